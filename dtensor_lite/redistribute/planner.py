"""Choosing how to get from one DTensorSpec to another at the least communication.

A plan is a sequence of *steps*, each changing the placement of one mesh dim:

  ===============  =================  ===========================================
  from -> to        step               bytes sent per rank (n = mesh dim size)
  ===============  =================  ===========================================
  S(d) -> R         all_gather         (n-1) * ceil(L_d / n) * rest
  S(d) -> S(e)      all_to_all         (n-1) * ceil(L_d / n) * ceil(l_e / n) * rest
  P    -> R         all_reduce         2 (n-1) * ceil(numel / n)
  P    -> S(d)      reduce_scatter     (n-1) * ceil(l_d / n) * rest
  R    -> S(d)      chunk              0  (local slice)
  R    -> P         to_partial         0  (sum: ranks off coordinate 0 hold zeros)
  S(d) -> P         pad_to_partial     0  (the piece in a buffer of the reduction's identity)
  P(sum)<->P(avg)   rescale            0  (multiply or divide by n)
  ===============  =================  ===========================================

(``L_d`` = the length of dim d before this mesh dim splits it, ``l`` = current local length,
``rest`` = the product of the other local dims, all times the element size.)

A Shard can only be undone on the mesh dim that split the tensor dim last (innermost in the
shard order), so the order of steps across mesh dims matters: the planner runs Dijkstra over
states (placements + shard order) with cost ``(bytes + COLLECTIVE_LATENCY_BYTES per collective,
collectives, steps, reductions)`` (steps.py: an extra collective must save more bytes than its
latency is worth), passing
through Partial(sum) where that is cheaper even if neither end is Partial. Bytes are those of
the rank holding the largest pieces (coordinate 0 everywhere) so every rank computes the same
plan; the plan also records what this rank itself sends, which is what CommDebugMode measures.
Plans are cached per (src spec, dst spec).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from ..placements import Partial, Replicate, Shard, reductions_mix
from ..spec import DTensorSpec, chunk_range
from .. import _caches
from .steps import COLLECTIVE_LATENCY_BYTES, STEP_KINDS, step_kind

__all__ = ["Step", "RedistributePlan", "plan_redistribute"]


@dataclass(frozen=True)
class Step:
    """Change mesh dim ``mesh_dim`` from ``src`` to ``dst`` placement with collective ``kind``."""
    mesh_dim: int
    kind: str
    src: object
    dst: object
    before: DTensorSpec = field(repr=False, compare=False)
    after: DTensorSpec = field(repr=False, compare=False)
    cost: int = 0            # bytes sent by the rank with the largest pieces
    rank_cost: int = 0       # bytes this rank sends

    def __str__(self):
        return (f"mesh dim {self.mesh_dim}: {self.src} -> {self.dst} ({self.kind}, "
                f"{self.rank_cost} B/rank)")


@dataclass(frozen=True)
class RedistributePlan:
    src: DTensorSpec
    dst: DTensorSpec
    steps: tuple[Step, ...]

    @property
    def cost(self) -> int:
        """Bytes sent per rank by the busiest rank (the planner's objective)."""
        return sum(s.cost for s in self.steps)

    @property
    def rank_cost(self) -> int:
        """Bytes this rank sends; CommDebugMode records exactly this."""
        return sum(s.rank_cost for s in self.steps)

    @property
    def num_collectives(self) -> int:
        return sum(STEP_KINDS[s.kind].collective for s in self.steps)

    def __str__(self):
        head = (f"redistribute {list(self.src.public_placements())} -> "
                f"{list(self.dst.public_placements())} of shape {tuple(self.src.shape)} on mesh "
                f"{self.src.mesh.shape}: {self.num_collectives} collective(s), "
                f"{self.rank_cost} bytes sent by this rank")
        if not self.steps:
            return head + " (nothing to do)"
        return "\n".join([head] + [f"  {k + 1}. {s}" for k, s in enumerate(self.steps)])

    def table(self):
        """A rich Table of the steps."""
        from rich.table import Table
        t = Table(title=f"{list(self.src.public_placements())} -> {list(self.dst.public_placements())}")
        for col in ("#", "mesh dim", "from", "to", "collective", "bytes/rank"):
            t.add_column(col)
        for k, s in enumerate(self.steps):
            t.add_row(str(k + 1), str(s.mesh_dim), str(s.src), str(s.dst), s.kind, f"{s.rank_cost:,}")
        return t


# ------------------------------------------------------------------ state arithmetic
def _piece_shape(shape, orders, mesh_shape, coord):
    out = list(shape)
    for d, order in enumerate(orders):
        for i in order:
            out[d] = chunk_range(out[d], mesh_shape[i], coord[i])[1]
    return out


def _parent_len(shape, orders, mesh_shape, coord, d, upto_excl):
    """Length of dim d after the mesh dims before ``upto_excl`` in its order have split it."""
    length = shape[d]
    for i in orders[d]:
        if i == upto_excl:
            break
        length = chunk_range(length, mesh_shape[i], coord[i])[1]
    return length


def _step_bytes(kind, i, d, e, shape, orders, mesh_shape, coord, itemsize):
    """Bytes sent by the rank at ``coord`` for one step (padded equal chunks)."""
    n = mesh_shape[i]
    local = _piece_shape(shape, orders, mesh_shape, coord)
    if kind == "all_gather":
        rest = math.prod(local) // local[d] if local[d] else math.prod(local[:d] + local[d + 1:])
        return (n - 1) * -(-_parent_len(shape, orders, mesh_shape, coord, d, i) // n) * rest * itemsize
    if kind == "all_to_all":
        others = math.prod(s for k, s in enumerate(local) if k not in (d, e))
        chunk_d = -(-_parent_len(shape, orders, mesh_shape, coord, d, i) // n)
        return (n - 1) * chunk_d * -(-local[e] // n) * others * itemsize
    if kind == "reduce_scatter":
        others = math.prod(s for k, s in enumerate(local) if k != d)
        return (n - 1) * -(-local[d] // n) * others * itemsize
    if kind == "all_reduce":
        numel = math.prod(local)
        return 2 * (n - 1) * -(-numel // n) * itemsize
    return 0


def _transition(p, q, i, orders):
    """The step kind for placement p -> q on mesh dim i, or None if not allowed from here."""
    if p.is_shard() and orders[p.dim][-1] != i:
        return None  # an outer split can only be undone after the inner ones
    return step_kind(p, q)


def _apply(placements, orders, i, q):
    p = placements[i]
    new_orders = list(orders)
    if p.is_shard():
        new_orders[p.dim] = orders[p.dim][:-1]
    if q.is_shard():
        new_orders[q.dim] = orders[q.dim] + (i,)
    new_p = placements[:i] + (q,) + placements[i + 1:]
    return new_p, tuple(new_orders)


def _partials_compatible(placements) -> bool:
    return reductions_mix(p.reduce_op for p in placements if p.is_partial())


def _search(src: DTensorSpec, dst: DTensorSpec):
    mesh_shape = src.mesh.shape
    shape = list(src.shape)
    ndim = len(shape)
    itemsize = src.dtype.itemsize
    zero = (0,) * len(mesh_shape)
    # Partial(sum) is always a candidate intermediate, not only when an end point has it: for a
    # dim split into pieces smaller than the mesh (e.g. shape (1, 5, 3) as S(0) on 4 ranks),
    # pad_to_partial + all_reduce (96 B) beats all_gather (180 B) and all_to_all + all_gather
    # (120 B); without it the plan was not the cheapest under this very cost table.
    ops = sorted({p.reduce_op for p in src.placements + dst.placements if p.is_partial()} | {"sum"})
    candidates = [Replicate()] + [Partial(op) for op in ops] + [Shard(d) for d in range(ndim)]
    # rescale multiplies or divides by n locally: an integer P(avg) -> P(sum) became a float
    # local tensor (and x / n cannot be exact under floor-division averages), a bool one an int
    exact_rescale = src.dtype.is_floating_point or src.dtype.is_complex
    start = (src.placements, src.shard_order)
    goal = (dst.placements, dst.shard_order)
    best = {start: (0, 0, 0, 0)}
    parent = {start: None}
    heap = [((0, 0, 0, 0), 0, start)]
    counter = 1
    done = set()
    while heap:
        cost, _, state = heapq.heappop(heap)
        if state == goal:
            break
        if state in done:
            continue  # a costlier entry of a state already expanded
        done.add(state)
        placements, orders = state
        for i in range(len(mesh_shape)):
            p = placements[i]
            for q in candidates:
                if q == p:
                    continue
                kind = _transition(p, q, i, orders)
                if kind is None or (kind == "rescale" and not exact_rescale):
                    continue
                new_state = _apply(placements, orders, i, q)
                if new_state in done:
                    continue  # settled: its cheapest path is known (saves the byte arithmetic)
                # only a step *to* a Partial can create a mix (Partial(sum) is always a candidate
                # now, so this check ran for most moves and was a fifth of the search time)
                if q.is_partial() and not _partials_compatible(new_state[0]):
                    continue
                d = p.dim if p.is_shard() else (q.dim if q.is_shard() else None)
                e = q.dim if (p.is_shard() and q.is_shard()) else None
                nbytes = _step_bytes(kind, i, d, e, shape, orders, mesh_shape, zero, itemsize)
                # last tie-breaker: fewer reductions, so that with Partial(sum) always on offer a
                # tie (e.g. [S0, S1] -> [S1, S0]: all_gather + all_to_all + chunk, or
                # pad_to_partial + all_to_all + reduce_scatter, 64 B each) keeps the bit-exact
                # gather path rather than depending on the heap's order
                info = STEP_KINDS[kind]
                new_cost = (cost[0] + nbytes + COLLECTIVE_LATENCY_BYTES * info.collective,
                            cost[1] + info.collective, cost[2] + 1, cost[3] + info.reduces)
                if new_state not in best or new_cost < best[new_state]:
                    best[new_state] = new_cost
                    parent[new_state] = (state, i, q, kind, d, e, nbytes)
                    heapq.heappush(heap, (new_cost, counter, new_state))
                    counter += 1
    if goal not in parent:
        raise RuntimeError(f"no redistribute path from {src} to {dst} (this is a bug)")
    moves = []
    state = goal
    while parent[state] is not None:
        moves.append((state,) + parent[state])
        state = parent[state][0]
    return list(reversed(moves))


def _build_plan(src: DTensorSpec, dst: DTensorSpec) -> RedistributePlan:
    if src == dst:
        return RedistributePlan(src, dst, ())
    coord = src.mesh.get_coordinate()
    mesh_shape = src.mesh.shape
    shape = list(src.shape)
    steps = []
    for (after_state, before_state, i, q, kind, d, e, nbytes) in _search(src, dst):
        before = src.with_placements(*before_state) if before_state != (src.placements, src.shard_order) else src
        after = dst if after_state == (dst.placements, dst.shard_order) else src.with_placements(*after_state)
        rank_bytes = _step_bytes(kind, i, d, e, shape, before_state[1], mesh_shape, coord,
                                 src.dtype.itemsize)
        steps.append(Step(i, kind, before_state[0][i], q, before, after, nbytes, rank_bytes))
    return RedistributePlan(src, dst, tuple(steps))


_PLANS: dict = _caches.register(_caches.LRUCache(_caches.PLANS_MAX))


def plan_redistribute(src: DTensorSpec, dst: DTensorSpec) -> RedistributePlan:
    """The cached minimum-communication plan from ``src`` to ``dst`` (same mesh, same tensor)."""
    key = (src, dst)
    plan = _caches.cached_get(_PLANS, key)
    if plan is None:
        plan = _PLANS[key] = _build_plan(src, dst)
    return plan
