"""The redistribute step kinds: one table that the planner, the executor and the dispatcher's
cost estimate all read.

A step changes the placement of one mesh dim. Which kind of step turns placement ``p`` into ``q``
is decided here once (``step_kind``); how many bytes it sends is ``StepKind.estimate`` (a rough
figure from the local size, for choosing among op strategies) or the planner's exact count;
how it runs is the executor's function for that kind.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

__all__ = ["StepKind", "STEP_KINDS", "step_kind", "estimate_bytes", "estimate_cost",
           "COLLECTIVE_LATENCY_BYTES"]

# What one more collective costs beyond its bytes, counted in bytes (an alpha-beta model with
# alpha / beta in bytes): about one collective's start-up latency times a link's bandwidth --
# ~10 us at ~6 GB/s is 64 KiB, the low end (NVLink and loopback gloo are higher). The planner
# adds it per collective step, so a plan of two collectives must save more than this many bytes
# over a plan of one: padding an uneven dim (a (2, 8) Partial -> Shard(0) on 4 ranks sent 96 B
# in one reduce-scatter, or 72 B in a reduce-scatter on dim 1 plus an all-to-all) no longer buys
# a second collective for small tensors, while large ones still take the byte-cheaper path.
COLLECTIVE_LATENCY_BYTES = 64 * 1024


class StepKind(NamedTuple):
    name: str
    collective: bool   # moves data between ranks (counted by CommDebugMode)
    reduces: bool      # adds values of several ranks (not bit-exact across reduction orders)
    estimate: Callable[[float, int], float]  # rough bytes sent per rank: f(local bytes, n)


STEP_KINDS = {k.name: k for k in (
    StepKind("all_gather", True, False, lambda local, n: (n - 1) * local),          # S -> R
    StepKind("all_to_all", True, False, lambda local, n: (n - 1) / n * local),      # S -> S
    StepKind("all_reduce", True, True, lambda local, n: 2 * (n - 1) / n * local),   # P -> R
    StepKind("reduce_scatter", True, True, lambda local, n: (n - 1) / n * local),   # P -> S
    StepKind("chunk", False, False, lambda local, n: 0.0),           # R -> S: a local slice
    StepKind("to_partial", False, False, lambda local, n: 0.0),      # R -> P: zeros off coord 0
    StepKind("pad_to_partial", False, False, lambda local, n: 0.0),  # S -> P: identity padding
    StepKind("rescale", False, False, lambda local, n: 0.0),         # P(sum) <-> P(avg)
)}


def step_kind(p, q) -> str | None:
    """The step that turns placement ``p`` into ``q`` on one mesh dim, or None where no single
    step does (Partial(max) -> Partial(sum) must pass through Replicate)."""
    if p.is_shard():
        return "all_gather" if q.is_replicate() else "all_to_all" if q.is_shard() else "pad_to_partial"
    if p.is_replicate():
        return "chunk" if q.is_shard() else "to_partial"
    if q.is_replicate():
        return "all_reduce"
    if q.is_shard():
        return "reduce_scatter"
    if p != q and p.is_linear and q.is_linear:
        return "rescale"
    return None


def estimate_bytes(p, q, local_bytes: float, n: int) -> float:
    """Rough bytes one rank sends to move a piece of ``local_bytes`` from ``p`` to ``q`` on a
    mesh dim of size ``n``; two steps (all-reduce, then a free one) where no single step does."""
    if p == q:
        return 0.0
    kind = step_kind(p, q)
    return STEP_KINDS[kind or "all_reduce"].estimate(local_bytes, n)


def estimate_cost(p, q, local_bytes: float, n: int) -> float:
    """:func:`estimate_bytes` plus ``COLLECTIVE_LATENCY_BYTES`` per collective: the planner's
    cost for one mesh dim's move, so that an op's strategy choice weighs two small collectives
    against one (a Partial x Partial product reduces one factor, not both)."""
    if p == q:
        return 0.0
    kind = step_kind(p, q)
    collective = STEP_KINDS[kind].collective if kind else True
    return estimate_bytes(p, q, local_bytes, n) + COLLECTIVE_LATENCY_BYTES * collective
