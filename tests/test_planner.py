"""Single-process tests of the redistribute planner against an independent brute-force model.

The model below is written from the cost table in ``dtensor_lite/redistribute/planner.py``'s
docstring, not from its code: a state is ``(placements, shard order)``, a move changes the
placement of one mesh dim (Partial intermediates of every reduction included), and the search is
an exhaustive relaxation over *all* move sequences (label-correcting, Bellman-Ford style: whenever
the cheapest known sequence to a state improves, extend it by every legal move, until nothing
improves), so its answer is the minimum over every transform order of any length. The planner
(Dijkstra, a different algorithm over its own code for moves and bytes) must state exactly that
minimum.

The planner only needs a mesh's shape, this rank's coordinate and value semantics, so these tests
use a tiny stand-in mesh and run without processes; that lets them cover mesh sizes the process
pools do not (3, 2x3, 4x2) at many more examples. ``tests/test_redistribute.py`` runs the same
model against real collectives and CommDebugMode.
"""
from __future__ import annotations

import collections
import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dtensor_lite import Partial, Replicate, Shard, _StridedShard
from dtensor_lite.redistribute import plan_redistribute
from dtensor_lite.redistribute.steps import COLLECTIVE_LATENCY_BYTES
from dtensor_lite.spec import DTensorSpec, TensorMeta

REDUCE_OPS = ("sum", "avg", "max", "min")
COLLECTIVES = ("all_gather", "all_to_all", "all_reduce", "reduce_scatter")


# ============================================================== independent model of the planner
# A placement in the model is a small tuple: ("R",), ("P", op) or ("S", dim).
def to_model(p) -> tuple:
    if p.is_shard():
        return ("S", p.dim)
    if p.is_partial():
        return ("P", p.reduce_op)
    assert p.is_replicate(), p
    return ("R",)


def from_model(m):
    return {"R": lambda: Replicate(), "P": lambda: Partial(m[1]), "S": lambda: Shard(m[1])}[m[0]]()


def chunk_len(length: int, n: int, k: int) -> int:
    """len(torch.chunk(range(length), n)[k]), 0 where torch.chunk returns fewer chunks."""
    c = -(-length // n)
    return max(0, min(c, length - k * c))


def chunk_start(length: int, n: int, k: int) -> int:
    return min(k * -(-length // n), length)


def piece_shape(shape, orders, mesh_shape, coord):
    """Shape of the piece at ``coord``: dim d is split by the mesh dims of orders[d], outer
    first."""
    out = list(shape)
    for d, order in enumerate(orders):
        for i in order:
            out[d] = chunk_len(out[d], mesh_shape[i], coord[i])
    return out


def default_orders(placements, ndim):
    return tuple(tuple(i for i, p in enumerate(placements) if p == ("S", d)) for d in range(ndim))


def partials_ok(placements) -> bool:
    ops = {p[1] for p in placements if p[0] == "P"}
    return len(ops) <= 1 or ops <= {"sum", "avg"}


@functools.lru_cache(maxsize=None)
def move(placements, orders, i, q):
    """Kind of the step that changes mesh dim i to q, and the state after it; None if illegal."""
    p = placements[i]
    orders = list(orders)
    if p[0] == "S":
        if orders[p[1]][-1] != i:
            return None  # only the innermost split of a tensor dim can be undone
        kind = {"R": "all_gather", "S": "all_to_all", "P": "pad_to_partial"}[q[0]]
        orders[p[1]] = orders[p[1]][:-1]
    elif p[0] == "R":
        kind = "chunk" if q[0] == "S" else "to_partial"
    else:
        if q[0] == "P":
            if {p[1], q[1]} != {"sum", "avg"}:
                return None
            kind = "rescale"
        else:
            kind = "all_reduce" if q[0] == "R" else "reduce_scatter"
    if q[0] == "S":
        orders[q[1]] = orders[q[1]] + (i,)
    new = placements[:i] + (q,) + placements[i + 1:]
    if not partials_ok(new):
        return None
    return kind, (new, tuple(orders))


@functools.lru_cache(maxsize=None)
def step_bytes(kind, i, src_p, dst_p, shape, orders, mesh_shape, coord, itemsize) -> int:
    """Bytes the rank at ``coord`` sends for one step, straight from the docstring's table:
    every collective moves equal (padded) chunks, chunk = ceil(length / n)."""
    n = mesh_shape[i]
    local = piece_shape(shape, orders, mesh_shape, coord)
    ceil = lambda a: -(-a // n)  # noqa: E731
    if kind == "all_gather":       # (n-1) * ceil(L_d / n) * rest
        d = src_p[1]
        parent = piece_shape(shape, tuple(o[:-1] if k == d else o for k, o in enumerate(orders)),
                             mesh_shape, coord)[d]
        rest = math.prod(s for k, s in enumerate(local) if k != d)
        return (n - 1) * ceil(parent) * rest * itemsize
    if kind == "all_to_all":       # (n-1) * ceil(L_d / n) * ceil(l_e / n) * rest
        d, e = src_p[1], dst_p[1]
        parent = piece_shape(shape, tuple(o[:-1] if k == d else o for k, o in enumerate(orders)),
                             mesh_shape, coord)[d]
        rest = math.prod(s for k, s in enumerate(local) if k not in (d, e))
        return (n - 1) * ceil(parent) * ceil(local[e]) * rest * itemsize
    if kind == "reduce_scatter":   # (n-1) * ceil(l_d / n) * rest
        d = dst_p[1]
        rest = math.prod(s for k, s in enumerate(local) if k != d)
        return (n - 1) * ceil(local[d]) * rest * itemsize
    if kind == "all_reduce":       # 2 (n-1) * ceil(numel / n)
        return 2 * (n - 1) * ceil(math.prod(local)) * itemsize
    return 0                       # chunk, to_partial, pad_to_partial, rescale: local only


def brute_force_min(shape, itemsize, mesh_shape, src_state, dst_state, ops=REDUCE_OPS,
                    floating=True):
    """``(bytes, collectives, steps)`` of the cheapest sequence of single-mesh-dim moves from
    ``src_state`` to ``dst_state`` (bytes at coordinate 0, the rank with the largest pieces),
    the cheapest being the least ``bytes + COLLECTIVE_LATENCY_BYTES * collectives``, then the
    fewest collectives, then the fewest steps (the planner's alpha-beta objective).

    Exhaustive label-correcting search: ``best`` holds the cheapest known sequence to each state;
    whenever a state's sequence gets cheaper, it is extended again by every legal move (Partial
    intermediates of every reduction included). When nothing improves any more, ``best`` is the
    minimum over sequences of every length, whatever order they were found in. Integer and bool
    tensors cannot rescale sum <-> avg locally (x / n is not exact), so ``floating=False`` drops
    those moves.
    """
    ndim = len(shape)
    cands = [("R",)] + [("P", op) for op in ops] + [("S", d) for d in range(ndim)]
    zero = (0,) * len(mesh_shape)
    best = {src_state: (0, 0, 0, 0)}  # (objective, collectives, steps, bytes)
    todo, queued = collections.deque([src_state]), {src_state}
    while todo:
        state = todo.popleft()
        queued.discard(state)
        cost = best[state]
        placements, orders = state
        for i in range(len(mesh_shape)):
            for q in cands:
                if q == placements[i]:
                    continue
                res = move(placements, orders, i, q)
                if res is None:
                    continue
                kind, new_state = res
                if kind == "rescale" and not floating:
                    continue
                b = step_bytes(kind, i, placements[i], q, shape, orders, mesh_shape, zero,
                               itemsize)
                collective = kind in COLLECTIVES
                new_cost = (cost[0] + b + COLLECTIVE_LATENCY_BYTES * collective,
                            cost[1] + collective, cost[2] + 1, cost[3] + b)
                if new_state not in best or new_cost < best[new_state]:
                    best[new_state] = new_cost
                    if new_state not in queued:
                        todo.append(new_state)
                        queued.add(new_state)
    _, collectives, steps, nbytes = best[dst_state]
    return nbytes, collectives, steps


def public_placements(placements, orders, mesh_shape):
    """Spell a (placements, shard order) state as PyTorch does: a mesh dim that shards its
    tensor dim after mesh dims to its right becomes _StridedShard(dim, product of their sizes)."""
    out = [from_model(p) for p in placements]
    for d, order in enumerate(orders):
        for pos, i in enumerate(order):
            first = [j for j in order[:pos] if j > i]
            if first:
                out[i] = _StridedShard(d, math.prod(mesh_shape[j] for j in first))
    return out


def replay(plan_steps, shape, itemsize, mesh_shape, src_state, coord=None, floating=True):
    """Check that each planned step is a legal move of the model with the cost the model gives
    at coordinate 0 (and, given ``coord``, at that coordinate); return the final state."""
    state = src_state
    zero = (0,) * len(mesh_shape)
    for s in plan_steps:
        placements, orders = state
        assert to_model(s["src"]) == placements[s["mesh_dim"]], (s, state)
        res = move(placements, orders, s["mesh_dim"], to_model(s["dst"]))
        assert res is not None, f"planned step {s} is not a legal move from {state}"
        kind, new_state = res
        assert s["kind"] == kind, (s, state)
        assert floating or kind != "rescale", f"a local rescale of a non-float tensor: {s}"
        args = (kind, s["mesh_dim"], placements[s["mesh_dim"]], to_model(s["dst"]), shape,
                orders, mesh_shape)
        assert s["cost"] == step_bytes(*args, zero, itemsize), (s, state)
        if coord is not None:
            assert s["rank_cost"] == step_bytes(*args, coord, itemsize), (s, state, coord)
        state = new_state
    return state


def step_dicts(plan):
    return [dict(mesh_dim=s.mesh_dim, kind=s.kind, src=s.src, dst=s.dst, cost=s.cost,
                 rank_cost=s.rank_cost) for s in plan.steps]


# ============================================================== strategies (shared)
@st.composite
def states(draw, mesh_shape, ndim, ops=REDUCE_OPS):
    """A random (placements, shard order) state: per mesh dim Shard (half the time, so that mesh
    dims often share a tensor dim), Replicate or Partial, and a random order among the mesh dims
    that shard the same tensor dim."""
    placements = []
    for _ in mesh_shape:
        kind = draw(st.sampled_from("RSSP" if ndim else "RP"))
        if kind == "S":
            placements.append(("S", draw(st.integers(0, ndim - 1))))
        elif kind == "P":
            placements.append(("P", draw(st.sampled_from(ops))))
        else:
            placements.append(("R",))
    placements = tuple(placements)
    if not partials_ok(placements):
        # keep one reduction (or sum+avg): mixed sum/max placements are rejected by design
        keep = next(p[1] for p in placements if p[0] == "P")
        placements = tuple(("P", keep) if p[0] == "P" else p for p in placements)
    orders = tuple(tuple(draw(st.permutations(o))) for o in default_orders(placements, ndim))
    return placements, orders


# mostly 2-D and 3-D; lengths 0..9, so often shorter than the product of the mesh dims that
# split them (then pieces are uneven or empty)
shapes = st.sampled_from([0, 1, 2, 2, 3, 3]).flatmap(
    lambda ndim: st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim).map(tuple))


# ============================================================== a mesh the planner can use alone
class FakeMesh:
    """Just what the planner reads: shape, this rank's coordinate, value semantics."""

    def __init__(self, shape, coord=None):
        self.shape = tuple(shape)
        self.ndim = len(shape)
        self._coord = list(coord) if coord is not None else [0] * len(shape)

    def get_coordinate(self):
        return list(self._coord)

    def __eq__(self, other):
        return isinstance(other, FakeMesh) and (self.shape, self._coord) == (other.shape,
                                                                            other._coord)

    def __hash__(self):
        return hash((self.shape, tuple(self._coord)))


def spec_of(mesh, state, shape, dtype=torch.float32):
    placements, orders = state
    stride = tuple(math.prod(shape[k + 1:]) for k in range(len(shape)))
    return DTensorSpec(mesh, [from_model(p) for p in placements],
                       TensorMeta(torch.Size(shape), stride, dtype), orders)


# ============================================================== the model itself is sane
def test_model_chunks_match_torch_chunk():
    for length in range(0, 12):
        for n in range(1, 6):
            chunks = torch.chunk(torch.arange(length), n)
            for k in range(n):
                expected = chunks[k] if k < len(chunks) else torch.arange(0)
                assert chunk_len(length, n, k) == len(expected)
                if len(expected):
                    assert chunk_start(length, n, k) == int(expected[0])


def test_brute_force_knows_simple_answers():
    # 1-D, S(0) -> R of (8, 4) fp32 on 4 ranks: one all_gather of 3 * 2*4 elements
    assert brute_force_min((8, 4), 4, (4,), ((("S", 0),), ((0,), ())),
                           ((("R",),), ((), ()))) == (3 * 2 * 4 * 4, 1, 1)
    # 2x2, [S0, S0] -> [R, R]: the inner split (mesh dim 1) must go first
    src = ((("S", 0), ("S", 0)), ((0, 1), ()))
    dst = ((("R",), ("R",)), ((), ()))
    assert brute_force_min((8, 4), 4, (2, 2), src, dst) == (2 * 4 * 4 + 4 * 4 * 4, 2, 2)


def test_partial_sum_is_a_candidate_intermediate():
    """Regression: the planner only considered Partial placements of its two end points, so for
    pieces smaller than the mesh it missed S(0) -> P(sum) (free) -> R (all_reduce)."""
    mesh = FakeMesh((4,))
    src = ((("S", 0),), ((0,), (), ()))
    dst = ((("R",),), ((), (), ()))
    plan = plan_redistribute(spec_of(mesh, src, (1, 5, 3)), spec_of(mesh, dst, (1, 5, 3)))
    # all_reduce of 15 floats on 4 ranks: 2 * 3 * ceil(15 / 4) * 4 B; a plain all_gather sends
    # the 1-row piece padded (3 * 15 * 4 B = 180), all_to_all + all_gather 60 + 60
    assert [s.kind for s in plan.steps] == ["pad_to_partial", "all_reduce"]
    assert plan.cost == 96 == brute_force_min((1, 5, 3), 4, (4,), src, dst)[0]


# ============================================================== planner == brute force
MESH_SHAPES = [(4,), (3,), (2, 2), (2, 3), (4, 2), (2, 2, 2)]


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=str)
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_planner_cost_is_the_brute_force_minimum(mesh_shape, data):
    shape = data.draw(shapes, label="shape")
    src = data.draw(states(mesh_shape, len(shape)), label="src")
    dst = data.draw(states(mesh_shape, len(shape)), label="dst")
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64,
                                       torch.bool]), label="dtype")
    floating = dtype.is_floating_point
    coord = tuple(data.draw(st.integers(0, n - 1)) for n in mesh_shape)
    mesh = FakeMesh(mesh_shape, coord)
    plan = plan_redistribute(spec_of(mesh, src, shape, dtype), spec_of(mesh, dst, shape, dtype))
    itemsize = dtype.itemsize
    # every step is a legal move of the model, costed as the model costs it (also at `coord`)
    assert replay(step_dicts(plan), shape, itemsize, mesh_shape, src, coord, floating) == dst
    # and the plan is the cheapest sequence of all: bytes plus a latency per collective, then
    # collectives, then steps
    best = brute_force_min(shape, itemsize, mesh_shape, src, dst, floating=floating)
    assert (plan.cost, plan.num_collectives, len(plan.steps)) == best
    # the stated cost is the busiest rank's: coordinate 0 sends at least as much as any rank
    assert plan.rank_cost <= plan.cost
    if all(c == 0 for c in coord):
        assert plan.rank_cost == plan.cost


def test_a_second_collective_must_save_more_than_its_latency():
    """Partial -> Shard(0) of a (2, cols) fp32 tensor on 4 ranks: 2 rows are pieces of 1, 1, 0, 0
    (padded to 1 row each). One reduce-scatter on dim 0 sends 3 * cols * 4 B; a reduce-scatter on
    dim 1 plus an all-to-all sends 3/4 of that. For the small weight of a user's ZeRO step (cols 8:
    96 B vs 72 B) the second collective's latency is not worth 24 B; for cols = 2**16 it saves
    192 KiB, more than COLLECTIVE_LATENCY_BYTES, and the two-collective plan wins."""
    mesh = FakeMesh((4,))
    for cols, kinds in ((8, ["reduce_scatter"]), (2 ** 16, ["reduce_scatter", "all_to_all"])):
        src = spec_of(mesh, ((("P", "sum"),), ((), ())), (2, cols))
        dst = spec_of(mesh, ((("S", 0),), ((0,), ())), (2, cols))
        plan = plan_redistribute(src, dst)
        assert [s.kind for s in plan.steps] == kinds, (cols, plan.steps)
        back = plan_redistribute(dst, src.with_placements([Replicate()]))
        assert [s.kind for s in back.steps] == list(reversed(
            ["all_gather" if k == "reduce_scatter" else k for k in kinds])), (cols, back.steps)
