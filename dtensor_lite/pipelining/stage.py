"""``PipelineStage``: one piece of the model on one pp rank, and what it keeps per micro-batch.

The stage runs its module's forward and backward for one micro-batch at a time and moves what
crosses its boundaries (``_transfer``); the schedule decides the order. It keeps, per micro-batch
in flight, the inputs (fresh leaves that collect the input gradients) and the outputs (or, on the
last stage, the loss) until the backward has run.

fsdp under a schedule: a stage module (or modules under it) sharded with ``fully_shard`` is used
``n_microbatches`` times per step. The stage drives fsdp's own switches (duck-typed: dtensor_lite
does not import fsdp): during the step no gradient sync and no reshard after backward, so every
micro-batch's unsharded gradients add up locally; right before the stage's last backward of the
step, both back on, so that backward reduce-scatters the sum once and reshards. A module whose
``reshard_after_forward`` was left to fully_shard's default also keeps its parameters after
forward: one all-gather per step (not one per micro-batch), for the memory of the unsharded
parameters held through the step. ``reshard_after_forward=True`` given explicitly is honoured
(all-gathers per micro-batch, forward and backward; the memory of one layer at a time).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import collectives
from ..device_mesh import DeviceMesh
from ._backward import SplitBackward
from ._orders import stage_rank
from ._transfer import (ACTIVATION, META_BYTES, META_SIZE, TensorMeta, local_piece,
                        message_tag, meta_of, rebuild, recv_object, send_object)

__all__ = ["PipelineStage"]


def _pp_mesh(group, device: torch.device) -> DeviceMesh:
    """The pipeline's 1-D mesh: ``group`` itself (a slice such as ``mesh["pp"]``), or a mesh over
    the process group (default: every rank)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"PipelineStage: group must be a 1-D mesh (the pp dim, e.g. "
                             f"mesh['pp']), got {group!r}")
        return group
    if group is None:
        group = dist.group.WORLD
    return DeviceMesh.from_group(group, device.type)


def _cached_mesh_lookup(get_mesh):
    if not callable(get_mesh):
        raise TypeError(f"PipelineStage: get_mesh must be callable (mesh_dim_names, mesh_layout) "
                        f"-> DeviceMesh, got {type(get_mesh).__name__}")
    cache: dict = {}

    def lookup(names, layout):
        if names not in cache:
            cache[names] = get_mesh(names, layout)
        return cache[names]
    return lookup


def _as_tuple(value, what: str) -> tuple:
    values = value if isinstance(value, (tuple, list)) else (value,)
    for v in values:
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"PipelineStage: {what} must be a tensor or a tuple of tensors, got "
                            f"{type(v).__name__}")
    return tuple(values)


def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return t.requires_grad_(requires_grad and (t.is_floating_point() or t.is_complex()))


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``, running ``submodule`` on this rank (torch's
    signature). ``group``: the pipeline's ranks -- best a 1-D slice of your mesh,
    ``mesh["pp"]``, which lets DTensor activations cross stages; a ProcessGroup (default: all
    ranks) carries plain tensors only. ``input_args`` / ``output_args``: example tensors (or
    tuples) of this stage's inputs / outputs for one micro-batch; optional -- shapes are agreed
    at the first step anyway -- but when given, a neighbour that sends something else is an
    error naming both. ``output_grads`` / ``input_grads`` (torch's, examples of the gradients)
    are accepted and not needed: gradient shapes are agreed at the first step too. ``get_mesh``
    (torch 2.15's ``GetMeshCallback``, ``(mesh_dim_names, mesh_layout) -> DeviceMesh``): for a
    stage built on a ProcessGroup (torchtitan's ``pipeline_llm``), how a DTensor received by
    dim names finds its mesh; we ask it with ``mesh_layout=None``, once per names.
    Stage ``s`` must be built on pp rank ``s % pp_size``.

    Example::

        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
        >>> pp = mesh["pp"].get_local_rank()
        >>> stage = PipelineStage(stage_modules[pp], pp, 2, torch.device("cpu"), group=mesh["pp"])
        >>> ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn).step(x, target=y)
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device,
                 input_args=None, output_args=None, output_grads=None, input_grads=None,
                 group=None, dw_builder=None, get_mesh=None):
        if not isinstance(submodule, nn.Module):
            raise TypeError(f"PipelineStage: submodule must be an nn.Module, got "
                            f"{type(submodule).__name__}")
        if not (isinstance(num_stages, int) and num_stages >= 1):
            raise ValueError(f"PipelineStage: num_stages must be a positive int, got "
                             f"{num_stages!r}")
        if not (isinstance(stage_index, int) and 0 <= stage_index < num_stages):
            raise ValueError(f"PipelineStage: stage_index {stage_index!r} is not in "
                             f"[0, {num_stages})")
        if dw_builder is not None:
            raise NotImplementedError("PipelineStage: dw_builder is not supported; the "
                                      "zero-bubble schedules split the backward themselves")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.pp_mesh = _pp_mesh(group, self.device)
        # torch 2.15's GetMeshCallback (mesh dim names, layout) -> DeviceMesh: how a stage built
        # on a ProcessGroup (torchtitan's pipeline_llm) finds the mesh of a DTensor it receives;
        # asked with layout None (our meshes are found by their names), once per names
        self._get_mesh = _cached_mesh_lookup(get_mesh) if get_mesh is not None else None
        self.group_size = self.pp_mesh.size(0)
        self.group_rank = self.pp_mesh.get_local_rank(0)
        if num_stages % self.group_size:
            raise ValueError(f"PipelineStage: {num_stages} stages do not divide over the "
                             f"{self.group_size} pp ranks; use a multiple of {self.group_size}")
        p, r = self.group_size, self.group_rank
        v_shaped = num_stages == 2 * p and stage_rank(stage_index, p, "v") == r
        if stage_index % p != r and not v_shaped:
            raise ValueError(f"PipelineStage: stage {stage_index} belongs on pp rank "
                             f"{stage_index % p} (stage s on rank s % {p}; or, for "
                             f"ScheduleZBVZeroBubble's V shape, on rank "
                             f"{stage_rank(stage_index, p, 'v')}), not on pp rank {r}")
        # which rank holds which stage: "loop" (s % p) or "v"; the schedule sets it
        self.shape = "loop" if stage_index % p == r else "v"
        self._declared_in = self._declare(input_args, "input_args")
        self._declared_out = self._declare(output_args, "output_args")
        # agreed at the first step: what this stage receives / sends, and their gradients
        self.in_meta: list[TensorMeta] | None = None
        self.out_meta: list[TensorMeta] | None = None
        self.grad_in_meta: list[TensorMeta | None] | None = None    # gradients of our outputs
        self.grad_out_meta: list[TensorMeta | None] | None = None   # gradients of our inputs
        self._fwd: dict[int, tuple] = {}        # mb -> (inputs, outputs or (loss,))
        self._split: dict[int, SplitBackward] = {}

    def _declare(self, args, what):
        if args is None:
            return None
        return [meta_of(t, self.pp_mesh, what, self._get_mesh) for t in _as_tuple(args, what)]

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def rank_of(self, stage: int) -> int:
        return stage_rank(stage, self.group_size, self.shape)

    def __repr__(self):
        return (f"PipelineStage({self.stage_index}/{self.num_stages}, pp rank "
                f"{self.group_rank}, {type(self.submod).__name__})")

    # ------------------------------------------------------------------ moving tensors
    def _tag(self, kind, stage, mb, index):
        return message_tag(kind, stage, mb, index, self.num_stages)

    def _send(self, kind: int, tensors: list, to_stage: int, mb: int, mailbox: dict) -> list:
        """Send ``tensors`` (None entries are not sent) to stage ``to_stage``; the pending sends."""
        dst = self.rank_of(to_stage)
        if dst == self.group_rank:   # the neighbour runs here (one pp rank): hand it over
            mailbox[(kind, to_stage, mb)] = [
                None if t is None else _leaf(t.detach(), t.requires_grad) for t in tensors]
            return []
        agreed = self.out_meta if kind == ACTIVATION else self.grad_out_meta
        what = "output" if kind == ACTIVATION else "input gradient"
        metas = [None if t is None else meta_of(t, self.pp_mesh, f"stage {self.stage_index}'s "
                                                f"{what} {i}", self._get_mesh) for i, t in enumerate(tensors)]
        pending = []
        if agreed is None and self.dry:
            agreed = metas    # a dry run: nobody receives the shapes (see ``dry``)
            if kind == ACTIVATION:
                self.out_meta = metas
            else:
                self.grad_out_meta = metas
        elif agreed is None:
            if kind == ACTIVATION and self._declared_out is not None:
                self._check(metas, self._declared_out, "its output_args")
            pending += send_object(metas, self.pp_mesh, dst,
                                   self._tag(META_SIZE, self.stage_index, 0, kind),
                                   self._tag(META_BYTES, self.stage_index, 0, kind), self.device)
            agreed = metas
            if kind == ACTIVATION:
                self.out_meta = metas
            else:
                self.grad_out_meta = metas
        else:
            self._check(metas, agreed, f"what it sent at the first micro-batch (micro-batch {mb})")
        for i, t in enumerate(tensors):
            if t is not None:
                pending.append(collectives.send(local_piece(t).detach(), self.pp_mesh, 0, dst,
                                                tag=self._tag(kind, self.stage_index, mb, i),
                                                async_op=True))
        return pending

    def _check(self, metas, agreed, against: str):
        def shown(ms):
            return "(" + ", ".join("None" if m is None else str(m) for m in ms) + ")"
        same = len(metas) == len(agreed) and all(
            (a is None) == (b is None) and (a is None or (a.shape, a.dtype, a.placements,
                                                          a.global_shape, a.mesh_dims)
                                            == (b.shape, b.dtype, b.placements, b.global_shape,
                                                b.mesh_dims))
            for a, b in zip(metas, agreed))
        if not same:
            raise ValueError(f"pipelining: stage {self.stage_index} has {shown(metas)} but "
                             f"{against} says {shown(agreed)}; every micro-batch must pass the "
                             "same shapes, dtypes and placements between stages")

    def _recv(self, kind: int, from_stage: int, mb: int, mailbox: dict) -> list:
        src = self.rank_of(from_stage)
        if src == self.group_rank:
            return mailbox.pop((kind, self.stage_index, mb))
        agreed = self.in_meta if kind == ACTIVATION else self.grad_in_meta
        if agreed is None and self.dry:
            agreed = self._dry_meta(kind, from_stage)
        elif agreed is None:
            agreed = recv_object(self.pp_mesh, src, self._tag(META_SIZE, from_stage, 0, kind),
                                 self._tag(META_BYTES, from_stage, 0, kind), self.device)
            if kind == ACTIVATION:
                if self._declared_in is not None:
                    self._check_declared(agreed, from_stage)
                self.in_meta = agreed
            else:
                self.grad_in_meta = agreed
        out = []
        for i, meta in enumerate(agreed):
            if meta is None:
                out.append(None)
                continue
            piece = collectives.recv(meta.shape, meta.dtype, self.pp_mesh, 0, src,
                                     device=self.device, tag=self._tag(kind, from_stage, mb, i))
            # activations arrive as fresh leaves that collect their gradients
            out.append(_leaf(rebuild(piece, meta, self.pp_mesh, self._get_mesh),
                             kind == ACTIVATION and meta.requires_grad))
        return out

    @property
    def dry(self) -> bool:
        """On a ``"meta"`` mesh (``dtensor_lite.plan``'s dry run over a fake world) no message
        carries data, so the shapes are not received: an activation is what ``input_args``
        declares, a gradient is shaped like this stage's own output."""
        return self.pp_mesh.device_type == "meta"

    def _dry_meta(self, kind, from_stage):
        if kind == ACTIVATION:
            if self._declared_in is None:
                raise ValueError(f"pipelining: the dry run (a meta mesh) needs stage "
                                 f"{self.stage_index}'s input_args: what stage {from_stage} "
                                 "sends it for one micro-batch (e.g. a meta tensor)")
            self.in_meta = self._declared_in
        else:
            self.grad_in_meta = [None if m is None else dataclasses.replace(m, requires_grad=False)
                                 for m in self.out_meta]
        return self.in_meta if kind == ACTIVATION else self.grad_in_meta

    def _check_declared(self, received, from_stage):
        try:
            self._check(received, self._declared_in, "this stage's input_args")
        except ValueError:
            shown = ", ".join(map(str, received))
            declared = ", ".join(map(str, self._declared_in))
            raise ValueError(f"pipelining: stage {from_stage} sends ({shown}) but stage "
                             f"{self.stage_index}'s input_args say ({declared}); the stages' "
                             "shapes do not match: fix the split of the model or the "
                             "input_args") from None

    # ------------------------------------------------------------------ compute
    def forward_one(self, mb: int, args: tuple, kwargs: dict, has_backward: bool):
        with torch.set_grad_enabled(has_backward):
            output = self.submod(*args, **kwargs)
        outputs = _as_tuple(output, f"stage {self.stage_index}'s output")
        if has_backward:
            self._fwd[mb] = (args, outputs)
        return output, outputs

    def keep_loss(self, mb: int, loss: torch.Tensor):
        args, _ = self._fwd[mb]
        self._fwd[mb] = (args, (loss,))

    def backward_one(self, mb: int, output_grads: list | None, split: bool) -> list:
        """The backward of micro-batch ``mb`` (with ``split``: its input half only); returns the
        gradients of the stage's inputs, one per input (None where none)."""
        args, outputs = self._fwd.pop(mb)
        if output_grads is None:         # the last stage: ``outputs`` is (loss,)
            pairs = [(outputs[0], None)]
        else:
            pairs = [(o, g) for o, g in zip(outputs, output_grads)
                     if g is not None and o.requires_grad]
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if split:
            sb = SplitBackward([o for o, _ in pairs], [g for _, g in pairs], inputs)
            with self._one_backward_only():
                grads = iter(sb.input_grads())
            self._split[mb] = sb
            return [next(grads) if isinstance(a, torch.Tensor) and a.requires_grad else None
                    for a in args] if inputs else [None] * len(args)
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return [a.grad if isinstance(a, torch.Tensor) and a.requires_grad else None for a in args]

    def backward_weight_one(self, mb: int):
        with self._one_backward_only():
            self._split.pop(mb).weight_grads()

    @contextlib.contextmanager
    def _one_backward_only(self):
        """torch's selective checkpointing refuses a second backward through a region, which
        the split backward is: say so in the schedule's terms."""
        try:
            yield
        except RuntimeError as e:
            if "selective activation checkpoint" not in str(e):
                raise
            raise RuntimeError(
                f"pipelining: stage {self.stage_index}'s backward runs in two passes under a "
                "zero-bubble schedule (input gradients, then weight gradients), and selective "
                "activation checkpointing allows one backward per region; use full "
                "checkpointing (or none) with this schedule, or a schedule without the split "
                "(1F1B, interleaved 1F1B)") from e

    # ------------------------------------------------------------------ fsdp and scaling
    def _fsdp_modules(self) -> list:
        return [m for m in self.submod.modules()
                if callable(getattr(m, "set_requires_gradient_sync", None))
                and callable(getattr(m, "set_reshard_after_backward", None))]

    def begin_step(self, has_backward: bool):
        self._fwd.clear()
        self._split.clear()
        for m in self._fsdp_modules():
            if getattr(m, "_keeps_default_reshard_after_forward", lambda: False)():
                m.set_reshard_after_forward(False, recurse=False)
            if has_backward:
                m.set_requires_gradient_sync(False, recurse=False)
                m.set_reshard_after_backward(False, recurse=False)

    def before_last_backward(self):
        """The stage's last backward of the step is next: it reduces the summed gradients."""
        for m in self._fsdp_modules():
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)

    def scale_grads(self, grad_scale_factor: int):
        """Divide every parameter's gradient by ``grad_scale_factor`` (torch's name)."""
        if grad_scale_factor == 1:
            return
        with torch.no_grad():
            for p in self.submod.parameters():
                if p.grad is not None:
                    p.grad.div_(grad_scale_factor)
