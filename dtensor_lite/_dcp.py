"""DTensor's side of ``torch.distributed.checkpoint`` (DCP): the tensor-subclass hooks its planners
call (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``).

DCP itself does the rest -- planning, de-duplication, file I/O and resharding on load -- so a
checkpoint of our DTensors is an ordinary DCP checkpoint that torch's own DTensor (or plain
tensors, via ``dcp.load`` into full-sized tensors) can read, and the reverse.

Each rank holds exactly one contiguous box of the global tensor, whatever the placements and shard
order (nested ``torch.chunk`` keeps pieces contiguous), so one chunk -- the box's global offsets
and sizes from ``DTensorSpec.local_shape_and_offset`` -- describes it:

* save: every rank offers its box; replicas offer the same box (same fqn + offsets), which DCP's
  ``dedup_save_plans`` keeps once.
* load: the box tells DCP which saved ranges overlap it; DCP reads exactly those into
  ``to_local()`` (resharding across meshes and placements for free).

Empty boxes (uneven shards where a rank holds no rows) are not offered: their offsets may equal
those of a real box on another rank, and DCP keys chunks by offsets, so de-duplication could keep
the empty one and drop the data. A tensor with no elements at all is offered once, whole, so its
metadata is still written.
"""
from __future__ import annotations

import math

import torch

__all__ = ["create_write_items", "create_chunk_list", "get_tensor_shard"]


def _check_no_partial(dt) -> None:
    if any(p.is_partial() for p in dt._spec.placements):
        raise ValueError(
            f"DCP cannot save or load a DTensor with Partial placements "
            f"{list(dt._spec.placements)} (shape {tuple(dt.shape)}): its pieces are not pieces of "
            "the global value. Redistribute it to Replicate (or Shard) first, e.g. "
            "dt.redistribute(dt.device_mesh, [Replicate()] * dt.device_mesh.ndim)")


def _box(dt):
    """(sizes, offsets) of this rank's piece, or None if it holds nothing worth a chunk."""
    _check_no_partial(dt)
    sizes, offsets = dt._spec.local_shape_and_offset()
    if math.prod(sizes) == 0:
        if math.prod(dt.shape) != 0:
            return None
        sizes, offsets = tuple(dt.shape), (0,) * dt.ndim  # nothing anywhere: one whole chunk
    return torch.Size(sizes), torch.Size(offsets)


def create_write_items(fqn: str, dt) -> list:
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties)
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    box = _box(dt)
    if box is None:
        return []
    sizes, offsets = box
    return [WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties.create_from_tensor(dt._local_tensor),
            size=dt.shape,
        ),
    )]


def create_chunk_list(dt) -> list:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    box = _box(dt)
    if box is None or math.prod(box[0]) == 0:
        return []  # nothing to read into
    sizes, offsets = box
    return [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]


def get_tensor_shard(dt, index) -> torch.Tensor:
    """The local tensor DCP reads from (save) or writes into (load); one chunk per rank."""
    _check_no_partial(dt)
    return dt._local_tensor
