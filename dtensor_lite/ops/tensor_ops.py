"""Constructors that follow an input (``*_like``), fills, copies and item()."""
from __future__ import annotations

import torch

from ..placements import Replicate, Shard
from ._registry import FullStrategy, register_rule

aten = torch.ops.aten


@register_rule(aten.ones_like, aten.zeros_like, aten.empty_like, aten.full_like)
def _like(call):
    # a fresh tensor shaped like the input: shards stay shards, Partial becomes Replicate
    spec = call.inputs[0]
    outs = tuple(p if not p.is_partial() else Replicate() for p in spec.placements)
    return FullStrategy(outs=[outs], ins=[None], out_orders=[spec.shard_order])


@register_rule(aten.fill_.Scalar, aten.zero_.default)
def _fill_(call):
    spec = call.inputs[0]
    if any(p.is_partial() for p in spec.placements):
        raise RuntimeError(f"{call.op} on a Partial DTensor would set every rank's partial value; "
                           "redistribute it to Replicate or Shard first")
    return FullStrategy(outs=[spec.placements], ins=[None], out_orders=[spec.shard_order])


@register_rule(aten._local_scalar_dense.default)
def _item(call):
    spec = call.inputs[0]
    return FullStrategy(outs=[None], ins=[(Replicate(),) * spec.mesh.ndim])


@register_rule(aten.copy_.default)
def _copy_(call):
    # dst keeps its placements; src is brought to them
    dst, src = call.inputs[0], call.inputs[1] if len(call.inputs) > 1 else None
    if src is None:
        return FullStrategy(outs=[dst.placements], ins=[None], out_orders=[dst.shard_order])
    if src.ndim != dst.ndim or src.shape != dst.shape:
        want = tuple(Replicate() if p.is_shard() else p for p in dst.placements)
        if want != dst.placements:
            raise RuntimeError(f"copy_ with broadcasting into a sharded DTensor {dst} is not "
                               "supported; expand the source first")
    return FullStrategy(outs=[dst.placements], ins=[None, dst.placements],
                        out_orders=[dst.shard_order], in_orders=[None, dst.shard_order])
