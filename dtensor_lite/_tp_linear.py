"""Shortcuts for tensor-parallel styles: a linear and the move at its boundary as one autograd node.

A sequence-parallel column-parallel Linear (``ColwiseParallel(input_layouts=Shard(1))``) runs, on
the general path, as three autograd nodes: the input hook's ``redistribute`` (all-gather of the
sequence), the linear (``_local_linear``), the output hook's ``to_local``; the row-parallel one
(``RowwiseParallel(output_layouts=Shard(1))``) as ``from_local``, the linear and the output hook's
``redistribute`` (reduce-scatter). Each node costs an autograd Function forward and backward, a
DTensor wrapper each way and the hook's conversions. Here each Linear is one node, calling the
very functions those nodes call (``_redistributed``, ``forward_local`` / ``backward_local``,
``local_grad_of``, ``_redistribute_grad_target``) in the same order, so values, placements,
gradients and collectives equal the general path's (tests/test_tp_fused.py).

``tp`` asks for them through ``_shortcuts.first(GATHER_COLUMN | ROW_REDUCE, ...)``; each declines
(``NOT_TAKEN``) wherever the general path could differ: grad mode off, a dispatch mode, a trace, a
debug mode watching collectives, a linear that ``_local_linear`` would not take, a local input
``from_local`` would treat otherwise (another device, not contiguous, a piece of the wrong shape).
"""
from __future__ import annotations

import torch

from . import _caches, debug_state
from . import _torch_names as torch_names
from ._local_linear import backward_local, forward_local, plan_of
from ._shortcuts import NOT_TAKEN, shortcut
from ._unseen import unseen_fn
from .compile_support import is_traced
from .dtensor import DTensor, _redistribute_grad_target, _redistributed, local_grad_of
from .placements import Replicate
from .redistribute import redistribute_target
from .redistribute.planner import _PLANS
from .spec import DTensorSpec, TensorMeta, contiguous_stride

__all__ = ["GATHER_COLUMN", "ROW_REDUCE"]

GATHER_COLUMN = "tp: redistribute to Replicate, column-parallel linear"
ROW_REDUCE = "tp: from_local, row-parallel linear, redistribute"

_grad_enabled = torch.is_grad_enabled
_dispatch_modes = torch_names.len_torch_dispatch_stack
_REPLICATE = (Replicate(),)
# (spec, mesh id, placements) -> the spec the hook's redistribute aims at; (mesh id, local shape,
# dtype, placement, global shape) -> the spec from_local gives a contiguous local piece
_TARGETS: dict = _caches.register_decisions({})
_FROM_LOCAL: dict = _caches.register_decisions({})


def _watched() -> bool:
    """A debug mode or trace that sees the general path's collectives and nodes one by one."""
    return bool(debug_state.COMM_SINKS or debug_state.TIMERS or debug_state.CHECKING or
                debug_state.EXPLICIT or _dispatch_modes())


def _target(spec: DTensorSpec, mesh, placements) -> DTensorSpec:
    key = (spec, id(mesh), placements)
    dst = _TARGETS.get(key)
    if dst is None:
        dst = _caches.remember(_TARGETS, key, redistribute_target(spec, mesh, placements), _PLANS)
    return dst


@shortcut(GATHER_COLUMN)
def gather_column(x, weight, bias, mesh, use_local: bool):
    """``linear(x.redistribute(mesh, [Replicate()]), weight, bias)``, then ``to_local()`` with
    ``use_local``, for a column-parallel linear; or NOT_TAKEN."""
    if not (_grad_enabled() and type(x) is DTensor and type(weight) is DTensor and
            (bias is None or type(bias) is DTensor)) or x._spec.mesh is not mesh or \
            x._spec.placements == _REPLICATE or _watched():  # (Replicate: the hook moves nothing)
        return NOT_TAKEN
    rspec = _target(x._spec, mesh, _REPLICATE)
    plan = plan_of(rspec, weight._spec, None if bias is None else bias._spec)
    if plan is None or not plan.out_spec.placements[0].is_shard() or \
            is_traced(x._local_tensor) or is_traced(weight._local_tensor):
        return NOT_TAKEN
    return _GatherColumn.apply(x, weight, bias, rspec, plan, use_local)


@shortcut(ROW_REDUCE)
def row_reduce(x, weight, bias, mesh, layout, shape, desired):
    """``linear(DTensor.from_local(x, mesh, [layout], shape=shape), weight, bias)`` redistributed
    to ``[desired]`` (a DTensor) for a row-parallel linear of a local input; or NOT_TAKEN."""
    if not (_grad_enabled() and type(x) is torch.Tensor and type(weight) is DTensor and
            (bias is None or type(bias) is DTensor)) or weight._spec.mesh is not mesh or \
            mesh._coordinate is None or mesh.size() < 2 or _watched() or \
            x.device.type != mesh.device_type or not x.is_contiguous() or is_traced(x):
        return NOT_TAKEN
    xspec = _from_local_spec(x, mesh, layout, shape)
    if xspec is None:
        return NOT_TAKEN
    plan = plan_of(xspec, weight._spec, None if bias is None else bias._spec)
    if plan is None or is_traced(weight._local_tensor):
        return NOT_TAKEN
    dst = None if plan.out_spec.placements == (desired,) else \
        _target(plan.out_spec, mesh, (desired,))
    return _RowReduce.apply(x, weight, bias, xspec, plan, dst)


def _from_local_spec(x, mesh, layout, shape):
    """The spec ``from_local`` gives the contiguous piece ``x`` (None where its shape is not that
    spec's piece on this rank: from_local raises, the general path shows it)."""
    key = (id(mesh), x.shape, x.dtype, layout, shape)
    spec = _FROM_LOCAL.get(key)
    if spec is None:
        size = torch.Size(shape)
        spec = DTensorSpec(mesh, (layout,), TensorMeta(size, contiguous_stride(size), x.dtype))
        if spec.local_shape() != tuple(x.shape):
            return None
        spec = _caches.remember(_FROM_LOCAL, key, spec, _PLANS)
    return spec


class _GatherColumn(torch.autograd.Function):
    @staticmethod
    @unseen_fn
    def forward(ctx, x, w, b, rspec, plan, use_local):
        ctx.src, ctx.plan, ctx.has_bias, ctx.use_local = x._spec, plan, b is not None, use_local
        with debug_state.outermost_cause("redistribute"):
            xr = _redistributed(x, rspec, False)  # the input hook's redistribute
        out = forward_local(ctx, xr._local_tensor, w, b, plan)
        return out if use_local else DTensor(out, plan.out_spec)

    @staticmethod
    @unseen_fn
    def backward(ctx, grad):
        plan = ctx.plan
        if ctx.use_local:  # to_local's backward wraps the piece; from_local's reads it back
            grad = DTensor(grad, _with_dtype(plan.out_spec, grad.dtype))
        with debug_state.outermost_cause("from_local.backward"):
            gx, gw, gb = backward_local(ctx, local_grad_of(grad, plan.out_spec))
        if gx is not None:  # the input hook's redistribute, transposed
            with debug_state.outermost_cause("redistribute.backward"):
                gx = _redistributed(gx, _redistribute_grad_target(ctx.src, gx._spec), False)
        return gx, gw, gb, None, None, None


class _RowReduce(torch.autograd.Function):
    @staticmethod
    @unseen_fn
    def forward(ctx, x, w, b, xspec, plan, dst):
        ctx.xspec, ctx.plan, ctx.has_bias, ctx.dst = xspec, plan, b is not None, dst
        out = DTensor(forward_local(ctx, x, w, b, plan), plan.out_spec)
        if dst is None:
            return out
        with debug_state.outermost_cause("redistribute"):
            return _redistributed(out, dst, False)  # the output hook's redistribute

    @staticmethod
    @unseen_fn
    def backward(ctx, grad):
        plan = ctx.plan
        if ctx.dst is not None:  # the output hook's redistribute, transposed
            with debug_state.outermost_cause("redistribute.backward"):
                grad = _redistributed(grad, _redistribute_grad_target(plan.out_spec, grad._spec),
                                      False)
        with debug_state.outermost_cause("from_local.backward"):
            gx, gw, gb = backward_local(ctx, local_grad_of(grad, plan.out_spec))
            if gx is not None:  # from_local's backward: the piece of x's layout
                gx = local_grad_of(gx, ctx.xspec)
        return gx, gw, gb, None, None, None


def _with_dtype(spec: DTensorSpec, dtype) -> DTensorSpec:
    if spec.dtype == dtype:
        return spec
    return DTensorSpec(spec.mesh, spec.placements, spec.tensor_meta._replace(dtype=dtype),
                       spec.shard_order)
