"""Nothing hangs: a failure on one rank stops every rank within the process group's timeout, and
every rank's error names the rank that failed first and its exception.

Each body runs on a fresh default process group with a short timeout (``_fresh_group``) and
restores the pool's usual group at the end, since a failed rank leaves the group's collective
sequences out of step. Times are wall-clock stamps taken on each rank (one machine, one clock):
the test asserts how long the other ranks waited after the failure, not just that they stopped.
"""
from __future__ import annotations

import contextlib
import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtensor_lite import Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.debug import propagate_failures
from tests.harness import TEST_DEVICE, launch_processes, reinit_process_group, run_distributed

R = Replicate()
GROUP_TIMEOUT = 3.0  # seconds: the default group's timeout in these tests
MARGIN = 2.0  # seconds on top of it that a loaded 2-core machine may need to notice
POSTED_TIMEOUT = 30.0  # seconds: a group timeout no posted failure should come near


@contextlib.contextmanager
def _fresh_group(timeout: float = GROUP_TIMEOUT):
    """A new default group with ``timeout`` for the body, the pool's usual one afterwards (the
    old group is abandoned with whatever collective the failure left pending). The short timeout
    is set after the rendezvous, which on a loaded machine can take longer than it."""
    reinit_process_group()
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout))
    try:
        yield
    finally:
        reinit_process_group()


def _outcome(fn):
    """(exception type name or "ok", message, wall-clock time it ended) of ``fn()``."""
    try:
        fn()
        return "ok", "", time.time()
    except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
        return type(e).__name__, str(e), time.time()


def _assert_stopped_naming(outcomes, failed_rank, failed_type, within=GROUP_TIMEOUT + MARGIN):
    """``failed_rank`` raised ``failed_type``; every other rank raised RankFailedError naming it,
    no later than ``within`` seconds after it."""
    kind, message, t_fail = outcomes[failed_rank]
    assert kind == failed_type, outcomes[failed_rank]
    for rank, (kind, message, t) in enumerate(outcomes):
        if rank == failed_rank:
            continue
        assert kind == "RankFailedError", (rank, kind, message)
        assert f"rank {failed_rank}: {failed_type}" in message, (rank, message)
        assert t - t_fail < within, f"rank {rank} stopped {t - t_fail:.1f}s after the failure"


# ------------------------------------------------------------------ data-dependent index errors
def _out_of_range_ids_on_one_rank(op: str):
    with _fresh_group():
        mesh = init_device_mesh("cpu", (2,))
        ids = distribute_tensor(torch.tensor([[1, 2], [3, 6]]), mesh, [Shard(0)])  # rank 1: id 6
        table = distribute_tensor(torch.randn(6, 4), mesh, [R])
        if op == "embedding":
            outcome = _outcome(lambda: F.embedding(ids, table).full_tensor())
        else:
            outcome = _outcome(lambda: table.index_select(0, ids.flatten()).full_tensor())
        return outcome


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="on a GPU an out-of-range id is a device-side "
                    "assert, as in torch's own kernel: it ends the process's CUDA context")
def test_out_of_range_id_on_one_rank_stops_every_rank():
    """Ids sharded with the batch: only rank 1 holds the out-of-range one. It raises an
    IndexError that says the error is data-dependent; rank 0, waiting in the all-gather of
    full_tensor, stops within a poll interval naming rank 1's IndexError."""
    for op in ("embedding", "index_select"):
        outcomes = run_distributed(2, _out_of_range_ids_on_one_rank, op, timeout=60)
        _assert_stopped_naming(outcomes, 1, "IndexError", within=MARGIN)
        assert "depends on the data this rank holds" in outcomes[1][1], outcomes[1]
        assert "index out of range" in outcomes[0][1], outcomes[0]


# ------------------------------------------------------------------ a fault anywhere in a step
PHASES = ("forward", "backward", "optimizer", "state_dict")


class InjectedFault(Exception):
    """Raised on purpose at one point of one rank's training step."""


def _fsdp_mlp(tp: bool):
    """A small MLP under fully_shard (each linear, then the root); with ``tp``, over a 2x2
    (dp, tp) mesh with column- then row-wise linears. Returns (model, input wrapper)."""
    from fsdp import fully_shard
    from tests.test_fsdp_tp import _meshes, _mlp, _tp_by_hand

    model = _mlp((6, 8, 6))
    if tp:
        _mesh, dp, tp_mesh = _meshes((2, 2), ("dp", "tp"))
        _tp_by_hand(model, tp_mesh)
        fully_shard(model, mesh=dp)
        from dtensor_lite import DTensor
        return model, lambda x: DTensor.from_local(x, tp_mesh, [R])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    return model, lambda x: x


def _train_with_fault(fail_rank: int, phase: str, fail_step: int, tp: bool = False):
    """Two FSDP training steps, each followed by a full state dict (collective), under
    propagate_failures(); rank ``fail_rank`` raises InjectedFault in ``phase`` of ``fail_step``."""
    from dtensor_lite import get_model_state_dict

    with _fresh_group():
        model, wrap = _fsdp_mlp(tp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        me, now = dist.get_rank(), {"step": 0}

        def fault(where):
            if me == fail_rank and where == phase and now["step"] == fail_step:
                raise InjectedFault(f"injected into the {where} of step {fail_step}")

        def grad_fault_after(module, args, out):
            out.register_hook(lambda grad: fault("backward"))

        model[2].register_forward_pre_hook(lambda module, args: fault("forward"))
        model[0].register_forward_hook(grad_fault_after)
        opt.register_step_pre_hook(lambda optimizer, args, kwargs: fault("optimizer"))
        g = torch.Generator().manual_seed(me)

        def steps():
            with propagate_failures():
                for step in range(2):
                    now["step"] = step
                    out = model(wrap(torch.randn(3, 6, generator=g)))
                    out = out.full_tensor() if hasattr(out, "full_tensor") else out
                    out.pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
                    fault("state_dict")
                    get_model_state_dict(model, full_state_dict=True)
        return _outcome(steps)


def _check_fault(world: int, fail_rank: int, phase: str, fail_step: int, tp: bool = False):
    outcomes = run_distributed(world, _train_with_fault, fail_rank, phase, fail_step, tp,
                               timeout=60)
    _assert_stopped_naming(outcomes, fail_rank, "InjectedFault")
    assert f"injected into the {phase} of step {fail_step}" in outcomes[1 - fail_rank][1]


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(fail_rank=st.integers(0, 1), phase=st.sampled_from(PHASES), fail_step=st.integers(0, 1))
def test_no_hang_fault_anywhere_in_an_fsdp_step(fail_rank, phase, fail_step):
    """Whatever rank fails wherever in the step (forward, backward, optimizer step, state
    dict), the other rank stops within the group timeout, naming the rank and the fault."""
    _check_fault(2, fail_rank, phase, fail_step)


def test_no_hang_fault_in_an_fsdp_tp_step():
    """FSDP over TP on a 2x2 mesh: a fault in one rank's forward (rank 3) and backward (rank 0)
    stops all four ranks, each naming the failed rank."""
    for fail_rank, phase in ((3, "forward"), (0, "backward")):
        outcomes = run_distributed(4, _train_with_fault, fail_rank, phase, 0, True, timeout=60)
        _assert_stopped_naming(outcomes, fail_rank, "InjectedFault")


# ------------------------------------------------------------------ a step not every rank runs
def _forward_on_one_rank_only():
    """Rank 0 runs a forward and backward; rank 1 skips them and stays away from collectives
    until rank 0 has given up (a rank that went on to *different* collectives instead would make
    gloo abort both processes on the size mismatch: see docs/troubleshooting.md)."""
    with _fresh_group():
        model, _ = _fsdp_mlp(False)
        started = time.time()
        if dist.get_rank() == 0:
            return _outcome(lambda: model(torch.randn(3, 6)).sum().backward()), started  # alone
        time.sleep(GROUP_TIMEOUT + 1)
        return ("skipped", "", time.time()), started


def test_no_hang_forward_on_one_rank_only():
    """No rank raised, yet rank 0 waits in an all-gather rank 1 never joins: gloo's timeout (the
    group's) ends it, and the error says that some rank of the group did not join."""
    (kind, message, t), t0 = run_distributed(2, _forward_on_one_rank_only, timeout=60)[0]
    assert kind == "CollectiveFailedError", (kind, message)
    assert "over ranks [0, 1]" in message and "did not join this collective" in message, message
    # who is where: rank 0 at the line of the forward it ran alone, rank 1 in no collective
    alone = next(k + 1 for k, line in enumerate(open(__file__).read().splitlines())
                 if line.endswith("# alone"))
    assert f"rank 0: in all_gather #" in message, message
    assert f"test_no_hang.py:{alone}" in message, message
    assert "rank 1: not responding" in message, message
    assert GROUP_TIMEOUT - 0.5 < t - t0 < GROUP_TIMEOUT + MARGIN + 2, f"{t - t0:.1f}s"


# ------------------------------------------------------------------ the default: excepthook
def _uncaught_exception_on_rank_1():
    """Rank 1 ends as an uncaught exception would (Python calls sys.excepthook, which the first
    DeviceMesh chained); rank 0 is in a collective."""
    import sys

    from dtensor_lite import DTensor

    with _fresh_group():
        mesh = init_device_mesh("cpu", (2,))
        if dist.get_rank() == 1:
            try:
                raise InjectedFault("uncaught in main()")
            except InjectedFault as e:
                sys.excepthook(type(e), e, e.__traceback__)
                return "InjectedFault", str(e), time.time()
        piece = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
        return _outcome(lambda: piece.full_tensor())


def test_uncaught_exception_is_posted_by_default():
    outcomes = run_distributed(2, _uncaught_exception_on_rank_1, timeout=60)
    _assert_stopped_naming(outcomes, 1, "InjectedFault", within=MARGIN)


# ------------------------------------------------------------------ errors every rank raises
def _consistent_errors_leave_the_group_usable():
    """An op without a rule runs on the gathered whole tensor on every rank, so a data error in
    it (bincount of a negative id, where rank 1's piece is empty) is raised by every rank alike;
    so is an out-of-range id that every rank holds. Nothing is posted: the group goes on."""
    from dtensor_lite._failures import posted_failure

    with _fresh_group():
        mesh = init_device_mesh("cpu", (2,))
        errors = []
        for bad in (lambda: torch.bincount(distribute_tensor(torch.tensor([-1]), mesh,
                                                             [Shard(0)])),
                    lambda: F.embedding(distribute_tensor(torch.tensor([6]), mesh, [R]),
                                        distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]))):
            kind, message, _ = _outcome(bad)
            errors.append((kind, message.splitlines()[0]))
        total = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]).sum().full_tensor()
        return errors, posted_failure(), float(total)


def test_errors_every_rank_raises_are_not_posted():
    outcomes = run_distributed(2, _consistent_errors_leave_the_group_usable, timeout=60)
    assert outcomes[0] == outcomes[1], outcomes
    errors, posted, total = outcomes[0]
    assert [kind for kind, _ in errors] == ["RuntimeError", "IndexError"], errors
    assert "non-negative" in errors[0][1] and "out of range" in errors[1][1], errors
    assert posted is None and total == 6.0


# ------------------------------------------------------------------ a kernel failing on an empty piece
_EMPTY_PIECE_OP = []  # the user op below, defined once per process (on first use)


def _fails_on_an_empty_piece_op():
    """A user-registered op whose kernel refuses an empty input -- as some kernels do, and which
    ones is up to each torch release (2.15's CPU FFT began to accept what 2.13's refused), so
    the test owns the kernel that fails."""
    if not _EMPTY_PIECE_OP:
        @torch.library.custom_op("dtl_no_hang::scaled_rows", mutates_args=())
        def scaled_rows(x: torch.Tensor) -> torch.Tensor:
            if x.numel() == 0:
                raise RuntimeError("scaled_rows: expected a non-empty input")
            return x * 2

        @scaled_rows.register_fake
        def _(x):
            return torch.empty_like(x)
        _EMPTY_PIECE_OP.append(torch.ops.dtl_no_hang.scaled_rows.default)
    return _EMPTY_PIECE_OP[0]


def _kernel_fails_on_an_empty_piece():
    """A user op with a user rule (the public strategy API) that runs it row-sharded; with one
    row on two ranks, rank 1's piece is empty and the op's kernel refuses it (only there).
    Rank 1's error says it is this rank's data; rank 0 stops at the all-gather of full_tensor,
    naming it."""
    from dtensor_lite import _caches, register_sharding

    op = _fails_on_an_empty_piece_op()
    # A long group timeout: rank 0 must stop because rank 1 posted its failure, which the
    # assertion tells apart from the timeout by an order of magnitude, load or not.
    with _fresh_group(timeout=POSTED_TIMEOUT):
        @register_sharding(op)
        def row_sharded(x):
            return [([Shard(0)], [Shard(0)])]
        try:
            mesh = init_device_mesh("cpu", (2,))
            x = distribute_tensor(torch.randn(1, 8), mesh, [Shard(0)])
            return _outcome(lambda: op(x).full_tensor())
        finally:
            _caches.clear_decisions()


def test_kernel_failing_on_one_ranks_empty_piece_stops_every_rank():
    outcomes = run_distributed(2, _kernel_fails_on_an_empty_piece, timeout=60)
    _assert_stopped_naming(outcomes, 1, "RuntimeError", within=POSTED_TIMEOUT / 3)
    assert "depends on the data this rank holds" in outcomes[1][1], outcomes[1]


# ------------------------------------------------------------------ a launched job, end to end
_LAUNCHED_MAIN = '''
import datetime, time
import torch
import torch.distributed as dist
from dtensor_lite import DTensor, Shard, init_device_mesh

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
mesh = init_device_mesh("cpu", (2,))
piece = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
piece.full_tensor()  # both ranks are up
if dist.get_rank() == 1:
    print(f"FAILED_AT {time.time()}", flush=True)
    raise ValueError("bad batch on rank 1")  # uncaught: ends the process
try:
    piece.full_tensor()
except Exception:
    print(f"STOPPED_AT {time.time()}", flush=True)
    raise
'''


def test_uncaught_exception_in_a_launched_job_stops_the_other_rank(tmp_path):
    """Two processes launched as torchrun would (env rendezvous, group timeout 60 s, no launcher
    to kill the survivor): rank 1's uncaught exception reaches the excepthook the mesh chained;
    rank 0 stops within a poll interval naming it, and its process exits non-zero long before
    the group timeout."""
    script = tmp_path / "main.py"
    script.write_text(_LAUNCHED_MAIN)
    codes, outs = launch_processes(script, 2)
    ended = time.time()
    stamps = {}
    for out in outs:
        for line in out.splitlines():
            if line.startswith(("FAILED_AT", "STOPPED_AT")):
                key, value = line.split()
                stamps[key] = float(value)
    assert codes[1] != 0 and "ValueError: bad batch on rank 1" in outs[1], outs[1]
    assert codes[0] != 0, outs[0]
    assert "RankFailedError" in outs[0] and "rank 1: ValueError: bad batch on rank 1" in outs[0]
    assert stamps["STOPPED_AT"] - stamps["FAILED_AT"] < MARGIN, stamps
    assert ended - stamps["FAILED_AT"] < 30, "the processes outlived half the group timeout"


# ------------------------------------------------------------------ slow is not failed (issue 30)
class _SlowWork:
    """A stand-in for a healthy collective on a loaded machine: still running for ``slices``
    timed waits, each of which runs out at once (the backend's clock and ours need not agree),
    then completed. ``error``: it completes failed instead."""

    def __init__(self, slices: int, error: str | None = None):
        self.slices, self.error, self.timed_waits = slices, error, 0

    def is_completed(self) -> bool:
        return self.timed_waits >= self.slices

    def wait(self, timeout=None):
        if timeout is not None and not self.is_completed():
            self.timed_waits += 1
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True


def _wait_stand_ins():
    from concurrent.futures import ThreadPoolExecutor

    from torch._C._distributed_c10d import _create_work_from_future
    from torch.futures import Future

    from dtensor_lite._failures import wait_work

    group = dist.group.WORLD  # gloo: waits are sliced
    slow = _SlowWork(slices=3)
    wait_work(slow, "all_reduce", group)  # ran out three times, then done: no failure
    outcomes = [("ok", slow.timed_waits)]
    outcomes.append(_outcome(lambda: wait_work(_SlowWork(2, "Connection closed by peer"),
                                               "all_reduce", group))[:2])
    # a work that cannot wait with a timeout (PyTorch's threaded group, some third-party backends)
    # is waited for unsliced
    fut = Future()
    work = _create_work_from_future(fut)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: (time.sleep(0.2), fut.set_result([])))
        outcomes.append(_outcome(lambda: wait_work(work, "all_reduce", group))[:2])
    return outcomes


def test_a_slice_running_out_is_never_a_failure():
    """Only the work's own state says it failed: a collective whose timed waits run out (even
    "early" by our clock) is waited for again; one that completed with an error raises it, named;
    a work whose wait(timeout) is not implemented is waited for without slices."""
    from dtensor_lite._failures import forget_posted_failure

    (ok, slices), failed, unsliced = run_distributed(1, _wait_stand_ins)[0]
    run_distributed(1, forget_posted_failure)  # the failed stand-ins posted for nobody
    assert (ok, slices) == ("ok", 3)
    assert failed[0] == "CollectiveFailedError" and "Connection closed by peer" in failed[1]
    assert unsliced == ("ok", ""), unsliced


class _StreamRecordingWork:
    """A completed work that records which CUDA stream is current on the thread that waits for
    it: a work over device tensors orders *that* stream after its copies (gloo copies them
    through the host on streams of its own)."""

    def __init__(self):
        self.streams = []

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None):
        self.streams.append(torch.cuda.current_stream() if torch.cuda.is_initialized() else None)
        return True


def _thread_waits_order_the_callers_stream():
    from dtensor_lite._failures import wait_work

    # gloo (a 2-rank world is gloo under DTL_TEST_DEVICE=cuda too; a 1-rank one is NCCL, whose
    # works are waited for on the calling thread): a reduce-scatter's work is waited for on a
    # waiter thread
    group = dist.group.WORLD
    assert dist.get_backend(group) == "gloo"
    work = _StreamRecordingWork()
    if not torch.cuda.is_available():
        wait_work(work, "reduce_scatter", group)
        return work.streams == [None]
    side = torch.cuda.Stream()  # as FSDP finishes its reduce-scatters on a side stream
    with torch.cuda.stream(side):
        wait_work(work, "reduce_scatter", group)
    return work.streams == [side]


def test_a_work_waited_on_a_thread_orders_the_callers_stream():
    """On CUDA (DTL_TEST_DEVICE=cuda), the waiter thread waits on the caller's current stream:
    waiting on its own default stream left FSDP's side stream reading reduce-scatter outputs
    before gloo had copied them back (wrong gradients in every FSDP test on an H200)."""
    assert run_distributed(2, _thread_waits_order_the_callers_stream) == [True, True]


def _fsdp_steps_under_load(steps: int, tp: bool):
    """FSDP (or FSDP over TP) steps whose collectives are slow enough to span several wait
    slices on a loaded machine: every rank must finish them (no rank fails)."""
    from fsdp import fully_shard
    from tests.test_fsdp_tp import _meshes, _tp_by_hand

    torch.manual_seed(0)
    dims = (64, 1024, 64)
    model = torch.nn.Sequential(torch.nn.Linear(dims[0], dims[1]), torch.nn.ReLU(),
                                torch.nn.Linear(dims[1], dims[2]))
    wrap = lambda x: x  # noqa: E731
    if tp:
        from dtensor_lite import DTensor

        _mesh, dp, tp_mesh = _meshes((2, 2), ("dp", "tp"))
        _tp_by_hand(model, tp_mesh)
        fully_shard(model, mesh=dp)
        wrap = lambda x: DTensor.from_local(x, tp_mesh, [R])  # noqa: E731
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        out = model(wrap(torch.randn(8, dims[0])))
        (out.full_tensor() if hasattr(out, "full_tensor") else out).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return "ok"


def test_fsdp_steps_beside_busy_processes_never_fail_falsely():
    """Issue 30: FSDP steps (and FSDP over TP) on 4 ranks while CPU-busy processes compete for
    the cores; every collective is slow, none may be reported failed."""
    from tests.harness import busy_cpus

    with busy_cpus(2):
        assert run_distributed(4, _fsdp_steps_under_load, 3, False, timeout=240) == ["ok"] * 4
        assert run_distributed(4, _fsdp_steps_under_load, 1, True, timeout=240) == ["ok"] * 4
