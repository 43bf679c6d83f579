"""``torch.distributed.tensor.experimental``'s names: ``local_map``, ``register_sharding`` (defined
in :mod:`dtensor_lite.strategy_api`) and ``implicit_replication``. torch's ``context_parallel``
is not provided: ``examples/strategies/ring_attention.py`` builds ring attention on the
placement API (docs/strategies.md)."""
from __future__ import annotations

import contextlib

from . import _dispatch
from .strategy_api import local_map, register_sharding

__all__ = ["implicit_replication", "local_map", "register_sharding"]


@contextlib.contextmanager
def implicit_replication():
    """Inside, a plain (non-scalar) ``torch.Tensor`` used together with DTensors in one op is
    taken as ``Replicate()`` on their mesh instead of raising the mixing error -- the caller
    promises it holds the same values on every rank (a constant, a buffer left unsharded).
    Outside, mixing stays an error: a plain tensor that differs across ranks would make the
    result silently wrong. A plain tensor that requires grad gets a DTensor gradient (its
    ``full_tensor()`` is the gradient one process computes).

        >>> with implicit_replication():
        ...     y = dtensor * torch.ones(dtensor.shape[-1])   # the ones join as Replicate()
    """
    token = _dispatch.IMPLICIT_REPLICATION.set(True)
    try:
        yield
    finally:
        _dispatch.IMPLICIT_REPLICATION.reset(token)
