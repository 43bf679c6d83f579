"""Desync diagnosis, on by default: which rank is in which collective, at which line of the user's.

The commonest distributed bug is a collective that not every rank runs (``x.full_tensor()``
inside ``if rank == 0:``): the ranks then wait in different collectives, and gloo waits for its
timeout (30 minutes by default) without a word. So, like PyTorch's NCCL flight recorder and
desync report, but on by default and for any backend whose waits are sliced (``_failures``):

* **recording** (every collective :mod:`.collectives` issues): a per-group sequence number and
  the collective's name, kept with the work's id in a small ring. A counter and a tuple: the
  user's call site is *not* computed here (walking the stack per collective would cost more than
  the rest of the bookkeeping); a waiting rank is still inside the user's call, so it reads the
  site from its own stack when, and only when, it reports.
* **reporting**: a wait that has lasted ``BOUND`` seconds posts this rank's state to the default
  group's store -- ``in <collective> #<seq> over <ranks> at <file:line>`` -- and reads its group's
  ranks' states every slice after. A rank that ends its process posts ``exited`` (its last
  collective) at exit.
* **the verdict**, read from the states alone (never from clocks: a loaded machine makes a
  healthy collective slow, and a slow collective is one every rank has joined): the ranks of the
  group that are in another collective (other sequence number, other name, other group) or have
  exited cannot join this one. When every rank of the group has joined or is known elsewhere, and
  at least one is elsewhere, or when one has exited, every waiting rank raises
  :class:`DesyncError` naming each rank's collective and line. A rank that posted nothing (it
  computes, or is blocked outside the library) is "not responding": the wait goes on, bounded by
  the group's timeout, whose error then carries the same report. The verdict must hold on two
  reads a slice apart, so a rank whose wait just ended (and whose state is being cleared) is
  never taken for one elsewhere.

``DTL_DESYNC_SECONDS`` sets ``BOUND`` (default 10; ``0`` turns reporting off);
``DTL_FLIGHT_RECORDER=0`` turns recording off too (then reports name no sequence numbers).
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import sys
import sysconfig
import time

import torch.distributed as dist

from . import _caches
from ._default_store import default_store
from ._rank_text import ranks_text

__all__ = ["RECORDING", "BOUND", "DesyncError", "issued", "Watch", "report", "user_site"]


def _env_seconds(name: str, default: float) -> float:
    text = os.environ.get(name, "")
    try:
        return float(text) if text else default
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a number of seconds (0 turns it off)") \
            from None


RECORDING = os.environ.get("DTL_FLIGHT_RECORDER", "1") not in ("0", "", "off", "false")
BOUND = _env_seconds("DTL_DESYNC_SECONDS", 10.0)

_RING: collections.deque = collections.deque(maxlen=64)  # (id(work), group, seq, name)
_SEQ: dict = _caches.register({})  # process group -> its last sequence number (per rank)
_KEY = "dtensor_lite/desync/"


class DesyncError(RuntimeError):
    """The ranks of a group are in different collectives (or some exited): this collective
    cannot complete. The message names each rank's collective and line."""


# every function collectives.py issues (a c10d one or its own form of one) -> the collective a
# user knows it as: the one table for reports, and for the codes of the agreement check's rows
ISSUED_AS = {
    "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
    "_broadcast_slots": "all_gather", "_broadcast_pieces": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "_all_reduce_in_place": "all_reduce", "all_reduce": "all_reduce",
    "broadcast": "broadcast", "scatter": "scatter", "all_to_all_single": "all_to_all_single",
}


def plain_name(name: str) -> str:
    """The collective a c10d function name (or collectives.py's own form of it) stands for."""
    return ISSUED_AS.get(name, name)


def issued(work, group, name: str) -> None:
    """Record a collective just issued (called by ``collectives._issue``)."""
    seq = _SEQ.get(group, 0) + 1
    _SEQ[group] = seq
    _RING.append((id(work), group, seq, name))


def _entry_of(work, group, kind: str):
    """(sequence number, collective name) of ``work`` (the newest entry with its id: the work is
    alive, so an older entry with the same id was another object's)."""
    wid = id(work)
    for entry in reversed(_RING):
        if entry[0] == wid:
            return entry[2], plain_name(entry[3])
    return None, kind


# ------------------------------------------------------------------ the user's line
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY = tuple(os.path.join(_ROOT, pkg) + os.sep for pkg in ("dtensor_lite", "fsdp", "tp")) + (
    os.path.dirname(os.path.abspath(dist.__file__)).rsplit(os.sep, 1)[0] + os.sep,  # torch/
    sysconfig.get_paths()["stdlib"] + os.sep)
_IS_LIBRARY: dict = {}  # code object -> whether it lives in the library (or torch, stdlib)


def user_site(frame=None) -> str:
    """``file:line`` of the first frame outside dtensor_lite, fsdp, tp, torch and the standard
    library, walking out from ``frame`` (default: the caller's)."""
    f = frame or sys._getframe(1)
    while f is not None:
        code = f.f_code
        lib = _IS_LIBRARY.get(code)
        if lib is None:
            lib = _IS_LIBRARY[code] = os.path.abspath(code.co_filename).startswith(_LIBRARY)
        if not lib:
            return f"{code.co_filename}:{f.f_lineno}"
        f = f.f_back
    return "(no frame outside the library)"


# ------------------------------------------------------------------ states in the store
_store = default_store


def _group_ranks(group) -> list[int]:
    try:
        return dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        return []


def _post(state: dict) -> None:
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):  # the store may be gone with its host
            store.set(f"{_KEY}{dist.get_rank()}", json.dumps(state))


def _clear() -> None:
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.delete_key(f"{_KEY}{dist.get_rank()}")


def _read(ranks) -> dict:
    """{rank: its posted state, or None}."""
    store = _store()
    states = {}
    for r in ranks:
        try:
            key = f"{_KEY}{r}"
            states[r] = json.loads(store.get(key)) if store is not None and store.check([key]) \
                else None
        except Exception:  # noqa: BLE001 - an unreachable store: nothing known of that rank
            states[r] = None
    return states


def _describe(state) -> str:
    if state is None:
        return "not responding (in no collective of dtensor_lite's: computing, blocked " \
               "elsewhere, or hung)"
    if state.get("state") == "exited":
        last = state.get("last")
        return "exited" + (f" (last collective: {last})" if last else "")
    seq = f" #{state['seq']}" if state.get("seq") is not None else ""
    return f"in {state['kind']}{seq} over ranks {state['ranks']} at {state['site']}"


def report(states: dict) -> str:
    """One line per state: "rank 0: in all_gather #5 over ranks [0, 1] at t.py:12; ranks 1-3:
    ..." (ranks with the same state together)."""
    groups: dict = {}
    for r, s in states.items():
        groups.setdefault(_describe(s), []).append(r)
    return "; ".join(f"{ranks_text(rs)}: {text}"
                     for text, rs in sorted(groups.items(), key=lambda kv: min(kv[1])))


def _joined(mine: dict, theirs) -> bool:
    return theirs is not None and theirs.get("state") == "in" and all(
        theirs.get(k) == mine[k] for k in ("ranks", "seq", "kind"))


class Watch:
    """One wait that has lasted past a slice. ``check()`` after each slice that ran out: posts
    this rank's state once ``BOUND`` has passed, then raises :class:`DesyncError` when the
    group's states say the collective cannot complete. ``close()`` when the wait ends."""

    __slots__ = ("work", "kind", "group", "since", "mine", "last_verdict")

    def __init__(self, work, kind: str, group, slice_seconds: float):
        self.work, self.kind, self.group = work, kind, group
        self.since = time.monotonic() - slice_seconds  # the first slice has run out already
        self.mine = None
        self.last_verdict = None

    def state(self) -> dict:
        seq, name = _entry_of(self.work, self.group, self.kind)
        return {"state": "in", "ranks": _group_ranks(self.group), "seq": seq,
                "kind": name, "site": user_site(sys._getframe(1))}

    def check(self) -> None:
        if BOUND <= 0 or time.monotonic() - self.since < BOUND:
            return
        if self.mine is None:
            self.mine = self.state()
            _post(self.mine)
        ranks = self.mine["ranks"]
        states = _read(ranks)
        states[dist.get_rank()] = self.mine
        others = {r: s for r, s in states.items() if r != dist.get_rank()}
        exited = [r for r, s in others.items() if s is not None and s.get("state") == "exited"]
        missing = [r for r, s in others.items() if s is None]
        away = [r for r, s in others.items() if s is not None and not _joined(self.mine, s)]
        verdict = None
        if exited or (away and not missing):
            verdict = json.dumps(states, sort_keys=True)
        if verdict is None or verdict != self.last_verdict:
            self.last_verdict = verdict  # the same verdict twice, a slice apart, or none
            return
        raise DesyncError(
            f"{self.mine['kind']} over ranks {ranks} cannot complete: the ranks are not all in "
            f"it -- {report(states)}. A collective was called on some ranks only (e.g. inside "
            "`if rank == ...`, or a step not every rank ran), in another order, or after some "
            "ranks ended. Make every rank of the group issue the same collectives in the same "
            "order; the group is out of step now (recreate it, or restart the job). See "
            "docs/troubleshooting.md, 'Ranks in different collectives'.")

    def close(self) -> None:
        if self.mine is not None:
            _clear()


def group_report(group, kind: str, work=None) -> str:
    """The states of ``group``'s ranks, this rank's included (for an error that ends a wait:
    the group's timeout, a peer gone), or "" when nothing is known."""
    ranks = _group_ranks(group)
    if not ranks or _store() is None:
        return ""
    states = _read(ranks)
    seq, name = _entry_of(work, group, kind) if work is not None else (None, kind)
    states[dist.get_rank()] = {"state": "in", "ranks": ranks, "seq": seq, "kind": name,
                               "site": user_site(sys._getframe(1))}
    return report(states)


_SITE_EXCHANGES = [0]  # how many times this process's group compared sites (same on every rank)


def exchange_sites(group, kind: str) -> str:
    """Every rank of ``group`` has found its collective differs from another rank's (all got the
    same rows, ``collectives._check_buffers_agree``): each posts its line and reads the others'
    (a wait on the store bounded by ``max(BOUND, 10)`` seconds); the report, or "" without a
    store."""
    ranks, store = _group_ranks(group), _store()
    if not ranks or store is None:
        return ""
    _SITE_EXCHANGES[0] += 1
    prefix = f"dtensor_lite/sites/{_SITE_EXCHANGES[0]}/"
    mine = {"state": "in", "ranks": ranks, "seq": None, "kind": plain_name(kind),
            "site": user_site(sys._getframe(1))}
    states = {}
    with contextlib.suppress(Exception):
        store.set(f"{prefix}{dist.get_rank()}", json.dumps(mine))
        store.wait([f"{prefix}{r}" for r in ranks], datetime.timedelta(seconds=max(BOUND, 10)))
    for r in ranks:
        try:
            states[r] = json.loads(store.get(f"{prefix}{r}"))
        except Exception:  # noqa: BLE001 - that rank did not post within the bound
            states[r] = None
    states[dist.get_rank()] = mine
    return report(states)


def _last_collective() -> str | None:
    if not _RING:
        return None
    _, group, seq, name = _RING[-1]
    return f"{plain_name(name)} #{seq} over ranks {_group_ranks(group)}"


def post_exit() -> None:
    """At exit (``_at_exit.py``): tell the ranks still waiting that this one has gone (only if
    it issued any collective)."""
    if _RING and dist.is_available() and dist.is_initialized():
        _post({"state": "exited", "last": _last_collective()})
