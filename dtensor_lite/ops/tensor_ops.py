"""Tensor-level ops: constructors that follow an input, fills and copies, concatenation, ops that
work along a dim (sort, topk, flip, roll, repeat, tril/triu), data-dependent ops, and the ops
that answer a Python bool (equal, allclose, is_same_size) identically on every rank.

Indexing ops (gather, scatter, index, index_put, ...) live in ``indexing.py``.
"""
from __future__ import annotations

import torch

from .. import _torch_names as torch_names
from ..dtensor import DTensor
from ..redistribute import redistribute_local
from .. import collectives
from .._fallback import replicated_local, replicated_run
from ..placements import LINEAR_REDUCE_OPS, REDUCE_OPS, Partial, Replicate, Shard, reductions_mix
from ..spec import DTensorSpec, TensorMeta, contiguous_stride
from ._registry import Decompose, FullStrategy, register_rule
from .kit import arg_at, choose
from .pointwise import _cast_keeps, with_scalar_zeroing

aten = torch_names.aten
R = Replicate()

__all__ = ["keep_strategy"]


# ------------------------------------------------------------------ helpers
def keep_strategy(spec: DTensorSpec, dim_map, partial_ok=lambda r: True, local_fn=None,
                  n_out: int = 1) -> FullStrategy:
    """Keep each placement where possible: Shard(d) becomes Shard(dim_map(d)), or Replicate when
    ``dim_map(d)`` is None; Partial(r) stays when ``partial_ok(r)``. Shard orders carry over."""
    ins, outs = [], []
    for p in spec.placements:
        if p.is_shard():
            nd = dim_map(p.dim)
            ins.append(p if nd is not None else R)
            outs.append(Shard(nd) if nd is not None else R)
        elif p.is_partial() and not partial_ok(p.reduce_op):
            ins.append(R)
            outs.append(R)
        else:
            ins.append(p)
            outs.append(p)
    in_orders = out_orders = None
    if not spec.has_default_order:
        kept = [tuple(i for i in order if ins[i].is_shard()) for order in spec.shard_order]
        in_orders = [tuple(kept)]
        out_order: dict = {}
        for d, order in enumerate(kept):
            if order:
                out_order[dim_map(d)] = order
        out_ndim = max(out_order, default=-1) + 1
        out_orders = [tuple(out_order.get(d, ()) for d in range(out_ndim))] * n_out
    return FullStrategy(outs=[tuple(outs)] * n_out, ins=[tuple(ins)], local_fn=local_fn,
                        out_orders=out_orders, in_orders=in_orders)


# ------------------------------------------------------------------ constructors and fills
@register_rule(aten.ones_like, aten.zeros_like, aten.empty_like, aten.full_like)
def _like(call):
    # a fresh tensor shaped like the input: shards stay shards, Partial becomes Replicate --
    # except in empty_like, whose uninitialised memory is as valid a Partial piece as any (as
    # torch's: module.to_empty keeps a Partial buffer Partial)
    spec = call.inputs[0]
    outs = tuple(p if not p.is_partial() or call.op is aten.empty_like.default else R
                 for p in spec.placements)
    return FullStrategy(outs=[outs], ins=[None], out_orders=[spec.shard_order])


# new_* factories whose values Partial can carry as they are: uninitialised memory (the next write
# decides, e.g. autograd's new_empty_strided + copy_ of a Partial gradient) and zeros (0 is a
# valid Partial piece for every reduction). ones / full would be multiplied by the reduction.
_NEW_KEEPS_PARTIAL = {aten.new_empty.default, aten.new_empty_strided.default,
                      aten.new_zeros.default}


@register_rule(aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full,
               aten.new_empty_strided)
def _new(call):
    # Sizes are global. A buffer keeps the input's shard of every dim whose size it keeps (each
    # rank builds its own piece): a strategy author's `x.new_empty_strided(x.shape, x.stride())`
    # stays sharded, and so do the buffers backward formulas pad into (rfft's backward:
    # `grad.new_zeros(input.shape)`, then a slice copied in). Other dims are whole on every
    # rank. No data moves; the input's values are unused.
    spec, size = call.inputs[0], tuple(call.args[1])
    stride = tuple(call.args[2]) if call.op is aten.new_empty_strided.default else None
    same = size == tuple(spec.shape)
    outs = tuple(p if (p.is_shard() and len(size) == spec.ndim and size[p.dim] == spec.shape[p.dim])
                 or (same and p.is_partial() and call.op in _NEW_KEEPS_PARTIAL) else R
                 for p in spec.placements)
    if not same and not spec.has_default_order and outs != spec.placements:
        outs = (R,) * call.mesh.ndim  # a part of a shard order has no spelling: build it whole
    if all(p.is_replicate() for p in outs):
        return FullStrategy(outs=[outs], ins=[None] * len(call.inputs))
    # the input's shard order holds while every shard is kept; else the default order does
    order = spec.shard_order if outs == spec.placements else None
    meta = TensorMeta(torch.Size(size), stride or contiguous_stride(size), spec.dtype)
    local_size = DTensorSpec(call.mesh, outs, meta, order).local_shape()

    def local_new(x, _size, *rest, **kwargs):
        if stride is None:
            return call.op(x, local_size, *rest, **kwargs)
        return call.op(x, local_size, _strides_in_order(stride, local_size), *rest[1:], **kwargs)

    return FullStrategy(outs=[outs], ins=[None] * len(call.inputs), local_fn=local_new,
                        out_orders=[order])


def _strides_in_order(global_stride, local_size) -> tuple[int, ...]:
    """Dense strides for ``local_size`` with the dims in the memory order of ``global_stride``
    (a transposed global layout gives transposed local pieces)."""
    order = sorted(range(len(local_size)), key=lambda d: (global_stride[d], -d))  # innermost first
    stride, acc = [0] * len(local_size), 1
    for d in order:
        stride[d] = acc
        acc *= max(local_size[d], 1)
    return tuple(stride)


@register_rule(aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default)
def _fill_(call):
    # the destination keeps its placements; for Partial(sum) the value goes on coordinate 0 only
    dst = call.inputs[0]
    value_in = tuple(p if p.is_partial() else R for p in dst.placements)  # R -> P is free
    full = FullStrategy(outs=[dst.placements], ins=[None] + [value_in] * (len(call.inputs) - 1),
                        out_orders=[dst.shard_order])
    return with_scalar_zeroing(call, full, (1,))


@register_rule(aten.fill.Scalar, aten.fill.Tensor)
def _fill(call):
    # the result ignores the input's values: Partial becomes Replicate, shards stay
    spec = call.inputs[0]
    outs = tuple(R if p.is_partial() else p for p in spec.placements)
    return FullStrategy(outs=[outs], ins=[None] + [(R,) * spec.mesh.ndim] * (len(call.inputs) - 1),
                        out_orders=[spec.shard_order])


@register_rule(aten.copy_.default)
def _copy_(call):
    """dst keeps its placements; src (which may broadcast) is brought to the matching ones. Under
    a Partial dst, a Partial src stays Partial when the dtype cast commutes with the reduction,
    else it is replicated and, for sum, written on coordinate 0 only."""
    dst = call.inputs[0]
    if len(call.inputs) == 1:  # a 0-d plain tensor source acts as a replicated scalar
        full = FullStrategy(outs=[dst.placements], ins=[None], out_orders=[dst.shard_order])
        return with_scalar_zeroing(call, full, (1,))
    src = call.inputs[1]
    lead = dst.ndim - src.ndim
    want, zero_dims = [], []
    for i, p in enumerate(dst.placements):
        q = src.placements[i]
        if p.is_shard():
            dd = p.dim - lead
            want.append(Shard(dd) if dd >= 0 and src.shape[dd] == dst.shape[p.dim] else R)
        elif not p.is_partial():
            want.append(R)
        elif _src_can_be_partial(q, p.reduce_op, src.dtype, dst.dtype):
            want.append(p)
        else:  # reduce the source, then write it on coordinate 0 only (sum) or everywhere
            want.append(R)
            if p.reduce_op == "sum":
                zero_dims.append(i)
    in_order = None
    if not dst.has_default_order:
        in_order = tuple(tuple(i for i in dst.shard_order[dd + lead] if want[i] == Shard(dd))
                         for dd in range(src.ndim))
    local_fn = None
    coord = call.mesh.get_coordinate()
    if any(coord[i] != 0 for i in zero_dims):
        def local_fn(d, s, *args, **kwargs):
            return d.copy_(torch.zeros_like(s), *args, **kwargs)
    return FullStrategy(outs=[dst.placements], ins=[None, tuple(want)], local_fn=local_fn,
                        out_orders=[dst.shard_order], in_orders=[None, in_order])


def _src_can_be_partial(q, r, src_dtype, dst_dtype) -> bool:
    """Can a copy_ source placed ``q`` become Partial(r) and be cast piece by piece?"""
    if q.is_replicate():
        return True  # R -> P(r): zeros off coordinate 0 (sum) or the value everywhere; cast(0) = 0
    keeps = _cast_keeps(src_dtype, dst_dtype, r)
    if q.is_shard():  # S -> P pads with the reduction's identity, which a cast may not preserve
        return keeps and (r in LINEAR_REDUCE_OPS or src_dtype == dst_dtype)
    same = reductions_mix((q.reduce_op, r))
    return same and keeps


@register_rule(aten._local_scalar_dense.default)
def _item(call):
    spec = call.inputs[0]
    return FullStrategy(outs=[None], ins=[(R,) * spec.mesh.ndim])


# ------------------------------------------------------------------ Python-bool answers
def _all_ranks(ok: bool, mesh, placements) -> bool:
    """Every rank gets the same answer: the AND of the local answers over the mesh dims that
    split the data (ranks along a replicated mesh dim compared the same pieces already)."""
    dims = [i for i, p in enumerate(placements) if p.is_shard()]
    if not dims:
        return ok
    t = torch.tensor([int(ok)], device=mesh.device_type)
    for i in dims:
        t = collectives.all_reduce(t, mesh, i, "min")
    return bool(t.item())


def _aligned_locals(a, b):
    """Local pieces of a and b at one common layout without Partial (a's shards are kept)."""
    sa = a._spec
    placements = tuple(R if p.is_partial() else p for p in sa.placements)
    order = sa.shard_order if placements == sa.placements else None
    target = DTensorSpec(sa.mesh, placements, sa.tensor_meta, order)
    b_target = DTensorSpec(sa.mesh, placements, b._spec.tensor_meta, target.shard_order)
    return redistribute_local(a._local_tensor, a._spec, target), redistribute_local(b._local_tensor, b._spec, b_target), placements


def _equal(a, b):
    if a.shape != b.shape:
        return False  # known from global metadata alone: no communication
    la, lb, placements = _aligned_locals(a, b)
    return _all_ranks(torch.equal(la, lb), a._spec.mesh, placements)


def _allclose(a, b, *args, **kwargs):
    if a.shape == b.shape:
        la, lb, placements = _aligned_locals(a, b)
        return _all_ranks(torch.allclose(la, lb, *args, **kwargs), a._spec.mesh, placements)
    # broadcasting: compare whole tensors (every rank computes the same answer)
    return torch.allclose(replicated_local(a), replicated_local(b), *args, **kwargs)


def _mixed(op):
    def check(a, b, *rest, **kwargs):
        if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
            raise ValueError(f"{op}: compare a DTensor with a DTensor (distribute the plain "
                             "tensor first); mixing them has no single answer on every rank")
        return {"equal": _equal, "allclose": _allclose}[op](a, b, *rest, **kwargs)
    return check


@register_rule(aten.equal.default)
def _equal_rule(call):
    return Decompose(_mixed("equal"))


@register_rule(aten.allclose.default)
def _allclose_rule(call):
    return Decompose(_mixed("allclose"))


@register_rule(aten.is_same_size.default)
def _is_same_size(call):
    return Decompose(lambda a, b: tuple(a.shape) == tuple(b.shape))


# ------------------------------------------------------------------ concatenation
def _cat_like(call, tensors, dim_out):
    """cat/stack: shard any dim all inputs share (the concatenated dim cannot stay sharded:
    pieces would interleave), keep a Partial common to the inputs (replicated inputs become
    Partial for free)."""
    specs = [t for t in tensors if isinstance(t, DTensorSpec)]
    ref = max(specs, key=lambda s: s.ndim)
    # legacy: cat skips 1-D empty tensors whatever the other inputs' shapes
    skip = [s.ndim == 1 and s.shape[0] == 0 and ref.ndim != 1 for s in specs]
    n = len(specs)
    strategies = [((R,), (R,) * n)]
    for d in range(ref.ndim):
        od = dim_out(d)
        if od is not None:
            strategies.append(((Shard(od),), tuple(R if k else Shard(d) for k in skip)))
    ops = sorted({p.reduce_op for s in specs for p in s.placements if p.is_partial()})
    if not ops:
        return strategies
    for r in ops:
        strategies.append(((Partial(r),), tuple(R if k else Partial(r) for k in skip)))
    return choose(call, strategies)  # keeps P(max) on one mesh dim from meeting P(sum) on another


@register_rule(aten.cat.default)
def _cat(call):
    tensors = call.args[0]
    specs = [t for t in tensors if isinstance(t, DTensorSpec)]
    ndim = max(s.ndim for s in specs)
    dim = arg_at(call, 1, "dim", 0) % max(ndim, 1)
    return _cat_like(call, tensors, lambda d: None if d == dim else d)


@register_rule(aten.stack.default)
def _stack(call):
    tensors = call.args[0]
    ndim = max(t.ndim for t in tensors if isinstance(t, DTensorSpec))
    dim = arg_at(call, 1, "dim", 0) % (ndim + 1)
    return _cat_like(call, tensors, lambda d: d if d < dim else d + 1)


# ------------------------------------------------------------------ ops along dims
@register_rule(aten.tril.default, aten.triu.default, aten.tril_.default, aten.triu_.default)
def _tri(call):
    """A sharded matrix dim shifts the diagonal: global (i, j) is local (i - oi, j - oj), so the
    local piece uses diagonal k + oi - oj. Zeroing elements commutes with any Partial."""
    spec = call.inputs[0]
    if spec.ndim < 2:
        return [((R,), (R,))]  # torch raises its own error from the metadata pass
    k = arg_at(call, 1, "diagonal", 0)
    _, off = spec.local_shape_and_offset()
    local_k = k + off[-2] - off[-1]
    op = call.op
    fn = None if local_k == k else (lambda x, *a, **kw: op(x, local_k))
    return keep_strategy(spec, lambda d: d, local_fn=fn)


@register_rule(aten.repeat.default)
def _repeat(call):
    # a dim repeated once keeps its shard; tiling a sharded dim would interleave pieces
    spec = call.inputs[0]
    repeats = list(call.args[1])
    lead = len(repeats) - spec.ndim
    if lead < 0:
        return [((R,), (R,))]  # torch raises its own error from the metadata pass
    return keep_strategy(spec, lambda d: d + lead if repeats[d + lead] == 1 else None)


@register_rule(aten.flip.default)
def _flip(call):
    spec = call.inputs[0]
    dims = {d % max(spec.ndim, 1) for d in call.args[1]}
    return keep_strategy(spec, lambda d: None if d in dims else d)


@register_rule(aten.roll.default)
def _roll(call):
    spec = call.inputs[0]
    dims = arg_at(call, 2, "dims", [])
    if len(dims) == 0:  # rolls the flattened tensor: every shard must go
        return keep_strategy(spec, lambda d: None)
    dims = {d % max(spec.ndim, 1) for d in dims}
    return keep_strategy(spec, lambda d: None if d in dims else d)


def _along_dim(spec, dim, n_out):
    """Ops that work along one dim (sort, topk): any other dim may stay sharded."""
    strategies = [((R,) * n_out, (R,))]
    strategies += [((Shard(d),) * n_out, (Shard(d),)) for d in range(spec.ndim) if d != dim]
    return strategies


@register_rule(aten.rot90.default)
def _rot90(call):
    # a quarter turn is a flip and a transpose: both have their own (local where possible) rules.
    # (A Decompose runs below autograd: it calls aten ops with real kernels, never composite ones
    # such as contiguous(), which would reach the dispatcher undecomposed.)
    def run(x, k=1, dims=(0, 1)):
        d0, d1 = dims
        k %= 4
        if k == 0:
            return aten.clone.default(x)
        if k == 2:
            return aten.flip.default(x, [d0, d1])
        flipped = aten.flip.default(x, [d1] if k == 1 else [d0])
        return aten.transpose.int(flipped, d0, d1)
    return Decompose(run)


@register_rule(aten.constant_pad_nd.default)
def _constant_pad(call):
    """Padding (or cropping) a sharded dim would change every piece's extent: that mesh dim is
    replicated; other dims keep their shards. Under Partial(sum) the pad value goes on
    coordinate 0 only (zeros elsewhere), so any Partial survives."""
    spec = call.inputs[0]
    pad = list(call.args[1])
    padded = {spec.ndim - 1 - k // 2 for k in range(len(pad)) if pad[k] != 0}
    full = keep_strategy(spec, lambda d: None if d in padded else d)
    return with_scalar_zeroing(call, full, (2, "value"))


@register_rule(aten.bucketize.Tensor, aten.isin.Tensor_Tensor)
def _lookup_in_replicated(call):
    # elementwise in the first input, against a whole (replicated) second input
    x = call.inputs[0]
    n = len(call.inputs)
    return [((R,), (R,) * n)] + [((Shard(d),), (Shard(d),) + (R,) * (n - 1))
                                 for d in range(x.ndim)]


@register_rule(aten.isin.Tensor_Scalar)
def _isin_scalar(call):
    return [((R,), (R,))] + [((Shard(d),), (Shard(d),)) for d in range(call.inputs[0].ndim)]


@register_rule(aten.searchsorted.Tensor)
def _searchsorted(call):
    """1-D boundaries: elementwise in the values; N-D: batch dims shard boundaries and values
    alike (the last dim, searched, stays whole)."""
    seq, values = call.args[0], call.args[1]
    n = len(call.inputs)
    strategies = [((R,), (R,) * n)]
    if not isinstance(seq, DTensorSpec) or not isinstance(values, DTensorSpec):
        return strategies
    if seq.ndim == 1:
        rest = (R,) * (n - 2)
        strategies += [((Shard(d),), (R, Shard(d)) + rest) for d in range(values.ndim)]
    else:
        strategies += [((Shard(d),), (Shard(d),) * n) for d in range(seq.ndim - 1)]
    return strategies


@register_rule(aten.kthvalue.default, aten.median.dim, aten.nanmedian.dim, aten.mode.default)
def _select_along_dim(call):
    """One value (and its index) per slice along ``dim``: the other dims keep their shards."""
    spec = call.inputs[0]
    default_dim = -1 if call.op in (aten.kthvalue.default, aten.mode.default) else None
    pos = 2 if call.op is aten.kthvalue.default else 1
    dim = arg_at(call, pos, "dim", default_dim) % max(spec.ndim, 1)
    keepdim = arg_at(call, pos + 1, "keepdim", False)
    strategies = [((R, R), (R,))]
    for d in range(spec.ndim):
        if d != dim:
            od = d if keepdim or d < dim else d - 1
            strategies.append(((Shard(od), Shard(od)), (Shard(d),)))
    return strategies


@register_rule(aten.sort.default, aten.sort.stable)
def _sort(call):
    spec = call.inputs[0]
    dim = call.kwargs.get("dim", call.args[1] if call.op is aten.sort.default and
                          len(call.args) > 1 else -1)
    return _along_dim(spec, dim % max(spec.ndim, 1), 2)


@register_rule(aten.topk.default)
def _topk(call):
    spec = call.inputs[0]
    dim = arg_at(call, 2, "dim", -1)
    return _along_dim(spec, dim % max(spec.ndim, 1), 2)


# ------------------------------------------------------------------ data-dependent shapes
@register_rule(aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
               aten.unique_dim.default, aten.unique_consecutive.default,
               aten.where.default)
def _data_dependent(call):
    return Decompose(replicated_run(call.op))


@register_rule(aten.masked_scatter.default, aten.masked_scatter_.default)
def _masked_scatter(call):
    # the source is consumed in row-major order of the mask: only whole tensors line up
    return [((R,), (R,) * len(call.inputs))]


@register_rule(aten.diagonal_copy.default, aten.diag_embed.default)
def _diagonal_replicated(call):
    # A diagonal crosses every shard of both dims it reads, so it is taken from the whole
    # matrix on every rank (Partial inputs stay Partial: picking entries is linear).
    R = Replicate()
    strategies = [((R,), (R,))]
    strategies += [((Partial(op),), (Partial(op),)) for op in REDUCE_OPS]
    return strategies
