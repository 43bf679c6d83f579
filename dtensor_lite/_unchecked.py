"""Which DTensors hold pieces no rank compared, so their collectives check sizes first.

``DTensor.from_local(run_check=False)`` (torch's default), ``local_map``'s outputs and a
``shape=`` given by the user trust that every rank's piece belongs to one global tensor. When
they do not (rank 3's piece one column wider, or float64 where the others hold float32), the
ranks hold different global shapes, and the first collective on them hands gloo buffers of
different sizes: gloo aborts the process (``terminate called ... EnforceNotMet``, SIGABRT, no
Python traceback on that rank). So such a DTensor is *marked*, and every collective that moves
it (or anything computed from it) first all-gathers one fixed-size row per rank -- collective,
sizes, dtype, piece and global shape -- and raises the same ValueError on every rank when they
differ (``collectives._check_buffers_agree``), before any buffer sized by a piece crosses ranks.

Why a mark on the tensor and not a set of specs: whether a collective pays the header must be
decided alike on every rank, or the ranks issue different collectives. A mark follows the
program's path (every rank runs the same ``from_local`` and the same ops), so every rank marks
the same tensors; a set of specs would not (rank 0's spec may equal an earlier, checked one,
rank 3's never does).

Cost: a program that never wraps unchecked pieces pays one truth test of an empty list per
dispatched op. Marked tensors pay the row per collective until an explicit ``redistribute`` /
``full_tensor`` on a 1-D mesh has checked them (its result is marked no more); on an N-D mesh a
collective checks only its own mesh dim, so the mark stays.
"""
from __future__ import annotations

import contextlib

import torch

from .debug_state import CHECKING

__all__ = ["MARKED", "mark", "unmark", "is_marked", "any_marked", "propagate", "checking"]

# non-empty once this process marked a DTensor: until then no op looks for marks
MARKED: list = []


def mark(dt) -> None:
    """``dt`` holds a piece no rank compared with the others'."""
    dt._unchecked = True
    if not MARKED:
        MARKED.append(True)


def unmark(dt) -> None:
    if dt.__dict__.get("_unchecked"):
        del dt.__dict__["_unchecked"]


def is_marked(dt) -> bool:
    return bool(MARKED) and dt.__dict__.get("_unchecked", False)


def _any_marked(values) -> bool:
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.__dict__.get("_unchecked"):
                return True
        elif isinstance(v, (list, tuple)) and _any_marked(v):
            return True
    return False


def _mark_all(out) -> None:
    if isinstance(out, torch.Tensor) and hasattr(out, "_spec"):
        mark(out)
    elif isinstance(out, (list, tuple)):
        for o in out:
            _mark_all(o)


def propagate(args, kwargs, out):
    """``out`` of an op on ``args`` / ``kwargs``: marked if any input DTensor is (an in-place
    op's destination included: it is ``out``). Called only while ``MARKED``."""
    if _any_marked(args) or (kwargs and _any_marked(kwargs.values())):
        _mark_all(out)
    return out


def any_marked(dts) -> bool:
    return bool(MARKED) and any(dt.__dict__.get("_unchecked") for dt in dts)


@contextlib.contextmanager
def checking(spec=None):
    """Collectives inside check that every rank's buffers agree first; ``spec``: the global
    layout the rank believes it moves (named in the error)."""
    CHECKING.append(spec if spec is not None else True)
    try:
        yield
    finally:
        CHECKING.pop()
