"""DTensorSpec: everything needed to reason about a DTensor without touching its data.

A spec is ``(mesh, placements, tensor_meta, shard_order)``. ``shard_order[d]`` lists the mesh dims
that shard tensor dim ``d``, outermost first: the rank's piece of dim ``d`` is chunk ``c[m_k]`` of
... of chunk ``c[m_1]`` of the whole dim (nested ``torch.chunk``). The default order is increasing
mesh dim (left to right, as in PyTorch); FSDP on top of TP needs the reverse, which users spell
with ``_StridedShard`` exactly as in PyTorch.

Specs are hashable and compared by value; the hash is computed once because specs key every cache
of the dispatcher and the redistribute planner.
"""
from __future__ import annotations

import math
import weakref
from typing import NamedTuple, Sequence

import torch

from . import _caches
from .device_mesh import DeviceMesh
from .placements import (Placement, Replicate, Shard, _StridedShard, as_placement, chunk_range,
                         from_torch_placement, reductions_mix)

__all__ = ["TensorMeta", "DTensorSpec", "chunk_range", "contiguous_stride", "normalize_placements"]


class TensorMeta(NamedTuple):
    """Global shape, stride and dtype of a DTensor."""
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


def contiguous_stride(shape) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (size-0 dims count as 1, as torch does)."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def normalize_placements(placements, mesh: DeviceMesh, ndim: int | None) -> tuple:
    """Validate ``placements`` for ``mesh``; make Shard dims non-negative."""
    if placements is None:
        return (Replicate(),) * mesh.ndim
    if isinstance(placements, Placement) or from_torch_placement(placements) is not None:
        placements = (placements,)
    # torch's own placement objects (torch.distributed.tensor.Shard(0)) are taken by value
    placements = tuple(as_placement(p, "placements entries") for p in placements)
    if len(placements) != mesh.ndim:
        raise ValueError(f"got {len(placements)} placements {list(placements)} for a {mesh.ndim}-D "
                         f"mesh {mesh}; give exactly one placement per mesh dimension")
    out = []
    for p in placements:
        if p.is_shard() and ndim is not None:
            d = p.dim
            if not -ndim <= d < max(ndim, 1) or ndim == 0:
                raise ValueError(f"{p!r} is out of range for a {ndim}-D tensor "
                                 f"(placements {list(placements)})")
            if d < 0:
                p = _StridedShard(d + ndim, p.split_factor) if type(p) is _StridedShard else Shard(d + ndim)
        out.append(p)
    partial_ops = {p.reduce_op for p in out if p.is_partial()}
    if not reductions_mix(partial_ops):
        raise ValueError(f"placements {out} mix Partial reductions {sorted(partial_ops)}; the global "
                         "value of such a mix is not defined. Reduce one of them first "
                         "(redistribute it to Replicate)")
    return tuple(out)


def _orders_from_placements(placements: tuple, mesh_shape: tuple, ndim: int):
    """Shard order per tensor dim, decoding PyTorch's _StridedShard(dim, split_factor).

    For each tensor dim the mesh dims are inserted right to left: a plain Shard goes outermost of
    the mesh dims to its right; a _StridedShard goes after the ones to its right whose sizes
    multiply to its split_factor.
    """
    orders = []
    for d in range(ndim):
        order: list[int] = []
        for i in reversed(range(len(placements))):
            p = placements[i]
            if not p.is_shard(d):
                continue
            if type(p) is _StridedShard:
                prod, pos = 1, 0
                while prod < p.split_factor and pos < len(order):
                    prod *= mesh_shape[order[pos]]
                    pos += 1
                if prod != p.split_factor:
                    raise ValueError(
                        f"{p!r} on mesh dim {i} does not match the mesh dims to its right that shard "
                        f"dim {d} (sizes {[mesh_shape[j] for j in order]}); split_factor must be the "
                        "product of the sizes of the mesh dims that shard this dim first")
                order.insert(pos, i)
            else:
                order.insert(0, i)
        orders.append(tuple(order))
    return tuple(orders)


def shard_orders(placements, ndim: int, ranking: dict | None = None) -> tuple:
    """Shard order per tensor dim: the mesh dims whose placement shards that dim, innermost last.
    By default in mesh-dim order; with ``ranking`` (mesh dim -> position, carried from another
    spec such as an FSDP-over-TP input) mesh dims keep that relative order, so local pieces of
    tensors laid out alike still line up."""
    per = [[] for _ in range(ndim)]
    for i, p in enumerate(placements):
        if p.is_shard():
            per[p.dim].append(i)
    if ranking:
        return tuple(tuple(sorted(o, key=lambda i: (ranking.get(i, i), i))) for o in per)
    return tuple(tuple(o) for o in per)


def _default_orders(placements: tuple, ndim: int):
    return shard_orders(placements, ndim)


_INTERNED: dict = _caches.register({})
# DTensorSpec(...)'s arguments as given -> the spec: only a shortcut to _INTERNED, so any entry
# may go (bounded, oldest first; a dropped one is canonicalised again on its next use)
_AS_GIVEN: dict = _caches.register(_caches.LRUCache(_caches.SPECS_MAX))
_NEXT_SWEEP = [_caches.SPECS_MAX]


def _intern(key, spec) -> None:
    """Store ``spec`` as the one object for ``key``; when the table passes its bound, first drop
    the specs nobody else holds (a spec still in use must stay the one object for its value)."""
    _INTERNED[key] = spec
    if len(_INTERNED) <= _NEXT_SWEEP[0]:
        return
    _AS_GIVEN.clear()
    alive = {k: weakref.ref(v) for k, v in _INTERNED.items()}
    _INTERNED.clear()
    for k, ref in alive.items():
        v = ref()
        if v is not None:
            _INTERNED[k] = v
    # all still in use: let the table grow before sweeping again (amortised O(1) per spec)
    _NEXT_SWEEP[0] = max(_caches.SPECS_MAX, 2 * len(_INTERNED))


class DTensorSpec:
    """(mesh, placements, tensor_meta, shard_order) of a DTensor; hashable and comparable.

    Specs are interned: constructing an equal spec (on the same mesh *object*) returns the
    existing object, so equality is identity and hashing is the C-level object hash. Specs on
    two equal-valued but distinct meshes differ; comparisons that mean "same mesh" go through
    ``DeviceMesh.__eq__``. That keeps the dispatcher's per-op cache
    lookup (a tuple of specs) free of Python-level ``__hash__`` / ``__eq__`` calls.
    """

    __slots__ = ("mesh", "placements", "tensor_meta", "shard_order", "_local_cache",
                 "_default_order", "__weakref__")

    def __new__(cls, mesh: DeviceMesh, placements: Sequence[Placement], tensor_meta: TensorMeta,
                shard_order: tuple | None = None):
        placements = tuple(placements)
        # the spec is a pure function of the arguments (and the mesh object): look them up as
        # given before canonicalising (from_local and autograd's backward build specs per call)
        given = (id(mesh), placements, tensor_meta, shard_order)
        try:
            spec = _AS_GIVEN.get(given)
        except TypeError:  # a shard_order spelled with lists: not hashable, canonicalise
            given = spec = None
        if spec is None:
            spec = cls._canonical(mesh, placements, tensor_meta, shard_order)
            if given is not None:
                _AS_GIVEN[given] = spec  # the spec holds the mesh: its id stays unique
        return spec

    @classmethod
    def _canonical(cls, mesh, placements: tuple, tensor_meta, shard_order):
        ndim = len(tensor_meta.shape)
        if shard_order is None and any(type(p) is _StridedShard for p in placements):
            shard_order = _orders_from_placements(placements, mesh.shape, ndim)
        placements = tuple(Shard(p.dim) if type(p) is _StridedShard else p for p in placements)
        default = _default_orders(placements, ndim)
        if shard_order is None:
            shard_order = default
        else:
            shard_order = tuple(tuple(o) for o in shard_order)
            if tuple(tuple(sorted(o)) for o in shard_order) != default:
                raise ValueError(f"shard_order {shard_order} does not match placements {placements}")
        # keyed by the mesh *object*: equal meshes are not interchangeable (each root knows its
        # own flattened dim names), and dt.device_mesh must be the mesh the caller passed. The
        # interned spec holds the mesh, so its id cannot be reused while the entry lives.
        key = (id(mesh), placements, tensor_meta, shard_order)
        spec = _INTERNED.get(key)
        if spec is not None:
            return spec
        spec = object.__new__(cls)
        object.__setattr__(spec, "mesh", mesh)
        object.__setattr__(spec, "placements", placements)
        object.__setattr__(spec, "tensor_meta", tensor_meta)
        object.__setattr__(spec, "shard_order", shard_order)
        object.__setattr__(spec, "_default_order", shard_order == default)
        object.__setattr__(spec, "_local_cache", None)
        _intern(key, spec)
        return spec

    # interned: equal specs are one object. Spelled out (C-level hash, identity equality) so
    # torch.compile may treat specs as constants (it wants a class-defined __eq__ / __hash__)
    __hash__ = object.__hash__

    def __eq__(self, other):
        return self is other

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self  # immutable and interned: a copy of the value is the value

    def __setattr__(self, name, value):
        if name != "_local_cache":
            raise AttributeError("DTensorSpec is immutable")
        object.__setattr__(self, name, value)

    def __reduce__(self):
        return (DTensorSpec, (self.mesh, self.placements, self.tensor_meta, self.shard_order))

    def __repr__(self):
        order = "" if self._default_order else f", shard_order={self.shard_order}"
        return (f"DTensorSpec({list(self.placements)}, shape={tuple(self.shape)}, "
                f"mesh={self.mesh.shape}{order})")

    # -- convenience
    @property
    def shape(self) -> torch.Size:
        return self.tensor_meta.shape

    @property
    def ndim(self) -> int:
        return len(self.tensor_meta.shape)

    @property
    def stride(self):
        return self.tensor_meta.stride

    @property
    def dtype(self):
        return self.tensor_meta.dtype

    @property
    def has_default_order(self) -> bool:
        return self._default_order

    def is_replicated(self) -> bool:
        return all(p.is_replicate() for p in self.placements)

    def public_placements(self) -> tuple:
        """Placements as PyTorch spells them: non-default shard orders become _StridedShard."""
        if self._default_order:
            return self.placements
        out = list(self.placements)
        for d, order in enumerate(self.shard_order):
            for pos, i in enumerate(order):
                before_from_right = [j for j in order[:pos] if j > i]
                if before_from_right:
                    out[i] = _StridedShard(d, math.prod(self.mesh.shape[j] for j in before_from_right))
        return tuple(out)

    def with_placements(self, placements, shard_order=None) -> "DTensorSpec":
        return DTensorSpec(self.mesh, placements, self.tensor_meta, shard_order)

    # -- where this rank's piece lives
    def local_shape_and_offset(self, coordinate: Sequence[int] | None = None):
        """Shape and global offset of the piece held at ``coordinate`` (default: this rank)."""
        if coordinate is None:
            if self._local_cache is None:
                self._local_cache = _piece(self, self.mesh.get_coordinate())
            return self._local_cache
        return _piece(self, coordinate)

    def local_shape(self) -> tuple[int, ...]:
        return self.local_shape_and_offset()[0]


def outside_shape(ndim: int) -> tuple[int, ...]:
    """The local shape of a DTensor on a rank outside its mesh, as torch's: an empty 1-D
    tensor (a 0-d DTensor there holds a 0-d zero)."""
    return () if ndim == 0 else (0,)


def _piece(spec: DTensorSpec, coordinate) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if coordinate is None:  # a rank outside the mesh holds nothing
        return outside_shape(spec.ndim), (0,) * spec.ndim
    shape = list(spec.shape)
    offset = [0] * len(shape)
    mesh_shape = spec.mesh.shape
    for d, order in enumerate(spec.shard_order):
        for i in order:
            start, size = chunk_range(shape[d], mesh_shape[i], coordinate[i])
            offset[d] += start
            shape[d] = size
    return tuple(shape), tuple(offset)


def local_piece(tensor: torch.Tensor, spec: DTensorSpec, coordinate=None) -> torch.Tensor:
    """The view of a global ``tensor`` that the rank at ``coordinate`` holds under ``spec``
    (ignoring Partial, which callers handle); empty on a rank outside the mesh."""
    if coordinate is None and spec.mesh.get_coordinate() is None:
        return tensor.new_zeros(outside_shape(spec.ndim))
    shape, offset = spec.local_shape_and_offset(coordinate)
    out = tensor
    for d, (size, start) in enumerate(zip(shape, offset)):
        if size != tensor.shape[d]:
            out = out.narrow(d, start, size)
    return out
