"""The policy value objects of ``fully_shard``: mixed precision and CPU offload.

They are plain frozen dataclasses with the same names and fields as PyTorch's, so
``from torch.distributed.fsdp import MixedPrecisionPolicy`` becomes ``from fsdp import ...``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn as nn

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
    * ``param_dtype_override_fn(param)`` (keyword only, torch 2.15): a per-parameter exception
      to ``param_dtype``, asked once per managed parameter when ``fully_shard`` runs. Return
      the parameter's own dtype to keep it unconverted (all-gathered and computed in it), or
      ``None`` / ``param_dtype`` for the default; anything else raises ``ValueError``. It must
      answer the same on every rank. Forward inputs are still cast to ``param_dtype``.

    Example::

        >>> mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        >>> fully_shard(block, mp_policy=mp)
        >>> keep_norms = MixedPrecisionPolicy(
        ...     param_dtype=torch.bfloat16,
        ...     param_dtype_override_fn=lambda p: p.dtype if p.ndim == 1 else None)
    """
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = field(
        default=None, kw_only=True)

    def _resolve_for_param(self, param: nn.Parameter) -> "MixedPrecisionPolicy":
        """This policy as it applies to ``param``: ``param_dtype`` after the override, and no
        override function (torch's name and meaning)."""
        if self.param_dtype_override_fn is None:
            return self
        dtype = self.param_dtype_override_fn(param)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(f"param_dtype_override_fn must return a torch.dtype or None but got "
                             f"{type(dtype).__name__} ({dtype!r}) for a parameter of shape "
                             f"{tuple(param.shape)}")
        if dtype is not None and dtype not in (self.param_dtype, param.dtype):
            raise ValueError(
                f"param_dtype_override_fn must return None, param_dtype, or the parameter's "
                f"original dtype but got {dtype} for a parameter with dtype {param.dtype} and "
                f"param_dtype {self.param_dtype} (shape {tuple(param.shape)}); other dtypes are "
                "not supported")
        return replace(self, param_dtype=self.param_dtype if dtype is None else dtype,
                       param_dtype_override_fn=None)


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
