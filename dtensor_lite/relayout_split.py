"""A tensor whose traffic passes the relayout's bucket, split into windows that each fit one.

A cross-mesh plan (``redistribute.cross_mesh.CrossMeshPlan``) is metadata: per (source rank,
destination rank) the boxes (global index ranges) one sends the other, per rank the boxes it
copies itself. Cutting every box with a *window* -- a box of the source's global index space --
gives the plan of that window alone; windows that tile the tensor give plans that together move
every element exactly once, so the bytes moved stay the minimum and each window is written in
place like any move (its boxes index the same pieces). The windows are cut in row-major order:
the most rows along dim 0 whose every rank's send and receive fit the bucket; a single row that
does not fit is cut along dim 1 the same way, and so on. So no bucket holds more than
``bucket_bytes`` per rank unless one element is larger than it.

Example::

    >>> pieces = split_plan(plan, shape=(4096, 4096), bucket_bytes=1 << 20)
    >>> sum(p.bytes_sent().get(0, 0) for p in pieces) == plan.bytes_sent().get(0, 0)
    True
"""
from __future__ import annotations

from .redistribute.cross_mesh import CrossMeshPlan, box_volume
from .redistribute.cross_mesh import _intersect as _cut  # box ∩ window, or None

__all__ = ["split_plan"]


def _busiest(plan: CrossMeshPlan, window) -> int:
    """The most bytes any rank sends or receives of ``window``."""
    sent: dict = {}
    recv: dict = {}
    for (a, b), boxes in plan.pairs.items():
        n = 0
        for box in boxes:
            cut = _cut(box, window)
            if cut is not None:
                n += box_volume(cut)
        if n:
            sent[a] = sent.get(a, 0) + n
            recv[b] = recv.get(b, 0) + n
    return max([*sent.values(), *recv.values(), 0]) * plan.itemsize


def _windows(plan: CrossMeshPlan, window: tuple, dim: int, bucket_bytes: int) -> list:
    """Windows tiling ``window`` (whole along dims after ``dim``) in row-major order, each
    fitting the bucket -- except a single element that is larger than it."""
    start, stop = window[dim]
    out = []
    lo = start
    while lo < stop:
        # the largest hi whose window [lo, hi) fits (traffic grows with hi: binary search)
        fits, bad = lo, stop + 1
        while bad - fits > 1:
            mid = (fits + bad) // 2
            trial = window[:dim] + ((lo, mid),) + window[dim + 1:]
            if _busiest(plan, trial) <= bucket_bytes:
                fits = mid
            else:
                bad = mid
        if fits > lo:
            out.append(window[:dim] + ((lo, fits),) + window[dim + 1:])
            lo = fits
            continue
        row = window[:dim] + ((lo, lo + 1),) + window[dim + 1:]
        if dim + 1 < len(window):  # one row is too big: cut it along the next dim
            out += _windows(plan, row, dim + 1, bucket_bytes)
        else:  # one element is larger than the bucket: it travels alone
            out.append(row)
        lo += 1
    return out


def _restricted(plan: CrossMeshPlan, window) -> CrossMeshPlan:
    def cut(table):
        out = {}
        for key, boxes in table.items():
            kept = [c for c in (_cut(b, window) for b in boxes) if c is not None]
            if kept:
                out[key] = kept
        return out
    return CrossMeshPlan(cut(plan.pairs), cut(plan.local), plan.itemsize)


def split_plan(plan: CrossMeshPlan, shape, bucket_bytes: int) -> list:
    """``plan`` itself in a list where its busiest rank's traffic fits ``bucket_bytes`` (or the
    tensor is 0-d); else the plans of windows tiling the source's index space (``shape``), in
    row-major order, each fitting the bucket (see the module's docstring), windows moving
    nothing left out."""
    shape = tuple(shape)
    whole = tuple((0, n) for n in shape)
    if not shape or _busiest(plan, whole) <= bucket_bytes:
        return [plan]
    pieces = (_restricted(plan, w) for w in _windows(plan, whole, 0, bucket_bytes))
    return [p for p in pieces if p.pairs or p.local]
