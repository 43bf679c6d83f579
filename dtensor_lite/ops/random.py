"""Random ops: the same global values as plain torch under the same seed, whatever the mesh.

A CPU generator (mt19937) cannot skip ahead to the part of the stream that belongs to this rank's
piece, so every rank runs the op itself on a *global-shaped stand-in* (same shape, strides and
dtype as the global tensor) with its own generator, keeps its piece and drops the rest. Every rank
draws the same numbers in the same order, so the result equals the unsharded op and all ranks'
generators advance identically (they stay in sync for the next op). The price is one global-size
temporary per random op per rank (see docs/random.md).

Tensor-valued parameters (bernoulli's ``p``, normal's ``mean``/``std``, dropout's input) are
embedded at this rank's region of a global-shaped stand-in filled with a harmless value: the
number of draws per element never depends on the parameter values, so the elements in this
rank's region come out exactly as in the global op, without gathering the parameters.

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

from .. import _caches
from .. import collectives as C
from ..debug_state import comm_cause
from ..placements import Replicate, Shard
from ..spec import DTensorSpec
from ._registry import FullStrategy, get_rule, register_rule

__all__ = ["sync_rng_state", "ensure_rng_synced", "manual_seed", "set_rng_sync_mode",
           "random_rule"]

aten = torch.ops.aten

# ---------------------------------------------------------------- generator agreement
# (device type, sorted ranks) -> weak references to the generators known to agree there; weak so
# that a collected user generator is never mistaken for a new one at the same address
_SYNCED: dict = _caches.register({})
_MODE = ["replicated"]
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
    _MODE[0] = mode


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise RuntimeError(f"random DTensor ops: no default generator known for device {device}; "
                       "pass generator= explicitly")


def _ranks_key(mesh) -> tuple:
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
    _SYNCED.setdefault(_ranks_key(mesh), set()).add(_generator_key(gen))


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
    _ensure_synced(mesh, _ranks_key(mesh), _comm_device(mesh), generator, dims)


def agreement_dims(mesh, placements_list) -> tuple[int, ...]:
    """The mesh dims over which ranks hold the same values of some result laid out by one of
    ``placements_list``: those of size > 1 where a placement is not a Shard."""
    return tuple(i for i in range(mesh.ndim) if mesh.shape[i] > 1 and
                 any(not pl[i].is_shard() for pl in placements_list))


def _ensure_synced(mesh, ranks_key, device: torch.device, generator, dims=None):
    """Called by every random op before it draws; ``ranks_key`` is ``_ranks_key(mesh)``, ``dims``
    the op's :func:`agreement_dims` (None: every mesh dim)."""
    mode = _MODE[0]
    if mode == "never" or (mode == "replicated" and dims == ()):
        return  # nothing drawn here is held by two ranks: no communication
    gen = generator if generator is not None else _default_generator(device)
    if mode == "replicated" and dims is not None and len(dims) < mesh.ndim:
        sync_rng_state(mesh, gen, dims)
        return
    if mode == "once":
        known = _SYNCED.get(ranks_key)
        if known is not None and _generator_key(gen) in known:
            return
    sync_rng_state(mesh, gen)


# ---------------------------------------------------------------- local pieces
def _region(spec: DTensorSpec):
    shape, offset = spec.local_shape_and_offset()
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def _sum_partial_elsewhere(spec: DTensorSpec) -> bool:
    """True if this rank's piece of a value written into ``spec`` must be zeros: for a
    Partial(sum) mesh dim only coordinate 0 holds the value (avg/max/min: every rank does)."""
    coord = spec.mesh.get_coordinate()
    return any(p.is_partial("sum") and coord[i] != 0 for i, p in enumerate(spec.placements))


def _embed(local: torch.Tensor, region, global_shape, fill) -> torch.Tensor:
    """A global-shaped tensor holding ``local`` at ``region`` and ``fill`` elsewhere."""
    full = torch.full(tuple(global_shape), fill, dtype=local.dtype, device=local.device)
    full[region] = local
    return full


def _keep(full: torch.Tensor, region) -> torch.Tensor:
    piece = full[region]
    if piece.shape == full.shape:  # replicated: the global tensor is the piece
        return full
    # a copy, so the global temporary is freed instead of living on behind a view
    return piece.clone(memory_format=torch.contiguous_format)


def _aligned(spec: DTensorSpec, out_placements, out_order, out_shape):
    """Placements (and shard order) that line ``spec`` up with an output of ``out_shape``:
    sharded like the output on the dims it shares with it, replicated on broadcast dims."""
    lead = len(out_shape) - spec.ndim
    pl = []
    for p in out_placements:
        if p.is_shard():
            d = p.dim - lead
            pl.append(Shard(d) if d >= 0 and spec.shape[d] == out_shape[p.dim] else Replicate())
        else:
            pl.append(Replicate())
    order = [()] * spec.ndim
    for d in range(spec.ndim):
        od = d + lead
        order[d] = tuple(i for i in out_order[od] if pl[i].is_shard(d))
    return tuple(pl), tuple(order)


# ---------------------------------------------------------------- rules
def _valued_positions(call, fills):
    """(position, fill) of every DTensor argument whose *values* the op reads."""
    return [(k, fill) for k, fill in fills.items()
            if k < len(call.args) and isinstance(call.args[k], DTensorSpec)]


def random_rule(call, inplace: bool, fills: dict | None = None, keep_partial: bool = False):
    """Strategy + local function for an elementwise random op.

    ``fills``: positional index -> harmless fill value for tensor arguments whose values the op
    reads (bernoulli's p, normal's mean/std, dropout's input); other tensor arguments only give
    the shape. ``keep_partial``: the op is linear in its (only) valued input for a fixed draw
    (dropout), so a Partial input may stay Partial.
    """
    op, mesh = call.op, call.mesh
    fills = fills or {}
    tensor_args = [(k, a) for k, a in enumerate(call.args) if isinstance(a, DTensorSpec)]
    if len(tensor_args) != len(call.inputs):
        raise RuntimeError(f"{op}: DTensor arguments must be passed positionally to random ops "
                           f"(got {len(call.inputs)} DTensors, {len(tensor_args)} positional)")
    valued = dict(_valued_positions(call, fills))
    if inplace:
        ref_k = 0
        out_shape = tuple(call.args[0].shape)
    else:
        out_shape = tuple(torch.broadcast_shapes(*[tuple(a.shape) for _, a in tensor_args]))
        ref_k = next((k for k, a in tensor_args if tuple(a.shape) == out_shape), None)
    ref = call.args[ref_k] if ref_k is not None else None
    if ref is None:  # every tensor argument is broadcast: draw replicated
        out_pl = (Replicate(),) * mesh.ndim
        out_order = ((),) * len(out_shape)
    else:
        out_pl = ref.placements if (inplace or keep_partial) else tuple(
            Replicate() if p.is_partial() else p for p in ref.placements)
        out_order = ref.shard_order
    ins, in_orders = [], []
    for k, a in tensor_args:
        if k not in valued or (k == ref_k and keep_partial):
            ins.append(None)  # only its shape matters, or the op is linear in it: keep it
            in_orders.append(None)
        elif a.ndim == 0:
            ins.append((Replicate(),) * mesh.ndim)
            in_orders.append(None)
        else:
            pl, order = _aligned(a, out_pl, out_order, out_shape)
            ins.append(pl)
            in_orders.append(order)
    # Partial does not change which piece a rank holds, so the output's region is ref's
    region = _region(ref) if ref is not None else tuple(slice(0, s) for s in out_shape)
    embed_at = {k: fills[k] for k in valued if call.args[k].ndim > 0}
    shape_only = {k: (tuple(a.shape), tuple(a.stride)) for k, a in tensor_args if k not in valued}
    zero_here = inplace and _sum_partial_elsewhere(ref)
    first = tensor_args[0][0]
    ranks_key = _ranks_key(mesh)
    n_out = 2 if op is aten.native_dropout.default else 1
    # the mesh dims where ranks hold the same values of the result (or of dropout's mask, never
    # Partial: it has out_pl's Shard dims) must draw alike; on Shard dims each keeps its own piece
    dims = agreement_dims(mesh, [out_pl])
    draw = getattr(op, "_op", op)  # the C++ overload, without OpOverload.__call__'s frame

    def local_fn(*args, **kwargs):
        dst = args[0]
        _ensure_synced(mesh, ranks_key, args[first].device, kwargs.get("generator"), dims)
        args = list(args)
        for k, fill in embed_at.items():
            args[k] = _embed(args[k], region, out_shape, fill)
        for k, (shape, stride) in shape_only.items():
            args[k] = torch.empty_strided(shape, stride, dtype=args[k].dtype, device=args[k].device)
        out = draw(*args, **kwargs)
        if inplace:
            if zero_here:
                return dst.zero_()
            return dst.copy_(out[region])
        if isinstance(out, (tuple, list)):
            return type(out)(_keep(o, region) for o in out)
        return _keep(out, region)

    outs = [out_pl]
    out_orders = [out_order]
    if n_out == 2:  # dropout's mask: exact on every rank, so never Partial
        outs.append(tuple(Replicate() if p.is_partial() else p for p in out_pl))
        out_orders.append(out_order)
    return FullStrategy(outs=outs, ins=ins, local_fn=local_fn, out_orders=out_orders,
                        in_orders=in_orders)


# ---------------------------------------------------------------- registrations
def _reg(ops, inplace, fills=None, keep_partial=False):
    register_rule(*ops)(lambda call: random_rule(call, inplace, fills, keep_partial))


# values are drawn into the tensor itself (in place) or into a tensor shaped like the input;
# nothing but the input's shape, dtype and strides matters
_reg([aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float,
      aten.exponential_.default, aten.random_.default, getattr(aten.random_, "from"),
      aten.random_.to, aten.cauchy_.default, aten.log_normal_.default, aten.geometric_.default],
     inplace=True)
_reg([aten.uniform.default, aten.normal_functional.default, aten.bernoulli.p,
      aten.exponential.default, aten.random.default, getattr(aten.random, "from"), aten.random.to,
      aten.cauchy.default, aten.log_normal.default, aten.geometric.default,
      aten.rand_like.default, aten.rand_like.generator, aten.randn_like.default,
      aten.randn_like.generator, aten.randint_like.default, aten.randint_like.generator,
      aten.randint_like.low_dtype, aten.randint_like.low_generator_dtype], inplace=False)
_reg([aten.randint_like.Tensor, aten.randint_like.Tensor_generator], inplace=False,
     fills={1: None})  # ``high`` is a 0-d tensor whose value matters
# tensor parameters: their values matter, embedded at this rank's region (0.5 / 0 / 1 are
# valid everywhere: a probability, a mean, a standard deviation)
_reg([aten.bernoulli_.Tensor], inplace=True, fills={1: 0.5})
_reg([aten.bernoulli.default], inplace=False, fills={0: 0.5})
_reg([aten.bernoulli.Tensor], inplace=False, fills={1: 0.5})
_reg([aten.normal.Tensor_float], inplace=False, fills={0: 0.0})
_reg([aten.normal.float_Tensor], inplace=False, fills={1: 1.0})
_reg([aten.normal.Tensor_Tensor], inplace=False, fills={0: 0.0, 1: 1.0})
# dropout(x) = x * mask * scale is linear in x for a fixed mask: a Partial input stays Partial
_reg([aten.native_dropout.default], inplace=False, fills={0: 0.0}, keep_partial=True)


# nn.init.orthogonal_ draws a replicated matrix and takes its QR factorisation. A QR of a sharded
# matrix has no cheap distributed form, so the factors are computed replicated; a rule that the
# matrix-family module registers (imported before this one) takes precedence.
def _replicated(call):
    return [((Replicate(), Replicate()), (Replicate(),) * len(call.inputs))]


if get_rule(aten.linalg_qr.default) is None:
    register_rule(aten.linalg_qr.default)(_replicated)
