"""Cheaper callables for aten ops on plain (local) tensors, checked once to run exactly the op.

Calling an aten op overload from Python parses its arguments with the generic schema parser;
``torch.<name>`` / ``Tensor.<name>`` parse them in generated C++, 0.3-0.7 us sooner per call.
Whether such a function runs exactly the overload (not another overload, not a decomposition)
with given arguments is checked once, on meta tensors of the same shapes and strides; the
dispatcher's cached decisions and ``_fast_path``'s replays then call it on every hit.
"""
from __future__ import annotations

from math import copysign as _copysign

import torch

from ._torch_names import TorchDispatchMode, VariableFunctions

__all__ = ["cheaper_spelling", "const", "quick_callable"]

_CONSTANT_TYPES = (int, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
                   torch.layout)


def const(a):
    """Hashable stand-in for a non-DTensor argument the replay may bake in; None if it cannot be
    (a plain tensor, an object whose equality is not identity of meaning)."""
    t = type(a)
    if t is float:
        # 0.0 == -0.0 but they multiply differently: a zero carries its sign (copysign: a C
        # call, where repr() cost a string per call of every op given alpha=0.0 or the like)
        return (t, a) if a else (t, a, _copysign(1.0, a))
    if t in _CONSTANT_TYPES:
        return (t, a)
    if t is tuple or t is list or t is torch.Size:
        parts = []
        for x in a:
            c = const(x)
            if c is None:
                return None
            parts.append(c)
        return (t, tuple(parts))
    if t is complex:
        return (t, repr(a))
    return None


class _SeenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def quick_callable(op, args, kwargs, local_fn):
    """``torch.<name>`` or ``Tensor.<name>``, which parse their arguments in generated C++ (0.5 us
    less than the op overload's generic parser), if calling one with these arguments on plain
    tensors of these local shapes runs exactly ``op`` (checked once, on meta tensors); else
    ``local_fn``."""
    if local_fn is not getattr(op, "_op", None):
        return local_fn  # a rule's own local function
    name = op._schema.name.split("::")[-1]
    for fn in (getattr(VariableFunctions, name, None), getattr(torch.Tensor, name, None)):
        if fn is not None and runs_exactly(fn, op, args, kwargs):
            return fn
    return local_fn


def runs_exactly(fn, op, args, kwargs, spelled=None) -> bool:
    """Whether ``fn(*args, **kwargs)`` dispatches ``op`` alone, with these arguments (tried on
    meta tensors of the same shapes and strides). With ``spelled``: whether ``fn(*spelled,
    **kwargs)`` (the same tensors, other spellings of the rest) dispatches ``op`` with ``args``."""
    metas: dict = {}

    def meta(a):
        if _tensors(a):  # a foreach op's list: each tensor as a meta tensor
            return type(a)(meta(t) for t in a)
        if not isinstance(a, torch.Tensor):
            return a
        if id(a) not in metas:
            metas[id(a)] = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        return metas[id(a)]
    margs = [meta(a) for a in args]
    mkw = {k: meta(v) for k, v in kwargs.items()}
    try:
        with _SeenOps() as mode:
            fn(*(margs if spelled is None else [meta(a) for a in spelled]), **mkw)
    except Exception:  # noqa: BLE001 - another overload or signature: not this one
        return False
    if len(mode.seen) != 1 or mode.seen[0][0] is not op:
        return False
    _, sargs, skw = mode.seen[0]
    return len(sargs) == len(margs) and all(map(_received, sargs, margs)) and \
        {k: const(v) for k, v in skw.items()} == {k: const(v) for k, v in mkw.items()}


def _tensors(a) -> bool:
    """Whether ``a`` is a non-empty list / tuple of tensors."""
    return isinstance(a, (list, tuple)) and bool(a) and all(isinstance(t, torch.Tensor)
                                                            for t in a)


def _received(seen, given) -> bool:
    """Whether the op saw the argument ``given`` as it was: the same tensor (or the same
    tensors, in a list), or a constant equal to it."""
    if seen is given:
        return True
    if _tensors(given):
        return _tensors(seen) and len(seen) == len(given) and all(
            s is g for s, g in zip(seen, given))
    return not isinstance(seen, torch.Tensor) and const(seen) == const(given)


def cheaper_spelling(fn, op, args, kwargs) -> list:
    """``args`` with each one-int list as the int itself where ``fn`` (a ``quick_callable``)
    runs ``op`` with ``args`` so: ``torch.sum(x, 1)`` parses 0.3 us sooner than
    ``torch.sum(x, [1])`` (checked once, on meta tensors); else ``args``."""
    spelled = [a[0] if type(a) is list and len(a) == 1 and type(a[0]) is int else a
               for a in args]
    if all(x is y for x, y in zip(spelled, args)) or not runs_exactly(fn, op, args, kwargs,
                                                                       spelled):
        return list(args)
    return spelled
