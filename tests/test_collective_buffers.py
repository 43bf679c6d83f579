"""The buffers a collective makes only to send a piece are freed when its wait returns.

A gather along a non-leading dim sends a contiguous copy of the piece (the moved dim first); an
all-to-all sends its chunks in group order; the check of ``debug.check_collectives`` gathers one
row per rank. The backend gets a private alias of each (dtensor_lite/_inflight.py), which gloo's
thread lets go of a moment after the work completes -- so, left to the alias, such a buffer lived
until a later collective retired it, or not, by that thread's timing: e.g. half the logits beside
the gathered ones at the start of backward (benchmarks/memory.py, dp2 x tp2), and a figure that
differed between ranks of one program (tests/test_plan.py's agreement of a dry run with a real
run). Here: every buffer handed to the backend that is neither the caller's piece nor the result
has no memory left once the call returns, the caller's piece keeps its memory and values, and the
results are the gathered values. On CUDA dropping the reference is the release (``free_now``
leaves CUDA tensors alone): there only the values are checked.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist

from dtensor_lite import DTensor, Partial, Replicate, Shard, _inflight, init_device_mesh
from dtensor_lite import collectives as C
from dtensor_lite.debug import check_collectives
from dtensor_lite.quiet_profiler import memory_profile
from tests._spies import FunctionNames, process_group_calls
from tests.harness import distributed


@contextlib.contextmanager
def _handed_to_backend():
    """Every tensor a collective hands to the backend (its private aliases), in order."""
    seen, private = [], _inflight.private

    def spy(arg, hold):
        out = private(arg, hold)
        seen.extend(out if isinstance(out, (list, tuple)) else [out])
        return out
    _inflight.private = spy
    try:
        yield seen
    finally:
        _inflight.private = private


def _freed(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == 0


def _pieces():
    """(the global 4 x 6 tensor, this rank's piece of columns), different on every rank."""
    whole = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return whole, whole.chunk(2, dim=1)[dist.get_rank()].contiguous()


@distributed(world_size=2)
@pytest.mark.parametrize("async_op", [False, True])
def test_a_gather_frees_the_copy_it_sent_and_keeps_the_piece(async_op):
    mesh = init_device_mesh("cpu", (2,))
    whole, piece = _pieces()
    kept = piece.clone()
    with _handed_to_backend() as seen:
        got = C.all_gather(piece, mesh, 0, gather_dim=1, async_op=async_op)
        if async_op:
            got = got.wait()
    out, sent = seen  # all_gather_single(output, input)
    assert torch.equal(got, whole) and torch.equal(piece, kept)
    assert sent.untyped_storage().data_ptr() != piece.untyped_storage().data_ptr()
    assert _freed(sent) == (piece.device.type == "cpu") and not _freed(out)
    with _handed_to_backend() as seen:  # along dim 0 the piece itself is sent: left alone
        rows = C.all_gather(piece, mesh, 0, gather_dim=0)
    assert seen[1].untyped_storage().data_ptr() == piece.untyped_storage().data_ptr()
    assert not _freed(piece) and torch.equal(piece, kept)
    assert torch.equal(rows, torch.cat(whole.chunk(2, dim=1)))


@distributed(world_size=2)
def test_redistribute_to_replicate_frees_the_copy_of_a_column_piece():
    """The cached plan's runner (collectives.sync_runner), as a column-parallel Linear's output
    hook gathers the logits: after the call only the result is new, no copy of the piece."""
    mesh = init_device_mesh("cpu", (2,))
    whole, piece = _pieces()
    dt = DTensor.from_local(piece, mesh, [Shard(1)])
    assert torch.equal(dt.redistribute(mesh, [Replicate()]).to_local(), whole)  # warm: plan cached
    with _handed_to_backend() as seen:
        got = dt.redistribute(mesh, [Replicate()]).to_local()
    assert torch.equal(got, whole) and torch.equal(piece, whole.chunk(2, dim=1)[dist.get_rank()])
    assert _freed(seen[1]) == (piece.device.type == "cpu") and not _freed(piece)
    if piece.device.type != "cpu":
        return
    with memory_profile() as prof:  # the allocator: what the call left live is its result
        got = dt.redistribute(mesh, [Replicate()]).to_local()
    assert sum(nbytes for _, nbytes in _allocator_events(prof)) == got.untyped_storage().nbytes()


def _allocator_events(prof):
    """``(time ns, bytes: + allocated / - freed)`` of the CPU allocator under ``prof``."""
    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.name == "[memory]" and e.extra_fields.device.type == "cpu":
            out.append((e.start_time_ns, e.extra_fields.alloc_size))
    return sorted(out)


@distributed(world_size=2)
def test_all_to_all_frees_the_chunks_it_sent():
    mesh = init_device_mesh("cpu", (2,))
    whole, piece = _pieces()
    me = dist.get_rank()
    rows = whole.chunk(2, dim=0)[me].contiguous()  # Shard(0) -> Shard(1): rows in, columns out
    kept = rows.clone()
    with _handed_to_backend() as seen:
        got = C.all_to_all(rows, mesh, 0, split_dim=1, cat_dim=0)
    assert torch.equal(got, piece) and torch.equal(rows, kept)
    out, sent = seen
    assert _freed(sent) == (rows.device.type == "cpu") and not _freed(out) and not _freed(rows)


@distributed(world_size=2)
def test_the_check_of_check_collectives_frees_its_rows():
    mesh = init_device_mesh("cpu", (2,))
    whole, piece = _pieces()
    with check_collectives(), _handed_to_backend() as seen:
        got = C.all_gather(piece, mesh, 0, gather_dim=1)
    assert torch.equal(got, whole)
    rows, row = seen[:2]  # the check's all-gather comes first: (rows, row)
    assert rows.shape[0] == 2 and row.shape[0] == 1
    assert _freed(rows) == _freed(row) == (piece.device.type == "cpu")


@distributed(world_size=2)
def test_cached_moves_call_the_process_group_unless_something_would_see_the_call():
    """A cached plan's collective (the three sync runners: all-gather, reduce-scatter,
    all-reduce) calls the process group's method itself, once per move, with dist's wrapper
    left out; where dist's wrapper would hand the call to someone -- a TorchFunctionMode, a
    coalescing manager -- the move takes dist's functions, as before. Values equal either way."""
    mesh = init_device_mesh("cpu", (2,))
    me = dist.get_rank()
    whole, piece = _pieces()
    cases = [  # (source piece, source placement, target placement, expected local result)
        (piece, Shard(1), Replicate(), whole),
        (whole * (me + 1), Partial(), Shard(0), (whole * 3).chunk(2)[me]),
        (whole * (me + 1), Partial(), Replicate(), whole * 3)]
    general, issued = C._issue, []  # dist's functions are called from here

    def issue(*args, **kwargs):
        issued.append(args[0])
        return general(*args, **kwargs)
    C._issue = issue
    try:
        with process_group_calls("allreduce", "all_gather_single") as called:
            for local, src, dst, want in cases:
                dt = DTensor.from_local(local, mesh, [src])
                dt.redistribute(mesh, [dst])  # the plan and its runner cached
                called.clear()
                issued.clear()
                got = dt.redistribute(mesh, [dst]).to_local()
                assert torch.equal(got, want) and len(called) == 1 and not issued, (
                    src, dst, called, issued)
                with FunctionNames() as mode:
                    got = dt.redistribute(mesh, [dst]).to_local()
                assert torch.equal(got, want) and issued
                assert any(n in ("all_reduce", "all_gather_single", "all_gather_into_tensor")
                           for n in mode.names), mode.names
    finally:
        C._issue = general


@distributed(world_size=2)
def test_the_joint_max_of_two_jobs_hands_the_backend_a_private_alias():
    """``all_reduce_max_over`` (the all-reduce of a link between two jobs, jobs.py; a job's last
    collective before it exits) gives the backend an alias ``_inflight`` keeps until gloo's
    thread lets go, never its own tensor: that thread freed it during the interpreter's
    finalization (an abort at exit, tests/test_jobs.py)."""
    rank = dist.get_rank()
    with _handed_to_backend() as seen, process_group_calls("allreduce") as calls:
        got = C.all_reduce_max_over(dist.group.WORLD, [rank, -rank])
    assert got == [1, 0]
    (_, (tensors, _opts)), = calls
    assert len(seen) == 1 and tensors[0] is seen[0]
    assert _inflight.drain(timeout=10) == (0, 0)  # released once the backend let go
