"""The library's own work is unseen by the user's dispatch modes: they see the program's ops only.

A ``TorchDispatchMode`` active around a DTensor program (activation checkpointing's selective
policy, a recording or counting mode) sees each op on DTensors once, at the DTensor level: the
local ops and collectives it becomes run inside ``DTensor.__torch_dispatch__``, where torch has
popped the mode. The library also works *outside* dispatch, in Python: the differentiable
conversions (``from_local``, ``redistribute`` and their backwards), the gathering of pieces of an
unknown global size, the shape exchanges. Those ops used to reach the user's modes, and their
sequence depends on the library's state, not on the program: the first call of a call site
exchanges shapes where a warm one rides the size with the data (gather_pieces.py), a cached plan
takes another runner. Under activation checkpointing the recompute is that warm second call, so
its op sequence differed from the forward's, and selective checkpointing (whose recompute replays
the forward's ops by position) failed: ``aten.zeros.default encountered during backward but not
found in storage`` (torchtitan's 2-D + sequence-parallel + selective default).

The rule, for every shortcut present and future: what a mode sees is a function of the program
alone. So the library's Python-level work runs with the user's modes set aside
(``unseen()``), as its dispatch-level work already does, and a checkpoint's recompute issues the
forward's op sequence whatever was warmed in between (tests/test_activation_checkpointing.py
records both). The cost: a selective policy cannot choose to keep the result of a redistribute
(torchtitan's list names ``reduce_scatter_tensor``); it is recomputed, as full checkpointing
would. Modes that must see everything keep seeing it: traces (fake, functional, proxy modes of
``torch.compile`` / ``make_fx``) and ours that measure the library itself (a mode class with
``sees_dtensor_lite_internals = True``, e.g. the dry run's memory recorder).
"""
from __future__ import annotations

import contextlib
import functools

import torch

from ._torch_names import (current_dispatch_mode_stack as _get_current_dispatch_mode_stack,
                           disable_current_modes as _disable_current_modes, dispatch_mode_keys,
                           get_dispatch_mode, len_pre_dispatch_stack as _len_pre_dispatch,
                           len_torch_dispatch_stack as _len_stack)

__all__ = ["unseen", "unseen_fn"]

_INFRA = tuple(getattr(dispatch_mode_keys, k) for k in ("FAKE", "PROXY", "FUNCTIONAL")
               if hasattr(dispatch_mode_keys, k))


def _must_see() -> bool:
    """A trace is running, or a mode on the stack measures the library itself."""
    if any(get_dispatch_mode(k) is not None for k in _INFRA):
        return True
    if _len_pre_dispatch():
        return True
    return any(getattr(m, "sees_dtensor_lite_internals", False)
               for m in _get_current_dispatch_mode_stack())


def unseen():
    """A context in which the user's dispatch modes are set aside (nothing to do, and nothing
    paid but one C call, when none is active)."""
    if not _len_stack() or torch.compiler.is_compiling() or _must_see():
        return contextlib.nullcontext()
    return _disable_current_modes()


def unseen_fn(fn):
    """``fn`` run under ``unseen()``."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _len_stack():
            return fn(*args, **kwargs)
        with unseen():
            return fn(*args, **kwargs)
    return wrapper
