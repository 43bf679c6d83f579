"""Every cache whose keys hold meshes (and so process groups) registers here, and every cache
that grows with what the program does is bounded here.

When the default process group changes (``destroy_process_group`` then ``init_process_group``),
``DeviceMesh`` construction calls :func:`clear_all`, so no cached decision outlives the groups it
was made for.

Bounds (entries; a long run with a new shape or scalar per step must not grow without end):

* ``DECISIONS_MAX`` op decisions (dispatcher), least recently used evicted;
* ``PLANS_MAX`` redistribute plans, least recently used evicted;
* ``SPECS_MAX`` interned specs: above it the specs nobody else holds are dropped (an interned
  spec still in use must stay the one object for its value, since spec equality is identity).

An evicted entry costs one re-decision when it comes back, never a wrong answer.
"""
from __future__ import annotations

from collections import OrderedDict

DECISIONS_MAX = 8192  # a 2x2 FSDP+TP Llama step needs ~150; each decision is ~1 KB
PLANS_MAX = 2048
SPECS_MAX = 16384

_REGISTERED: list = []


class LRUCache(OrderedDict):
    """A dict holding at most ``max_size`` entries: storing one more evicts the least recently
    used. ``get`` does not count as a use (it stays the C-level dict lookup on hot paths);
    callers that hit call ``move_to_end(key)``, as :func:`cached_get` does."""

    def __init__(self, max_size: int):
        super().__init__()
        self.max_size = max_size

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if len(self) > self.max_size:
            self.popitem(last=False)


def cached_get(cache: LRUCache, key):
    """``cache.get(key)``, marking a hit as recently used."""
    value = cache.get(key)
    if value is not None:
        cache.move_to_end(key)
    return value


def remember(cache: dict, key, value, like: LRUCache):
    """``cache[key] = value`` for a plain-dict cache kept beside the LRU ``like`` and keyed by
    the same kind of specs: emptied first when it reaches ``like``'s bound, so it never keeps
    more specs interned than ``like`` may. Returns ``value``."""
    if len(cache) >= like.max_size:
        cache.clear()
    cache[key] = value
    return value


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
