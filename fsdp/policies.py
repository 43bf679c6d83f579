"""The policy value objects of ``fully_shard``: mixed precision and CPU offload.

They are plain frozen dataclasses with the same names and fields as PyTorch's, so
``from torch.distributed.fsdp import MixedPrecisionPolicy`` becomes ``from fsdp import ...``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision.

    * ``param_dtype``: dtype of the unsharded parameters, hence of the all-gather and of the
      forward/backward compute. The sharded parameters (what the optimizer steps) keep their
      own dtype. ``None``: no cast.
    * ``reduce_dtype``: dtype of the gradient reduce-scatter (and HSDP all-reduce), and of
      gradients accumulated without sync. ``None``: the unsharded gradient's dtype.
    * ``output_dtype``: floating-point forward outputs are cast to it. ``None``: no cast.
    * ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.

    Example::

        >>> mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        >>> fully_shard(block, mp_policy=mp)
    """
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default). Base class of :class:`CPUOffloadPolicy`."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and their gradients in CPU memory.

    Each all-gather copies the shard to the mesh's device first; each reduced gradient is copied
    back to the CPU, where the optimizer steps. ``pin_memory`` pins the CPU shards so the
    host-to-device copies can run asynchronously. On a CPU mesh this changes nothing.

    Example::

        >>> fully_shard(model, offload_policy=CPUOffloadPolicy())
    """
    pin_memory: bool = True
