"""A world of any size inside one process: torch.distributed's "fake" backend.

Every collective on it returns at once without moving data, but it is still called: through
``dtensor_lite.collectives`` and so through CommDebugMode, with the real groups of the real
mesh. Process groups exist only for this rank's rows (``new_group`` gives non-members a
placeholder), so a 2,048-rank mesh builds a handful of groups, not thousands.
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist

__all__ = ["fake_world"]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """Initialise torch.distributed as rank ``rank`` of a fake world of ``world_size`` ranks for
    the duration of the block, then destroy it.

    Example::

        >>> with fake_world(1024):
        ...     mesh = init_device_mesh("meta", (8, 16, 8), mesh_dim_names=("dp_replicate",
        ...                                                             "dp_shard", "tp"))
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"fake_world: world_size must be a positive int, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"fake_world: rank {rank} is not in a world of {world_size} ranks")
    if dist.is_initialized():
        raise RuntimeError(
            "fake_world: torch.distributed is already initialised in this process (one default "
            "group per process); run the dry run in a process of its own, e.g. "
            "`python -m dtensor_lite.plan ...`, or destroy_process_group() first")
    # importing it registers the "fake" backend with torch.distributed
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    # a real (in-process) store, not fake_pg's FakeStore: a wait that outlasts its poll slice
    # (a loaded machine) reads the store for a posted failure, and FakeStore cannot answer
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
