"""Tests of the multi-process harness itself (tests/harness.py)."""

import dataclasses
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import (
    DistributedTestFailure,
    DistributedTestTimeout,
    distributed,
    reinit_process_group,
    run_distributed,
)

# ----------------------------------------------------------------- bodies run on every rank


def _rank_and_sum(scale):
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item() * scale


def _pid():
    return os.getpid()


def _raise_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    return "fine"


def _raise_while_others_wait():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gave up before the collective")
    dist.all_reduce(torch.ones(1))  # never completes: rank 1 does not join


def _sleep_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(60)


def _exit_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)


def _destroy_and_reinit():
    dist.destroy_process_group()
    assert not dist.is_initialized()
    reinit_process_group()
    t = torch.ones(2)
    dist.all_reduce(t)
    return t.tolist()


def _destroy_only():
    dist.destroy_process_group()


def _group_works():
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.is_initialized() and t.item() == dist.get_world_size()


def _random_draw():
    return torch.rand(3).tolist()


# ----------------------------------------------------------------- run_distributed


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_run_distributed_returns_per_rank_values(world_size):
    total = world_size * (world_size + 1) / 2
    results = run_distributed(world_size, _rank_and_sum, 10)
    assert results == [(rank, world_size, total * 10) for rank in range(world_size)]


def test_workers_persist_between_calls():
    first = run_distributed(2, _pid)
    assert len(set(first)) == 2 and os.getpid() not in first
    assert run_distributed(2, _pid) == first


def test_each_body_starts_from_seed_zero():
    torch.manual_seed(0)
    expected = torch.rand(3).tolist()
    assert run_distributed(2, _random_draw) == [expected, expected]
    assert run_distributed(2, _random_draw) == [expected, expected]


def test_rejects_functions_workers_cannot_import():
    with pytest.raises(ValueError, match="module-level"):
        run_distributed(2, lambda: 1)


# ----------------------------------------------------------------- the decorator


@distributed(world_size=2)
def test_decorated_body_runs_on_every_rank():
    assert dist.get_world_size() == 2
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    assert t.item() == 1.0
    assert _rank_and_sum(1)[2] == 3.0  # module-level helpers are usable in the workers


@dataclasses.dataclass(frozen=True)
class Shape:
    rows: int
    cols: int


@distributed(world_size=4)
@pytest.mark.parametrize("shape", [Shape(2, 3), Shape(1, 1)])
@pytest.mark.parametrize("fill", [1.0, 2.5])
def test_decorated_with_parametrize(shape, fill):
    t = torch.full((shape.rows, shape.cols), fill)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((shape.rows, shape.cols), 4 * fill))


@pytest.mark.parametrize("n", [0, 5])
@distributed(world_size=2)
def test_parametrize_outside_the_decorator(n):
    assert isinstance(n, int)
    t = torch.arange(n, dtype=torch.float32)
    dist.all_reduce(t)
    assert torch.equal(t, 2 * torch.arange(n, dtype=torch.float32))


# ----------------------------------------------------------------- failures and recovery


def test_failing_rank_reports_its_traceback_and_pool_stays_healthy():
    before = run_distributed(2, _pid)
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(2, _raise_on_rank, 1)
    message = str(info.value)
    assert "failed on rank(s) [1]" in message
    assert "Traceback" in message and "ValueError: boom from rank 1" in message
    assert "_raise_on_rank" in message  # the frame of the failing body
    # Every rank answered, so the pool was kept (same processes) and still works.
    assert run_distributed(2, _pid) == before
    assert run_distributed(2, _group_works) == [True, True]


def test_failing_rank_while_others_are_stuck_in_a_collective():
    before = run_distributed(2, _pid)
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(2, _raise_while_others_wait, timeout=60)
    assert time.monotonic() - start < 30  # the grace period, not the 60 s timeout
    message = str(info.value)
    assert "failed on rank(s) [1]" in message and "gave up before the collective" in message
    assert "ranks [0] had not returned" in message
    after = run_distributed(2, _pid)  # a fresh pool
    assert set(after).isdisjoint(before)
    assert run_distributed(2, _group_works) == [True, True]


def test_hang_times_out_and_pool_recovers():
    before = run_distributed(2, _pid)
    start = time.monotonic()
    with pytest.raises(DistributedTestTimeout) as info:
        run_distributed(2, _sleep_on_rank_1, timeout=3)
    assert 3 <= time.monotonic() - start < 15
    message = str(info.value)
    assert "timed out after 3s" in message and "world_size=2" in message
    assert "test_hang_times_out_and_pool_recovers" in message and "[1]" in message
    after = run_distributed(2, _pid)
    assert set(after).isdisjoint(before)
    assert run_distributed(2, _group_works) == [True, True]


def test_dead_worker_is_reported_and_pool_recovers():
    with pytest.raises(DistributedTestFailure, match=r"rank\(s\) \[1\][\s\S]*exit code 3"):
        run_distributed(2, _exit_on_rank_1, timeout=60)
    assert run_distributed(2, _group_works) == [True, True]


# ----------------------------------------------------------------- process group lifecycle


def test_destroy_and_reinit_inside_a_body():
    assert run_distributed(4, _destroy_and_reinit) == [[4.0, 4.0]] * 4
    assert run_distributed(4, _group_works) == [True] * 4


def test_destroyed_group_is_restored_for_the_next_test():
    before = run_distributed(2, _pid)
    run_distributed(2, _destroy_only)
    assert run_distributed(2, _group_works) == [True, True]
    assert run_distributed(2, _pid) == before  # repaired in place, no restart


@distributed(world_size=2)
def test_decorated_destroy_and_reinit():
    dist.destroy_process_group()
    reinit_process_group()
    reinit_process_group()  # also fine while a group exists: it replaces it
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0


def test_reinit_outside_a_worker_is_an_error():
    with pytest.raises(RuntimeError, match="inside a tests.harness worker"):
        reinit_process_group()
