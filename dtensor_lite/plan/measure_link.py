"""Measure the point-to-point link of the running process group, so that an estimate made with
``plan.cost`` (``RelayoutPlan.estimate_seconds``) can be checked against a measured run on the
same machine: the estimate's inputs are then this machine's, and what is compared is the model
(bytes per link, one latency per peer, buckets in sequence), not H100 defaults against gloo.

Ranks 0 and 1 exchange a small and a large tensor a few times (send then receive, both ways);
latency is the small round trip's half, bandwidth the large transfer's bytes over its time less
that latency. Best of ``repeats`` (the least disturbed by other load); every rank gets the result.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .cost import Link

__all__ = ["measure_link"]


def measure_link(group=None, big_bytes: int = 8 * 2**20, repeats: int = 5) -> Link:
    """The ``Link`` between ranks 0 and 1 of ``group`` (default: the whole world), as measured
    now. Every rank of the group must call it. ``measure_link()`` -> ``Link(bandwidth=...,
    latency=...)``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world < 2:
        raise ValueError("measure_link needs a group of at least 2 ranks")
    peer = {0: 1, 1: 0}.get(rank)
    small = torch.zeros(1, dtype=torch.uint8)
    big = torch.zeros(big_bytes, dtype=torch.uint8)
    result = torch.zeros(2, dtype=torch.float64)
    if peer is not None:
        peer_global = dist.get_global_rank(group, peer) if group is not None else peer
        latency = min(_round_trip(small, peer_global, rank) for _ in range(repeats)) / 2
        one_way = min(_round_trip(big, peer_global, rank) for _ in range(repeats)) / 2
        result[0] = big_bytes / max(one_way - latency, 1e-9)
        result[1] = latency
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(result, src, group=group)
    return Link(bandwidth=float(result[0]), latency=float(result[1]))


def _round_trip(t: torch.Tensor, peer: int, rank: int) -> float:
    start = time.perf_counter()
    if rank == 0:
        dist.send(t, peer)
        dist.recv(t, peer)
    else:
        dist.recv(t, peer)
        dist.send(t, peer)
    return time.perf_counter() - start
