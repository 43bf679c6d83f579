"""A tensor whose traffic passes the relayout's bucket, split into windows that each fit one.

A cross-mesh plan (``redistribute.cross_mesh.CrossMeshPlan``) is metadata: per (source rank,
destination rank) the boxes (global index ranges) one sends the other, per rank the boxes it
copies itself. Window k of n takes the k-th of n near-equal parts of *every* box -- its rows
(along dim 0; a box with fewer rows than parts gives each row several parts, cut along the next
dim the same way). So the windows tile every box: together they move every element exactly
once (the bytes stay the minimum), each is written in place like any move (its boxes index the
same pieces), and every rank pair that exchanges anything exchanges about 1/n of it in every
window: all pairs stay busy in every bucket. (Cutting the tensor into row ranges instead would
give each window to the few pairs that hold those rows, and the buckets of one tensor would run
one pair after another.) n starts at the busiest rank's traffic over the bucket and grows until
every window fits, so no bucket holds more than ``bucket_bytes`` per rank unless one element is
larger than it.

Example::

    >>> pieces = split_plan(plan, bucket_bytes=1 << 20)
    >>> sum(p.bytes_sent().get(0, 0) for p in pieces) == plan.bytes_sent().get(0, 0)
    True
"""
from __future__ import annotations

from .redistribute.cross_mesh import CrossMeshPlan, box_volume

__all__ = ["split_plan"]


def _parts(box: tuple, n: int) -> list:
    """``box`` cut into n parts (a box or None each), in row-major order, near-equal: by rows
    along dim 0 where it has at least n rows, else each row into its share of the parts along
    the next dim."""
    if n == 1:
        return [box]
    if not box:  # a 0-d tensor's one element
        return [box] + [None] * (n - 1)
    (start, stop), rest = box[0], box[1:]
    rows = stop - start
    if rows >= n:
        return [((start + rows * k // n, start + rows * (k + 1) // n),) + rest
                for k in range(n)]
    out = []
    for i in range(rows):
        share = n * (i + 1) // rows - n * i // rows
        row = (start + i, start + i + 1)
        out += [None if p is None else (row,) + p for p in _parts(rest, share)] if rest \
            else [(row,)] + [None] * (share - 1)
    return out


def _windows(plan: CrossMeshPlan, n: int) -> list:
    def cut(table):
        out = [{} for _ in range(n)]
        for key, boxes in table.items():
            for box in boxes:
                for k, part in enumerate(_parts(box, n)):
                    if part is not None:
                        out[k].setdefault(key, []).append(part)
        return out
    return [CrossMeshPlan(p, loc, plan.itemsize)
            for p, loc in zip(cut(plan.pairs), cut(plan.local))]


def _busiest(plan: CrossMeshPlan) -> int:
    """The most bytes any rank sends or receives in ``plan``."""
    sent: dict = {}
    recv: dict = {}
    for (a, b), n in plan.pair_bytes().items():
        sent[a] = sent.get(a, 0) + n
        recv[b] = recv.get(b, 0) + n
    return max([*sent.values(), *recv.values(), 0])


def split_plan(plan: CrossMeshPlan, bucket_bytes: int) -> list:
    """``[plan]`` where its busiest rank's traffic fits ``bucket_bytes``; else the plans of the
    fewest windows (see the module's docstring) that each fit it, windows moving nothing left
    out."""
    busiest = _busiest(plan)
    if busiest <= bucket_bytes:
        return [plan]
    largest = max((box_volume(b) for boxes in plan.pairs.values() for b in boxes), default=1)
    n = -(-busiest // bucket_bytes)
    while True:
        windows = _windows(plan, n)
        if all(_busiest(w) <= bucket_bytes for w in windows):
            return [w for w in windows if w.pairs or w.local]
        if n >= largest:  # every part is one element: a rank's several boxes still pass a
            return [one for w in windows for one in _one_box_each(w)]  # tiny bucket
        n = min(largest, n + max(1, n // 8))


def _one_box_each(plan: CrossMeshPlan) -> list:
    """``plan`` as one window per box it sends (its local copies with the first): each fits a
    bucket that holds the largest box."""
    out = [CrossMeshPlan({key: [box]}, {}, plan.itemsize)
           for key, boxes in plan.pairs.items() for box in boxes]
    if plan.local:
        out = [CrossMeshPlan(out[0].pairs if out else {}, plan.local, plan.itemsize)] + out[1:]
    return out
