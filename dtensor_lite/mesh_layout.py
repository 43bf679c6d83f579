"""A mesh known by its ranks only (``MeshLayout``): the layout of another job's mesh, or of a
mesh this rank describes without building its process groups (``describe.describe``). The
cross-mesh planner reads its instances; nothing communicates over it."""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["MeshLayout"]


class MeshLayout:
    """A mesh known by its ranks only: ``instances`` is one tensor of ranks per instance (a mesh
    sliced from a bigger one, ``mesh["tp"]``, exists once per row of the rest), all of one
    shape. No process groups: this rank is never its member (``get_coordinate()`` is None)."""

    def __init__(self, device_type: str, instances, mesh_dim_names: Sequence[str] | None = None):
        inst = [torch.as_tensor(i, dtype=torch.int64) for i in (
            instances if isinstance(instances, (list, tuple)) else [instances])]
        if not inst or any(i.shape != inst[0].shape for i in inst) or inst[0].ndim == 0:
            raise ValueError(f"MeshLayout: instances must be rank tensors of one shape (at least "
                             f"1-D), got shapes {[tuple(i.shape) for i in inst]}")
        ranks = torch.stack(inst).flatten().tolist()
        if len(set(ranks)) != len(ranks) or min(ranks) < 0:
            raise ValueError(f"MeshLayout: ranks must be distinct and non-negative, got {ranks}")
        self.device_type = device_type
        self.instances = inst
        self.mesh = inst[0]
        self.mesh_dim_names = tuple(mesh_dim_names) if mesh_dim_names else None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    def size(self, mesh_dim: int | None = None) -> int:
        return self.mesh.numel() if mesh_dim is None else self.shape[mesh_dim]

    def get_coordinate(self):
        return None

    def _check_alive(self) -> None:  # nothing to tear down: no groups
        return None

    def __repr__(self):
        more = f" x {len(self.instances)} instances" if len(self.instances) > 1 else ""
        return f"MeshLayout({self.device_type!r}, {self.mesh.tolist()}{more})"
