"""The default bucket (``plan_relayout(bucket_bytes=None)``): 1/32 of the busiest rank's
traffic (at most one bucket per 2 tensors) within [1 MiB, 256 MiB], so the planned extra
memory (one bucket's receive buffers and the next one's send and receive buffers: buckets
overlap) stays under 10% of what the busiest rank moves (64 tensors and more) -- planned on
described tensors (no data) of a 1 GiB model; and an overlapped run fills the destination
exactly as distribute_tensor's pieces. A tensor whose traffic passes the bucket is split across
buckets (window k: the k-th part of every pair's boxes), so the bound holds whatever the largest
tensor: same bytes per rank pair as unsplit, same values, in place."""

import torch

import torch.distributed as dist

from dtensor_lite import DeviceMesh, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.describe import describe_model
from dtensor_lite.relayout import (AUTO_BUCKET_FRACTION, AUTO_BUCKET_MIN,
                                   AUTO_TENSORS_PER_BUCKET, auto_bucket_bytes, plan_relayout)
from dtensor_lite.relayout import Concat
from tests.harness import distributed
from tests.test_relayout_fused import check_bucket_bound, wire_buffers


@distributed(world_size=2)
def test_default_bucket_bounds_extra_memory_relative_to_traffic():
    mesh = init_device_mesh("cpu", (2,))
    shapes = {f"layer{i}.w": (1024, 4096) for i in range(64)}  # 1 GiB of fp32, described
    src = describe_model(shapes, mesh, [Shard(0)], dtype=torch.float32)
    dst = describe_model(shapes, mesh, [Shard(1)], dtype=torch.float32)
    plan = plan_relayout(src, dst)
    busiest = max(max(plan.bytes_sent().values()), max(plan.bytes_received().values()))
    assert plan.bucket_bytes == auto_bucket_bytes(plan.moves) == busiest // AUTO_BUCKET_FRACTION
    assert len(plan.buckets) >= AUTO_BUCKET_FRACTION // 2
    assert max(plan.peak_extra_bytes().values()) <= 0.1 * busiest
    # a small model: the floor (latency, not memory, bounds tiny buckets)
    small = plan_relayout(describe_model({"w": (8, 8)}, mesh, [Shard(0)], dtype=torch.float32),
                          describe_model({"w": (8, 8)}, mesh, [Shard(1)], dtype=torch.float32))
    assert small.bucket_bytes == AUTO_BUCKET_MIN
    # few large tensors: at most one bucket (one round of messages) per 2 tensors, not 32
    few = {f"w{i}": (1024, 4096) for i in range(4)}
    plan = plan_relayout(describe_model(few, mesh, [Shard(0)], dtype=torch.float32),
                         describe_model(few, mesh, [Shard(1)], dtype=torch.float32))
    busiest = max(max(plan.bytes_sent().values()), max(plan.bytes_received().values()))
    assert plan.bucket_bytes == busiest * AUTO_TENSORS_PER_BUCKET // 4
    assert len(plan.buckets) == 4 // AUTO_TENSORS_PER_BUCKET


@distributed(world_size=2)
def test_overlapped_buckets_fill_the_destination_exactly():
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    full = {f"w{i}": torch.randn(16, 8 + i) for i in range(6)}
    src = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
    dst = {n: distribute_tensor(torch.zeros(t.shape), mesh, [Shard(1)]) for n, t in full.items()}
    # each tensor sends <= 224 B per rank, any two more than 240: one per bucket, 6 overlapped
    plan = plan_relayout(src, dst, bucket_bytes=240)
    assert len(plan.buckets) == 6
    plan.run(src, dst)
    for n, t in full.items():
        assert torch.equal(dst[n].to_local(), distribute_tensor(t, mesh, [Shard(1)]).to_local())


@distributed(world_size=4)
def test_tensors_many_times_the_bucket_are_split_across_buckets():
    """A 4 KiB bucket; FSDP-4 sources of 37 x 300 fp32 (43 KiB: uneven pieces), a 1-row one,
    an empty one, and rows of 2000 columns (8 KiB: one row passes the bucket) -> a fused
    per-rank [q_r; k_r; v_r] on TP-2 (ranks 2, 3: overlapping) and a Shard(1) weight on all 4."""
    torch.manual_seed(0)
    full = {"q": torch.randn(38, 300), "k": torch.randn(2, 300), "v": torch.zeros(0, 300),
            "wide": torch.randn(5, 2000)}
    A = init_device_mesh("cpu", (4,))
    tp = DeviceMesh("cpu", [2, 3])
    srcs = {n: distribute_tensor(t, A, [Shard(0)]) for n, t in full.items()}
    dsts = {"qkv": distribute_tensor(torch.zeros(40, 300), tp, [Shard(0)]),
            "wide": distribute_tensor(torch.zeros(5, 2000), A, [Shard(1)])}
    buffers = {n: d._local_tensor for n, d in dsts.items()}
    fused = {"qkv": Concat(["q", "k", "v"], per_rank=True)}
    bucket = 4096
    plan = plan_relayout(srcs, dsts, fused=fused, bucket_bytes=bucket)
    whole = plan_relayout(srcs, dsts, fused=fused, bucket_bytes=1 << 30)
    assert len(whole.buckets) == 1 and len(plan.buckets) >= 2 * 43 * 1024 // (3 * bucket)
    assert plan.pair_bytes() == whole.pair_bytes()  # the minimum, unchanged by splitting
    for k in range(len(plan.buckets)):
        assert max(max(side.values(), default=0) for side in plan.bucket_traffic(k)) <= bucket
    with wire_buffers() as seen:
        plan.run(srcs, dsts)
    check_bucket_bound(plan, seen, dist.get_rank())
    coord = tp.get_coordinate()
    if coord is not None:
        want = torch.cat([full[n].chunk(2)[coord[0]] if len(full[n]) else full[n]
                          for n in ("q", "k", "v")])
        assert dsts["qkv"]._local_tensor is buffers["qkv"]
        assert torch.equal(buffers["qkv"], want)
    assert dsts["wide"]._local_tensor is buffers["wide"]
    assert torch.equal(buffers["wide"],
                       distribute_tensor(full["wide"], A, [Shard(1)]).to_local())


@distributed(world_size=2)
def test_a_partial_source_split_across_buckets_is_reduced_once():
    """A Partial("sum") source 3 KiB per rank with a 256 B bucket: its windows share one
    reduction inside its mesh (one collective, not one per window) and the destination holds
    the sum."""
    from dtensor_lite import DTensor, Partial
    from dtensor_lite.debug import CommDebugMode
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(dist.get_rank())
    mine = torch.randn(24, 32)
    src = {"w": DTensor.from_local(mine, mesh, [Partial("sum")])}
    dst = {"w": distribute_tensor(torch.zeros(24, 32), mesh, [Shard(0)])}
    plan = plan_relayout(src, dst, bucket_bytes=256)
    assert len(plan.buckets) > 1
    with CommDebugMode() as comm:
        plan.run(src, dst, check=False)
    counts = dict(comm.get_comm_counts())
    assert counts.pop("cross_mesh") == len(plan.buckets)
    assert sum(counts.values()) == 1, counts
    total = mine.clone()
    dist.all_reduce(total)
    assert torch.allclose(dst["w"].to_local(), total.chunk(2)[dist.get_rank()], rtol=0, atol=0)


def test_split_windows_tile_every_box_and_keep_every_pair_busy():
    """``split_plan`` on metadata alone: the windows cover every box of every pair (and every
    local copy) exactly once, each fits the bucket, and every pair sends in every window (the
    windows slice each pair's boxes, not the tensor's rows: one tensor's buckets do not run
    one pair after another); down to a bucket of one element, where a rank's several boxes go
    one per window."""
    import itertools
    import math

    from dtensor_lite.redistribute.cross_mesh import CrossMeshPlan
    from dtensor_lite.relayout_split import split_plan
    plan = CrossMeshPlan({(0, 2): [((0, 40), (0, 6))], (1, 2): [((40, 80), (0, 6))],
                          (1, 3): [((80, 83), (0, 6)), ((83, 84), (2, 5))]},
                         {3: [((84, 90), (0, 6))]}, itemsize=4)

    def cells(table):
        return sorted((key, c) for key, boxes in table.items() for box in boxes
                      for c in itertools.product(*[range(s, e) for s, e in box]))
    for bucket in (4, 12, 100, 400, 960, 1 << 20):
        windows = split_plan(plan, bucket)
        got_pairs = sorted(c for w in windows for c in cells(w.pairs))
        assert got_pairs == cells(plan.pairs)
        assert sorted(c for w in windows for c in cells(w.local)) == cells(plan.local)
        for w in windows:
            sent, recv = {}, {}
            for (a, b), n in w.pair_bytes().items():
                sent[a] = sent.get(a, 0) + n
                recv[b] = recv.get(b, 0) + n
            assert max([*sent.values(), *recv.values(), 0]) <= bucket
        for key, boxes in plan.pairs.items():  # a pair whose boxes have at least a part for
            if min(math.prod(e - s for s, e in b) for b in boxes) >= len(windows):  # each
                assert all(key in w.pairs for w in windows), (key, bucket)  # window: in each
    assert split_plan(plan, 1 << 20) == [plan]
