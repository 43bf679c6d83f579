"""A parallel Linear's hooks and its linear as one autograd node, where nothing can tell.

``ColwiseParallel`` / ``RowwiseParallel`` convert activations in forward hooks around an
``nn.Linear``: the input hook redistributes (a sequence-parallel all-gather) or declares a local
piece (``from_local``), the linear runs on DTensors, the output hook redistributes (a
reduce-scatter) or hands back the local piece. Three autograd nodes and their wrappers per Linear;
dtensor_lite's ``GATHER_COLUMN`` / ``ROW_REDUCE`` shortcuts (``dtensor_lite/_tp_linear.py``) run
the same three steps as one node, calling the same functions.

How the hooks hand the call over: the style also gives the module a ``forward`` of its own
(:func:`install`). Where the call qualifies (:func:`eligible`), the input hook leaves the input as
it is and notes it for the module (per thread); that ``forward`` finds the note and asks for the
shortcut, whose result the output hook then passes through. Where the shortcut declines,
``forward`` converts the input as the hook would have and runs the class's forward; without a
note it is the class's forward itself. A call qualifies only where no one else could see the
difference: the module's own ``forward`` is ``nn.Linear``'s (``nn.LayerNorm``'s for
``SequenceParallel``), the style's hooks are its only hooks (no global module hooks either, no
backward hooks: they would see the input before its conversion), and no trace is running.
"""
from __future__ import annotations

import threading
import types

import torch
import torch.nn as nn
from torch.nn.modules import module as _module

from dtensor_lite._shortcuts import NOT_TAKEN, first

__all__ = ["eligible", "install", "note", "passed_through"]


class _Notes(threading.local):
    """Per thread (a module may be called from several): what the input hook left to forward
    (``pending``) and what forward left to the output hook (``done``), by module."""

    def __init__(self):
        self.pending, self.done = {}, {}


_NOTES = _Notes()
_GLOBAL_HOOKS = tuple(getattr(_module, name, None) for name in (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
    "_global_backward_pre_hooks", "_global_backward_hooks"))
_linear_forward = nn.Linear.forward


def eligible(mod: nn.Module, forward=_linear_forward, output_hooks: int = 1) -> bool:
    """Whether nothing but the style's own hooks (its input hook, ``output_hooks`` output hooks)
    sees ``mod``'s call, whose class runs ``forward`` (see the module docstring)."""
    # a trace first: under Dynamo nothing after it is read, so it guards on none of it
    return (not torch.compiler.is_compiling() and type(mod).forward is forward and
            len(mod._forward_pre_hooks) == 1 and len(mod._forward_hooks) == output_hooks and
            not mod._backward_hooks and not mod._backward_pre_hooks and not any(_GLOBAL_HOOKS))


def note(mod: nn.Module, x, *extra) -> None:
    """The input hook leaves ``x`` to ``mod``'s forward (with ``extra``, what it worked out)."""
    _NOTES.pending[mod] = (x, *extra)


def passed_through(mod: nn.Module, out) -> bool:
    """Whether ``out`` is the shortcut's result, final already (the output hook returns it)."""
    return _NOTES.done.pop(mod, None) is out and out is not None


def install(module: nn.Module, shortcut: str, args_of, general, base=_linear_forward,
            output_hook: bool = True) -> None:
    """Give ``module`` the forward described above: ``args_of(module, *noted)`` are the
    shortcut's arguments, ``finish(out)`` its result's final form (``args_of`` returns both);
    ``general(module, *noted)`` converts the input as the hook would have; ``base`` is the
    class's own forward; ``output_hook``: whether an output hook takes the result (to pass it
    through; else nothing is noted)."""
    def forward(self, input):
        if not torch.compiler.is_compiling():
            noted = _NOTES.pending.pop(self, None)
            if noted is not None and noted[0] is input:
                args, finish = args_of(self, *noted)
                out = first(shortcut, args, {})
                if out is not NOT_TAKEN:
                    out = finish(out)
                    if output_hook:
                        _NOTES.done[self] = out
                    return out
                input = general(self, *noted)
        return base(self, input)
    # bound, in the instance: a deepcopy of the module binds its copy
    module.forward = types.MethodType(forward, module)
