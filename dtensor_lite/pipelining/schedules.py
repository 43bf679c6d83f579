"""The schedules (torch's names and signatures) and the one loop that runs any of them.

Each schedule is a list of actions per pp rank (``_orders``); ``step`` splits the batch into
micro-batches, runs this rank's list -- receiving what an action needs right before it, sending
what it produced without waiting -- then waits for its sends, and divides the gradients by the
number of micro-batches (``scale_grads``, as one process averaging over the whole batch would).

Sends and receives go through ``collectives.send`` / ``recv`` (counted by ``CommDebugMode`` as
``send`` / ``recv``, plus ``pp_meta`` for the shapes agreed at the first step), and the step
runs under ``propagate_failures``: a stage that raises posts its error, and every rank waiting
for it stops with that error instead of hanging.
"""
from __future__ import annotations

import time
import zlib
from typing import Callable

import torch

from .. import collectives
from .._failures import propagate_failures
from . import _orders
from ._orders import Action
from ._transfer import ACTIVATION, GRADIENT
from .microbatch import merge_chunks, split_args_kwargs_into_chunks
from .stage import PipelineStage

__all__ = ["PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe", "Schedule1F1B",
           "ScheduleLoopedBFS", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
           "ScheduleZBVZeroBubble", "get_schedule_class", "schedules_with"]


class _PipelineSchedule:
    _one_stage_per_rank = False   # GPipe, 1F1B
    _needs_full_pipe = False      # the 1F1B family: at least one micro-batch per pp rank
    _split_backward = False       # zero bubble: backward as I then W
    _shape = "loop"               # which rank holds which stage (_orders.local_stages)

    def __init__(self, stages: list[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None = None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None, scale_grads: bool = True):
        name = type(self).__name__
        if not (isinstance(n_microbatches, int) and n_microbatches >= 1):
            raise ValueError(f"{name}: n_microbatches must be a positive int, got "
                             f"{n_microbatches!r}")
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"{name}: stages must be PipelineStage objects, got {stages!r}")
        first = stages[0]
        p, num_stages = first.group_size, first.num_stages
        for s in stages:
            if s.num_stages != num_stages or s.pp_mesh != first.pp_mesh:
                raise ValueError(f"{name}: all stages of a rank must share num_stages and the pp "
                                 f"group; {s} and {first} differ")
        v = num_stages // p
        if self._one_stage_per_rank and v != 1:
            raise ValueError(f"{name} runs one stage per pp rank, but {num_stages} stages over "
                             f"{p} pp ranks make {v} per rank; use ScheduleInterleaved1F1B, "
                             "ScheduleLoopedBFS, ScheduleInterleavedZeroBubble or "
                             "ScheduleZBVZeroBubble")
        if self._shape == "v" and v != 2:
            raise ValueError(f"{name} runs two stages per pp rank (V shape), but {num_stages} "
                             f"stages over {p} pp ranks make {v} per rank; use {2 * p} stages")
        mine = sorted(s.stage_index for s in stages)
        expected = sorted(_orders.local_stages(first.group_rank, p, v, self._shape))
        if mine != expected:
            where = (f"V shape: stages r and {2 * p - 1} - r on rank r" if self._shape == "v"
                     else f"stage s on rank s % {p}")
            raise ValueError(f"{name}: pp rank {first.group_rank} must hold stages {expected} "
                             f"({where}), got {mine}")
        for s in stages:
            s.shape = self._shape
        if self._needs_full_pipe and n_microbatches < p:
            raise ValueError(f"{name}: {n_microbatches} micro-batches are fewer than the {p} pp "
                             f"ranks; this schedule needs n_microbatches >= {p} (or use "
                             "ScheduleGPipe / ScheduleLoopedBFS)")
        self._stages = sorted(stages, key=lambda s: s.stage_index)
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._args_chunk_spec = args_chunk_spec
        self._kwargs_chunk_spec = kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        self._num_stages, self._p, self._v = num_stages, p, v
        self._pp_mesh = first.pp_mesh
        self._rank = first.group_rank
        orders = self.orders(p, v, n_microbatches)
        self.pipeline_order: dict[int, list[Action]] = dict(enumerate(orders))
        self._order = orders[self._rank]
        # the last action of each local stage that produces parameter gradients
        self._last_grad_action = {}
        for a in self._order:
            if a.kind in ("B", "W"):
                self._last_grad_action[a.stage] = a
        self._agreed = False
        self.last_step_timing: dict | None = None

    @classmethod
    def orders(cls, p: int, v: int, m: int) -> list[list[Action]]:
        """Every pp rank's actions for ``p`` ranks, ``v`` stages per rank, ``m`` micro-batches
        (what ``pipeline_order`` holds; the dry run plays it for each schedule)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ beyond torch
    @classmethod
    def stages_of(cls, pp_rank: int, pp_size: int, stages_per_rank: int = 1) -> list[int]:
        """The stage indices pp rank ``pp_rank`` must build for this schedule: looped
        (``r, r + p, ...``), or ``[r, 2p - 1 - r]`` for ``ScheduleZBVZeroBubble``."""
        return _orders.local_stages(pp_rank, pp_size, stages_per_rank, cls._shape)

    def comm_counts(self) -> dict[str, int]:
        """Messages this rank sends and receives per step, per tensor crossing a boundary."""
        return _orders.comm_counts(list(self.pipeline_order.values()), self._rank,
                                   self._num_stages, self._shape)

    def replayed_bubble(self, costs: dict) -> dict:
        """The schedule played with measured costs (``{Action: seconds}`` of every rank: the
        union of each rank's ``last_step_timing["actions"]``) and free communication -- the
        bubble the order leaves with the real compute, whatever the machine's load."""
        return _orders.simulate(list(self.pipeline_order.values()), self._num_stages, costs)

    def analytical_bubble(self) -> dict:
        """The schedule played in unit time (F = 1, B = 2, I = W = 1, free communication):
        ``{"idle": [fraction per pp rank], "bubble": mean, "makespan": ...}``."""
        return _orders.simulate(list(self.pipeline_order.values()), self._num_stages)

    # ------------------------------------------------------------------ running
    def step(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             **kwargs):
        """One training step on the whole batch ``args`` / ``kwargs`` (read on the first stage;
        ``target`` on the last), split into ``n_microbatches``. Fills ``losses`` (last stage)
        with each micro-batch's loss; returns the merged output on the last stage, else None."""
        with propagate_failures():
            return self._step(args, kwargs, target, losses, return_outputs,
                              has_backward=self._loss_fn is not None, is_step=True)

    def eval(self, *args, target=None, losses: list | None = None, **kwargs):
        """Forward only (losses still computed when a loss_fn and a target are given)."""
        with propagate_failures():
            return self._step(args, kwargs, target, losses, True, has_backward=False,
                              is_step=False)

    def _agree(self, is_step: bool):
        """Once: every pp rank built the same pipeline (checked on every rank alike)."""
        holds_last = any(s.is_last for s in self._stages)
        code = zlib.crc32(type(self).__name__.encode()) & 0x7FFFFFFF
        row = torch.tensor([[self._n_microbatches, self._num_stages, code,
                             int(self._loss_fn is not None), int(holds_last), int(is_step)]],
                           dtype=torch.int64, device=self._stages[0].device)
        rows = collectives.all_gather(row, self._pp_mesh, 0).tolist()
        what = ("n_microbatches", "num_stages", "schedule class")
        for i, name in enumerate(what):
            if len({r[i] for r in rows}) > 1:
                raise ValueError(f"pipelining: the pp ranks built different pipelines: "
                                 f"{name} per pp rank {[r[i] for r in rows]}")
        last = next(r for r in rows if r[4])
        if len({r[3] for r in rows}) > 1:
            if not last[3]:
                raise ValueError("pipelining: the rank holding the last stage has no loss_fn "
                                 "while other ranks have one; pass loss_fn to the schedule on "
                                 "every rank (it is called on the last stage)")
            raise ValueError("pipelining: loss_fn is given on some pp ranks only; pass the same "
                             "loss_fn everywhere (None everywhere runs forward only)")
        if len({r[5] for r in rows}) > 1:
            raise ValueError("pipelining: some pp ranks called step() and others eval()")
        self._agreed = True

    def _step(self, args, kwargs, target, losses, return_outputs, has_backward, is_step):
        if not self._agreed and not self._stages[0].dry:   # a dry run has no data to agree on
            self._agree(is_step)
        m = self._n_microbatches
        first = self._stages[0].is_first
        last_stage = self._stages[-1] if self._stages[-1].is_last else None
        arg_mbs = kwarg_mbs = None
        if first:
            arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(
                args, kwargs, m, self._args_chunk_spec, self._kwargs_chunk_spec)
            _check_count(len(arg_mbs), m, "the inputs")
        target_mbs = None
        if last_stage is not None and self._loss_fn is not None:
            if target is None and has_backward:
                raise ValueError(f"{type(self).__name__}.step: the last stage needs target= to "
                                 "compute the loss")
            if target is not None:
                target_mbs, _ = split_args_kwargs_into_chunks((target,), None, m)
                _check_count(len(target_mbs), m, "target")
                target_mbs = [t[0] for t in target_mbs]
        for s in self._stages:
            s.begin_step(has_backward)
        by_index = {s.stage_index: s for s in self._stages}
        mailbox: dict = {}
        pending: list = []
        outputs: dict[int, object] = {}
        mb_losses: dict[int, torch.Tensor] = {}
        busy = waited = 0.0   # in this rank's compute; blocked in receives and the last sends
        cpu: dict[Action, float] = {}   # each action's compute in this thread's CPU seconds
        start = time.perf_counter()
        for a in self._order:
            if not has_backward and a.kind != "F":
                continue
            # sends that arrived release their buffers now (1F1B frees a micro-batch's
            # activations after its backward: a send still held would keep them to the end)
            pending = _drop_arrived(pending)
            st = by_index[a.stage]
            t0 = time.perf_counter()
            if a.kind == "F":
                if st.is_first:
                    mb_args, mb_kwargs = arg_mbs[a.mb], kwarg_mbs[a.mb]
                else:
                    mb_args, mb_kwargs = tuple(st._recv(ACTIVATION, a.stage - 1, a.mb, mailbox)), {}
                    waited += time.perf_counter() - t0
                t0, c0 = time.perf_counter(), time.thread_time()
                output, outs = st.forward_one(a.mb, mb_args, mb_kwargs, has_backward)
                if st.is_last:
                    outputs[a.mb] = output.detach() if isinstance(output, torch.Tensor) else output
                    if target_mbs is not None:
                        with torch.set_grad_enabled(has_backward):
                            loss = self._loss_fn(output, target_mbs[a.mb])
                        mb_losses[a.mb] = loss.detach()
                        if has_backward:
                            st.keep_loss(a.mb, loss)
                busy += time.perf_counter() - t0
                cpu[a] = time.thread_time() - c0
                if not st.is_last:
                    pending += st._send(ACTIVATION, list(outs), a.stage + 1, a.mb, mailbox)
                continue
            if a == self._last_grad_action.get(a.stage):
                st.before_last_backward()
            if a.kind == "W":
                c0 = time.thread_time()
                st.backward_weight_one(a.mb)
                busy += time.perf_counter() - t0
                cpu[a] = time.thread_time() - c0
                continue
            grads = None if st.is_last else st._recv(GRADIENT, a.stage + 1, a.mb, mailbox)
            waited += time.perf_counter() - t0
            t0, c0 = time.perf_counter(), time.thread_time()
            in_grads = st.backward_one(a.mb, grads, split=a.kind == "I")
            busy += time.perf_counter() - t0
            cpu[a] = time.thread_time() - c0
            if not st.is_first:
                pending += st._send(GRADIENT, in_grads, a.stage - 1, a.mb, mailbox)
        t0 = time.perf_counter()
        for work in pending:
            work.wait()
        waited += time.perf_counter() - t0
        if has_backward and self.scale_grads:
            for s in self._stages:
                s.scale_grads(m)
        total = time.perf_counter() - start
        # compute time of this rank's actions vs the step's wall time (measured bubble)
        # "idle": everything but compute (waits, sends, Python); "waiting": only the time
        # blocked for a neighbour -- the bubble itself, by this rank's own clock
        # "actions": each action's CPU seconds, to replay the order with measured costs
        # (replayed_bubble), which descheduling on a loaded machine does not inflate
        self.last_step_timing = {"busy_s": busy, "wait_s": waited, "step_s": total,
                                 "idle": 1 - busy / total if total > 0 else 0.0,
                                 "waiting": waited / total if total > 0 else 0.0,
                                 "actions": cpu}
        if last_stage is None:
            return None
        if losses is not None and mb_losses:
            losses.extend(mb_losses[i] for i in range(m))
        if not return_outputs:
            return None
        return merge_chunks([outputs[i] for i in range(m)], self._output_merge_spec)


def _check_count(got: int, m: int, what: str) -> None:
    """torch's split gives fewer micro-batches than asked when a tensor has fewer rows."""
    if got != m:
        raise ValueError(f"pipelining: {what} split into only {got} micro-batches: a tensor has "
                         f"{got} rows along its chunk dim, fewer than the {m} micro-batches; "
                         "pass a larger batch or fewer n_microbatches")


def _drop_arrived(pending: list) -> list:
    """The sends still in flight; the others are finished (waited: at once) and let go."""
    still = []
    for work in pending:
        if work.is_completed():
            work.wait()
        else:
            still.append(work)
    return still


class PipelineScheduleSingle(_PipelineSchedule):
    """A schedule of one stage per pp rank: ``Schedule(stage, n_microbatches, loss_fn)``."""
    _one_stage_per_rank = True

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None,
                 scale_grads: bool = True):
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"{type(self).__name__} takes one PipelineStage, got "
                            f"{type(stage).__name__} (multi-stage schedules take a list)")
        super().__init__([stage], n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                         output_merge_spec, scale_grads)
        self._stage = stage


class PipelineScheduleMulti(_PipelineSchedule):
    """A schedule of several stages per pp rank: ``Schedule(stages, n_microbatches, loss_fn)``."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None = None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None, scale_grads: bool = True, **ignored):
        if isinstance(stages, PipelineStage):
            stages = [stages]
        super().__init__(list(stages), n_microbatches, loss_fn, args_chunk_spec,
                         kwargs_chunk_spec, output_merge_spec, scale_grads)


class ScheduleGPipe(PipelineScheduleSingle):
    """All micro-batches' forwards, then all backwards. Bubble (p-1)/(m+p-1); holds the
    activations of all m micro-batches."""

    @classmethod
    def orders(cls, p, v, m):
        return _orders.gpipe(p, v, m)


class Schedule1F1B(PipelineScheduleSingle):
    """One forward, one backward: GPipe's bubble with at most p micro-batches in flight."""
    _needs_full_pipe = True

    @classmethod
    def orders(cls, p, v, m):
        return _orders.greedy(p, v, m, split_backward=False)


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Several stages per rank, breadth first: every micro-batch through one local stage, then
    the next."""

    @classmethod
    def orders(cls, p, v, m):
        return _orders.looped_bfs(p, v, m)


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """1F1B over v local stages per rank (Megatron's interleaving): bubble about
    (p-1)/(v*m+p-1)."""
    _needs_full_pipe = True

    @classmethod
    def orders(cls, p, v, m):
        return _orders.greedy(p, v, m, split_backward=False)


class ScheduleInterleavedZeroBubble(PipelineScheduleMulti):
    """Interleaved 1F1B with each backward split into its input half (sent upstream at once)
    and its weight half (run where the pipeline would idle)."""
    _needs_full_pipe = True
    _split_backward = True

    @classmethod
    def orders(cls, p, v, m):
        return _orders.greedy(p, v, m, split_backward=True)


class ScheduleZBVZeroBubble(PipelineScheduleMulti):
    """Zero bubble on a V: two stages per pp rank, ``r`` and ``2p - 1 - r`` (the micro-batch
    goes down the ranks and back up; the last stage and the loss sit on rank 0, and rank
    ``p - 1`` passes stage ``p - 1``'s output to stage ``p`` locally), each backward split
    into ``I`` and ``W`` as in interleaved zero bubble. Holds up to ``2p`` half-stage
    activations per rank (1F1B's memory on rank 0, and the same on every rank)."""
    _needs_full_pipe = True
    _split_backward = True
    _shape = "v"

    @classmethod
    def orders(cls, p, v, m):
        if v != 2:
            raise ValueError(f"ScheduleZBVZeroBubble runs 2 stages per pp rank, not {v}")
        return _orders.greedy(p, v, m, split_backward=True, shape="v")


_BY_NAME = {c.__name__.lower().removeprefix("schedule"): c for c in
            (ScheduleGPipe, Schedule1F1B, ScheduleLoopedBFS, ScheduleInterleaved1F1B,
             ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)}


def schedules_with(stages_per_rank: int) -> list[type]:
    """The schedule classes that run ``stages_per_rank`` stages per pp rank."""
    return [c for c in _BY_NAME.values()
            if (stages_per_rank == 1) == issubclass(c, PipelineScheduleSingle)]


def get_schedule_class(schedule_name: str):
    """The schedule class of a name, case-insensitive (``"1F1B"``, ``"GPipe"``,
    ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``)."""
    cls = _BY_NAME.get(schedule_name.lower().removeprefix("schedule"))
    if cls is None:
        raise ValueError(f"unknown pipeline schedule '{schedule_name}'; known: "
                         f"{sorted(c.__name__ for c in _BY_NAME.values())}")
    return cls
