"""Multi-process test harness: run a test body on every rank of a real gloo process group.

Spawning and initialising N processes costs seconds (each imports torch), far too slow to do per
test on a 2-core machine. So we keep one persistent *pool* of worker processes per world size for
the whole pytest session and ship test bodies to it.

Two spellings::

    @distributed(world_size=4)                  # the body runs on ranks 0..3; passes iff all pass
    @pytest.mark.parametrize("n", [1, 3])
    def test_allreduce(n):
        t = torch.full((n,), float(dist.get_rank()))
        dist.all_reduce(t)
        assert t.tolist() == [6.0] * n

    def _body(x):                               # module level, so workers can import it
        return dist.get_rank() * x

    assert run_distributed(2, _body, 10) == [0, 10]   # e.g. inside a hypothesis test

``DTL_TEST_DEVICE=cuda`` runs the same bodies with their tensors on ``cuda:0`` (every rank shares
that one GPU): factory functions default to CUDA, meshes asked for as ``"cpu"`` become ``"cuda"``
meshes, and the default group is gloo (which moves CUDA tensors through the host; NCCL refuses
two ranks on one GPU) except in a 1-rank world, which uses NCCL itself. Tests that assert a CPU
device on purpose (offload, ``device_type == "cpu"``) are expected to differ there.

Functions travel as (module name, file, qualname) and are imported in the workers, never pickled
as code; arguments and return values must be picklable. Each body starts with seeds set to 0 and a
working default process group (``reinit_process_group`` builds a new one after a test destroys
it). A failing rank, a dead worker or a hang fails the test with every rank's traceback, and the
pool is killed and lazily restarted so later tests get a healthy one.
"""

from __future__ import annotations

import ast
import atexit
import datetime
import functools
import importlib.util
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import multiprocessing.resource_tracker as mp_resource_tracker
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback

import numpy
import torch
import torch.distributed as dist

__all__ = ["DistributedTestFailure", "DistributedTestTimeout", "busy_cpus", "distributed",
           "launch_processes", "launch_torchrun", "reinit_process_group", "run_distributed",
           "shutdown_pools"]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_DEVICE = os.environ.get("DTL_TEST_DEVICE", "cpu")  # "cuda": see the module docstring
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)  # gloo gives up on a stuck collective after this
STARTUP_TIMEOUT = 300.0  # 8 workers importing torch on 2 cores takes a while
FAILURE_GRACE = 5.0  # after one rank fails, how long the others get to report before we kill them
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # silence c10d's informational chatter
    "GLOO_SOCKET_IFNAME": "lo",  # the hostname may not resolve to loopback in sandboxes
}


class DistributedTestFailure(AssertionError):
    """A rank raised, died, or did not finish. AssertionError so pytest reports a plain failure."""


class DistributedTestTimeout(DistributedTestFailure):
    """No result from every rank within the timeout."""


# --------------------------------------------------------------------------- worker side

_SHUTDOWN = pickle.dumps(None)
_worker_state: dict = {}  # set only inside worker processes: rank, world_size, store, generation


def reinit_process_group(timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> None:
    """Create a fresh default process group on this rank (call it on every rank).

    For tests of destroy + init in one process: ``dist.destroy_process_group()`` then
    ``reinit_process_group()``. Destroys the current default group first if there still is one.
    Each call uses a new key prefix on the pool's store, so no state leaks from the old group.
    Fault tests pass a short ``timeout`` (a rank left alone in a collective raises after it) and
    call ``reinit_process_group()`` again at the end to restore the pool's usual group.
    """
    if not _worker_state:
        raise RuntimeError("reinit_process_group() only works inside a tests.harness worker")
    if dist.is_initialized():
        dist.destroy_process_group()
    _worker_state["generation"] += 1
    dist.init_process_group(
        backend=_backend(_worker_state["world_size"]),
        store=dist.PrefixStore(f"pg{_worker_state['generation']}/", _worker_state["store"]),
        rank=_worker_state["rank"],
        world_size=_worker_state["world_size"],
        timeout=timeout,
    )


def _backend(world_size: int) -> str:
    return "nccl" if TEST_DEVICE == "cuda" and world_size == 1 else "gloo"


def _use_test_device() -> None:
    """Put this worker's tensors and meshes on ``TEST_DEVICE`` (no-op for the CPU default)."""
    if TEST_DEVICE == "cpu":
        return
    torch.cuda.set_device(0)
    torch.set_default_device(TEST_DEVICE)
    # fp32 tests compare fp32 numerics: TF32 matmuls/convs (on by default for cuDNN) would round
    # the DTensor path and the oracle differently for their different shapes
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import dtensor_lite.device_mesh as device_mesh

    validate = device_mesh._validate_device_type

    def cpu_means_test_device(device_type):
        checked = validate(device_type)
        return TEST_DEVICE if checked == "cpu" else checked

    device_mesh._validate_device_type = cpu_means_test_device

    # A generator made without a device must match the default device, or every factory call
    # that passes one (torch.randint(..., generator=g)) refuses it.
    cpu_generator = torch.Generator

    class TestDeviceGenerator(cpu_generator):
        def __new__(cls, device=None):
            return cpu_generator.__new__(cls, TEST_DEVICE if device is None else device)

        def __init__(self, device=None):
            pass

    torch.Generator = TestDeviceGenerator


def _to_driver(value):
    """Results travel to the driver as CPU tensors: it compares them with tensors of its own and
    never touches a GPU."""
    if TEST_DEVICE == "cpu":
        return value
    from torch.utils._pytree import tree_map
    return tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, value)


def _exit_when_orphaned(parent_pid: int) -> None:
    # If the driver is SIGKILLed no atexit runs; don't linger as an orphan stuck in a collective.
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def _load_module(name: str, path: str):
    """Import the driver's module ``name`` from ``path``, once per worker.

    Using the driver's module name keeps pickled references (e.g. a class defined in a test file)
    pointing at the very same module object the function comes from. Asserts are rewritten the
    way pytest does it, so a failing ``assert a == b`` on a rank shows both values.
    """
    module = sys.modules.get(name)
    if module is not None and os.path.abspath(getattr(module, "__file__", "") or "") == path:
        return module
    with open(path, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=path)
    try:
        from _pytest.assertion.rewrite import rewrite_asserts  # private, but stable for years
    except ImportError:
        pass
    else:
        rewrite_asserts(tree, source, path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(compile(tree, path, "exec", dont_inherit=True), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _format_error(exc: BaseException) -> str:
    # Skip the harness's own frames: the reader wants the test body's traceback.
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _run_task(module_name: str, path: str, qualname: str, args: tuple, kwargs: dict):
    obj = _load_module(module_name, path)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    fn = getattr(obj, "__harness_body__", obj)  # a @distributed wrapper: call the raw body
    # a failure some rank of an earlier test posted (an error it raised and the test caught)
    # would stop this test's first slow collective: every rank finished that test, forget it
    failures = sys.modules.get("dtensor_lite._failures")
    if failures is not None:
        failures.forget_posted_failure()
    torch.manual_seed(0)
    random.seed(0)
    numpy.random.seed(0)
    return fn(*args, **kwargs)


def _worker_main(rank: int, world_size: int, port: int, conn, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's business; it kills us
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    torch.set_num_threads(1)
    _use_test_device()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    _worker_state.update(rank=rank, world_size=world_size, store=store, generation=0)
    reinit_process_group()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:  # driver went away
            break
        if data == _SHUTDOWN:
            break
        try:
            reply = pickle.dumps(("ok", _to_driver(_run_task(*pickle.loads(data)))))
        except BaseException as exc:
            reply = pickle.dumps(("error", _format_error(exc)))
        try:
            # A test that destroyed the default group without re-creating it must not break the
            # next test. All ranks normally do the same, so they re-initialise together.
            if not dist.is_initialized():
                reinit_process_group()
        except BaseException as exc:
            reply = pickle.dumps(("error", "re-initialising the default process group after the "
                                  "test failed:\n" + _format_error(exc)))
        sys.stdout.flush()  # output lands in the capture of the test that produced it
        sys.stderr.flush()
        conn.send_bytes(reply)
    os._exit(0)  # skip interpreter teardown: gloo's threads can make it slow


# --------------------------------------------------------------------------- driver side


class _Pool:
    """``world_size`` worker processes sharing one default gloo process group."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        # The driver hosts the rendezvous store: port 0 lets the OS pick a free port with no race,
        # and the store outlives any worker that crashes.
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=COLLECTIVE_TIMEOUT)
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        saved_env = {k: os.environ.get(k) for k in WORKER_ENV}
        os.environ.update(WORKER_ENV)  # spawn copies os.environ at start(); restore right after
        try:
            for rank in range(world_size):
                parent_conn, child_conn = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, name=f"harness-w{world_size}-r{rank}",
                                   args=(rank, world_size, self.store.port, child_conn,
                                         os.getpid()), daemon=True)
                proc.start()
                child_conn.close()
                self.procs.append(proc)
                self.conns.append(parent_conn)
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._collect(f"starting the world_size={world_size} pool", STARTUP_TIMEOUT)

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []

    def shutdown(self) -> None:
        for c in self.conns:
            try:
                c.send_bytes(_SHUTDOWN)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def run(self, payload: bytes, what: str, timeout: float) -> list:
        __tracebackhide__ = True  # pytest: show the ranks' tracebacks, not the harness's frames
        for c in self.conns:
            c.send_bytes(payload)
        return self._collect(what, timeout)

    def _collect(self, what: str, timeout: float) -> list:
        """Wait for one reply per rank and return the values; raise if any rank failed.

        Kills the pool when a rank is stuck or dead (``self.procs`` is then empty); a pool whose
        ranks all answered stays up.
        """
        __tracebackhide__ = True
        replies: list = [None] * self.world_size
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        grace_deadline = None
        while pending:
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            # Wait on pipes *and* process sentinels so a crashed worker can't block us forever.
            waitables = {self.conns[r]: r for r in pending}
            waitables.update({self.procs[r].sentinel: r for r in pending})
            ready = mp_connection.wait(list(waitables), timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for rank in sorted({waitables[obj] for obj in ready}):
                try:
                    kind, value = pickle.loads(self.conns[rank].recv_bytes())
                except (EOFError, OSError):  # the pipe closed: the worker is gone
                    self.procs[rank].join(timeout=1)
                    kind, value = "error", (f"worker process died (exit code "
                                            f"{self.procs[rank].exitcode})")
                pending.discard(rank)
                replies[rank] = value
                if kind == "error":
                    errors[rank] = value
                    if grace_deadline is None:
                        grace_deadline = time.monotonic() + FAILURE_GRACE
        if pending or not self.alive():
            self.kill()
        if pending or errors:
            raise _failure(what, self.world_size, errors, pending, timeout,
                           timed_out=bool(pending) and not errors)
        return replies


def _failure(what, world_size, errors, pending, timeout, timed_out) -> DistributedTestFailure:
    if timed_out:
        head = (f"{what} (world_size={world_size}) timed out after {timeout:g}s: ranks "
                f"{sorted(pending)} never returned; the pool was killed and will be restarted")
        return DistributedTestTimeout(head)
    lines = [f"{what} (world_size={world_size}) failed on rank(s) {sorted(errors)}"]
    if pending:
        lines.append(f"ranks {sorted(pending)} had not returned {FAILURE_GRACE:g}s after the first "
                     "failure (probably stuck in a collective); the pool was killed")
    for rank, text in sorted(errors.items()):
        lines.append(f"\n----- rank {rank} -----\n{text.rstrip()}")
    return DistributedTestFailure("\n".join(lines))


_pools: dict[int, _Pool] = {}


def _get_pool(world_size: int) -> _Pool:
    pool = _pools.get(world_size)
    if pool is None or not pool.alive():  # never started, or a worker died while idle
        if pool is not None:
            pool.kill()
        pool = _pools[world_size] = _Pool(world_size)
    return pool


def shutdown_pools() -> None:
    """Stop every worker pool (called at the end of the pytest session and at exit)."""
    while _pools:
        _, pool = _pools.popitem()
        pool.shutdown()


def _at_exit() -> None:
    shutdown_pools()
    # spawn started multiprocessing's resource tracker; stop it while we can still reap it, or it
    # lingers as a zombie under an init that does not reap (containers). Private API, so guarded.
    stop = getattr(getattr(mp_resource_tracker, "_resource_tracker", None), "_stop", None)
    if stop is not None:
        stop()


atexit.register(_at_exit)


def _check_health(world_size: int) -> None:
    """After a failure in which every rank returned, make sure the group still works."""
    pool = _pools.get(world_size)
    if pool is None:
        return
    try:
        pool.run(pickle.dumps((__name__, os.path.abspath(__file__), "_probe", (), {})),
                 "health check", timeout=10)
    except DistributedTestFailure:
        _pools.pop(world_size, None)
        pool.kill()


def _probe() -> None:
    t = torch.ones(1, device=TEST_DEVICE)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()


def run_distributed(world_size: int, fn, *args, timeout: float = 120, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size`` pool; return per-rank results.

    ``fn`` must be a module-level function (it is imported by name in the workers). Raises
    ``DistributedTestFailure`` (an AssertionError) naming the failing ranks with their tracebacks,
    or ``DistributedTestTimeout`` if some rank has not returned after ``timeout`` seconds.
    """
    __tracebackhide__ = True
    if not 1 <= world_size <= 8:  # every distinct size keeps its own pool alive: prefer 1, 2, 4, 8
        raise ValueError(f"world_size must be between 1 and 8, got {world_size}")
    fn = getattr(fn, "__harness_body__", fn)
    qualname = getattr(fn, "__qualname__", "")
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = getattr(module, "__file__", None)
    if not qualname or "<" in qualname or path is None:
        raise ValueError(f"run_distributed needs a module-level function defined in a file, got "
                         f"{fn!r}; lambdas, closures and nested functions cannot reach the workers")
    try:
        payload = pickle.dumps((fn.__module__, os.path.abspath(path), qualname, args, kwargs))
    except Exception as exc:
        raise TypeError(f"arguments for {qualname} must be picklable to reach the workers: "
                        f"{exc}") from exc
    what = os.environ.get("PYTEST_CURRENT_TEST", f"{fn.__module__}.{qualname}").split(" (")[0]
    pool = _get_pool(world_size)
    try:
        return pool.run(payload, what, timeout)
    except DistributedTestFailure:
        if pool.procs:  # every rank answered: the pool may still be fine; check before reuse
            _check_health(world_size)
        else:  # killed; the next call starts a fresh one
            _pools.pop(world_size, None)
        raise
    except BaseException:  # e.g. KeyboardInterrupt mid-test: the pool's state is unknown
        _pools.pop(world_size, None)
        pool.kill()
        raise


def distributed(world_size: int, timeout: float = 120):
    """Decorator: the test body runs on every rank of a ``world_size`` pool.

    Works with ``@pytest.mark.parametrize`` (parameters reach the body as keyword arguments, so
    they must be picklable). The wrapper keeps the body's signature for pytest and exposes the raw
    body as ``__harness_body__``, which the workers call.
    """

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            __tracebackhide__ = True
            run_distributed(world_size, fn, *args, timeout=timeout, **kwargs)

        wrapper.__harness_body__ = fn
        return wrapper

    return decorate


def launch_processes(script: str, world_size: int, *args: str, timeout: float = 120):
    """Run the Python file ``script`` as ``world_size`` processes, as torchrun would start them
    (env rendezvous: RANK, WORLD_SIZE, MASTER_ADDR/PORT; no launcher that stops the survivors),
    with ``args`` on their command lines. Returns ``(returncodes, outputs)`` (stdout and stderr
    together) once all exited; any still running after ``timeout`` seconds is killed. For tests
    of what a pool worker cannot survive: a process that dies, an uncaught exception."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=REPO_ROOT,
                   CUDA_VISIBLE_DEVICES="", **WORKER_ENV)
        procs.append(subprocess.Popen([sys.executable, str(script), *map(str, args)], env=env,
                                      text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [p.returncode for p in procs], outputs


def launch_torchrun(script: str, *args: str, nproc: int = 4, timeout: float = 240):
    """``python -m torch.distributed.run --standalone --nproc-per-node nproc script args`` -- a real
    torchrun job of this checkout (PYTHONPATH set to it). Returns ``(returncode, output)``."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=REPO_ROOT, CUDA_VISIBLE_DEVICES="", **WORKER_ENV)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(script), *map(str, args)]
    proc = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output = proc.communicate(timeout=timeout)[0]
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers: a session of their own
        return None, proc.communicate()[0]


class busy_cpus:
    """Context manager: ``n`` processes spinning on the CPU while the body runs (a loaded
    machine), stopped by their own ids afterwards."""

    def __init__(self, n: int = 1):
        self.n, self.procs = n, []

    def __enter__(self):
        import subprocess

        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(self.n)]
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []
