"""``torch.distributed.tensor.placement_types``'s names (code importing them from there switches
by its import line alone); the placements themselves live in :mod:`dtensor_lite.placements`."""
# _StridedShard too: torch code imports it from here (torchtitan, FSDP2+TP state dicts)
from .placements import Partial, Placement, Replicate, Shard, _StridedShard

__all__ = ["Placement", "Shard", "Replicate", "Partial"]  # _StridedShard is private, as in torch
