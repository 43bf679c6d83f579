"""Time estimates from the measured bytes and FLOPs: a link model per mesh dim and a compute model.

Link model: a collective over a group of ``n`` ranks takes ``bytes / bandwidth + steps * latency``
where ``bytes`` is what the rank sends (the ring cost the collectives layer reports) and ``steps``
the ring's rounds (``n - 1``; ``2 (n - 1)`` for an all-reduce). A group whose ranks all sit in
one node uses the intra-node link, any other the inter-node link (ranks are numbered node by
node: node ``r // gpus_per_node``). Defaults, per GPU and direction, for H100 SXM nodes:

* intra-node, NVLink 4: 450 GB/s nominal; 360 GB/s assumed achievable (80%), 5 us per round;
* inter-node, one 400 Gb/s NIC per GPU (InfiniBand NDR / RoCE): 50 GB/s nominal; 40 GB/s
  assumed, 10 us per round.

Compute model: ``flops / (peak * efficiency)``; default peak 989 TFLOP/s (H100 SXM dense BF16),
efficiency 0.4 (a typical achieved MFU for large Llama training).

Overlap: collectives over the data-parallel dims (FSDP's all-gathers and reduce-scatters, HSDP's
all-reduce) are issued ahead of / beside compute, so up to the compute time of the step can hide
them; collectives over other dims (tensor parallelism) sit between dependent ops and are exposed.
An estimate, not a simulation: it ignores that the first all-gather and the last reduction of a
step cannot hide, and contention between dims that share a NIC.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = ["Link", "LinkModel", "ComputeModel", "INTRA_NODE", "INTER_NODE", "comm_seconds",
           "overlap"]


@dataclass(frozen=True)
class Link:
    """Bandwidth in bytes/s per rank and direction; latency in seconds per ring round."""
    bandwidth: float
    latency: float

    def __post_init__(self):
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise ValueError(f"Link needs bandwidth > 0 and latency >= 0, got {self}")


INTRA_NODE = Link(bandwidth=360e9, latency=5e-6)
INTER_NODE = Link(bandwidth=40e9, latency=10e-6)


@dataclass(frozen=True)
class LinkModel:
    """Which link each mesh dim's collectives use. ``per_dim`` overrides by dim name.

    Example::

        >>> LinkModel(gpus_per_node=8, per_dim={"dp_replicate": Link(25e9, 20e-6)})
    """
    gpus_per_node: int = 8
    intra: Link = INTRA_NODE
    inter: Link = INTER_NODE
    per_dim: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")

    def link(self, dim: str, groups) -> tuple[Link, str]:
        """The link of ``dim`` whose groups (tuples of global ranks) are ``groups``, and its kind
        (``"intra-node"``, ``"inter-node"`` or ``"given"``)."""
        if dim in self.per_dim:
            return self.per_dim[dim], "given"
        g = self.gpus_per_node
        if all(len({r // g for r in ranks}) <= 1 for ranks in groups):
            return self.intra, "intra-node"
        return self.inter, "inter-node"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ComputeModel:
    peak_flops: float = 989e12
    efficiency: float = 0.4

    def __post_init__(self):
        if not self.peak_flops > 0 or not 0 < self.efficiency <= 1:
            raise ValueError(f"ComputeModel needs peak_flops > 0 and 0 < efficiency <= 1, got "
                             f"{self}")

    def seconds(self, flops: float) -> float:
        return flops / (self.peak_flops * self.efficiency)


def _rounds(kind: str, n: int) -> int:
    if n <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (n - 1)
    if kind == "broadcast":
        return 1
    return n - 1


def comm_seconds(kind: str, nbytes: int, n: int, link: Link) -> float:
    """One collective's time under ``link`` (see the module docstring)."""
    return nbytes / link.bandwidth + _rounds(kind, n) * link.latency


def overlap(compute_s: float, comm_s_by_dim: dict[str, float],
            overlapped_dims) -> dict[str, float]:
    """``{hidden_s, exposed_s, step_s}``: the comm of ``overlapped_dims`` hides behind compute up
    to ``compute_s``; the rest is exposed and adds to the step."""
    hideable = sum(t for d, t in comm_s_by_dim.items() if d in overlapped_dims)
    serial = sum(t for d, t in comm_s_by_dim.items() if d not in overlapped_dims)
    hidden = min(hideable, compute_s)
    exposed = serial + hideable - hidden
    return {"hidden_s": hidden, "exposed_s": exposed, "step_s": compute_s + exposed}
