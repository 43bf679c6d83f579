"""Every cache whose keys hold meshes (and so process groups) registers here.

When the default process group changes (``destroy_process_group`` then ``init_process_group``),
``DeviceMesh`` construction calls :func:`clear_all`, so no cached decision outlives the groups it
was made for.
"""
from __future__ import annotations

_REGISTERED: list = []


def register(cache):
    """Register a dict-like cache (anything with ``clear()``) and return it."""
    _REGISTERED.append(cache)
    return cache


def clear_all():
    for cache in _REGISTERED:
        cache.clear()


_DECISION_CACHES: list = []


def register_decisions(cache):
    """Register a cache of op decisions: dropped on group changes *and* when a rule changes."""
    _DECISION_CACHES.append(cache)
    return register(cache)


def clear_decisions():
    for cache in _DECISION_CACHES:
        cache.clear()
