"""The generator state random DTensor ops rely on: seeding, the sync modes and the check every
random op makes before it draws (see docs/random.md; the rules are in ``ops/random.py``).

Random ops on DTensors draw the global tensor on every rank and keep this rank's piece, so values
match plain torch under the same seed on any mesh; that needs every rank's generator in the same
state, which every random op checks by default (and, if needed, fixes from coordinate 0).

Ranks must draw from the same generator state wherever they claim the same values. In the
default mode, ``"replicated"``, :func:`sync_rng_state` compares a digest of the states (one tiny
all-reduce per mesh dim) before a random op only over the mesh dims on which the result is not
sharded (Replicate or Partial: ranks there hold the same values) and, if they differ, copies the
state of coordinate 0 to the others, with a warning. A result sharded on every mesh dim (a
``Shard(0)`` dropout over a 1-D mesh) needs no agreement -- each rank keeps a piece no other rank
holds -- so it draws with no collective and no host sync. A divergence it leaves (ranks seeded
differently) is caught, every rank alike, at the next op whose result is replicated. The check is
made on every such op, not only the first: a rank may re-seed or draw plain random numbers between
two ops, and only a check that every rank makes every time tells all ranks alike -- a check made
only where a rank saw its own generator change would be entered by some ranks and not others.
"""
from __future__ import annotations

import hashlib
import warnings
import weakref

import torch

from . import _caches
from . import collectives as C
from .debug_state import comm_cause

__all__ = ["ensure_rng_synced", "manual_seed", "set_rng_sync_mode", "sync_rng_state",
           "agreement_dims", "ranks_key", "sync_before_draw"]

# (device type, sorted ranks) -> weak references to the generators known to agree there; weak so
# that a collected user generator is never mistaken for a new one at the same address
_SYNCED: dict = _caches.register({})
_mode = "replicated"  # set_rng_sync_mode's, process-wide
_MODES = ("replicated", "always", "once", "never")


def set_rng_sync_mode(mode: str) -> None:
    """When random DTensor ops check that ranks share the generator state.

    ``"replicated"`` (default): before every random op whose result holds the same values on
    several ranks -- a ``Replicate`` or ``Partial`` placement on a mesh dim of size > 1 -- one
    all-reduce of two int64 over each such mesh dim; a result sharded on every mesh dim draws
    with no communication (each rank keeps a piece nobody else holds, so no replicated value can
    differ; a divergence is caught at the next replicated random op, every rank alike).
    ``"always"``: before every random op, over every mesh dim (one small collective's latency:
    0.5-0.7 ms measured for a 64x64 dropout on 2 gloo ranks of a 2-core box, a host sync on
    CUDA; a rank that re-seeded or drew plain random numbers on its own is caught at the next
    random DTensor op, every rank alike).
    ``"once"``: on the first random op over a given set of ranks (and generator), then never
    again (no communication afterwards; ranks re-seeded differently later are *not* detected:
    their replicated values silently differ).
    ``"never"``: trust the user to seed every rank alike.

    Example::

        >>> set_rng_sync_mode("once")   # a hot loop of tiny random ops, every rank seeded alike
    """
    if mode not in _MODES:
        raise ValueError(
            f"set_rng_sync_mode: mode must be one of {', '.join(map(repr, _MODES))}, got {mode!r}")
    global _mode
    _mode = mode


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise RuntimeError(f"random DTensor ops: no default generator known for device {device}; "
                       "pass generator= explicitly")


def ranks_key(mesh) -> tuple:
    return (mesh.device_type, tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist())))


def _comm_device(mesh):
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" \
        else torch.device("cpu")


def sync_rng_state(mesh, generator: torch.Generator | None = None,
                   mesh_dims: "tuple[int, ...] | None" = None) -> bool:
    """Make every rank of ``mesh`` hold the same generator state; True if they differed.

    Compares a 64-bit digest of the state over every mesh dim, or over ``mesh_dims`` (one
    all-reduce of two int64s per mesh dim); only if the digests differ does it broadcast the
    state of coordinate 0 of those dims (about 5 KB for the CPU generator) and warn. Call it on
    every rank of ``mesh``.
    Random DTensor ops call it automatically (see :func:`set_rng_sync_mode`).

    Example::

        >>> torch.manual_seed(dist.get_rank())   # oops: different seeds per rank
        >>> sync_rng_state(mesh)                  # True: every rank now has rank 0's state
    """
    device = _comm_device(mesh)
    gen = generator if generator is not None else _default_generator(device)
    state = gen.get_state()
    digest = int.from_bytes(hashlib.blake2b(state.numpy().tobytes(), digest_size=8).digest(),
                            "little", signed=True)
    # max(d) == -max(-d) exactly when every rank holds the same digest
    t = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dims = range(mesh.ndim) if mesh_dims is None else mesh_dims
    with comm_cause("rng_check"):
        for i in dims:
            t = C.all_reduce(t, mesh, i, "max")
        differed = int(t[0]) != -int(t[1])
        if differed:
            # broadcasting from coordinate 0 along each mesh dim in turn leaves every rank with
            # the state of coordinate (0, ..., 0)
            buf = state.to(device)
            for i in dims:
                C.broadcast(buf, mesh, i, 0)
            gen.set_state(buf.cpu())
    if differed:
        warnings.warn(
            f"dtensor_lite: the random generator states differed across the ranks of {mesh} "
            "(seeded differently, or some ranks drew plain random numbers that others did not, "
            "since the last random DTensor op); copied the state of mesh coordinate 0 to every "
            "rank so that random DTensor ops give the same global values everywhere. Seed every "
            "rank alike (torch.manual_seed(s) on each rank) to avoid this; per-rank random "
            "streams for plain tensors need their own torch.Generator", stacklevel=2)
    if mesh_dims is None:
        _mark_synced(mesh, gen)
    return differed


def _generator_key(gen):
    """A weak reference to ``gen``; the generator itself where it takes none (torch < 2.13's
    Generator has no weakref slot -- default generators live forever anyway)."""
    try:
        return weakref.ref(gen)
    except TypeError:
        return gen


def _mark_synced(mesh, gen):
    _SYNCED.setdefault(ranks_key(mesh), set()).add(_generator_key(gen))


def manual_seed(seed: int, device_mesh) -> None:
    """Seed the default generator of ``device_mesh``'s device with ``seed`` on this rank and trust
    that every rank of the mesh does the same (no communication), as in PyTorch.

    Example::

        >>> manual_seed(1234, mesh)   # on every rank
    """
    device = _comm_device(device_mesh)
    gen = _default_generator(device)
    gen.manual_seed(seed)
    _mark_synced(device_mesh, gen)


def ensure_rng_synced(mesh, generator: torch.Generator | None = None,
                      placements=None) -> None:
    """The check every random DTensor op makes before drawing (see :func:`set_rng_sync_mode`),
    for code that draws on all ranks by other means, e.g. a replicated kernel with built-in
    dropout or a factory that draws the global tensor. ``placements``: those of what is drawn
    (default: replicated everywhere), which say over which mesh dims ranks must agree. Call it
    on every rank of ``mesh``.

    Example::

        >>> ensure_rng_synced(mesh)   # one tiny all-reduce per mesh dim
        >>> local = torch.rand(global_shape)[my_slice]
    """
    dims = None if placements is None else agreement_dims(mesh, [tuple(placements)])
    sync_before_draw(mesh, ranks_key(mesh), _comm_device(mesh), generator, dims)


def agreement_dims(mesh, placements_list) -> tuple[int, ...]:
    """The mesh dims over which ranks hold the same values of some result laid out by one of
    ``placements_list``: those of size > 1 where a placement is not a Shard."""
    return tuple(i for i in range(mesh.ndim) if mesh.shape[i] > 1 and
                 any(not pl[i].is_shard() for pl in placements_list))


def sync_before_draw(mesh, mesh_key, device: torch.device, generator, dims=None):
    """Called by every random op before it draws; ``mesh_key`` is ``ranks_key(mesh)``, ``dims``
    the op's :func:`agreement_dims` (None: every mesh dim)."""
    mode = _mode
    if mode == "never" or (mode == "replicated" and dims == ()):
        return  # nothing drawn here is held by two ranks: no communication
    gen = generator if generator is not None else _default_generator(device)
    if mode == "replicated" and dims is not None and len(dims) < mesh.ndim:
        sync_rng_state(mesh, gen, dims)
        return
    if mode == "once":
        known = _SYNCED.get(mesh_key)
        if known is not None and _generator_key(gen) in known:
            return
    sync_rng_state(mesh, gen)
