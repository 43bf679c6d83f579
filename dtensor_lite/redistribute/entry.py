"""Redistributing one rank's local piece: what the DTensor methods, the dispatcher and rules that
move their inputs themselves call."""
from __future__ import annotations

import contextlib
import math

import torch

from .. import _caches, collectives as C
from ..compile_support import is_traced
from ..spec import DTensorSpec, normalize_placements, outside_shape
from .cross_mesh import check_meshes, plan_cross_mesh, redistribute_across_meshes, reduced_source
from .executor import run_plan
from .planner import _PLANS, plan_redistribute

__all__ = ["redistribute_local", "redistribute_locals", "redistribute_target",
           "explain_redistribute"]


def redistribute_local(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec,
                       async_op: bool = False):
    """``local`` (this rank's piece of a tensor laid out as ``src``) laid out as ``dst``: the
    same tensor when nothing changes, else a new one; with ``async_op`` maybe a ``Pending``."""
    if not async_op:
        run = _RUNNERS.get((src, dst))  # specs are interned: the key hashes in C
        if run is None:
            run = _caches.remember(_RUNNERS, (src, dst), _sync_runner(src, dst) or _NO_RUNNER,
                                   _PLANS)
        if run is not _NO_RUNNER:
            out = run(local)
            if out is not None:
                return out
    if src == dst:
        return local
    if dst.mesh is src.mesh or dst.mesh == src.mesh:
        if src.mesh._coordinate is None:  # outside the mesh: nothing held, nothing moved
            return local.new_zeros(outside_shape(dst.ndim))
    else:
        return redistribute_across_meshes(local, src, dst)
    if src.tensor_meta != dst.tensor_meta:  # e.g. a gradient of another dtype than its input
        src = DTensorSpec(src.mesh, src.placements, dst.tensor_meta, src.shard_order)
    return run_plan(local, plan_redistribute(src, dst), async_op)


# (src spec, dst spec) -> a function running the plan's one collective with every choice made
# (collectives.sync_runner), or _NO_RUNNER where the plan takes run_plan
_RUNNERS: dict = _caches.register_decisions({})
_NO_RUNNER = object()
_SYNC_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _sync_runner(src: DTensorSpec, dst: DTensorSpec):
    """For a plan of exactly one all-gather, sum reduce-scatter or sum all-reduce on pieces
    that need no padding, on one mesh this rank is in: ``collectives.sync_runner`` for it."""
    step = _only_step(src, dst)
    if step is None or step.kind not in _SYNC_KINDS:
        return None
    before, after = step.before.local_shape(), step.after.local_shape()
    if step.kind == "all_gather":
        dim = step.src.dim
        if after[dim] != before[dim] * src.mesh.shape[step.mesh_dim]:
            return None  # uneven: padded inside the collective (run_plan)
    elif step.src.reduce_op != "sum":
        return None
    else:
        dim = step.dst.dim if step.kind == "reduce_scatter" else 0
    return C.sync_runner(step.kind, src.mesh, step.mesh_dim, dim, tuple(src.local_shape()),
                         src.dtype, torch.device(src.mesh.device_type))


def redistribute_locals(pieces, srcs, dsts, cause=None) -> list:
    """``redistribute_local`` for several inputs of one op (``dsts[k] is None``: ``pieces[k]``
    stays). Pieces whose plan is one sum all-reduce over the same group, dtype and device (a
    foreach optimizer step over ``Partial`` gradients) travel in one flat all-reduce instead of
    one each: the collective's fixed cost (issue, wait, bookkeeping, ~0.2 ms of host time on
    gloo) is paid once. Sums are elementwise, so the values are those of separate all-reduces.
    ``cause(k)``: a context manager labelling the move of input ``k`` (CommDebugMode); a flat
    all-reduce is labelled with its first input.

    Which pieces share a flat all-reduce follows from the specs alone, so it is worked out once
    per (sources, targets) (``_batching``) -- an optimizer step asks the same every step; only
    what a piece could contradict its spec with (shape, dtype, device, a trace) is checked per
    call."""
    out = list(pieces)
    key = (tuple(srcs), tuple(dsts))  # specs are interned: the key hashes in C
    batching = _BATCHINGS.get(key)
    if batching is None:
        batching = _caches.remember(_BATCHINGS, key, _batching(srcs, dsts), _PLANS)
    batches, singles = batching
    if batches and not _fits(pieces, srcs, batches):  # a piece unlike its spec: grouped per call
        batches, singles = _batching(srcs, dsts, pieces)
    for ks, mesh, mesh_dim, _, sizes, run in batches:
        flat = torch.cat([pieces[k].reshape(-1) for k in ks])
        reduced = run(flat) if run is not None and cause is None else None
        if reduced is None:  # a debug mode watches, or no runner: the general all-reduce
            with cause(ks[0]) if cause is not None else _NO_CAUSE:
                reduced = C.all_reduce(flat, mesh, mesh_dim)
        for k, part in zip(ks, reduced.split_with_sizes(sizes)):
            out[k] = part.view(pieces[k].shape)
    for k in singles:
        with cause(k) if cause is not None else _NO_CAUSE:
            out[k] = redistribute_local(pieces[k], srcs[k], dsts[k])
    return out


# (source specs, target specs) -> their _batching
_BATCHINGS: dict = _caches.register_decisions({})


def _batching(srcs, dsts, pieces=None):
    """``(batches, singles)`` for ``redistribute_locals``: each batch ``(indices, mesh, mesh
    dim, (dtype, device type), sizes, run)`` is two or more pieces moved by one sum all-reduce
    over one group, dtype and device (``run``: its ``collectives.sync_runner``, or None);
    ``singles``, the indices
    moved one by one. From the specs, or from ``pieces`` where given (one that contradicts
    its spec goes alone, where its move raises the error)."""
    flat: dict = {}  # (mesh, mesh dim, dtype, device) -> indices of its pieces
    for k, (src, dst) in enumerate(zip(srcs, dsts)):
        if dst is None:
            continue
        piece = None if pieces is None else pieces[k]
        mesh_dim = _sum_all_reduce_dim(src, dst, piece)
        dtype = src.dtype if piece is None else piece.dtype
        device = src.mesh.device_type if piece is None else piece.device.type
        flat.setdefault((id(src.mesh), mesh_dim, dtype, device), []).append(k)
    batches, singles = [], []
    for (_, mesh_dim, dtype, device), ks in flat.items():
        if mesh_dim is None or len(ks) < 2:
            singles += ks
            continue
        mesh = srcs[ks[0]].mesh
        sizes = [math.prod(srcs[k].local_shape()) for k in ks]
        run = C.sync_runner("all_reduce", mesh, mesh_dim, 0, (sum(sizes),), dtype,
                            torch.device(device))
        batches.append((ks, mesh, mesh_dim, (dtype, device), sizes, run))
    return batches, sorted(singles)


def _fits(pieces, srcs, batches) -> bool:
    """Whether every batched piece is what its spec says (shape, dtype, device, no trace): the
    batching made from the specs holds for these pieces."""
    for ks, _, _, (dtype, device), _, _ in batches:
        for k in ks:
            piece = pieces[k]
            if piece.shape != srcs[k].local_shape() or piece.dtype != dtype or \
                    piece.device.type != device or is_traced(piece):
                return False
    return True


def _sum_all_reduce_dim(src, dst, piece=None) -> int | None:
    """The mesh dim, if moving a piece from ``src`` to ``dst`` is exactly one sum all-reduce
    of a floating piece of the spec's shape (``piece``, where given, is checked to be one);
    else None (anything else -- a wrong-shaped piece included, whose error ``run_plan`` raises
    -- goes the ordinary way)."""
    step = _only_step(src, dst)
    if step is None or step.kind != "all_reduce" or step.src.reduce_op != "sum" or \
            not src.dtype.is_floating_point:
        return None
    if piece is not None and (piece.dtype != src.dtype or is_traced(piece) or
                              tuple(piece.shape) != tuple(src.local_shape())):
        return None
    return step.mesh_dim


def _only_step(src: DTensorSpec, dst: DTensorSpec):
    """The step, if moving a piece from ``src`` to ``dst`` is one step on one mesh this rank is
    in, with the same tensor metadata; else None (what the shortcuts above may serve)."""
    if src == dst or dst.mesh is not src.mesh or src.mesh._coordinate is None or \
            src.tensor_meta != dst.tensor_meta:
        return None
    steps = plan_redistribute(src, dst).steps
    return steps[0] if len(steps) == 1 else None


_NO_CAUSE = contextlib.nullcontext()  # reusable: it holds nothing


def redistribute_target(src: DTensorSpec, device_mesh, placements) -> DTensorSpec:
    """The spec ``redistribute(device_mesh, placements)`` of a DTensor laid out as ``src`` aims
    at, with the user's arguments checked (once per (spec, mesh, placements): a training step
    asks the same every time)."""
    try:
        placements = tuple(placements)  # once: a generator would be spent by the key
        key = (src, id(device_mesh), placements)
        hit = _TARGETS.get(key)
    except TypeError:  # None, or something unhashable: the checks below say what is wrong
        key = hit = None
    if hit is not None and hit[0] is device_mesh:
        return hit[1]
    dst = _checked_target(src, device_mesh, placements)
    if key is not None:  # the mesh itself: its id alone could be reused
        _caches.remember(_TARGETS, key, (device_mesh, dst), _PLANS)
    return dst


_TARGETS: dict = _caches.register_decisions({})


def _checked_target(src: DTensorSpec, device_mesh, placements) -> DTensorSpec:
    mesh = src.mesh if device_mesh is None else device_mesh
    if mesh != src.mesh:
        check_meshes(src.mesh, mesh)
    else:
        mesh = src.mesh
    if placements is None:
        raise ValueError("redistribute needs placements, e.g. [Replicate()] or [Shard(0)]")
    placements = normalize_placements(placements, mesh, src.ndim)
    return DTensorSpec(mesh, placements, src.tensor_meta)


def explain_redistribute(dtensor, device_mesh=None, placements=None, *, print_plan: bool = False):
    """The plan ``dtensor.redistribute(device_mesh, placements)`` would run, without running it.

    Example::

        >>> plan = explain_redistribute(x, mesh, [Replicate(), Shard(0)])
        >>> print(plan)          # steps, collectives and bytes per rank
        >>> plan.cost            # bytes sent by the busiest rank
    """
    src = dtensor._spec
    dst = redistribute_target(src, device_mesh, placements)
    if dst.mesh != src.mesh:  # onto another mesh: the per-rank-pair boxes (cross_mesh.py)
        plan = plan_cross_mesh(reduced_source(src), dst)
        if print_plan:
            print(plan)
        return plan
    plan = plan_redistribute(src, dst)
    if print_plan:
        from rich.console import Console
        Console().print(plan.table())
    return plan
