"""Redistributing one rank's local piece: what the DTensor methods, the dispatcher and rules that
move their inputs themselves call."""
from __future__ import annotations

import torch

from ..spec import DTensorSpec, normalize_placements, outside_shape
from .cross_mesh import check_meshes, plan_cross_mesh, redistribute_across_meshes, reduced_source
from .executor import run_plan
from .planner import plan_redistribute

__all__ = ["redistribute_local", "redistribute_target", "explain_redistribute"]


def redistribute_local(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec,
                       async_op: bool = False):
    """``local`` (this rank's piece of a tensor laid out as ``src``) laid out as ``dst``: the
    same tensor when nothing changes, else a new one; with ``async_op`` maybe a ``Pending``."""
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


def redistribute_target(src: DTensorSpec, device_mesh, placements) -> DTensorSpec:
    """The spec ``redistribute(device_mesh, placements)`` of a DTensor laid out as ``src`` aims
    at, with the user's arguments checked."""
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
