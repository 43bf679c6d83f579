"""Placements: how a global tensor is laid out along one dimension of a DeviceMesh.

A DTensor carries one placement per mesh dimension:

* ``Shard(dim)``     -- tensor dim ``dim`` is split across the mesh dim, with ``torch.chunk``
                        semantics (chunk size ``ceil(n / k)``; trailing ranks may hold fewer rows
                        or an empty shard).
* ``Replicate()``    -- every rank of the mesh dim holds the whole (remaining) tensor.
* ``Partial(op)``    -- every rank holds a partial value; the global value is the reduction
                        (``sum``, ``avg``, ``max``, ``min`` or ``product``) of the local values
                        over the mesh dim.
* ``_StridedShard``  -- an internal spelling (as in PyTorch) for "this mesh dim shards the tensor
                        dim *after* mesh dims to its right do", which FSDP on top of TP needs.

Placements are tiny immutable value objects: hashable, equal by value, cheap to compare. They are
used as cache keys on every dispatched op, so their hashes are computed once.
"""
from __future__ import annotations

import sys

__all__ = ["Placement", "Shard", "Replicate", "Partial", "_StridedShard", "REDUCE_OPS",
           "LINEAR_REDUCE_OPS", "reductions_mix", "chunk_range", "as_placement",
           "torch_placements_to_ours", "from_torch_placement"]

REDUCE_OPS = ("sum", "avg", "max", "min", "product")
_REDUCE_OP_ALIASES = {"prod": "product"}  # torch.prod's spelling of torch's "product"
# The Partial reductions that commute with linear maps (add, matmul, scaling). They also mix with
# each other: a tensor may be Partial(sum) on one mesh dim and Partial(avg) on another, because
# both reduce by addition (avg is sum scaled by 1/n). max, min and product mix with nothing but
# themselves.
LINEAR_REDUCE_OPS = ("sum", "avg")


def reductions_mix(reduce_ops) -> bool:
    """Can Partials with these reductions coexist (in one placement list, or as the inputs of
    one op decision)? The global value of e.g. Partial(sum) over Partial(max) is undefined."""
    ops = set(reduce_ops)
    return len(ops) <= 1 or ops <= set(LINEAR_REDUCE_OPS)


def chunk_range(length: int, num_chunks: int, index: int) -> tuple[int, int]:
    """(start, size) of chunk ``index`` when ``length`` is split like ``torch.chunk``.

    The chunk size is ``ceil(length / num_chunks)``; trailing chunks may be short or empty. This is
    what makes padded collectives exact: padding every chunk to the full chunk size and trimming
    the concatenation to ``length`` gives back the original layout.
    """
    size = -(-length // num_chunks) if length else 0
    start = min(index * size, length)
    return start, min(size, length - start)


class _PlacementType(type):
    """torch's own placement objects are ours by value: ``isinstance(torch_shard, Shard)`` is
    true, as ``==`` is (``_equal_to_torch``). Code written for torch's DTensor checks
    ``isinstance(p, Shard)`` on placements that torch 2.15 builds itself (through
    ``spmd_types``) before any import can be switched -- torchtitan 0.3's placement checks do.
    Python answers ``isinstance(x, C)`` without calling this when ``type(x) is C``, so our own
    placements never pay for it."""

    def __instancecheck__(cls, obj):
        if type.__instancecheck__(cls, obj):
            return True
        try:
            ours = from_torch_placement(obj)
        except TypeError:  # a torch placement with no equivalent (_MaskPartial, ...)
            return False
        return ours is not None and type.__instancecheck__(cls, ours)


def is_ours(p) -> bool:
    """``p`` is one of dtensor_lite's placement objects (not torch's, which ``isinstance``
    also accepts)."""
    return issubclass(type(p), Placement)


class Placement(metaclass=_PlacementType):
    """Base class of all placements. Use ``Shard``, ``Replicate`` or ``Partial``."""

    __slots__ = ("_hash",)

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (type(self), self._init_args())

    def _init_args(self) -> tuple:
        return ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False


class Shard(Placement):
    """Split tensor dimension ``dim`` across a mesh dimension (``torch.chunk`` semantics).

    Example::

        >>> Shard(0)
        Shard(dim=0)
    """

    __slots__ = ("dim",)

    def __init__(self, dim: int):
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"Shard(dim) needs an int tensor dimension, got {dim!r}")
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "_hash", hash(dim))  # torch's formula: see _equal_to_torch

    def _init_args(self):
        return (self.dim,)

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    @staticmethod
    def local_shard_size_and_offset(curr_local_size: int, num_chunks: int,
                                    rank: int) -> tuple[int, int]:
        """torch's: (size, offset) of piece ``rank`` of ``num_chunks`` of a dim of
        ``curr_local_size`` (``torch.chunk``; an empty piece sits at the end).
        ``Shard.local_shard_size_and_offset(7, 4, 3)`` is ``(1, 6)``."""
        start, size = chunk_range(curr_local_size, num_chunks, rank)
        return size, start

    def __eq__(self, other):
        if type(other) is Shard:
            return other.dim == self.dim
        return _equal_to_torch(self, other)

    __hash__ = Placement.__hash__  # defining __eq__ would otherwise drop the inherited hash

    def __repr__(self):
        return f"Shard(dim={self.dim})"

    def __str__(self):
        return f"S({self.dim})"


class _StridedShard(Shard):
    """Shard ``dim`` on this mesh dim *after* the mesh dims to its right that shard ``dim`` too.

    ``split_factor`` is the product of the sizes of those mesh dims that apply first. This is the
    PyTorch spelling of a non-default shard order; dtensor_lite stores the order explicitly in
    ``DTensorSpec.shard_order`` and uses nested ``torch.chunk`` semantics for uneven sizes (the
    piece a rank holds is chunk ``c_inner`` of chunk ``c_outer`` of the dim).
    """

    __slots__ = ("split_factor",)

    def __init__(self, dim: int, split_factor: int):
        super().__init__(dim)
        if not isinstance(split_factor, int) or split_factor < 1:
            raise ValueError(f"_StridedShard split_factor must be a positive int, got {split_factor!r}")
        object.__setattr__(self, "split_factor", split_factor)
        object.__setattr__(self, "_hash", hash((dim, split_factor)))

    def _init_args(self):
        return (self.dim, self.split_factor)

    def __eq__(self, other):
        if type(other) is _StridedShard:
            return other.dim == self.dim and other.split_factor == self.split_factor
        return _equal_to_torch(self, other)

    __hash__ = Placement.__hash__

    def __repr__(self):
        return f"_StridedShard(dim={self.dim}, split_factor={self.split_factor})"

    def __str__(self):
        return f"_S({self.dim},{self.split_factor})"


class Replicate(Placement):
    """Every rank of the mesh dimension holds the full tensor."""

    __slots__ = ()

    def __init__(self):
        object.__setattr__(self, "_hash", hash(-1))

    def is_replicate(self) -> bool:
        return True

    def __eq__(self, other):
        return type(other) is Replicate or _equal_to_torch(self, other)

    __hash__ = Placement.__hash__

    def __repr__(self):
        return "Replicate()"

    def __str__(self):
        return "R"


class Partial(Placement):
    """Each rank holds a partial value; the global value is ``reduce_op`` over the mesh dim.

    ``reduce_op`` is one of ``"sum"`` (default), ``"avg"``, ``"max"``, ``"min"``, ``"product"``
    (``"prod"`` is the same: it becomes ``"product"``, torch's name). Most ops reduce a
    ``Partial("product")`` input first (few rules keep it); ``Replicate -> Partial("product")``
    leaves the value on coordinate 0 and ones elsewhere.

    Example::

        >>> Partial()
        Partial(sum)
    """

    __slots__ = ("reduce_op",)
    LINEAR_REDUCE_OPS = LINEAR_REDUCE_OPS  # torch's class attributes
    ALL_REDUCE_OPS = REDUCE_OPS

    def __init__(self, reduce_op: str = "sum"):
        reduce_op = _REDUCE_OP_ALIASES.get(reduce_op, reduce_op)
        if reduce_op not in REDUCE_OPS:
            raise ValueError(
                f"Partial reduce_op must be one of {REDUCE_OPS}, got {reduce_op!r}")
        object.__setattr__(self, "reduce_op", reduce_op)
        object.__setattr__(self, "_hash", 1 + hash(reduce_op))

    def _init_args(self):
        return (self.reduce_op,)

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    @property
    def is_linear(self) -> bool:
        """sum and avg commute with linear maps (add, matmul, scaling); max and min do not."""
        return self.reduce_op in LINEAR_REDUCE_OPS

    def __eq__(self, other):
        if type(other) is Partial:
            return other.reduce_op == self.reduce_op
        return _equal_to_torch(self, other)

    __hash__ = Placement.__hash__

    def __repr__(self):
        return f"Partial({self.reduce_op})"

    def __str__(self):
        return f"P({self.reduce_op})"


# ----------------------------------------------------------------------------- torch's placements
# Code written for torch (torchtitan, a user's plan) builds ``torch.distributed.tensor.Shard(0)``
# and hands it to us. Those objects are torch's own classes (C++-backed on 2.13 and 2.15 alike),
# unrelated to ours, so every entry point that takes a placement converts them *by value* here --
# one helper, not a check per call site. Ours stay the only placements inside the library
# (specs, cache keys and rules compare by our types).
_TORCH_PLACEMENTS = "torch.distributed.tensor.placement_types"


def from_torch_placement(p) -> Placement | None:
    """Ours for one of torch's placement objects; None for anything that is not one."""
    # a torch placement exists only once its module was imported (by whoever built it), so
    # this costs nothing -- and imports nothing -- for programs that never use torch's
    mod = sys.modules.get(_TORCH_PLACEMENTS)
    if mod is None or not isinstance(p, mod.Placement):
        return None
    kind = type(p)
    if kind is getattr(mod, "_StridedShard", None):  # checked first: some torch releases
        return _StridedShard(p.dim, p.split_factor)    # derive it from Shard
    if kind is mod.Shard:
        return Shard(p.dim)
    if kind is mod.Replicate:
        return Replicate()
    if kind is mod.Partial:
        return Partial(p.reduce_op)
    # _MaskPartial (torch's embedding internals) and other subclasses carry state ours cannot
    raise TypeError(
        f"torch's placement {p!r} ({kind.__module__}.{kind.__qualname__}) has no dtensor_lite "
        "equivalent; use Shard(dim), Replicate(), Partial(reduce_op) or _StridedShard")


def _equal_to_torch(ours: Placement, other) -> bool:
    """``ours == other`` for an ``other`` that is not one of our placements: equal by value to
    torch's own placement objects, so code comparing placements it built through torch
    (torchtitan's ``placements != expected``; torch 2.15 builds them through ``spmd_types``)
    with a DTensor's gets the answer torch would give. torch's ``__eq__`` returns
    ``NotImplemented`` for our objects, so Python asks this one in both orders; the hashes
    follow torch's formulas (``hash(dim)``, ``-1``, ``1 + hash(reduce_op)``) so equal
    placements of either library are one dict key."""
    if is_ours(other):  # one of ours of another kind: unequal, no lookup
        return False
    try:
        theirs = from_torch_placement(other)
    except TypeError:  # a torch placement with no equivalent (_MaskPartial, ...)
        return False
    return theirs is not None and theirs == ours


def as_placement(p, what: str = "placement") -> Placement:
    """``p`` as a dtensor_lite placement: ours as they are; torch's own
    ``torch.distributed.tensor`` ``Shard`` / ``Replicate`` / ``Partial`` (with its ``reduce_op``)
    / ``_StridedShard`` converted by value. Anything else raises ``TypeError`` naming ``what``.

    Example::

        >>> import torch.distributed.tensor as tdt
        >>> as_placement(tdt.Shard(0)), as_placement(tdt.Partial("avg"))
        (Shard(dim=0), Partial(avg))
    """
    if is_ours(p):
        return p
    ours = from_torch_placement(p)
    if ours is None:
        raise TypeError(f"{what} must be a Shard/Replicate/Partial placement (dtensor_lite's or "
                        f"torch.distributed.tensor's), got {p!r} of type {type(p).__name__}")
    return ours


def torch_placements_to_ours(obj):
    """``obj`` with every torch placement inside (nested lists / tuples) replaced by ours, the
    rest untouched: for arguments whose structure is checked later (local_map's per-input and
    per-output placements). ``torch_placements_to_ours(([tdt.Shard(0)], None))``"""
    if isinstance(obj, (list, tuple)):
        converted = [torch_placements_to_ours(x) for x in obj]
        if all(a is b for a, b in zip(converted, obj)):
            return obj
        return type(obj)(converted) if type(obj) in (list, tuple) else tuple(converted)
    if is_ours(obj) or obj is None:
        return obj
    ours = from_torch_placement(obj)
    return obj if ours is None else ours
