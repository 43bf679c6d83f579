"""Running a redistribute plan on this rank's local tensor, one step at a time.

Uneven shards are padded to the chunk size only inside the collective and trimmed right after;
the ``torch.chunk`` layout (full chunks first) makes pad-then-trim exact.
"""
from __future__ import annotations

import torch

from .. import collectives as C
from ..compile_support import is_traced
from .._failures import post_failure
from ..placements import LINEAR_REDUCE_OPS
from ..spec import chunk_range
from .planner import RedistributePlan, Step
from .steps import STEP_KINDS

__all__ = ["run_plan"]


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    extra = size - t.shape[dim]
    if extra == 0:
        return t
    pad_shape = list(t.shape)
    pad_shape[dim] = extra
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)


def _identity_value(op: str, dtype: torch.dtype):
    if op in LINEAR_REDUCE_OPS:
        # -0.0, not 0.0: x + (-0.0) is x bit for bit (x + 0.0 turns -0.0 into +0.0), and the
        # planner takes S -> P(sum) -> R for small dims, which must be as exact as an all_gather
        return complex(-0.0, -0.0) if dtype.is_complex else -0.0 if dtype.is_floating_point else 0
    if op == "product":
        return 1
    if dtype == torch.bool:
        return op == "min"
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    if dtype.is_floating_point:
        return float("-inf") if op == "max" else float("inf")
    return info.min if op == "max" else info.max


def _run_step(x: torch.Tensor, step: Step, async_op: bool = False):
    """One step on this rank's piece. ``async_op`` (collective steps only): a ``Pending``."""
    mesh = step.before.mesh
    i = step.mesh_dim
    n = mesh.shape[i]
    kind = step.kind
    before_shape = step.before.local_shape()
    after_shape = step.after.local_shape()
    if kind == "all_gather":
        d = step.src.dim
        parent = after_shape[d]
        x = _pad_to(x, d, -(-parent // n))
        return C.then(C.all_gather(x, mesh, i, gather_dim=d, async_op=async_op),
                       lambda out: out.narrow(d, 0, parent))
    if kind == "reduce_scatter":
        d = step.dst.dim
        x = _pad_to(x, d, n * -(-before_shape[d] // n))
        out = C.reduce_scatter(x, mesh, i, step.src.reduce_op, scatter_dim=d, async_op=async_op)
        return C.then(out, lambda out: out.narrow(d, 0, after_shape[d]))
    if kind == "all_reduce":
        return C.all_reduce(x, mesh, i, step.src.reduce_op, async_op=async_op)
    if kind == "all_to_all":
        d, e = step.src.dim, step.dst.dim
        parent_d = after_shape[d]
        x = _pad_to(x, d, -(-parent_d // n))
        x = _pad_to(x, e, n * -(-before_shape[e] // n))
        out = C.all_to_all(x, mesh, i, split_dim=e, cat_dim=d, async_op=async_op)
        return C.then(out, lambda out: out.narrow(d, 0, parent_d).narrow(e, 0, after_shape[e]))
    coord = mesh.get_coordinate()[i]
    if kind == "chunk":
        d = step.dst.dim
        start, size = _chunk_start(before_shape[d], n, coord)
        return x.narrow(d, start, size)
    if kind == "to_partial":
        if step.dst.reduce_op in ("sum", "product") and coord != 0:
            return torch.zeros_like(x) if step.dst.reduce_op == "sum" else torch.ones_like(x)
        return x
    if kind == "pad_to_partial":
        d, op = step.src.dim, step.dst.reduce_op
        full_shape = list(x.shape)
        full_shape[d] = after_shape[d]
        out = x.new_full(full_shape, _identity_value(op, x.dtype))
        start, size = _chunk_start(after_shape[d], n, coord)
        out.narrow(d, start, size).copy_(x * n if op == "avg" else x)
        return out
    if kind == "rescale":
        return x * n if step.dst.reduce_op == "avg" else x / n
    raise AssertionError(f"unknown redistribute step {kind}")


def _chunk_start(length, n, coord):
    return chunk_range(length, n, coord)


def run_plan(local: torch.Tensor, plan: RedistributePlan, async_op: bool = False):
    """Apply ``plan`` to this rank's ``local`` tensor; the result never aliases ``local``.

    ``async_op``: every step up to the plan's last collective runs now, that collective is only
    issued, and a ``collectives.Pending`` comes back whose ``wait()`` finishes it and runs the
    steps after it (a plan without a collective returns its result directly)."""
    steps = plan.steps
    traced = is_traced(local)
    if steps and not traced:
        _check_piece(local, steps[0].before)
    async_op = async_op and not traced  # in a graph, the compiler places the waits
    last = max((k for k, s in enumerate(steps) if STEP_KINDS[s.kind].collective), default=-1)
    x = local
    for k, step in enumerate(steps):
        if async_op and k == last:
            return _run_step(x, step, async_op=True).then(
                lambda out: _finish_plan(out, steps[k + 1:], local))
        x = _run_step(x, step)
    return _finish_plan(x, (), local) if steps else x


def _check_piece(local: torch.Tensor, spec) -> None:
    """The collectives are sized from the spec; a piece of another shape must not reach them
    (pad-to-chunk would fail, or gloo would get buffers of different sizes and abort)."""
    expected = spec.local_shape()
    if tuple(local.shape) != tuple(expected):
        error = ValueError(
            f"redistribute: this rank's local piece has shape {tuple(local.shape)} but its spec "
            f"(global shape {tuple(spec.shape)}, placements {list(spec.placements)}) says it "
            f"holds {tuple(expected)}; the DTensor was built from an inconsistent piece (or its "
            "local tensor was resized in place). Build it with DTensor.from_local(..., shape=) or "
            "run_check=True")
        post_failure(error)  # only this rank sees it: the others stop in their collective
        raise error


def _finish_plan(x: torch.Tensor, steps, local: torch.Tensor) -> torch.Tensor:
    for step in steps:
        x = _run_step(x, step)
    # storage identity, not data_ptr: fake tensors (torch.compile) have storages but no data
    if local.numel() > 0 and x.untyped_storage()._cdata == local.untyped_storage()._cdata:
        x = x.clone()  # a plan of only local slices must not hand back a view of its input
    return x
