"""The state the debug tools set and the hot path reads, with nothing else in it.

``collectives.py`` reports every collective through :func:`record` and times it with
:class:`CommFlight` while an ``ExposedCommMode`` is entered; the dispatcher, the fallback and the
aliasing checks ask :data:`EXPLICIT` whether an ``ExplicitRedistributionContext`` is entered and
label the collectives they cause with :class:`comm_cause` (so do fsdp, tp and the rules).
The user-facing modes (``CommDebugMode``, ``ExposedCommMode``, ``ExplicitRedistributionContext``,
``check_collectives``) live in :mod:`dtensor_lite.debug` and only append to / remove from these
lists. The lists are never rebound (modules import them by name), and an empty list is the
whole cost on the hot path: one truth test.
"""
from __future__ import annotations

import contextlib
import os
import time

__all__ = ["COMM_SINKS", "TIMERS", "CAUSES", "CHECKING", "EXPLICIT", "UNATTRIBUTED", "comm_cause",
           "outermost_cause", "record", "CommFlight", "on_completion"]

# the recording method of every CommDebugMode entered (debug.CommDebugMode adds and removes it)
COMM_SINKS: list = []
# every ExposedCommMode entered: sinks with add_wait / add_flight (see CommFlight)
TIMERS: list = []
CAUSES: list[tuple[str, "int | str | None"]] = []  # innermost last: (op, input)
# non-empty while collectives check that every rank's buffers agree (check_collectives)
CHECKING: list[bool] = [True] if os.environ.get("DTL_CHECK_COLLECTIVES", "0") not in ("", "0") \
    else []
# every debug.ExplicitRedistributionContext entered, innermost last
EXPLICIT: list = []

UNATTRIBUTED = "(direct collective)"  # a collectives.* call made outside any labelled cause


class comm_cause:
    """Label the collectives issued inside it with ``op`` (and ``input``: an argument index or
    name) for :class:`CommDebugMode`. The innermost label wins. The dispatcher labels each aten
    op and the input it moves, ``DTensor.redistribute`` / ``full_tensor`` label themselves
    ``"redistribute"``, FSDP its hooks; label your own strategy's collectives the same way::

        >>> with comm_cause("my_ring_attention"):
        ...     k = ring_shift(k, mesh, 0)
    """

    __slots__ = ("entry",)

    def __init__(self, op, input: "int | str | None" = None):
        self.entry = (str(op), input)

    def __enter__(self):
        CAUSES.append(self.entry)
        return self

    def __exit__(self, *exc):
        CAUSES.pop()
        return False


_NO_CAUSE = contextlib.nullcontext()


def outermost_cause(label: str):
    """``comm_cause(label)`` unless a cause is already labelled (an op that redistributes as
    part of its own work keeps the op's label), only while a CommDebugMode records; otherwise a
    context that does nothing."""
    if COMM_SINKS and not CAUSES:
        return comm_cause(label)
    return _NO_CAUSE


def record(kind: str, nbytes: int, group_size: int, mesh_dim: str = "?",
           ranks: tuple[int, ...] = ()):
    """Called by the collectives layer for every collective it issues: its kind, bytes sent per
    rank, group size, the name of the mesh dim it ran over and that group's global ranks."""
    op, input = CAUSES[-1] if CAUSES else (UNATTRIBUTED, None)
    for sink in COMM_SINKS:
        sink(kind, nbytes, group_size, mesh_dim, ranks, op, input)


class CommFlight:
    """The timeline of one issued collective, for exposed-communication accounting.

    Exposed (the caller was blocked): the issue call itself plus every ``wait``. In flight: from
    the issue call to completion -- the backend's completion callback when it fired before the
    caller began to wait (the collective finished behind compute), else the end of the wait
    (gloo's reduce-scatter reports no completion: its flight is an upper bound; and a wait
    returns a little after the callback, once the waiting thread has the GIL back). So exposed
    <= in flight for every collective. ``sinks``: objects with ``add_wait`` / ``add_flight``.
    """

    __slots__ = ("kind", "started", "sinks", "done_at")

    def __init__(self, kind: str, started: float, work, sinks):
        self.kind, self.started, self.sinks, self.done_at = kind, started, list(sinks), None
        issued = time.perf_counter()
        for sink in self.sinks:
            sink.add_wait(kind, issued - started)
        on_completion(work, self._completed)

    def _completed(self):
        self.done_at = time.perf_counter()

    def waited(self, wait_start: float, wait_end: float):
        done = self.done_at
        end = done if done is not None and done <= wait_start else wait_end
        for sink in self.sinks:
            sink.add_wait(self.kind, wait_end - wait_start)
            sink.add_flight(self.kind, end - self.started)


def on_completion(work, callback) -> bool:
    """Arrange ``callback()`` to run (on the backend's thread) when the c10d ``work`` completes;
    False where its backend gives no future for it (gloo's reduce-scatter)."""
    try:
        work.get_future().then(lambda _future: callback())
    except RuntimeError:
        return False
    return True
