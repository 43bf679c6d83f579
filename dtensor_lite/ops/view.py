"""Shape ops: permutations move shards with their dims; reshapes keep a shard whenever every
rank's piece stays one contiguous block of the new dim, and replicate that mesh dim otherwise
(uneven shards included: the answer is checked piece by piece, never assumed)."""
from __future__ import annotations

import itertools
import math

import torch

from ..placements import Replicate, Shard
from ..spec import DTensorSpec, TensorMeta
from ._registry import FullStrategy, register_rule

aten = torch.ops.aten


def _permuted(spec, perm):
    """Placements after output dim k takes input dim perm[k]."""
    inv = {src: dst for dst, src in enumerate(perm)}
    outs = tuple(Shard(inv[p.dim]) if p.is_shard() else p for p in spec.placements)
    order = [()] * len(perm)
    for d, o in enumerate(spec.shard_order):
        order[inv[d]] = o
    return FullStrategy(outs=[outs], ins=[None], out_orders=[tuple(order)])


@register_rule(aten.t.default)
def _t(call):
    spec = call.inputs[0]
    return _permuted(spec, [1, 0] if spec.ndim == 2 else list(range(spec.ndim)))


@register_rule(aten.transpose.int)
def _transpose(call):
    spec = call.inputs[0]
    ndim = spec.ndim
    d0, d1 = call.args[1] % max(ndim, 1), call.args[2] % max(ndim, 1)
    perm = list(range(ndim))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permuted(spec, perm)


@register_rule(aten.permute.default)
def _permute(call):
    spec = call.inputs[0]
    return _permuted(spec, [d % max(spec.ndim, 1) for d in call.args[1]])


@register_rule(aten.expand.default)
def _expand(call):
    spec = call.inputs[0]
    meta = _meta(spec)
    out_shape = tuple(aten.expand.default(meta, call.args[1]).shape)
    lead = len(out_shape) - spec.ndim
    ins, outs = [], []
    for p in spec.placements:
        if p.is_shard() and spec.shape[p.dim] != out_shape[p.dim + lead]:
            ins.append(Replicate())  # a size-1 dim being broadcast cannot stay sharded
            outs.append(Replicate())
        else:
            ins.append(p)
            outs.append(Shard(p.dim + lead) if p.is_shard() else p)
    return _with_local_shape(call, spec, tuple(ins), tuple(outs), out_shape, aten.expand.default)


def _meta(spec):
    return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")


def _view_groups(old, new):
    """Pair up runs of old and new dims with equal products (size-1 dims ride along)."""
    groups, i, j = [], 0, 0
    while i < len(old) and j < len(new):
        og, ng, po, pn = [i], [j], old[i], new[j]
        i, j = i + 1, j + 1
        while po != pn:
            if po < pn:
                og.append(i)
                po *= old[i]
                i += 1
            else:
                ng.append(j)
                pn *= new[j]
                j += 1
        groups.append((og, ng))
    groups += [([k], []) for k in range(i, len(old))] + [([], [k]) for k in range(j, len(new))]
    return groups


def _reshape_strategy(call, out_shape, local_op):
    spec = call.inputs[0]
    old = tuple(spec.shape)
    ins = list(spec.placements)
    outs = list(spec.placements)
    if math.prod(old) == 0:
        ins = outs = [Replicate() if p.is_shard() else p for p in spec.placements]
    else:
        target = {}
        for og, ng in _view_groups(old, out_shape):
            real_old = [d for d in og if old[d] != 1]
            real_new = [d for d in ng if out_shape[d] != 1]
            if real_old and real_new:
                target[real_old[0]] = real_new[0]  # only the outermost dim of a run can stay sharded
        for i, p in enumerate(spec.placements):
            if p.is_shard():
                if p.dim in target:
                    outs[i] = Shard(target[p.dim])
                else:
                    ins[i] = outs[i] = Replicate()
        # keep a shard only where every rank's piece maps onto the piece the new spec assigns it
        while True:
            bad = _misaligned_mesh_dims(spec, tuple(ins), tuple(outs), old, out_shape)
            if not bad:
                break
            for i in bad:
                ins[i] = outs[i] = Replicate()
    return _with_local_shape(call, spec, tuple(ins), tuple(outs), out_shape, local_op)


def _misaligned_mesh_dims(spec, ins, outs, old, new):
    if all(not p.is_shard() for p in ins):
        return []
    mesh = spec.mesh
    in_spec = DTensorSpec(mesh, ins, spec.tensor_meta)
    out_spec = DTensorSpec(mesh, outs, TensorMeta(torch.Size(new), (), spec.dtype))
    groups = _view_groups(old, new)
    bad = set()
    for coord in itertools.product(*[range(n) for n in mesh.shape]):
        in_shape, in_off = in_spec.local_shape_and_offset(coord)
        out_shape, out_off = out_spec.local_shape_and_offset(coord)
        for og, ng in groups:
            if not og or not ng:
                continue
            if _flat_range(og, old, in_shape, in_off) != _flat_range(ng, new, out_shape, out_off):
                bad.update(i for i, p in enumerate(ins)
                           if p.is_shard() and (p.dim in og))
    return sorted(bad)


def _flat_range(dims, full, piece, offset):
    """The piece's range in the flattened run ``dims``, or None if it is not one block."""
    sharded = [d for d in dims if piece[d] != full[d]]
    if not sharded:
        return (0, math.prod(full[d] for d in dims))
    d = sharded[0]
    if len(sharded) > 1 or any(full[k] != 1 for k in dims if k < d):
        return None
    inner = math.prod(full[k] for k in dims if k > d)
    return (offset[d] * inner, (offset[d] + piece[d]) * inner)


def _with_local_shape(call, spec, ins, outs, out_shape, local_op):
    """FullStrategy running ``local_op(x, local_out_shape)``: sizes in the call are global."""
    mesh = spec.mesh
    out_spec = DTensorSpec(mesh, outs, TensorMeta(torch.Size(out_shape), (), spec.dtype))
    local_shape = list(out_spec.local_shape())

    def local_fn(x, *args, **kwargs):
        return local_op(x, local_shape)

    return FullStrategy(outs=[outs], ins=[ins], local_fn=local_fn)


def _view_local(x, shape):
    try:
        return aten.view.default(x, shape)
    except RuntimeError:  # a strided local piece: copying is the only way
        return aten.reshape.default(x, shape)


@register_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(call):
    spec = call.inputs[0]
    out_shape = tuple(aten.reshape.default(_meta(spec), call.args[1]).shape)
    local_op = _view_local if call.op is aten.view.default else call.op
    return _reshape_strategy(call, out_shape, local_op)


@register_rule(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default,
               aten.flatten.using_ints, aten.unflatten.int)
def _squeeze_like(call):
    spec = call.inputs[0]
    out_shape = tuple(call.op(_meta(spec), *call.args[1:], **call.kwargs).shape)
    return _reshape_strategy(call, out_shape, _view_local)
