"""Random ops: the same global values as plain torch under the same seed, whatever the mesh.

A CPU generator (mt19937) cannot skip ahead to the part of the stream that belongs to this rank's
piece, so every rank runs the op itself on a *global-shaped stand-in* (same shape, strides and
dtype as the global tensor) with its own generator, keeps its piece and drops the rest. Every rank
draws the same numbers in the same order, so the result equals the unsharded op and all ranks'
generators advance identically (they stay in sync for the next op). The price is one global-size
temporary per random op per rank (see docs/random.md).

Tensor-valued parameters (bernoulli's ``p``, normal's ``mean``/``std``, dropout's input) are
embedded at this rank's region of a global-shaped stand-in filled with a harmless value: the
number of draws per element never depends on the parameter values, so the elements in this
rank's region come out exactly as in the global op, without gathering the parameters.

Before drawing, the ranks that must hold the same values are checked to share the generator
state (``dtensor_lite/random.py``: the sync modes, seeding, the check).
"""
from __future__ import annotations

import torch

from .. import _torch_names as torch_names
from ..placements import Replicate, Shard
from ..spec import DTensorSpec
from ..random import agreement_dims, ranks_key, sync_before_draw
from ._registry import FullStrategy, get_rule, register_rule

__all__ = ["random_rule"]

aten = torch_names.aten

# ---------------------------------------------------------------- local pieces
def _region(spec: DTensorSpec):
    shape, offset = spec.local_shape_and_offset()
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def _sum_partial_elsewhere(spec: DTensorSpec) -> bool:
    """True if this rank's piece of a value written into ``spec`` must be zeros: for a
    Partial(sum) mesh dim only coordinate 0 holds the value (avg/max/min: every rank does)."""
    coord = spec.mesh.get_coordinate()
    return any(p.is_partial("sum") and coord[i] != 0 for i, p in enumerate(spec.placements))


def _embed(local: torch.Tensor, region, global_shape, fill) -> torch.Tensor:
    """A global-shaped tensor holding ``local`` at ``region`` and ``fill`` elsewhere."""
    full = torch.full(tuple(global_shape), fill, dtype=local.dtype, device=local.device)
    full[region] = local
    return full


def _keep(full: torch.Tensor, index) -> torch.Tensor:
    """This rank's piece of a drawn global tensor (``index``: :func:`_short_index`'s), as a
    copy, so the global temporary is freed instead of living on behind a view."""
    return full[index].clone(memory_format=torch.contiguous_format)


def _short_index(region, global_shape):
    """An index equal to ``region`` without its trailing whole-dim slices (one slice indexes in
    0.8 us, a tuple of two in 1.4 us); None if the region is the whole tensor."""
    region = list(region)
    while region and region[-1] == slice(0, global_shape[len(region) - 1]):
        region.pop()
    if not region:
        return None
    return region[0] if len(region) == 1 else tuple(region)


def _aligned(spec: DTensorSpec, out_placements, out_order, out_shape):
    """Placements (and shard order) that line ``spec`` up with an output of ``out_shape``:
    sharded like the output on the dims it shares with it, replicated on broadcast dims."""
    lead = len(out_shape) - spec.ndim
    pl = []
    for p in out_placements:
        if p.is_shard():
            d = p.dim - lead
            pl.append(Shard(d) if d >= 0 and spec.shape[d] == out_shape[p.dim] else Replicate())
        else:
            pl.append(Replicate())
    order = [()] * spec.ndim
    for d in range(spec.ndim):
        od = d + lead
        order[d] = tuple(i for i in out_order[od] if pl[i].is_shard(d))
    return tuple(pl), tuple(order)


# ---------------------------------------------------------------- rules
def _valued_positions(call, fills):
    """(position, fill) of every DTensor argument whose *values* the op reads."""
    return [(k, fill) for k, fill in fills.items()
            if k < len(call.args) and isinstance(call.args[k], DTensorSpec)]


def random_rule(call, inplace: bool, fills: dict | None = None, keep_partial: bool = False):
    """Strategy + local function for an elementwise random op.

    ``fills``: positional index -> harmless fill value for tensor arguments whose values the op
    reads (bernoulli's p, normal's mean/std, dropout's input); other tensor arguments only give
    the shape. ``keep_partial``: the op is linear in its (only) valued input for a fixed draw
    (dropout), so a Partial input may stay Partial.
    """
    op, mesh = call.op, call.mesh
    fills = fills or {}
    tensor_args = [(k, a) for k, a in enumerate(call.args) if isinstance(a, DTensorSpec)]
    if len(tensor_args) != len(call.inputs):
        raise RuntimeError(f"{op}: DTensor arguments must be passed positionally to random ops "
                           f"(got {len(call.inputs)} DTensors, {len(tensor_args)} positional)")
    valued = dict(_valued_positions(call, fills))
    if inplace:
        ref_k = 0
        out_shape = tuple(call.args[0].shape)
    else:
        out_shape = tuple(torch.broadcast_shapes(*[tuple(a.shape) for _, a in tensor_args]))
        ref_k = next((k for k, a in tensor_args if tuple(a.shape) == out_shape), None)
    ref = call.args[ref_k] if ref_k is not None else None
    if ref is None:  # every tensor argument is broadcast: draw replicated
        out_pl = (Replicate(),) * mesh.ndim
        out_order = ((),) * len(out_shape)
    else:
        out_pl = ref.placements if (inplace or keep_partial) else tuple(
            Replicate() if p.is_partial() else p for p in ref.placements)
        out_order = ref.shard_order
    ins, in_orders = [], []
    for k, a in tensor_args:
        if k not in valued or (k == ref_k and keep_partial):
            ins.append(None)  # only its shape matters, or the op is linear in it: keep it
            in_orders.append(None)
        elif a.ndim == 0:
            ins.append((Replicate(),) * mesh.ndim)
            in_orders.append(None)
        else:
            pl, order = _aligned(a, out_pl, out_order, out_shape)
            ins.append(pl)
            in_orders.append(order)
    # Partial does not change which piece a rank holds, so the output's region is ref's
    region = _region(ref) if ref is not None else tuple(slice(0, s) for s in out_shape)
    embed_at = {k: fills[k] for k in valued if call.args[k].ndim > 0}
    shape_only = {k: (tuple(a.shape), tuple(a.stride)) for k, a in tensor_args if k not in valued}
    zero_here = inplace and _sum_partial_elsewhere(ref)
    first = tensor_args[0][0]
    mesh_key = ranks_key(mesh)
    n_out = 2 if op is aten.native_dropout.default else 1
    # the mesh dims where ranks hold the same values of the result (or of dropout's mask, never
    # Partial: it has out_pl's Shard dims) must draw alike; on Shard dims each keeps its own piece
    dims = agreement_dims(mesh, [out_pl])
    draw = getattr(op, "_op", op)  # the C++ overload, without OpOverload.__call__'s frame
    # everything a call needs is fixed here, once per decision: the stand-ins' shapes, the index
    # that keeps this rank's piece (trailing whole dims left out: a one-slice index is cheaper)
    embeds = tuple(embed_at.items())
    stand_ins = tuple((k, shape, stride) for k, (shape, stride) in shape_only.items())
    piece_index = _short_index(region, out_shape)
    whole = piece_index is None  # the piece is the global tensor (replicated result)

    def local_fn(*args, **kwargs):
        sync_before_draw(mesh, mesh_key, args[first].device, kwargs.get("generator"), dims)
        dst = args[0]
        args = list(args)
        for k, fill in embeds:
            args[k] = _embed(args[k], region, out_shape, fill)
        for k, shape, stride in stand_ins:
            args[k] = torch.empty_strided(shape, stride, dtype=args[k].dtype, device=args[k].device)
        out = draw(*args, **kwargs)
        if inplace:
            if zero_here:
                return dst.zero_()
            return dst.copy_(out if whole else out[piece_index])
        if whole:
            return out
        if isinstance(out, (tuple, list)):  # native_dropout: output and mask
            return type(out)(_keep(o, piece_index) for o in out)
        return _keep(out, piece_index)

    outs = [out_pl]
    out_orders = [out_order]
    if n_out == 2:  # dropout's mask: exact on every rank, so never Partial
        outs.append(tuple(Replicate() if p.is_partial() else p for p in out_pl))
        out_orders.append(out_order)
    return FullStrategy(outs=outs, ins=ins, local_fn=local_fn, out_orders=out_orders,
                        in_orders=in_orders)


# ---------------------------------------------------------------- registrations
def _reg(ops, inplace, fills=None, keep_partial=False):
    register_rule(*ops)(lambda call: random_rule(call, inplace, fills, keep_partial))


# values are drawn into the tensor itself (in place) or into a tensor shaped like the input;
# nothing but the input's shape, dtype and strides matters
_reg([aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float,
      aten.exponential_.default, aten.random_.default, getattr(aten.random_, "from"),
      aten.random_.to, aten.cauchy_.default, aten.log_normal_.default, aten.geometric_.default],
     inplace=True)
_reg([aten.uniform.default, aten.normal_functional.default, aten.bernoulli.p,
      aten.exponential.default, aten.random.default, getattr(aten.random, "from"), aten.random.to,
      aten.cauchy.default, aten.log_normal.default, aten.geometric.default,
      aten.rand_like.default, aten.rand_like.generator, aten.randn_like.default,
      aten.randn_like.generator, aten.randint_like.default, aten.randint_like.generator,
      aten.randint_like.low_dtype, aten.randint_like.low_generator_dtype], inplace=False)
_reg([aten.randint_like.Tensor, aten.randint_like.Tensor_generator], inplace=False,
     fills={1: None})  # ``high`` is a 0-d tensor whose value matters
# tensor parameters: their values matter, embedded at this rank's region (0.5 / 0 / 1 are
# valid everywhere: a probability, a mean, a standard deviation)
_reg([aten.bernoulli_.Tensor], inplace=True, fills={1: 0.5})
_reg([aten.bernoulli.default], inplace=False, fills={0: 0.5})
_reg([aten.bernoulli.Tensor], inplace=False, fills={1: 0.5})
_reg([aten.normal.Tensor_float], inplace=False, fills={0: 0.0})
_reg([aten.normal.float_Tensor], inplace=False, fills={1: 1.0})
_reg([aten.normal.Tensor_Tensor], inplace=False, fills={0: 0.0, 1: 1.0})
# dropout(x) = x * mask * scale is linear in x for a fixed mask: a Partial input stays Partial
_reg([aten.native_dropout.default], inplace=False, fills={0: 0.0}, keep_partial=True)


# nn.init.orthogonal_ draws a replicated matrix and takes its QR factorisation. A QR of a sharded
# matrix has no cheap distributed form, so the factors are computed replicated; a rule that the
# matrix-family module registers (imported before this one) takes precedence.
def _replicated(call):
    return [((Replicate(), Replicate()), (Replicate(),) * len(call.inputs))]


if get_rule(aten.linalg_qr.default) is None:
    register_rule(aten.linalg_qr.default)(_replicated)
