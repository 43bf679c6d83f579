"""Reductions: reducing over a sharded dim leaves a Partial that the next redistribute resolves.

sum over a sharded dim -> Partial(sum); mean -> local sum / global count, Partial(sum); amax/amin
-> Partial(max/min) with empty shards filled by the reduction's identity.
"""
from __future__ import annotations

import math

import torch

from ..placements import Partial, Replicate, Shard
from ._registry import FullStrategy, register_rule

aten = torch.ops.aten


def _reduced_dims(dim, ndim):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = (dim,)
    return tuple(sorted(d % max(ndim, 1) for d in dim))


def reduction_strategy(call, dims, keepdim, partial_op: str, linear_ok=("sum", "avg"),
                       local_fn=None, sharded_local_fn=None):
    """Keep the input as it is; sharded reduced dims give ``Partial(partial_op)``.

    Partial inputs whose op is not in ``linear_ok`` are replicated first. ``sharded_local_fn``
    replaces the op when some reduced dim is sharded (e.g. mean's global-count division)."""
    spec = call.inputs[0]
    ins, outs = [], []
    any_sharded = False
    for p in spec.placements:
        if p.is_shard():
            if p.dim in dims:
                any_sharded = True
                ins.append(p)
                outs.append(Partial(partial_op))
            else:
                shift = 0 if keepdim else sum(1 for d in dims if d < p.dim)
                ins.append(p)
                outs.append(Shard(p.dim - shift))
        elif p.is_partial():
            if p.reduce_op in linear_ok:
                ins.append(p)
                outs.append(p)
            else:
                ins.append(Replicate())
                outs.append(Replicate())
        else:
            ins.append(p)
            outs.append(p)
    fn = sharded_local_fn if (any_sharded and sharded_local_fn is not None) else local_fn
    return FullStrategy(outs=[tuple(outs)], ins=[tuple(ins)] + [None] * (len(call.inputs) - 1),
                        local_fn=fn)


def _sum_args(call):
    args = call.args
    if call.op in (aten.sum.default, aten.mean.default):
        return None, False
    dim = args[1] if len(args) > 1 else call.kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else call.kwargs.get("keepdim", False)
    return dim, keepdim


@register_rule(aten.sum.default, aten.sum.dim_IntList)
def _sum(call):
    dim, keepdim = _sum_args(call)
    return reduction_strategy(call, _reduced_dims(dim, call.inputs[0].ndim), keepdim, "sum")


@register_rule(aten.mean.default, aten.mean.dim)
def _mean(call):
    spec = call.inputs[0]
    dim, keepdim = _sum_args(call)
    dims = _reduced_dims(dim, spec.ndim)
    count = math.prod(spec.shape[d] for d in dims)
    dtype = call.kwargs.get("dtype")

    def sharded_mean(x, *args, **kwargs):
        # mean over a sharded dim = (local sum) / (global count), summed over ranks
        s = aten.sum.dim_IntList(x, list(dims), keepdim, dtype=dtype)
        return s / count

    return reduction_strategy(call, dims, keepdim, "sum", sharded_local_fn=sharded_mean)
