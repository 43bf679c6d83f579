"""The tensors a backend still holds after a collective: released here, never on its threads.

Why (issue 25, a core dump of ``train_llama.py`` aborting at exit): gloo runs each collective on
one of its process group's worker threads (``ProcessGroupGloo::runLoop``), and that thread drops
its reference to the work a moment *after* the work is marked complete -- the waiting thread is
already on its way. If Python dropped the last reference to a tensor of that work meanwhile,
torch keeps the tensor's Python object alive from C++, and the worker thread's release of the
work then has to take the GIL to free it. Should the interpreter be finalizing by then (the
program ended right after its last collective; a loaded machine delays the worker thread), taking
the GIL ends the thread with ``pthread_exit``, which unwinds through a C++ destructor:
``terminate called without an active exception``, SIGABRT, exit code -6. The same holds for a
Python callback (``Future.then``) that fires, or a Python thread blocked in ``Work.wait()`` that
returns, while the interpreter finalizes.

So every tensor :mod:`.collectives` hands to a backend is a private alias (``detach()``: a new
tensor object sharing the storage) that this module keeps until the backend has let go of it --
its use count is back to one, the reference held here. It is then dropped on the calling thread,
holding the GIL. At exit (``_at_exit.py``, before finalization) the collectives still held are drained;
works whose wait was abandoned (a failure elsewhere stopped it) are kept for good, and if one of
them is still running in the backend, the process exits at once with status 1 rather than
finalize beside it (``_exit_now``).
"""
from __future__ import annotations

import ctypes
import os
import sys
import time

import torch

__all__ = ["private", "retire", "abandon", "drain", "free_now", "aliases_of", "at_exit"]

_RETIRING: list[list[torch.Tensor]] = []  # holds whose work completed; the backend may still hold it
_ABANDONED: list[tuple] = []  # (is_done or None, hold): works whose wait was given up
_RETIRING_CAP = 4096  # a hold never released (a backend that keeps works) must not grow memory
DRAIN_SECONDS = 5.0  # at exit: how long a backend thread may take to let go of completed works


def private(arg, hold: list):
    """``arg`` for a backend call: each tensor (also inside a list) replaced by a private alias,
    which is appended to ``hold``."""
    if isinstance(arg, torch.Tensor):
        alias = arg.detach()
        hold.append(alias)
        return alias
    if isinstance(arg, (list, tuple)) and arg and all(isinstance(a, torch.Tensor) for a in arg):
        return type(arg)(private(a, hold) for a in arg)
    return arg


def _released(hold) -> bool:
    # one reference: ours (each alias is a tensor object nothing else was given); a loop, not
    # all(<generator>): this runs after every collective
    for t in hold:
        if t._use_count() > 1:
            return False
    return True


def aliases_of(storage) -> int:
    """How many private aliases held here share ``storage`` (an untyped storage): holders of a
    tensor's memory that are no user of it (``_aliasing`` counts the others)."""
    holds = [h for h in _RETIRING] + [a[1] for a in _ABANDONED]
    return sum(1 for hold in holds for t in hold
               if t.untyped_storage()._cdata == storage._cdata)


def free_now(*tensors: torch.Tensor) -> None:
    """Free the memory of buffers whose collective has finished, now, where that is the CPU: a
    finished gloo work is still referenced from gloo's thread until that thread runs again
    (milliseconds on a busy CPU), and the work keeps its tensors, so dropping our reference
    alone frees them at a moment the scheduler picks -- after the caller's next allocations, or
    before (a peak that varies from step to step, a bound on buffers in flight broken). On CUDA
    dropping the reference is the release (the caching allocator orders the memory's reuse), so
    this leaves CUDA tensors alone. The tensor objects stay, with empty storage."""
    for t in tensors:
        if t.device.type == "cpu":
            t.untyped_storage().resize_(0)


def retire(hold: list) -> None:
    """The work of ``hold`` completed and its ``Work`` object was dropped: release the aliases
    now if the backend has let go of them, else at a later call (or at exit)."""
    global _RETIRING
    if hold and not _released(hold):
        _RETIRING.append(hold)
    if _RETIRING:
        _RETIRING = [h for h in _RETIRING if not _released(h)]
        if len(_RETIRING) > _RETIRING_CAP:
            del _RETIRING[0]
    if _ABANDONED:  # those the backend finished and let go of since
        _ABANDONED[:] = [a for a in _ABANDONED if not _finished(a)]


def _finished(abandoned) -> bool:
    is_done, hold = abandoned
    return (is_done is None or is_done()) and _released(hold)


def abandon(is_done, hold: list) -> None:
    """A wait on a work was given up before it completed (an error stopped it, or its Pending
    was dropped unwaited): keep ``hold`` until the backend let go of it (the backend's thread
    keeps the work itself; keeping it here would keep its group's connections open, and a peer
    blocked on them). ``is_done``: None, or whether a thread still blocked in it has returned."""
    _ABANDONED.append((is_done, hold))


def _pending() -> tuple[int, int]:
    """(holds not yet released by a backend, abandoned works still running)."""
    retire([])
    return len(_RETIRING), len(_ABANDONED)


def drain(timeout: float = DRAIN_SECONDS) -> tuple[int, int]:
    """Wait (releasing the GIL, so a backend thread can finish) until every completed work was let
    go of by its backend and every abandoned one finished, at most ``timeout`` seconds. Returns
    what is still pending (see ``_pending``)."""
    deadline = time.monotonic() + timeout
    pause = 1e-4
    while True:
        pending = _pending()
        if pending == (0, 0) or time.monotonic() >= deadline:
            return pending
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def _keep_forever(obj) -> None:
    """One more reference that nothing releases: finalization never frees ``obj``, so a backend
    thread still holding one of its tensors never frees a Python object."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _exit_now(status: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream
            pass
    os._exit(status)


def at_exit() -> None:
    """Drain what backends still hold of our collectives (called first thing at exit by
    ``_at_exit``, before the process groups are torn down)."""
    if not (_RETIRING or _ABANDONED):
        return
    _, running = drain()
    if running:
        # a collective this process gave up on still runs on a backend thread (its peers have not
        # all gone yet): finalizing beside it would abort when it ends; this process failed anyway
        _exit_now(1)
    _keep_forever([_RETIRING, _ABANDONED])
