"""Redistribute across meshes: random source and destination meshes over 4 (and 8) ranks -- the
same ranks reshaped, a sub-mesh, disjoint and overlapping rank sets -- and random placements
(uneven and empty pieces, Partial sources with real terms, _StridedShard). Every destination
piece must equal ``distribute_tensor(full, B, placements)``'s; the bytes each rank sends (as
CommDebugMode counts them) are the minimum, computed here by brute force from index sets; no
rank allocates a buffer the size of the global tensor; the backward equals plain torch's."""

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from dtensor_lite import (DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor,
                          init_device_mesh)
from dtensor_lite.debug import CommDebugMode
from dtensor_lite.placements import _StridedShard
from tests.harness import distributed, run_distributed


# ----------------------------------------------------------------------------- helpers
def _placement(spec):
    kind = spec[0]
    if kind == "S":
        return Shard(spec[1])
    if kind == "SS":
        return _StridedShard(spec[1], split_factor=spec[2])
    if kind == "P":
        return Partial(spec[1])
    return Replicate()


class _LargestAllocation(TorchDispatchMode):
    """The numel of the largest float tensor any aten op produced while active (the data's
    dtype; meshes' rank tables are integer tensors)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor) and o.is_floating_point() and not isinstance(o, DTensor):
                self.largest = max(self.largest, o.numel())
        return out


def _with_partial_terms(dt, full):
    """``dt`` (laid out with Partial dims, value on coordinate 0) rebuilt with real terms: the
    piece at coordinate c of a Partial(sum) dim of size n is piece * 2(c+1)/(n(n+1))."""
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return dt
    plain = [Replicate() if p.is_partial() else p for p in dt.placements]
    piece = distribute_tensor(full, mesh, plain, src_data_rank=None).to_local()
    for i, p in enumerate(dt.placements):
        if p.is_partial("sum"):
            n = mesh.shape[i]
            piece = piece * (2.0 * (coord[i] + 1) / (n * (n + 1)))
    return DTensor.from_local(piece, mesh, dt.placements, shape=full.shape,
                              stride=full.stride())


def cross_mesh_body(world, src_ranks, src_shape, src_pl, dst_ranks, dst_shape, dst_pl, shape,
                    seed):
    rank = dist.get_rank()
    A = DeviceMesh("cpu", torch.tensor(src_ranks).reshape(src_shape))
    B = DeviceMesh("cpu", torch.tensor(dst_ranks).reshape(dst_shape))
    src_pl = [_placement(p) for p in src_pl]
    dst_pl = [_placement(p) for p in dst_pl]
    torch.manual_seed(seed)
    full = torch.randn(shape, dtype=torch.float64)
    x = _with_partial_terms(distribute_tensor(full, A, src_pl, src_data_rank=None), full)
    partial_src = any(p.is_partial() for p in src_pl)
    with CommDebugMode() as comm, _LargestAllocation() as alloc:
        y = x.redistribute(B, dst_pl)
    ref = distribute_tensor(full, B, dst_pl, src_data_rank=None)
    assert y.device_mesh == B and y.placements == ref.placements
    assert y.to_local().shape == ref.to_local().shape
    torch.testing.assert_close(y.to_local(), ref.to_local(), atol=1e-12 if partial_src else 0,
                               rtol=1e-12 if partial_src else 0)
    # which global elements this rank holds before and needs after (1-based ids; a zero term of
    # a Partial(sum) destination needs nothing)
    ids = torch.arange(1, math.prod(shape) + 1, dtype=torch.float64).reshape(shape)
    plain_src = [Replicate() if p.is_partial() else p for p in src_pl]
    held = distribute_tensor(ids, A, plain_src, src_data_rank=None).to_local()
    need = distribute_tensor(ids, B, dst_pl, src_data_rank=None).to_local()
    biggest_piece = max(held.numel(), need.numel(), 1)
    return {"rank": rank, "sent": comm.get_comm_bytes().get("cross_mesh", 0),
            "held": sorted(int(i) for i in held.flatten().tolist() if i) if
            A.get_coordinate() is not None else [],
            "need": sorted(int(i) for i in need.flatten().tolist() if i) if
            B.get_coordinate() is not None else [],
            "partial_src": partial_src, "largest": alloc.largest, "biggest_piece": biggest_piece,
            "global": math.prod(shape)}


def check_minimum_bytes(results, itemsize=8):
    """Driver side: every needed element a rank does not hold crosses once, sent by a rank that
    holds it; nothing else is sent; no buffer beyond a piece."""
    held = {r["rank"]: set(r["held"]) for r in results}
    total_needed = sum(len(set(r["need"]) - held[r["rank"]]) for r in results)
    if not results[0]["partial_src"]:  # a Partial source first reduces (a collective of its own)
        assert sum(r["sent"] for r in results) == total_needed * itemsize
        for r in results:  # a rank sends only what it holds and someone else needs
            useful = sum(len(held[r["rank"]] & (set(o["need"]) - held[o["rank"]]))
                         for o in results)
            assert r["sent"] <= useful * itemsize
            assert r["largest"] <= r["biggest_piece"], (r["largest"], r["biggest_piece"])
    for r in results:
        if r["global"] > 4 and r["largest"] >= r["global"]:
            assert r["biggest_piece"] == r["global"], "a global-size buffer was allocated"


# ----------------------------------------------------------------------------- strategies
shapes = st.lists(st.integers(1, 7), min_size=1, max_size=2).map(tuple)


@st.composite
def meshes(draw, world):
    """Ranks (a random subset in random order) and a 1-D or 2-D shape for them."""
    n = draw(st.integers(1, world))
    ranks = draw(st.permutations(range(world)))[:n]
    shapes_ = [(n,)] + [(a, n // a) for a in range(2, n) if n % a == 0]
    return list(ranks), draw(st.sampled_from(shapes_))


@st.composite
def placements(draw, mesh_shape, ndim, allow_partial=True, allow_strided=True):
    kinds = ["S", "R"] + (["P"] if allow_partial else [])
    out = []
    for _ in mesh_shape:
        kind = draw(st.sampled_from(kinds))
        if kind == "S":
            out.append(("S", draw(st.integers(0, ndim - 1))))
        elif kind == "P":
            out.append(("P", draw(st.sampled_from(["sum", "sum", "avg", "max"]))))
        else:
            out.append(("R",))
    # torch's FSDP-over-TP spelling: a strided shard left of a plain shard of the same dim
    if allow_strided and len(mesh_shape) == 2 and out[1][0] == "S" and draw(st.booleans()):
        out[0] = ("SS", out[1][1], mesh_shape[1])
    return out


@st.composite
def cross_cases(draw, world):
    shape = draw(shapes)
    src_ranks, src_shape = draw(meshes(world))
    dst_ranks, dst_shape = draw(meshes(world))
    src_pl = draw(placements(src_shape, len(shape)))
    dst_pl = draw(placements(dst_shape, len(shape)))
    return (world, src_ranks, src_shape, src_pl, dst_ranks, dst_shape, dst_pl, shape,
            draw(st.integers(0, 2**16)))


def _property(n):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_property(8)
@given(case=cross_cases(4))
def test_random_cross_mesh_redistribute_4_ranks(case):
    check_minimum_bytes(run_distributed(4, cross_mesh_body, *case))


@_property(2)
@given(case=cross_cases(8))
def test_random_cross_mesh_redistribute_8_ranks(case):
    check_minimum_bytes(run_distributed(8, cross_mesh_body, *case))


# ----------------------------------------------------------------------------- named cases
CASES = {
    # name: (src ranks, src shape, src placements, dst ranks, dst shape, dst placements, shape)
    "reshaped": ([0, 1, 2, 3], (4,), [("S", 0)], [0, 1, 2, 3], (2, 2), [("S", 1), ("S", 0)],
                 (5, 3)),
    "sub_mesh": ([0, 1, 2, 3], (4,), [("S", 0)], [2, 3], (2,), [("S", 1)], (6, 5)),
    "disjoint": ([0, 1], (2,), [("S", 0)], [2, 3], (2,), [("R",)], (3, 4)),
    "overlap": ([0, 1, 2], (3,), [("S", 1)], [3, 2, 1], (3,), [("S", 0)], (7, 2)),
    "partial_src": ([0, 1, 2, 3], (2, 2), [("P", "sum"), ("S", 0)], [3, 1], (2,), [("S", 0)],
                    (4, 4)),
    "partial_dst": ([0, 1], (2,), [("S", 0)], [1, 2, 3], (3,), [("P", "sum")], (4,)),
    "strided": ([0, 1, 2, 3], (2, 2), [("SS", 0, 2), ("S", 0)], [0, 1, 2, 3], (4,),
                [("S", 0)], (9, 2)),
    "empty_pieces": ([0, 1, 2, 3], (4,), [("S", 0)], [1, 2], (2,), [("S", 0)], (1, 3)),
    "scalar": ([0, 1], (2,), [("P", "sum")], [2, 3], (2,), [("R",)], ()),
    # ranks 2 and 3 are in neither mesh: they send and receive nothing and return at once
    "outside_both": ([1], (1,), [("R",)], [0], (1,), [("S", 1)], (3, 5)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cross_mesh_named_cases(name):
    src, ss, sp, dst, ds, dp, shape = CASES[name]
    check_minimum_bytes(run_distributed(4, cross_mesh_body, 4, src, ss, sp, dst, ds, dp, shape,
                                        0))


# ----------------------------------------------------------------------------- autograd
@distributed(world_size=4)
def test_backward_through_cross_mesh_redistribute_equals_torch():
    torch.manual_seed(0)
    full = torch.randn(6, 5)
    w = torch.randn(6, 5)
    A = init_device_mesh("cpu", (2, 2))
    B = DeviceMesh("cpu", [3, 1])
    x = distribute_tensor(full, A, [Shard(0), Shard(1)]).requires_grad_()
    y = x.redistribute(B, [Shard(1)])
    wd = distribute_tensor(w, B, [Shard(1)])
    (y * wd).sum().backward()
    assert x.grad.device_mesh is A and x.grad.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(x.grad.full_tensor(), w)  # d(sum(x * w))/dx = w, exactly


@distributed(world_size=4)
def test_cross_mesh_forward_dtype_moves_bf16():
    A = init_device_mesh("cpu", (4,))
    B = DeviceMesh("cpu", [2, 3])
    full = torch.randn(8, 4)
    x = distribute_tensor(full, A, [Shard(0)])
    with CommDebugMode() as comm:
        y = x.redistribute(B, [Shard(0)], forward_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    ref = distribute_tensor(full.bfloat16(), B, [Shard(0)])
    assert torch.equal(y.to_local(), ref.to_local())
    # rank 2 needs rows 0-3 (ranks 0, 1 hold them), rank 3 rows 4-7 (it holds 6-7; rank 2
    # holds 4-5): two rows of 4 bf16 values from each of ranks 0, 1, 2
    assert comm.get_comm_bytes().get("cross_mesh", 0) == {0: 16, 1: 16, 2: 16, 3: 0}[
        dist.get_rank()]


@distributed(world_size=4)
def test_cross_mesh_errors_are_clear_on_every_rank():
    A = init_device_mesh("cpu", (4,))
    B = DeviceMesh("cpu", [[0, 1], [2, 3]])
    x = distribute_tensor(torch.randn(4, 4), A, [Shard(0)])
    with pytest.raises(ValueError, match="one placement per mesh dimension"):
        x.redistribute(B, [Shard(0)])
    with pytest.raises(ValueError, match="out of range"):
        x.redistribute(B, [Shard(2), Replicate()])
    with pytest.raises(TypeError, match="DeviceMesh"):
        x.redistribute("cpu", [Shard(0)])


@distributed(world_size=4)
def test_explain_cross_mesh_redistribute_shows_the_boxes():
    from dtensor_lite import explain_redistribute
    A = init_device_mesh("cpu", (4,))
    B = DeviceMesh("cpu", [2, 3])
    x = distribute_tensor(torch.randn(8, 4), A, [Shard(0)])
    plan = explain_redistribute(x, B, [Shard(1)])
    with CommDebugMode() as comm:
        x.redistribute(B, [Shard(1)])
    assert plan.bytes_sent().get(dist.get_rank(), 0) == comm.get_comm_bytes().get("cross_mesh", 0)
    assert plan.cost == 32 and "0 -> 2: [0:2, 0:2]" in str(plan)


def _a_source_rank_fails_before_sending():
    from dtensor_lite._failures import post_failure
    from tests.test_no_hang import _fresh_group, _outcome
    with _fresh_group():
        A, B = init_device_mesh("cpu", (4,)), DeviceMesh("cpu", [0, 1])
        x = distribute_tensor(torch.randn(8, 4), A, [Shard(0)])
        if dist.get_rank() == 3:
            def fail():
                error = RuntimeError("injected before the move")
                post_failure(error)
                raise error
            return _outcome(fail)
        return _outcome(lambda: x.redistribute(B, [Replicate()]))


def test_cross_mesh_receivers_stop_when_a_source_rank_fails():
    """Rank 3 fails instead of sending its rows: ranks 0 and 1, waiting for them in the
    point-to-point exchange, stop naming it within a poll interval (nothing hangs)."""
    from tests.test_no_hang import MARGIN
    outcomes = run_distributed(4, _a_source_rank_fails_before_sending, timeout=60)
    t_fail = outcomes[3][2]
    for rank in (0, 1):
        kind, message, t = outcomes[rank]
        assert kind == "RankFailedError" and "rank 3: RuntimeError" in message, outcomes[rank]
        assert t - t_fail < MARGIN + 1.0
