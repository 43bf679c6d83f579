"""Shape ops: permutations, reshapes, expand, slicing and splitting (cat, stack and flip live
in tensor_ops).

* Permutations move shards with their dims; Partial passes through every shape op (each one only
  moves or copies elements, which commutes with any elementwise reduction over ranks).
* Reshapes keep a shard whenever every rank's piece stays one contiguous block of the new dim
  layout, checked piece by piece over the whole mesh (uneven and empty shards included), and
  replicate the innermost offending mesh dim otherwise. Several mesh dims sharding a dim that a
  reshape splits go to successive new dims where that keeps the pieces whole.
* Slicing an unsharded dim keeps every shard. Slicing a sharded dim keeps the shard when each rank
  already holds its piece of the result (e.g. ``x[::2]`` on an even split); otherwise a short
  slice (and any ``select``) becomes ``Partial(sum)`` of zero-padded local pieces -- no
  communication now, and resolving it later moves only the slice -- and a long one gathers.
"""
from __future__ import annotations

import itertools
import math

import torch

from .. import _torch_names as torch_names
from ..placements import Partial, Replicate, Shard
from ..spec import DTensorSpec, TensorMeta, shard_orders
from ._registry import FullStrategy, register_rule
from .kit import arg_at

aten = torch_names.aten
R = Replicate()
_INT_MAX = 2 ** 63 - 1


# ------------------------------------------------------------------ shard orders
def carry_order(spec, out_placements, out_ndim: int) -> tuple:
    """Shard order of an output whose Shard placements each come from one input dim: mesh dims
    keep the relative order they had in the input (FSDP-over-TP layouts survive shape ops)."""
    ranking = {i: k for order in spec.shard_order for k, i in enumerate(order)}
    return shard_orders(out_placements, out_ndim, ranking)


def kept_order(spec, ins) -> tuple:
    """The input's shard order restricted to the mesh dims that still shard in ``ins``."""
    return tuple(tuple(i for i in order if ins[i] == Shard(d))
                 for d, order in enumerate(spec.shard_order))


def full_strategy(spec, ins, outs, out_ndims, local_fn=None) -> FullStrategy:
    """A FullStrategy for a single-input op with one or more outputs (``outs``/``out_ndims`` are
    per output), carrying shard orders from the input to the outputs."""
    ins = tuple(ins)
    in_orders = None
    if ins != spec.placements:
        in_orders = [kept_order(spec, ins)]
    return FullStrategy(outs=[tuple(o) for o in outs], ins=[ins], local_fn=local_fn,
                        out_orders=[carry_order(spec, o, n) for o, n in zip(outs, out_ndims)],
                        in_orders=in_orders)


def _meta(spec):
    return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")


class _BadCall(Exception):
    """torch rejects the call's arguments: the dispatcher's own shape pass reports it."""


def _global_out(call, op=None):
    """The op's global output on meta tensors (``op`` defaults to the call's)."""
    try:
        return (op or call.op)(_meta(call.inputs[0]), *call.args[1:], **call.kwargs)
    except (RuntimeError, IndexError, ValueError, TypeError) as e:
        raise _BadCall() from e


def _rejects_bad_calls(rule):
    """Let the dispatcher report arguments torch rejects (it names the op and shapes): any
    strategy will do, the metadata pass raises before it runs."""
    def wrapped(call):
        try:
            return rule(call)
        except _BadCall:
            return [((R,), (R,))]
    wrapped.__name__ = rule.__name__
    return wrapped


def _out_spec(spec, outs, shape, order=None):
    shape = torch.Size(shape)
    if order is None:
        order = carry_order(spec, outs, len(shape))
    return DTensorSpec(spec.mesh, tuple(outs), TensorMeta(shape, (), spec.dtype), order)


def _coords(mesh):
    return itertools.product(*[range(n) for n in mesh.shape])


def _sharding(spec, d):
    """Mesh dims that shard tensor dim ``d``."""
    return [i for i, p in enumerate(spec.placements) if p.is_shard(d)]


def _linear_partials_only(spec) -> bool:
    return all(p.is_linear for p in spec.placements if p.is_partial())


# ------------------------------------------------------------------ permutations
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
@_rejects_bad_calls
def _transpose(call):
    spec = call.inputs[0]
    _global_out(call)
    ndim = spec.ndim
    d0, d1 = call.args[1] % max(ndim, 1), call.args[2] % max(ndim, 1)
    perm = list(range(ndim))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permuted(spec, perm)


@register_rule(aten.permute.default)
@_rejects_bad_calls
def _permute(call):
    spec = call.inputs[0]
    _global_out(call)
    return _permuted(spec, [d % max(spec.ndim, 1) for d in call.args[1]])


# ------------------------------------------------------------------ expand
@register_rule(aten.expand.default)
@_rejects_bad_calls
def _expand(call):
    spec = call.inputs[0]
    out_shape = tuple(_global_out(call).shape)
    lead = len(out_shape) - spec.ndim
    ins, outs = [], []
    for p in spec.placements:
        if p.is_shard() and spec.shape[p.dim] != out_shape[p.dim + lead]:
            ins.append(R)  # a size-1 dim being broadcast cannot stay sharded
            outs.append(R)
        else:
            ins.append(p)
            outs.append(Shard(p.dim + lead) if p.is_shard() else p)
    strategy = full_strategy(spec, ins, [outs], [len(out_shape)])
    strategy.local_fn = _local_shape_fn(_out_spec(spec, outs, out_shape), aten.expand.default)
    return strategy


def _local_shape_fn(out_spec, local_op):
    """``local_op(x, local_out_shape)``: sizes in the call are global, the piece is not."""
    local_shape = list(out_spec.local_shape())

    def local_fn(x, *args, **kwargs):
        return local_op(x, local_shape)
    return local_fn


# ------------------------------------------------------------------ reshapes
def _view_groups(old, new):
    """Pair up runs of old and new dims with equal products (size-1 dims ride along).
    Sizes must be positive (empty tensors never get here)."""
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


def _flat_range(dims, full, piece, offset):
    """The piece's block in the flattened run ``dims``: ``(start, length)``, "empty", or None
    when the piece is not one contiguous block (a partial dim with non-singleton dims before it,
    or full dims after it)."""
    if any(piece[d] == 0 for d in dims):
        return "empty"
    partial = [k for k, d in enumerate(dims) if piece[d] != full[d]]
    if not partial:
        return (0, math.prod(full[d] for d in dims))
    j = partial[-1]
    if any(piece[dims[k]] != 1 for k in range(j)):
        return None
    start, inner = 0, 1
    for k in reversed(range(len(dims))):
        start += offset[dims[k]] * inner
        if k == j:
            length = piece[dims[k]] * inner
        inner *= full[dims[k]]
    return (start, length)


def _size1_carried(og, ng, old, new) -> bool:
    """A run that is one size-1 dim before and after (``(1, 2, 2) -> (1, 4)``'s first dim):
    a shard of it (one rank holds the row, the others empty pieces) stays a shard of the new
    dim, with every rank's piece unchanged, so the view moves nothing (PyTorch's
    test_dtensor_view_op_uneven)."""
    return len(og) == 1 and len(ng) == 1 and old[og[0]] == 1 and new[ng[0]] == 1


def _assign_reshape(spec, old, new, groups, seqs):
    """Input/output placements and orders when run ``g`` keeps the mesh dims ``seqs[g]``.

    A run's mesh dims, outer old dims first and each old dim's in its shard order, go to the
    first real new dim of the run; once their sizes multiply to that new dim's size the next
    mesh dim moves on to the next new dim: [S(0), S(0)] of an (8, 6) viewed as (2, 4, 6) becomes
    [S(0), S(1)], and viewing that back as (8, 6) gives [S(0), S(0)] again."""
    ins = [R if p.is_shard() else p for p in spec.placements]
    outs = list(ins)
    in_order = [[] for _ in old]
    out_order = [[] for _ in new]
    for g, (og, ng) in enumerate(groups):
        if _size1_carried(og, ng, old, new):  # the same piece: the rank holding it keeps it
            for i in seqs.get(g, ()):
                k = spec.placements[i].dim
                ins[i], outs[i] = Shard(k), Shard(ng[0])
                in_order[k].append(i)
                out_order[ng[0]].append(i)
            continue
        real_new = [d for d in ng if new[d] != 1]
        t, split = 0, 1
        for i in seqs.get(g, ()):
            while t < len(real_new) and split >= new[real_new[t]]:
                t, split = t + 1, 1
            if t == len(real_new):
                break
            k = spec.placements[i].dim
            ins[i], outs[i] = Shard(k), Shard(real_new[t])
            in_order[k].append(i)
            out_order[real_new[t]].append(i)
            split *= spec.mesh.shape[i]
    return (ins, outs, tuple(tuple(o) for o in in_order), tuple(tuple(o) for o in out_order))


def _reshape_strategy(call, out_shape, local_op):
    spec = call.inputs[0]
    old, new = tuple(spec.shape), tuple(out_shape)
    if math.prod(old) == 0:
        # nothing to move: every rank's (empty) piece already is the whole (empty) result
        outs = (R,) * spec.mesh.ndim
        return FullStrategy(outs=[outs], ins=[None],
                            local_fn=lambda x, *a, **k: local_op(x, list(new)))
    groups = _view_groups(old, new)
    # a shard of a size-1 dim (one rank holds it all) never lines up with a longer new dim: it
    # is replicated up front, so the alignment search below does not give up good shards for it
    seqs = {g: [i for k in og if old[k] != 1 or _size1_carried(og, ng, old, new)
                for i in spec.shard_order[k]]
            for g, (og, ng) in enumerate(groups)
            if og and (any(new[d] != 1 for d in ng) or _size1_carried(og, ng, old, new))}
    while True:
        ins, outs, in_order, out_order = _assign_reshape(spec, old, new, groups, seqs)
        bad = _misaligned_groups(spec, ins, outs, in_order, out_order, old, new, groups)
        if not bad:
            break
        for g in bad:
            seqs[g].pop()  # give up the innermost mesh dim first: outer ones may still align
    in_spec = DTensorSpec(spec.mesh, tuple(ins), spec.tensor_meta, in_order)
    out_spec = _out_spec(spec, outs, new, out_order)
    return FullStrategy(outs=[tuple(outs)], ins=[tuple(ins)],
                        local_fn=_local_shape_fn(out_spec, local_op),
                        out_orders=[out_order], in_orders=[in_spec.shard_order])


def _misaligned_groups(spec, ins, outs, in_order, out_order, old, new, groups):
    """Runs in which some rank's piece is not the same flat block before and after."""
    if all(not p.is_shard() for p in ins):
        return []
    in_spec = DTensorSpec(spec.mesh, tuple(ins), spec.tensor_meta, in_order)
    out_spec = _out_spec(spec, outs, new, out_order)
    checked = [g for g, (og, ng) in enumerate(groups) if og and ng and any(in_order[k] for k in og)]
    bad = set()
    for coord in _coords(spec.mesh):
        in_shape, in_off = in_spec.local_shape_and_offset(coord)
        out_shape, out_off = out_spec.local_shape_and_offset(coord)
        for g in checked:
            og, ng = groups[g]
            a = _flat_range(og, old, in_shape, in_off)
            if a is None or a != _flat_range(ng, new, out_shape, out_off):
                bad.add(g)
    return sorted(bad)


def _viewing(op):
    """``op(x, shape)`` on a local piece, copying when the piece's strides allow no view (a
    gathered or strided piece: the global tensor's strides say nothing about the local ones)."""
    if op is aten.view.default:
        # through Tensor.view: the same op, parsed in generated C++ (1 us less per call), with
        # the sizes spread (``x.view(64, 8, 8)``: 0.4 us less than a list); a 0-d shape as a list
        view = torch.Tensor.view

        def local_view(x, shape):
            try:
                return view(x, *shape) if shape else view(x, shape)
            except (RuntimeError, ValueError):  # fake tensors (torch.compile) raise ValueError
                return aten.reshape.default(x, shape)
        return local_view
    call = op

    def local_op(x, shape):
        try:
            return call(x, shape)
        except (RuntimeError, ValueError):  # fake tensors (torch.compile) raise ValueError
            return aten.reshape.default(x, shape)
    return local_op


_view_local = _viewing(aten.view.default)


@register_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
@_rejects_bad_calls
def _view(call):
    out_shape = tuple(_global_out(call, aten.reshape.default).shape)
    return _reshape_strategy(call, out_shape, _viewing(call.op))


@register_rule(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default,
               aten.flatten.using_ints, aten.unflatten.int)
@_rejects_bad_calls
def _squeeze_like(call):
    out_shape = tuple(_global_out(call).shape)
    return _reshape_strategy(call, out_shape, _view_local)


# ------------------------------------------------------------------ slicing
def _slice_bounds(n, start, end, step):
    """Python-style clamped (start, length) of ``[start:end:step]`` on a dim of size n."""
    start = 0 if start is None else start
    end = _INT_MAX if end is None else end
    start = start + n if start < 0 else start
    end = end + n if end < 0 else end
    start, end = min(max(start, 0), n), min(max(end, 0), n)
    return start, max(0, -(-(end - start) // step))


def _sources_held(in_spec, out_spec, d, start, step):
    """Does every rank hold the input rows its piece of the slice result needs?"""
    for coord in _coords(in_spec.mesh):
        (in_shape, in_off), (out_shape, out_off) = (in_spec.local_shape_and_offset(coord),
                                                    out_spec.local_shape_and_offset(coord))
        if out_shape[d] == 0:
            continue
        first = start + out_off[d] * step
        last = start + (out_off[d] + out_shape[d] - 1) * step
        if first < in_off[d] or last >= in_off[d] + in_shape[d]:
            return False
    return True


def _pad_to_partial_ok(spec) -> bool:
    # zeros are the identity of sum only; bool has no exact sum on the wire
    return spec.dtype != torch.bool and _linear_partials_only(spec)


@register_rule(aten.slice.Tensor)
@_rejects_bad_calls
def _slice(call):
    spec = call.inputs[0]
    _global_out(call)  # validates the arguments (a 0-d input, an index out of range)
    ndim = spec.ndim
    d = arg_at(call, 1, "dim", 0) % max(ndim, 1)
    step = arg_at(call, 4, "step", 1)
    n = spec.shape[d]
    start, length = _slice_bounds(n, arg_at(call, 2, "start", None), arg_at(call, 3, "end", None), step)
    M = _sharding(spec, d)
    if not M:
        return full_strategy(spec, spec.placements, [spec.placements], [ndim])
    out_shape = list(spec.shape)
    out_shape[d] = length
    out_spec = _out_spec(spec, spec.placements, out_shape)
    if _sources_held(spec, out_spec, d, start, step):
        o = spec.local_shape_and_offset()[1][d]
        out_shape_local, out_off = out_spec.local_shape_and_offset()
        size = out_shape_local[d]
        lstart = start + out_off[d] * step - o

        def local_slice(x, *args, **kwargs):
            if size == 0:
                return aten.slice.Tensor(x, d, 0, 0)
            return aten.slice.Tensor(x, d, lstart, lstart + (size - 1) * step + 1, step)
        return full_strategy(spec, spec.placements, [spec.placements], [ndim], local_slice)
    if 2 * length <= n and _pad_to_partial_ok(spec):
        outs = [Partial("sum") if i in M else p for i, p in enumerate(spec.placements)]
        (shape, off) = spec.local_shape_and_offset()
        o, held = off[d], shape[d]
        jlo = max(0, -((start - o) // step))
        jhi = min(length, -((start - o - held) // step))

        def local_pad(x, *args, **kwargs):
            out_local = list(x.shape)
            out_local[d] = length
            out = x.new_zeros(out_local)
            if jhi > jlo:
                src = start + jlo * step - o
                out.narrow(d, jlo, jhi - jlo).copy_(
                    aten.slice.Tensor(x, d, src, src + (jhi - jlo - 1) * step + 1, step))
            return out
        return full_strategy(spec, spec.placements, [outs], [ndim], local_pad)
    ins = [R if i in M else p for i, p in enumerate(spec.placements)]
    return full_strategy(spec, ins, [ins], [ndim])


@register_rule(aten.select.int)
@_rejects_bad_calls
def _select(call):
    spec = call.inputs[0]
    _global_out(call)  # validates the arguments (a 0-d input, an index out of range)
    ndim = spec.ndim
    d = call.args[1] % max(ndim, 1)
    index = call.args[2]
    index = index + spec.shape[d] if index < 0 else index
    M = _sharding(spec, d)
    drop = [Shard(p.dim - (p.dim > d)) if p.is_shard() and p.dim != d else p
            for p in spec.placements]
    if not M:
        return full_strategy(spec, spec.placements, [drop], [ndim - 1])
    if not _pad_to_partial_ok(spec):
        ins = [R if i in M else p for i, p in enumerate(spec.placements)]
        outs = [R if i in M else p for i, p in enumerate(drop)]
        return full_strategy(spec, ins, [outs], [ndim - 1])
    # only the owner of row `index` has it: everyone else contributes zeros to a Partial(sum)
    outs = [Partial("sum") if i in M else p for i, p in enumerate(drop)]
    shape, off = spec.local_shape_and_offset()
    mine = off[d] <= index < off[d] + shape[d]
    local_index = index - off[d]

    def local_select(x, *args, **kwargs):
        if mine:  # a copy, not a view: writes through a Partial result must not reach x
            return aten.select.int(x, d, local_index).clone()
        out_shape = list(x.shape)
        del out_shape[d]
        return x.new_zeros(out_shape)
    return full_strategy(spec, spec.placements, [outs], [ndim - 1], local_select)


def _backward_placements(gspec, d_in_grad, out_dim_of):
    """Per mesh dim of a slice/select backward: the grad's placement (Shard dims mapped to the
    output's), Replicate for a sharded sliced dim, and Partial only where zero fill is exact."""
    ins, outs = [], []
    for p in gspec.placements:
        if p.is_shard() and p.dim == d_in_grad:
            ins.append(R)
            outs.append(R)
        elif p.is_shard():
            ins.append(p)
            outs.append(Shard(out_dim_of(p.dim)))
        elif p.is_partial() and not p.is_linear:
            ins.append(R)
            outs.append(R)
        else:
            ins.append(p)
            outs.append(p)
    return ins, outs


@register_rule(aten.slice_backward.default)
def _slice_backward(call):
    gspec = call.inputs[0]
    sizes = list(call.args[1])
    d = call.args[2] % len(sizes)
    start, length = _slice_bounds(sizes[d], call.args[3], call.args[4], call.args[5])
    step = call.args[5]
    M = _sharding(gspec, d)
    if M:  # keep the grad's shard if each rank's piece of the input grad is fed by its own rows
        out_spec = _out_spec(gspec, gspec.placements, sizes)
        if _backward_rows_held(gspec, out_spec, d, start, length, step):
            return _aligned_slice_backward(gspec, out_spec, d, start, length, step)
    ins, outs = _backward_placements(gspec, d, lambda e: e)
    out_spec = _out_spec(gspec, outs, sizes)
    local_sizes = list(out_spec.local_shape())

    def local_fn(g, input_sizes, dim, s, e, st):
        return aten.slice_backward.default(g, local_sizes, dim, s, e, st)
    return full_strategy(gspec, ins, [outs], [len(sizes)], local_fn)


def _rows_landing(o, size, start, length, step):
    """Range [jlo, jhi) of slice rows j whose target start + j*step lies in [o, o + size)."""
    jlo = max(0, -((start - o) // step))
    jhi = min(length, -((start - o - size) // step))
    return jlo, max(jlo, jhi)


def _backward_rows_held(gspec, out_spec, d, start, length, step):
    for coord in _coords(gspec.mesh):
        (g_shape, g_off), (o_shape, o_off) = (gspec.local_shape_and_offset(coord),
                                              out_spec.local_shape_and_offset(coord))
        jlo, jhi = _rows_landing(o_off[d], o_shape[d], start, length, step)
        if jhi > jlo and (jlo < g_off[d] or jhi > g_off[d] + g_shape[d]):
            return False
    return True


def _aligned_slice_backward(gspec, out_spec, d, start, length, step):
    (_, g_off), (o_shape, o_off) = (gspec.local_shape_and_offset(),
                                    out_spec.local_shape_and_offset())
    jlo, jhi = _rows_landing(o_off[d], o_shape[d], start, length, step)
    local_sizes = list(o_shape)
    lstart = start + jlo * step - o_off[d]

    def local_fn(g, *args, **kwargs):
        if jhi == jlo:
            return g.new_zeros(local_sizes)
        rows = g.narrow(d, jlo - g_off[d], jhi - jlo)
        return aten.slice_backward.default(rows, local_sizes, d, lstart,
                                           lstart + (jhi - jlo - 1) * step + 1, step)
    return full_strategy(gspec, gspec.placements, [gspec.placements], [gspec.ndim], local_fn)


@register_rule(aten.select_backward.default)
def _select_backward(call):
    gspec = call.inputs[0]
    sizes = list(call.args[1])
    d = call.args[2] % len(sizes)
    ins, outs = _backward_placements(gspec, None, lambda e: e + (e >= d))
    out_spec = _out_spec(gspec, outs, sizes)
    local_sizes = list(out_spec.local_shape())

    def local_fn(g, input_sizes, dim, index):
        return aten.select_backward.default(g, local_sizes, dim, index)
    return full_strategy(gspec, ins, [outs], [len(sizes)], local_fn)


# ------------------------------------------------------------------ split / unbind
@register_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unsafe_split.Tensor,
               aten.unsafe_split_with_sizes.default, aten.unbind.int)
@_rejects_bad_calls
def _split(call):
    spec = call.inputs[0]
    ndim = spec.ndim
    is_unbind = call.op is aten.unbind.int
    d = arg_at(call, 1 if is_unbind else 2, "dim", 0) % max(ndim, 1)
    n_out = len(_global_out(call))
    M = _sharding(spec, d)
    ins = list(spec.placements)
    if M and (is_unbind or n_out > 1):
        # each rank's chunk of the dim is not a chunk of any one piece: gather that dim
        ins = [R if i in M else p for i, p in enumerate(ins)]
    if is_unbind:
        outs = [Shard(p.dim - (p.dim > d)) if p.is_shard() else p for p in ins]
        return full_strategy(spec, ins, [outs] * n_out, [ndim - 1] * n_out)
    return full_strategy(spec, ins, [ins] * n_out, [ndim] * n_out)


# ------------------------------------------------------------------ complex views
def _complex_view(x, op):
    if x.is_conj() or x.is_neg():
        # the wrapper of a conj() DTensor carries no conj bit, its piece does (the _conj view):
        # plain torch would have resolved it before viewing, so resolve the piece
        x = x.resolve_conj().resolve_neg()
    try:
        return op(x)
    except RuntimeError:  # a strided local piece (e.g. after a gather): make it viewable
        return op(x.contiguous())


@register_rule(aten.view_as_complex.default, aten.view_as_real.default)
@_rejects_bad_calls
def _view_as_complex_or_real(call):
    # (..., 2) reals <-> (...) complex: shards of the leading dims stay; a Partial sum stays (real
    # and imaginary parts add separately); the size-2 dim cannot stay sharded
    spec = call.inputs[0]
    out_ndim = _global_out(call).ndim
    last = spec.ndim - 1
    to_complex = call.op is aten.view_as_complex.default
    ins = [R if (p.is_shard() and to_complex and p.dim == last)
           or (p.is_partial() and not p.is_linear) else p
           for p in spec.placements]
    op = call.op
    return full_strategy(spec, ins, [ins], [out_ndim], lambda x: _complex_view(x, op))
