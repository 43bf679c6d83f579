"""``fully_shard(..., mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))``: torch 2.13's way
to name the data-parallel dims of the full SPMD mesh instead of slicing them out by hand.

A front end onto the sliced-mesh path (docs/2d.md), nothing more: the named dims become the
data-parallel mesh (several names flattened into one dim), each parameter -- a DTensor on the full
mesh, ``Replicate()`` on every data-parallel dim -- is re-expressed on the remaining dims (the TP
layout FSDP-over-TP already handles; a plain tensor when no dim remains), and the sharded
parameters are put back in the full mesh's dim order (:func:`in_mesh_order`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from dtensor_lite import DTensor, DeviceMesh
from dtensor_lite.spec import DTensorSpec

from .spmd_types_params import is_annotated, storage_placements

__all__ = ["DataParallelMeshDims", "data_parallel_mesh", "non_dp_mesh", "param_off_dp_dims",
           "in_mesh_order"]


@dataclass
class DataParallelMeshDims:
    """Which dims of the full mesh given to ``fully_shard`` are data parallel (torch's name).

    ``shard``: the dim name(s) FSDP shards parameters on (a tuple is flattened into one dim);
    ``replicate``: the HSDP replication dim name(s) (likewise). ``shard`` must be set.

        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self):
        for field in ("shard", "replicate"):
            value = getattr(self, field)
            if isinstance(value, list):
                value = tuple(value)
                setattr(self, field, value)
            ok = value is None or isinstance(value, str) or (
                isinstance(value, tuple) and value and all(isinstance(n, str) for n in value))
            if not ok:
                raise TypeError(f"DataParallelMeshDims.{field} must be a mesh dim name, a "
                                f"non-empty tuple of names, or None; got {value!r}")
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs at least one of shard= and replicate=: "
                             "name the mesh dim(s) FSDP shards on, e.g. "
                             "DataParallelMeshDims(shard='dp')")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _as_tuple(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _as_tuple(self.replicate)


def _as_tuple(names) -> tuple[str, ...]:
    return () if names is None else (names,) if isinstance(names, str) else tuple(names)


def data_parallel_mesh(mesh: DeviceMesh, dims: DataParallelMeshDims) -> DeviceMesh:
    """The 1-D (shard) or 2-D (replicate, shard) mesh ``fully_shard`` shards over, from the names
    in ``dims``; a dim named by a tuple is the flattened product of those dims."""
    if not isinstance(dims, DataParallelMeshDims):
        raise TypeError(f"fully_shard: dp_mesh_dims must be a DataParallelMeshDims, got "
                        f"{type(dims).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: with dp_mesh_dims, mesh must be the full dtensor_lite "
                        f"DeviceMesh, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(f"fully_shard: dp_mesh_dims names mesh dims, but {mesh!r} has no dim "
                         "names; build it with init_device_mesh(..., mesh_dim_names=(...))")
    shard, replicate = dims.shard_names, dims.replicate_names
    unknown = [n for n in shard + replicate if n not in names]
    if unknown:
        raise ValueError(f"fully_shard: dp_mesh_dims names {unknown} that are not dims of {mesh!r}"
                         f" (its dims: {list(names)})")
    if len(set(shard + replicate)) != len(shard + replicate):
        raise ValueError(f"fully_shard: {dims} names a mesh dim twice; each data-parallel dim is "
                         "either sharded or replicated")
    if not shard:
        raise ValueError(f"fully_shard: {dims} has no shard dim; replication alone (DDP) is not "
                         "supported by fully_shard here: name the dim(s) to shard on with shard=")
    dp = _one_dim(mesh, shard)
    return dp if not replicate else _one_dim(mesh, replicate).join(dp)


def _one_dim(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))  # the root learns the name: idempotent


def non_dp_mesh(mesh: DeviceMesh, dims: DataParallelMeshDims) -> DeviceMesh | None:
    """The dims of ``mesh`` that ``dims`` does not name (TP, ...), in order; ``None`` if none."""
    dp_names = set(dims.shard_names + dims.replicate_names)
    rest = tuple(n for n in mesh.mesh_dim_names if n not in dp_names)
    return mesh[rest] if rest else None


def param_off_dp_dims(param, where: str, mesh: DeviceMesh, dims: DataParallelMeshDims,
                      rest: DeviceMesh | None) -> nn.Parameter:
    """``param`` (a DTensor on ``mesh``, Replicate on each data-parallel dim; or a plain tensor
    with a ``spmd_types`` annotation saying that) as the same local data on ``rest`` =
    :func:`non_dp_mesh` (a plain tensor when that is ``None``): what the sliced-mesh path
    takes."""
    compute = None
    if is_annotated(param):
        # spmd_types' plain local piece: stored as the DTensor its annotation describes
        placements, compute = storage_placements(
            param, where, mesh, set(dims.shard_names + dims.replicate_names))
        param = DTensor.from_local(param.detach(), mesh, placements,
                                   run_check=False).requires_grad_(param.requires_grad)
    if not isinstance(param, DTensor) or param.device_mesh != mesh:
        got = (f"a DTensor on {param.device_mesh!r}" if isinstance(param, DTensor)
               else f"a plain {type(param).__name__}")
        raise ValueError(
            f"fully_shard: with dp_mesh_dims every parameter must be a DTensor on the full mesh "
            f"{mesh!r}; parameter {where} is {got}. Distribute it first, e.g. "
            f"distribute_tensor(w, mesh, [Replicate()] * {mesh.ndim}), or pass it in "
            "ignored_params")
    names, placements = mesh.mesh_dim_names, param.placements
    dp_names = set(dims.shard_names + dims.replicate_names)
    bad = [f"{p!r} on {n!r}" for n, p in zip(names, placements)
           if n in dp_names and not p.is_replicate()]
    if bad:
        raise ValueError(
            f"fully_shard: parameter {where} has placements {list(placements)} on {names}, but a "
            f"data-parallel dim must be Replicate() (got {', '.join(bad)}); FSDP does the "
            "sharding there: redistribute it to Replicate() on those dims first")
    local = param.detach().to_local()
    if rest is not None:
        keep = [names.index(n) for n in rest.mesh_dim_names]
        local = DTensor(local, respec(param._spec, rest, keep))
    # else replicated on every dim: the local tensor is the whole parameter
    new = nn.Parameter(local, requires_grad=param.requires_grad)
    if compute is not None:
        new._dtl_spmd_compute = compute  # FSDPParam: modules see plain pieces again
    return new


def respec(spec: DTensorSpec, mesh: DeviceMesh, dims: list[int]) -> DTensorSpec:
    """``spec`` on ``mesh``, whose dim ``k`` is dim ``dims[k]`` of ``spec.mesh``: placements and
    shard order follow (dims left out must not shard anything)."""
    new_index = {old: k for k, old in enumerate(dims)}
    order = tuple(tuple(new_index[i] for i in o) for o in spec.shard_order)
    return DTensorSpec(mesh, [spec.placements[i] for i in dims], spec.tensor_meta, order)


def in_mesh_order(spec: DTensorSpec, full: DeviceMesh) -> DTensorSpec:
    """The sharded parameter's spec (data-parallel dims first, then the others) with its mesh dims
    in the order of ``full``, the mesh the user passed: on ``full`` itself unless a tuple of
    names was flattened into one dim (torch keeps that flattened dim in place, as here)."""
    joined = spec.mesh
    position = {d: i for i, ds in enumerate(full.root_dims) for d in ds}
    dims = sorted(range(joined.ndim), key=lambda k: min(position[d] for d in joined.root_dims[k]))
    root_dims = tuple(joined.root_dims[k] for k in dims)
    if root_dims == full.root_dims:
        target = full
    else:
        target = joined[tuple(joined.mesh_dim_names[k] for k in dims)]
    return spec if target is joined else respec(spec, target, dims)
