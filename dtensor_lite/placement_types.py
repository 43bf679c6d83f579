"""``torch.distributed.tensor.placement_types``'s names (code importing them from there switches
by its import line alone); the placements themselves live in :mod:`dtensor_lite.placements`."""
from .placements import Partial, Placement, Replicate, Shard

__all__ = ["Placement", "Shard", "Replicate", "Partial"]
