"""Redistributing a DTensor onto another mesh: the plan is metadata, the bytes the minimum.

A placement on mesh A says which box of the global tensor (a start:stop range per dim) each rank
of A holds; a placement on mesh B says which box each rank of B needs. For every (source rank,
destination rank) pair the bytes to move are the intersection of the two boxes -- nothing is
gathered whole, and a destination rank that already holds bytes it needs (it is in both meshes)
copies them locally. Where several source ranks hold the same box (Replicate, or a sliced mesh's
other instances) each destination's share is taken from one of them, round-robin, so the senders
share the load and every needed byte crosses the wire exactly once.

Meshes sliced from a bigger one (``mesh["tp"]``) exist once per row of that mesh; the plan takes
all rows as *instances* of the same tensor: source instances are replicas (any may serve), and
every destination instance receives its own copy (e.g. TP-2 x 2 replicas of an FSDP-4 tensor).
So every rank derives the same plan from the same arguments, with no communication.

A ``Partial`` source is reduced first, inside each source instance (a reduce-scatter onto a
``Shard`` where the tensor has a dim, else an all-reduce), then moved. A ``Partial`` destination
gets the value on the coordinate-0 rank of each ``Partial("sum")`` dim and zeros elsewhere (as
``distribute_tensor`` does), so those other ranks receive nothing.

The bytes go through ``collectives.exchange_pieces`` (one message per rank pair, all issued at
once over the default group, waited in slices): CommDebugMode counts them as ``cross_mesh``.
Ranks outside both meshes do nothing. The backward of a cross-mesh redistribute is the reverse
move (``DTensor.redistribute``'s autograd Function sends the gradient back the same way).
"""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from .. import _caches
from .. import collectives as C
from ..placements import Replicate, Shard
from ..spec import DTensorSpec, outside_shape
from .executor import run_plan
from .planner import plan_redistribute

__all__ = ["CrossMeshPlan", "check_meshes", "plan_cross_mesh", "redistribute_across_meshes",
           "mesh_instances", "reduced_source", "shift_box", "box_slices"]

Box = tuple  # ((start, stop), ...) per tensor dim


def check_meshes(src_mesh, dst_mesh) -> None:
    """The checks every rank makes (from the meshes alone) before a cross-mesh move."""
    from ..mesh_layout import MeshLayout
    from ..device_mesh import DeviceMesh
    if not isinstance(dst_mesh, (DeviceMesh, MeshLayout)):
        raise TypeError(f"redistribute: device_mesh must be a DeviceMesh, got "
                        f"{type(dst_mesh).__name__}")
    if src_mesh.device_type != dst_mesh.device_type:
        raise ValueError(
            f"redistribute between meshes of different device types ({src_mesh.device_type!r} "
            f"{src_mesh} and {dst_mesh.device_type!r} {dst_mesh}) is not supported; move the "
            "local pieces to one device type first")
    for m in (src_mesh, dst_mesh):
        m._check_alive()


def mesh_instances(mesh) -> list[torch.Tensor]:
    """Every instance of ``mesh`` as the same list on every rank: a root mesh is one instance;
    a mesh sliced from a root (``root["tp"]``) has one per combination of the root's other
    dims (each rank of the world sees only the one it belongs to as ``mesh.mesh``). A
    described mesh (``mesh_layout.MeshLayout``) lists its instances itself."""
    from ..mesh_layout import MeshLayout
    if isinstance(mesh, MeshLayout):
        return list(mesh.instances)
    permuted, others, _ = mesh._permuted_root()
    n_others = math.prod(mesh.root_layout.shape[d] for d in others) if others else 1
    return list(permuted.reshape(n_others, *mesh.shape).unbind(0))


class CrossMeshPlan(NamedTuple):
    """What crosses between meshes, for every rank: ``pairs[(src rank, dst rank)]`` lists the
    boxes (global index ranges) sent; ``local[rank]`` the boxes a rank copies from its own source
    piece into its destination piece. Same on every rank."""
    pairs: dict
    local: dict
    itemsize: int

    def bytes_sent(self) -> dict:
        """{global rank: bytes it sends}."""
        out: dict = {}
        for (a, _), boxes in self.pairs.items():
            out[a] = out.get(a, 0) + sum(box_volume(b) for b in boxes) * self.itemsize
        return out

    def pair_bytes(self) -> dict:
        return {k: sum(box_volume(b) for b in v) * self.itemsize for k, v in self.pairs.items()}

    @property
    def cost(self) -> int:
        """Bytes sent by the busiest rank (a Partial source's reduction inside its mesh, which
        runs first, not included)."""
        return max(self.bytes_sent().values(), default=0)

    def __str__(self):
        lines = [f"cross-mesh redistribute: {len(self.pairs)} rank pairs, busiest sender "
                 f"{self.cost} B"]
        for (a, b), boxes in sorted(self.pairs.items()):
            spans = ", ".join("[" + ", ".join(f"{s}:{e}" for s, e in box) + "]" for box in boxes)
            lines.append(f"  {a} -> {b}: {spans} ({self.pair_bytes()[(a, b)]} B)")
        for rank, boxes in sorted(self.local.items()):
            lines.append(f"  {rank} keeps {len(boxes)} box(es) it holds already")
        return "\n".join(lines)


def box_volume(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def _box(spec: DTensorSpec, coord) -> Box | None:
    shape, offset = spec.local_shape_and_offset(tuple(coord))
    if any(s == 0 for s in shape) and spec.ndim:
        return None
    return tuple((o, o + s) for o, s in zip(offset, shape))


def _intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (s1, e1), (s2, e2) in zip(a, b):
        s, e = max(s1, s2), min(e1, e2)
        if s >= e:
            return None
        out.append((s, e))
    return tuple(out)


def _needs_value(spec: DTensorSpec, coord) -> bool:
    """A destination rank holds data unless a Partial("sum") dim gives it the zero term."""
    return not any(p.is_partial("sum") and coord[i] != 0 for i, p in enumerate(spec.placements))


def _members(mesh):
    """(global rank, coordinate) of every rank of every instance of ``mesh``."""
    out = []
    for inst in mesh_instances(mesh):
        for coord in itertools.product(*(range(n) for n in mesh.shape)):
            out.append((int(inst[coord]), coord))
    return out


def reduced_source(src: DTensorSpec) -> DTensorSpec:
    """``src`` with every Partial dim reduced: onto a Shard of the largest dim of the pieces,
    nested *inside* the dim's existing shards (a reduce-scatter of each rank's own piece: the
    least traffic, no buffer beyond the piece) or, for a 0-d tensor, Replicate."""
    partial_dims = [i for i, p in enumerate(src.placements) if p.is_partial()]
    if not partial_dims:
        return src
    if src.ndim == 0:
        placements = [Replicate() if p.is_partial() else p for p in src.placements]
        return DTensorSpec(src.mesh, placements, src.tensor_meta)
    # the piece shape at coordinate 0 is the largest (torch.chunk puts full chunks first)
    piece = src.local_shape_and_offset((0,) * src.mesh.ndim)[0]
    d = max(range(src.ndim), key=lambda k: (piece[k], -k))
    placements = [Shard(d) if p.is_partial() else p for p in src.placements]
    order = list(src.shard_order)
    order[d] = tuple(order[d]) + tuple(partial_dims)
    return DTensorSpec(src.mesh, placements, src.tensor_meta, tuple(order))


_PLANS: dict = _caches.register(_caches.LRUCache(256))


def plan_cross_mesh(src: DTensorSpec, dst: DTensorSpec, region=None) -> CrossMeshPlan:
    """The pure-metadata plan moving a tensor laid out as ``src`` (no Partial) to ``dst``.

    ``region=(dim, offset)``: ``src`` fills only rows ``offset .. offset + src.shape[dim]`` of
    ``dst`` along ``dim`` (a fused destination such as ``qkv``); boxes stay in ``src``'s
    coordinates and the receiver shifts them."""
    key = (src, dst, region)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    holders: dict = {}  # source box -> global ranks holding it (every replica)
    held_by: dict = {}  # global rank -> its source box
    for rank, coord in _members(src.mesh):
        box = _box(src, coord)
        held_by[rank] = box
        if box is not None:
            holders.setdefault(box, []).append(rank)
    pairs: dict = {}
    local: dict = {}
    load = {box: 0 for box in holders}  # round-robin position per source box
    for rank, coord in _members(dst.mesh):
        need = _box(dst, coord) if _needs_value(dst, coord) else None
        if need is not None and region is not None:
            need = _to_region(need, region, src.shape)
        if need is None:
            continue
        own = held_by.get(rank)
        for box, ranks in holders.items():
            part = _intersect(box, need)
            if part is None:
                continue
            if own == box:  # this rank holds these bytes already
                local.setdefault(rank, []).append(part)
                continue
            sender = ranks[load[box] % len(ranks)]
            load[box] += 1
            pairs.setdefault((sender, rank), []).append(part)
    plan = CrossMeshPlan(pairs, local, torch.empty(0, dtype=src.dtype).element_size())
    _PLANS[key] = plan
    return plan


def _to_region(box: Box, region, src_shape) -> Box | None:
    """``box`` (destination coordinates) cut to the region a source fills, in its coordinates."""
    dim, offset = region
    start, stop = box[dim]
    start, stop = max(start - offset, 0), min(stop - offset, src_shape[dim])
    if start >= stop:
        return None
    return box[:dim] + ((start, stop),) + box[dim + 1:]


def shift_box(box: Box, region) -> Box:
    """A box in a source's coordinates moved to its region of the destination."""
    if region is None:
        return box
    dim, offset = region
    return box[:dim] + ((box[dim][0] + offset, box[dim][1] + offset),) + box[dim + 1:]


def box_slices(box: Box, offset) -> tuple:
    """Index of ``box`` (global coordinates) in a piece that starts at ``offset``."""
    return tuple(slice(s - o, e - o) for (s, e), o in zip(box, offset))


def redistribute_across_meshes(local: torch.Tensor, src: DTensorSpec,
                               dst: DTensorSpec) -> torch.Tensor:
    """This rank's piece of ``dst`` (on another mesh) from its piece of ``src`` (an empty one
    where this rank is outside ``src``'s mesh). Every rank in either mesh must call it."""
    if src.shape != dst.shape:
        raise ValueError(f"redistribute across meshes: source shape {tuple(src.shape)} and "
                         f"destination shape {tuple(dst.shape)} differ")
    reduced = reduced_source(src)
    if reduced is not src:  # only the source mesh's ranks take part in reducing
        if src.mesh.get_coordinate() is not None:
            local = run_plan(local, plan_redistribute(src, reduced))
        src = reduced
    plan = plan_cross_mesh(src, dst)
    me = src.mesh.get_rank()
    device = local.device
    src_coord = src.mesh.get_coordinate()
    src_offset = src.local_shape_and_offset()[1] if src_coord is not None else None
    sends = {}
    for (a, b), boxes in plan.pairs.items():
        if a == me:
            pieces = [local[box_slices(box, src_offset)].reshape(-1) for box in boxes]
            sends[b] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    recvs = {a: (sum(box_volume(box) for box in boxes), dst.dtype)
             for (a, b), boxes in plan.pairs.items() if b == me}
    received = C.exchange_pieces(sends, recvs, device) if sends or recvs else {}
    dst_coord = dst.mesh.get_coordinate()
    if dst_coord is None:
        return local.new_zeros(outside_shape(dst.ndim), dtype=dst.dtype)
    shape, offset = dst.local_shape_and_offset()
    out = torch.zeros(shape, dtype=dst.dtype, device=device) if not _needs_value(dst, dst_coord) \
        else torch.empty(shape, dtype=dst.dtype, device=device)
    for box in plan.local.get(me, ()):
        out[box_slices(box, offset)] = local[box_slices(box, src_offset)]
    for (a, b), boxes in plan.pairs.items():
        if b != me:
            continue
        flat, start = received[a], 0
        for box in boxes:
            n = box_volume(box)
            out[box_slices(box, offset)] = flat[start:start + n].reshape(
                [e - s for s, e in box])
            start += n
    return out
