"""The default process group's c10d store: where ranks leave each other side-band notes (a
failure, a desync report) without a collective."""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["default_store"]


def default_store():
    """The default process group's store, or None (no group, or a backend without one)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
