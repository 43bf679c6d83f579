"""Tensor methods and operators on DTensor that reach ``_fast_path``'s replays directly.

``a + b``, ``a.sum(1)``, ``a.add_(b)`` on a DTensor are C methods of ``torch.Tensor``: each parses
its arguments in C++, finds DTensor's ``__torch_function__`` and calls back into Python (about
1.7 us, more than an 8x8 add itself) before ``_fast_path`` can replay the call. The methods named
here are defined on DTensor in Python instead, so Python calls them directly: they run the same
``_fast_path.torch_function`` with the C method as the function (its own shortcut key), and a call
the shortcut cannot take goes on exactly as before (the C method, with DTensor's hook skipped for
that one call, as ``_fast_path`` runs every ordinary call).

The one thing ``__torch_function__`` gives that a Python method does not is the torch-function
modes: C++ hands a call to an active ``TorchFunctionMode`` (or skips every hook under
``DisableTorchFunction``) before any subclass sees it. So while a mode is on the stack, or torch
functions are disabled, these methods call the C method itself, which does all of that.

Which methods: arithmetic operators and their in-place forms, the common reductions and matrix
products, and views (replayed by ``_view_replay``).
Installed and removed with ``_fast_path`` (``DTENSOR_LITE_FAST_PATH=0`` leaves DTensor with
torch's methods only).
"""
from __future__ import annotations

import torch

from . import _torch_names as N

__all__ = ["install"]

_NAMES = (
    # operators (Python looks these up on the type: ``a + b`` is ``type(a).__add__(a, b)``)
    "__add__", "__sub__", "__mul__", "__truediv__", "__matmul__", "__pow__",
    "__iadd__", "__isub__", "__imul__", "__itruediv__",
    # methods
    "add", "sub", "mul", "div", "add_", "sub_", "mul_", "div_", "addcmul_", "addcdiv_", "lerp_",
    "neg", "exp", "sqrt", "rsqrt", "pow", "abs", "relu", "sigmoid", "tanh", "clamp",
    "sum", "mean", "amax", "norm", "matmul", "mm", "bmm",
    # views (``_view_replay``)
    "t", "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "expand",
)

_mode_stack = N.len_torch_function_stack
_hooks_on = N.is_torch_function_enabled
_DEFINED: dict = {}  # name -> the Python method, made once


def _c_method(name):
    """``torch.Tensor``'s method ``name`` where it is the C one (what the replays can key on),
    else None: a name this torch lacks, or one ``torch.Tensor`` defines in Python (a Python
    function runs the ordinary way anyway, see _fast_path)."""
    base = getattr(N.TensorBase, name, None)
    ok = type(base) is _METHOD_DESCRIPTOR and getattr(torch.Tensor, name, None) is base
    return base if ok else None


_METHOD_DESCRIPTOR = type(N.TensorBase.add)


def _method(name, base, torch_function, dtensor_cls):
    types_ = (dtensor_cls,)

    if name.startswith("__"):
        def method(self, other):  # operators: one argument, never keywords
            if _mode_stack() or not _hooks_on():
                return base(self, other)
            return torch_function(dtensor_cls, base, types_, (self, other))
    else:
        def method(self, *args, **kwargs):
            if _mode_stack() or not _hooks_on():
                return base(self, *args, **kwargs)
            return torch_function(dtensor_cls, base, types_, (self, *args), kwargs or None)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = base.__doc__
    return method


def install(on: bool, torch_function, dtensor_cls) -> None:
    """Define (or, with False, remove) the methods of ``_NAMES`` on ``dtensor_cls``."""
    for name in _NAMES:
        if on:
            if name not in _DEFINED:
                base = _c_method(name)
                if base is None:
                    continue
                _DEFINED[name] = _method(name, base, torch_function, dtensor_cls)
            setattr(dtensor_cls, name, _DEFINED[name])
        elif name in dtensor_cls.__dict__:
            delattr(dtensor_cls, name)
