"""fsdp: ``fully_shard`` -- per-parameter sharding (FSDP2-style) as a thin hook layer over DTensor.

Parameters become ``Shard(0)`` DTensors; forward/backward hooks all-gather them into plain
unsharded tensors around each module's compute and reduce-scatter the gradients back into the
DTensor ``.grad``. Public names mirror ``torch.distributed.fsdp``. See docs/fsdp.md.
"""
from .api import (DataParallelMeshDims, FSDPModule, GradientReductionHandle, UnshardHandle,
                  fully_shard, register_fsdp_forward_method, share_comm_ctx)
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["fully_shard", "DataParallelMeshDims", "FSDPModule", "UnshardHandle",
           "GradientReductionHandle", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
           "register_fsdp_forward_method", "share_comm_ctx"]
