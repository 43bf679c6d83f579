"""The one module through which every byte crosses ranks.

Each function takes a ``DeviceMesh`` and a mesh dim, talks to that dim's process group through
``torch.distributed`` (gloo on CPU, nccl on CUDA) and reports the call to CommDebugMode. Inputs
are equal-sized chunks: callers pad uneven shards (``torch.chunk`` layout makes pad-and-trim exact).

Group ranks follow sorted global ranks (``new_group`` sorts them) while meshes may list ranks in
any order, so results are reordered into mesh-coordinate order where the two differ.

The synchronous runners of cached redistribute plans (``sync_runner``) call the process group's
own methods (``ProcessGroup.allreduce`` / ``all_gather_single``) rather than dist's functions:
what those add per call is argument checking the runner did once, and their TorchFunctionMode
and coalescing hand-offs, for which a runner takes dist's functions (``_direct_applies``).

Every collective is issued asynchronously and wrapped in a ``Pending``: ``async_op=True`` hands
it back (``wait()`` blocks until the bytes arrived and returns the finished result), otherwise it
is waited on at once. So one place sees when each collective was issued, how long the caller was
blocked on it (exposed communication) and when it completed: ``debug.ExposedCommMode`` reads that.
Waits go through ``_failures.wait_work``: on gloo, a rank that failed elsewhere (and posted its
error to the store) stops this wait with an error naming it instead of the group's timeout.

Cost model (bytes sent per rank; ``n`` = group size, ``c`` = one padded chunk in bytes):
  all_gather (n-1)*c · reduce_scatter (n-1)*c · all_reduce 2*(n-1)*ceil(numel/n)*itemsize ·
  all_to_all (n-1)*c · broadcast numel*itemsize · scatter (n-1)*c (the source's share) ·
  all_to_all_single (uneven splits) the rows sent to other ranks · send_recv / ring_shift the
  bytes this rank sends (0 on a rank that only receives) · cross_mesh (``exchange_pieces``,
  point-to-point between any ranks) the bytes this rank sends.
"""
from __future__ import annotations

import pickle
import time
import zlib

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

from . import _inflight, _torch_names as torch_names
from ._inflight import free_now
from .compile_support import is_traced
from ._failures import group_backend, wait_work
from ._rank_text import grouped_by
from . import _desync
from ._desync import exchange_sites, issued, plain_name
from .debug_state import CHECKING, COMM_SINKS, TIMERS, CommFlight, record

__all__ = ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "scatter",
           "broadcast_object", "all_reduce_cost", "flat_all_gather", "all_gather_pieces",
           "flat_reduce_scatter",
           "all_to_all_single", "send_recv", "exchange_pieces", "all_reduce_max_over", "Pending",
           "then", "free_now"]

# torch 2.13 renamed the *_into_tensor / *_tensor collectives to *_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
           "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


def all_reduce_cost(numel: int, itemsize: int, n: int) -> int:
    return 2 * (n - 1) * (-(-numel // n)) * itemsize if n > 1 else 0


# dtypes gloo cannot move, and the wider dtype each travels as (exact both ways)
_WIRE_DTYPES = {torch.bool: torch.uint8, torch.int16: torch.int32}


def _wire(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of a dtype every backend can move (bool travels as uint8)."""
    if t.dtype in _WIRE_DTYPES:
        t = t.to(_WIRE_DTYPES[t.dtype])
    elif t.is_complex():
        # a lazily conjugated / negated piece (a conj() view) has no real view: materialise it
        t = torch.view_as_real(t.resolve_conj().resolve_neg())
    return t.contiguous()


def _unwire(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.dtype == torch.bool:
        return t != 0
    if like.dtype in _WIRE_DTYPES:
        return t.to(like.dtype)
    if like.is_complex():
        return torch.view_as_complex(t)
    return t


# A max / min collective over floats travels as integers ordered like the floats ("order keys"):
# gloo's MAX / MIN keep whichever operand their comparison favours, so a NaN survives only where
# it happened to be the accumulator (rank order) -- torch's max / min propagate NaN always. As
# keys, NaN is placed beyond +inf (max) or below -inf (min) and wins every comparison; the bytes
# on the wire are the same as the floats'.
_ORDER_KEY_DTYPES = {torch.float64: torch.int64, torch.float32: torch.int32,
                     torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _needs_order_keys(t: torch.Tensor, reduce_op: str) -> bool:
    return reduce_op in ("max", "min") and t.dtype in _ORDER_KEY_DTYPES


def _to_order_keys(t: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """Integers that compare as the floats ``t`` do, NaN winning ``reduce_op``."""
    key_dtype = _ORDER_KEY_DTYPES[t.dtype]
    bits = t.contiguous().view(key_dtype)
    info = torch.iinfo(key_dtype)
    # sign-magnitude -> two's complement order: negative floats grow toward -0 as bits shrink
    keys = torch.where(bits < 0, bits ^ info.max, bits)
    return keys.masked_fill(t.isnan(), info.max if reduce_op == "max" else info.min)


def _from_order_keys(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The floats of ``_to_order_keys`` (the map is its own inverse; NaN keys decode to NaN)."""
    return torch.where(keys < 0, keys ^ torch.iinfo(keys.dtype).max, keys).view(dtype)


def _report(kind: str, nbytes: int, n: int, mesh, mesh_dim: int):
    if COMM_SINKS:
        names = mesh.mesh_dim_names
        label = names[mesh_dim] if names else str(mesh_dim)
        # the group's global ranks too: a link model tells intra- from inter-node by them
        record(kind, nbytes, n, label, mesh.dim_group(mesh_dim).ranks)


class Pending:
    """A collective in flight. ``wait()`` blocks until it is done and returns its result (the
    output tensor after any reordering / unwiring; None for FSDP's flat collectives, whose output
    buffer the caller owns). ``then(fn)`` queues more local work to run on that result at wait.
    Waiting twice returns the same result."""

    __slots__ = ("_work", "_finish", "_kind", "_done", "_result", "_flight", "_group", "_hold")

    def __init__(self, issued, finish, kind: str):
        work, started, group, hold = issued if issued is not None else (None, 0.0, None, None)
        self._work, self._finish, self._kind, self._group = work, finish, kind, group
        self._hold = hold  # the private aliases the backend was given (see _inflight.py)
        self._done, self._result = False, None
        self._flight = CommFlight(kind, started, work, TIMERS) if TIMERS and work else None

    def then(self, fn) -> "Pending":
        finish = self._finish
        self._finish = lambda: fn(finish())
        return self

    def is_completed(self) -> bool:
        return self._done or self._work is None or self._work.is_completed()

    def wait(self):
        if not self._done:
            if self._work is not None:
                work, self._work = self._work, None
                _wait_issued(work, self._kind, self._group, self._hold, self._flight)
            self._result = self._finish()
            self._done = True
            self._work = self._finish = self._flight = self._group = self._hold = None
        return self._result

    def _abandon(self):
        """This work will not be waited for (again): keep it and its buffers until the backend is
        done with it (at exit at the latest, see _inflight.py)."""
        work, self._work = self._work, None
        if work is not None:
            _inflight.abandon(None, self._hold)

    def __del__(self):
        # a collective issued with async_op=True and dropped unwaited still runs in the backend
        try:
            if not self._done:
                self._abandon()
        except (AttributeError, TypeError):  # a half-built Pending, or module teardown
            pass


# {process group: its ranks} for the groups of mesh dims made with torch's "fake" backend in a
# real world (init_device_mesh(backend_override={dim: "fake"}), as torchtitan's ParallelDims asks
# for dims it only reads coordinates of). Such a group moves no bytes, so a collective over it
# would leave wrong values behind without a word: refuse it instead (device_mesh.py)
NO_COMM_GROUPS: dict = {}


def _refuse_if_fake(group) -> None:
    """Raise, naming the ranks, if ``group`` is one of ``NO_COMM_GROUPS``."""
    if not NO_COMM_GROUPS or group not in NO_COMM_GROUPS:
        return
    raise RuntimeError(
        f"a collective was asked of the mesh dim over ranks {list(NO_COMM_GROUPS[group])}, whose "
        "process group has backend 'fake' (init_device_mesh / _unflatten backend_override): a fake "
        "group never communicates, so the result would be wrong; give that dim a real backend "
        "(leave it out of backend_override) if anything is sharded, reduced or gathered over it")


def _issue(collective, *args, group, **kwargs):
    """Issue ``collective`` asynchronously: (its work, when the issue call began, the group, the
    tensors the backend holds until it lets go of the work). The backend gets private aliases of
    the tensor arguments, released only once it let go of them (see _inflight.py)."""
    _refuse_if_fake(group)
    if CHECKING:
        _check_buffers_agree(collective, args, group)
    started = time.perf_counter()
    hold: list = []
    args = tuple(_inflight.private(a, hold) for a in args)
    work = collective(*args, async_op=True, group=group, **kwargs)
    if _desync.RECORDING:  # its sequence number in the group, for a desync report
        issued(work, group, collective.__name__)
    if isinstance(work, _Works):  # the tensors its works were given (e.g. views of the aliases)
        hold = list(work.buffers)
    return work, started, group, hold


def dtype_code(dtype: torch.dtype) -> int:
    """A number for ``dtype`` that every rank computes alike (to compare dtypes across ranks)."""
    return zlib.crc32(str(dtype).encode())


_DTYPE_OF_CODE = {dtype_code(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def dtype_from_code(code: int):
    """The dtype of ``dtype_code`` (for messages; the code itself if unknown)."""
    return _DTYPE_OF_CODE.get(code, f"dtype#{code}")


# the functions _issue hands tensors to, by the number each rank puts in its row
_COLLECTIVE_NAMES = {zlib.crc32(name.encode()): name for name in _desync.ISSUED_AS}
_SHAPE_COLS = 9  # ndim, then up to 8 sizes (a deeper tensor is named by its first 8)


def _shape_cols(shape) -> list[int]:
    if shape is None:
        return [-1] + [0] * (_SHAPE_COLS - 1)
    dims = [int(s) for s in shape][:_SHAPE_COLS - 1]
    return [len(shape)] + dims + [0] * (_SHAPE_COLS - 1 - len(dims))


def _shape_of_cols(cols) -> tuple | None:
    return None if cols[0] < 0 else tuple(cols[1:1 + min(cols[0], _SHAPE_COLS - 1)])


HEADER_ROWS = [0]  # how many rows _check_buffers_agree gathered in this process (for tests)


def _check_buffers_agree(collective, args, group) -> None:
    """Every rank's (collective, output and input sizes, dtype, the piece it sends and the global
    shape it believes it moves), one fixed-size row each, compared before the buffers reach the
    backend -- gloo aborts the process on buffers of different sizes. Runs under
    ``debug.check_collectives`` and for pieces no rank compared (``_unchecked.py``). Uneven
    all_to_all splits may differ by design: sizes are compared only where they must be equal.
    Every rank gets the same rows, so every rank raises the same error or none does."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if tensors and tensors[0].is_meta:  # a dry run (plan.dry_run's fake world): no buffers move,
        return                          # and a meta row has no values to compare
    uneven = any(isinstance(a, (list, tuple)) and a for a in args[2:])  # all_to_all splits
    # (output, input) -- the input (last tensor argument) is the piece a rank sends
    sizes = [-1, -1] if uneven else [tensors[0].numel(), tensors[-1].numel()]
    name = name_of(collective)
    believed = CHECKING[-1] if CHECKING else True
    global_shape = getattr(believed, "shape", None)
    row = torch.tensor([[zlib.crc32(name.encode()), *sizes, dtype_code(tensors[0].dtype),
                         *_shape_cols(tensors[-1].shape), *_shape_cols(global_shape)]],
                       dtype=torch.int64, device=tensors[0].device)
    n = dist.get_world_size(group)
    HEADER_ROWS[0] += 1
    rows = row.new_empty((n, row.shape[1]))
    hold: list = []  # waited like every collective here, its buffers released likewise
    work = _all_gather_single(_inflight.private(rows, hold), _inflight.private(row, hold),
                              group=group, async_op=True)
    Pending((work, time.perf_counter(), group, hold), lambda: None, "check_collectives").wait()
    if (rows == rows[0]).all():
        free_now(rows, row)  # read: freed now, not when gloo's thread lets go (see _free_sent)
        return
    ranks = dist.get_process_group_ranks(group)
    table = dict(zip(ranks, rows.tolist()))
    kinds = {r: plain_name(_COLLECTIVE_NAMES.get(t[0], f"collective#{t[0]}"))
             for r, t in table.items()}
    if len(set(kinds.values())) > 1:
        where = exchange_sites(group, name)
        raise ValueError(
            f"collectives over ranks {ranks} do not match: {grouped_by(kinds)}"
            f"{f' -- {where}' if where else ''}. The ranks ran "
            "different sequences of collectives: one was called on some ranks only (e.g. inside "
            "`if rank == ...`, or a forward / backward / optimizer step not every rank ran) or in "
            "another order; gloo would abort the process. Make every rank of the group issue "
            "the same collectives in the same order")
    pieces = {r: f"{_shape_of_cols(t[4:4 + _SHAPE_COLS])} {dtype_from_code(t[3])}"
              for r, t in table.items()}
    globals_ = {r: _shape_of_cols(t[4 + _SHAPE_COLS:]) for r, t in table.items()}
    believed_text = ""
    if len(set(globals_.values())) > 1:
        believed_text = (" -- the ranks believe the global shape is "
                         f"{grouped_by({r: str(g) for r, g in globals_.items()})}")
    if believed is not True:
        advice = ("These pieces were wrapped without comparing them across ranks: "
                  "DTensor.from_local(run_check=False) (torch's default), local_map's outputs "
                  "and a given shape= trust that every rank's piece is a torch.chunk piece of one "
                  "global tensor of one dtype. Pass shape= (the same on every rank) for uneven "
                  "pieces, or run_check=True to derive and check it, and give every rank the same "
                  "dtype")
    else:
        advice = ("Either the pieces were wrapped inconsistently (DTensor.from_local with "
                  "run_check=False trusts that every rank's piece belongs to one global shape and "
                  "dtype: pass shape= for uneven pieces, or run_check=True to check them), or the "
                  "ranks reached this collective from different points of the program (one was "
                  "called on some ranks only)")
    sizes_differ = any((t[1:4] != rows[0][1:4]) for t in rows.tolist())
    consequence = ("gloo would abort the process on buffers of different sizes" if sizes_differ
                   else "the buffers happen to be of one size, but the result would be wrong")
    raise ValueError(
        f"{plain_name(name)} over ranks {ranks}: the ranks disagree on what they move -- pieces "
        f"{grouped_by(pieces)}"
        f"{believed_text}; {consequence}. {advice}.")


def name_of(collective) -> str:
    return getattr(collective, "__name__", str(collective))


def _launch(kind: str, issued, finish, async_op: bool):
    """``issued`` (from ``_issue``, or None: nothing to wait for) as a Pending, or its result now."""
    if async_op or TIMERS:
        pending = Pending(issued, finish, kind)
        return pending if async_op else pending.wait()
    if issued is not None:  # waited now: what Pending.wait does, without the Pending
        work, _, group, hold = issued
        _wait_issued(work, kind, group, hold)
    return finish()


def _wait_issued(work, kind: str, group, hold, flight=None, timed_wait_aborts=None) -> None:
    """Wait for an issued collective's ``work`` in slices, watching for a failure another rank
    posted (see _failures.py), then release the private aliases ``hold`` of its buffers (see
    _inflight.py); a wait that raises keeps them until the backend lets go."""
    start = time.perf_counter() if flight is not None else 0.0
    try:
        wait_work(work, kind, group, timed_wait_aborts)
    except BaseException:
        _inflight.abandon(None, hold)
        raise
    if flight is not None:
        flight.waited(start, time.perf_counter())
    # drop the work before its buffers: the backend's thread may still hold it
    del work
    _inflight.retire(hold)


def sync_runner(kind: str, mesh, mesh_dim: int, dim: int, local_shape, dtype, device):
    """A function ``run(piece)`` doing what ``all_gather`` (along ``dim``), ``reduce_scatter``
    (sum, along ``dim``) or ``all_reduce`` (sum) do, synchronously, for pieces of
    ``local_shape`` that move as they are: the decisions those functions make per call (wire
    dtype, order keys, group order, buffer form, padding) made once, for a redistribute plan
    cached per spec pair. None where a call must take the general function. ``run`` returns
    None (nothing issued) while a debug mode watches collectives, for a piece of another shape
    (the general path raises the error) or dtype, or one that belongs to a trace: the caller then takes
    the general path, which reports, checks and traces. The result never aliases the piece.
    It calls the process group's own methods (see ``_direct_applies``)."""
    dg = mesh.dim_group(mesh_dim)
    n = dg.size
    if n == 1 or dg.group is None or not dg.is_sorted or dtype in _WIRE_DTYPES or \
            dtype.is_complex or dtype == torch.bool or not local_shape:
        return None
    if kind == "all_gather":
        if not _PG_GATHERS_SINGLE:
            return None
        out_shape = (n * local_shape[dim],) + tuple(
            s for k, s in enumerate(local_shape) if k != dim)

        def collect(x, group):
            sent = x.contiguous()
            out = sent.new_empty(out_shape)
            hold = _held(group, out, sent)
            _wait_direct(group.all_gather_single(hold[0], hold[1], _GATHER), group,
                         "all_gather_single", kind, hold)
            _free_sent(sent, x)
            return out.movedim(0, dim) if dim else out
    elif kind == "reduce_scatter":
        if local_shape[dim] % n or not _copies_whole_buffer(
                torch.empty(0, device=device), dg.group):
            return None
        chunk, slot = local_shape[dim] // n, dg.coordinate

        def collect(x, group):
            # gloo's form (see reduce_scatter): the copy all-reduced, this rank's slot copied out
            x = x.clone(memory_format=torch.contiguous_format)
            hold = _held(group, x)
            _wait_direct(group.allreduce(hold, _SUM), group, "_all_reduce_in_place", kind, hold)
            piece = x.narrow(0, slot * chunk, chunk).clone()
            free_now(x)
            return piece.movedim(0, dim) if dim else piece
    elif kind == "all_reduce":
        def collect(x, group):
            x = x.clone(memory_format=torch.contiguous_format)
            hold = _held(group, x)
            _wait_direct(group.allreduce(hold, _SUM), group, "all_reduce", kind, hold)
            return x
    else:
        return None

    def run(piece):
        if COMM_SINKS or TIMERS or CHECKING or is_traced(piece) or piece.shape != local_shape \
                or piece.dtype != dtype or not _direct_applies():
            return None
        # dim_group per call: a mesh whose groups were destroyed raises its clear error
        return collect(piece.movedim(dim, 0) if dim else piece, mesh.dim_group(mesh_dim).group)
    return run


# The synchronous runners call the process group's methods themselves, with these options,
# rather than through dist.all_reduce / dist.all_gather_single: those re-check per call what a
# runner checked when it was made (one plain, contiguous, real tensor of a known shape and dtype,
# a group this rank is in) and cost ~15-25 us more per collective on CPU. Issued asynchronously
# and waited for in slices, like every collective here.
_SUM = _c10d.AllreduceOptions()
_SUM.reduceOp, _SUM.asyncOp = dist.ReduceOp.SUM, True
_GATHER = _c10d.AllgatherOptions()
_GATHER.asyncOp = True
_PG_GATHERS_SINGLE = hasattr(_c10d.ProcessGroup, "all_gather_single")  # (not on torch 2.11)
_tf_mode_on = torch_names.torch_function_mode_enabled  # (True where torch cannot say)
_c10d_world = torch_names.c10d_world


def _direct_applies() -> bool:
    """What dist's functions would do besides the method call is nothing: no TorchFunctionMode
    to hand the collective to (e.g. non-strict export's, which maps it to a functional one) and
    no ``_coalescing_manager`` collecting collectives to issue as one (a torch that does not
    say: dist's functions)."""
    return not (_tf_mode_on() or getattr(_c10d_world, "pg_coalesce_state", True))


def _held(group, *tensors) -> list:
    """Private aliases of ``tensors`` for the backend (``_inflight``), once ``group`` is known
    to communicate (as in ``_issue``)."""
    _refuse_if_fake(group)
    hold: list = []
    for t in tensors:
        _inflight.private(t, hold)
    return hold


def _wait_direct(work, group, name: str, kind: str, hold: list) -> None:
    """What ``_issue`` does after the issue and ``_wait_issued`` does, for ``work`` from a
    method of ``group`` called on the aliases ``hold`` (``name``: as ``_desync`` records it)."""
    if _desync.RECORDING:
        issued(work, group, name)
    # an all-gather's or all-reduce's work (a reduce-scatter is issued as an all-reduce here,
    # ``kind`` names what the caller asked for): waited for in slices, never on a thread
    _wait_issued(work, kind, group, hold, timed_wait_aborts=False)


def then(result, fn):
    """``fn(result)``, now for a finished result, at wait for a Pending one."""
    return result.then(fn) if isinstance(result, Pending) else fn(result)


_FUNCTIONAL = None


def _functional():
    """torch's traceable functional collectives (the ops are registered on first import)."""
    global _FUNCTIONAL
    if _FUNCTIONAL is None:
        import torch.distributed._functional_collectives  # noqa: F401  (registers the ops)
        _FUNCTIONAL = getattr(torch.ops, "_c10d_functional")  # a namespace, made on first use
    return _FUNCTIONAL


def _traced(kind: str, x: torch.Tensor, dg, *args):
    """In a trace: the functional collective ``kind`` on ``x`` over ``dg``, waited (the compiler
    is free to move the wait as late as the first use)."""
    f = _functional()
    name = dg.group.group_name
    if kind == "all_gather":
        out = f.all_gather_into_tensor(x, dg.size, name)
    elif kind == "reduce_scatter":
        out = f.reduce_scatter_tensor(x, args[0], dg.size, name)
    elif kind == "all_reduce":
        out = f.all_reduce(x, args[0], name)
    else:  # all_to_all: equal splits along dim 0
        split = [x.shape[0] // dg.size] * dg.size
        out = f.all_to_all_single(x, split, split, name)
    return f.wait_tensor(out)


_TRACED_OP = {"sum": "sum", "avg": "sum", "max": "max", "min": "min", "product": "product"}  # avg: sum, then divide


def _chunks_to_coord_order(out: torch.Tensor, dg) -> torch.Tensor:
    """``out`` holds n equal chunks along dim 0 in group-rank order; return coordinate order."""
    if dg.is_sorted:
        return out
    chunks = out.chunk(dg.size)
    return torch.cat([chunks[g] for g in dg.group_rank_of_coord])


def _chunks_to_group_order(inp: torch.Tensor, dg) -> torch.Tensor:
    if dg.is_sorted:
        return inp
    chunks = inp.chunk(dg.size)
    return torch.cat([chunks[c] for c in dg.coord_of_group_rank])


def all_gather(tensor: torch.Tensor, mesh, mesh_dim: int, gather_dim: int = 0,
               async_op: bool = False):
    """Concatenate every rank's equal-shaped ``tensor`` along ``gather_dim`` in mesh order.
    ``async_op``: return a ``Pending`` whose ``wait()`` gives that tensor."""
    dg = mesh.dim_group(mesh_dim)
    n = dg.size
    if n == 1:
        return _launch("all_gather", None, lambda: tensor, async_op)
    x = _wire(tensor.movedim(gather_dim, 0) if gather_dim else tensor)
    if is_traced(x):
        out, work = _traced("all_gather", x, dg), None
    else:
        out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
        work = _issue(_all_gather_single, out, x, group=dg.group)
    _report("all_gather", (n - 1) * x.numel() * x.element_size(), n, mesh, mesh_dim)

    def finish():
        if work is not None:
            _free_sent(x, tensor)
        res = _unwire(_chunks_to_coord_order(out, dg), tensor)
        return res.movedim(0, gather_dim) if gather_dim else res
    return _launch("all_gather", work, finish, async_op)


def _free_sent(sent: torch.Tensor, piece: torch.Tensor) -> None:
    """After the wait: free ``sent`` now if it is a buffer made here to send ``piece`` (a moved
    dim made contiguous, a wire dtype, chunks put in group order), not ``piece``'s own memory:
    nothing but the backend's private alias refers to it then. Left to the alias, it lives until
    gloo's thread lets go of the work and a later collective retires it (``_inflight.retire``),
    longer or shorter by that thread's timing: e.g. half the logits beside the gathered ones at
    the start of backward (benchmarks/memory.py, dp2 x tp2)."""
    if sent.untyped_storage().data_ptr() != piece.untyped_storage().data_ptr():
        free_now(sent)


def reduce_scatter(tensor: torch.Tensor, mesh, mesh_dim: int, reduce_op: str = "sum",
                   scatter_dim: int = 0, async_op: bool = False):
    """Reduce ``tensor`` over the group; keep chunk ``coordinate`` of ``scatter_dim`` (size % n == 0)."""
    dg = mesh.dim_group(mesh_dim)
    n = dg.size
    if n == 1:
        return _launch("reduce_scatter", None, lambda: _finish_avg(tensor.clone(), reduce_op, n),
                       async_op)
    keyed = _needs_order_keys(tensor, reduce_op)
    x = tensor.movedim(scatter_dim, 0) if scatter_dim else tensor
    x = _wire(_to_order_keys(x, reduce_op) if keyed else x)
    x = _chunks_to_group_order(x, dg).contiguous()
    whole = None  # the all-reduced buffer ``out`` is a slot of, freed once the slot is copied out
    if is_traced(x):
        out, work = _traced("reduce_scatter", x, dg, _TRACED_OP[reduce_op]), None
    elif _copies_whole_buffer(x, dg.group):
        # gloo's reduce-scatter runs inside wait() and ignores its timeout, so it could only be
        # waited for on a thread; an all-reduce of a copy (gloo's reduce-scatter copies the whole
        # buffer too, and is slower on one host: see _copies_whole_buffer) is waited for in slices
        if x.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            x = x.clone()
        work = _issue(_all_reduce_in_place, x, op=_REDUCE[reduce_op], group=dg.group)
        chunk = x.shape[0] // n
        out, whole = x.narrow(0, dg.group_rank_of_coord[dg.coordinate] * chunk, chunk), x
    else:
        out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
        work = _issue(_reduce_scatter_single, out, x, op=_REDUCE[reduce_op], group=dg.group)
    _report("reduce_scatter", (n - 1) * out.numel() * out.element_size(), n, mesh, mesh_dim)

    def finish():
        piece = out
        if whole is not None:
            # a view would keep all n slots alive for as long as the result lives (a reduce-
            # scatter's output is 1/n of its input): copy this rank's slot out, free the rest now
            piece = out.clone()
            free_now(whole)
        if keyed:
            res = _from_order_keys(piece.to(_ORDER_KEY_DTYPES[tensor.dtype]), tensor.dtype)
        else:
            res = _finish_avg(_unwire(piece, tensor), reduce_op, n)
        return res.movedim(0, scatter_dim) if scatter_dim else res
    return _launch("reduce_scatter", work, finish, async_op)


def all_reduce(tensor: torch.Tensor, mesh, mesh_dim: int, reduce_op: str = "sum",
               async_op: bool = False):
    """Out-of-place all-reduce over one mesh dim."""
    dg = mesh.dim_group(mesh_dim)
    n = dg.size
    if n == 1:
        return _launch("all_reduce", None, lambda: _finish_avg(tensor.clone(), reduce_op, n),
                       async_op)
    keyed = _needs_order_keys(tensor, reduce_op)
    wired = _wire(_to_order_keys(tensor, reduce_op) if keyed else tensor)
    if is_traced(tensor):
        x, work = _traced("all_reduce", wired, dg, _TRACED_OP[reduce_op]), None
    else:
        x = wired if keyed else wired.clone()  # keys are a fresh tensor already
        work = _issue(dist.all_reduce, x, op=_REDUCE[reduce_op], group=dg.group)
    _report("all_reduce", all_reduce_cost(x.numel(), x.element_size(), n), n, mesh, mesh_dim)

    def finish():
        if keyed:
            return _from_order_keys(x.to(_ORDER_KEY_DTYPES[tensor.dtype]), tensor.dtype)
        return _finish_avg(_unwire(x, tensor), reduce_op, n)
    return _launch("all_reduce", work, finish, async_op)


def _finish_avg(t: torch.Tensor, reduce_op: str, n: int) -> torch.Tensor:
    if reduce_op != "avg" or n == 1:
        return t
    return t.div_(n) if t.is_floating_point() or t.is_complex() else t.div_(n, rounding_mode="floor")


def all_to_all(tensor: torch.Tensor, mesh, mesh_dim: int, split_dim: int, cat_dim: int,
               async_op: bool = False):
    """Split ``split_dim`` into n equal pieces, send piece k to coordinate k, concatenate the
    received pieces along ``cat_dim`` in mesh order."""
    dg = mesh.dim_group(mesh_dim)
    n = dg.size
    if n == 1:
        return _launch("all_to_all", None, lambda: tensor, async_op)
    x = _wire(tensor.movedim(split_dim, 0))
    x = _chunks_to_group_order(x, dg).contiguous()
    if is_traced(x):
        out, work = _traced("all_to_all", x, dg), None
    else:
        out = torch.empty_like(x)
        work = _issue(dist.all_to_all_single, out, x, group=dg.group)
    _report("all_to_all", (n - 1) * (x.numel() // n) * x.element_size(), n, mesh, mesh_dim)

    def finish():
        if work is not None:
            _free_sent(x, tensor)
        res = _unwire(_chunks_to_coord_order(out, dg), tensor).movedim(0, split_dim)
        # received pieces are stacked along split_dim; lay them side by side along cat_dim
        return torch.cat(res.chunk(n, dim=split_dim), dim=cat_dim)
    return _launch("all_to_all", work, finish, async_op)


def broadcast(tensor: torch.Tensor, mesh, mesh_dim: int, src_coord: int = 0) -> torch.Tensor:
    """Every rank of the mesh dim receives ``tensor`` from the rank at ``src_coord`` (in place)."""
    dg = mesh.dim_group(mesh_dim)
    n = dg.size
    if n == 1:
        return tensor
    x = _wire(tensor)
    src = dg.ranks[src_coord]
    _launch("broadcast", _issue(dist.broadcast, x, src=src, group=dg.group), lambda: None, False)
    _report("broadcast", x.numel() * x.element_size(), n, mesh, mesh_dim)
    out = _unwire(x, tensor)
    if out is not tensor:
        tensor.copy_(out)
    return tensor


def broadcast_object(obj, mesh, mesh_dim: int, src_coord: int = 0):
    """Every rank of the mesh dim receives the picklable ``obj`` of the rank at ``src_coord``
    (others pass anything, e.g. None). For small metadata (a state dict's keys and shapes)."""
    dg = mesh.dim_group(mesh_dim)
    if dg.size == 1:
        return obj
    # the pickled bytes' length, then the bytes: two broadcasts waited like every collective here
    # (torch's broadcast_object_list would wait out the group's timeout for a rank that failed)
    device = torch.device(mesh.device_type)
    src = dg.ranks[src_coord]
    if dg.coordinate == src_coord:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    _launch("broadcast_object", _issue(dist.broadcast, size, src=src, group=dg.group),
            lambda: None, False)
    if dg.coordinate != src_coord:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _launch("broadcast_object", _issue(dist.broadcast, data, src=src, group=dg.group),
            lambda: None, False)
    # the pickled size is not known to every rank in advance
    _report("broadcast_object", 0, dg.size, mesh, mesh_dim)
    return obj if dg.coordinate == src_coord else pickle.loads(data.cpu().numpy().tobytes())


def scatter(chunks: list[torch.Tensor] | None, out: torch.Tensor, mesh, mesh_dim: int,
            src_coord: int = 0) -> torch.Tensor:
    """Rank ``src_coord`` sends ``chunks[k]`` (equal shapes) to coordinate k; others pass None."""
    dg = mesh.dim_group(mesh_dim)
    n = dg.size
    if n == 1:
        out.copy_(chunks[0])
        return out
    x = _wire(out)
    src = dg.ranks[src_coord]
    scatter_list = None
    if dg.coordinate == src_coord:
        wired = [_wire(c) for c in chunks]
        scatter_list = [wired[c] for c in dg.coord_of_group_rank]  # group-rank order
    _launch("scatter", _issue(dist.scatter, x, scatter_list, src=src, group=dg.group),
            lambda: None, False)
    _report("scatter", (n - 1) * x.numel() * x.element_size(), n, mesh, mesh_dim)
    res = _unwire(x, out)
    if res is not out:
        out.copy_(res)
    return out


def flat_all_gather(out: torch.Tensor, inp: torch.Tensor, mesh, mesh_dim: int, async_op=False):
    """FSDP's batched all-gather: 1-D ``inp`` into 1-D ``out`` of n*len(inp), in mesh order
    (requires a sorted mesh row; FSDP meshes always are). ``async_op``: a ``Pending``.
    ``inp`` may be this rank's slot of ``out`` already (FSDP's in-place gather)."""
    dg = mesh.dim_group(mesh_dim)
    if _copies_whole_buffer(out, dg.group):
        work = _issue(_broadcast_slots, out, inp, group=dg.group)
    else:
        work = _issue(_all_gather_single, out, inp, group=dg.group)
    _report("all_gather", (dg.size - 1) * inp.numel() * inp.element_size(), dg.size, mesh,
            mesh_dim)
    return _launch("all_gather", work, lambda: None, async_op)


def all_gather_pieces(pieces: list[torch.Tensor], mesh, mesh_dim: int, async_op=False):
    """``flat_all_gather`` into one buffer per rank (mesh order): this rank's piece is its
    input, the others are written. FSDP gathers so on CPU: the piece it sent can then be freed
    before the unsharded parameters are allocated, so the copy-out holds the received pieces
    beside them, not the whole buffer (on gloo: one in-place broadcast per piece, as
    ``flat_all_gather``; elsewhere c10d's list all-gather)."""
    dg = mesh.dim_group(mesh_dim)
    inp = pieces[dg.coordinate]
    if _copies_whole_buffer(inp, dg.group):
        work = _issue(_broadcast_pieces, pieces, inp, group=dg.group)
    else:
        work = _issue(dist.all_gather, pieces, inp, group=dg.group)
    _report("all_gather", (dg.size - 1) * inp.numel() * inp.element_size(), dg.size, mesh,
            mesh_dim)
    return _launch("all_gather", work, lambda: None, async_op)


def flat_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, mesh, mesh_dim: int,
                        reduce_op: str = "sum", async_op=False):
    """FSDP's batched reduce-scatter of a flat gradient buffer (sum; callers pre/post-divide).
    ``inp`` is FSDP's own packing buffer: on gloo it is all-reduced in place and this rank's
    slot copied out (its other slots are left holding sums too; the work is an all-reduce's)."""
    dg = mesh.dim_group(mesh_dim)
    _report("reduce_scatter", (dg.size - 1) * out.numel() * out.element_size(), dg.size, mesh,
            mesh_dim)
    if not _copies_whole_buffer(inp, dg.group):
        work = _issue(_reduce_scatter_single, out, inp, op=_REDUCE[reduce_op], group=dg.group)
        return _launch("reduce_scatter", work, lambda: None, async_op)
    work = _issue(_all_reduce_in_place, inp, op=_REDUCE[reduce_op], group=dg.group)
    slot = inp.narrow(0, dg.coordinate * out.numel(), out.numel())

    def finish():
        out.copy_(slot)
    return _launch("reduce_scatter", work, finish, async_op)


# gloo's all_gather_into_tensor and reduce_scatter_tensor copy the WHOLE buffer into a private
# one for as long as the collective runs (measured: a 64 MiB all-gather or reduce-scatter raises
# a rank's peak RSS by 66 MiB, an all-reduce by 2 MiB) -- held beside the compute that an
# asynchronous FSDP collective overlaps, that is one more block at the step's peak. Its
# all-reduce and broadcast work in place, and on one host they are faster too (2 ranks, 4 MiB:
# all-gather 2.6-3.7 ms vs one broadcast per rank 1.8-2.1; reduce-scatter 4.5-6.2 vs all-reduce
# 3.3-3.9). So FSDP's flat collectives take those forms on gloo. The all-reduce moves twice a
# reduce-scatter's bytes in theory; gloo's reduce-scatter is slower still on the hosts measured.
def _copies_whole_buffer(t: torch.Tensor, group) -> bool:
    """Whether ``group`` runs collectives on ``t`` through gloo (CPU tensors)."""
    return t.device.type == "cpu" and "gloo" in group_backend(group)


def _all_reduce_in_place(inp: torch.Tensor, op, group, async_op=True):
    """``inp`` all-reduced in place, its work wrapped: unlike gloo's reduce-scatter work, an
    all-reduce's can be waited for in slices (``_failures.wait_work``)."""
    return _Works([dist.all_reduce(inp, op=op, group=group, async_op=True)], buffers=[inp])


def _broadcast_slots(out: torch.Tensor, inp: torch.Tensor, group, async_op=True):
    """All-gather in place: rank k broadcasts slot k of ``out`` (its input, copied in unless it
    is that slot already) -- no buffer beyond ``out``."""
    n, me, size = dist.get_world_size(group), dist.get_rank(group), inp.numel()
    mine = out.narrow(0, me * size, size)
    if mine.data_ptr() != inp.data_ptr():
        mine.copy_(inp)
    slots = [out.narrow(0, k * size, size) for k in range(n)]
    return _Works([dist.broadcast(slot, group=group, group_src=k, async_op=True)
                   for k, slot in enumerate(slots)], buffers=slots)


def _broadcast_pieces(pieces: list[torch.Tensor], inp: torch.Tensor, group, async_op=True):
    """``_broadcast_slots`` with one buffer per rank (``inp``: this rank's, given apart so the
    issue holds a private alias of it like any input)."""
    me = dist.get_rank(group)
    pieces = [inp if k == me else piece for k, piece in enumerate(pieces)]
    return _Works([dist.broadcast(piece, group=group, group_src=k, async_op=True)
                   for k, piece in enumerate(pieces)], buffers=pieces)


def _check_splits(name: str, splits, n: int, rows: int | None):
    """``splits`` as a list of n non-negative ints summing to ``rows`` (None: n equal parts)."""
    if splits is None:
        if rows is not None and rows % n:
            raise ValueError(f"all_to_all_single: {rows} rows do not split evenly over {n} ranks "
                             f"and no {name} was given; pass the per-rank row counts")
        return None if rows is None else [rows // n] * n
    splits = [int(s) for s in splits]
    if len(splits) != n or any(s < 0 for s in splits):
        raise ValueError(f"all_to_all_single: {name}={splits} must give one non-negative row "
                         f"count per rank of the mesh dim ({n} ranks)")
    if rows is not None and sum(splits) != rows:
        raise ValueError(f"all_to_all_single: {name}={splits} sums to {sum(splits)} but the "
                         f"input has {rows} rows along dim 0")
    return splits


def _split_to_group_order(x: torch.Tensor, splits: list[int], dg):
    """Pieces of ``x`` (dim 0, sizes ``splits``, mesh-coordinate order) reordered for the group."""
    if dg.is_sorted:
        return x, splits
    pieces = x.split(splits)
    return (torch.cat([pieces[c] for c in dg.coord_of_group_rank]),
            [splits[c] for c in dg.coord_of_group_rank])


def all_to_all_single(tensor: torch.Tensor, mesh, mesh_dim: int, output_split_sizes=None,
                      input_split_sizes=None, async_op: bool = False):
    """torch's ``all_to_all_single`` over one mesh dim, uneven splits included: rows
    ``input_split_sizes[k]`` of ``tensor`` (dim 0, in order) go to coordinate k; the result holds
    ``output_split_sizes[k]`` rows from each coordinate k, in mesh order. None: equal splits.
    Counted as ``all_to_all``, bytes = the rows sent to *other* ranks (no padding)."""
    dg = mesh.dim_group(mesh_dim)
    n = dg.size
    in_splits = _check_splits("input_split_sizes", input_split_sizes, n, tensor.shape[0])
    out_splits = _check_splits("output_split_sizes", output_split_sizes, n,
                               None if output_split_sizes is not None else tensor.shape[0])
    if n == 1:
        if out_splits != in_splits:
            raise ValueError(f"all_to_all_single on a 1-rank mesh dim: output_split_sizes "
                             f"{out_splits} must equal input_split_sizes {in_splits}")
        return _launch("all_to_all", None, lambda: tensor, async_op)
    x = _wire(tensor)
    if is_traced(x):
        raise NotImplementedError("all_to_all_single with uneven splits cannot be traced by "
                                  "torch.compile yet; run it eagerly (a graph break)")
    row_bytes = x[0].numel() * x.element_size() if x.shape[0] else 0
    x, group_in = _split_to_group_order(x, in_splits, dg)
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    _, group_out = _split_to_group_order(out, out_splits, dg)
    work = _issue(dist.all_to_all_single, out, x.contiguous(), group_out, group_in, group=dg.group)
    _report("all_to_all", (sum(in_splits) - in_splits[dg.coordinate]) * row_bytes, n, mesh,
            mesh_dim)

    def finish():
        res = out
        if not dg.is_sorted:  # group order back to mesh-coordinate order
            pieces = out.split(group_out)
            res = torch.cat([pieces[g] for g in dg.group_rank_of_coord])
        return _unwire(res, tensor)
    return _launch("all_to_all", work, finish, async_op)


class _Works:
    """Several c10d works waited for as one: a send and a receive, the broadcasts of
    ``_broadcast_slots``, or one work that can be waited for in slices."""

    __slots__ = ("works", "buffers", "timed_wait_aborts")

    def __init__(self, works, buffers=(), timed_wait_aborts: bool = False):
        # buffers: the tensor objects the works were given (private to them: see _inflight.py)
        self.works, self.buffers = works, buffers
        # a gloo send / receive whose wait(timeout) runs out closes the pair: _failures.wait_work
        # must not wait for it in slices (it waits on a thread of its own instead)
        self.timed_wait_aborts = timed_wait_aborts

    def wait(self, timeout=None):
        """Like a work's: False (or gloo's error) when ``timeout`` ran out before all finished."""
        for w in self.works:
            if (w.wait() if timeout is None else w.wait(timeout)) is False:
                return False
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def get_future(self):
        """One future for all (see debug_state.on_completion)."""
        if self.timed_wait_aborts:
            raise RuntimeError("no single future for a send/receive pair")
        return torch.futures.collect_all([w.get_future() for w in self.works])


def send_recv(tensor: torch.Tensor | None, mesh, mesh_dim: int, dst: int | None, src: int | None,
              recv_shape=None, recv_dtype=None, async_op: bool = False, kind: str = "send_recv"):
    """Point-to-point over one mesh dim: send ``tensor`` to coordinate ``dst`` and receive a
    tensor of ``recv_shape`` / ``recv_dtype`` (default: ``tensor``'s) from coordinate ``src``;
    either side may be None. Returns the received tensor (None when ``src`` is None). Every rank
    of a pair must issue its sends and receives with a peer in the same order (they match in
    order). ``kind`` names the call for CommDebugMode (``ring_shift`` for a ring's step)."""
    dg = mesh.dim_group(mesh_dim)
    me = dg.coordinate
    if (dst == me) != (src == me):
        raise ValueError(f"{kind}: coordinate {me} sends to {dst} and receives from {src}; a "
                         "rank can only exchange with itself for both (a shift by 0)")
    like = tensor
    shape = tuple(recv_shape) if recv_shape is not None else tuple(tensor.shape)
    dtype = recv_dtype if recv_dtype is not None else tensor.dtype
    if dst == me:  # a shift by a multiple of the ring: stays here
        return _launch(kind, None, lambda: tensor.clone(), async_op)
    works, started, sent, received, x = [], time.perf_counter(), 0, None, None
    hold: list = []  # the private aliases the backend is given (see _inflight.py)
    device = tensor.device if tensor is not None else torch.device(mesh.device_type)
    # gloo's send / recv read and write host memory only: device tensors go through the host
    host = device.type != "cpu" and dist.get_backend(dg.group) == "gloo"
    if dst is not None:
        x = _wire(tensor)
        if is_traced(x):
            raise NotImplementedError(f"{kind} cannot be traced by torch.compile yet; run it "
                                      "eagerly (a graph break)")
        x = x.cpu() if host else x
        works.append(dist.isend(_inflight.private(x, hold), dst=dg.ranks[dst], group=dg.group))
        sent = x.numel() * x.element_size()
    if src is not None:
        if like is None or like.dtype != dtype or tuple(like.shape) != shape:
            like = torch.empty(shape, dtype=dtype, device=device)
        received = _wire(torch.empty_like(like, device="cpu" if host else device))
        works.append(dist.irecv(_inflight.private(received, hold), src=dg.ranks[src],
                                group=dg.group))
    _report(kind, sent, dg.size, mesh, mesh_dim)
    issued = (_Works(works, hold, timed_wait_aborts=True), started, dg.group, hold) \
        if works else None

    def finish():
        if received is None:
            return None
        return _unwire(received.to(device) if host else received, like)
    return _launch(kind, issued, finish, async_op)


def exchange_pieces(sends: dict, recvs: dict, device, async_op: bool = False,
                    kind: str = "cross_mesh", link=None):
    """Point-to-point between arbitrary global ranks over the default group, for moves between
    meshes (which share no mesh dim, so no mesh group spans both): this rank sends the 1-D
    tensor ``sends[r]`` to each global rank ``r`` and receives ``recvs[r] = (numel, dtype)``
    from each ``r``; returns ``{r: received 1-D tensor}``. Every pair must agree on one message
    per direction (the cross-mesh plan guarantees it: every rank derives it from metadata). All
    messages are issued at once (no ordering deadlock) and waited as one work, in slices, so a
    failure posted by any rank stops the wait. A rank with nothing to send or receive returns at
    once. Counted as ``kind`` with the bytes this rank sends. ``link`` (a ``jobs.JobLink``):
    over its process group joining two separately launched jobs, peers numbered as in it."""
    group = link.group if link is not None else dist.distributed_c10d._get_default_group()
    me = link.rank if link is not None else dist.get_rank()
    works, hold, received = [], [], {}  # hold: the private aliases the backend is given
    started = time.perf_counter()
    sent = 0
    host = torch.device(device).type != "cpu" and (link is not None  # gloo joins jobs
                                                   or "gloo" in group_backend(group))
    # receives first, in peer order, then sends (the order within each side only has to match
    # one message per pair, which it does)
    for peer in sorted(recvs):
        numel, dtype = recvs[peer]
        like = torch.empty(0, dtype=dtype)
        buf = _wire(torch.empty(numel, dtype=dtype, device="cpu" if host else device))
        works.append(_point_to_point("recv", _inflight.private(buf, hold), peer, group, link))
        received[peer] = (buf, like)
    for peer in sorted(sends):
        if peer == me:
            raise ValueError("exchange_pieces: a rank does not send to itself (copy locally)")
        x = _wire(sends[peer])
        x = x.cpu() if host else x
        works.append(_point_to_point("send", _inflight.private(x, hold), peer, group, link))
        sent += x.numel() * x.element_size()
    if COMM_SINKS:
        record(kind, sent, dist.get_world_size(), kind, tuple(sorted({me, *sends, *recvs})))
    issued = (_Works(works, hold, timed_wait_aborts=True), started, group, hold) \
        if works else None

    def finish():
        return {peer: _unwire(buf.to(device) if host else buf, like)
                for peer, (buf, like) in received.items()}
    return _launch(kind, issued, finish, async_op)


def all_reduce_max_over(group, values: list) -> list:
    """The max of a few ints over every rank of ``group``, a process group in no world's group
    map (two jobs' joint group, ``jobs.JobLink``): its own all-reduce, waited plainly -- bounded
    by the group's timeout; a peer that died makes gloo raise at once. The backend gets a private
    alias, as every collective here gives it (``_inflight``): this is the last collective of a
    job that closes its link and exits, and gloo's thread lets go of the work a moment after the
    wait returns -- holding ``t`` itself, it would free it after the interpreter began to
    finalize (SIGABRT: tests/test_jobs.py's trainer, 2 runs in 5 on 2 cores)."""
    t = torch.tensor(values, dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    hold = _held(group, t)
    work = group.allreduce(hold, opts)
    try:
        work.wait()
    except BaseException:
        _inflight.abandon(None, hold)
        raise
    del work  # before the aliases (as _wait_issued): the backend's thread may still hold it
    _inflight.retire(hold)
    return t.tolist()


def _point_to_point(op: str, tensor: torch.Tensor, peer: int, group, link):
    """An ``isend`` / ``irecv`` of ``tensor`` with ``peer``: over the default group by global
    rank, or over a group joining two jobs (``link``), which is in no world's group map, by its
    own send / recv in its numbering."""
    if link is None:
        return dist.irecv(tensor, src=peer, group=group) if op == "recv" \
            else dist.isend(tensor, dst=peer, group=group)
    return group.recv([tensor], peer, 0) if op == "recv" else group.send([tensor], peer, 0)


# ---------------------------------------------------------------- tagged point-to-point
# Pipeline schedules (dtensor_lite.pipelining) exchange many messages between one pair of ranks in
# both directions (activations one way, gradients the other, several stages per rank): a tag per
# message lets each receive name the message it wants, whatever order the two ranks post them in.
def send(tensor: torch.Tensor, mesh, mesh_dim: int, dst: int, *, tag: int = 0,
         async_op: bool = False, kind: str = "send"):
    """Send ``tensor`` to coordinate ``dst`` of the mesh dim under ``tag``. With ``async_op`` a
    ``Pending`` (wait before reusing ``tensor``; the tensor is kept alive until then)."""
    dg = mesh.dim_group(mesh_dim)
    x = _wire(tensor)
    if x.device.type != "cpu" and group_backend(dg.group) == "gloo":
        x = x.cpu()  # gloo's send reads host memory only
    started = time.perf_counter()
    hold: list = []  # the private alias the backend is given (see _inflight.py)
    work = dist.isend(_inflight.private(x, hold), dst=dg.ranks[dst], group=dg.group, tag=tag)
    _report(kind, x.numel() * x.element_size(), dg.size, mesh, mesh_dim)
    issued = (_Works([work], hold, timed_wait_aborts=True), started, dg.group, hold)
    return _launch(kind, issued, lambda: None, async_op)


def recv(shape, dtype: torch.dtype, mesh, mesh_dim: int, src: int, *, device=None, tag: int = 0,
         async_op: bool = False, kind: str = "recv"):
    """Receive a tensor of ``shape`` / ``dtype`` sent by coordinate ``src`` under ``tag``;
    returns it (with ``async_op`` a ``Pending`` whose ``wait()`` does)."""
    dg = mesh.dim_group(mesh_dim)
    device = torch.device(device if device is not None else mesh.device_type)
    like = torch.empty(tuple(shape), dtype=dtype, device="meta")
    host = device.type != "cpu" and group_backend(dg.group) == "gloo"
    buf = _wire(torch.empty(tuple(shape), dtype=dtype, device="cpu" if host else device))
    started = time.perf_counter()
    hold: list = []
    work = dist.irecv(_inflight.private(buf, hold), src=dg.ranks[src], group=dg.group, tag=tag)
    _report(kind, 0, dg.size, mesh, mesh_dim)
    issued = (_Works([work], hold, timed_wait_aborts=True), started, dg.group, hold)
    return _launch(kind, issued, lambda: _unwire(buf.to(device) if host else buf, like), async_op)
