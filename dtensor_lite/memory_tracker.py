"""MemoryTracker: what a rank's memory consists of at its peak, per FSDP module and phase.

The totals come from the allocator itself: on CPU the profiler's memory events (every allocation
and free of the CPU allocator: ``torch.profiler`` with ``profile_memory=True``, the figure
benchmarks/memory.py reports), on CUDA ``torch.cuda.memory_stats`` (``allocated_bytes.all``
current and peak). Both count bytes above what was live when tracking began.

Phases and modules come from FSDP's hooks (an observer list that fsdp reads, so dtensor_lite
does not import fsdp) and the optimizer's step hooks: each hook closes one interval and opens the
next, named by that hook's module and phase (the work a hook does itself, e.g. a prefetching
all-gather, falls in the interval it closes). At every hook the tracker notes the storages it can
name: the model's sharded parameters and their gradients, optimizer state, and what FSDP holds
(gathered parameters, unsharded gradients, buffers of collectives in flight). On CPU each
interval's peak is then split exactly: every allocation live at that moment is put in the
category whose storage it is (allocations made inside a collective -- the backend's own
buffers -- are communication buffers), the rest are activations (tensors saved for backward and
temporaries). On CUDA the split uses the named bytes at the hook that opened the interval.

Known limits (CPU): a buffer that gloo frees on a thread the profiler does not follow shows no
free event, and counts until the end. A block allocated before tracking began and freed during it
carries no size in the profiler's events, so the figures do not go down by it (the table says so;
PyTorch's own line about it, and the profiler's start / stop lines, are kept off stderr by
:func:`dtensor_lite.quiet_profiler.memory_profile`).

The category names are those of :mod:`dtensor_lite.memory_categories`.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from .memory_categories import (ACTIVATIONS, CATEGORIES, COMM_BUFFERS, GRADIENTS, LEGEND,
                                OPTIMIZER_STATE, SHARDED_PARAMS, SHORT_NAMES, UNSHARDED_PARAMS)
from ._tables import compact_table
from .quiet_profiler import memory_profile

__all__ = ["MemoryTracker", "FSDP_EVENT_OBSERVERS"]

# profiler scopes of collectives: what is allocated inside them is the backend's buffers
_COLLECTIVE_SCOPES = ("c10d::", "gloo:", "nccl:")

# fsdp.observers.notify calls every entry as fn(event, fsdp_state) after each of its hooks
FSDP_EVENT_OBSERVERS: list[Callable] = []

_PHASE = {"pre_forward": "forward", "post_forward": "forward", "pre_backward": "backward",
          "post_backward": "backward", "end_of_backward": "backward",
          "optimizer": "optimizer", "optimizer_end": "optimizer", "start": "forward"}


class MemoryTracker:
    """Context manager: the peak memory of the tracked code and what it consisted of, per FSDP
    module and per phase (forward, backward, optimizer).

    * ``peak_bytes``: the highest total above what was live at ``__enter__``.
    * ``peak_breakdown``: ``{category: bytes}`` at that peak (sums to ``peak_bytes``).
    * ``by_module_phase()``: ``{(module name, phase): {"peak": bytes, category: bytes, ...}}``;
      an interval belongs to the module whose hook opened it.
    * ``at_start``: ``{category: bytes}`` held when tracking began (params, grads, state).
    * ``table()``: a rich Table of all of it.

    Example::

        >>> with MemoryTracker(model, optimizer) as mem:
        ...     loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()
        >>> print(f"peak {mem.peak_bytes / 2**20:.1f} MiB", mem.peak_breakdown)
        >>> rich.print(mem.table())
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 device: str | torch.device | None = None):
        """Enter between training steps (FSDP's parameters sharded). ``device``: where to count
        (default: the device of the model's first parameter)."""
        self.model = model
        self.optimizer = optimizer
        if device is None:
            first = next(iter(model.parameters()), None)
            local = _local(first) if first is not None else None
            device = local.device if local is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self._names = {id(m): (name or type(model).__name__) for name, m in model.named_modules()}
        # read now, between steps: inside forward / backward, FSDP modules show gathered tensors
        self._params = list(model.parameters())
        # (module, phase, {category: {storage data_ptr: bytes}}) at every mark
        self._snapshots: list[tuple[str, str, dict[str, dict[int, int]]]] = []
        self._cuda_marks: list[tuple[int, int]] = []   # CUDA: (peak since previous, current)
        self._hooks = []
        self._prof = None
        self._profiling = contextlib.ExitStack()  # CPU: holds the profiler from enter to exit
        self.peak_bytes = 0
        self.peak_breakdown: dict[str, int] = {}
        self.at_start: dict[str, int] = {}
        self._intervals: list[tuple[str, str, int, dict[str, int]]] = []

    # ----------------------------------------------------------------- what can be named
    def _named(self, fsdp_state=None) -> dict[str, dict[int, int]]:
        """``{category: {storage data_ptr: bytes}}`` of everything the tracker can name now."""
        out = {k: {} for k in CATEGORIES if k != ACTIVATIONS}
        with torch.no_grad():
            for p in self._params:
                _add_storage(out[SHARDED_PARAMS], _local(p))
                if p.grad is not None:
                    _add_storage(out[GRADIENTS], _local(p.grad))
            if self.optimizer is not None:
                for st in self.optimizer.state.values():
                    for t in st.values():
                        if isinstance(t, torch.Tensor):
                            _add_storage(out[OPTIMIZER_STATE], _local(t))
        ctx = getattr(fsdp_state, "ctx", None) if fsdp_state is not None else self._fsdp_ctx()
        if ctx is not None:
            for k, storages in ctx.memory_storages().items():
                out[k].update(storages)
            # a shard FSDP lent to its gathered parameter lives in that storage: it is the
            # gathered parameter's (the shard's own storage was freed)
            for ptr in out[UNSHARDED_PARAMS]:
                out[SHARDED_PARAMS].pop(ptr, None)
        return out

    def _fsdp_ctx(self):
        state = self.model.__dict__.get("_fsdp_state")
        return getattr(state, "ctx", None)

    # ----------------------------------------------------------------- marks
    def _mark(self, module: str, event: str, fsdp_state=None):
        index = len(self._snapshots)
        self._snapshots.append((module, _PHASE[event], self._named(fsdp_state)))
        if self.is_cuda:
            stats = torch.cuda.memory_stats(self.device)
            self._cuda_marks.append((stats["allocated_bytes.all.peak"] - self._cuda_base,
                                     stats["allocated_bytes.all.current"] - self._cuda_base))
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with torch.profiler.record_function(f"memtrack::{index}"):
                pass

    def _on_fsdp_event(self, event: str, state):
        module = self._names.get(id(state.modules[0]), type(state.modules[0]).__name__)
        self._mark(module, event, state)

    # ----------------------------------------------------------------- context manager
    def __enter__(self):
        self._start = self._named()
        self.at_start = {k: sum(self._start.get(k, {}).values()) for k in CATEGORIES}
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._prof = self._profiling.enter_context(memory_profile())
        FSDP_EVENT_OBSERVERS.append(self._on_fsdp_event)
        if self.optimizer is not None:
            self._hooks = [
                self.optimizer.register_step_pre_hook(
                    lambda *_: self._mark("optimizer", "optimizer")),
                self.optimizer.register_step_post_hook(
                    lambda *_: self._mark("optimizer", "optimizer_end"))]
        self._mark(self._names[id(self.model)], "start")
        return self

    def __exit__(self, *exc):
        FSDP_EVENT_OBSERVERS.remove(self._on_fsdp_event)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            self._mark("end", "optimizer_end")
            intervals = self._cuda_intervals()
        else:
            self._mark("end", "optimizer_end")
            self._profiling.close()
            intervals = self._cpu_intervals()
            self._prof = None
        self._summarise(intervals)
        return False

    # ----------------------------------------------------------------- turning marks into peaks
    def _category(self, ptr: int, interval: int) -> str:
        """The category of the allocation at ``ptr``, as named by the marks around ``interval``."""
        for i in (interval, interval + 1):
            if i < len(self._snapshots):
                for k, storages in self._snapshots[i][2].items():
                    if ptr in storages:
                        return k
        return ACTIVATIONS

    def _start_category(self, ptr: int) -> str:
        for k, storages in self._start.items():
            if ptr in storages:
                return k
        return ACTIVATIONS

    def _cpu_intervals(self) -> list[tuple[int, dict[str, int]]]:
        """``(peak, {category: bytes})`` of each interval between two marks, from the profiler's
        allocator events: the running total above the start, split by which live allocation
        (or freed pre-existing one) belongs to which category at the interval's peak."""
        events = []
        stack = [(e, False) for e in self._prof.profiler.kineto_results.experimental_event_tree()]
        while stack:
            e, in_comm = stack.pop()
            in_comm = in_comm or e.name.startswith(_COLLECTIVE_SCOPES)
            stack.extend((c, in_comm) for c in e.children)
            if e.name == "[memory]":
                f = e.extra_fields
                if f.device.type == "cpu":
                    events.append((e.start_time_ns, 0, f.alloc_size, f.ptr, in_comm))
            elif e.name.startswith("memtrack::"):
                events.append((e.start_time_ns, 1, int(e.name[len("memtrack::"):]), 0, False))
        events.sort()
        # pass 1: each interval's peak and the event at which it is reached
        n = len(self._snapshots)
        peak_at = [(0, -1)] * n
        current, total = 0, 0
        for idx, (_t, is_mark, value, _ptr, _comm) in enumerate(events):
            if is_mark:
                current = value
            else:
                total += value
            if peak_at[current][1] < 0 or total > peak_at[current][0]:
                peak_at[current] = (total, idx)
        wanted: dict[int, list[int]] = {}
        for interval, (_peak, idx) in enumerate(peak_at):
            wanted.setdefault(idx, []).append(interval)
        # pass 2: what was live at each of those moments
        live: dict[int, tuple[int, bool]] = {}  # made since the start: (bytes, in a collective)
        gone: dict[int, int] = {}      # pre-existing allocations freed since the start
        result = [(0, dict.fromkeys(CATEGORIES, 0))] * n
        for idx, (_t, is_mark, value, ptr, in_comm) in enumerate(events):
            if not is_mark:
                if value > 0:
                    live[ptr] = (value, in_comm)
                elif ptr in live:
                    del live[ptr]
                else:
                    gone[ptr] = gone.get(ptr, 0) + value
            for interval in wanted.get(idx, ()):
                parts = dict.fromkeys(CATEGORIES, 0)
                for p, (size, in_comm) in live.items():
                    # the backend's own buffers, allocated inside a collective, are named by that
                    parts[COMM_BUFFERS if in_comm else self._category(p, interval)] += size
                for p, size in gone.items():
                    parts[self._start_category(p)] += size
                result[interval] = (sum(parts.values()), parts)
        return result

    def _cuda_intervals(self) -> list[tuple[int, dict[str, int]]]:
        """CUDA: each interval's peak from the allocator's statistics, split by what was named
        at the mark that opened it (the rest: activations)."""
        out = []
        for i, (_module, _phase, named) in enumerate(self._snapshots):
            peak = (self._cuda_marks[i + 1][0] if i + 1 < len(self._cuda_marks)
                    else self._cuda_marks[i][1])
            parts = {k: sum(named.get(k, {}).values()) - self.at_start[k] for k in CATEGORIES
                     if k != ACTIVATIONS}
            parts[ACTIVATIONS] = peak - sum(parts.values())
            out.append((peak, parts))
        return out

    def _summarise(self, intervals: list[tuple[int, dict[str, int]]]):
        self._intervals = []
        best = None
        for (module, phase, _named), (peak, parts) in zip(self._snapshots, intervals):
            self._intervals.append((module, phase, peak, parts))
            if best is None or peak > best[0]:
                best = (peak, parts)
        if best is not None:
            self.peak_bytes, self.peak_breakdown = best

    # ----------------------------------------------------------------- queries
    def by_module_phase(self) -> dict[tuple[str, str], dict[str, int]]:
        out: dict[tuple[str, str], dict[str, int]] = {}
        for module, phase, peak, parts in self._intervals:
            key = (module, phase)
            if key not in out or peak > out[key]["peak"]:
                out[key] = {"peak": peak, **parts}
        return out

    def by_phase(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (_module, phase), row in self.by_module_phase().items():
            if phase not in out or row["peak"] > out[phase]["peak"]:
                out[phase] = row
        return out

    def table(self, per_module: bool = True, title: str | None = None):
        """A rich Table in MiB: the peak of each (module, phase) -- of each phase with
        ``per_module=False`` -- split into categories, and what was held at the start."""
        # CPU: what the profiler's events cannot show, said once, where the figures are
        unseen = None if self.is_cuda else ("a block allocated before tracking and freed during "
                                            "it is not subtracted (the profiler cannot size it)")
        # short headers explained by a legend, values never wrapped: nine columns fit an
        # 80-column terminal
        t = compact_table(title=title or f"memory above start: peak {_mib(self.peak_bytes)} MiB",
                          caption="\n".join(filter(None, [LEGEND, unseen])))
        if per_module:
            t.add_column("module", overflow="fold")
        t.add_column("phase")
        t.add_column("peak", justify="right", no_wrap=True)
        for k in CATEGORIES:
            t.add_column(SHORT_NAMES[k], justify="right", no_wrap=True)
        rows = self.by_module_phase() if per_module else {
            (None, phase): row for phase, row in self.by_phase().items()}
        for (module, phase), row in rows.items():
            t.add_row(*([module] if per_module else []), phase, _mib(row["peak"]),
                      *(_mib(row[k]) for k in CATEGORIES))
        t.add_row(*([""] if per_module else []), "held at start", "",
                  *(_mib(self.at_start[k]) for k in CATEGORIES))
        return t


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece (no autograd op), any other tensor itself."""
    return getattr(t, "_local_tensor", t)


def _add_storage(seen: dict, t: torch.Tensor):
    if t.device.type == "meta":
        return
    s = t.untyped_storage()
    seen[s.data_ptr()] = s.nbytes()


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.2f}"

