"""What a process does at exit, in the one order that cannot race the backend's threads.

Why (issue 35): a script whose last collective is the user's own ``dist.all_reduce(t)`` (not one
of ours, so ``_inflight`` never saw its tensors) could end with ``terminate called without an
active exception`` (SIGABRT, exit -6) after printing success: gloo's worker thread drops its
reference to a finished work a moment after the caller saw it complete; if ``t``'s Python
object died meanwhile (the interpreter clearing the script's globals at exit), that thread is
left to free it and must take the GIL while the interpreter is finalizing, which ends the
thread with ``pthread_exit`` through a C++ destructor. The race is torch's (its own
``fully_shard`` script aborts alike), measured before this hook beside a busy process.

So at exit (``atexit``: the interpreter is whole, every module still there), in this order:

1. ``_desync.post_exit``: tell the ranks still waiting in a collective that this rank has gone
   (needs the store, which the default group keeps);
2. ``_inflight.at_exit``: wait until the backend let go of the tensors of dtensor_lite's own
   collectives (or leave at once, status 1, beside one still running);
3. destroy the process groups the program left (``dist.destroy_process_group()``): it shuts each
   backend down and joins its worker threads *now*, while they can still take the GIL, so no
   backend thread outlives the interpreter holding a Python object. A program that destroyed
   its groups itself has nothing left here. Only gloo groups are torn down: an NCCL group's
   shutdown may wait for a peer, and NCCL's own watchdog owns its teardown.
"""
from __future__ import annotations

import atexit
import contextlib
import threading

import torch.distributed as dist

from . import _desync, _inflight
from ._failures import group_backend

__all__ = ["at_exit"]


def _only_gloo_groups() -> bool:
    world = dist.distributed_c10d._world
    return all("gloo" in group_backend(pg) and "nccl" not in group_backend(pg)
               for pg in list(world.pg_map))


DESTROY_SECONDS = 30.0  # at exit: how long tearing the groups down may take


def _destroy_groups() -> None:
    """``dist.destroy_process_group()`` on a thread of its own, waited for at most
    ``DESTROY_SECONDS``: a collective the program issued and never waited for, whose peers never
    come, keeps gloo's shutdown waiting for it (up to the group's timeout); the process then
    exits as it would have without this hook rather than hang."""
    if not (dist.is_available() and dist.is_initialized()) or not _only_gloo_groups():
        return

    def destroy():
        with contextlib.suppress(Exception):  # a group already broken: exit as before
            dist.destroy_process_group()
    thread = threading.Thread(target=destroy, name="dtensor_lite exit teardown", daemon=True)
    thread.start()
    thread.join(DESTROY_SECONDS)  # releases the GIL: gloo's threads can free what they hold


def at_exit() -> None:
    _desync.post_exit()
    _inflight.at_exit()
    _destroy_groups()


atexit.register(at_exit)
