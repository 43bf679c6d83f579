"""Which mesh dims shard and which replicate the parameters of one ``fully_shard`` call.

A 1-D mesh shards over all its ranks (FSDP). A 2-D mesh ``(replicate, shard)`` is HSDP: shard
within dim 1, replicate across dim 0. ``reshard_after_forward=N`` needs a third, smaller group:
the shard dim cut into consecutive groups of ``N`` ranks (see :meth:`MeshInfo.post_forward`).
"""
from __future__ import annotations

import torch

from dtensor_lite import DeviceMesh, Replicate, Shard

__all__ = ["MeshInfo"]


class MeshInfo:
    def __init__(self, mesh: DeviceMesh, spmd_mesh: DeviceMesh | None = None):
        if mesh.ndim not in (1, 2):
            raise ValueError(
                f"fully_shard needs a 1-D mesh (FSDP) or a 2-D mesh (replicate, shard) for HSDP; "
                f"got a {mesh.ndim}-D mesh {mesh}. Slice the data-parallel dims out of a larger "
                "mesh first, e.g. mesh['dp'] or mesh['dp_replicate', 'dp_shard']")
        self.mesh = mesh
        # the full mesh of fully_shard(dp_mesh_dims=...): sharded parameters live on it
        self.spmd_mesh = spmd_mesh
        self.shard_dim = mesh.ndim - 1
        self.replicate_dim = 0 if mesh.ndim == 2 else None
        self.shard_size = mesh.size(self.shard_dim)
        self.shard_rank = mesh.get_local_rank(self.shard_dim)
        self.replicate_size = mesh.size(0) if mesh.ndim == 2 else 1
        coord = mesh.get_coordinate()
        row = mesh.mesh[tuple(coord[:-1])].tolist() if mesh.ndim == 2 else mesh.mesh.tolist()
        if row != sorted(row):
            raise ValueError(f"fully_shard needs the ranks along the shard dim of {mesh} in "
                             f"increasing order (this rank's row is {row}); build the mesh with "
                             "init_device_mesh or list ranks in order")
        names = mesh.mesh_dim_names
        self.shard_mesh = mesh if mesh.ndim == 1 or not names else mesh[names[-1]]
        self._post_forward: dict[int, tuple[DeviceMesh, int]] = {}

    @property
    def dp_size(self) -> int:
        return self.shard_size * self.replicate_size

    def placements(self, shard_dim: int) -> tuple:
        if self.replicate_dim is None:
            return (Shard(shard_dim),)
        return (Replicate(), Shard(shard_dim))

    def post_forward(self, n: int) -> tuple[DeviceMesh, int]:
        """``(mesh, dim)`` of the ``n``-rank groups that hold the parameters between forward and
        backward under ``reshard_after_forward=n``: consecutive ranks of the shard dim, so the
        n pieces a group gathers are, in order, the whole all-gather output."""
        if n not in self._post_forward:
            rows = _shard_rows(self.mesh, self.shard_dim)
            # a new root mesh over every rank: (rows, shard_size // n, n); its last dim is the group
            layout = rows.reshape(rows.shape[0], self.shard_size // n, n)
            self._post_forward[n] = (DeviceMesh(self.mesh.device_type, layout), 2)
        return self._post_forward[n]


def _shard_rows(mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """Every rank's row along mesh dim ``dim``, over the whole world: ``(num_rows, size)``.

    Reads the root layout because a sub-mesh only lists this rank's slice.
    """
    root = mesh.root_layout
    dims = mesh.root_dims[dim]
    others = [d for d in range(root.ndim) if d not in dims]
    return root.permute(*others, *dims).reshape(-1, mesh.size(dim))
