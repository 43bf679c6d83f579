"""The default bucket (``plan_relayout(bucket_bytes=None)``): 1/32 of the busiest rank's
traffic within [1 MiB, 256 MiB], so the planned extra memory (one bucket's receive buffers and
the next one's send and receive buffers: buckets overlap) stays under 10% of what the busiest
rank moves -- planned on described tensors (no data) of a 1 GiB model; and an overlapped run
fills the destination exactly as distribute_tensor's pieces."""

import torch

from dtensor_lite import Shard, distribute_tensor, init_device_mesh
from dtensor_lite.describe import describe_model
from dtensor_lite.relayout import (AUTO_BUCKET_FRACTION, AUTO_BUCKET_MIN, auto_bucket_bytes,
                                   plan_relayout)
from tests.harness import distributed


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


@distributed(world_size=2)
def test_overlapped_buckets_fill_the_destination_exactly():
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    full = {f"w{i}": torch.randn(16, 8 + i) for i in range(6)}
    src = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
    dst = {n: distribute_tensor(torch.zeros(t.shape), mesh, [Shard(1)]) for n, t in full.items()}
    plan = plan_relayout(src, dst, bucket_bytes=64)  # one tensor per bucket: 6 overlapped
    assert len(plan.buckets) == 6
    plan.run(src, dst)
    for n, t in full.items():
        assert torch.equal(dst[n].to_local(), distribute_tensor(t, mesh, [Shard(1)]).to_local())
