"""Rank failures: one rank's exception stops every rank, naming it, within the group timeout.

A rank that raises while the others go on to their next collective leaves them waiting for a
partner that never comes; gloo would end that wait only after the process group's timeout (30
minutes unless ``init_process_group(timeout=...)`` says otherwise) with a bare "Timed out waiting
for recv" that names neither the rank nor its error. So:

* **posting**: a rank whose failure may be its own posts ``"rank r: <type>: <message>"`` to the
  c10d store the default process group already has (one key; the first post wins, so the root
  cause is named, not the ranks that stopped because of it). Who posts: the dispatcher, for a
  local kernel that failed on data only this rank holds (ids out of range in a sharded index
  tensor, an empty piece; :func:`on_kernel_error`); :func:`propagate_failures` for any exception
  escaping a block (a training step); the ``sys.excepthook`` installed when the first DeviceMesh
  is built, for any exception that ends the process (the torchrun / torchtitan default: an
  uncaught exception in ``main``); and a collective that failed itself (a gloo timeout).
* **waiting**: :mod:`.collectives` waits for every collective here (:func:`wait_work`), in slices
  of ``POLL_INTERVAL``; between slices it reads the store and, if a rank posted, raises
  :class:`RankFailedError` naming that rank and its error. A healthy collective that finishes
  within one slice never touches the store; a slow one reads one key per slice. Whether a slice
  ran out or the collective failed is read from the work's own state, never from clocks (a
  loaded machine skews them): only the process group's timeout may fail a healthy collective.

A posted failure means the job cannot go on: the failing rank skipped collectives the others
ran, so the groups' sequences no longer match. Recreate the process groups (or restart the job)
to continue; torchrun stops the remaining workers once one exits non-zero.

Only gloo waits are sliced: gloo's ``wait`` blocks the caller, while NCCL's only orders streams
(and a timed-out NCCL wait aborts the communicator); NCCL jobs rely on NCCL's watchdog
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``) and on torchrun. Works that cannot wait with a timeout
(PyTorch's threaded test group, some third-party backends) are waited for unsliced.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import queue
import sys
import threading
import time

import torch
import torch.distributed as dist

from . import _caches, _desync, _inflight
from ._default_store import default_store

__all__ = ["RankFailedError", "CollectiveFailedError", "POLL_INTERVAL", "post_failure",
           "posted_failure", "propagate_failures", "wait_work", "on_kernel_error",
           "install_excepthook"]

POLL_INTERVAL = datetime.timedelta(seconds=0.5)  # how often a blocked wait looks at the store
_POLL_SECONDS = POLL_INTERVAL.total_seconds()
_KEY = "dtensor_lite/first_failure"
_MAX_MESSAGE = 2000  # characters of the exception text that travel through the store
_POSTED = "_dtensor_lite_posted"  # attribute on an exception: already posted (or not ours to post)


class RankFailedError(RuntimeError):
    """Another rank failed (its error is in the message and in ``failure``); this rank was
    waiting for it in a collective that can no longer complete."""

    def __init__(self, message: str, failure: str):
        super().__init__(message)
        self.failure = failure
        setattr(self, _POSTED, True)  # the cause is posted already; this is only its echo


class CollectiveFailedError(RuntimeError):
    """A collective failed (e.g. timed out) without any rank having posted an exception first."""


# ------------------------------------------------------------------ the store
_store = default_store  # the default process group's store, or None


def _describe(exc: BaseException) -> str:
    text = str(exc)
    if len(text) > _MAX_MESSAGE:
        text = text[:_MAX_MESSAGE] + " [...]"
    return f"rank {dist.get_rank()}: {type(exc).__name__}: {text}"


def post_failure(exc: BaseException) -> bool:
    """Tell every rank that this rank failed with ``exc`` (the first post of the job wins);
    whether this post won. Never raises: it runs on paths that are already failing."""
    if getattr(exc, _POSTED, False):
        return False
    try:
        setattr(exc, _POSTED, True)
    except AttributeError:  # an exception type with __slots__: post it anyway
        pass
    store = _store()
    if store is None:
        return False
    try:
        # compare_set with an expected "" creates the key only if it is absent: first post wins
        text = _describe(exc)
        won = _as_text(store.compare_set(_KEY, "", text)) == text
        _acknowledge(store)  # a poster needs nothing more from the store (Ctrl-C on every rank)
        return won
    except Exception:  # noqa: BLE001 - the store may be gone with the rank that hosted it
        return False


def posted_failure() -> str | None:
    """The first failure any rank posted ("rank r: Type: message"), or None."""
    store = _store()
    if store is None:
        return None
    try:
        if not store.check([_KEY]):
            return None
        failure = _as_text(store.get(_KEY))
        _acknowledge(store)
        return failure
    except Exception as e:  # noqa: BLE001
        # the store's host (rank 0 under torchrun's c10d rendezvous: the agent) is unreachable
        return f"(unknown rank: the c10d store is unreachable: {type(e).__name__}: {e})"


def forget_posted_failure() -> None:
    """Remove the posted failure, for a process group that is used again after ranks raised
    errors they caught (test suites whose ranks all raised alike; jobs never need this)."""
    global _ACKNOWLEDGED
    _ACKNOWLEDGED = False
    store = _store()
    if store is not None:
        for key in (_KEY, _seen_key(dist.get_rank())):
            try:
                store.delete_key(key)
            except Exception:  # noqa: BLE001 - nothing to forget, or no store
                pass


# A rank that posts its failure and then ends its process takes the store with it when it is the
# store's host (rank 0 of an env:// or tcp:// rendezvous; torchrun's agent hosts it otherwise):
# the ranks still blocked in a collective would find gloo's "connection closed" and no store to
# read the failure's name from. So the host, after reporting, keeps serving the store until every
# other rank has read the failure or posted its own (each sets its "seen" key once) -- an event,
# not a clock -- or HOST_LINGER passes (a rank that never reaches a collective again: it exited,
# or computes on).
HOST_LINGER = datetime.timedelta(seconds=10)
_SEEN = "dtensor_lite/failure_seen/"
_ACKNOWLEDGED = False


def _as_text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _seen_key(rank: int) -> str:
    return f"{_SEEN}{rank}"


def _acknowledge(store) -> None:
    """Tell the store's host this rank needs the store no more for the failure: it read the
    posted one, or posted its own (once per process)."""
    global _ACKNOWLEDGED
    if not _ACKNOWLEDGED:
        _ACKNOWLEDGED = True
        with contextlib.suppress(Exception):
            store.set(_seen_key(dist.get_rank()), "1")


def _hosts_store(store) -> bool:
    """Whether this process serves the default group's TCPStore (its exit would end it)."""
    if dist.get_rank() != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return False
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return isinstance(store, dist.TCPStore)


def serve_store_until_read() -> None:
    """On the store's host, after posting the failure that ends it: wait until every other rank
    has read it (bounded by HOST_LINGER)."""
    store = _store()
    if store is None or dist.get_world_size() == 1 or not _hosts_store(store):
        return
    others = [_seen_key(r) for r in range(dist.get_world_size()) if r != dist.get_rank()]
    with contextlib.suppress(Exception):  # the bound ran out: exit as before
        store.wait(others, HOST_LINGER)


@contextlib.contextmanager
def propagate_failures():
    """Post any exception escaping the block, so that every other rank stops at its next
    collective with a :class:`RankFailedError` naming this rank and the exception, within
    ``POLL_INTERVAL`` instead of the process group's timeout.

    Wrap a training step (or the whole loop) with it where the exception does not end the
    process (an uncaught one is posted by the hook installed with the first DeviceMesh)::

        >>> with dtensor_lite.debug.propagate_failures():
        ...     loss = model(batch).sum(); loss.backward(); optim.step()

    After a posted failure the process groups are out of step: recreate them before going on.
    """
    try:
        yield
    except BaseException as e:
        if _is_failure(e):
            post_failure(e)
        raise


def _is_failure(exc: BaseException) -> bool:
    """Whether ``exc`` stops this rank for its peers: any exception, and Ctrl-C (the others would
    wait for it forever); not a SystemExit or a generator's close."""
    return isinstance(exc, (Exception, KeyboardInterrupt))


_HOOK_INSTALLED = False


def install_excepthook() -> None:
    """Post the exception that ends this process (chained before the current ``sys.excepthook``).
    Called when the first DeviceMesh is built; installing twice is a no-op."""
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED:
        return
    _HOOK_INSTALLED = True
    previous = sys.excepthook

    def post_then_report(exc_type, exc, tb):
        won = _is_failure(exc) and post_failure(exc)
        previous(exc_type, exc, tb)
        if won:
            serve_store_until_read()

    sys.excepthook = post_then_report


# ------------------------------------------------------------------ waiting
# process group -> its backend's name ("" when torch cannot tell); keyed by groups, so dropped
# with them when the default group changes
_BACKENDS: dict = _caches.register({})


def group_backend(group) -> str:
    """``str(dist.get_backend(group))``, looked up once per group (collectives ask per call)."""
    name = _BACKENDS.get(group)
    if name is None:
        try:
            name = str(dist.get_backend(group))
        except (RuntimeError, ValueError):
            name = ""
        _BACKENDS[group] = name
    return name


def _sliceable(group) -> bool:
    """Whether waits on ``group`` block the caller and can be sliced (gloo, not NCCL)."""
    name = group_backend(group)
    return bool(name) and "nccl" not in name


def _group_ranks(group) -> list[int]:
    try:
        return dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        return []


def _remote_failure(kind: str, group, failure: str) -> RankFailedError:
    return RankFailedError(
        f"{kind} over ranks {_group_ranks(group)} cannot complete: another rank failed first -- "
        f"{failure} -- and will not join it. Every rank of the job stops; the first failure above "
        "is the one to fix (see docs/troubleshooting.md, 'A rank failed').", failure)


def wait_work(work, kind: str, group, timed_wait_aborts: bool | None = None) -> None:
    """Wait for ``work`` (a collective of ``kind`` over ``group``). On gloo, in slices of
    ``POLL_INTERVAL``: a failure another rank posted meanwhile raises :class:`RankFailedError`;
    a collective that fails itself (gloo's timeout, a peer gone) raises
    :class:`CollectiveFailedError` and is posted for the ranks waiting elsewhere.

    Whether a slice merely ran out or the collective failed is read from the work itself (is it
    completed? then a plain ``wait()`` returns at once, or raises the collective's own error),
    never from clocks: on a loaded machine a healthy collective may take any number of slices,
    and only the process group's own timeout may fail it. A backend whose works cannot wait with
    a timeout at all (PyTorch's threaded test group, some third-party backends) is waited for
    without slices, bounded by the group's timeout alone.

    ``timed_wait_aborts``: whether a timed wait would break ``work`` (then it is waited for on a
    thread); None: as the work says (``_Works``), else true for a reduce-scatter only."""
    if not _sliceable(group):
        work.wait()
        return
    if timed_wait_aborts is None:
        timed_wait_aborts = getattr(work, "timed_wait_aborts", kind == "reduce_scatter")
    if timed_wait_aborts:
        # gloo's reduce_scatter work runs the collective inside wait() and ignores its timeout
        # (and has no future), and a send / receive pair is closed by a timed-out wait: wait for
        # those on a thread of their own and watch the store from here (works dtensor_lite wraps
        # say which they are)
        _wait_on_thread(work, kind, group)
        return
    watch = None  # made once the first slice ran out: a desync report (_desync.py)
    try:
        while True:
            try:
                if work.wait(POLL_INTERVAL) is not False:
                    return
            except RuntimeError as e:  # NotImplementedError too
                if work.is_completed() or not _slice_ran_out(e):
                    # it ended during the slice (succeeded or failed: a plain wait returns at
                    # once or raises its error), or it cannot wait with a timeout (PyTorch's
                    # threaded test group, some third-party backends): wait unsliced, bounded by
                    # the group timeout
                    _wait_plain(work, kind, group)
                    return
            failure = posted_failure()  # only the slice ran out: did some rank give up?
            if failure is not None:
                raise _remote_failure(kind, group, failure)
            if watch is None:
                watch = _desync.Watch(work, kind, group, _POLL_SECONDS)
            _desync_check(watch)
    finally:
        if watch is not None:
            watch.close()


def _slice_ran_out(e: BaseException) -> bool:
    """Whether ``e``, raised by ``wait(timeout)`` on a work not completed, says the timeout ran
    out (gloo: "Operation timed out!") -- not that timed waits are unsupported ("wait() with
    finite timeout not implemented") or anything else."""
    text = str(e).lower()
    return "timed out" in text and "not implemented" not in text


def _wait_plain(work, kind: str, group) -> None:
    """Wait for ``work`` without a timeout of ours; its own failure is raised named (and
    posted), as a sliced wait's would be."""
    try:
        work.wait()
    except RuntimeError as e:
        _raise_failed(kind, group, e, work)


class _Waiter(threading.Thread):
    """A daemon thread that waits for works handed to it; idle ones are reused (starting a thread
    costs ~100 us, a hand-over ~10). A daemon: one left waiting for a dead collective must not
    hold up the process's exit, and a busy one is never handed more, so it cannot block others."""

    def __init__(self):
        super().__init__(name="dtensor_lite collective wait", daemon=True)
        self.jobs = queue.SimpleQueue()

    def run(self):
        while True:
            work, stream, done, errors = self.jobs.get()
            try:
                with _on_stream(stream):
                    work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                errors.append(e)
            # drop the work (and the buffers it keeps alive) before the waiting thread goes on
            work = stream = None
            _IDLE_WAITERS.append(self)
            done.set()
            done = errors = None


_IDLE_WAITERS: list[_Waiter] = []


def _current_cuda_stream():
    """The calling thread's current CUDA stream (None in a process that never used CUDA).

    A work over device tensors ends its ``wait()`` by ordering the *waiting thread's* current
    stream after the collective's copies (gloo copies device tensors through the host on its own
    streams). Streams are per thread: a waiter thread would order its own default stream, not the
    one the caller reads the result on (FSDP reads a reduce-scatter's output on a side stream),
    and the caller would read the buffer before the result was copied in -- silently wrong. So
    the waiter waits on the caller's stream."""
    return torch.cuda.current_stream() if torch.cuda.is_initialized() else None


def _on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _wait_on_thread(work, kind: str, group) -> None:
    try:
        waiter = _IDLE_WAITERS.pop()
    except IndexError:
        waiter = _Waiter()
        waiter.start()
    done, errors = threading.Event(), []
    waiter.jobs.put((work, _current_cuda_stream(), done, errors))
    watch = None
    try:
        while not done.wait(_POLL_SECONDS):
            failure = posted_failure()
            if failure is not None:
                raise _remote_failure(kind, group, failure)
            if watch is None:
                watch = _desync.Watch(work, kind, group, _POLL_SECONDS)
            _desync_check(watch)
    except BaseException:  # that failure, or Ctrl-C
        # the waiter stays blocked in the backend until the work ends (a peer exits, or the group
        # times out); the process must not finalize before it is back (see _inflight.py)
        _inflight.abandon(done.is_set, [])
        raise
    finally:
        if watch is not None:
            watch.close()
    if errors:
        _raise_failed(kind, group, errors[0], work)


def _desync_check(watch) -> None:
    """``watch.check()``; its DesyncError is posted for the ranks waiting in other groups."""
    try:
        watch.check()
    except _desync.DesyncError as e:
        post_failure(e)
        raise


def _raise_failed(kind: str, group, e: BaseException, work=None):
    """The collective itself failed: name the rank that failed first if one posted, else say
    which ranks did not join (what each rank of the group was doing, as the store tells: see
    _desync.py), and post that for the ranks waiting elsewhere."""
    failure = posted_failure()
    if failure is not None:
        raise _remote_failure(kind, group, failure) from e
    where = _desync.group_report(group, kind, work)
    where = f" Where the group's ranks are: {where}." if where else ""
    err = CollectiveFailedError(
        f"{kind} over ranks {_group_ranks(group)} failed: {e}. No rank reported an exception "
        f"before it, so some rank of the group did not join this collective.{where} A rank that "
        "did not join exited, is stuck elsewhere, or ran a different sequence of collectives "
        "(e.g. a forward, backward or optimizer step that not every rank ran). The process "
        "group's timeout bounds this wait: init_process_group(timeout=...). See "
        "docs/troubleshooting.md, 'Ranks in different collectives'.")
    post_failure(err)
    raise err from e


# ------------------------------------------------------------------ kernels on pieces
def _may_be_rank_local(specs, locals_) -> bool:
    """Whether a kernel error on these pieces can be this rank's alone: some input holds data
    that differs by rank and that kernels check (ids / masks: non-float tensors), or this rank's
    piece is empty while the whole tensor is not."""
    for spec, loc in zip(specs, locals_):
        if all(p.is_replicate() for p in spec.placements):
            continue
        dtype = spec.tensor_meta.dtype
        if not (dtype.is_floating_point or dtype.is_complex):
            return True
        if isinstance(loc, torch.Tensor) and loc.numel() == 0 and \
                math.prod(spec.tensor_meta.shape) > 0:
            return True
    return False


def on_kernel_error(op, exc: Exception, specs, locals_) -> None:
    """The local kernel of ``op`` raised ``exc`` on pieces ``locals_`` (specs ``specs``). If the
    failure may be this rank's alone (see :func:`_may_be_rank_local`), post it and raise it again
    with a message that says so; otherwise return (the caller re-raises ``exc``: every rank holds
    the same data and raises the same error)."""
    if getattr(exc, _POSTED, False) or not _may_be_rank_local(specs, locals_):
        return
    placements = [list(s.placements) for s in specs]
    message = (f"{exc}\n[{op} on this rank's pieces, inputs placed {placements}: the error depends "
               "on the data this rank holds, so other ranks need not raise it; they stop at their "
               "next collective with an error naming this rank. See docs/troubleshooting.md, "
               "'Out-of-range indices'.]")
    try:
        err = type(exc)(message)
    except Exception:  # noqa: BLE001 - an exception type with another signature
        err = RuntimeError(message)
    post_failure(err)
    raise err from exc
