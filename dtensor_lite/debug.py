"""CommDebugMode: count and measure every collective that dtensor_lite issues.

All communication goes through :mod:`dtensor_lite.collectives`, which reports each call here, so
the counter sees redistributes, op-triggered resharding and FSDP's batched collectives alike;
torch's functional collectives that user code calls inside the mode (``funcol.all_reduce(x,
"sum", mesh)``) count too, as in torch's (:mod:`._funcol_counts`).

Bytes are *bytes sent per rank* under the cost model that the redistribute planner uses (ring
algorithms, chunks padded to equal size), so a test can check a plan's stated cost against what
actually ran::

    >>> with CommDebugMode() as comm:
    ...     y = x.redistribute(mesh, [Replicate()])
    >>> comm.get_comm_counts()
    {'all_gather': 1}
    >>> comm.get_total_bytes()
    3072
"""
from __future__ import annotations

import contextlib
import functools
import threading
from collections import defaultdict
from typing import NamedTuple

import torch

from ._comm_counts import CommCounts
from ._funcol_counts import FuncolCounter
from ._desync import DesyncError
from ._failures import CollectiveFailedError, RankFailedError, propagate_failures
from ._torch_names import tree_leaves
from ._visualize import visualize_sharding
from .debug_state import CHECKING, COMM_SINKS, EXPLICIT, TIMERS, UNATTRIBUTED, comm_cause
from .memory_tracker import MemoryTracker


__all__ = ["CommDebugMode", "CommRecord", "check_collectives", "comm_cause", "ExposedCommMode", "ExplicitRedistributionContext",
           "strict_redistribute", "FallbackRedistributeWarning", "ImplicitRedistributionError",
           "reset_fallback_warnings", "MemoryTracker", "propagate_failures", "RankFailedError",
           "CollectiveFailedError", "DesyncError", "visualize_sharding"]

@contextlib.contextmanager
def check_collectives():
    """Inside it, every collective first compares the ranks' buffers (kind, sizes, dtype; one
    fixed-size all_gather of 32 bytes per rank) and raises ``ValueError`` on every rank, naming
    each rank's buffer, where gloo would abort the process on buffers of different sizes. For
    finding where pieces were wrapped inconsistently, e.g. ``DTensor.from_local(run_check=False)``
    of pieces of different global shapes or dtypes. ``DTL_CHECK_COLLECTIVES=1`` turns it on for
    the whole process. Costs one small collective per collective.

    Example::

        >>> with check_collectives():
        ...     DTensor.from_local(torch.ones(3 - rank, 4), mesh, [Shard(0)]).full_tensor()
        ValueError: all_gather_single over ranks [0, 1]: the ranks' pieces differ (rank 0: 12 x ...
    """
    CHECKING.append(True)
    try:
        yield
    finally:
        CHECKING.pop()
class CommRecord(NamedTuple):
    """One collective as CommDebugMode saw it."""
    kind: str          # all_gather, reduce_scatter, all_reduce, all_to_all, ...
    nbytes: int        # bytes sent per rank (the planner's cost model)
    group_size: int
    module: str        # fqn of the innermost module whose forward issued it, or "Global"
    mesh_dim: str      # mesh dim name (or index)
    op: str            # aten op, "redistribute", "fsdp.all_gather", ... (see comm_cause)
    input: "int | str | None"  # the op's argument that had to move, if one did


class CommDebugMode:
    """Context manager recording count and bytes-per-rank of each collective type.

    ``get_comm_counts()`` -> ``{kind: count}``, which also answers torch's keys:
    ``counts[torch.ops.c10d_functional.all_reduce]`` (see :mod:`._comm_counts` for the mapping;
    FSDP's collectives count as the c10d ops torch's FSDP issues); ``comm_module_counts`` ->
    ``{module fqn: {"forward": counts, "backward": counts}}`` as torch's (``"Global"``: all);
    ``get_comm_bytes()`` -> ``{kind: bytes}``;
    ``get_per_module_comm_counts()`` -> ``{module_fqn: {kind: count}}`` for collectives issued
    inside a module's forward (``"Global"`` holds everything);
    ``get_comm_bytes_by_mesh_dim()`` -> ``{mesh dim name: {kind: bytes}}``;
    ``get_comm_counts_by_op()`` -> ``{op: {kind: count}}``: which aten op (and, with
    ``by_input=True``, which of its inputs) or which explicit ``redistribute`` / FSDP hook caused
    each collective; ``records``: one :class:`CommRecord` per collective, in order.
    Kinds: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all`` (uneven
    ``all_to_all_single`` too), ``broadcast``, ``scatter``, and the point-to-point ``ring_shift``
    and ``send_recv`` (bytes this rank sends).

    Entering the mode again starts from zero (as torch's). Also torch's
    ``get_parameter_info()`` / ``get_sharding_info()`` (the parameters of the modules that ran
    forward inside it) and ``generate_comm_debug_tracing_table()`` /
    ``log_comm_debug_tracing_table_to_file()`` / ``generate_json_dump()`` (per-module counts;
    no per-op listing).
    """

    def __init__(self):
        self._reset()
        self._names: dict[int, str] = {}
        self._hooks = []

    def _reset(self):
        self.comm_counts = CommCounts()
        self.comm_bytes: dict[str, int] = defaultdict(int)
        self.per_module_counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        # torch's: {fqn: {"forward": CommCounts, "backward": CommCounts}}, "Global" holding all
        self.comm_module_counts: dict[str, dict[str, CommCounts]] = {
            "Global": {"forward": CommCounts(), "backward": CommCounts()}}
        # (kind, bytes, group size, module fqn, mesh dim name)
        self.calls: list[tuple[str, int, int, str, str]] = []
        self.records: list[CommRecord] = []
        self.mesh_dim_ranks: dict[str, set[tuple[int, ...]]] = defaultdict(set)  # groups seen
        self._module_stack: list[str] = []
        self._parameter_info: dict[str, dict[str, torch.Tensor]] = {}
        self._sharding_info: dict[str, tuple] = {}

    # -- recording
    def _add(self, kind: str, nbytes: int, group_size: int, mesh_dim: str = "?",
             ranks: tuple[int, ...] = (), op: str = UNATTRIBUTED, input=None, torch_names=None):
        self.comm_counts._add(kind, op, torch_names)
        self.comm_bytes[kind] += nbytes
        fqn = self._module_stack[-1] if self._module_stack else "Global"
        self.calls.append((kind, nbytes, group_size, fqn, mesh_dim))
        self.records.append(CommRecord(kind, nbytes, group_size, fqn, mesh_dim, op, input))
        self.mesh_dim_ranks[mesh_dim].add(ranks)
        self.per_module_counts["Global"][kind] += 1
        for name in dict.fromkeys(self._module_stack):  # every enclosing module, once
            self.per_module_counts[name][kind] += 1
        # forward: the modules whose forward is running (our stack); backward: the modules whose
        # backward is running, as torch's ModTracker follows them through autograd
        tracker = self._tracker
        if tracker is not None and tracker.is_bw:
            phase, modules = "backward", ["Global", *sorted(tracker.parents - {"Global"})]
        else:
            phase, modules = "forward", ["Global", *dict.fromkeys(self._module_stack)]
        for name in modules:
            entry = self.comm_module_counts.get(name)
            if entry is None:
                entry = self.comm_module_counts[name] = {"forward": CommCounts(),
                                                         "backward": CommCounts()}
            entry[phase]._add(kind, op, torch_names)

    # -- queries
    def get_comm_counts(self) -> CommCounts:
        return CommCounts(self.comm_counts, self.comm_counts.by_torch_op())

    def get_parameter_info(self) -> dict[str, dict[str, torch.Tensor]]:
        """torch's: ``{module fqn: {parameter name: parameter data}}`` for the modules whose
        forward ran inside this mode."""
        return self._parameter_info

    def get_sharding_info(self) -> dict[str, tuple]:
        """torch's: ``{"<module fqn>.<parameter name>": placements}`` for their DTensor
        parameters."""
        return self._sharding_info

    def generate_comm_debug_tracing_table(self, noise_level: int = 3) -> str:
        """Per-module collective counts, forward and backward, as text (torch's name; the
        noise level is accepted for its signature: there is no per-op listing here)."""
        lines = []
        for fqn, phases in self.comm_module_counts.items():
            depth = 0 if fqn == "Global" else fqn.count(".") + 1
            lines.append("  " * depth + fqn)
            for phase in ("forward", "backward"):
                for kind, count in sorted(phases[phase].items()):
                    lines.append("  " * (depth + 1) + f"{phase} {kind}: {count}")
        return "\n".join(lines)

    def log_comm_debug_tracing_table_to_file(self, file_name: str = "comm_mode_log.txt",
                                             noise_level: int = 3) -> None:
        with open(file_name, "w") as f:
            f.write(self.generate_comm_debug_tracing_table(noise_level))

    def generate_json_dump(self, file_name: str = "comm_mode_log.json",
                           noise_level: int = 3) -> None:
        """``comm_module_counts`` as JSON: ``{fqn: {"forward": {kind: n}, "backward": ...}}``."""
        import json
        with open(file_name, "w") as f:
            json.dump({fqn: {phase: dict(c) for phase, c in phases.items()}
                       for fqn, phases in self.comm_module_counts.items()}, f, indent=2)

    def get_comm_bytes(self) -> dict[str, int]:
        return dict(self.comm_bytes)

    def get_total_counts(self) -> int:
        return sum(self.comm_counts.values())

    def get_total_bytes(self) -> int:
        return sum(self.comm_bytes.values())

    def get_comm_bytes_by_mesh_dim(self) -> dict[str, dict[str, int]]:
        """``{mesh dim name: {kind: bytes per rank}}``; a dim without names is its index."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for kind, nbytes, _, _, dim in self.calls:
            out[dim][kind] += nbytes
        return {d: dict(k) for d, k in out.items()}

    def get_per_module_comm_counts(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in self.per_module_counts.items()}

    def get_comm_counts_by_op(self, by_input: bool = False) -> dict:
        """``{op: {kind: count}}``, or with ``by_input=True`` ``{(op, input): {kind: count}}``.

        ``op`` is the aten op whose dispatch issued the collective (e.g.
        ``"aten.mm.default"``; ``input`` the index of the argument its rule moved, None for
        communication inside the op's own local computation), ``"redistribute"`` for an
        explicit ``redistribute`` / ``full_tensor`` (``"redistribute.backward"`` for its
        gradient), ``"from_local.backward"``, ``"fsdp.all_gather"`` / ``"fsdp.reduce_scatter"``
        / ``"fsdp.all_reduce"``, ``"local_map(<fn>)"``, or a label of your own (``comm_cause``).
        """
        out: dict = defaultdict(lambda: defaultdict(int))
        for r in self.records:
            out[(r.op, r.input) if by_input else r.op][r.kind] += 1
        return {k: dict(v) for k, v in out.items()}

    def table(self):
        """A rich Table of counts and bytes per collective kind and the op (and its input) that
        caused them."""
        from rich.table import Table
        t = Table(title="collectives")
        t.add_column("collective")
        t.add_column("caused by")
        t.add_column("input", justify="right")
        t.add_column("count", justify="right")
        t.add_column("bytes/rank", justify="right")
        rows: dict = defaultdict(lambda: [0, 0])
        for r in self.records:
            row = rows[(r.kind, r.op, "" if r.input is None else str(r.input))]
            row[0] += 1
            row[1] += r.nbytes
        for (kind, op, input), (count, nbytes) in sorted(rows.items()):
            t.add_row(kind, op, input, str(count), f"{nbytes:,}")
        return t

    # -- module attribution
    def _pre_forward(self, module, args):
        name = self._names.get(id(module))
        if name is None:
            if not self._module_stack:  # a new root: name its whole tree once
                root = type(module).__name__
                for sub_name, sub in module.named_modules():
                    self._names.setdefault(id(sub), f"{root}.{sub_name}" if sub_name else root)
                name = self._names[id(module)]
            else:
                name = f"{self._module_stack[-1]}.<{type(module).__name__}>"
        self._module_stack.append(name)
        if name not in self._parameter_info:
            params = dict(module.named_parameters(recurse=False))
            if params:
                self._parameter_info[name] = {k: p.data for k, p in params.items()}
                for k, p in params.items():
                    if hasattr(p, "placements"):
                        self._sharding_info[f"{name}.{k}"] = p.placements
        if id(module) not in self._exit_hooks:
            # the module leaves the stack after its *own* forward hooks, not before them (as a
            # global forward hook would): what a module's output hook sends -- a tensor-parallel
            # style's reduction of the module's output -- counts for that module
            self._exit_hooks[id(module)] = module.register_forward_hook(self._post_forward,
                                                                        always_call=True)

    def _post_forward(self, module, args, output):
        if self._module_stack:
            self._module_stack.pop()

    def __enter__(self):
        self._reset()  # as torch's: each entry counts from zero
        self._hooks = [torch.nn.modules.module.register_module_forward_pre_hook(self._pre_forward)]
        self._exit_hooks = {}
        self._tracker = (_leafless_mod_tracker_class()().__enter__() if self._follows_backward
                         else None)
        COMM_SINKS.append(self._add)
        self._funcol = FuncolCounter(self._add).__enter__()  # funcol.* that user code calls
        return self

    def __exit__(self, *exc):
        COMM_SINKS.remove(self._add)
        if self._funcol is not None:
            self._funcol.__exit__(None, None, None)
            self._funcol = None
        for h in [*self._hooks, *self._exit_hooks.values()]:
            h.remove()
        self._hooks = []
        self._exit_hooks = {}
        if self._tracker is not None:
            self._tracker.__exit__()
        self._tracker = None
        return False

    _tracker = None  # torch's ModTracker while the mode is entered: which module runs backward
    _funcol = None  # the FuncolCounter while the mode is entered
    # whether to follow modules through backward (comm_module_counts' "backward" phase); its
    # multi-grad hooks hold their nodes in reference cycles, which keep a retained graph's
    # saved tensors alive until Python's gc runs (the meter of dtensor_lite.plan turns it off)
    _follows_backward = True

    def __repr__(self):
        return f"CommDebugMode(get_total_counts()={self.get_total_counts()})"


@functools.cache  # the class, built on first use (importing torch's tracker costs at import)
def _leafless_mod_tracker_class():
    """torch's ModTracker, except that a module's leaf inputs get no backward hook: torch's
    registers a multi-grad hook on every input that requires grad, and such a hook on a leaf
    fails under ``torch.autograd.grad`` ("A leaf node was passed to _will_engine_execute_node"),
    which is how a pipeline stage takes its received activation's gradient. A leaf's gradient
    is the end of the module's backward anyway; with only leaves the module's backward ends
    with the backward pass, as torch's tracker already does for a module with no such input."""
    from torch.distributed._tools.mod_tracker import ModTracker

    class _LeaflessModTracker(ModTracker):
        def _fw_pre_hook(self, mod, input):
            kept = tuple(a for a in tree_leaves(input)
                         if not (isinstance(a, torch.Tensor) and a.is_leaf))
            return super()._fw_pre_hook(mod, kept)

    return _LeaflessModTracker


# ---------------------------------------------------------------- implicit redistributes
class FallbackRedistributeWarning(UserWarning):
    """Warned once per (op, input placements) when an op without a sharding rule ran on
    gathered (replicated) inputs: correct, but every rank moved and computed the whole tensors.
    Filter it like any warning::

        >>> warnings.filterwarnings("ignore", category=FallbackRedistributeWarning)
    """


_FALLBACK_WARNED: set = set()  # (op, input placements) already warned about


def warn_fallback_once(key, message: str) -> None:
    """Warn ``message`` as a FallbackRedistributeWarning the first time ``key`` comes by."""
    if key not in _FALLBACK_WARNED:
        _FALLBACK_WARNED.add(key)
        import warnings
        warnings.warn(message, FallbackRedistributeWarning, stacklevel=5)


def reset_fallback_warnings() -> None:
    """Warn again for every (op, placements) that already warned, e.g. in a test or after
    registering new rules."""
    _FALLBACK_WARNED.clear()


class ImplicitRedistributionError(RuntimeError):
    """Raised inside :class:`ExplicitRedistributionContext` for a redistribute the user did not
    ask for (a rule's input redistribute or the no-rule fallback)."""


class ExplicitRedistributionContext:
    """Refuse (or report) every redistribute that the user did not ask for.

    Inside it, a redistribute that an op makes on its own -- an input a sharding rule wants in
    other placements, the gather of the fallback for ops without a rule, an ``out=`` of other
    placements than the result -- raises :class:`ImplicitRedistributionError` naming the op, the
    placements and the bytes it would move; call ``.redistribute()`` yourself first to make it
    explicit. Same arguments as ``torch.distributed.tensor.debug``'s context of this name:

    * ``enable=False`` turns the check off (e.g. a region inside an enabled one);
    * ``strict=False`` (default) lets redistributes that move no data pass (e.g. Replicate to
      Shard, a local slice); ``strict=True`` refuses those too;
    * ``mode="raise"`` (default) or ``"warn"`` (a :class:`UserWarning` instead of the error).

    Contexts nest; the innermost decides. Backward passes run the same checks.

    Example::

        >>> with ExplicitRedistributionContext():
        ...     y = x_sharded_dim1 @ w_sharded_dim1   # raises: mm would all-gather an input
    """

    def __init__(self, enable: bool = True, strict: bool = False, mode: str = "raise"):
        if mode not in ("raise", "warn"):
            raise ValueError(f"ExplicitRedistributionContext: mode must be 'raise' or 'warn', "
                             f"got {mode!r}")
        self.enable = enable
        self.strict = strict
        self.mode = mode

    def __enter__(self):
        EXPLICIT.append(self)
        return self

    def __exit__(self, *exc):
        EXPLICIT.remove(self)
        return False


def strict_redistribute() -> ExplicitRedistributionContext:
    """Every implicit redistribute raises, even those that move no data (a short name for
    ``ExplicitRedistributionContext(strict=True)``)."""
    return ExplicitRedistributionContext(strict=True)


def describe_moves(moves) -> str:
    """``moves``: (input index, src spec, dst spec, bytes) for each input that changes."""
    return "; ".join(f"input {j}: {list(src.placements)} -> {list(dst.placements)} "
                     f"({tuple(src.shape)}, {nbytes} bytes/rank)" for j, src, dst, nbytes in moves)


def observe_implicit_redistribute(op, moves, why: str) -> None:
    """Called (only while a context is active) before an op redistributes its inputs on its own;
    ``moves`` as in :func:`describe_moves`."""
    ctx = EXPLICIT[-1]
    total = sum(m[3] for m in moves)
    if not ctx.enable or (not ctx.strict and total == 0):
        return
    msg = (f"{op}: implicit redistribute ({why}) inside ExplicitRedistributionContext, "
           f"{total} bytes/rank in all: {describe_moves(moves)}. Redistribute the inputs "
           "yourself first (x.redistribute(mesh, placements)), or leave the context")
    if ctx.mode == "raise":
        raise ImplicitRedistributionError(msg)
    import warnings
    warnings.warn(msg, stacklevel=3)


# --------------------------------------------------------------------------- exposed communication
class ExposedCommMode:
    """Context manager measuring how much communication a rank *waits for* (exposed) against how
    long its collectives were in flight (total), for everything issued through dtensor_lite
    (redistributes, op resharding, FSDP's all-gathers and reduce-scatters).

    * ``exposed_s``: seconds this rank's thread was blocked in ``wait()`` on a collective -- a
      synchronous collective waits right after issuing it, so all of it is exposed; a prefetched
      or ``async_op=True`` one that finished behind compute costs (almost) nothing here.
    * ``total_s``: seconds from issue to completion, summed over the collectives waited for
      (see ``debug_state.CommFlight``). ``exposed_s / total_s`` is the share not hidden (at most 1).
    * ``by_kind()``: ``{kind: {"count", "exposed_s", "total_s"}}``.

    Times are host wall-clock: on CUDA, ``wait()`` only orders streams and returns at once, so
    use the profiler there. Example::

        >>> with ExposedCommMode() as comm:
        ...     loss = model(x).sum(); loss.backward()
        >>> print(f"{comm.exposed_s * 1e3:.1f} ms of {comm.total_s * 1e3:.1f} ms exposed")
    """

    def __init__(self):
        self._lock = threading.Lock()  # completion callbacks run on the backend's threads
        self._waits: dict[str, float] = defaultdict(float)
        self._flights: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    def add_wait(self, kind, seconds):
        self._waits[kind] += seconds

    def add_flight(self, kind, seconds):
        with self._lock:
            self._flights[kind] += seconds
            self._counts[kind] += 1

    @property
    def exposed_s(self) -> float:
        return sum(self._waits.values())

    @property
    def total_s(self) -> float:
        with self._lock:
            return sum(self._flights.values())

    def by_kind(self) -> dict[str, dict[str, float]]:
        with self._lock:
            kinds = set(self._waits) | set(self._flights)
            return {k: {"count": self._counts.get(k, 0), "exposed_s": self._waits.get(k, 0.0),
                        "total_s": self._flights.get(k, 0.0)} for k in sorted(kinds)}

    def __enter__(self):
        TIMERS.append(self)
        return self

    def __exit__(self, *exc):
        TIMERS.remove(self)
        return False

