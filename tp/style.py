"""Parallel styles: how one module's parameters and activations are laid out over the TP mesh.

A style does two things to the module it is applied to:

* **parameters** become ``nn.Parameter``\\ s wrapping DTensors, distributed from the module's
  current (identical on every rank) full values with ``distribute_tensor``, so the sharded module
  computes exactly what the unsharded one did;
* **activations** are converted at the module boundary by forward hooks: a local input tensor is
  declared to have ``input_layouts`` (``DTensor.from_local``) and redistributed to what the module
  needs; the output is redistributed to ``output_layouts`` and, with ``use_local_output``, turned
  back into a local tensor. The hooks are differentiable, so backward is the exact transpose.

All layouts are single placements because tensor parallelism runs on a 1-D mesh.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from dtensor_lite import DeviceMesh, DTensor, Placement, Replicate, Shard, distribute_tensor
from dtensor_lite.placements import as_placement

from dtensor_lite._tp_linear import GATHER_COLUMN, ROW_REDUCE
from dtensor_lite._tp_norm import SEQUENCE_NORM

from . import _fused
from ._layouts import _normalized, convert, local_piece, one_layout, tagged_piece

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleOutput"]


class ParallelStyle:
    """Base class of the styles: ``_apply(module, mesh)`` parallelizes ``module`` in place.

    ``src_data_rank`` (set by ``parallelize_module``) is the rank whose full weights are scattered
    (``None``: every rank slices its own copy, with no communication).

    Example (a custom style)::

        >>> class Replicated(ParallelStyle):
        ...     def _apply(self, module, mesh):
        ...         distribute_params(self, module, mesh, {})   # everything Replicate
        ...         return module
    """

    src_data_rank: int | None = 0

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        raise NotImplementedError

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def distribute_params(style: ParallelStyle, module: nn.Module, mesh: DeviceMesh,
                      placements: dict[str, Placement]) -> None:
    """Turn every parameter of ``module`` (and its children) into a DTensor parameter.

    ``placements`` maps a direct parameter name (``"weight"``) to its placement; every other
    parameter is replicated. A parameter that already is a DTensor means the module was
    parallelized before, which is an error (two styles would fight over its layout).
    """
    for sub_name, sub in module.named_modules():
        for name, param in list(sub._parameters.items()):
            if param is None:
                continue
            if isinstance(param, DTensor):
                where = f"{sub_name}.{name}" if sub_name else name
                raise ValueError(
                    f"{type(style).__name__}: parameter {where!r} of {type(module).__name__} is "
                    f"already a DTensor (placements {list(param.placements)}); a module can be "
                    "parallelized once -- remove the duplicate plan entry")
            layout = placements.get(name, Replicate()) if sub is module else Replicate()
            dt = distribute_tensor(param.detach(), mesh, [layout], src_data_rank=style.src_data_rank)
            sub.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def _expect_module(style: ParallelStyle, module: nn.Module, types: tuple, instead: str):
    if not isinstance(module, types):
        names = " and ".join(t.__name__ for t in types)
        raise ValueError(f"{type(style).__name__} supports {names} modules, not "
                         f"{type(module).__name__}; {instead}")


def _first_input_hook(fn):
    """A forward pre-hook that replaces the first positional input by ``fn(module, input)``."""
    def hook(module, inputs):
        if not inputs:
            raise ValueError(f"{type(module).__name__} was called without a positional input; "
                             "tensor-parallel styles lay out the first positional argument")
        return (fn(module, inputs[0]), *inputs[1:])
    return hook


_OTHER_MODULES = ("write a custom ParallelStyle, or shard its parameters with distribute_tensor "
                  "and its activations with PrepareModuleInput/PrepareModuleOutput")


class ColwiseParallel(ParallelStyle):
    """Shard an ``nn.Linear`` / ``nn.Embedding`` on its output features ("column-wise").

    Linear: ``weight`` and ``bias`` ``Shard(0)``; Embedding: ``weight`` ``Shard(1)``. The input
    (declared ``input_layouts``, default ``Replicate()``) is made ``Replicate`` first; the output
    comes out ``Shard(-1)`` and is redistributed to ``output_layouts`` (default ``Shard(-1)``: no
    communication). With ``use_local_output`` (default) the module returns local tensors.
    Uneven output features (e.g. 7 on 2 ranks) are fine.

    Example::

        >>> parallelize_module(nn.Linear(16, 32), mesh, ColwiseParallel())
        >>> # each rank returns its 32 / n output features of the full result
    """

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True):
        self.input_layouts = one_layout(input_layouts, "ColwiseParallel input_layouts") or Replicate()
        self.output_layouts = one_layout(output_layouts, "ColwiseParallel output_layouts") or Shard(-1)
        self.desired_input_layouts = Replicate()
        self.use_local_output = use_local_output

    def _apply(self, module, device_mesh):
        _expect_module(self, module, (nn.Linear, nn.Embedding), _OTHER_MODULES)
        weight_layout = Shard(0) if isinstance(module, nn.Linear) else Shard(1)
        distribute_params(self, module, device_mesh, {"weight": weight_layout, "bias": Shard(0)})
        who = f"ColwiseParallel({type(module).__name__})"

        def prepare_input(mod, x):
            return convert(x, device_mesh, self.input_layouts, self.desired_input_layouts,
                           use_local=False, who=who)

        produced = Shard(-1)  # made here, not per call: torch.compile wants constants made before
        if isinstance(module, nn.Linear):
            prepare_input = _column_fusion(self, module, device_mesh, prepare_input)
        module.register_forward_pre_hook(_first_input_hook(prepare_input))
        module.register_forward_hook(
            lambda mod, inputs, out: out if _fused.passed_through(mod, out) else
            convert(out, device_mesh, produced, self.output_layouts, self.use_local_output,
                    who=who))
        return module


def _column_fusion(style, module, mesh, prepare_input):
    """The input hook of a column-parallel Linear, which leaves a sharded DTensor input to the
    all-gather + linear shortcut where that is the whole story (tp/_fused.py)."""
    def args_of(mod, x):
        last = Shard(x.ndim - 1)
        if style.use_local_output:
            return (x, mod.weight, mod.bias, mesh, True), lambda out: tagged_piece(
                out, mesh, last, (*x.shape[:-1], mod.out_features))
        return (x, mod.weight, mod.bias, mesh, False), _same

    def hook(mod, x):
        if type(x) is DTensor and _fused.eligible(mod) and \
                _normalized(style.output_layouts, x.ndim) == Shard(x.ndim - 1):
            _fused.note(mod, x)
            return x
        return prepare_input(mod, x)

    _fused.install(module, GATHER_COLUMN, args_of, prepare_input)
    return hook


def _same(out):
    return out


class RowwiseParallel(ParallelStyle):
    """Shard an ``nn.Linear`` on its input features, or an ``nn.Embedding`` on its vocabulary.

    Linear: ``weight`` ``Shard(1)``, ``bias`` ``Replicate``; the input (declared
    ``input_layouts``, default ``Shard(-1)``) is made ``Shard(-1)``. Embedding (vocab-parallel):
    ``weight`` ``Shard(0)``; the ids (default ``Replicate()``) stay replicated and each rank looks
    up the ids in its row range. Either way the result is ``Partial`` (a sum over ranks) and is
    reduced to ``output_layouts`` (default ``Replicate()``: an all-reduce; ``Shard(1)``: a
    reduce-scatter onto the sequence dim, as sequence parallelism wants).

    A local input declared ``Shard(-1)`` needs no evenness assumption here: its global last dim is
    ``in_features``. Uneven rows (vocab 7 on 2 ranks) are fine.

    Example::

        >>> parallelize_module(nn.Linear(32, 16), mesh, RowwiseParallel())
        >>> # input: each rank's 32 / n features; output: the full result on every rank
    """

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True):
        self.input_layouts = one_layout(input_layouts, "RowwiseParallel input_layouts")
        self.output_layouts = one_layout(output_layouts, "RowwiseParallel output_layouts") or Replicate()
        self.use_local_output = use_local_output

    def _apply(self, module, device_mesh):
        _expect_module(self, module, (nn.Linear, nn.Embedding), _OTHER_MODULES)
        linear = isinstance(module, nn.Linear)
        # the defaults depend on the module: features for a Linear, token ids for an Embedding
        input_layout = self.input_layouts or (Shard(-1) if linear else Replicate())
        desired = Shard(-1) if linear else Replicate()
        distribute_params(self, module, device_mesh,
                          {"weight": Shard(1) if linear else Shard(0), "bias": Replicate()})
        who = f"RowwiseParallel({type(module).__name__})"

        def input_shape(mod, x):
            if linear and isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and \
                    input_layout.is_shard() and input_layout.dim in (-1, x.ndim - 1):
                return (*x.shape[:-1], mod.in_features)  # exact, even for uneven pieces
            return None

        def prepare_input(mod, x, shape=None):
            if shape is None:
                shape = input_shape(mod, x)
            return convert(x, device_mesh, input_layout, desired, use_local=False, shape=shape,
                           who=who)

        if linear:
            prepare_input = _row_fusion(self, module, device_mesh, input_shape, prepare_input)
        module.register_forward_pre_hook(_first_input_hook(prepare_input))
        produced = Replicate()  # (a DTensor output keeps its own placements; see convert)
        module.register_forward_hook(
            lambda mod, inputs, out: out if _fused.passed_through(mod, out) else
            convert(out, device_mesh, produced, self.output_layouts, self.use_local_output,
                    who=who))
        return module


def _row_fusion(style, module, mesh, input_shape, prepare_input):
    """The input hook of a row-parallel Linear, which leaves a local input to the linear +
    reduction shortcut where that is the whole story (tp/_fused.py)."""
    def args_of(mod, x, shape):
        want = _normalized(style.output_layouts, x.ndim)
        args = (x, mod.weight, mod.bias, mesh, Shard(x.ndim - 1), shape, want)
        return args, local_piece if style.use_local_output else _same

    def hook(mod, x):
        if type(x) is torch.Tensor and _fused.eligible(mod):
            shape = input_shape(mod, x)
            if shape is not None:
                _fused.note(mod, x, shape)
                return x
        return prepare_input(mod, x)

    _fused.install(module, ROW_REDUCE, args_of, prepare_input)
    return hook


class SequenceParallel(ParallelStyle):
    """Run a per-position module (norms, dropout) on activations sharded on the sequence dim.

    Parameters are replicated. A local input is declared ``Shard(sequence_dim)``: the ranks
    exchange their pieces' lengths to learn the global one, so any length works (13 positions on
    2 ranks: pieces 7 and 6); a DTensor input needs no exchange and is redistributed to that
    layout if needed. The output is a ``Shard(sequence_dim)`` DTensor (a local tensor with
    ``use_local_output=True``). The parameters' gradients come out ``Partial`` (each rank saw
    only its positions) and are summed when read, e.g. by the optimizer or ``full_tensor()``.

    The module must treat positions independently (LayerNorm, RMSNorm, Dropout, activations); a
    module that mixes positions would silently see only this rank's slice.

    Example::

        >>> parallelize_module(nn.LayerNorm(16), mesh, SequenceParallel())
        >>> y = norm(x_local)       # x_local: [batch, seq / n, 16]; y: a Shard(1) DTensor
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def _apply(self, module, device_mesh):
        distribute_params(self, module, device_mesh, {})
        layout = Shard(self.sequence_dim)
        who = f"SequenceParallel({type(module).__name__})"

        def prepare_input(mod, x):
            return convert(x, device_mesh, layout, layout, use_local=False, who=who)

        if isinstance(module, nn.LayerNorm):
            prepare_input = _norm_fusion(self, module, device_mesh, prepare_input)
        module.register_forward_pre_hook(_first_input_hook(prepare_input))
        if self.use_local_output:
            module.register_forward_hook(
                lambda mod, inputs, out: local_piece(out) if isinstance(out, DTensor) else out)
        return module


def _norm_fusion(style, module, mesh, prepare_input):
    """The input hook of a sequence-parallel LayerNorm, which leaves a DTensor already laid out
    as the style wants to the one-node layer_norm shortcut (tp/_fused.py)."""
    def args_of(mod, x):
        return (x, mod.normalized_shape, mod.weight, mod.bias, mod.eps), _same

    def hook(mod, x):
        if type(x) is DTensor and \
                _fused.eligible(mod, _layer_norm_forward, 1 if style.use_local_output else 0) and \
                x.device_mesh is mesh and \
                x.placements == (_normalized(Shard(style.sequence_dim), x.ndim),):
            _fused.note(mod, x)
            return x  # what prepare_input returns for it too
        return prepare_input(mod, x)

    _fused.install(module, SEQUENCE_NORM, args_of, prepare_input, _layer_norm_forward,
                   output_hook=False)
    return hook


_layer_norm_forward = nn.LayerNorm.forward


def _layout_tuple(layouts, what: str):
    if layouts is None:
        return None
    if not isinstance(layouts, (tuple, list)):
        layouts = (layouts,)
    out = []
    for layout in layouts:
        try:  # torch's own placements are taken by value
            out.append(None if layout is None else as_placement(layout, what))
        except TypeError:
            raise ValueError(f"{what} entries must be placements or None, got {layout!r}") from None
    return tuple(out)


def _layout_dict(layouts, what: str) -> dict:
    """One placement (or None) per keyword; torch's own placements are taken by value."""
    return {name: one_layout(layout, f"{what}[{name!r}]")
            for name, layout in (layouts or {}).items()}


def _check_pairs(layouts, desired, what: str):
    if (layouts is None) != (desired is None) or (layouts is not None and len(layouts) != len(desired)):
        raise ValueError(f"{what}: the layouts and desired layouts must be given together, one "
                         f"per tensor (got {layouts!r} and {desired!r})")
    for have, want in zip(layouts or (), desired or ()):
        if have is not None and want is None:
            raise ValueError(f"{what}: a tensor with layout {have} needs a desired layout")


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs to the layouts its body expects (no parameters touched).

    ``input_layouts`` / ``desired_input_layouts`` have one entry per positional input (``None``:
    pass that argument through untouched, e.g. non-tensor or plain replicated side inputs); the
    ``*_kwarg_layouts`` dicts do the same for keyword arguments. Local tensors are declared their
    layout (a Shard piece's global size learnt from the ranks' pieces), then redistributed.
    ``use_local_output=False`` (default) hands the module DTensors.

    Example (sequence parallelism: gather the sequence before attention; cos/sin untouched)::

        >>> PrepareModuleInput(input_layouts=(Shard(1), None, None),
        ...                    desired_input_layouts=(Replicate(), None, None))
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts: dict | None = None,
                 desired_input_kwarg_layouts: dict | None = None, use_local_output: bool = False):
        self.input_layouts = _layout_tuple(input_layouts, "PrepareModuleInput input_layouts")
        self.desired_input_layouts = _layout_tuple(desired_input_layouts,
                                                   "PrepareModuleInput desired_input_layouts")
        _check_pairs(self.input_layouts, self.desired_input_layouts, "PrepareModuleInput")
        self.input_kwarg_layouts = _layout_dict(input_kwarg_layouts,
                                                "PrepareModuleInput input_kwarg_layouts")
        self.desired_input_kwarg_layouts = _layout_dict(
            desired_input_kwarg_layouts, "PrepareModuleInput desired_input_kwarg_layouts")
        keys = list(self.input_kwarg_layouts)
        _check_pairs(tuple(self.input_kwarg_layouts.values()),
                     tuple(self.desired_input_kwarg_layouts.get(k) for k in keys),
                     "PrepareModuleInput kwargs")
        self.use_local_output = use_local_output

    def _apply(self, module, device_mesh):
        who = f"PrepareModuleInput({type(module).__name__})"

        def hook(mod, args, kwargs):
            if self.input_layouts is not None:
                if len(args) != len(self.input_layouts):
                    raise ValueError(
                        f"{who}: the module got {len(args)} positional inputs but input_layouts "
                        f"has {len(self.input_layouts)} entries; give one per input (None to pass "
                        "one through)")
                args = tuple(convert(a, device_mesh, have, want, self.use_local_output, who=who)
                             for a, have, want in zip(args, self.input_layouts,
                                                      self.desired_input_layouts))
            kwargs = {k: convert(v, device_mesh, self.input_kwarg_layouts.get(k),
                                 self.desired_input_kwarg_layouts.get(k), self.use_local_output,
                                 who=who) for k, v in kwargs.items()}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's output(s) to new layouts (no parameters touched).

    One ``output_layouts`` / ``desired_output_layouts`` entry per output tensor (a tuple output:
    one per element, ``None`` to pass one through). Local outputs are declared their layout
    (a Shard piece's global size learnt from the ranks' pieces). ``use_local_output=True``
    (default) returns local tensors.

    Example (a block that ends sequence-sharded hands on a replicated result)::

        >>> PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
    """

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output: bool = True):
        self.output_layouts = _layout_tuple(output_layouts, "PrepareModuleOutput output_layouts")
        self.desired_output_layouts = _layout_tuple(desired_output_layouts,
                                                    "PrepareModuleOutput desired_output_layouts")
        if self.output_layouts is None:
            raise ValueError("PrepareModuleOutput needs output_layouts and desired_output_layouts")
        _check_pairs(self.output_layouts, self.desired_output_layouts, "PrepareModuleOutput")
        self.use_local_output = use_local_output

    def _apply(self, module, device_mesh):
        who = f"PrepareModuleOutput({type(module).__name__})"

        def hook(mod, inputs, out):
            single = not isinstance(out, (tuple, list))
            outs = (out,) if single else out
            if len(outs) != len(self.output_layouts):
                raise ValueError(f"{who}: the module returned {len(outs)} outputs but "
                                 f"output_layouts has {len(self.output_layouts)} entries")
            res = [convert(o, device_mesh, have, want, self.use_local_output, who=who)
                   for o, have, want in zip(outs, self.output_layouts, self.desired_output_layouts)]
            return res[0] if single else type(out)(res)

        module.register_forward_hook(hook)
        return module


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module: its inputs are
    converted before the forward (``use_local_input=True`` hands the body local tensors), its
    outputs after (``use_local_output``, default True). The arguments mean what they mean there.

    Example (a mixture-of-experts layer on a sequence-sharded stream: every rank routes the whole
    sequence locally, its experts' outputs are partial sums, scattered back along the sequence)::

        >>> PrepareModuleInputOutput(
        ...     input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
        ...     use_local_input=True,
        ...     output_layouts=(Partial(),), desired_output_layouts=(Shard(1),))
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts: dict | None = None,
                 desired_input_kwarg_layouts: dict | None = None, use_local_input: bool = False,
                 output_layouts, desired_output_layouts, use_local_output: bool = True):
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def _apply(self, module, device_mesh):
        self.prepare_module_input._apply(module, device_mesh)
        return self.prepare_module_output._apply(module, device_mesh)
