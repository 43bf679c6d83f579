"""Reductions: reducing over a sharded dim yields a Partial that the next redistribute resolves.

* sum / nansum / count_nonzero / mean -> ``Partial(sum)`` (mean divides the local sum by the
  *global* count, so empty shards add 0, never NaN); amax / amin / max / min / aminmax ->
  ``Partial(max|min)`` with empty shards filled by the reduction's identity; all -> ``P(min)``,
  any -> ``P(max)``.
* Reductions that no Partial expresses run exactly as short compositions (:class:`Decompose`):
  var/std (mean, then squared deviations: the variance itself stays ``Partial(sum)``), norms
  (``sum |x|^p`` then the root; ``P(max)`` for inf), logsumexp (shifted by the global max), and
  prod / max.dim / argmax, whose per-rank results (a product; a value with its *global* index)
  are all-gathered -- one entry per rank, far less than the input -- and combined locally.
* Scans (cumsum, cumprod, ...) along a sharded dim gather that dim; other dims keep their shards.
"""
from __future__ import annotations

import math

import torch

from .. import _torch_names as torch_names
from ..dtensor import DTensor
from ..placements import LINEAR_REDUCE_OPS, Partial, Replicate, Shard
from ..redistribute import plan_redistribute, redistribute_local, run_plan
from ..redistribute.steps import COLLECTIVE_LATENCY_BYTES
from ..spec import DTensorSpec, TensorMeta
from ._registry import Decompose, register_rule
from .kit import arg_at
from .view import carry_order, full_strategy

aten = torch_names.aten
R = Replicate()


# ------------------------------------------------------------------ argument helpers
def reduced_dims(dim, ndim, empty_means_all=True) -> tuple:
    """Sorted non-negative dims reduced by ``dim``: None reduces everything, and so does [] for
    most ops (all.dims / any.dims reduce nothing then). A 0-d tensor has no dims to reduce."""
    if ndim == 0:
        return ()
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0 and empty_means_all):
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = (dim,)
    return tuple(sorted({d % max(ndim, 1) for d in dim}))


def _out_dim(d, dims, keepdim):
    return d if keepdim else d - sum(1 for r in dims if r < d)


def _contiguous_meta(shape, dtype):
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return TensorMeta(torch.Size(shape), tuple(reversed(stride)), dtype)


def _identity(kind: str, dtype: torch.dtype):
    """The value an empty piece contributes to a max ("max") or min ("min") reduction."""
    if dtype == torch.bool:
        return kind == "min"
    if dtype.is_floating_point:
        return float("-inf") if kind == "max" else float("inf")
    info = torch.iinfo(dtype)
    return info.min if kind == "max" else info.max


def _validated(call, decomposition):
    """``Decompose(decomposition)`` once torch accepts the arguments: a composition would
    otherwise wrap a bad dim around instead of failing as torch does."""
    spec = call.inputs[0]
    meta = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")
    try:
        call.op(meta, *call.args[1:], **call.kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised with the op and the global shape
        raise RuntimeError(f"{call.op}: torch rejects these arguments for a DTensor of global "
                           f"shape {tuple(spec.shape)}: {e}") from e
    return Decompose(decomposition)


def _reduced_shape(shape, dims, keepdim):
    return [1 if d in dims else s for d, s in enumerate(shape) if keepdim or d not in dims]


# ------------------------------------------------------------------ the common strategy
def reduction(spec, dims, keepdim, sharded_to, keep_partial=(), local_fn=None, n_out=1):
    """Keep the input where it is: a mesh dim sharding a reduced dim gives ``sharded_to`` (a
    Partial), or is gathered first when ``sharded_to`` is None; Partial inputs pass through when
    their op is in ``keep_partial`` and are reduced first otherwise."""
    ins, outs = [], []
    for p in spec.placements:
        if p.is_shard() and p.dim in dims:
            ins.append(p if sharded_to is not None else R)
            outs.append(sharded_to if sharded_to is not None else R)
        elif p.is_shard():
            ins.append(p)
            outs.append(Shard(_out_dim(p.dim, dims, keepdim)))
        elif p.is_partial() and p.reduce_op not in keep_partial:
            ins.append(R)
            outs.append(R)
        else:
            ins.append(p)
            outs.append(p)
    out_ndim = spec.ndim if keepdim else spec.ndim - len(dims)
    return full_strategy(spec, ins, [outs] * n_out, [out_ndim] * n_out, local_fn)


def _any_sharded(spec, dims) -> bool:
    return any(p.is_shard() and p.dim in dims for p in spec.placements)


def reduce_pieces_is_cheaper(spec, dims, rounds: tuple[str, ...]) -> bool:
    """Is reducing a sharded dim piece-wise -- one collective per entry of ``rounds``
    ("all_reduce" or "all_gather" of the reduced pieces, over each mesh dim sharding a reduced
    dim) -- cheaper than gathering those dims first (one plan), under the planner's cost: bytes
    plus ``COLLECTIVE_LATENCY_BYTES`` per collective? For a small tensor one gather beats two
    round trips (logsumexp of an (8, 12) tensor: PyTorch gathers, once); for a large one,
    moving reduced results beats moving the input. Priced at mesh coordinate 0 (the largest
    pieces) so that every rank decides alike; Partial dims are resolved alike on both paths
    and left out."""
    if not _any_sharded(spec, dims):
        return False
    base = spec.with_placements(tuple(R if p.is_partial() else p for p in spec.placements),
                                spec.shard_order)
    M = [i for i, p in enumerate(base.placements) if p.is_shard() and p.dim in dims]
    gathered = base.with_placements(tuple(R if i in M else p for i, p in enumerate(
        base.placements)))
    plan = plan_redistribute(base, gathered)
    gather_cost = plan.cost + COLLECTIVE_LATENCY_BYTES * plan.num_collectives
    piece = base.local_shape_and_offset((0,) * spec.mesh.ndim)[0]
    out_bytes = math.prod(1 if d in dims else s for d, s in enumerate(piece)) * spec.dtype.itemsize
    per_round = {"all_reduce": lambda n: 2 * (n - 1) * -(-out_bytes // n),
                 "all_gather": lambda n: (n - 1) * out_bytes}
    reduce_cost = sum(COLLECTIVE_LATENCY_BYTES + per_round[kind](spec.mesh.shape[i])
                      for kind in rounds for i in M)
    return reduce_cost < gather_cost


def _sum_like_args(call):
    if call.op._overloadname == "default":
        return None, False
    return arg_at(call, 1, "dim"), arg_at(call, 2, "keepdim", False)


@register_rule(aten.sum.default, aten.sum.dim_IntList, aten.nansum.default)
def _sum(call):
    spec = call.inputs[0]
    dim, keepdim = _sum_like_args(call) if call.op is not aten.nansum.default else (
        arg_at(call, 1, "dim"), arg_at(call, 2, "keepdim", False))
    # nansum is not linear in a Partial operand: NaN in one rank's share hides the others
    keep = LINEAR_REDUCE_OPS if call.op is not aten.nansum.default else ()
    return reduction(spec, reduced_dims(dim, spec.ndim), keepdim, Partial("sum"), keep)


@register_rule(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def _count_nonzero(call):
    spec = call.inputs[0]
    dims = reduced_dims(arg_at(call, 1, "dim"), spec.ndim)
    return reduction(spec, dims, False, Partial("sum"))


@register_rule(aten.mean.default, aten.mean.dim)
def _mean(call):
    spec = call.inputs[0]
    dim, keepdim = _sum_like_args(call)
    dims = reduced_dims(dim, spec.ndim)
    local_fn = None
    if _any_sharded(spec, dims):
        count = math.prod(spec.shape[d] for d in dims)
        dtype = call.kwargs.get("dtype")

        def local_fn(x, *args, **kwargs):
            # the global mean is sum over ranks of (local sum / global count): exact, and an
            # empty shard adds 0 instead of NaN
            return aten.sum.dim_IntList(x, list(dims), keepdim, dtype=dtype) / count
    return reduction(spec, dims, keepdim, Partial("sum"), LINEAR_REDUCE_OPS, local_fn)


# ------------------------------------------------------------------ max / min family
def _identity_filled(op, dims, keepdim, kinds):
    """``op`` on the local piece, or identity-filled results when a reduced dim is empty there
    (torch refuses to reduce an empty dim; the identity leaves the Partial(max|min) exact)."""
    def local_fn(x, *args, **kwargs):
        if all(x.shape[d] > 0 for d in dims):
            return op(x, *args, **kwargs)
        shape = _reduced_shape(x.shape, dims, keepdim)
        outs = [torch.full(shape, _identity(k, x.dtype), dtype=x.dtype, device=x.device)
                for k in kinds]
        return outs[0] if len(outs) == 1 else tuple(outs)
    return local_fn


@register_rule(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default)
def _amax(call):
    spec = call.inputs[0]
    kind = "max" if call.op in (aten.amax.default, aten.max.default) else "min"
    if call.op in (aten.max.default, aten.min.default):
        dims, keepdim = tuple(range(spec.ndim)), False
    else:
        dims = reduced_dims(arg_at(call, 1, "dim", []), spec.ndim)
        keepdim = arg_at(call, 2, "keepdim", False)
    return reduction(spec, dims, keepdim, Partial(kind), (kind,),
                     _identity_filled(call.op, dims, keepdim, [kind]))


@register_rule(aten.aminmax.default)
def _aminmax(call):
    spec = call.inputs[0]
    dims = reduced_dims(call.kwargs.get("dim"), spec.ndim)
    keepdim = call.kwargs.get("keepdim", False)
    strategy = reduction(spec, dims, keepdim, Partial("min"), (), n_out=2)
    # the two outputs reduce differently: P(min) for the minimum, P(max) for the maximum
    strategy.outs = [strategy.outs[0], tuple(Partial("max") if p == Partial("min") else p
                                             for p in strategy.outs[1])]
    strategy.local_fn = _identity_filled(call.op, dims, keepdim, ["min", "max"])
    return strategy


@register_rule(aten.all.default, aten.all.dim, aten.all.dims, aten.any.default, aten.any.dim,
               aten.any.dims)
def _all_any(call):
    # over bools, all is a min and any a max; empty pieces give True / False, their identities
    spec = call.inputs[0]
    dim, keepdim = _sum_like_args(call)
    kind = "min" if call.op._schema.name == "aten::all" else "max"
    dims = reduced_dims(dim, spec.ndim, empty_means_all=call.op._overloadname != "dims")
    return reduction(spec, dims, keepdim, Partial(kind))


# ------------------------------------------------------------------ gather-and-combine
def _replicate_partials(x: DTensor):
    """This rank's piece and spec of ``x`` with every Partial mesh dim reduced."""
    spec = x._spec
    if not any(p.is_partial() for p in spec.placements):
        return x._local_tensor, spec
    target = spec.with_placements(tuple(R if p.is_partial() else p for p in spec.placements),
                                  spec.shard_order)
    return redistribute_local(x._local_tensor, x._spec, target), target


def _gather_over(local, spec, M, kept_shape):
    """All-gather, over the mesh dims ``M``, every rank's ``local`` (its piece of a tensor of
    global shape ``kept_shape`` laid out like ``spec`` except that M shard nothing): the result
    stacks one entry per rank of M along a new dim 0."""
    mesh = spec.mesh
    K = math.prod(mesh.shape[i] for i in M)
    placements = tuple(Shard(0) if i in M else (Shard(p.dim + 1) if p.is_shard() else p)
                       for i, p in enumerate(spec.placements))
    order = ((tuple(sorted(M)),) + tuple(tuple(i for i in o if i not in M)
                                         for o in spec.shard_order))
    meta = _contiguous_meta([K] + list(kept_shape), local.dtype)
    src = DTensorSpec(mesh, placements, meta, order)
    dst = DTensorSpec(mesh, tuple(R if i in M else p for i, p in enumerate(placements)), meta,
                      ((),) + order[1:])
    return run_plan(local.unsqueeze(0), plan_redistribute(src, dst))


def _result(local, spec, M, dims, keepdim):
    """Wrap a reduction result: M became Replicate, other shards move with their dims."""
    outs = [R if i in M else (Shard(_out_dim(p.dim, dims, keepdim)) if p.is_shard() else p)
            for i, p in enumerate(spec.placements)]
    shape = _reduced_shape(spec.shape, dims, keepdim)
    return DTensor(local, DTensorSpec(spec.mesh, tuple(outs), _contiguous_meta(shape, local.dtype),
                                      carry_order(spec, outs, len(shape))))


def _arg_reduce(x: DTensor, dim, keepdim, largest, want_values):
    """max.dim / argmax over a sharded dim (``dim`` None: over the flattened tensor).

    Each rank reduces its piece to (value, global index); the pairs of all ranks sharing the
    output entry are gathered and the winner is the largest value (NaN beats everything, as in
    torch), ties going to the smallest global index -- torch's first occurrence."""
    local, spec = _replicate_partials(x)
    shape, offset = spec.local_shape_and_offset()
    gshape = list(spec.shape)
    if dim is None:
        dims = tuple(range(spec.ndim))
        M = [i for i, p in enumerate(spec.placements) if p.is_shard()]
        sentinel = math.prod(gshape)
        kept_shape = [1] * spec.ndim
        if local.numel():
            flat = local.reshape(-1)
            li = int(flat.argmax() if largest else flat.argmin())
            v = flat[li].reshape(kept_shape)
            coords = []
            for size in reversed(shape):
                coords.append(li % size)
                li //= size
            g = 0
            for c, o, n in zip(reversed(coords), offset, gshape):
                g = g * n + c + o
            i = torch.full(kept_shape, g, dtype=torch.long, device=local.device)
        else:
            v = torch.full(kept_shape, _identity("max" if largest else "min", local.dtype),
                           dtype=local.dtype, device=local.device)
            i = torch.full(kept_shape, sentinel, dtype=torch.long, device=local.device)
    else:
        d = dim % max(spec.ndim, 1)
        dims = (d,)
        M = [i for i, p in enumerate(spec.placements) if p.is_shard(d)]
        sentinel = gshape[d]
        kept_shape = _reduced_shape(gshape, dims, True)
        if local.shape[d] > 0:
            v, i = (torch.max if largest else torch.min)(local, d, keepdim=True)
            i = i + offset[d]
        else:
            lshape = _reduced_shape(local.shape, dims, True)
            v = torch.full(lshape, _identity("max" if largest else "min", local.dtype),
                           dtype=local.dtype, device=local.device)
            i = torch.full(lshape, sentinel, dtype=torch.long, device=local.device)
    values = _gather_over(v, spec, M, kept_shape)
    indices = _gather_over(i, spec, M, kept_shape)
    best = values.amax(0) if largest else values.amin(0)
    win = values == best.unsqueeze(0)
    if values.dtype.is_floating_point:
        nan = values.isnan()
        win = torch.where(nan.any(0, keepdim=True), nan, win)
    idx = torch.where(win, indices, sentinel).amin(0)
    if not keepdim:
        best, idx = best.squeeze(dims) if dims else best, idx.squeeze(dims) if dims else idx
        if dim is None:
            best, idx = best.reshape(()), idx.reshape(())
    idx_dt = _result(idx, spec, M, dims, keepdim)
    if not want_values:
        return idx_dt
    return _result(best, spec, M, dims, keepdim), idx_dt


@register_rule(aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default)
def _max_dim(call):
    spec = call.inputs[0]
    want_values = call.op in (aten.max.dim, aten.min.dim)
    largest = call.op in (aten.max.dim, aten.argmax.default)
    dim = arg_at(call, 1, "dim")
    keepdim = arg_at(call, 2, "keepdim", False)
    dims = reduced_dims(dim, spec.ndim) if dim is not None else tuple(range(spec.ndim))
    if reduce_pieces_is_cheaper(spec, dims, ("all_gather", "all_gather")):  # values, indices
        return _validated(call, lambda x, *a, **k: _arg_reduce(x, dim, keepdim, largest,
                                                               want_values))
    return reduction(spec, dims, keepdim, None, (), n_out=2 if want_values else 1)


@register_rule(aten.prod.default, aten.prod.dim_int)
def _prod(call):
    spec = call.inputs[0]
    dim = None if call.op is aten.prod.default else arg_at(call, 1, "dim")
    keepdim = False if call.op is aten.prod.default else arg_at(call, 2, "keepdim", False)
    dims = reduced_dims(dim, spec.ndim)
    dtype = call.kwargs.get("dtype")
    if not reduce_pieces_is_cheaper(spec, dims, ("all_gather",)):  # one product per rank
        return reduction(spec, dims, keepdim, None)

    def sharded_prod(x, *args, **kwargs):
        # local products, one per rank, multiplied together: no need to move the input
        local, spec = _replicate_partials(x)
        part = local
        for d in reversed(dims):
            part = aten.prod.dim_int(part, d, True, dtype=dtype)
        M = [i for i, p in enumerate(spec.placements) if p.is_shard() and p.dim in dims]
        stacked = _gather_over(part, spec, M, _reduced_shape(spec.shape, dims, True))
        out = stacked.prod(0, dtype=stacked.dtype)
        if not keepdim:
            out = out.reshape(_reduced_shape(out.shape, dims, False))
        return _result(out, spec, M, dims, keepdim)
    return _validated(call, sharded_prod)


# ------------------------------------------------------------------ exact compositions
def _resolve(x: DTensor, mesh_dims) -> DTensor:
    """``x`` with its Partial mesh dims in ``mesh_dims`` reduced to Replicate."""
    spec = x._spec
    placements = tuple(R if i in mesh_dims and p.is_partial() else p
                       for i, p in enumerate(spec.placements))
    if placements == spec.placements:
        return x
    target = spec.with_placements(placements, spec.shard_order)
    return DTensor(redistribute_local(x._local_tensor, x._spec, target), target)


def _var_args(call):
    spec = call.inputs[0]
    dims = reduced_dims(arg_at(call, 1, "dim"), spec.ndim)
    correction = call.kwargs.get("correction")
    correction = 1 if correction is None else correction
    return spec, dims, correction, call.kwargs.get("keepdim", False)


@register_rule(aten.var.correction, aten.std.correction, aten.var_mean.correction,
               aten.std_mean.correction)
def _var(call):
    spec, dims, correction, keepdim = _var_args(call)
    name = call.op._schema.name.split("::")[1]
    if not reduce_pieces_is_cheaper(spec, dims, ("all_reduce",) * 2):  # the mean, then the deviations
        return reduction(spec, dims, keepdim, None, (), n_out=2 if "mean" in name else 1)
    count = math.prod(spec.shape[d] for d in dims)
    M = [i for i, p in enumerate(spec.placements) if p.is_shard() and p.dim in dims]

    def exact(x, *args, **kwargs):
        # two passes, like torch: the global mean (one small all-reduce), then the sum of
        # squared deviations, which stays Partial(sum) until something needs the value
        mean = _resolve(aten.mean.dim(x, list(dims), True), M)
        dev = aten.sub.Tensor(x, mean)
        sq = aten.mul.Tensor(dev, dev) if not dev.is_complex() else aten.mul.Tensor(
            aten.abs.default(dev), aten.abs.default(dev))
        ssd = aten.sum.dim_IntList(sq, list(dims), keepdim)
        if count - correction <= 0:
            ssd = _resolve(ssd, M)  # x / 0 is inf or NaN by x's sign: divide the whole sum
        var = aten.div.Scalar(ssd, max(0, count - correction))
        out = aten.sqrt.default(var) if name.startswith("std") else var
        if "mean" not in name:
            return out
        return out, (mean if keepdim else aten.squeeze.dims(mean, list(dims)))
    return _validated(call, exact)


def _norm_args(call):
    name = call.op._overloadname
    if call.op is aten.linalg_vector_norm.default:
        return (arg_at(call, 1, "ord", 2), arg_at(call, 2, "dim"), arg_at(call, 3, "keepdim", False),
                call.kwargs.get("dtype"))
    p = arg_at(call, 1, "p", 2)
    dim = arg_at(call, 2, "dim") if "dim" in name else None
    keepdim = arg_at(call, 3, "keepdim", False) if "dim" in name else False
    return 2 if p is None else p, dim, keepdim, call.kwargs.get("dtype")


@register_rule(aten.linalg_vector_norm.default, aten.norm.Scalar, aten.norm.ScalarOpt_dim,
               aten.norm.ScalarOpt_dtype, aten.norm.ScalarOpt_dim_dtype)
def _norm(call):
    spec = call.inputs[0]
    ord_, dim, keepdim, dtype = _norm_args(call)
    dims = reduced_dims(dim, spec.ndim)
    if not reduce_pieces_is_cheaper(spec, dims, ("all_reduce",)):
        return reduction(spec, dims, keepdim, None)
    ord_ = float(ord_)

    def exact(x, *args, **kwargs):
        if dtype is not None:
            x = aten._to_copy.default(x, dtype=dtype)
        a = aten.abs.default(x)
        if ord_ == math.inf:
            return aten.amax.default(a, list(dims), keepdim)  # stays Partial(max)
        if ord_ == -math.inf:
            return aten.amin.default(a, list(dims), keepdim)
        if ord_ == 0:
            return aten.sum.dim_IntList(aten.ne.Scalar(a, 0), list(dims), keepdim, dtype=a.dtype)
        if ord_ == 1:
            return aten.sum.dim_IntList(a, list(dims), keepdim)  # stays Partial(sum)
        if ord_ == 2:
            squares = aten.mul.Tensor(a, a)
            return aten.sqrt.default(aten.sum.dim_IntList(squares, list(dims), keepdim))
        s = aten.sum.dim_IntList(aten.pow.Tensor_Scalar(a, ord_), list(dims), keepdim)
        return aten.pow.Tensor_Scalar(s, 1.0 / ord_)
    return _validated(call, exact)


@register_rule(aten.logsumexp.default)
def _logsumexp(call):
    spec = call.inputs[0]
    dims = reduced_dims(arg_at(call, 1, "dim"), spec.ndim)
    keepdim = arg_at(call, 2, "keepdim", False)
    if not reduce_pieces_is_cheaper(spec, dims, ("all_reduce",) * 2):  # the max, then the sum
        return reduction(spec, dims, keepdim, None)
    M = [i for i, p in enumerate(spec.placements) if p.is_shard() and p.dim in dims]

    def stable(x, *args, **kwargs):
        if not (x.dtype.is_floating_point or x.is_complex()):
            x = aten._to_copy.default(x, dtype=torch.get_default_dtype())
        # shift by the global max (a small all-reduce), as torch does; an infinite max shifts
        # by 0 so that inf - inf never makes a NaN
        m = _resolve(aten.amax.default(x, list(dims), True), M)
        m._local_tensor.masked_fill_(m._local_tensor.isinf(), 0)
        s = aten.sum.dim_IntList(aten.exp.default(aten.sub.Tensor(x, m)), list(dims), keepdim)
        shift = m if keepdim else aten.squeeze.dims(m, list(dims))
        return aten.add.Tensor(aten.log.default(s), shift)
    return _validated(call, stable)


# ------------------------------------------------------------------ scans
@register_rule(aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default,
               aten.cummax.default, aten.cummin.default)
def _scan(call):
    spec = call.inputs[0]
    d = arg_at(call, 1, "dim") % max(spec.ndim, 1)
    linear = call.op is aten.cumsum.default
    n_out = 2 if call.op in (aten.cummax.default, aten.cummin.default) else 1
    ins = [R if (p.is_shard() and p.dim == d) or (p.is_partial() and not (
        linear and p.is_linear)) else p for p in spec.placements]
    return full_strategy(spec, ins, [ins] * n_out, [spec.ndim] * n_out)


# ------------------------------------------------------------------ histograms
@register_rule(aten.histc.default)
def _histc(call):
    """Bin counts add across pieces when every rank bins alike: with a given range
    (``min < max``) a sharded input gives ``Partial(sum)`` counts and moves nothing. Without
    one (``min == max``) the bins come from the data's global min and max, so the input is
    gathered."""
    spec = call.inputs[0]
    lo, hi = arg_at(call, 2, "min", 0), arg_at(call, 3, "max", 0)
    strategies = [((R,), (R,))]
    if lo < hi:
        strategies += [((Partial("sum"),), (Shard(d),)) for d in range(spec.ndim)]
    return strategies
