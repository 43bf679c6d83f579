"""Whole-model relayout: every parameter of a model laid out one way (``fully_shard`` /
``parallelize_module`` on mesh A) moved into a model laid out another way (another plan, maybe
on other ranks), in buckets -- RL weight sync (trainer -> rollout engine) and elastic resize.

Each destination tensor is filled from one source tensor, or from several (a fused destination:
``qkv`` from ``q``, ``k``, ``v`` concatenated along a dim) -- each source then fills a region of
it. What moves is the cross-mesh plan of each (source, destination region) pair
(``redistribute.cross_mesh``): per (source rank, destination rank) the index boxes one holds and
the other needs, nothing else. Tensors are grouped into buckets whose largest per-rank send or
receive stays within ``bucket_bytes``; a bucket is ONE message per rank pair (its boxes
concatenated), cast to the wire dtype *before* sending, written into the destination's local
pieces in place. So the extra memory of a rank is at most one bucket of send buffers plus one of
receive buffers (a tensor larger than the bucket is a bucket of its own).

Everything is decided from metadata (names, shapes, dtypes, meshes, placements) that every rank
has, so ``RelayoutPlan.report()`` is a dry run that needs no data; before moving anything the
ranks compare a fingerprint of the plan (one small all-reduce), so a rank that built another
plan makes every rank raise instead of hanging.

Example::

    >>> plan = plan_relayout(trainer_model, rollout_model, dtype=torch.bfloat16,
    ...                      fused={"attn.qkv.weight": Concat(["attn.q.weight", "attn.k.weight",
    ...                                                        "attn.v.weight"], dim=0)})
    >>> print(plan.report())          # bytes per rank pair, buckets, peak extra memory
    >>> plan.run(trainer_model, rollout_model)   # every rank of the world calls it
"""
from __future__ import annotations

import math
import zlib
from typing import Callable, NamedTuple

import torch
import torch.nn as nn

from . import collectives as C
from .dtensor import DTensor, _default_mesh
from .placements import Replicate
from .redistribute.cross_mesh import (_volume, box_slices, check_meshes, plan_cross_mesh,
                                      reduced_source, shift_box)
from .redistribute.local import redistribute_local
from .spec import DTensorSpec, TensorMeta

__all__ = ["Concat", "RelayoutPlan", "plan_relayout", "relayout_", "relayout_optimizer_state_"]

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


class Concat(NamedTuple):
    """A fused destination tensor: the source tensors ``names`` concatenated along ``dim``."""
    names: list
    dim: int = 0


class _Move(NamedTuple):
    """One source tensor into one region of one destination tensor."""
    dst_name: str
    src_name: str
    src: DTensorSpec      # as it travels: Partial dims already reduced, in the wire dtype
    dst: DTensorSpec
    region: tuple | None  # (dim, offset) in the destination; None: the whole of it
    plan: object          # CrossMeshPlan


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

    # ------------------------------------------------------------------ dry run
    def pair_bytes(self) -> dict:
        """{(source rank, destination rank): bytes} over the whole relayout."""
        out: dict = {}
        for m in self.moves:
            for pair, n in m.plan.pair_bytes().items():
                out[pair] = out.get(pair, 0) + n
        return out

    def bytes_sent(self) -> dict:
        out: dict = {}
        for (a, _), n in self.pair_bytes().items():
            out[a] = out.get(a, 0) + n
        return out

    def bucket_traffic(self, k: int) -> tuple[dict, dict]:
        """({rank: bytes sent}, {rank: bytes received}) in bucket ``k``."""
        sent, recv = {}, {}
        for i in self.buckets[k]:
            for (a, b), n in self.moves[i].plan.pair_bytes().items():
                sent[a] = sent.get(a, 0) + n
                recv[b] = recv.get(b, 0) + n
        return sent, recv

    def peak_extra_bytes(self) -> dict:
        """{rank: the most bytes of send + receive buffers it holds at once} (one bucket's)."""
        peak: dict = {}
        for k in range(len(self.buckets)):
            sent, recv = self.bucket_traffic(k)
            for r in set(sent) | set(recv):
                peak[r] = max(peak.get(r, 0), sent.get(r, 0) + recv.get(r, 0))
        return peak

    def report(self) -> str:
        pairs = self.pair_bytes()
        lines = [f"relayout: {len(self.moves)} moves in {len(self.buckets)} buckets of <= "
                 f"{_mb(self.bucket_bytes)} per rank, wire dtype {self.wire_dtype or 'as source'}",
                 f"total bytes moved: {_mb(sum(pairs.values()))}; busiest sender: "
                 + (_busiest(self.bytes_sent()) if pairs else "none")]
        lines.append("bytes per rank pair (src -> dst):")
        for (a, b), n in sorted(pairs.items()):
            lines.append(f"  {a:>4} -> {b:<4} {_mb(n)}")
        peak = self.peak_extra_bytes()
        if peak:
            lines.append("peak extra memory per rank (send + receive buffers of one bucket): "
                         + ", ".join(f"{r}: {_mb(n)}" for r, n in sorted(peak.items())))
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
        for bucket in self.buckets:
            self._run_bucket([self.moves[i] for i in bucket], srcs, dsts)

    def _run_bucket(self, moves, srcs, dsts):
        me = torch.distributed.get_rank()
        sends: dict = {}
        recvs: dict = {}
        local_src = {}
        for m in moves:
            t = srcs[m.src_name]
            local = t._local_tensor
            spec = t._spec
            reduced = reduced_source(spec)
            if reduced is not spec:  # a Partial source: reduced inside its mesh first
                local = redistribute_local(local, spec, reduced)
            coord = reduced.mesh.get_coordinate()
            offset = reduced.local_shape_and_offset()[1] if coord is not None else None
            local_src[id(m)] = (local, offset)
            for (a, b), boxes in m.plan.pairs.items():
                if a == me:
                    for box in boxes:  # cast before sending: the wire carries the wire dtype
                        sends.setdefault(b, []).append(
                            local[box_slices(box, offset)].reshape(-1).to(m.src.dtype))
                if b == me:
                    numel = sum(_volume(box) for box in boxes)
                    n, dtype = recvs.get(a, (0, m.src.dtype))
                    recvs[a] = (n + numel, dtype)
        flat_sends = {b: (p[0] if len(p) == 1 else torch.cat(p)) for b, p in sends.items()}
        device = next(iter(dsts.values())).device if dsts else torch.device("cpu")
        received = C.exchange_pieces(flat_sends, recvs, device) if flat_sends or recvs else {}
        del flat_sends, sends
        cursor = {a: 0 for a in received}
        for m in moves:
            out = dsts[m.dst_name]
            if out._spec.mesh.get_coordinate() is None:
                continue
            piece = out._local_tensor
            dst_offset = out._spec.local_shape_and_offset()[1]
            local, src_offset = local_src[id(m)]
            for box in m.plan.local.get(me, ()):
                piece[box_slices(shift_box(box, m.region), dst_offset)] = \
                    local[box_slices(box, src_offset)].to(piece.dtype)
            for (a, b), boxes in m.plan.pairs.items():
                if b != me:
                    continue
                flat = received[a]
                for box in boxes:
                    n = _volume(box)
                    start = cursor[a]
                    piece[box_slices(shift_box(box, m.region), dst_offset)] = \
                        flat[start:start + n].reshape([e - s for s, e in box]).to(piece.dtype)
                    cursor[a] = start + n


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
    for m in moves:
        for spec in (m.src, m.dst):
            parts.append(f"{spec.mesh.device_type}{[t.tolist() for t in _instances(spec.mesh)]}"
                         f"{spec.placements}{spec.shard_order}{tuple(spec.shape)}{spec.dtype}")
        parts.append(f"{m.src_name}>{m.dst_name}@{m.region}")
    return zlib.crc32("|".join(parts).encode()) & 0x7FFFFFFF


def _instances(mesh):
    from .redistribute.cross_mesh import mesh_instances
    return mesh_instances(mesh)


def _check_same_plan(plan: RelayoutPlan) -> None:
    """One all-reduce (max and min of the fingerprint) over the world: every rank raises the same
    error when some rank planned differently, before any tensor moves."""
    mesh = _default_mesh(torch.empty(0))
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
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> RelayoutPlan:
    """Plan moving ``src``'s tensors into ``dst``'s (modules or ``{name: DTensor or
    DTensorSpec}``). Pure metadata, no communication.

    ``name_map``: destination name -> source name (a dict or a function; default: the same
    name). ``fused``: destination name -> :class:`Concat` of source names (``qkv`` from ``q``,
    ``k``, ``v``): each source fills its rows, and only the bytes each destination rank needs
    move. ``dtype``: the wire dtype, cast before sending (the destination tensors must have it;
    default: the source's, which must then equal the destination's). ``bucket_bytes``: the most
    bytes a rank sends (or receives) per bucket.
    """
    srcs, dsts = _tensors(src), _tensors(dst)
    fused = dict(fused or {})
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"relayout: bucket_bytes must be a positive int, got {bucket_bytes!r}")
    moves = []
    for dst_name, d in dsts.items():
        dspec = _spec_of(dst_name, d)
        if dst_name in fused:
            cat = fused[dst_name]
            if not isinstance(cat, Concat):
                raise TypeError(f"relayout: fused[{dst_name!r}] must be a Concat(names, dim), "
                                f"got {cat!r}")
            sources, dim = list(cat.names), cat.dim % max(dspec.ndim, 1)
        else:
            mapped = name_map(dst_name) if callable(name_map) else \
                (name_map or {}).get(dst_name, dst_name)
            sources, dim = [mapped], None
        offset = 0
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
            region = None
            if dim is not None:
                expect = list(dspec.shape)
                expect[dim] = sspec.shape[dim] if sspec.ndim == dspec.ndim else -1
                if list(sspec.shape) != expect:
                    raise ValueError(
                        f"relayout: fused {dst_name!r} {tuple(dspec.shape)} cannot hold "
                        f"{src_name!r} {tuple(sspec.shape)} along dim {dim}")
                region = (dim, offset)
                offset += sspec.shape[dim]
            elif tuple(sspec.shape) != tuple(dspec.shape):
                raise ValueError(f"relayout: shape mismatch: source {src_name!r} is "
                                 f"{tuple(sspec.shape)}, destination {dst_name!r} is "
                                 f"{tuple(dspec.shape)}")
            travel = _with_dtype(reduced_source(sspec), wire)
            plan = plan_cross_mesh(travel, _with_dtype(dspec, wire), region)
            moves.append(_Move(dst_name, src_name, travel, dspec, region, plan))
        if dim is not None and offset != dspec.shape[dim]:
            raise ValueError(f"relayout: fused {dst_name!r} has {dspec.shape[dim]} rows along "
                             f"dim {dim} but its sources {sources} fill {offset}")
    return RelayoutPlan(moves, _buckets(moves, bucket_bytes), bucket_bytes, dtype)


def _buckets(moves, bucket_bytes: int) -> list:
    """Consecutive moves while no rank's sends or receives in the bucket pass ``bucket_bytes``."""
    buckets, current, sent, recv = [], [], {}, {}
    for i, m in enumerate(moves):
        s2, r2 = dict(sent), dict(recv)
        for (a, b), n in m.plan.pair_bytes().items():
            s2[a] = s2.get(a, 0) + n
            r2[b] = r2.get(b, 0) + n
        over = max([*s2.values(), *r2.values(), 0]) > bucket_bytes
        # one message per rank pair and bucket carries one dtype
        if current and (over or moves[current[0]].src.dtype != m.src.dtype):
            buckets.append(current)
            current, s2, r2 = [], {}, {}
            for (a, b), n in m.plan.pair_bytes().items():
                s2[a] = s2.get(a, 0) + n
                r2[b] = r2.get(b, 0) + n
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
def relayout_optimizer_state_(src_model: nn.Module, src_opt, dst_model: nn.Module, dst_opt,
                              **kwargs) -> RelayoutPlan:
    """Elastic resize: every per-parameter optimizer state tensor laid out like its parameter
    (Adam's ``exp_avg``, ``exp_avg_sq``) moved from ``src_opt``'s state into ``dst_opt``'s, laid
    out like the destination parameters (created there if missing); scalar state (``step``) is
    copied. Parameters are matched by name (``name_map`` as in :func:`plan_relayout`)."""
    src_named = dict(src_model.named_parameters())
    dst_named = dict(dst_model.named_parameters())
    keys = sorted({k for st in src_opt.state.values() for k, v in st.items()
                   if isinstance(v, DTensor)})
    src_t, dst_t = {}, {}
    name_map = kwargs.get("name_map")
    for dname, dp in dst_named.items():
        sname = name_map(dname) if callable(name_map) else (name_map or {}).get(dname, dname)
        sstate = src_opt.state.get(src_named[sname], {})
        dstate = dst_opt.state[dp]
        for k, v in sstate.items():
            if k in keys and isinstance(v, DTensor):
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


def _mapped(name_map, name):
    return name_map(name) if callable(name_map) else (name_map or {}).get(name, name)
