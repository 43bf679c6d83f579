"""fsdp: ``fully_shard`` (per-parameter sharding) on top of dtensor_lite -- not built yet.

This package is reserved for the FSDP issue; it exports nothing today.
"""
__all__: list[str] = []
