"""Fused destinations of a relayout: one destination tensor filled from several sources
concatenated along a dim (``qkv`` from ``q``, ``k``, ``v``; ``gate_up`` from ``gate``, ``up``).

Two layouts are meant by "concatenated", and they differ as soon as the destination is sharded
along the concatenated dim:

* ``per_rank=False`` (global): the global tensor is ``cat([q, k, v])``, cut by the destination's
  placements. TP rank 0 of 2 gets the first half of the rows of that -- all of ``q`` when
  ``q`` is as big as ``k`` and ``v`` together.
* ``per_rank=True`` (what vLLM's ``QKVParallelLinear`` and SGLang hold): each destination rank's
  piece is ``cat([q_r, k_r, v_r])``, its own pieces of each source under the destination's
  placements -- each rank computes its own heads of q, k and v from one matmul.

``Concat`` without ``per_rank`` into a destination sharded along ``dim`` is refused while
planning (on every rank, from metadata), asking the caller to choose: silently picking one would
fill an engine with the wrong rows. Where the destination is not sharded along ``dim`` the two
agree and no choice is needed.

Per-rank fusion plans each source as its own cross-mesh move onto a *part* spec: the destination's
mesh and placements with the source's global shape. A destination rank's piece of part ``i`` is
written into rows ``sum(piece rows of parts 0..i-1) ..`` of its fused piece, in place.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from .spec import DTensorSpec

__all__ = ["Concat", "concat_layout", "part_specs", "check_per_rank_sizes", "per_rank_view"]


class Concat(NamedTuple):
    """A fused destination tensor: the source tensors ``names`` concatenated along ``dim``.

    ``per_rank=True``: each destination rank's piece is the concatenation of its own pieces of
    the sources under the destination's placements (vLLM / SGLang ``[q_r; k_r; v_r]``,
    ``[gate_r; up_r]``, unequal sizes as in GQA). ``per_rank=False``: the global concatenation,
    then cut by the destination's placements. ``None`` (default): allowed only where both mean
    the same (the destination is not sharded along ``dim``).

    Example::

        >>> fused = {"qkv.weight": Concat(["q.weight", "k.weight", "v.weight"], per_rank=True)}
    """
    names: list
    dim: int = 0
    per_rank: bool | None = None


def _shards_along(spec: DTensorSpec, dim: int) -> int:
    """How many pieces the destination's placements cut ``dim`` into."""
    n = 1
    for size, p in zip(spec.mesh.shape, spec.placements):
        if p.is_shard(dim):
            n *= size
    return n


def concat_layout(dst_name: str, cat: Concat, spec: DTensorSpec) -> bool:
    """Whether ``cat`` into ``spec`` is per-rank (True) or global (False); raises where the
    caller left it open and the two differ."""
    if not isinstance(cat, Concat):
        raise TypeError(f"relayout: fused[{dst_name!r}] must be a Concat(names, dim, per_rank), "
                        f"got {cat!r}")
    if cat.per_rank not in (None, True, False):
        raise TypeError(f"relayout: fused[{dst_name!r}].per_rank must be True, False or None, "
                        f"got {cat.per_rank!r}")
    if not isinstance(cat.names, (list, tuple)) or not cat.names:
        raise ValueError(f"relayout: fused[{dst_name!r}] needs a non-empty list of source "
                         f"names, got {cat.names!r}")
    dim = cat.dim % max(spec.ndim, 1)
    shards = _shards_along(spec, dim)
    if cat.per_rank is None and shards > 1:
        names = ", ".join(cat.names)
        raise ValueError(
            f"relayout: fused {dst_name!r} is sharded along the concatenated dim {dim} "
            f"({list(spec.placements)} on a mesh of shape {tuple(spec.mesh.shape)}: {shards} "
            f"pieces), so Concat({cat.names}, dim={dim}) has two meanings; choose one: "
            f"per_rank=True -- each rank holds [its piece of each of {names}] concatenated "
            f"(vLLM / SGLang QKVParallelLinear, MergedColumnParallelLinear), or "
            f"per_rank=False -- rank r holds rows r of cat([{names}]) (the global "
            f"concatenation). See docs/relayout.md, 'Fused destinations'.")
    return bool(cat.per_rank) and shards > 1


def part_specs(dst: DTensorSpec, sources: list) -> tuple:
    """Per source spec: the destination's mesh and placements (and dtype) over that source's
    global shape -- what each destination rank holds of it in a per-rank fused piece."""
    return tuple(DTensorSpec(dst.mesh, dst.placements,
                             dst.tensor_meta._replace(shape=s.shape, stride=s.stride))
                 for s in sources)


def check_per_rank_sizes(dst_name: str, dst: DTensorSpec, dim: int, names: list,
                         parts: tuple) -> None:
    """Every destination coordinate's fused piece has exactly the rows of its pieces of the
    parts (checked for every coordinate, on every rank alike)."""
    for coord in itertools.product(*(range(n) for n in dst.mesh.shape)):
        have = dst.local_shape_and_offset(coord)[0][dim]
        sizes = [p.local_shape_and_offset(coord)[0][dim] for p in parts]
        if have != sum(sizes):
            raise ValueError(
                f"relayout: fused {dst_name!r} with per_rank=True: the destination rank at "
                f"coordinate {list(coord)} holds {have} rows along dim {dim} "
                f"({list(dst.placements)}, global {tuple(dst.shape)}), but its pieces of "
                f"{list(names)} (global sizes {[p.shape[dim] for p in parts]}) have {sizes} "
                f"rows (sum {sum(sizes)}); per-rank fusion needs every source to split along "
                f"dim {dim} like the fused tensor does (sizes divisible by the number of "
                f"pieces), or use per_rank=False for the global concatenation")


def per_rank_view(piece: torch.Tensor, coord, dim: int, parts: tuple, index: int):
    """(rows of this rank's fused ``piece`` that hold its piece of part ``index``, the global
    offset of that piece in the part's coordinates)."""
    shape, offset = parts[index].local_shape_and_offset(tuple(coord))
    row0 = sum(p.local_shape_and_offset(tuple(coord))[0][dim] for p in parts[:index])
    return piece.narrow(dim, row0, shape[dim]), offset
