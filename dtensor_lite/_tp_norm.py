"""Shortcut for tensor-parallel styles: a LayerNorm on a sequence-sharded DTensor as one node.

``SequenceParallel`` runs a LayerNorm on a ``Shard(d)`` DTensor (``d`` a row dim) with replicated
weight and bias. On the general path that is ``native_layer_norm`` through the dispatcher forward
and ``native_layer_norm_backward`` through it in backward (its rule: input gradient ``Shard(d)``,
weight and bias gradients ``Partial``), each a dispatch with its wrappers. Here it is one autograd
node running the same two aten kernels on the local pieces with the same arguments, its results
wrapped with the specs the rule gives them (tests/test_tp_fused.py). A gradient arriving in
another layout than the output's takes the dispatcher's ``native_layer_norm_backward`` on the
saved pieces, as the general path would.

``tp`` asks for it through ``_shortcuts.first(SEQUENCE_NORM, ...)``; it declines under the same
conditions as ``_tp_linear``'s shortcuts, and for inputs that are not contiguous, not sharded on a
row dim, or whose weight / bias are not replicated on the same mesh with the same dtype.
"""
from __future__ import annotations

import torch

from . import _caches
from . import _torch_names as torch_names
from ._local_linear import bindings_see_plain
from ._shortcuts import NOT_TAKEN, shortcut
from ._tp_linear import _watched
from ._unseen import unseen_fn
from .compile_support import is_traced
from .dtensor import DTensor
from .placements import Partial, Replicate
from .redistribute.planner import _PLANS
from .spec import DTensorSpec, TensorMeta, contiguous_stride

__all__ = ["SEQUENCE_NORM"]

SEQUENCE_NORM = "tp: layer_norm of a sequence-sharded DTensor"

aten = torch_names.aten
_grad_enabled = torch.is_grad_enabled
_REPLICATE = (Replicate(),)
_PARTIAL = (Partial(),)
# (x spec, weight spec, bias spec, normalized shape) -> (weight grad spec, bias grad spec), or
# None where the shortcut does not apply
_PLANS_BY_SPECS: dict = _caches.register_decisions({})
_NO = object()
_native_layer_norm = torch.native_layer_norm


@shortcut(SEQUENCE_NORM)
def sequence_layer_norm(x, normalized_shape, weight, bias, eps):
    """``F.layer_norm(x, normalized_shape, weight, bias, eps)`` for a row-sharded DTensor ``x``."""
    if not (_grad_enabled() and type(x) is DTensor and (weight is None or type(weight) is DTensor)
            and (bias is None or type(bias) is DTensor)) or _watched():
        return NOT_TAKEN
    key = (x._spec, None if weight is None else weight._spec, None if bias is None else bias._spec,
           tuple(normalized_shape))
    plan = _PLANS_BY_SPECS.get(key)
    if plan is None:
        plan = _caches.remember(_PLANS_BY_SPECS, key, _plan(*key) or _NO, _PLANS)
    if plan is _NO or not x._local_tensor.is_contiguous() or is_traced(x._local_tensor):
        return NOT_TAKEN
    return _SequenceLayerNorm.apply(x, weight, bias, key[3], eps, plan)


def _plan(x, w, b, shape):
    mesh = x.mesh
    rows = x.ndim - len(shape)
    p = x.placements[0]
    if mesh.ndim != 1 or mesh._coordinate is None or not p.is_shard() or p.dim >= rows or \
            rows < 0 or tuple(x.shape[rows:]) != shape or not x.dtype.is_floating_point or \
            x.tensor_meta.stride != contiguous_stride(x.shape) or not x.has_default_order:
        return None
    grads = []
    for s in (w, b):
        if s is None:
            grads.append(None)
            continue
        if s.mesh is not mesh or s.placements != _REPLICATE or s.dtype != x.dtype or \
                tuple(s.shape) != shape or s.tensor_meta.stride != contiguous_stride(s.shape):
            return None
        grads.append(s.with_placements(_PARTIAL))
    return tuple(grads)


class _SequenceLayerNorm(torch.autograd.Function):
    @staticmethod
    @unseen_fn
    def forward(ctx, x, w, b, shape, eps, plan):
        xl = x._local_tensor
        wl = None if w is None else w._local_tensor
        bl = None if b is None else b._local_tensor
        # torch's binding reaches the same kernel at a lower call cost (see _local_linear)
        out, mean, rstd = (_native_layer_norm if bindings_see_plain(xl, wl, bl) else
                           aten.native_layer_norm.default)(xl, shape, wl, bl, eps)
        ctx.save_for_backward(xl, mean, rstd, wl, bl)
        ctx.spec, ctx.shape, ctx.plan, ctx.w, ctx.b = x._spec, shape, plan, w, b
        return DTensor(out, x._spec)

    @staticmethod
    @unseen_fn
    def backward(ctx, grad):
        xl, mean, rstd, wl, bl = ctx.saved_tensors
        need = ctx.needs_input_grad
        mask = [need[0], need[1], need[2]]
        if type(grad) is DTensor and grad._spec is ctx.spec:  # the layout the output has
            gx, gw, gb = aten.native_layer_norm_backward.default(
                grad._local_tensor, xl, ctx.shape, mean, rstd, wl, bl, mask)
            gx = None if gx is None else DTensor(gx, ctx.spec)
            gw = None if gw is None else DTensor(gw, ctx.plan[0])
            gb = None if gb is None else DTensor(gb, ctx.plan[1])
        else:  # the dispatcher decides, as on the general path
            x = DTensor(xl, ctx.spec)
            gx, gw, gb = aten.native_layer_norm_backward.default(
                grad, x, ctx.shape, _stat(mean, ctx.spec, len(ctx.shape)),
                _stat(rstd, ctx.spec, len(ctx.shape)), ctx.w, ctx.b,
                mask)
        return gx, gw, gb, None, None, None


def _stat(local, x_spec, normalized: int):
    """A saved per-row statistic (mean or rstd: the row dims, then 1s) as the DTensor the general
    path held."""
    rows = x_spec.ndim - normalized
    shape = torch.Size(tuple(x_spec.shape[:rows]) + tuple(local.shape[rows:]))
    return DTensor(local, DTensorSpec(x_spec.mesh, x_spec.placements,
                                      TensorMeta(shape, contiguous_stride(shape), local.dtype)))
