"""What each rank runs, in which order: the schedules as lists of actions, and a simulator.

An action is ``F`` (forward of one micro-batch on one stage), ``B`` (its whole backward), or,
for zero-bubble schedules, ``I`` (the backward to the stage's *inputs* only: what the previous
stage waits for) and ``W`` (the rest: the weights' gradients, which nobody waits for and so can
fill the pipeline's idle time). Stage ``s`` lives on pp rank ``s % p`` ("looped" placement: with
``v`` stages per rank, rank ``r`` holds ``r, r + p, ..., r + (v-1) p``).

GPipe and looped BFS are written out directly. 1F1B, interleaved 1F1B and interleaved zero bubble
are produced by one greedy list scheduler that plays the pipeline in unit time (F = I = W = 1,
B = 2) and lets each idle rank pick its next action by the schedule's rule:

* 1F1B / interleaved 1F1B: forwards while fewer than ``limit`` await their backward (``p - r``
  for 1F1B, Megatron's warm-up plus one when interleaved: this is what bounds activation
  memory), then one forward, one backward: after a forward a ready backward goes first, after a
  backward a ready forward (either, when the other is not ready).
* zero bubble: a ready ``I`` first; else a forward under the same limit; else a pending ``W``.
  So the ``W`` passes run where 1F1B would sit idle (ZB-H1 of Qi et al., 2023).

Playing the schedule is also the proof that the order cannot deadlock: every action starts, in
the played timeline, after the actions it waits for, so running each rank's list in order with
non-blocking sends and blocking receives always finds the next message sent. The same play gives
the analytical bubble (idle fraction) that the example prints beside the measured one.
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["Action", "gpipe", "looped_bfs", "greedy", "simulate", "comm_counts", "local_stages",
           "stage_rank"]

COST = {"F": 1, "B": 2, "I": 1, "W": 1}


class Action(NamedTuple):
    kind: str   # "F", "B", "I" or "W"
    stage: int
    mb: int

    def __repr__(self):
        return f"{self.kind}{self.stage}.{self.mb}"


def local_stages(rank: int, p: int, v: int, shape: str = "loop") -> list[int]:
    """The stages pp rank ``rank`` holds: looped (``r, r + p, ...``) or, with ``shape="v"``
    (two per rank), V-shaped: ``r`` and ``2p - 1 - r``, so the last stage sits on rank 0 and
    the pipeline turns on rank ``p - 1``, which holds two neighbouring stages."""
    if shape == "v":
        return [rank, 2 * p - 1 - rank]
    return [rank + k * p for k in range(v)]


def stage_rank(stage: int, p: int, shape: str = "loop") -> int:
    """The pp rank that holds ``stage`` (see ``local_stages``)."""
    if shape == "v":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def gpipe(p: int, v: int, m: int) -> list[list[Action]]:
    """All forwards, then all backwards (one stage per rank)."""
    return [[Action("F", s, i) for s in local_stages(r, p, v) for i in range(m)]
            + [Action("B", s, i) for s in reversed(local_stages(r, p, v)) for i in range(m)]
            for r in range(p)]


def looped_bfs(p: int, v: int, m: int) -> list[list[Action]]:
    """Each local stage's forwards for every micro-batch, stage by stage; backwards in reverse."""
    return gpipe(p, v, m)  # the same breadth-first order, over several local stages


def _deps(a: Action, num_stages: int) -> list[Action]:
    """The actions ``a`` waits for (on this or another rank)."""
    if a.kind == "F":
        return [Action("F", a.stage - 1, a.mb)] if a.stage else []
    if a.kind == "W":
        return [Action("I", a.stage, a.mb)]
    back = "I" if a.kind == "I" else "B"
    after = [Action(back, a.stage + 1, a.mb)] if a.stage + 1 < num_stages else []
    return [Action("F", a.stage, a.mb)] + after


def interleaved_limit(rank: int, p: int, v: int, m: int) -> int:
    """Forwards a rank may have in flight (Megatron's warm-up count, plus the steady state's)."""
    warmup = (p - 1 - rank) if v == 1 else (p - 1 - rank) * 2 + (v - 1) * p
    return min(warmup + 1, v * m)


def v_limit(rank: int, p: int, m: int) -> int:
    """V-shape: forwards (of either local stage, each half a rank's layers) a rank may hold
    before their ``W``: ``2p`` on every rank, the activations of ``p`` micro-batches through all
    its layers -- 1F1B's memory on rank 0. Fewer starve the pipeline (played: at p = 4, m = 8,
    ``2 (p - r) + 2`` gives a 13% bubble, ``2p`` 6%, as interleaved zero bubble)."""
    return min(2 * p, 2 * m)


def greedy(p: int, v: int, m: int, split_backward: bool,
           shape: str = "loop") -> list[list[Action]]:
    """The 1F1B-family orders (see the module docstring); ``shape="v"``: V-shaped placement."""
    num_stages = p * v
    back = "I" if split_backward else "B"
    todo = [[Action(k, s, i) for s in local_stages(r, p, v, shape) for i in range(m)
             for k in (("F", "I", "W") if split_backward else ("F", "B"))] for r in range(p)]
    finish: dict[Action, int] = {}
    busy_until = [0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    limit = [v_limit(r, p, m) if shape == "v" else interleaved_limit(r, p, v, m)
             for r in range(p)]
    in_flight = [0] * p   # forwards whose backward has not started
    pending_w = [0] * p
    t = 0
    while any(todo):
        for r in range(p):
            if busy_until[r] > t or not todo[r]:
                continue
            ready = [a for a in todo[r] if all(finish.get(d, t + 1) <= t
                                               for d in _deps(a, num_stages))
                     and _in_mb_order(a, finish)]
            last = orders[r][-1].kind if orders[r] else "B"
            choice = _pick(ready, back, in_flight[r] < limit[r], pending_w[r] > p, last)
            if choice is None:
                continue
            todo[r].remove(choice)
            orders[r].append(choice)
            finish[choice] = t + COST[choice.kind]
            busy_until[r] = finish[choice]
            in_flight[r] += {"F": 1, "B": -1, "I": -1}.get(choice.kind, 0)
            pending_w[r] += {"I": 1, "W": -1}.get(choice.kind, 0)
        t += 1
        if t > 100 * (num_stages + m) * 3:
            raise RuntimeError("pipelining: the greedy scheduler made no progress (a bug)")
    return orders


def _in_mb_order(a: Action, finish) -> bool:
    """Each stage runs each kind of action in micro-batch order."""
    return a.mb == 0 or Action(a.kind, a.stage, a.mb - 1) in finish


def _pick(ready: list[Action], back: str, may_forward: bool, w_overdue: bool, last: str):
    def first(kind, key):
        cands = [a for a in ready if a.kind == kind]
        return min(cands, key=key) if cands else None
    backward = first(back, lambda a: (a.mb, -a.stage))     # oldest micro-batch, later stage
    forward = first("F", lambda a: (a.mb, -a.stage)) if may_forward else None
    weight = first("W", lambda a: (a.mb, -a.stage))
    if weight is not None and w_overdue:
        return weight
    if last == "F" and forward is not None and backward is not None:
        return backward   # steady state: one forward, one backward
    return forward or backward or weight if last != "F" else backward or forward or weight


def simulate(orders: list[list[Action]], num_stages: int, cost: dict | None = None) -> dict:
    """Play ``orders`` (unit costs, or ``cost[action]`` -- e.g. measured seconds -- free
    communication): the makespan, each rank's busy time and idle fraction. Raises
    ``RuntimeError`` if the orders deadlock."""
    took = (lambda a: cost[a]) if cost is not None else (lambda a: COST[a.kind])
    p = len(orders)
    pos = [0] * p
    clock = [0] * p
    finish: dict[Action, int] = {}
    while any(pos[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                deps = _deps(Action("I" if a.kind == "W" else a.kind, a.stage, a.mb)
                             if a.kind != "W" else a, num_stages)
                deps = [_as_run(d, finish) for d in deps]
                if any(d not in finish for d in deps):
                    break
                start = max([clock[r]] + [finish[d] for d in deps])
                finish[a] = clock[r] = start + took(a)
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][pos[r]] for r in range(p) if pos[r] < len(orders[r])}
            raise RuntimeError(f"pipelining: the schedule deadlocks (next actions {stuck})")
    makespan = max(clock) if clock else 0
    busy = [sum(took(a) for a in o) for o in orders]
    idle = [1 - b / makespan if makespan else 0.0 for b in busy]
    return {"makespan": makespan, "busy": busy, "idle": idle,
            "bubble": sum(idle) / p if p else 0.0}


def _as_run(d: Action, finish) -> Action:
    """A dependency on a backward is met by ``B`` or (split backward) ``I``."""
    if d.kind in ("B", "I") and d not in finish:
        other = Action("I" if d.kind == "B" else "B", d.stage, d.mb)
        if other in finish:
            return other
    return d


def comm_counts(orders: list[list[Action]], rank: int, num_stages: int,
                shape: str = "loop") -> dict[str, int]:
    """Messages ``rank`` sends and receives per step (per tensor crossing a stage boundary)."""
    p = len(orders)
    counts = {"send": 0, "recv": 0}
    for a in orders[rank]:
        if a.kind == "F":
            nxt, prv = a.stage + 1, a.stage - 1
        elif a.kind in ("B", "I"):
            nxt, prv = a.stage - 1, a.stage + 1   # gradients flow back
        else:
            continue
        if 0 <= nxt < num_stages and stage_rank(nxt, p, shape) != rank:
            counts["send"] += 1
        if 0 <= prv < num_stages and stage_rank(prv, p, shape) != rank:
            counts["recv"] += 1
    return counts
