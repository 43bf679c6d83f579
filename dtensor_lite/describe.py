"""Describing distributed tensors without data: the layout of a tensor (shape, dtype, mesh,
placements) that this rank holds nothing of -- the trainer's weights seen from an engine-only
rank, or a whole model of another job.

``describe(shape, dtype, mesh, placements)`` returns the tensor's ``DTensorSpec``, which
``plan_relayout`` (and ``RelayoutPlan.run``) accept wherever a DTensor is. It works on any rank,
in the mesh or not, and allocates nothing (``DTensor.from_local`` with an empty piece needs a
piece of the right rank count and fails outside the mesh for ``Shard(1)``). The mesh may be a
``DeviceMesh`` of this world or a :class:`MeshLayout`: a mesh described by its ranks only (no
process groups), e.g. another job's mesh in the joint numbering of ``dtensor_lite.jobs``.

Example::

    >>> trainer_side = describe_model(Llama(cfg).to("meta"), trainer_mesh, [Shard(0)])
    >>> plan = plan_relayout(trainer_side, engine_model, dtype=torch.bfloat16)
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn

from .mesh_layout import MeshLayout
from .redistribute.cross_mesh import mesh_instances
from .spec import DTensorSpec, TensorMeta, contiguous_stride, normalize_placements

__all__ = ["MeshLayout", "describe", "describe_model", "describe_mesh"]


def describe_mesh(mesh, rank_offset: int = 0) -> MeshLayout:
    """A ``DeviceMesh`` (every instance of it) as a :class:`MeshLayout` whose ranks are shifted
    by ``rank_offset`` (its world's ranks in a numbering joining several worlds)."""
    return MeshLayout(mesh.device_type, [i + rank_offset for i in mesh_instances(mesh)],
                      mesh.mesh_dim_names)


def describe(shape, dtype: torch.dtype, mesh, placements) -> DTensorSpec:
    """The layout of a tensor of global ``shape`` and ``dtype`` on ``mesh`` (a ``DeviceMesh`` or
    a :class:`MeshLayout`) with ``placements`` -- no data, on any rank.

    Example::

        >>> spec = describe((4096, 4096), torch.float32, trainer_mesh, [Shard(0)])
        >>> plan_relayout({"w": spec}, {"w": engine_w})
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"describe: dtype must be a torch.dtype, got {dtype!r}")
    try:
        shape = torch.Size(int(n) for n in shape)
    except (TypeError, ValueError):
        raise TypeError(f"describe: shape must be a sequence of ints, got {shape!r}") from None
    if any(n < 0 for n in shape):
        raise ValueError(f"describe: shape {tuple(shape)} has a negative size")
    if not hasattr(mesh, "shape") or not hasattr(mesh, "get_coordinate"):
        raise TypeError(f"describe: mesh must be a DeviceMesh or a MeshLayout, got "
                        f"{type(mesh).__name__}")
    try:
        placements = normalize_placements(placements, mesh, len(shape))
    except ValueError as e:
        raise ValueError(f"describe{tuple(shape)}: {e}") from None
    return DTensorSpec(mesh, placements, TensorMeta(shape, contiguous_stride(shape), dtype))


def describe_model(model, mesh, placements: Sequence | Callable,
                   dtype: torch.dtype | None = None) -> dict:
    """{name: spec} for every parameter of ``model`` (a module -- on the ``meta`` device costs no
    memory -- or ``{name: tensor or shape}``), laid out on ``mesh`` with ``placements`` (or
    ``placements(name, shape)``), in ``dtype`` (default: the parameter's)."""
    table = dict(model.named_parameters()) if isinstance(model, nn.Module) else dict(model)
    out = {}
    for name, t in table.items():
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t)
        pl = placements(name, shape) if callable(placements) else placements
        dt = dtype or (t.dtype if isinstance(t, torch.Tensor) else None)
        if dt is None:
            raise ValueError(f"describe_model: {name!r} is given by shape only; pass dtype=")
        out[name] = describe(shape, dt, mesh, pl)
    return out
