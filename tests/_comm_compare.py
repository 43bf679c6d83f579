"""Communication cost of the same work under PyTorch's DTensor and under ours, in one unit.

The unit is the planner's: bytes sent per rank (ring collectives, equal chunks) plus
``COLLECTIVE_LATENCY_BYTES`` per collective (``dtensor_lite/redistribute/steps.py``). Ours is read
from our ``CommDebugMode`` records; PyTorch's from a ``TorchDispatchMode`` over the functional
collectives its DTensor issues (torch's own CommDebugMode counts them but keeps no sizes), priced
with the same per-kind formulas, so the two sides differ only by what each library chose to send.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dtensor_lite.redistribute.steps import COLLECTIVE_LATENCY_BYTES

__all__ = ["Comm", "TorchComm", "ours_comm", "torch_mesh", "to_torch_placements"]


class Comm(NamedTuple):
    collectives: int
    nbytes: int

    @property
    def cost(self) -> int:
        return self.collectives * COLLECTIVE_LATENCY_BYTES + self.nbytes

    def __add__(self, other):
        return Comm(self.collectives + other.collectives, self.nbytes + other.nbytes)


def _group_size(name) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group
    return dist.get_world_size(_resolve_process_group(name))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _all_reduce_bytes(t, n):
    return 2 * (n - 1) * -(-t.numel() // n) * t.element_size()


def _all_to_all_bytes(t, out_splits, in_splits, n):
    if in_splits:  # what leaves this rank: every split but its own
        row = _nbytes(t) // max(t.shape[0], 1)
        return (sum(in_splits) - in_splits[dist.get_rank() % n]) * row if t.shape[0] else 0
    return (n - 1) * -(-_nbytes(t) // n)


# funcol op name -> (bytes this rank sends, group size) from the op's arguments
_PRICES = {
    "all_gather_into_tensor": lambda a: ((a[1] - 1) * _nbytes(a[0]), a[1]),
    "reduce_scatter_tensor": lambda a: ((a[2] - 1) * -(-_nbytes(a[0]) // a[2]), a[2]),
    "all_reduce": lambda a: (_all_reduce_bytes(a[0], _group_size(a[2])), _group_size(a[2])),
    "all_to_all_single": lambda a: (_all_to_all_bytes(a[0], a[1], a[2], _group_size(a[3])),
                                    _group_size(a[3])),
    "broadcast": lambda a: ((_group_size(a[2]) - 1) * -(-_nbytes(a[0]) // _group_size(a[2])),
                            _group_size(a[2])),
}
_COALESCED = {"all_gather_into_tensor_coalesced": "all_gather_into_tensor",
              "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
              "all_reduce_coalesced": "all_reduce"}


class TorchComm(TorchDispatchMode):
    """Records PyTorch DTensor's functional collectives: ``records`` of (kind, bytes)."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        if any(issubclass(t, DTensor) for t in types):
            # let DTensor run the op first: its collectives then come back through this mode
            # (a mode is off while its own __torch_dispatch__ runs)
            return NotImplemented
        ns = func.namespace
        name = func._overloadpacket.__name__
        if ns in ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd"):
            if name in _PRICES:
                self.records.append((name, _PRICES[name](args)[0]))
            elif name in _COALESCED:
                price = _PRICES[_COALESCED[name]]
                self.records.append((name, sum(price((t, *args[1:]))[0] for t in args[0])))
            elif name not in ("wait_tensor", "_wrap_tensor_autograd"):
                self.records.append((name, 0))
        elif ns == "c10d" and name not in ("barrier", "monitored_barrier"):
            self.records.append((name, 0))  # a plain c10d collective (not funcol): count it
        return func(*args, **(kwargs or {}))

    @property
    def comm(self) -> Comm:
        return Comm(len(self.records), sum(b for _, b in self.records))


def ours_comm(mode, only_op: str | None = None) -> Comm:
    """Our CommDebugMode's records in the same unit (``only_op``: just those with that cause,
    e.g. ``"rng_check"``)."""
    records = [r for r in mode.records if only_op is None or r.op == only_op]
    return Comm(len(records), sum(r.nbytes for r in records))


_TORCH_MESHES: dict = {}


def torch_mesh(shape):
    """torch's DeviceMesh over the default group, made once per shape (and per group: a test
    that re-initialises the world gets new ones)."""
    from torch.distributed.device_mesh import init_device_mesh
    key = (tuple(shape), id(dist.group.WORLD))
    if key not in _TORCH_MESHES:
        _TORCH_MESHES[key] = init_device_mesh("cpu", tuple(shape))
    return _TORCH_MESHES[key]


def to_torch_placements(placements):
    """Ours -> torch's placement objects (Shard / Replicate / Partial)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    out = []
    for p in placements:
        if p.is_shard():
            out.append(Shard(p.dim))
        elif p.is_replicate():
            out.append(Replicate())
        else:
            out.append(Partial(p.reduce_op))
    return out
