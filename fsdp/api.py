"""``fully_shard`` and ``FSDPModule``: the public surface of fsdp (names as in PyTorch).

Apply ``fully_shard`` bottom-up: each call makes one parameter group of the parameters under its
module(s) that no earlier call took, shards them as DTensors, and hooks the module(s)::

    >>> mesh = init_device_mesh("cpu", (4,))
    >>> for block in model.layers:
    ...     fully_shard(block, mesh=mesh)
    >>> fully_shard(model, mesh=mesh)       # the root: embeddings, final norm, output
    >>> opt = torch.optim.AdamW(model.parameters())   # DTensor Shard(0) parameters
    >>> model(tokens).sum().backward(); opt.step()
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import replace
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from dtensor_lite import DTensor, DeviceMesh, Shard, init_device_mesh
from dtensor_lite.placements import torch_placements_to_ours

from . import hooks
from .dp_mesh_dims import (DataParallelMeshDims, data_parallel_mesh, non_dp_mesh,
                           param_off_dp_dims)
from .optim_guard import mark_replaced
from .mesh_info import MeshInfo
from .param import FSDPParam
from .param_group import ParamGroup, ShardState
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .state import FSDPState, all_states

__all__ = ["fully_shard", "DataParallelMeshDims", "FSDPModule", "UnshardHandle",
           "GradientReductionHandle", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
           "register_fsdp_forward_method", "share_comm_ctx"]


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: Iterable[nn.Parameter] | None = None,
                dp_mesh_dims: DataParallelMeshDims | None = None):
    """Shard ``module``'s parameters over ``mesh`` and all-gather them around its forward and
    backward. Returns ``module``, whose class is now ``FSDP<Class>`` (also an ``FSDPModule``).

    * ``module``: a module, or a list of modules that share one parameter group (one all-gather
      and one reduce-scatter for all of them).
    * ``mesh``: 1-D (FSDP) or 2-D ``(replicate, shard)`` (HSDP). Default: all ranks, 1-D, on
      CUDA if available, else CPU.
    * ``reshard_after_forward``: ``True`` frees the unsharded parameters after forward and
      all-gathers them again in backward (ZeRO-3); ``False`` keeps them until the end of backward
      (ZeRO-2); an int ``N`` dividing the shard size keeps a 1/N piece after forward and
      all-gathers within groups of N ranks in backward. The root always keeps its parameters
      (backward starts right after its forward) unless set otherwise explicitly. ``None``
      (default, as torch's): ``True`` for non-root modules, the root keeping its parameters.
    * ``shard_placement_fn(param)``: ``Shard(d)`` to shard ``param`` on dim ``d``; ``None``: dim 0.
    * ``mp_policy``: :class:`MixedPrecisionPolicy`. ``offload_policy``: :class:`CPUOffloadPolicy`
      to keep sharded parameters and gradients on the CPU.
    * ``ignored_params``: parameters left alone (not sharded, not reduced).
    * ``dp_mesh_dims``: :class:`DataParallelMeshDims`; ``mesh`` is then the full mesh (e.g.
      ``("dp", "tp")``), every parameter a DTensor on it with ``Replicate()`` on the dims named
      there, and the sharded parameters are DTensors on it (docs/2d.md).

    DTensor parameters (after ``tp.parallelize_module`` on another dim of the same mesh) are
    sharded further: each becomes one DTensor over the data-parallel dims followed by the TP
    dims, and modules see TP DTensors during forward and backward (docs/2d.md).

    Example::

        >>> fully_shard(model.layers[0], mesh=mesh, reshard_after_forward=False)
        >>> fully_shard(model, mesh=init_device_mesh("cpu", (2, 2)))        # HSDP
        >>> fully_shard(tp_model, mesh=mesh["dp"])      # FSDP over TP on a ("dp", "tp") mesh
    """
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    _check_modules(modules)
    ignored = {id(p) for p in (ignored_params or ())}
    spmd_mesh, users = None, {}
    if dp_mesh_dims is not None:
        spmd_mesh, mesh = mesh, data_parallel_mesh(mesh, dp_mesh_dims)
        users = _params_off_dp_dims(modules, spmd_mesh, dp_mesh_dims, ignored)
    if mesh is None:
        mesh = _default_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a dtensor_lite DeviceMesh, got "
                        f"{type(mesh).__name__}")
    device = _mesh_device(mesh)
    info = MeshInfo(mesh, spmd_mesh)
    left_default = reshard_after_forward is None
    if reshard_after_forward is None:
        reshard_after_forward = True  # a root keeps its parameters whatever this says
    _check_reshard_after_forward(reshard_after_forward, info)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be an OffloadPolicy, got "
                        f"{offload_policy!r}")
    offload = isinstance(offload_policy, CPUOffloadPolicy)

    managed = _collect_params(modules, ignored)
    qualified = {id(p): f"'{name}' of {type(top).__name__}" for top in modules
                 for name, p in top.named_parameters(remove_duplicate=False)}
    tp_meshes = {p.device_mesh for p, _ in managed if isinstance(p, DTensor)}
    # plain parameters of a TP'd group join its TP mesh as Replicate (see FSDPParam)
    replicate_over = next(iter(tp_meshes)) if len(tp_meshes) == 1 else None
    # param_dtype_override_fn is asked once per parameter, now (as torch), with the parameter the
    # user's modules held -- before anything is sharded, so a refused answer changes nothing
    resolved = {id(param): mp_policy._resolve_for_param(users.get(id(param), param))
                for param, _ in managed}
    mp_policy = replace(mp_policy, param_dtype_override_fn=None)  # what groups and states keep
    fsdp_params = []
    for param, owners in managed:
        where = _where(owners)
        _check_param(param, where, mesh, device)
        dim = _shard_dim(param, where, shard_placement_fn)
        user_param = users.get(id(param), param)  # what the user's modules held
        fsdp_param = FSDPParam(param, owners, info, dim, device, offload,
                               getattr(offload_policy, "pin_memory", False),
                               replicate_over, original=user_param)
        fsdp_param.mp_policy = resolved[id(param)]
        fsdp_params.append(fsdp_param)
        mark_replaced(user_param, qualified.get(id(param), where))
    group = None
    if fsdp_params:
        group = ParamGroup(fsdp_params, modules, info, mp_policy, offload, device)
        group.reshard_after_forward = reshard_after_forward
        if group.post_forward_n():
            info.post_forward(reshard_after_forward)  # creates process groups: on every rank now
    state = FSDPState(modules, group, mp_policy)
    state.default_reshard_after_forward = left_default
    for m in modules:
        m._fsdp_state = state
        m.register_forward_pre_hook(functools.partial(hooks.pre_forward, state), prepend=True,
                                    with_kwargs=True)
        # always_call: a forward that raises still ends the use (else the next one is skipped)
        m.register_forward_hook(functools.partial(hooks.post_forward, state), always_call=True)
        # state dicts always see (and load into) the sharded DTensor parameters, even between a
        # forward and its backward, when the root still holds gathered ones
        m.register_state_dict_pre_hook(functools.partial(hooks.reshard_for_state_dict, state))
        m.register_load_state_dict_pre_hook(functools.partial(hooks.reshard_for_state_dict,
                                                              state))
        m.__class__ = _fsdp_class(type(m))
    return module


def _fsdp_state_of(module: nn.Module) -> FSDPState | None:
    """``fully_shard.state(module)`` (torch's): the state ``fully_shard`` attached to
    ``module``, or None where it was not applied. ``fully_shard.state(block) is not None``"""
    return module.__dict__.get("_fsdp_state")


fully_shard.state = _fsdp_state_of


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` run FSDP's pre-/post-forward hooks around it, as
    ``forward`` does: the parameters are all-gathered before the method runs and resharded after
    it (per ``reshard_after_forward``), and its outputs get the pre-backward hooks, so a
    backward through them is reduced like one through ``forward``. For methods that use the
    parameters without calling the module (``generate``, a second head)::

        >>> fully_shard(model, mesh=mesh)
        >>> register_fsdp_forward_method(model, "generate")
        >>> model.generate(prompt)

    The method may call the module itself (``self(x)``) or another registered method: those
    inner calls run inside the outer call's use and add no hooks of their own. As in PyTorch, a
    module that ``fully_shard`` was not applied to is left alone (no-op, so the same code runs
    with and without FSDP). A name that is not a method of ``module`` raises ``ValueError``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_fsdp_forward_method takes an nn.Module, got "
                        f"{type(module).__name__}")
    if not isinstance(module, FSDPModule):
        return  # as in PyTorch: lets one script register with and without fully_shard
    method = getattr(module, method_name, None)
    if not callable(method):
        what = "has no attribute" if method is None else "has a non-callable attribute"
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} {what} "
                         f"'{method_name}'; pass the name of one of its methods (e.g. "
                         "'generate')")
    setattr(module, method_name, hooks.wrap_forward_method(module, method))


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """PyTorch shares the communication streams of several FSDP roots (pipeline stages) with
    this. Ours are shared already: one set of side streams per device (``fsdp.streams``), used
    by every FSDP module on it, so this only checks its argument.
    ``share_comm_ctx([stage0, stage1])``"""
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"share_comm_ctx takes modules that fully_shard was applied to, got "
                             f"{type(m).__name__}")


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the all-gather."""

    def __init__(self, group: ParamGroup | None):
        self._group = group

    def wait(self):
        g = self._group
        if g is not None:
            g.wait_unshard()
        self._group = None


class GradientReductionHandle:
    """Returned by ``FSDPModule.finalize_backward(async_op=True)``: ``wait()`` finishes the
    gradient reductions still in flight (gradients are in ``.grad`` after it) and ends the
    backward iteration. Call it before reading gradients or the next forward.

    Example::

        >>> handle = model.finalize_backward(async_op=True)
        >>> other_work()
        >>> handle.wait(); opt.step()
    """

    def wait(self) -> None:
        """Wait for the gradient reduction. Raises ``RuntimeError`` if ``reset_iter_state``
        invalidated this handle. A second call does nothing."""
        return


class _GradientReductionHandleImpl(GradientReductionHandle):
    def __init__(self, ctx, token):
        self._ctx, self._token = ctx, token

    def wait(self) -> None:
        ctx, token = self._ctx, self._token
        if ctx is None:
            return
        if ctx.reduction_token is not token:
            raise RuntimeError("This gradient reduction handle was invalidated "
                               "(reset_iter_state ran after finalize_backward(async_op=True)); "
                               "its gradients were dropped")
        ctx.end_backward_iteration()
        ctx.reduction_token = None
        self._ctx = self._token = None


class FSDPModule:
    """Mixin of every module that ``fully_shard`` was applied to (``isinstance(m, FSDPModule)``)."""

    def __new__(cls, *args, **kwargs):
        # as torch's: building a new module of an FSDP class -- ``seq[1:]`` builds
        # ``self.__class__(...)`` -- gives the original class; the slice shares the submodules
        # (and their hooks) but is no FSDP module of its own
        orig = cls.__dict__.get("_fsdp_orig_cls")
        if orig is None:
            return super().__new__(cls)
        obj = object.__new__(orig) if orig.__new__ is object.__new__ else orig.__new__(
            orig, *args, **kwargs)
        obj.__init__(*args, **kwargs)
        return obj

    def __deepcopy__(self, memo):
        # a copy would share the process groups and hooks of the original's parameter group
        raise AssertionError(
            f"FSDP does not support deepcopy. Please use state dict for serialization: "
            f"{type(self).__name__} was sharded by fully_shard (deepcopy the model before "
            "fully_shard, or load a copy from get_model_state_dict)")

    def _get_fsdp_state(self) -> FSDPState:
        return self.__dict__["_fsdp_state"]

    def _fsdp_modules(self, recurse: bool):
        mods = self.modules() if recurse else [self]
        return [m for m in mods if isinstance(m, FSDPModule)]

    def _groups(self, recurse: bool):
        """The parameter groups of this module (and of the FSDP modules under it): what the
        ``set_*`` policies change (a module whose parameters all went to others has none)."""
        for m in self._fsdp_modules(recurse):
            if (g := m._get_fsdp_state().group) is not None:
                yield g

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (not recursive). With ``async_op`` return a
        handle; its ``wait()`` (or the module's next forward) finishes the all-gather.

        Example::

            >>> model.layers[1].unshard(async_op=True)   # overlap with layer 0's forward
        """
        group = self._get_fsdp_state().group
        if group is not None and group.state is not ShardState.UNSHARDED:
            group.start_unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters; its attributes are the sharded DTensor
        parameters again (not recursive). ``model.reshard()``"""
        group = self._get_fsdp_state().group
        if group is not None:
            group.reshard()

    def reset_iter_state(self) -> None:
        """After a forward or backward raised half-way: wait for FSDP's collectives in flight,
        reshard every group and clear the iteration's bookkeeping; gradients of the failed
        iteration not yet reduced into ``.grad`` are dropped (as are ``no_sync``-accumulated ones).
        The next root forward does this by itself when it finds such a state; call it to free
        the memory sooner. Call it on the root (the module whose forward runs first)::

            >>> try:
            ...     loss.backward()
            ... except RuntimeError:
            ...     model.reset_iter_state(); opt.zero_grad()
        """
        state = self._get_fsdp_state()
        if state.ctx is None:
            return  # never ran: nothing to reset
        if state.ctx.root is not state:
            raise RuntimeError(f"reset_iter_state: call it on the root FSDP module "
                               f"({type(state.ctx.root.modules[0]).__name__}), not on "
                               f"{type(self).__name__}")
        state.ctx.reset_iteration()

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """``True``: resharding keeps the unsharded parameters' storage instead of freeing it,
        so every all-gather refills the same memory (stable data pointers, e.g. for CUDA graph
        capture), at the cost of holding the unsharded parameters all the time. ``recurse``:
        also for the FSDP modules under this one. ``model.set_keep_unsharded_storage(True)``"""
        _require_bool("set_keep_unsharded_storage", keep)
        for g in self._groups(recurse):
            for p in g.params:
                p.keep_unsharded_storage = keep

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """``True``: backward no longer finishes FSDP's work at its end; the caller does, with
        :meth:`finalize_backward`, after all the backward passes of one step (this supersedes
        :meth:`set_is_last_backward`). Reductions of groups whose gradients are complete may
        still be issued during backward; the rest, and the wait for the last one, happen in
        ``finalize_backward``. Call it on the root, before the backward; the mode cannot change
        during a backward or between a backward and its finalization::

            >>> model.set_manual_backward_finalization(True)
            >>> model.set_requires_gradient_sync(False)
            >>> for mb in micro_batches:
            ...     loss_fn(model(mb)).backward()      # no communication
            >>> model.set_requires_gradient_sync(True)
            >>> model.finalize_backward()              # one reduce-scatter per group, here
        """
        _require_bool("set_manual_backward_finalization", enabled)
        state = self._get_fsdp_state()
        if state.is_root is False:
            raise RuntimeError(f"set_manual_backward_finalization must be called on the root "
                               f"FSDP module ({type(state.ctx.root.modules[0]).__name__}), not "
                               f"on {type(self).__name__}")
        ctx = state.ctx
        if ctx is not None and enabled != state.manual_backward_finalization and ctx.in_backward:
            raise RuntimeError("set_manual_backward_finalization cannot change mode during "
                               "backward")
        if ctx is not None and ctx.manual_active is not None and enabled != ctx.manual_active:
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode after backward starts; "
                "call it after finalize_backward() (or the last backward of the step)")
        state.manual_backward_finalization = enabled

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """Finish the backward of one step under manual finalization (see
        :meth:`set_manual_backward_finalization`): reduce the gradients still unreduced (those
        of ``set_requires_gradient_sync(False)`` backward passes too, if sync is back on), wait
        for the reductions (gradients in ``.grad``), reshard per ``reshard_after_backward``.
        Call it on the root after the step's last backward and before reading gradients. A
        no-op before the first forward.

        ``async_op=True``: return a :class:`GradientReductionHandle` without waiting for the
        last reduction; call its ``wait()`` before using the gradients or the next forward.

        Example::

            >>> loss.backward()
            >>> model.finalize_backward()
            >>> opt.step()
        """
        state = self._get_fsdp_state()
        ctx = state.ctx
        if ctx is None:  # never ran forward: nothing to finalize
            return _GradientReductionHandleImpl(None, None) if async_op else None
        _check_finalize(state, type(self).__name__)
        ctx.finalize_backward()
        if not async_op:
            ctx.end_backward_iteration()
            return None
        ctx.reduction_token = object()
        return _GradientReductionHandleImpl(ctx, ctx.reduction_token)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """``False``: backward accumulates unsharded gradients without communication (gradient
        accumulation; HSDP skips the all-reduce too); the next backward with ``True`` reduces the
        sum. ``model.set_requires_gradient_sync(False)``"""
        for g in self._groups(recurse):
            g.reduce_grads = bool(requires_gradient_sync)
            g.all_reduce_grads = bool(requires_gradient_sync)  # as torch: both switches

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True):
        """HSDP only (a 1-D mesh has no all-reduce: ignored there). ``False``: backward still
        reduce-scatters within each replica, but skips the all-reduce across replicas and keeps
        the partial sums (not in ``.grad``); the next backward with ``True`` adds them to its
        own and all-reduces once -- gradient accumulation that pays the reduce-scatter per
        micro-batch (its memory stays sharded) and the all-reduce once::

            >>> model.set_requires_all_reduce(False)     # micro-batches 1 .. n-1
            >>> model.set_requires_all_reduce(True)      # micro-batch n: .grad = the sum of all
        """
        for g in self._groups(recurse):
            g.all_reduce_grads = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, recurse: bool = True):
        """Change ``reshard_after_forward`` at run time (also on the root, whose default is to
        keep its parameters). ``model.set_reshard_after_forward(False)`` for evaluation."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward takes a bool, got "
                             f"{reshard_after_forward!r}")
        for m in self._fsdp_modules(recurse):
            state = m._get_fsdp_state()
            state.root_keeps_params = False
            if state.group is not None:
                state.group.reshard_after_forward = reshard_after_forward
                state.group.is_root = False

    def _keeps_default_reshard_after_forward(self) -> bool:
        """Whether ``reshard_after_forward`` was left to fully_shard's default. Pipeline
        schedules (``dtensor_lite.pipelining``) then keep the parameters through the step's
        micro-batches: one all-gather per step instead of two per micro-batch."""
        return self._get_fsdp_state().default_reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        """``False`` keeps parameters unsharded after backward, saving the next forward's
        all-gather during gradient accumulation (they are stale after an optimizer step: set it
        back to ``True`` for the last micro-batch)."""
        for g in self._groups(recurse):
            g.reshard_after_backward = bool(reshard_after_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: this module's parameters are not all-gathered in backward (not
        recursive, as in PyTorch) -- for a module whose backward does not read its parameters,
        such as an embedding (its weight gradient needs only the indices). Its gradients are
        still reduce-scattered. ``model.embed.set_unshard_in_backward(False)``

        A module whose backward does read them (a linear layer) finds their storage freed by
        the reshard after forward: its backward raises ``RuntimeError`` from the op that reads
        them ("setStorage: ... out of bounds for storage of size 0"; so does PyTorch's). Parameters that were not resharded after forward (the root,
        ``reshard_after_forward=False``) are still there and are used as they are."""
        _require_bool("set_unshard_in_backward", unshard_in_backward)
        for g in self._groups(recurse=False):
            g.unshard_in_backward = unshard_in_backward

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]):
        """All-gather ``modules`` right after this module's all-gather in forward (replaces the
        implicit prefetch of the next module).
        ``layers[i].set_modules_to_forward_prefetch([layers[i + 1]])``"""
        self._get_fsdp_state().forward_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]):
        """All-gather ``modules`` right after this module's all-gather in backward (replaces the
        implicit prefetch of the module that ran before it in forward)."""
        self._get_fsdp_state().backward_prefetch = [_state_of(m) for m in modules]

    def set_gradient_divide_factor(self, factor: float):
        """Divide this module's reduced gradients by ``factor`` instead of the data-parallel size
        (not recursive, as in PyTorch). ``model.set_gradient_divide_factor(1.0)`` sums."""
        for g in self._groups(recurse=False):
            g.divide_factor = float(factor)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None):
        """Call ``hook(reduced)`` on this module's reduced gradients before they are added into
        ``.grad`` (not recursive, as in PyTorch): ``reduced`` is the flat reduce-scatter output
        (1-D FSDP) or the all-reduce output (HSDP), already divided by the gradient divide
        factor -- the values PyTorch's hook sees with fp32/bf16 reduction -- and ``hook``
        changes it in place. The use: a data-parallel dimension FSDP does not reduce, e.g.
        replicas all-reduced by hand over a 1-D FSDP mesh::

            >>> group = mesh.get_group("replicate")
            >>> model.set_all_reduce_hook(lambda g: (dist.all_reduce(g, group=group),
            ...                                      g.div_(group.size())))

        Called once per gradient dtype of the group, per reduction. ``stream`` (CUDA, 1-D only,
        as in PyTorch): run the hook there instead of on FSDP's reduce-scatter stream."""
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook takes a callable hook(tensor), got "
                            f"{type(hook).__name__}")
        if (g := self._get_fsdp_state().group) is None:
            return
        if stream is not None and g.mesh_info.replicate_dim is not None:
            raise ValueError("set_all_reduce_hook: stream cannot be set when using HSDP (a 2-D "
                             "mesh): the hook runs after FSDP's own all-reduce, on its stream; "
                             "leave stream=None")
        g.all_reduce_hook = hook
        g.all_reduce_hook_stream = stream

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True):
        """PyTorch: ``True`` reduce-scatters zeros for parameters that got no gradient in this
        backward, so ranks whose control flow used different parameters (mixture of experts)
        still issue matching collectives. Ours always do: every trainable parameter of a group
        has its segment in the reduce-scatter (zeros without a gradient), so this only records
        the setting. (With ``False`` PyTorch leaves ``.grad`` ``None`` for a parameter that no
        rank used; ours writes zeros.)"""
        _require_bool("set_reduce_scatter_unused_params", reduce_scatter_unused_params)
        for g in self._groups(recurse):
            g.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_divide_factor(self, factor: float):
        """Deprecated in PyTorch (``DeprecationWarning``, as there): use
        :meth:`set_gradient_divide_factor`, which this calls."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning,
                      stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool):
        """PyTorch: make the collectives reduce with ``SUM`` only and scale separately (NCCL's
        zero-copy transfers need it). Ours always do: every reduce-scatter and all-reduce sums
        and the gradient is divided afterwards, so this only records the setting (not
        recursive, as in PyTorch). ``model.set_force_sum_reduction_for_comms(True)``"""
        _require_bool("set_force_sum_reduction_for_comms", enable)
        for g in self._groups(recurse=False):
            g.force_sum_reduction_for_comms = enable

    def set_post_optim_event(self, event: torch.Event):
        """An event recorded after the optimizer step: the next root forward's first all-gather
        waits for it instead of for everything queued on the compute stream, so unrelated work
        queued after the step does not delay it (CUDA; on CPU there is nothing to wait for).
        Used once: record and set a new one every iteration::

            >>> opt.step(); event = torch.cuda.current_stream().record_event()
            >>> model.set_post_optim_event(event)
        """
        if not isinstance(event, (torch.Event, torch.cuda.Event)):
            raise TypeError(f"set_post_optim_event takes a torch.Event (or torch.cuda.Event) "
                            f"recorded after the optimizer step, got {type(event).__name__}")
        self._get_fsdp_state().post_optim_event = event

    def set_is_last_backward(self, is_last_backward: bool):
        """``False``: the coming backward is not the last before the optimizer step, so its last
        reduce-scatter may stay in flight (finished by the next backward)."""
        state = self._get_fsdp_state()
        if state.ctx is None:
            state.init_as_root()
        state.ctx.is_last_backward = bool(is_last_backward)


# ===================================================================== helpers
def _check_finalize(state: FSDPState, name: str) -> None:
    """finalize_backward's preconditions, as torch's (same on every rank: settings only)."""
    ctx = state.ctx
    if ctx.reduction_token is not None:
        raise RuntimeError("The previous gradient reduction must be waited on before finalizing "
                           "backward again: call wait() on the handle of "
                           "finalize_backward(async_op=True)")
    if ctx.root is not state:
        raise RuntimeError(f"finalize_backward must be called on the root FSDP module "
                           f"({type(ctx.root.modules[0]).__name__}), not on {name}")
    manual = ctx.manual_active if ctx.manual_active is not None \
        else state.manual_backward_finalization
    if not manual:
        raise RuntimeError("FSDP finalize_backward requires manual backward finalization. Call "
                           "set_manual_backward_finalization(True) before forward")
    if ctx.in_backward:
        raise RuntimeError("FSDP finalize_backward must be called after backward completes")
    for g in ctx.groups:
        if g.partial_reduce:
            raise RuntimeError(
                f"FSDP manual backward finalization does not support partial gradient reductions "
                f"(set_requires_all_reduce(False) kept HSDP sums for {g.name}); use automatic "
                "backward finalization for this configuration")
        if g.post_backward_pending and g.reduce_grads and not g.all_reduce_grads and \
                g.mesh_info.replicate_dim is not None:
            raise RuntimeError(f"FSDP manual backward finalization requires all-reduce for "
                               f"{g.name}. Call set_requires_all_reduce(True) before "
                               "finalization")


def _require_bool(method: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{method} takes a bool, got {value!r}")


_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if issubclass(cls, FSDPModule):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"_fsdp_orig_cls": cls})
    return _CLASSES[cls]


def _state_of(module) -> FSDPState:
    if not isinstance(module, FSDPModule):
        raise TypeError(f"prefetch targets must be modules that fully_shard was applied to, got "
                        f"{type(module).__name__}")
    return module._get_fsdp_state()


def _check_modules(modules):
    if not modules:
        raise ValueError("fully_shard got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard takes nn.Module(s), got {type(m).__name__}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            # torch's rule: its hooks run around forward, and a container has none
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: "
                f"{type(m).__name__}; shard each of its modules (fully_shard(block) for block "
                "in blocks), or pass them as one list: fully_shard(list(blocks))")
        if isinstance(m, FSDPModule) or "_fsdp_state" in m.__dict__:
            raise RuntimeError(
                f"fully_shard was already applied to this {type(m).__name__}; apply it once per "
                "module (bottom-up: blocks first, then the root)")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard got the same module twice in its list")


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed: call init_process_group first "
                           "(or pass mesh=)")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    if mesh.device_type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"fully_shard: the mesh {mesh} is a 'cuda' mesh but CUDA is not "
                             "available here; build a 'cpu' mesh (init_device_mesh('cpu', ...))")
        return torch.device("cuda", torch.cuda.current_device())
    if mesh.device_type == "meta":
        # a mesh of meta devices (the dry run, dtensor_lite.plan): every buffer is shapes only
        return torch.device("meta")
    raise ValueError(f"fully_shard supports 'cpu', 'cuda' and 'meta' meshes, got a "
                     f"'{mesh.device_type}' mesh {mesh}")


def _check_reshard_after_forward(value, info: MeshInfo):
    if isinstance(value, bool):
        return
    if not isinstance(value, int) or not 1 <= value <= info.shard_size or \
            info.shard_size % value:
        raise ValueError(
            f"reshard_after_forward must be True, False or an int N dividing the shard size "
            f"{info.shard_size} (N ranks keep the parameters between forward and backward); got "
            f"{value!r}")


def _is_fsdp_root(module, top) -> bool:
    return module is not top and (isinstance(module, FSDPModule)
                                  or "_fsdp_state" in module.__dict__)


def _params_off_dp_dims(modules, mesh, dims, ignored: set[int]) -> dict:
    """``dp_mesh_dims``' front end: put each parameter (a DTensor on the full ``mesh``) on the
    dims that are not data parallel, for the sliced-mesh path. Returns ``{id(new): the user's
    parameter}``, so the optimizer guard and the tied-weight check know the user's one."""
    rest = non_dp_mesh(mesh, dims)
    users = {}
    for param, owners in _collect_params(modules, ignored):
        new = param_off_dp_dims(param, _where(owners), mesh, dims, rest)
        users[id(new)] = param
        for owner, name in owners:
            owner._parameters[name] = new
    return users


def _collect_params(modules, ignored: set[int]):
    """``[(param, [(module, name), ...])]`` of every parameter under ``modules`` that no earlier
    ``fully_shard`` call manages, in registration order; a shared parameter appears once."""
    owners: dict[int, tuple[nn.Parameter, list]] = {}
    visited: set[int] = set()
    in_group = {id(m) for m in modules}

    def visit(m, top):
        if id(m) in visited or (m is not top and (id(m) in in_group or _is_fsdp_root(m, top))):
            return
        visited.add(id(m))
        for name, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            owners.setdefault(id(p), (p, []))[1].append((m, name))
        for child in m._modules.values():
            if child is not None:
                visit(child, top)

    for top in modules:
        visit(top, top)
    result = list(owners.values())
    _check_not_managed(result)
    return result


def _check_not_managed(params):
    managed = {}
    for st in all_states():
        if st.group is not None:
            for p in st.group.params:
                managed[id(p.sharded)] = st
                original = p.original()
                if original is not None:
                    managed[id(original)] = st
    for param, owners in params:
        st = managed.get(id(param))
        if st is not None:
            raise ValueError(
                f"parameter {_where(owners)} is already managed by fully_shard("
                f"{type(st.modules[0]).__name__}): a parameter can belong to one group only. "
                "Shard the modules that share it in one call (fully_shard([a, b])) or leave it to "
                "their common parent, and apply fully_shard bottom-up")


def _where(owners) -> str:
    module, name = owners[0]
    return f"'{name}' of {type(module).__name__}"


def _check_param(param, where, mesh, device):
    if isinstance(param, DTensor):
        _check_tp_param(param, where, mesh)
    if param.ndim == 0:
        raise ValueError(f"parameter {where} is 0-d and cannot be sharded; pass it in "
                         "ignored_params")
    kind = param.device.type
    if kind not in ("meta", device.type) and not (kind == "cpu" and device.type != "cpu"):
        raise ValueError(f"parameter {where} is on {param.device} but the mesh is a "
                         f"'{mesh.device_type}' mesh; move the module to the mesh's device type "
                         "(or build the mesh for the parameters' device) before fully_shard")


def _check_tp_param(param, where, mesh):
    """A DTensor parameter (tensor parallelism) must live on other dims of the same mesh."""
    tp_mesh = param.device_mesh
    try:
        mesh.join(tp_mesh)
    except ValueError as e:
        raise ValueError(
            f"parameter {where} is a DTensor on {tp_mesh!r} and fully_shard got {mesh!r}; FSDP on "
            f"top of tensor parallelism needs both sliced from one mesh over disjoint dims, e.g. "
            f"fully_shard(model, mesh=mesh['dp']) after parallelize_module(model, mesh['tp'], "
            f"plan) ({e})") from None
    if any(p.is_partial() for p in param.placements):
        raise ValueError(f"parameter {where} is a DTensor with placements "
                         f"{list(param.placements)}; a parameter cannot be Partial: redistribute "
                         "it to Shard or Replicate before fully_shard")


def _shard_dim(param, where, fn) -> int:
    placement = fn(param) if fn is not None else None
    if placement is None:
        return 0
    placement = torch_placements_to_ours(placement)  # torch's Shard(d) is taken by value
    if type(placement) is not Shard:
        raise TypeError(f"shard_placement_fn must return Shard(dim) or None, got {placement!r} "
                        f"for parameter {where}")
    dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.ndim:
        raise ValueError(f"shard_placement_fn returned {placement!r} for the {param.ndim}-D "
                         f"parameter {where}")
    return dim
