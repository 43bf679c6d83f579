"""``memory_profile()``: PyTorch's profiler with allocator events, started without its log lines.

Starting ``torch.profiler`` makes PyTorch's native code print lines that mean nothing to the
reader of our output, on stderr, outside Python's ``warnings``:

* kineto (the profiler's backend) logs ``USDT:... SyncActivityProfilerHandler.cpp] profiler_start``
  and ``profiler_stop`` when a trace starts and stops. Its ``USDT`` severity is the highest of
  its ``LoggerOutputType``, so the threshold torch sets (``ERROR``) lets it through and only a
  threshold above ``USDT`` (or ``KINETO_LOG_LEVEL``, read once when kineto starts) stops it.
* c10's CPU allocator logs ``CPUAllocator.cpp] Memory block of unknown size was allocated
  before the profiling started...`` (a ``WARNING``) the first time a block allocated before the
  profiler started is freed under it -- in a training step that is almost certain.

Both loggers read a threshold variable at every message, and both variables are exported by
torch's libraries, so we raise each only around the calls that print -- kineto's above ``USDT``
for the start and stop calls, c10's above ``WARNING`` while memory is profiled -- and put back
what was there. Nothing else is filtered: the user's stderr, Python warnings and c10's errors
pass as before. The cost of a threshold: c10 has one for the whole process, so another c10
``WARNING`` logged (on any thread) while memory is profiled is dropped too; the block is one
training step that the profiler watches anyway. Where a build does not export a variable
(another torch, a glog build), its lines are left as they are.

What the allocator's line says is a real limit, and the one who reports the memory states it in
its own words (``MemoryTracker``'s table, ``benchmarks/memory.py``): a free of a block allocated
before the profiler started carries no size, so a figure "above the start" does not go down by it.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import torch

__all__ = ["memory_profile"]

# kineto's LoggerOutputType: VERBOSE 0, INFO 1, WARNING 2, ERROR 3, STAGE 4, USDT 5 (the highest)
_KINETO_ABOVE_USDT = 6
# c10's severities (logging_is_not_google_glog.h): INFO 0, WARNING 1, ERROR 2, FATAL 3
_C10_ERROR = 2


@functools.lru_cache(maxsize=None)
def _threshold(library: str, symbol: str) -> ctypes.c_int | None:
    """The ``int`` log threshold ``symbol`` exported by torch's ``library`` (already loaded by
    ``import torch``: this finds it, it loads nothing new), or None."""
    for suffix in (".so", ".dylib"):
        try:
            lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib",
                                           library + suffix))
            return ctypes.c_int.in_dll(lib, symbol)
        except (OSError, ValueError):
            continue
    return None


def _kineto_threshold():
    return _threshold("libtorch_cpu", "_ZN9libkineto6Logger14severityLevel_E")


def _c10_threshold():
    return _threshold("libc10", "FLAGS_caffe2_log_level")


@contextlib.contextmanager
def _at_least(threshold: ctypes.c_int | None, level: int):
    """Messages below ``level`` are dropped by this logger inside the block (a threshold already
    higher stays); the previous threshold is restored after it."""
    if threshold is None:
        yield
        return
    before = threshold.value
    threshold.value = max(before, level)
    try:
        yield
    finally:
        threshold.value = before


@contextlib.contextmanager
def memory_profile():
    """Run the block under ``torch.profiler.profile(activities=[CPU], profile_memory=True)``
    without the profiler's or the allocator's log lines; yields the profile (read
    ``prof.profiler.kineto_results`` after the block).

    Example::

        >>> with memory_profile() as prof:
        ...     y = model(x)
        >>> events = prof.profiler.kineto_results.experimental_event_tree()
    """
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    # the first preparation in a process starts kineto, which then sets its own threshold:
    # raise it only after that, around the calls that log
    prof.prepare_trace()
    with _at_least(_c10_threshold(), _C10_ERROR):
        with _at_least(_kineto_threshold(), _KINETO_ABOVE_USDT):
            prof.start_trace()
        try:
            yield prof
        finally:
            with _at_least(_kineto_threshold(), _KINETO_ABOVE_USDT):
                prof.__exit__(None, None, None)   # stop_trace, and the step counter it holds
