"""``redistribute(async_op=True)``: returns once the collective is issued, its local piece waits
at first use (forward and backward), values equal the synchronous path; and ``ExposedCommMode``
sees the wait shrink when compute runs between issue and use."""

import time

import pytest
import torch
import torch.distributed as dist

from dtensor_lite import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.debug import CommDebugMode, ExposedCommMode
from tests.harness import distributed

# (mesh shape, source placements, target placements): one collective, several, and a plan whose
# last collective is followed by local steps; uneven shards throughout (7 x 5 over 2 ranks)
CASES = [
    ((4,), [Shard(0)], [Replicate()]),
    ((4,), [Partial()], [Shard(1)]),
    ((4,), [Shard(0)], [Shard(1)]),
    ((2, 2), [Shard(0), Shard(1)], [Replicate(), Replicate()]),
    ((2, 2), [Partial(), Shard(0)], [Shard(1), Replicate()]),
    ((2, 2), [Replicate(), Partial("max")], [Replicate(), Replicate()]),
]


@distributed(world_size=4)
@pytest.mark.parametrize("shape, src, dst", CASES)
def test_async_redistribute_equals_sync_forward_and_backward(shape, src, dst):
    mesh = init_device_mesh("cpu", shape)
    torch.manual_seed(1)
    x = torch.randn(7, 5)
    results = {}
    for async_op in (False, True):
        d = distribute_tensor(x, mesh, [Replicate()] * len(shape)).redistribute(mesh, src)
        d = d.detach().requires_grad_()
        with CommDebugMode() as comm:
            y = d.redistribute(mesh, dst, async_op=async_op)
            issued = comm.get_comm_counts()
            if async_op:
                # returned before anyone waited: the piece is still pending
                assert y._pending is not None or not issued
            out = (y * y).sum()
        out.backward()
        results[async_op] = (y.to_local(), out.to_local(), d.grad.to_local(), issued)
    (y_sync, out_sync, g_sync, c_sync), (y_async, out_async, g_async, c_async) = \
        results[False], results[True]
    assert torch.equal(y_async, y_sync)  # the same collectives, the same order: bit for bit
    assert torch.equal(out_async, out_sync)
    assert torch.equal(g_async, g_sync)
    assert c_async == c_sync  # no extra communication for going async


@distributed(world_size=2)
def test_async_redistribute_local_piece_waits_at_first_use():
    mesh = init_device_mesh("cpu", (2,))
    d = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
    y = d.redistribute(mesh, [Replicate()], async_op=True)
    assert y.shape == (6, 2) and y.placements == (Replicate(),)  # metadata needs no wait
    assert y._pending is not None
    assert torch.equal(y.to_local(), torch.arange(12.0).reshape(6, 2))
    assert y._pending is None  # waited once; later uses read the stored piece
    # a redistribute with nothing to communicate is simply done
    same = d.redistribute(mesh, [Shard(0)], async_op=True)
    assert torch.equal(same.to_local(), d.to_local())


def _gather_seconds(big, mesh, async_op, compute_s):
    """Exposed and total seconds of one all-gather of ``big`` with ``compute_s`` of 'compute'
    (a sleep: the rank does other work) between issue and use."""
    dist.barrier()
    with ExposedCommMode() as comm:
        y = big.redistribute(mesh, [Replicate()], async_op=async_op)
        time.sleep(compute_s)
        local = y.to_local()
    dist.barrier()  # every completion callback has run once all ranks are past the gather
    time.sleep(0.01)
    return comm.exposed_s, comm.total_s, local


@distributed(world_size=2)
def test_async_all_gather_overlaps_with_compute():
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    big = distribute_tensor(torch.randn(4096, 1024), mesh, [Shard(0)])  # 8 MiB per rank
    sync_exposed, sync_total, sync_local = _gather_seconds(big, mesh, False, 0.0)
    assert sync_exposed > 0.5 * sync_total  # a synchronous collective is all exposed
    compute = max(0.2, 3 * sync_total)       # comfortably longer than the gather itself
    exposed, total, local = _gather_seconds(big, mesh, True, compute)
    assert torch.equal(local, sync_local)
    # the rank slept while gloo moved the bytes: it waits (far) less than the gather took
    assert exposed < 0.5 * total, (exposed, total)


@distributed(world_size=2)
def test_exposed_comm_mode_times_every_fsdp_collective():
    """Every collective of an FSDP step shows in ExposedCommMode (count, in-flight time) as in
    CommDebugMode, whether its backend reports completion (all-gather) or not (reduce-scatter)."""
    from fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    mesh = init_device_mesh("cpu", (2,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with CommDebugMode() as counts, ExposedCommMode() as clock:
        model(torch.randn(3, 8)).sum().backward()
    dist.barrier()
    time.sleep(0.01)  # completion callbacks run on gloo's threads
    timed = clock.by_kind()
    assert {k: v["count"] for k, v in timed.items()} == counts.get_comm_counts()
    assert all(v["total_s"] > 0 and v["exposed_s"] >= 0 for v in timed.values())
    assert 0 < clock.exposed_s and 0 < clock.total_s
