"""Collective counts that answer to torch's keys as well as ours.

torch's ``CommDebugMode.get_comm_counts()`` is keyed by the ops torch's DTensor issues: the
functional collectives (``torch.ops.c10d_functional.all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``, ``broadcast``, and
``torch.ops._dtensor.shard_dim_alltoall`` for a Shard -> Shard move), and the c10d ops its FSDP
issues (``torch.ops.c10d._allgather_base_``, ``_reduce_scatter_base_``, ``allreduce_``). Ours
are keyed by kind (``"all_gather"``, ...). A :class:`CommCounts` holds our keys as a dict does
(iteration, ``==`` with a dict of kinds, ``.items()``) and answers torch's keys by lookup --
``counts[funcol.all_reduce]`` -- and by ``==`` with a dict keyed by torch's ops. Every key that
was not seen counts 0, as in torch's defaultdict. The native spellings
(``torch.ops._c10d_functional.*``) and overloads (``....default``) are the same keys.
"""
from __future__ import annotations

__all__ = ["CommCounts", "torch_op_names"]

_FUNCOL = "c10d_functional::"
_C10D = "c10d::"
# (our kind, issued by FSDP?) -> the qualified names of the torch ops torch counts for it
_TORCH_NAMES = {
    ("all_gather", False): (_FUNCOL + "all_gather_into_tensor",),
    ("reduce_scatter", False): (_FUNCOL + "reduce_scatter_tensor",),
    ("all_reduce", False): (_FUNCOL + "all_reduce",),
    ("all_to_all", False): (_FUNCOL + "all_to_all_single", "_dtensor::shard_dim_alltoall"),
    ("broadcast", False): (_FUNCOL + "broadcast", _C10D + "broadcast_"),
    ("scatter", False): (_C10D + "scatter_",),
    ("all_gather", True): (_C10D + "_allgather_base_",),
    ("reduce_scatter", True): (_C10D + "_reduce_scatter_base_",),
    ("all_reduce", True): (_C10D + "allreduce_",),
}


def torch_op_names(kind: str, op: str) -> tuple[str, ...]:
    """The torch ops (qualified names) a collective of ``kind`` caused by ``op`` (a
    ``comm_cause`` label: FSDP's are ``"fsdp.*"``) counts as; () for the point-to-point kinds,
    which torch's mode does not count."""
    fsdp = op.startswith("fsdp.")
    return _TORCH_NAMES.get((kind, fsdp)) or _TORCH_NAMES.get((kind, False), ())


def _qualified_name(key) -> str | None:
    """``torch.ops.c10d_functional.all_reduce`` (or its native ``_c10d_functional`` twin, or an
    overload of either) -> ``"c10d_functional::all_reduce"``; None for a key that is no op."""
    name = getattr(key, "_qualified_op_name", None)  # an OpOverloadPacket
    if name is None:
        packet = getattr(key, "overloadpacket", None)  # an OpOverload
        name = getattr(packet, "_qualified_op_name", None)
    if name is None:
        return None
    namespace, _, op = name.partition("::")
    if namespace in ("_c10d_functional", "_c10d_functional_autograd"):
        namespace = "c10d_functional"
    return f"{namespace}::{op}"


class CommCounts(dict):
    """``{kind: count}`` that also answers torch's op keys (see the module docstring)."""

    def __init__(self, counts=(), torch_counts=None):
        super().__init__(counts)
        self._torch = dict(torch_counts or {})  # qualified torch op name -> count

    def __missing__(self, key):
        return 0

    def __getitem__(self, key):
        if isinstance(key, str):
            return super().__getitem__(key)
        name = _qualified_name(key)
        return self._torch.get(name, 0) if name is not None else 0

    def get(self, key, default=None):
        return self[key] if key in self else default

    def __contains__(self, key):
        if isinstance(key, str):
            return super().__contains__(key)
        return self._torch.get(_qualified_name(key), 0) > 0

    def __eq__(self, other):
        if isinstance(other, dict) and other and not any(isinstance(k, str) for k in other):
            # a dict keyed by torch's ops, as torch's tests write them
            mine = {k: v for k, v in self._torch.items() if v}
            theirs = {_qualified_name(k): v for k, v in other.items() if v}
            return mine == theirs
        return dict.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    __hash__ = None

    def by_torch_op(self) -> dict[str, int]:
        """``{qualified torch op name: count}``, e.g. ``{"c10d_functional::all_reduce": 2}``."""
        return dict(self._torch)

    def _add(self, kind: str, op: str, torch_names: tuple[str, ...] | None = None) -> None:
        """Count one collective of ``kind``; ``torch_names``: the torch ops it counts as, where
        they are known (a functional collective user code called), else derived from ``op``."""
        dict.__setitem__(self, kind, dict.get(self, kind, 0) + 1)
        for name in torch_op_names(kind, op) if torch_names is None else torch_names:
            self._torch[name] = self._torch.get(name, 0) + 1
