"""Public RNG helpers for DTensor random ops (see docs/random.md).

Random ops on DTensors draw the global tensor on every rank and keep this rank's piece, so values
match plain torch under the same seed on any mesh; that needs every rank's generator in the same
state, which every random op checks by default (and, if needed, fixes from coordinate 0).
"""
from .ops.random import ensure_rng_synced, manual_seed, set_rng_sync_mode, sync_rng_state

__all__ = ["ensure_rng_synced", "manual_seed", "set_rng_sync_mode", "sync_rng_state"]
