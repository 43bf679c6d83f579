"""Whole-model relayout: every parameter of a model laid out one way (``fully_shard`` /
``parallelize_module`` on mesh A) moved into a model laid out another way (another plan, maybe
on other ranks), in buckets -- RL weight sync (trainer -> rollout engine) and elastic resize.

Each destination tensor is filled from one source tensor, or from several (a fused destination:
``qkv`` from ``q``, ``k``, ``v`` concatenated along a dim, globally or per rank as inference
engines hold it: ``relayout_fused.py``) -- each source then fills a region of it. What moves is the cross-mesh plan of each (source, destination region) pair
(``redistribute.cross_mesh``): per (source rank, destination rank) the index boxes one holds and
the other needs, nothing else. Tensors are grouped into buckets whose largest per-rank send or
receive stays within ``bucket_bytes``; a bucket is ONE message per rank pair (its boxes
concatenated), cast to the wire dtype *before* sending, written into the destination's local
pieces in place. The next bucket is in flight while the last is unpacked, so the extra memory of
a rank is at most one bucket's receive buffers plus the next one's send and receive buffers:
3 x ``bucket_bytes``. A tensor whose traffic passes the bucket is split into windows that each
fit one, every window a slice of every rank pair's boxes (``relayout_split.py``). The default
bucket is a fraction of the busiest rank's traffic (``AUTO_BUCKET_FRACTION``; at most one bucket
per 2 tensors): no tuning.

Everything is decided from metadata (names, shapes, dtypes, meshes, placements) that every rank
has, so ``RelayoutPlan.report()`` is a dry run that needs no data; before moving anything the
ranks compare a fingerprint of the plan (one small all-reduce), so a rank that built another
plan makes every rank raise instead of hanging.

Example::

    >>> plan = plan_relayout(trainer_model, rollout_model, dtype=torch.bfloat16,
    ...                      fused={"attn.qkv.weight": Concat(["attn.q.weight", "attn.k.weight",
    ...                                                        "attn.v.weight"], per_rank=True)})
    >>> print(plan.report())          # bytes per rank pair, buckets, peak extra memory
    >>> plan.run(trainer_model, rollout_model)   # every rank of the world calls it
"""
from __future__ import annotations

import zlib
from typing import Callable, NamedTuple

import torch
import torch.nn as nn

from . import collectives as C
from ._text import counted
from .dtensor import DTensor, default_mesh
from .placements import Replicate
from .redistribute.cross_mesh import (box_volume, box_slices, check_meshes, mesh_instances,
                                      plan_cross_mesh, reduced_source)
from .relayout_fused import (Concat, check_per_rank_sizes, concat_layout, part_specs,
                             per_rank_view)
from .relayout_split import split_plan
from .redistribute.entry import redistribute_local
from .spec import DTensorSpec, TensorMeta

__all__ = ["Concat", "RelayoutPlan", "plan_relayout", "relayout_", "relayout_optimizer_state_"]

# The default bucket (``bucket_bytes=None``): 1/32 of the most any rank sends or receives over
# the whole relayout -- or, for a model of few tensors, the traffic of 2 average tensors -- within
# [1 MiB, 256 MiB]. Why: buckets overlap (one in flight while the last is unpacked), so a rank
# holds at most 3 buckets of wire buffers at once -- under 10% of what it receives, i.e. of the
# destination weights it already holds, whatever the model's size (an engine that fits its
# weights fits the sync). Each bucket is one round in which every rank that sends or receives in
# it must run: on a loaded machine a round costs a scheduling cycle of every process whatever its
# bytes, so the number of rounds, not the bytes, sets the time there. ~32 buckets keep that small,
# and at most one bucket per 2 tensors keeps it at most half of what a per-parameter sync pays
# (one collective per tensor at least) -- for a model of few large tensors, where 1/32 of the
# traffic would give more buckets than that. The floor keeps messages large enough that latency
# does not dominate; the cap bounds the headroom in absolute terms on GPUs whose memory an engine
# gives to its KV cache.
AUTO_BUCKET_FRACTION = 32
AUTO_TENSORS_PER_BUCKET = 2
AUTO_BUCKET_MIN = 1 << 20
AUTO_BUCKET_MAX = 256 << 20


class _Move(NamedTuple):
    """One source tensor into one region of one destination tensor."""
    dst_name: str
    src_name: str
    src: DTensorSpec      # as it travels: Partial dims already reduced, in the wire dtype
    dst: DTensorSpec
    region: tuple | None  # (dim, offset) in the destination; None: the whole of it
    plan: object          # CrossMeshPlan
    parts: tuple | None = None  # per-rank fused: every source's part spec (relayout_fused)
    index: int = 0              # which of them this move fills
    window: int | None = None   # which window of a source split to fit the bucket, if it is


def _tensors(obj) -> dict:
    """{name: DTensor} of a module's parameters (or a dict given as is). Plain tensors among
    them (a TP plan leaves norms unsharded: every rank holds them whole) become Replicate
    DTensors over the mesh of the first DTensor -- views of the same memory, so writing into
    them updates the plain tensor."""
    table = dict(obj.named_parameters()) if isinstance(obj, nn.Module) else dict(obj)
    mesh = next((t.device_mesh for t in table.values() if isinstance(t, DTensor)), None)
    if mesh is None:
        return table
    for name, t in table.items():
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            meta = TensorMeta(t.shape, tuple(t.stride()), t.dtype)
            table[name] = DTensor(t.data, DTensorSpec(mesh, [Replicate()] * mesh.ndim, meta))
    return table


def _spec_of(name: str, t) -> DTensorSpec:
    if isinstance(t, DTensor):
        return t._spec
    if isinstance(t, DTensorSpec):
        return t
    raise TypeError(f"relayout: {name!r} is a {type(t).__name__}, not a DTensor; lay the model "
                    "out with fully_shard / parallelize_module (or distribute_tensor) first")


def _with_dtype(spec: DTensorSpec, dtype) -> DTensorSpec:
    if dtype is None or spec.dtype == dtype:
        return spec
    return DTensorSpec(spec.mesh, spec.placements, spec.tensor_meta._replace(dtype=dtype),
                       spec.shard_order)


class RelayoutPlan:
    """The moves, grouped in buckets; same on every rank. ``report()``: the dry run;
    ``run(src, dst)``: the move (every rank of the world calls it)."""

    def __init__(self, moves: list, buckets: list, bucket_bytes: int, wire_dtype):
        self.moves = moves
        self.buckets = buckets  # lists of indices into moves
        self.bucket_bytes = bucket_bytes
        self.wire_dtype = wire_dtype
        self.fingerprint = _fingerprint(moves, (bucket_bytes, str(wire_dtype)))
        # the jobs.JobLink whose group moves the bytes between two separately launched jobs
        # (ranks in its numbering); None: the default group of this world
        self.link = None

    # ------------------------------------------------------------------ dry run
    # Tensors of one shape and layout share one cross-mesh plan (a model's layers do), so the
    # figures are computed per distinct plan and counted: a 70B model over 256 ranks sizes in
    # seconds on one CPU.
    def _counted(self, moves=None):
        counts: dict = {}
        for m in (self.moves if moves is None else moves):
            entry = counts.setdefault(id(m.plan), [m.plan, 0])
            entry[1] += 1
        return counts.values()

    def pair_bytes(self) -> dict:
        """{(source rank, destination rank): bytes} over the whole relayout."""
        out: dict = {}
        for plan, count in self._counted():
            for pair, n in _pair_bytes(plan).items():
                out[pair] = out.get(pair, 0) + n * count
        return out

    def bytes_sent(self) -> dict:
        """{rank: bytes it sends} over the whole relayout."""
        return self._per_rank(0)

    def bytes_received(self) -> dict:
        return self._per_rank(1)

    def _per_rank(self, side: int, moves=None) -> dict:
        out: dict = {}
        for plan, count in self._counted(moves):
            for r, n in _rank_bytes(plan)[side].items():
                out[r] = out.get(r, 0) + n * count
        return out

    def bucket_traffic(self, k: int) -> tuple[dict, dict]:
        """({rank: bytes sent}, {rank: bytes received}) in bucket ``k``."""
        moves = [self.moves[i] for i in self.buckets[k]]
        return self._per_rank(0, moves), self._per_rank(1, moves)

    def peak_extra_bytes(self) -> dict:
        """{rank: the most bytes of wire buffers it holds at once}: buckets overlap, so bucket
        k's receive buffers (being unpacked) beside bucket k+1's send and receive buffers."""
        peak: dict = {}
        prev_recv: dict = {}
        for k in range(len(self.buckets)):
            sent, recv = self.bucket_traffic(k)
            for r in set(sent) | set(recv) | set(prev_recv):
                held = prev_recv.get(r, 0) + sent.get(r, 0) + recv.get(r, 0)
                peak[r] = max(peak.get(r, 0), held)
            prev_recv = recv
        return peak

    def link_bytes(self, gpus_per_node: int) -> dict:
        """{"intra-node": bytes, "inter-node": bytes} (ranks numbered node by node)."""
        out = {"intra-node": 0, "inter-node": 0}
        for (a, b), n in self.pair_bytes().items():
            out["intra-node" if a // gpus_per_node == b // gpus_per_node else "inter-node"] += n
        return out

    def estimate_seconds(self, link_model) -> float:
        """The busiest rank's time from a ``plan.cost.LinkModel``: per bucket, the larger of what
        it sends and what it receives over each link kind at that link's bandwidth, plus one
        latency per peer; buckets run one after another."""
        g = link_model.gpus_per_node
        total = 0.0
        for k in range(len(self.buckets)):
            moves = [self.moves[i] for i in self.buckets[k]]
            per_rank: dict = {}
            peers: dict = {}
            for plan, count in self._counted(moves):
                for (a, b), n in _pair_bytes(plan).items():
                    link = link_model.intra if a // g == b // g else link_model.inter
                    for r in (a, b):  # a rank's send and receive sides run at once
                        key = (r, a == r)
                        per_rank[key] = per_rank.get(key, 0.0) + n * count / link.bandwidth
                        peers.setdefault(key, set()).add(b if a == r else a)
            if per_rank:
                total += max(t + len(peers[key]) * link_model.inter.latency
                             for key, t in per_rank.items())
        return total

    def report(self, top: int = 16) -> str:
        pairs = self.pair_bytes()
        lines = [f"relayout: {counted(len(self.moves), 'move')} in "
                 f"{counted(len(self.buckets), 'bucket')} of <= "
                 f"{_mb(self.bucket_bytes)} per rank, wire dtype {self.wire_dtype or 'as source'}",
                 f"total bytes moved: {_mb(sum(pairs.values()))} over {len(pairs)} rank pairs; "
                 "busiest sender: " + (_busiest(self.bytes_sent()) if pairs else "none")
                 + "; busiest receiver: " + (_busiest(self.bytes_received()) if pairs else "none")]
        shown = sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
        lines.append("bytes per rank pair (src -> dst)"
                     + (f", the {top} largest of {len(pairs)}:" if len(pairs) > top else ":"))
        for (a, b), n in sorted(shown):
            lines.append(f"  {a:>4} -> {b:<4} {_mb(n)}")
        peak = self.peak_extra_bytes()
        if peak:
            worst = max(peak, key=peak.get)
            lines.append("peak extra memory (one bucket's receive buffers + the next one's send "
                         "and receive buffers): "
                         f"at most {_mb(peak[worst])} (rank {worst})"
                         + ("; per rank: " + ", ".join(f"{r}: {_mb(n)}" for r, n in
                                                      sorted(peak.items()))
                            if len(peak) <= 16 else ""))
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"moves": len(self.moves), "buckets": len(self.buckets),
                "bucket_bytes": self.bucket_bytes,
                "pair_bytes": {f"{a}->{b}": n for (a, b), n in sorted(self.pair_bytes().items())},
                "bytes_sent": self.bytes_sent(), "peak_extra_bytes": self.peak_extra_bytes()}

    # ------------------------------------------------------------------ the move
    @torch.no_grad()
    def run(self, src, dst, *, check: bool = True) -> None:
        """Move ``src``'s tensors (a module or ``{name: DTensor}``) into ``dst``'s in place.
        Collective over the world: every rank calls it with the same plan (checked first)."""
        srcs, dsts = _tensors(src), _tensors(dst)
        if check:
            _check_same_plan(self)
        for m in self.moves:  # the tensors must be the ones planned for
            for name, table, spec in ((m.src_name, srcs, None), (m.dst_name, dsts, m.dst)):
                if name not in table:
                    raise KeyError(f"relayout.run: {name!r} is not in the model it was planned "
                                   "for")
            if tuple(dsts[m.dst_name].shape) != tuple(m.dst.shape):
                raise ValueError(f"relayout.run: {m.dst_name!r} has shape "
                                 f"{tuple(dsts[m.dst_name].shape)}, planned {tuple(m.dst.shape)}")
        me = self.link.rank if self.link is not None else torch.distributed.get_rank()
        # Bucket k+1 is in flight while bucket k is unpacked. Bucket k's exchange is waited (its
        # send buffers freed) before k+1's are packed, so a rank holds at most bucket k's
        # receive buffers and k+1's send and receive buffers at once (peak_extra_bytes).
        in_flight = None  # (moves, pending exchange, send buffers, source pieces)
        reduced: dict = {}  # the last Partial source reduced: its windows reduce it once
        for bucket in self.buckets:
            moves = [self.moves[i] for i in bucket]
            received = self._finish(in_flight)
            local_src, sends, recvs, device = _pack(moves, srcs, dsts, me, reduced)
            pending = C.exchange_pieces(sends, recvs, device, async_op=True, link=self.link)
            if in_flight is not None:
                _unpack(in_flight[0], received, in_flight[3], dsts, me)
            in_flight = (moves, pending, sends, local_src)
        if in_flight is not None:
            _unpack(in_flight[0], self._finish(in_flight), in_flight[3], dsts, me)

    @staticmethod
    def _finish(in_flight) -> dict:
        """Wait for a bucket's exchange; free its send buffers; return what it received."""
        if in_flight is None:
            return {}
        received = in_flight[1].wait()
        _release(in_flight[2].values())
        in_flight[2].clear()
        return received


def _pack(moves, srcs, dsts, me: int, reduced: dict):
    """(source pieces, {peer: 1-D send buffer}, {peer: (numel, dtype) to receive}, device) of
    one bucket: one buffer per peer in the wire dtype, filled in place -- the cast happens in the
    copy, before sending, and no piece is held twice."""
    recvs: dict = {}
    local_src = {}
    send_numel: dict = {}
    device = None  # where this rank's pieces live (its wire buffers go there too)
    for m in moves:
        local, offset = _source_piece(m, srcs[m.src_name], me, reduced)
        local_src[id(m)] = (local, offset)
        if local is not None and device is None:
            device = local.device
        for (a, b), boxes in m.plan.pairs.items():
            numel = sum(box_volume(box) for box in boxes)
            if a == me:
                send_numel[b] = send_numel.get(b, 0) + numel
            if b == me:
                n, dtype = recvs.get(a, (0, m.src.dtype))
                recvs[a] = (n + numel, dtype)
    wire = moves[0].src.dtype
    sends = {b: torch.empty(n, dtype=wire, device=device) for b, n in send_numel.items()}
    fill = dict.fromkeys(sends, 0)
    for m in moves:
        local, offset = local_src[id(m)]
        for (a, b), boxes in m.plan.pairs.items():
            if a != me:
                continue
            for box in boxes:
                n = box_volume(box)
                sends[b][fill[b]:fill[b] + n].view(
                    [e - s for s, e in box]).copy_(local[box_slices(box, offset)])
                fill[b] += n
    device = next((t.device for t in dsts.values() if isinstance(t, torch.Tensor)),
                  device or torch.device("cpu"))
    return local_src, sends, recvs, device


def _unpack(moves, received: dict, local_src: dict, dsts, me: int) -> None:
    """Write one bucket into the destination pieces in place: what this rank holds itself, then
    what it received (in the order the senders packed it); free the receive buffers."""
    cursor = {a: 0 for a in received}
    for m in moves:
        target = _target(m, dsts[m.dst_name], me)
        if target is None:
            continue
        view, dst_offset = target
        local, src_offset = local_src[id(m)]
        for box in m.plan.local.get(me, ()):
            view[box_slices(box, dst_offset)] = local[box_slices(box, src_offset)].to(view.dtype)
        for (a, b), boxes in m.plan.pairs.items():
            if b != me:
                continue
            flat = received[a]
            for box in boxes:
                n = box_volume(box)
                start = cursor[a]
                view[box_slices(box, dst_offset)] = \
                    flat[start:start + n].reshape([e - s for s, e in box]).to(view.dtype)
                cursor[a] = start + n
    _release(received.values())


def _only_described(m: _Move, spec: DTensorSpec, me: int, side: str, name: str,
                    exchanges: bool) -> None:
    """A tensor given by its description only (``describe``) is fine on a rank that moves none
    of it; a rank that must send or receive its bytes needs the DTensor itself."""
    if exchanges or m.plan.local.get(me):
        raise ValueError(
            f"relayout.run: rank {me} holds part of {side} {name!r} ({list(spec.placements)} on "
            f"{spec.mesh}) but was given only its description; pass the DTensor itself on the "
            "ranks of its mesh")


def _source_piece(m: _Move, t, me: int, reduced: dict):
    """(this rank's piece of source ``t`` -- Partial dims reduced inside its mesh -- and its
    global offset), or (None, None) where this rank holds none of it (outside its mesh, or
    ``t`` is only described: ``describe.describe``). ``reduced`` keeps the last Partial
    source's reduced piece, so the windows of a source split across buckets reduce it once."""
    if isinstance(t, DTensorSpec):
        _only_described(m, t, me, "source", m.src_name, any(a == me for a, _ in m.plan.pairs))
        return None, None
    local, spec = t._local_tensor, t._spec
    target = reduced_source(spec)
    if target is not spec:  # a Partial source: reduced inside its mesh first
        if m.src_name not in reduced:
            reduced.clear()
            reduced[m.src_name] = redistribute_local(local, spec, target)
        local = reduced[m.src_name]
    if target.mesh.get_coordinate() is None:
        return None, None
    return local, target.local_shape_and_offset()[1]


def _target(m: _Move, out, me: int):
    """(the view of this rank's destination piece that move ``m`` writes, the global offset of
    its first element in the source's coordinates), so a source box ``box`` lands at
    ``view[box_slices(box, offset)]``; None where this rank holds none of the destination."""
    if isinstance(out, DTensorSpec):
        _only_described(m, out, me, "destination", m.dst_name,
                        any(b == me for _, b in m.plan.pairs))
        return None
    coord = out._spec.mesh.get_coordinate()
    if coord is None:
        return None
    piece = out._local_tensor
    if m.parts is not None:
        return per_rank_view(piece, coord, m.region[0], m.parts, m.index)
    offset = list(out._spec.local_shape_and_offset()[1])
    if m.region is not None:  # a global concatenation: the source starts ``offset`` rows in
        dim, start = m.region
        offset[dim] -= start
    return piece, offset


def _release(buffers) -> None:
    """Free the memory of this bucket's wire buffers now that their exchange finished, or one
    bucket's buffers could outlive the next bucket's allocation and break the 2-bucket bound
    (``collectives.free_now``)."""
    C.free_now(*buffers)


_PLAN_FIGURES: dict = {}  # id(cross-mesh plan) -> (plan, pair bytes, (sent, received) per rank)


def _figures(plan):
    entry = _PLAN_FIGURES.get(id(plan))
    if entry is None or entry[0] is not plan:
        pairs = plan.pair_bytes()
        sent: dict = {}
        recv: dict = {}
        for (a, b), n in pairs.items():
            sent[a] = sent.get(a, 0) + n
            recv[b] = recv.get(b, 0) + n
        if len(_PLAN_FIGURES) > 4096:
            _PLAN_FIGURES.clear()
        entry = _PLAN_FIGURES[id(plan)] = (plan, pairs, (sent, recv))
    return entry


def _pair_bytes(plan) -> dict:
    return _figures(plan)[1]


def _rank_bytes(plan) -> tuple:
    return _figures(plan)[2]


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB" if n >= 1024 \
        else f"{n} B"


def _busiest(sent: dict) -> str:
    rank = max(sent, key=sent.get)
    return f"rank {rank} ({_mb(sent[rank])})"


def _fingerprint(moves, options) -> int:
    """A number every rank computes alike for the same plan (names, shapes, dtypes, meshes,
    placements, regions): differing numbers mean the ranks planned different moves."""
    parts = [str(options)]
    meshes: dict = {}  # id -> its ranks as text, once per mesh
    for m in moves:
        for spec in (m.src, m.dst):
            mesh = spec.mesh
            if id(mesh) not in meshes:
                meshes[id(mesh)] = f"{mesh.device_type}{[t.tolist() for t in mesh_instances(mesh)]}"
            parts.append(f"{meshes[id(mesh)]}{spec.placements}{spec.shard_order}"
                         f"{tuple(spec.shape)}{spec.dtype}")
        parts.append(f"{m.src_name}>{m.dst_name}@{m.region}#{m.window}"
                     + (f"/per-rank {m.index} of {[tuple(p.shape) for p in m.parts]}"
                        if m.parts else ""))
    return zlib.crc32("|".join(parts).encode()) & 0x7FFFFFFF


def _check_same_plan(plan: RelayoutPlan) -> None:
    """One all-reduce (max and min of the fingerprint) over the world: every rank raises the same
    error when some rank planned differently, before any tensor moves."""
    mesh = default_mesh(torch.empty(0))
    mine = torch.tensor([plan.fingerprint, -plan.fingerprint], dtype=torch.int64)
    both = C.all_reduce(mine, mesh, 0, "max")
    if int(both[0]) != -int(both[1]):
        raise ValueError(
            "relayout: the ranks built different relayout plans (fingerprint "
            f"{plan.fingerprint} here; the ranks range over [{-int(both[1])}, {int(both[0])}]); "
            "every rank must plan the same models, name map, fused tensors, dtype and bucket "
            "size")


def plan_relayout(src, dst, *, name_map: dict | Callable | None = None,
                  fused: dict | None = None, dtype: torch.dtype | None = None,
                  bucket_bytes: int | None = None) -> RelayoutPlan:
    """Plan moving ``src``'s tensors into ``dst``'s (modules or ``{name: DTensor or
    DTensorSpec}``). Pure metadata, no communication.

    ``name_map``: destination name -> source name (a dict or a function; default: the same
    name). ``fused``: destination name -> :class:`Concat` of source names (``qkv`` from ``q``,
    ``k``, ``v``): each source fills its rows -- of the global tensor (``per_rank=False``) or of
    each rank's piece (``per_rank=True``, the inference engines' layout) -- and only the bytes
    each destination rank needs move. ``dtype``: the wire dtype, cast before sending (the destination tensors must have it;
    default: the source's, which must then equal the destination's). ``bucket_bytes``: the most
    bytes a rank sends (or receives) per bucket; default (None): 1/32 of the most any rank
    sends or receives in all (for a model of fewer than 64 tensors, that traffic over half their
    number: at most one bucket per 2 tensors), within [1 MiB, 256 MiB]
    (``AUTO_BUCKET_FRACTION``: the extra memory stays under 10% of what a rank receives).
    """
    srcs, dsts = _tensors(src), _tensors(dst)
    fused = dict(fused or {})
    if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
        raise ValueError(f"relayout: bucket_bytes must be a positive int (or None: chosen from "
                         f"the traffic), got {bucket_bytes!r}")
    moves = []
    for dst_name, d in dsts.items():
        dspec = _spec_of(dst_name, d)
        per_rank = False
        if dst_name in fused:
            cat = fused[dst_name]
            per_rank = concat_layout(dst_name, cat, dspec)
            sources, dim = list(cat.names), cat.dim % max(dspec.ndim, 1)
        else:
            mapped = name_map(dst_name) if callable(name_map) else \
                (name_map or {}).get(dst_name, dst_name)
            sources, dim = [mapped], None
        sspecs = []
        for src_name in sources:
            if src_name not in srcs:
                raise KeyError(f"relayout: destination {dst_name!r} needs source {src_name!r}, "
                               f"which the source model does not have (source names: "
                               f"{sorted(srcs)[:8]}...); pass name_map= or fused=")
            sspec = _spec_of(src_name, srcs[src_name])
            check_meshes(sspec.mesh, dspec.mesh)
            wire = dtype or sspec.dtype
            if dspec.dtype != wire:
                raise ValueError(
                    f"relayout: {src_name!r} is {sspec.dtype} and destination {dst_name!r} is "
                    f"{dspec.dtype}; pass dtype={dspec.dtype} to cast on the way")
            if dim is not None:
                expect = list(dspec.shape)
                expect[dim] = sspec.shape[dim] if sspec.ndim == dspec.ndim else -1
                if list(sspec.shape) != expect:
                    raise ValueError(
                        f"relayout: fused {dst_name!r} {tuple(dspec.shape)} cannot hold "
                        f"{src_name!r} {tuple(sspec.shape)} along dim {dim} (every other dim "
                        "must match)")
            elif tuple(sspec.shape) != tuple(dspec.shape):
                raise ValueError(f"relayout: shape mismatch: source {src_name!r} is "
                                 f"{tuple(sspec.shape)}, destination {dst_name!r} is "
                                 f"{tuple(dspec.shape)}")
            sspecs.append(sspec)
        if dim is not None and sum(s.shape[dim] for s in sspecs) != dspec.shape[dim]:
            raise ValueError(f"relayout: fused {dst_name!r} has {dspec.shape[dim]} rows along "
                             f"dim {dim} but its sources {sources} have "
                             f"{[s.shape[dim] for s in sspecs]} (sum "
                             f"{sum(s.shape[dim] for s in sspecs)}); the sizes must add up")
        parts = part_specs(dspec, sspecs) if per_rank else None
        if per_rank:
            check_per_rank_sizes(dst_name, dspec, dim, sources, parts)
        offset = 0
        for i, (src_name, sspec) in enumerate(zip(sources, sspecs)):
            wire = dtype or sspec.dtype
            travel = _with_dtype(reduced_source(sspec), wire)
            if per_rank:
                region = (dim, None)
                plan = plan_cross_mesh(travel, _with_dtype(parts[i], wire))
            else:
                region = None if dim is None else (dim, offset)
                plan = plan_cross_mesh(travel, _with_dtype(dspec, wire), region)
            moves.append(_Move(dst_name, src_name, travel, dspec, region, plan, parts, i))
            if dim is not None:
                offset += sspec.shape[dim]
    if bucket_bytes is None:
        bucket_bytes = auto_bucket_bytes(moves)
    moves = _split_large(moves, bucket_bytes)
    return RelayoutPlan(moves, _buckets(moves, bucket_bytes), bucket_bytes, dtype)


def _split_large(moves, bucket_bytes: int) -> list:
    """Every move whose traffic passes the bucket replaced by the moves of windows of its
    source that each fit one (``relayout_split``), so the bucket bounds the extra memory
    whatever the largest tensor. Moves sharing one cross-mesh plan (a model's layers) share
    its pieces too (the dry run counts by plan)."""
    pieces: dict = {}
    out = []
    for m in moves:
        split = pieces.get(id(m.plan))
        if split is None:
            split = pieces[id(m.plan)] = split_plan(m.plan, bucket_bytes)
        out += [m._replace(plan=p, window=k) for k, p in enumerate(split)] \
            if len(split) > 1 else [m]
    return out


def auto_bucket_bytes(moves) -> int:
    """The default bucket: the larger of 1/32 of the most any rank sends or receives over all
    ``moves`` and that times 2 over the number of destination tensors, within [1 MiB, 256 MiB]
    (why: at ``AUTO_BUCKET_FRACTION``)."""
    sent: dict = {}
    recv: dict = {}
    for m in moves:
        s_m, r_m = _rank_bytes(m.plan)
        for table, part in ((sent, s_m), (recv, r_m)):
            for r, n in part.items():
                table[r] = table.get(r, 0) + n
    busiest = max([*sent.values(), *recv.values(), 0])
    tensors = max(len({m.dst_name for m in moves}), 1)
    bucket = max(busiest // AUTO_BUCKET_FRACTION, busiest * AUTO_TENSORS_PER_BUCKET // tensors)
    return min(max(bucket, AUTO_BUCKET_MIN), AUTO_BUCKET_MAX)


def _buckets(moves, bucket_bytes: int) -> list:
    """Consecutive moves while no rank's sends or receives in the bucket pass ``bucket_bytes``
    (one dtype per bucket: a bucket is one message per rank pair)."""
    buckets, current, sent, recv = [], [], {}, {}
    for i, m in enumerate(moves):
        s_m, r_m = _rank_bytes(m.plan)
        s2, r2 = dict(sent), dict(recv)
        for r, n in s_m.items():
            s2[r] = s2.get(r, 0) + n
        for r, n in r_m.items():
            r2[r] = r2.get(r, 0) + n
        over = max([*s2.values(), *r2.values(), 0]) > bucket_bytes
        if current and (over or moves[current[0]].src.dtype != m.src.dtype):
            buckets.append(current)
            current, s2, r2 = [], dict(s_m), dict(r_m)
        current.append(i)
        sent, recv = s2, r2
    if current:
        buckets.append(current)
    return buckets


def relayout_(src, dst, **kwargs) -> RelayoutPlan:
    """Plan and run in one call (see :func:`plan_relayout`); returns the plan (its report)."""
    plan = plan_relayout(src, dst, **kwargs)
    plan.run(src, dst)
    return plan


@torch.no_grad()
def relayout_optimizer_state_(src_model, src_opt, dst_model, dst_opt,
                              **kwargs) -> RelayoutPlan:
    """Elastic resize: every per-parameter optimizer state tensor laid out like its parameter
    (Adam's ``exp_avg``, ``exp_avg_sq``) moved from ``src_opt``'s state into ``dst_opt``'s, laid
    out like the destination parameters (created there if missing); scalar state (``step``) is
    copied. Parameters are matched by name (``name_map`` as in :func:`plan_relayout`); the
    models are modules or ``{name: parameter}`` dicts (the parameters the optimizers hold)."""
    src_named = _named(src_model)
    dst_named = _named(dst_model)
    src_t, dst_t = {}, {}
    name_map = kwargs.get("name_map")
    for dname, dp in dst_named.items():
        sname = _mapped(name_map, dname)
        sstate = src_opt.state.get(src_named[sname], {})
        dstate = dst_opt.state[dp]
        for k, v in sstate.items():
            if isinstance(v, DTensor):  # laid out like its parameter: moved like it
                if k not in dstate:
                    dstate[k] = torch.zeros_like(dp.detach())
                src_t[f"{sname}::{k}"] = v
                dst_t[f"{dname}::{k}"] = dstate[k]
            elif k not in dstate:
                dstate[k] = v.clone() if isinstance(v, torch.Tensor) else v
    kw = {k: v for k, v in kwargs.items() if k != "name_map"}
    plan = plan_relayout(src_t, dst_t, name_map=lambda n: (
        _mapped(name_map, n.split("::")[0]) + "::" + n.split("::")[1]), **kw)
    plan.run(src_t, dst_t)
    return plan


def _named(model) -> dict:
    return dict(model.named_parameters()) if isinstance(model, nn.Module) else dict(model)


def _mapped(name_map, name):
    return name_map(name) if callable(name_map) else (name_map or {}).get(name, name)
