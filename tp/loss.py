"""loss_parallel: cross-entropy on class-sharded logits without gathering them.

dtensor_lite's op rules already compute ``log_softmax`` and ``nll_loss`` on logits sharded on
the class dim (each rank handles the targets in its class range; the pieces sum). What stands
in the way of writing ``F.cross_entropy(logits, targets)`` with DTensor logits is that
``targets`` is a plain tensor, and mixing plain and distributed tensors is an error by design.
Inside ``loss_parallel()`` that mix is resolved for the loss functions only: plain ``target``
and ``weight`` tensors are taken to be the same on every rank (``Replicate``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from dtensor_lite import DTensor, Replicate

__all__ = ["loss_parallel"]

_LOSSES = {F.cross_entropy, F.nll_loss}


@contextlib.contextmanager
def loss_parallel():
    """Compute ``F.cross_entropy`` / ``F.nll_loss`` on class-sharded DTensor logits in place.

    Inside the context, when the input is a DTensor, plain ``target`` / ``weight`` tensors are
    treated as ``Replicate`` on the input's mesh; the logits stay sharded (only per-row scalars
    are all-reduced) and the loss comes back as a ``Replicate`` DTensor. ``loss.backward()``
    works inside or outside the context (the gradient is class-sharded like the logits).

    Example::

        >>> # output layer: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        >>> logits = model(tokens)                  # DTensor, Shard(-1) over the vocab
        >>> with loss_parallel():
        ...     loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
        ...     loss.backward()
    """
    with _LossParallelMode():
        yield


class _LossParallelMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _LOSSES or not args or not isinstance(args[0], DTensor):
            return func(*args, **kwargs)
        mesh = args[0].device_mesh
        replicate = [Replicate()] * mesh.ndim

        def as_replicate(t):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.ndim > 0:
                return DTensor.from_local(t, mesh, replicate)
            return t

        args = (args[0], *[as_replicate(a) for a in args[1:]])
        kwargs = {k: as_replicate(v) for k, v in kwargs.items()}
        loss = func(*args, **kwargs)
        if isinstance(loss, DTensor) and any(p.is_partial() for p in loss.placements):
            loss = loss.redistribute(mesh, replicate)  # the class shards' partial sums: 1 scalar
        return loss
