"""``fully_shard(..., dp_mesh_dims=...)`` over parameters annotated with ``spmd_types`` (torch 2.15's
"local SPMD types"; torchtitan 0.3's default ``spmd_backend``).

Such a parameter is a plain tensor -- this rank's piece -- whose annotation says, per mesh axis,
what the piece is: ``S(d)`` (a shard of dim ``d``), ``R`` (replicated; its gradient is a partial
sum), ``I`` (invariant: replicated, gradient replicated too). Modules compute on plain tensors and
issue their own collectives. FSDP therefore:

- stores it as a DTensor on the full mesh: ``Replicate()`` on the data-parallel dims (which FSDP
  then shards), and the annotation's placement on every other dim (:func:`storage_placements`);
- hands modules the gathered piece as a plain tensor again, whose gradient is reduced over the
  non-data-parallel dims where the annotation's backward type is ``P`` (an ``R`` parameter beside
  sequence-sharded activations: each rank's gradient is a partial sum) -- :meth:`SpmdCompute.view`.

``spmd_types`` is not a dependency: it is used only when a parameter carries its annotation, which
means the program imported it already (hence ``sys.modules``, never an import of ours).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from dtensor_lite import DTensor, DeviceMesh, Replicate
from dtensor_lite.placements import as_placement

__all__ = ["SpmdCompute", "is_annotated", "storage_placements"]


def _spmd():
    return sys.modules.get("spmd_types")


def is_annotated(param) -> bool:
    """``param`` is a plain tensor carrying a ``spmd_types`` annotation."""
    spmd = _spmd()
    return (spmd is not None and not isinstance(param, DTensor)
            and bool(spmd.get_local_type(param)))


@dataclass(frozen=True)
class SpmdCompute:
    """How modules see an annotated parameter: plain, gradient reduced over the dims where its
    backward type is Partial, annotation restored when spmd_types checks types."""

    grad_placements: tuple   # per non-data-parallel dim (ours)
    local_type: dict         # the user's annotation, restored on the compute tensor
    partition_spec: object

    @property
    def reduces_grad(self) -> bool:
        return any(p.is_partial() for p in self.grad_placements)

    def view(self, unsharded: torch.Tensor, tp_spec) -> torch.Tensor:
        """The tensor modules compute with, for the gathered piece ``unsharded`` (``tp_spec``:
        its layout on the non-data-parallel dims, ``None`` if there are none)."""
        t = unsharded
        if tp_spec is not None and self.reduces_grad:
            # identity forward; backward: the plain gradient is read with the backward
            # placements (Partial where the annotation is R) and reduced to the forward ones
            t = DTensor.from_local(unsharded, tp_spec.mesh, tp_spec.public_placements(),
                                   shape=tp_spec.shape, stride=tp_spec.stride).to_local(
                grad_placements=self.grad_placements)
        spmd = _spmd()
        if self.local_type and spmd is not None and spmd.is_type_checking():
            spmd.assert_type(t, dict(self.local_type), partition_spec=self.partition_spec)
        return t


def storage_placements(param: torch.Tensor, where: str, mesh: DeviceMesh,
                       dp_names: set[str]) -> tuple[list, SpmdCompute]:
    """The placements on ``mesh`` of the annotated plain ``param`` (``Replicate()`` on the
    data-parallel dims ``dp_names``), and how modules compute with it.

    As torch's FSDP: an annotation on a data-parallel axis must be ``R`` (FSDP owns that
    reduction) and may be left out; every other dim of ``mesh`` must be annotated."""
    spmd = _spmd()
    from spmd_types.runtime import get_partition_spec
    from spmd_types.types import partition_spec_to_shard_types

    init_type = dict(spmd.get_local_type(param))
    spec = get_partition_spec(param)
    local_type = dict(init_type)
    if spec is not None:
        local_type.update(partition_spec_to_shard_types(spec))
    axes = {name: spmd.MeshAxis.of(mesh.get_group(name)) for name in mesh.mesh_dim_names}
    by_axis = {axis: name for name, axis in axes.items()}
    dp_axes = [axes[n] for n in mesh.mesh_dim_names if n in dp_names]
    fwd, bwd = [], []
    for name in mesh.mesh_dim_names:
        if name in dp_names:
            fwd.append(Replicate())
            continue
        if axes[name] not in local_type:
            raise ValueError(
                f"fully_shard: parameter {where} has spmd_types annotations "
                f"{_names(local_type, by_axis)} but none for the non-data-parallel mesh dim "
                f"{name!r}; annotate it there (e.g. spmd.S(0), spmd.R or spmd.I), or name "
                "the dim in dp_mesh_dims if FSDP should shard over it")
        kind = local_type[axes[name]]
        fwd.append(as_placement(spmd.spmd_type_to_dtensor_placement(kind)))
        bwd.append(as_placement(spmd.spmd_type_to_dtensor_placement(kind.backward_type())))
    for axis, kind in local_type.items():
        if axis in by_axis:
            name = by_axis[axis]
            if name in dp_names and kind is not spmd.R:
                raise ValueError(
                    f"fully_shard: parameter {where} is annotated {kind} on the data-parallel "
                    f"mesh dim {name!r}; FSDP shards it there and reduces its gradient, so the "
                    "annotation must be spmd.R (or left out)")
        elif not any(_within(axis, a) for a in dp_axes) and not _within(axis, _flat(dp_axes)):
            raise ValueError(
                f"fully_shard: parameter {where} has an spmd_types annotation on mesh axis "
                f"{axis}, which is not a dim of the mesh given to fully_shard "
                f"({list(mesh.mesh_dim_names)}) nor part of its data-parallel dims")
    return fwd, SpmdCompute(tuple(bwd), init_type, spec)


def _within(axis, container) -> bool:
    try:
        return container is not None and axis <= container  # MeshAxis: rank-set containment
    except TypeError:
        return False


def _flat(axes):
    if not axes:
        return None
    from spmd_types._mesh_axis import flatten_axes
    return flatten_axes(tuple(axes))


def _names(local_type: dict, by_axis: dict) -> dict:
    return {by_axis.get(axis, str(axis)): str(kind) for axis, kind in local_type.items()}
