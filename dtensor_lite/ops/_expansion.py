"""Expanding per-mesh-dim strategies into placements for every mesh dim.

A rule that returns ``(outs, ins)`` pairs for ONE mesh dim is expanded here: for each mesh dim the
pair that costs least to reach (bytes plus a latency term per collective) is chosen (ties: the one that moves nothing, then list order), and
a non-default shard order on an input that keeps its placements is carried to the outputs. Rules
that want the dispatcher's choice and then attach their own ``local_fn`` call
:func:`expand_strategies` themselves.
"""
from __future__ import annotations

import math

from ..placements import reductions_mix
from ..redistribute.steps import COLLECTIVE_LATENCY_BYTES, estimate_cost
from ..spec import DTensorSpec, shard_orders
from ._registry import FullStrategy, OpCall

__all__ = ["expand_strategies", "only_reduces_partials"]


def _estimate(spec: DTensorSpec, i: int, p, q) -> float:
    """Rough cost to move ``spec`` from p to q on mesh dim i (exact plans come later): bytes
    plus the planner's latency term per collective."""
    local = math.prod(spec.local_shape_and_offset((0,) * spec.mesh.ndim)[0]) * spec.dtype.itemsize
    return estimate_cost(p, q, local, spec.mesh.shape[i])


def _resolve_later(p, q, outs) -> float:
    """What a strategy that moves an input from ``p`` to ``q`` on one mesh dim leaves its
    consumer to pay: an all_to_all (Shard -> Shard) keeps the op's result sharded on a dim the
    caller did not choose, where gathering would have left it whole, and a consumer that needs
    it whole (the next layer's gather, ``full_tensor``) pays one more collective. Priced as that
    collective's latency term, not its bytes: a small input is gathered once (PyTorch's choice
    for topk, a norm over a sharded dim), a large one still takes the all_to_all's fewer bytes."""
    if p.is_shard() and q.is_shard() and any(o is not None and o.is_shard() for o in outs):
        return COLLECTIVE_LATENCY_BYTES
    return 0.0


def _normalize_strategy(s, n_inputs):
    outs, ins = s
    if not isinstance(outs, (list, tuple)):
        outs = (outs,)
    ins = tuple(ins)
    if len(ins) != n_inputs:
        raise RuntimeError(f"sharding strategy {s} lists {len(ins)} input placements for "
                           f"{n_inputs} DTensor inputs (a bug in the rule)")
    return tuple(outs), ins


def expand_strategies(call: OpCall, strategies, mutated=None) -> FullStrategy:
    """Pick per mesh dim among ``strategies`` (see the module docstring); ``mutated`` is the
    index of an in-place destination among ``call.inputs``, whose placement must not change --
    except a Partial that no strategy keeps (a non-linear op such as ``sqrt_`` on a sum of
    pieces): there the values require the destination reduced first, so the cheapest strategy
    that reduces it (to Replicate, or to a Shard where the rule allows one) and writes the
    result at that placement is chosen, and the dispatcher moves the destination itself
    (``_aliasing.relayout_destination``)."""
    inputs = call.inputs
    strategies = [_normalize_strategy(s, len(inputs)) for s in strategies]
    chosen = []
    for i in range(call.mesh.ndim):
        best = _cheapest(inputs, strategies, chosen, i, mutated, reduce_destination=False)
        if best is None and mutated is not None and inputs[mutated].placements[i].is_partial():
            best = _cheapest(inputs, strategies, chosen, i, mutated, reduce_destination=True)
        if best is None:
            if mutated is None:
                raise RuntimeError(f"{call.op}: no sharding strategy fits inputs "
                                   f"{[list(x.placements) for x in inputs]} (a bug in the rule)")
            raise RuntimeError(
                f"{call.op}: no sharding strategy keeps the in-place destination's placement "
                f"{list(inputs[mutated].placements)}; use the out-of-place op")
        chosen.append(best)
    n_out = max(len(c[1]) for c in chosen)
    outs = []
    for k in range(n_out):
        pl = [c[1][k] if k < len(c[1]) else None for c in chosen]
        outs.append(None if any(p is None for p in pl) else tuple(pl))
    ins = []
    for j in range(len(inputs)):
        pl = [c[2][j] for c in chosen]
        ins.append(None if all(p is None for p in pl) else tuple(
            inputs[j].placements[i] if p is None else p for i, p in enumerate(pl)))
    in_orders, out_orders = _transfer_orders(inputs, ins, outs)
    return FullStrategy(outs, ins, None, out_orders, in_orders)


def only_reduces_partials(have, want) -> bool:
    """Do placements ``want`` differ from ``have`` only by reducing Partial mesh dims (what an
    in-place destination may undergo, see :func:`expand_strategies`)?"""
    return want is not None and all(p == q or (p.is_partial() and not q.is_partial())
                                    for p, q in zip(have, want))


def _cheapest(inputs, strategies, chosen, i, mutated, reduce_destination):
    """The cheapest (rank, outs, ins) on mesh dim ``i``, or None. With an in-place destination
    ``mutated``: strategies that keep its placement, or (``reduce_destination``) those that
    reduce its Partial to a non-Partial placement the result is written at."""
    best = None
    for k, (outs, ins) in enumerate(strategies):
        if mutated is not None:
            have, want = inputs[mutated].placements[i], ins[mutated]
            if reduce_destination:
                if want is None or want.is_partial() or outs[0] != want:
                    continue
            elif want not in (None, have) or outs[0] != have:
                continue  # an in-place op writes its result where its destination already is
        if not _partials_stay_compatible(chosen, outs, ins):
            continue  # e.g. P(max) on one mesh dim and P(avg) on another has no meaning
        cost, exact, later = 0.0, True, 0.0
        for spec, q in zip(inputs, ins):
            if q is None:
                continue
            p = spec.placements[i]
            if p != q:
                exact = False
                cost += _estimate(spec, i, p, q)
                later = max(later, _resolve_later(p, q, outs))
        rank = (cost + later, not exact, k)
        if best is None or rank < best[0]:
            best = (rank, outs, ins)
    return best


def _partials_stay_compatible(chosen, outs, ins) -> bool:
    """Would adding (outs, ins) for the next mesh dim mix Partial reductions on one tensor?
    sum and avg mix (both linear); max/min only with themselves."""
    for k, p in enumerate(tuple(outs) + tuple(ins)):
        if p is None or not p.is_partial():
            continue
        ops = {p.reduce_op}
        for c in chosen:
            prev = (tuple(c[1]) + tuple(c[2]))[k] if k < len(c[1]) + len(c[2]) else None
            if prev is not None and prev.is_partial():
                ops.add(prev.reduce_op)
        if not reductions_mix(ops):
            return False
    return True


def _transfer_orders(inputs, ins, outs):
    """Carry a non-default shard order (e.g. FSDP over TP) from an input that keeps its
    placements to the other inputs and outputs: mesh dims splitting one tensor dim keep the same
    relative order everywhere, so the local pieces still line up."""
    ranking = None
    for spec, want in zip(inputs, ins):
        if not spec.has_default_order and (want is None or tuple(want) == spec.placements):
            ranking = {}
            for order in spec.shard_order:
                for pos, i in enumerate(order):
                    ranking[i] = pos
            break
    if ranking is None:
        return None, None

    def order_for(placements):
        if placements is None:
            return None
        ndim_guess = max((p.dim + 1 for p in placements if p.is_shard()), default=0)
        return shard_orders(placements, ndim_guess, ranking)

    def fit(order, ndim):
        if order is None:
            return None
        return tuple(order) + ((),) * (ndim - len(order))

    in_orders = [fit(order_for(w), spec.ndim) if w is not None else None
                 for spec, w in zip(inputs, ins)]
    out_orders = [order_for(o) for o in outs]
    return in_orders, out_orders
