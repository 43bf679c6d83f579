"""CommDebugMode's view of the functional collectives that *user code* calls.

Every collective of dtensor_lite reaches CommDebugMode through ``collectives.py``; but user code
may call torch's functional collectives itself (``funcol.all_reduce(x, "sum", mesh)`` inside a
``local_map``'d function, torchtitan's ``dist_max``), and torch's CommDebugMode counts those. They
are ``torch.ops._c10d_functional.*`` ops, which pass through ``__torch_function__`` (not only
the dispatcher): a small ``TorchFunctionMode`` entered with CommDebugMode sees them.

Why not a TorchDispatchMode, as torch's: one would see every aten op, turn off DTensor's fast
path (``_fast_path``: a dispatch mode must see every op) and change what it measures. A function
mode costs one Python call per torch call inside the mode and leaves the dispatch path alone. It
does not see the c10d ops of ``torch.distributed.all_reduce(...)`` & co, which are no torch
functions (torch's mode counts those too; ours counts its own collectives, not a user's c10d ones).

No double counting: a functional collective whose nearest caller outside torch is dtensor_lite
(or its fsdp / tp) was issued by our collectives layer, which reports it already; it is skipped.
Under ``torch.compile`` the mode does nothing (the compiled graph's collectives are ours).
"""
from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

from .collectives import all_reduce_cost
from ._torch_names import OpOverload, OpOverloadPacket
from .debug_state import CAUSES

__all__ = ["FuncolCounter"]

_OURS = ("dtensor_lite", "fsdp", "tp")

# native functional collective -> (our kind, the key torch's CommDebugMode counts it under)
_KINDS = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast",
}


def _counted_ops() -> dict:
    """{op packet or overload: functional collective name} for every spelling torch has."""
    out = {}
    for ns_name in ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd"):
        ns = getattr(torch.ops, ns_name)
        for name in _KINDS:
            try:
                packet = getattr(ns, name)
            except (AttributeError, RuntimeError):
                continue
            out[packet] = name
            for overload in packet.overloads():
                out[getattr(packet, overload)] = name
    return out


_COUNTED: dict = {}


def _issued_by_us() -> bool:
    """Is the nearest caller outside torch dtensor_lite (or our fsdp / tp)?"""
    frame = sys._getframe(2)  # past this function and __torch_function__
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module != "torch" and not module.startswith("torch."):
            return module.split(".", 1)[0] in _OURS
        frame = frame.f_back
    return False


def _group(args, kwargs, name):
    group_name = kwargs.get("group_name", args[-1] if args else None)
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
        pg = _resolve_process_group(group_name)
        return pg.size(), tuple(torch.distributed.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - a name we cannot resolve: count it with unknown peers
        return 1, ()


def _bytes(name: str, args, n: int) -> int:
    """Bytes sent per rank, in collectives.py's cost model."""
    first = args[0] if args else None
    tensors = list(first) if isinstance(first, (list, tuple)) else [first]
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        numel, size = t.numel(), t.element_size()
        if name.startswith("all_reduce"):
            total += all_reduce_cost(numel, size, n)
        elif name.startswith("all_gather"):
            total += (n - 1) * numel * size
        elif name.startswith("reduce_scatter") or name == "all_to_all_single":
            total += (n - 1) * (-(-numel // n)) * size
        elif name == "broadcast":
            total += numel * size
    return total


class FuncolCounter(TorchFunctionMode):
    """Reports each functional collective user code calls to ``add`` (CommDebugMode._add)."""

    def __init__(self, add):
        super().__init__()
        self._add = add
        if not _COUNTED:
            _COUNTED.update(_counted_ops())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _COUNTED.get(func) if type(func) in (OpOverload, OpOverloadPacket) else None
        if name is not None and not torch.compiler.is_compiling() and not _issued_by_us():
            n, ranks = _group(args, kwargs, name)
            op, input = CAUSES[-1] if CAUSES else (f"funcol.{name}", None)
            self._add(_KINDS[name], _bytes(name, args, n), n, "?", ranks, op, input,
                      torch_names=(f"c10d_functional::{name}",))
        return out
