"""The dry run of a pipeline-parallel step: micro-batches in flight, sends and receives, bubble.

When ``setup(mesh)`` also returns its pipeline schedule (``(model, optimizer, step, schedule)``,
``model`` holding this rank's stage modules), the dry run runs that schedule's real ``step`` on
the meta mesh: each stage is a :class:`~dtensor_lite.pipelining.PipelineStage` that, on a meta
mesh, takes the shapes it would receive from its ``input_args`` (and, for gradients, from its own
outputs) instead of from its neighbours. So fsdp's once-per-step gathers, the pp sends and the
schedule's order are the real ones, and the meter sees them all. From that run:

* ``activations_per_microbatch``: per local stage, the bytes one micro-batch's forward leaves
  alive (what autograd keeps for its backward, and its outputs), the least over the step's
  micro-batches (the first also gathers fsdp's parameters, which stay);
* per schedule (every one with this run's stages per rank): the most micro-batches a rank holds
  at once and their activation bytes -- the rank's order walked with ``F`` adding its stage's
  bytes and ``B`` (or ``W``, which frees the rest after ``I``) taking them away: GPipe holds all
  m, 1F1B ``p - r`` on pp rank ``r``, the interleaved ones Megatron's warm-up;
* the bytes of each send and receive per micro-batch (the local pieces of what crosses a stage
  boundary), and the schedule's analytical bubble (its order played in unit time);
* ``peak_bytes`` (on the report): the step's most bytes alive at once above its start, which is
  what ``MemoryTracker`` measures on a real run (tested within 10%).
"""
from __future__ import annotations

import math

from ..dtensor import DTensor

__all__ = ["watch_stages", "pipeline_section", "in_flight_peak"]


def watch_stages(schedule, mode) -> dict:
    """Wrap each local stage's ``forward_one`` to note the bytes one micro-batch's forward
    leaves alive (storages it created, the meter's ``_StepMode`` knows them), other than the
    stage's parameters (fsdp's gathered ones); returns ``{stage index: [bytes, ...]}``."""
    added: dict[int, list[int]] = {}
    for stage in schedule._stages:
        forward = stage.forward_one

        def counted(mb, args, kwargs, has_backward, _forward=forward, _stage=stage):
            mark = mode.created_order
            result = _forward(mb, args, kwargs, has_backward)
            params = {_local(p).untyped_storage()._cdata for p in _stage.submod.parameters()}
            added.setdefault(_stage.stage_index, []).append(
                mode.bytes_created_since(mark, params))
            return result
        stage.forward_one = counted
    return added


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def in_flight_peak(order, stage_bytes: dict[int, int]) -> tuple[int, int]:
    """``(most micro-batches held at once, most activation bytes held at once)`` on a rank that
    runs ``order`` (a list of ``Action``): ``F`` takes its stage's bytes, ``B`` / ``W`` frees."""
    held = count = peak_bytes = peak_count = 0
    for a in order:
        if a.kind == "F":
            held += stage_bytes.get(a.stage, 0)
            count += 1
        elif a.kind in ("B", "W"):
            held -= stage_bytes.get(a.stage, 0)
            count -= 1
        peak_bytes, peak_count = max(peak_bytes, held), max(peak_count, count)
    return peak_count, peak_bytes


def _piece_bytes(metas) -> int:
    return sum(math.prod(m.shape) * m.dtype.itemsize for m in metas or () if m is not None)


def pipeline_section(schedule, added: dict[int, list[int]]) -> dict:
    """The report's ``pipeline`` entry (see the module docstring)."""
    from ..pipelining._orders import simulate
    from ..pipelining.schedules import schedules_with

    p, v, m, rank = schedule._p, schedule._v, schedule._n_microbatches, schedule._rank
    per_mb = {s: min(b) for s, b in added.items() if b}
    sends, recvs = {}, {}
    for st in schedule._stages:
        # what this stage sends and receives per micro-batch, when its neighbour is elsewhere
        if not st.is_last and st.rank_of(st.stage_index + 1) != st.group_rank:
            sends[f"activation {st.stage_index}->{st.stage_index + 1}"] = _piece_bytes(
                st.out_meta)
            recvs[f"gradient {st.stage_index + 1}->{st.stage_index}"] = _piece_bytes(
                st.grad_in_meta)
        if not st.is_first and st.rank_of(st.stage_index - 1) != st.group_rank:
            recvs[f"activation {st.stage_index - 1}->{st.stage_index}"] = _piece_bytes(
                st.in_meta)
            sends[f"gradient {st.stage_index}->{st.stage_index - 1}"] = _piece_bytes(
                st.grad_out_meta)
    rows = []
    for cls in schedules_with(v):
        if cls._shape != schedule._shape:
            continue   # another placement: other stages on this rank
        if cls._needs_full_pipe and m < p:
            continue   # the 1F1B family needs a micro-batch per pp rank
        orders = cls.orders(p, v, m)
        played = simulate(orders, p * v)
        count, held = in_flight_peak(orders[rank], per_mb)
        rows.append({"schedule": cls.__name__, "microbatches_in_flight": count,
                     "activation_bytes_in_flight": held, "bubble": played["bubble"],
                     "idle_this_rank": played["idle"][rank]})
    played = schedule.analytical_bubble()
    return {"schedule": type(schedule).__name__, "pp": p, "stages_per_rank": v,
            "n_microbatches": m, "pp_rank": rank,
            "local_stages": [s.stage_index for s in schedule._stages],
            "activations_per_microbatch": per_mb, "send_bytes": sends, "recv_bytes": recvs,
            "comm_counts": schedule.comm_counts(), "bubble": played["bubble"],
            "idle_this_rank": played["idle"][rank], "schedules": rows}
