"""FSDP's phase observers: who is told after each hook has done its work.

A module of its own so that the hooks (``hooks.py``) and the end-of-backward callback
(``state.py``) both report to it without importing each other.
"""
from __future__ import annotations

from typing import Callable

from dtensor_lite.memory_tracker import FSDP_EVENT_OBSERVERS

__all__ = ["OBSERVERS", "observe", "notify"]

# one list shared with dtensor_lite's MemoryTracker, which follows FSDP's phases through it
OBSERVERS: list[Callable[[str, "FSDPState"], None]] = FSDP_EVENT_OBSERVERS


class observe:
    """Context manager: call ``fn(event, state)`` after every FSDP hook has done its work.

    ``event`` is ``"pre_forward"``, ``"post_forward"``, ``"pre_backward"``, ``"post_backward"``
    (the group's gradients are in and handed to the reduce-scatter) or ``"end_of_backward"``
    (``state`` is the root's). Recomputation inside backward (activation checkpointing) is not
    reported. For tools that follow groups through a step (memory tracking, tests)::

        >>> with observe(lambda event, state: print(event, state.group)):
        ...     model(x).sum().backward()
    """

    def __init__(self, fn: Callable[[str, "FSDPState"], None]):
        self.fn = fn

    def __enter__(self):
        OBSERVERS.append(self.fn)
        return self

    def __exit__(self, *exc):
        OBSERVERS.remove(self.fn)
        return False


def notify(event: str, state: "FSDPState"):
    for fn in list(OBSERVERS):
        fn(event, state)
