"""Per-rank fused destinations (``Concat(names, per_rank=True)``): an inference engine's
``[q_r; k_r; v_r]`` / ``[gate_r; up_r]`` layout filled in place from a trainer's q, k, v.

Property test (hypothesis): random fused groups (1-4 sources, unequal sizes, empty ones), random
source layouts (uneven and empty pieces), 1-D and 2-D engine meshes colocated with, disjoint from
or overlapping the trainer's: every engine rank's fused buffer equals the concatenation of its
pieces of the sources under the engine's placements (``distribute_tensor``'s pieces: the
oracle), written into the same storage; the bytes sent are the minimum (every needed element a
rank does not hold crosses once); with buckets down to one element, tensors many times the
bucket are split across buckets, each bucket's wire buffers stay within it and the most held at
once is the plan's ``peak_extra_bytes`` (<= 3 buckets). Named cases: GQA into TP-2 replicas
sliced from a 2-D mesh, the errors (a missing source, sizes that do not add up, an ambiguous
``Concat``, per-rank sizes that do not split)."""

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st

from dtensor_lite import DeviceMesh, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite import collectives
from dtensor_lite.debug import CommDebugMode
from dtensor_lite.relayout import Concat, plan_relayout
from tests.harness import distributed, run_distributed
from tests.test_cross_mesh import check_minimum_bytes


def _placement(spec):
    return Shard(spec[1]) if spec[0] == "S" else Replicate()


@contextlib.contextmanager
def wire_buffers():
    """[(bytes sent, bytes received)] of this rank's wire buffers, one entry per exchange (per
    bucket), as the relayout really allocates them."""
    seen, real = [], collectives.exchange_pieces

    def recording(sends, recvs, *args, **kwargs):
        seen.append((sum(t.numel() * t.element_size() for t in sends.values()),
                     sum(n * torch.empty(0, dtype=d).element_size() for n, d in recvs.values())))
        return real(sends, recvs, *args, **kwargs)
    collectives.exchange_pieces = recording
    try:
        yield seen
    finally:
        collectives.exchange_pieces = real


def check_bucket_bound(plan, seen, rank):
    """Every bucket's wire buffers within ``bucket_bytes`` each way, and the most held at once
    (bucket k's receive buffers beside k+1's send and receive buffers) exactly the plan's
    ``peak_extra_bytes`` -- at most 3 buckets."""
    assert len(seen) == len(plan.buckets)
    held, prev = 0, 0
    for sent, recv in seen:
        assert sent <= plan.bucket_bytes and recv <= plan.bucket_bytes, (sent, recv)
        held, prev = max(held, prev + sent + recv), recv
    assert held == plan.peak_extra_bytes().get(rank, 0) <= 3 * plan.bucket_bytes


def fused_body(src_ranks, src_shape, src_pls, dst_ranks, dst_shape, dst_pl, sizes, cols,
               bucket, seed):
    rank = dist.get_rank()
    A = DeviceMesh("cpu", torch.tensor(src_ranks).reshape(src_shape))
    B = DeviceMesh("cpu", torch.tensor(dst_ranks).reshape(dst_shape))
    dst_pl = [_placement(p) for p in dst_pl]
    torch.manual_seed(seed)
    full = [torch.randn(n, cols, dtype=torch.float64) for n in sizes]
    names = [f"w{i}" for i in range(len(sizes))]
    srcs = {n: distribute_tensor(t, A, [_placement(p) for p in pl], src_data_rank=None)
            for n, t, pl in zip(names, full, src_pls)}
    fused = distribute_tensor(torch.zeros(sum(sizes), cols, dtype=torch.float64), B, dst_pl,
                              src_data_rank=None)
    buffer = fused._local_tensor  # the engine's own buffer
    plan = plan_relayout(srcs, {"fused": fused}, bucket_bytes=bucket,
                         fused={"fused": Concat(names, dim=0, per_rank=True)})
    with CommDebugMode() as comm, wire_buffers() as seen:
        plan.run(srcs, {"fused": fused})
    check_bucket_bound(plan, seen, rank)
    sent = comm.get_comm_bytes().get("cross_mesh", 0)
    assert sent == plan.bytes_sent().get(rank, 0)
    assert fused._local_tensor is buffer
    # element ids (1-based, source after source) for the minimum-bytes check
    ids, start = [], 1
    for n in sizes:
        ids.append(torch.arange(start, start + n * cols, dtype=torch.float64).reshape(n, cols))
        start += n * cols
    held, need = [], []
    for t, i, pl in zip(full, ids, src_pls):
        held += distribute_tensor(i, A, [_placement(p) for p in pl],
                                  src_data_rank=None).to_local().flatten().tolist()
    if B.get_coordinate() is not None:
        expected = torch.cat([distribute_tensor(t, B, dst_pl, src_data_rank=None).to_local()
                              for t in full], dim=0)
        assert torch.equal(buffer, expected), (buffer, expected)
        for i in ids:
            need += distribute_tensor(i, B, dst_pl, src_data_rank=None).to_local().flatten() \
                .tolist()
    return {"rank": rank, "sent": sent, "held": sorted(int(x) for x in held if x),
            "need": sorted(int(x) for x in need if x), "partial_src": False, "largest": 0,
            "biggest_piece": 1, "global": start - 1}


@st.composite
def fused_cases(draw, world=4):
    relation = draw(st.sampled_from(["colocated", "disjoint", "overlapping", "any"]))
    order = draw(st.permutations(range(world)))
    if relation == "colocated":
        n = draw(st.integers(1, world))
        src_ranks, dst_ranks = order[:n], list(draw(st.permutations(order[:n])))
    elif relation == "disjoint":
        a = draw(st.integers(1, world - 1))
        src_ranks, dst_ranks = order[:a], order[a:]
    elif relation == "overlapping":
        a = draw(st.integers(2, world - 1))
        src_ranks, dst_ranks = order[:a], order[a - 1:]
    else:
        src_ranks = order[:draw(st.integers(1, world))]
        dst_ranks = list(draw(st.permutations(range(world))))[:draw(st.integers(1, world))]

    def shape_of(ranks):
        n = len(ranks)
        return draw(st.sampled_from([(n,)] + [(a, n // a) for a in range(2, n) if n % a == 0]))
    src_shape, dst_shape = shape_of(src_ranks), shape_of(dst_ranks)
    # the engine shards the fused dim (0) on at least one mesh dim: the per-rank case
    dst_pl = [draw(st.sampled_from([("S", 0), ("S", 1), ("R",)])) for _ in dst_shape]
    if ("S", 0) not in dst_pl:
        dst_pl[draw(st.integers(0, len(dst_shape) - 1))] = ("S", 0)
    pieces = math.prod(n for n, p in zip(dst_shape, dst_pl) if p == ("S", 0))
    k = draw(st.integers(1, 4))
    # unequal sizes (GQA: q bigger than k and v), some empty; each splits evenly over the
    # engine's shards of dim 0, as every engine's heads do
    sizes = [pieces * draw(st.integers(0, 3)) for _ in range(k)]
    cols = draw(st.integers(1, 5))
    src_pls = [[draw(st.sampled_from([("S", 0), ("S", 1), ("R",)])) for _ in src_shape]
               for _ in range(k)]
    # one element (fp64), a few: tensors many times the bucket are split across buckets
    bucket = draw(st.sampled_from([8, 24, 64, 1 << 20]))
    return (list(src_ranks), src_shape, src_pls, list(dst_ranks), dst_shape, dst_pl, sizes,
            cols, bucket, draw(st.integers(0, 2**16)))


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=fused_cases())
def test_random_per_rank_fused_groups_4_ranks(case):
    check_minimum_bytes(run_distributed(4, fused_body, *case))


@distributed(world_size=4)
def test_gqa_qkv_and_gate_up_into_tp2_replicas_of_a_2d_mesh():
    """FSDP-4 q (8 rows: 4 heads of 2), k, v (4 rows: 2 kv heads) and gate, up -> two TP-2
    replicas (``mesh["tp"]`` of a (rep, tp) mesh), bf16: TP rank r holds [q_r; k_r; v_r] and
    [gate_r; up_r], in the engine's own buffers, in both replicas."""
    torch.manual_seed(0)
    full = {"q": torch.randn(8, 6), "k": torch.randn(4, 6), "v": torch.randn(4, 6),
            "gate": torch.randn(10, 6), "up": torch.randn(10, 6)}
    A = init_device_mesh("cpu", (4,))
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "tp"))["tp"]
    srcs = {n: distribute_tensor(t, A, [Shard(0)]) for n, t in full.items()}
    dsts = {"qkv": distribute_tensor(torch.zeros(16, 6, dtype=torch.bfloat16), tp, [Shard(0)]),
            "gate_up": distribute_tensor(torch.zeros(20, 6, dtype=torch.bfloat16), tp,
                                         [Shard(0)])}
    buffers = {n: d._local_tensor for n, d in dsts.items()}
    fused = {"qkv": Concat(["q", "k", "v"], per_rank=True),
             "gate_up": Concat(["gate", "up"], per_rank=True)}
    plan = plan_relayout(srcs, dsts, fused=fused, dtype=torch.bfloat16)
    plan.run(srcs, dsts)
    r = tp.get_coordinate()[0]
    want = {"qkv": torch.cat([full[n].chunk(2)[r] for n in ("q", "k", "v")]),
            "gate_up": torch.cat([full[n].chunk(2)[r] for n in ("gate", "up")])}
    for n, d in dsts.items():
        assert d._local_tensor is buffers[n]
        assert torch.equal(buffers[n], want[n].bfloat16()), n
    # the global spelling puts other rows there (all of q on TP rank 0): it must be asked for
    assert not torch.equal(want["qkv"], torch.cat([full["q"], full["k"], full["v"]]).chunk(2)[r])


@distributed(world_size=2)
def test_fused_errors_are_clear_on_every_rank():
    A = init_device_mesh("cpu", (2,))
    srcs = {n: distribute_tensor(torch.randn(s, 4), A, [Shard(0)])
            for n, s in (("q", 4), ("k", 2), ("v", 2))}
    dst = {"qkv": distribute_tensor(torch.zeros(8, 4), A, [Shard(0)])}
    with pytest.raises(ValueError, match=r"two meanings; choose one: per_rank=True"):
        plan_relayout(srcs, dst, fused={"qkv": Concat(["q", "k", "v"])})
    with pytest.raises(KeyError, match="needs source 'kk'"):
        plan_relayout(srcs, dst, fused={"qkv": Concat(["q", "kk", "v"], per_rank=True)})
    with pytest.raises(ValueError, match=r"sources \['q', 'k'\] have \[4, 2\] \(sum 6\); the "
                                         "sizes must add up"):
        plan_relayout(srcs, dst, fused={"qkv": Concat(["q", "k"], per_rank=True)})
    with pytest.raises(ValueError, match="cannot hold 'w'"):
        plan_relayout({**srcs, "w": distribute_tensor(torch.randn(2, 3), A, [Shard(0)])}, dst,
                      fused={"qkv": Concat(["q", "k", "w"], per_rank=True)})
    # 3 + 3 rows split as 2+1 and 2+1 per rank, but the fused 6 rows as 3 and 3
    odd = {n: distribute_tensor(torch.randn(3, 4), A, [Shard(0)]) for n in ("a", "b")}
    with pytest.raises(ValueError, match=r"coordinate \[0\] holds 3 rows .* have \[2, 2\]"):
        plan_relayout(odd, {"ab": distribute_tensor(torch.zeros(6, 4), A, [Shard(0)])},
                      fused={"ab": Concat(["a", "b"], per_rank=True)})
    with pytest.raises(TypeError, match="per_rank must be True, False or None"):
        plan_relayout(srcs, dst, fused={"qkv": Concat(["q", "k", "v"], per_rank="yes")})
    # not sharded along the fused dim: both meanings agree, no choice needed
    rep = {"qkv": distribute_tensor(torch.zeros(8, 4), A, [Shard(1)])}
    plan_relayout(srcs, rep, fused={"qkv": Concat(["q", "k", "v"])}).run(srcs, rep)


def test_dry_run_cli_plans_the_engines_fused_layout_at_the_same_bytes(capsys):
    """``python -m dtensor_lite.plan relayout --fused``: the destination fuses q, k, v and
    gate, up per rank; the same elements cross as without fusion (fusion moves no extra byte)."""
    import json

    from dtensor_lite.plan.__main__ import main
    argv = ["relayout", "--model", "example", "--src", "dp_shard=4", "--dst", "tp=2",
            "--dst-first-rank", "4", "--json"]
    main(argv)
    plain = json.loads(capsys.readouterr().out)
    main(argv + ["--fused"])
    fused = json.loads(capsys.readouterr().out)
    assert fused["total_bytes"] == plain["total_bytes"] > 0
    assert fused["busiest_sender_bytes"] == plain["busiest_sender_bytes"]
