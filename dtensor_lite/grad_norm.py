"""Gradient norms over DTensors that live on different meshes (pipeline stages, experts on their
own mesh beside the dense layers, a sub-world mesh).

``torch.nn.utils.clip_grad_norm_`` stacks the per-tensor norms into one tensor, which for
DTensors on several meshes has no mesh to live on. Here each tensor's norm is computed on its own
mesh (``torch._foreach_norm``, one batched all-reduce per mesh dim), every mesh *instance*
contributes its tensors' norms once (from its coordinate-0 rank: a mesh sliced from a bigger one
exists once per row of it, and each row holds its own tensors, as pipeline stages do), and one
all-reduce over the world combines them: every rank gets the same total, so every rank clips by
the same factor. Every rank of the world must call it (like any torch.distributed collective).

Plain (non-DTensor) tensors are taken as the same on every rank and added once, locally.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from . import collectives as C
from ._torch_names import foreach_mul_, foreach_norm
from .dtensor import DTensor, default_mesh

__all__ = ["get_total_norm", "clip_grad_norm_"]


def _by_mesh(tensors):
    groups: dict = {}
    plain = []
    for t in tensors:
        if isinstance(t, DTensor):
            groups.setdefault(t.device_mesh, []).append(t)
        else:
            plain.append(t)
    return groups, plain


def _combine_op(norm_type: float) -> str:
    return "max" if norm_type == math.inf else "min" if norm_type == -math.inf else "sum"


def get_total_norm(tensors: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """The norm of all ``tensors`` together (as if concatenated into one vector), for DTensors on
    any meshes: a plain 0-d tensor, the same on every rank. Collective over the world.

    Example::

        >>> stage0 = DeviceMesh("cpu", [0, 1]); stage1 = DeviceMesh("cpu", [2, 3])
        >>> total = get_total_norm([g0, g1])   # g0 on stage0, g1 on stage1; every rank calls it
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    norm_type = float(norm_type)
    op = _combine_op(norm_type)
    groups, plain = _by_mesh(tensors)
    acc = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    identity = {"sum": 0.0, "max": 0.0, "min": math.inf}[op]
    # on the gradients' device, as torch's total: no copy to the host (a GPU would wait for it)
    device = next(iter(groups)).device_type if groups else (
        plain[0].device if plain else torch.device("cpu"))
    mine = torch.tensor(identity, dtype=acc, device=device)
    for mesh, group in groups.items():  # every rank walks the meshes alike (a dict keeps order)
        norms = foreach_norm(group, norm_type)
        coord = mesh.get_coordinate()
        if coord is None or any(coord):  # outside, or not this instance's coordinate-0 rank
            continue
        mine = _fold(mine, torch.stack([n.to_local().to(device, acc) for n in norms]), op,
                     norm_type)
    if groups:
        mine = C.all_reduce(mine, default_mesh(mine), 0, op)
    if plain:
        mine = _fold(mine, torch.stack([torch.linalg.vector_norm(t.detach().to(acc), norm_type)
                                        .to(device) for t in plain]), op, norm_type)
    total = mine if op != "sum" or norm_type in (0.0, 1.0) else mine.pow(1.0 / norm_type)
    if error_if_nonfinite and (total.isnan() or total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`")
    return total


def _fold(acc: torch.Tensor, norms: torch.Tensor, op: str, norm_type: float) -> torch.Tensor:
    if op == "max":
        return torch.maximum(acc, norms.max())
    if op == "min":
        return torch.minimum(acc, norms.min())
    if norm_type in (0.0, 1.0):
        return acc + norms.sum()
    return acc + norms.pow(norm_type).sum()


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters on any meshes: the total norm of all
    gradients (see :func:`get_total_norm`; the same on every rank), then every gradient scaled
    by ``min(1, max_norm / (total + 1e-6))`` on its own mesh. Returns the total norm.

    Example::

        >>> total = clip_grad_norm_(list(stage0.parameters()) + list(stage1.parameters()), 1.0)
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    if not grads:
        return total
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    groups, plain = _by_mesh(grads)
    for group in groups.values():
        foreach_mul_(group, coef.to(group[0].dtype))
    for g in plain:
        g.mul_(coef.to(g.device, g.dtype))
    return total
