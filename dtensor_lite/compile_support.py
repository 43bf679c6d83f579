"""What ``torch.compile`` needs from dtensor_lite.

* DTensor is a traceable wrapper subclass (``__tensor_flatten__`` / ``__tensor_unflatten__`` in
  dtensor.py): AOTAutograd runs ``__torch_dispatch__`` on fake local tensors, so every sharding
  decision is made at trace time from specs alone and the graph holds only local ops.
* Collectives met while tracing (``is_traced``) are issued as torch's traceable functional
  collectives (``torch.ops._c10d_functional.*`` + ``wait_tensor``), never as c10d calls; in eager
  nothing changes (CommDebugMode still counts them).
* The conversions that build DTensors from Python objects (``from_local``, ``to_local``,
  ``redistribute``, ``full_tensor``, tp's layout hooks) are *boundaries*: Dynamo does not trace
  their Python (specs, interning, caches), it records one call that AOTAutograd then runs for
  real on fake tensors (``torch._dynamo.nonstrict_trace``). Their non-tensor arguments -- meshes,
  placements, specs -- are pytree constants (hashable, compared by ``__eq__``; made before the
  compiled region), and ``None`` travels as a constant stand-in because nonstrict_trace refuses
  it.
* Nothing here imports Dynamo: it costs seconds of every rank's start-up, and torch's DTensor does
  not pay them either. A boundary registers its traced form once Dynamo is imported (by
  ``torch.compile`` itself, which imports it before tracing anything; ``_after_import.py``).
"""
from __future__ import annotations

import functools

import torch
import torch.utils._pytree as pytree

from . import _torch_names as torch_names
from ._after_import import after_import
from ._torch_names import is_functional_tensor, is_functorch_wrapped_tensor

__all__ = ["boundary", "is_traced", "register_constants"]


class _NoneArg:
    """Stands in for ``None`` in a boundary call's arguments (nonstrict_trace refuses None)."""

    def __eq__(self, other):
        return isinstance(other, _NoneArg)

    def __hash__(self):
        return 0

    def __repr__(self):
        return "None"


_NONE = _NoneArg()
_REGISTERED: set = set()


def register_constants(*classes) -> None:
    """Let instances of ``classes`` cross a boundary as compile-time constants."""
    for cls in classes:
        if cls not in _REGISTERED:
            pytree.register_constant(cls)
            _REGISTERED.add(cls)


register_constants(_NoneArg)


def _encode(value):
    return _NONE if value is None else value


def _decode(value):
    return None if isinstance(value, _NoneArg) else value


def _call_decoded(fn, args, kwargs):
    return fn(*[_decode(a) for a in args], **{k: _decode(v) for k, v in kwargs.items()})


def boundary(fn):
    """``fn`` unchanged in eager; under Dynamo one opaque call that AOTAutograd traces for real
    (its Python never runs in Dynamo). Arguments: tensors and registered constants."""
    traced = None  # nonstrict_trace's form of fn, made once Dynamo is imported

    def register(_dynamo):
        nonlocal traced
        traced = torch_names.private(torch_names.NONSTRICT_TRACE)(
            functools.partial(_call_decoded, fn))

    after_import(torch_names.DYNAMO, register)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        return traced([_encode(a) for a in args], {k: _encode(v) for k, v in kwargs.items()})
    return wrapper


def is_traced(t: torch.Tensor) -> bool:
    """``t`` belongs to a trace (fake / functional tensors of AOTAutograd, or Dynamo running):
    collectives on it must be functional ops, not c10d calls on real buffers."""
    if torch.compiler.is_compiling():
        return True
    if type(t) is torch.Tensor and not _is_functional(t) and not _functorch_wrapped(t):
        return False  # a plain tensor, no wrapper around it: not fake (the eager hot path)
    from torch._subclasses.fake_tensor import is_fake  # also sees fakes under functional wrappers
    return is_fake(t)


_is_functional = is_functional_tensor
_functorch_wrapped = is_functorch_wrapped_tensor
