"""Shortcuts: ways to run a call on DTensors that skip work the general path would do.

The general path is the dispatcher: every aten op on DTensors through its sharding rule. A
shortcut is faster for a case it can recognise, and must give exactly what the general path gives
(values to the bit, placements, gradients, errors); where it cannot prove that from the call's
specs and the process's state, it declines and the general path runs unchanged. Rule files
(``ops/``) stay functions of specs: no shortcut lives there.

The one interface for composite ops (CompositeImplicitAutograd: ``linear``), which decompose at
their autograd kernel before any rule sees them::

    @shortcut(aten.linear.default)
    def fn(input, weight, bias=None):
        ...
        return NOT_TAKEN  # or the result

runs ``fn`` first wherever the op meets a DTensor (``ops._registry.intercept_composite``).
``disabled()`` turns every shortcut off (tests compare both paths with it).

The other shortcuts sit in the same layer, each beside the path it shortens: ``_fast_path``
replays whole torch functions whose aten ops were all cache hits, ``_fast_methods`` reaches those
replays from Tensor methods without the C++ entry, and ``collectives.sync_runner`` runs a cached
redistribute plan's one collective. Registered here: ``_local_linear`` (tensor-parallel linear on
local pieces), and, under names rather than ops, ``_tp_linear`` / ``_tp_norm`` (a parallel style's
Linear or LayerNorm with the moves of its hooks, one autograd node each), which ``tp`` asks for
with ``first(name, args, {})``.
"""
from __future__ import annotations

import contextlib

__all__ = ["NOT_TAKEN", "shortcut", "first", "disabled"]

NOT_TAKEN = object()  # a shortcut's answer for "not for this call: take the general path"
_BY_OP: dict = {}  # op -> shortcut functions, tried in registration order
_OFF = [0]  # > 0 inside disabled()


def shortcut(op):
    """Register the decorated ``fn(*args, **kwargs)`` as a shortcut of the composite ``op``."""
    def register(fn):
        _BY_OP.setdefault(op, []).append(fn)
        return fn
    return register


def first(op, args, kwargs):
    """The result of the first shortcut of ``op`` that takes this call, else ``NOT_TAKEN``."""
    fns = _BY_OP.get(op)
    if fns and not _OFF[0]:
        for fn in fns:
            out = fn(*args, **kwargs)
            if out is not NOT_TAKEN:
                return out
    return NOT_TAKEN


@contextlib.contextmanager
def disabled():
    """Every shortcut declines inside the block (the general path runs)."""
    _OFF[0] += 1
    try:
        yield
    finally:
        _OFF[0] -= 1
