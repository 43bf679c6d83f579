"""Indexing ops: index_select, gather, scatter*, index_add/copy/fill, advanced indexing
(``x[idx]``, ``x[mask]``) and index_put (``x[idx] = v``).

Three ways to avoid moving the indexed tensor when it is sharded:

* along a dim that is *not* indexed: every rank indexes its own piece (indices replicated);
* *reads* along the sharded indexed dim: every rank looks up the ids that fall in its piece and
  contributes zeros elsewhere, giving Partial(sum) (a masked lookup, as a vocab-parallel
  embedding does);
* *writes* along the sharded indexed dim: every rank applies the writes that land in its piece;
  the others are sent to one padding slot past its end and dropped.

Sharded indices give sharded outputs (reads), or Partial(sum) for accumulating writes
(``scatter_add``, ``index_add``, ``index_put(accumulate=True)``), each rank adding its share.
Boolean masks are turned into (replicated) integer indices first: the output length depends on
the data, so only a replicated mask can give every rank the same global shape.

``one_hot``: every id expands in place, so any shard of the ids stays and the new last dim is
whole. Its class count (``num_classes=-1``) and its range checks read the data: they use the
global min and max (one small all-reduce per mesh dim sharding the ids), so every rank gets the
same shape and the same error.
"""
from __future__ import annotations

import torch

from .. import _torch_names as torch_names
from .._fallback import replicated_local, replicated_run, wrap_replicated
from ..dtensor import DTensor
from ..placements import LINEAR_REDUCE_OPS, REDUCE_OPS, Partial, Replicate, Shard
from ..spec import DTensorSpec, TensorMeta, contiguous_stride
from ._registry import Decompose, intercept_composite, register_rule
from .kit import choose, input_locations, target_spec
from .pointwise import with_scalar_zeroing

aten = torch_names.aten
R = Replicate()


# ------------------------------------------------------------------ helpers
def _partials(*specs) -> list:
    return sorted({p.reduce_op for s in specs if isinstance(s, DTensorSpec)
                   for p in s.placements if p.is_partial()})


def _masked_ok(spec) -> bool:
    """A masked lookup gives Partial(sum): it cannot join a max/min Partial on another mesh dim,
    and a sum of bools is no bool."""
    return spec.dtype != torch.bool and not any(
        p.is_partial() and p.reduce_op in ("max", "min") for p in spec.placements)


def _strategy(locs, out, placed: dict, default=R):
    """(out, ins) with the input at location loc placed ``placed.get(loc[0])`` (arg position)."""
    outs = out if isinstance(out, tuple) else (out,)
    return outs, tuple(placed.get(loc[0], default) for loc in locs)


def _sharded_pieces(call, full, j, dims) -> dict:
    """{dim: (offset, size)} of input j's local piece, for each dim in ``dims`` that the chosen
    placements shard."""
    spec = target_spec(call, full, j)
    shape, off = spec.local_shape_and_offset()
    sharded = {p.dim for p in spec.placements if p.is_shard()}
    return {d: (off[d], shape[d]) for d in dims if d in sharded}


def _check_range(index, n, allow_negative, op, dim):
    lo = -n if allow_negative else 0
    if index.numel() and bool(((index < lo) | (index >= n)).any()):
        raise IndexError(f"{op}: an index is out of range for dim {dim} of size {n} "
                         f"(allowed: [{lo}, {n}))")
    return torch.where(index < 0, index + n, index) if allow_negative else index


def _local_ids(index, off, size, n, allow_negative, op, dim):
    """Global ids -> ids into this rank's piece [off, off + size), and which are valid."""
    local = _check_range(index, n, allow_negative, op, dim) - off
    return local, (local >= 0) & (local < size)


def _functional(op):
    """The out-of-place overload of an in-place op (scatter_.src -> scatter.src)."""
    name = op._schema.name.split("::")[-1]
    if op is aten._index_put_impl_.default:
        return lambda x, indices, values, accumulate=False, unsafe=False: \
            aten.index_put.default(x, indices, values, accumulate)
    if not name.endswith("_"):
        return op
    packet = getattr(aten, name[:-1])
    return getattr(packet, op._overloadname)


def _padded_writer(op, pieces: dict, full_sizes: dict, index_of, allow_negative, inplace):
    """local_fn for writes along sharded dims: ids outside this rank's piece go to one padding
    slot past its end (per sharded dim), which is cut off afterwards."""
    fn = _functional(op)

    def run(x, *args, **kwargs):
        args = list(args)
        bad = None
        locals_ = {}
        for d, (off, size) in pieces.items():
            get, put = index_of(d)
            local, valid = _local_ids(get(args), off, size, full_sizes[d], allow_negative, op, d)
            locals_[d] = (local, put)
            bad = ~valid if bad is None else bad | ~valid
        xp = x
        for d, (off, size) in pieces.items():
            shape = list(xp.shape)
            shape[d] = 1
            xp = torch.cat([xp, xp.new_zeros(shape)], d)
            local, put = locals_[d]
            put(args, torch.where(bad, size, local))
        out = fn(xp, *args, **kwargs)
        for d, (off, size) in pieces.items():
            out = out.narrow(d, 0, size)
        if inplace:
            return x.copy_(out)
        return out
    return run


def _dim_index_of(pos=1):
    """For ops shaped (self, dim, index, ...): read/replace the index (args after self)."""
    def index_of(d):
        def get(args):
            return args[pos]

        def put(args, v):
            args[pos] = v
        return get, put
    return index_of


# ------------------------------------------------------------------ index_select, gather
@register_rule(aten.index_select.default)
def _index_select(call):
    x = call.inputs[0]
    dim = call.args[1] % max(x.ndim, 1)
    locs = input_locations(call)
    idx = call.args[2] if isinstance(call.args[2], DTensorSpec) else None
    st = [_strategy(locs, R, {})]
    if x.ndim == 0:  # a 0-d source gives a 0-d result: nothing to shard (Partials stay)
        return st + [_strategy(locs, Partial(r), {0: Partial(r)}) for r in _partials(x)]
    st += [_strategy(locs, Shard(d), {0: Shard(d)}) for d in range(x.ndim) if d != dim]
    if idx is not None and idx.ndim == 1:
        st.append(_strategy(locs, Shard(dim), {2: Shard(0)}))  # the output follows the ids
    return _choose_lookup(call, st, locs, x, dim, gather=False)


def _choose_lookup(call, st, locs, x, dim, gather):
    """index_select / gather: add the strategies both share (a Partial source stays Partial; a
    source sharded on the looked-up ``dim`` reads its piece and masks the rest, giving a partial
    sum), choose, and run the masked local lookup when ``dim`` of the source is sharded."""
    st += [_strategy(locs, Partial(r), {0: Partial(r)}) for r in _partials(x)]
    if _masked_ok(x):
        st.append(_strategy(locs, Partial("sum"), {0: Shard(dim)}))
    full = choose(call, st)
    pieces = _sharded_pieces(call, full, 0, [dim])
    if pieces:
        full.local_fn = _masked_reader(call.op, dim, *pieces[dim], x.shape[dim], gather=gather)
    return full


def _masked_reader(op, dim, off, size, n, gather):
    """index_select / gather against a piece [off, off + size) of dim: ids elsewhere give 0."""
    def run(x, d_, index, *args, **kwargs):
        local, valid = _local_ids(index, off, size, n, False, op, dim)
        if size == 0:  # nothing here: look up zeros of the right shape
            shape = list(x.shape)
            shape[dim] = 1
            x, local = x.new_zeros(shape), torch.zeros_like(local)
        out = op(x, d_, local.clamp(0, max(size - 1, 0)), *args, **kwargs)
        if not gather:
            view = [1] * out.ndim
            if out.ndim:
                view[dim] = -1
            valid = valid.reshape(view)
        return out.masked_fill(~valid, 0)
    return run


@register_rule(aten.gather.default)
def _gather(call):
    if len(call.inputs) < 2:  # a 0-d plain index: only a 0-d self can take it
        return [((R,), (R,))]
    x, idx = call.inputs[0], call.inputs[1]
    dim = call.args[1] % max(x.ndim, 1)
    locs = input_locations(call)
    st = [_strategy(locs, R, {})]
    # out[i, j] = x[i, idx[i, j]] (dim=1): a non-gathered dim shards x and idx alike when their
    # pieces line up (equal sizes); the gathered dim of idx shards the output directly
    st += [_strategy(locs, Shard(d), {0: Shard(d), 2: Shard(d)})
           for d in range(x.ndim) if d != dim and x.shape[d] == idx.shape[d]]
    st.append(_strategy(locs, Shard(dim), {2: Shard(dim)}))
    return _choose_lookup(call, st, locs, x, dim, gather=True)


# ------------------------------------------------------------------ scatter family
_SCATTER = [aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
            aten.scatter_.src, aten.scatter_.value, aten.scatter_.reduce,
            aten.scatter_.value_reduce, aten.scatter_add.default, aten.scatter_add_.default,
            aten.scatter_reduce.two, aten.scatter_reduce_.two]


def _scatter_reduction(call) -> str | None:
    """How colliding writes combine: None (overwrite), 'sum', 'prod', 'mean', 'amax', 'amin'."""
    name = call.op._schema.name.split("::")[-1].rstrip("_")
    if name == "scatter_add":
        return "sum"
    reduce = call.kwargs.get("reduce", call.args[4] if len(call.args) > 4 else None)
    return {"add": "sum", "multiply": "prod"}.get(reduce, reduce)


def _includes_self(call) -> bool:
    """scatter_reduce / index_reduce(..., include_self=False) leave x out of written slots."""
    return call.kwargs.get("include_self", call.args[5] if len(call.args) > 5 else True)


@register_rule(*_SCATTER)
def _scatter(call):
    x, idx = call.inputs[0], call.inputs[1]
    src = call.args[3] if isinstance(call.args[3], DTensorSpec) else None
    dim = call.args[1] % max(x.ndim, 1)
    red = _scatter_reduction(call)
    locs = input_locations(call)
    st = [_strategy(locs, R, {})]
    st += [_strategy(locs, Shard(d), {0: Shard(d), 2: Shard(d), 3: Shard(d)})
           for d in range(x.ndim) if d != dim and x.shape[d] == idx.shape[d]
           and (src is None or src.shape[d] == idx.shape[d])]
    st.append(_strategy(locs, Shard(dim), {0: Shard(dim)}))  # writes land in their piece
    if red == "sum" and _includes_self(call) and src is not None and \
            src.shape[dim] == idx.shape[dim]:
        # each rank adds its share of the sources: x counted once (R -> P puts zeros off 0).
        # Not with include_self=False: a rank that writes a slot drops its share of x there,
        # one that does not keeps it, so the sum over ranks would count x where others wrote
        st.append(_strategy(locs, Partial("sum"), {0: Partial("sum"), 2: Shard(dim),
                                                   3: Shard(dim)}))
    keeps = {None: REDUCE_OPS, "sum": LINEAR_REDUCE_OPS, "amax": ("max",),
             "amin": ("min",)}.get(red, ())
    for r in _partials(x, src):
        if r in keeps:
            st.append(_strategy(locs, Partial(r), {0: Partial(r), 3: Partial(r)}))
    full = choose(call, st)
    pieces = _sharded_pieces(call, full, 0, [dim])
    if pieces:
        inplace = call.op._schema.name.endswith("_")
        full.local_fn = _padded_writer(call.op, pieces, {dim: x.shape[dim]}, _dim_index_of(1),
                                       False, inplace)
    return with_scalar_zeroing(call, full, (3,) if red in (None, "sum") else ())


# ------------------------------------------------------------------ index_add / copy / fill
@register_rule(aten.index_add.default, aten.index_add_.default, aten.index_copy.default,
               aten.index_copy_.default, aten.index_fill.int_Scalar, aten.index_fill.int_Tensor,
               aten.index_fill_.int_Scalar, aten.index_fill_.int_Tensor,
               aten.index_reduce.default, aten.index_reduce_.default)
def _index_dim_write(call):
    x = call.inputs[0]
    dim = call.args[1] % max(x.ndim, 1)
    name = call.op._schema.name.split("::")[-1].rstrip("_")
    src = call.args[3] if len(call.args) > 3 and isinstance(call.args[3], DTensorSpec) else None
    idx = call.args[2] if isinstance(call.args[2], DTensorSpec) else None
    locs = input_locations(call)
    fill = name == "index_fill"
    # a 0-d source (or self) has no dim to shard alongside self's
    dims_line_up = x.ndim > 0 and (src is None or src.ndim == x.ndim)
    st = [_strategy(locs, R, {})]
    st += [_strategy(locs, Shard(d), {0: Shard(d)} if fill else {0: Shard(d), 3: Shard(d)})
           for d in range(x.ndim) if d != dim and (fill or dims_line_up)]
    if x.ndim > 0:
        st.append(_strategy(locs, Shard(dim), {0: Shard(dim)}))
    if name == "index_add" and idx is not None and src is not None and idx.ndim == 1 and \
            dims_line_up:
        st.append(_strategy(locs, Partial("sum"), {0: Partial("sum"), 2: Shard(0),
                                                   3: Shard(dim)}))
    if name == "index_reduce":  # colliding writes combine: only amax / amin keep a Partial
        keeps = {"amax": ("max",), "amin": ("min",)}.get(call.args[4], ())
    else:
        keeps = LINEAR_REDUCE_OPS if name == "index_add" else REDUCE_OPS
    st += [_strategy(locs, Partial(r), {0: Partial(r), 3: Partial(r)})
           for r in _partials(x, src) if r in keeps]
    full = choose(call, st)
    pieces = _sharded_pieces(call, full, 0, [dim])
    if pieces:
        full.local_fn = _padded_writer(call.op, pieces, {dim: x.shape[dim]}, _dim_index_of(1),
                                       fill, call.op._schema.name.endswith("_"))
    return with_scalar_zeroing(call, full, (3,))


# ------------------------------------------------------------------ advanced indexing
class _Layout:
    """Where ``x[indices]`` puts each dim: the broadcast index dims form one block, at the first
    indexed dim if the indexed dims are adjacent, else in front."""

    def __init__(self, x_ndim, indices):
        self.indexed = [k for k, t in enumerate(indices) if t is not None]
        shapes = [tuple(t.shape) for t in indices if t is not None]
        self.block = tuple(torch.broadcast_shapes(*shapes))
        first, last = self.indexed[0], self.indexed[-1]
        adjacent = self.indexed == list(range(first, last + 1))
        self.start = first if adjacent else 0
        rest = [d for d in range(x_ndim) if d not in self.indexed]
        self.out_ndim = len(rest) + len(self.block)
        self._map = {}
        for k, d in enumerate(rest):
            if adjacent:
                self._map[d] = d if d < first else d - len(self.indexed) + len(self.block)
            else:
                self._map[d] = len(self.block) + k

    def out_dim(self, d):
        return self._map.get(d)


def _is_mask(t) -> bool:
    return t is not None and t.dtype in (torch.bool, torch.uint8)


def _block_placements(locs, indices, layout, b):
    """Each index tensor's placement when the index block's dim b is sharded."""
    placed = {}
    for loc in locs:
        if loc[0] == 1:
            t = indices[loc[1]]
            bb = b - (len(layout.block) - t.ndim)
            placed[loc] = Shard(bb) if bb >= 0 and t.shape[bb] == layout.block[b] else R
    return placed


def _ins(locs, by_loc: dict, default=R):
    return tuple(by_loc.get(loc, by_loc.get(loc[0], default)) for loc in locs)


@register_rule(aten.index.Tensor, aten._unsafe_index.Tensor)
def _index(call):
    x, indices = call.inputs[0], call.args[1]
    if any(_is_mask(t) for t in indices) or not any(t is not None for t in indices):
        return Decompose(_masks_to_ids(call.op))
    layout = _Layout(x.ndim, indices)
    locs = input_locations(call)
    st = [((R,), _ins(locs, {}))]
    for d in range(x.ndim):
        if layout.out_dim(d) is not None:
            st.append(((Shard(layout.out_dim(d)),), _ins(locs, {0: Shard(d)})))
    for b in range(len(layout.block)):
        st.append(((Shard(layout.start + b),), _ins(locs, _block_placements(locs, indices,
                                                                            layout, b))))
    st += [((Partial(r),), _ins(locs, {0: Partial(r)})) for r in _partials(x)]
    if _masked_ok(x):
        st += [((Partial("sum"),), _ins(locs, {0: Shard(d)})) for d in layout.indexed]
    full = choose(call, st)
    pieces = _sharded_pieces(call, full, 0, layout.indexed)
    if pieces:
        full.local_fn = _masked_index(call.op, pieces, x.shape, layout)
    return full


def _masked_index(op, pieces, x_shape, layout):
    """x[indices] against this rank's piece of the sharded indexed dims: ids elsewhere give 0."""
    def run(x, indices):
        indices = list(indices)
        valid = None
        for d, (off, size) in pieces.items():
            local, ok = _local_ids(indices[d], off, size, x_shape[d], True, op, d)
            indices[d] = local.clamp(0, max(size - 1, 0))
            valid = ok if valid is None else valid & ok
        if any(size == 0 for _, size in pieces.values()):
            shape = list(x.shape)
            for d, (_, size) in pieces.items():
                shape[d] = max(size, 1)
            x = x.new_zeros(shape)
        out = op(x, indices)
        block = len(layout.block)
        valid = valid.reshape((1,) * (block - valid.ndim) + tuple(valid.shape))
        view = (1,) * layout.start + tuple(valid.shape) + (1,) * (out.ndim - layout.start - block)
        return out.masked_fill(~valid.reshape(view), 0)
    return run


@register_rule(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default,
               aten._unsafe_index_put.default)
def _index_put(call):
    x, indices, values = call.inputs[0], call.args[1], call.args[2]
    if any(_is_mask(t) for t in indices) or not any(t is not None for t in indices):
        return Decompose(_masks_to_ids(call.op))
    accumulate = call.kwargs.get("accumulate", call.args[3] if len(call.args) > 3 else False)
    layout = _Layout(x.ndim, indices)
    vals = values if isinstance(values, DTensorSpec) else None
    locs = input_locations(call)
    result = [0] * layout.out_ndim  # sizes of x[indices], to align values with
    for d in range(x.ndim):
        if layout.out_dim(d) is not None:
            result[layout.out_dim(d)] = x.shape[d]
    result[layout.start:layout.start + len(layout.block)] = layout.block

    def value_placement(out_dim):
        if vals is None:
            return {}
        vd = out_dim - (len(result) - vals.ndim)
        return {2: Shard(vd) if vd >= 0 and vals.shape[vd] == result[out_dim] else R}

    st = [((R,), _ins(locs, {}))]
    for d in range(x.ndim):
        od = layout.out_dim(d)
        if od is not None:
            st.append(((Shard(d),), _ins(locs, {0: Shard(d), **value_placement(od)})))
    st += [((Shard(d),), _ins(locs, {0: Shard(d)})) for d in layout.indexed]  # padded writes
    if accumulate:
        for b in range(len(layout.block)):
            placed = _block_placements(locs, indices, layout, b)
            placed.update({0: Partial("sum"), **value_placement(layout.start + b)})
            st.append(((Partial("sum"),), _ins(locs, placed)))
    keeps = LINEAR_REDUCE_OPS if accumulate else REDUCE_OPS
    st += [((Partial(r),), _ins(locs, {0: Partial(r), 2: Partial(r)}))
           for r in _partials(x, vals) if r in keeps]
    full = choose(call, st)
    pieces = _sharded_pieces(call, full, 0, layout.indexed)
    if pieces:
        full.local_fn = _padded_writer(call.op, pieces, {d: x.shape[d] for d in pieces},
                                       _list_index_of, True, call.op._schema.name.endswith("_"))
    return with_scalar_zeroing(call, full, (2,))


def _list_index_of(d):
    """For index_put(self, indices, ...): read/replace indices[d] (args after self)."""
    def get(args):
        return args[0][d]

    def put(args, v):
        args[0] = list(args[0])
        args[0][d] = v
    return get, put


def _masks_to_ids(op):
    """x[mask] == x[mask.nonzero().unbind(1)]: replicate the mask, find its ids, and index with
    them (the ids are replicated, so every rank knows the data-dependent output length)."""
    def run(x, indices, *args, **kwargs):
        mesh = x._spec.mesh
        ids = []
        for t in indices:
            if not _is_mask(t):
                ids.append(t)
                continue
            m = replicated_local(t) if isinstance(t, DTensor) else t
            if m.ndim == 0:  # x[True] adds a dim: no ids to speak of; do it whole
                return replicated_run(op)(x, indices, *args, **kwargs)
            nz = m.nonzero()
            ids += [wrap_replicated(nz[:, k].contiguous(), mesh) for k in range(m.ndim)]
        if not any(t is not None for t in ids):
            return replicated_run(op)(x, indices, *args, **kwargs)
        return op(x, ids, *args, **kwargs)
    return run


# ------------------------------------------------------------------ one_hot
ONE_HOT = aten.one_hot.default


def _one_hot(self, num_classes=-1):
    """``F.one_hot`` of an integer DTensor: local one-hot rows, sharded like the ids."""
    from .nn import all_reduce_over
    if self.dtype != torch.int64:  # checked here: a rank with an empty piece must fail alike
        raise RuntimeError(f"one_hot is only applicable to index tensor of type LongTensor "
                           f"(got a DTensor of {self.dtype})")
    if any(p.is_partial() for p in self.placements):  # one-hot rows are not linear in the ids
        self = self.redistribute(self.device_mesh,
                                 [R if p.is_partial() else p for p in self.placements])
    spec, local = self._spec, self._local_tensor
    if self.numel() == 0:
        if num_classes == -1:
            raise RuntimeError("one_hot: can not infer the number of classes from an empty "
                               "tensor; pass num_classes")
    else:  # global (-min, max): empty pieces contribute the identity of max
        sharding = [i for i, p in enumerate(spec.placements) if p.is_shard()]
        ident = torch.iinfo(torch.int64).min
        stats = torch.stack([-local.min(), local.max()]) if local.numel() else \
            torch.full((2,), ident, dtype=torch.int64, device=local.device)
        neg_lo, hi = all_reduce_over(stats, spec.mesh, sharding, "max").tolist()
        if -neg_lo < 0:
            raise RuntimeError("one_hot: class values must be non-negative "
                               f"(the DTensor holds {-neg_lo})")
        if num_classes == -1:
            num_classes = hi + 1
        elif hi >= num_classes:
            raise RuntimeError(f"one_hot: class values must be smaller than num_classes="
                               f"{num_classes} (the DTensor holds {hi})")
    out = ONE_HOT.decompose(local, num_classes)  # checks num_classes itself, alike on all ranks
    shape = torch.Size(tuple(self.shape) + (num_classes,))
    out_spec = DTensorSpec(spec.mesh, spec.placements,
                           TensorMeta(shape, contiguous_stride(shape), out.dtype),
                           tuple(spec.shard_order) + ((),))
    return DTensor(out, out_spec)


intercept_composite(ONE_HOT, _one_hot)


@register_rule(ONE_HOT)
def _one_hot_rule(call):
    return Decompose(_one_hot)  # reached whole only without autograd keys (inference mode)
