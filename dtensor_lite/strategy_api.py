"""The public API for writing parallel strategies: ``register_sharding`` and ``local_map``.

Both use only public placement types, so a user's strategy looks exactly like a built-in one.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_map

from . import _caches
from .dtensor import DTensor
from .ops._registry import _overloads, set_rule
from .placements import Placement
from .spec import DTensorSpec

__all__ = ["register_sharding", "local_map"]


def register_sharding(op):
    """Register (or override) the sharding strategies of an aten op, PyTorch-style.

    The decorated function receives the op's arguments with every DTensor replaced by its
    ``DTensorSpec`` (``.shape``, ``.ndim``, ``.placements``) and returns a list of
    ``(output_placements, input_placements)`` pairs for ONE mesh dim: one placement per output
    and one per positional argument (``None`` for non-tensor arguments). dtensor_lite expands
    them over every mesh dim and picks the cheapest per dim.

    Example::

        >>> @register_sharding(torch.ops.aten._softmax.default)
        ... def softmax_rule(x, dim, half_to_float):
        ...     dim = dim % x.ndim
        ...     rules = [([Replicate()], [Replicate(), None, None])]
        ...     rules += [([Shard(d)], [Shard(d), None, None]) for d in range(x.ndim) if d != dim]
        ...     return rules
    """
    ops = op if isinstance(op, (list, tuple)) else [op]

    def deco(fn: Callable[..., Sequence]):
        def rule(call):
            strategies = []
            for outs, ins in fn(*call.args, **call.kwargs):
                strategies.append((_as_tuple(outs), _align_inputs(call, ins)))
            return strategies

        rule.__name__ = f"user_rule_{getattr(fn, '__name__', 'fn')}"
        for o in ops:
            for overload in _overloads(o):
                set_rule(overload, rule)  # a user rule may read any value: cache by value
        _caches.clear_decisions()  # decisions made under the old rule must not be reused
        return fn

    return deco


def _as_tuple(p):
    if isinstance(p, Placement) or p is None:
        return (p,)
    return tuple(p)


def _align_inputs(call, in_placements):
    """Map per-argument placements onto the DTensor inputs in flattened order."""
    out = []
    for arg, p in zip(call.args, list(in_placements) + [None] * len(call.args)):
        if isinstance(arg, DTensorSpec):
            if not isinstance(p, Placement):
                raise ValueError(f"register_sharding rule for {call.op} gave {p!r} for a DTensor "
                                 "argument; give a Placement (None is only for non-tensor args)")
            out.append(p)
        elif isinstance(arg, (list, tuple)) and any(isinstance(a, DTensorSpec) for a in arg):
            ps = p if isinstance(p, (list, tuple)) else [p] * len(arg)
            out.extend(q for a, q in zip(arg, ps) if isinstance(a, DTensorSpec))
    if len(out) != len(call.inputs):
        raise ValueError(f"register_sharding rule for {call.op} gave placements for {len(out)} "
                         f"DTensor arguments, but the call has {len(call.inputs)}")
    return tuple(out)


def local_map(func: Callable, out_placements, in_placements=None, in_grad_placements=None,
              device_mesh=None, *, redistribute_inputs: bool = False):
    """Run ``func`` on local shards: DTensor args become local tensors, outputs become DTensors.

    ``in_placements`` (one entry per positional arg; ``None`` for non-DTensor args) are checked,
    or, with ``redistribute_inputs=True``, enforced. ``out_placements`` has one entry per output
    (``None`` for a non-tensor output). Differentiable.

    Example::

        >>> def local_add_bias(x, b):           # plain torch on each rank's piece
        ...     return x + b
        >>> f = local_map(local_add_bias, out_placements=[Shard(0)],
        ...               in_placements=([Shard(0)], [Replicate()]))
        >>> y = f(x_dt, b_dt)                   # a DTensor placed [Shard(0)]
    """
    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        flat, _ = tree_flatten((args, kwargs))
        dtensors = [a for a in flat if isinstance(a, DTensor)]
        if not dtensors:
            return func(*args, **kwargs)
        mesh = device_mesh if device_mesh is not None else dtensors[0].device_mesh
        local_args = []
        for k, arg in enumerate(args):
            want = in_placements[k] if in_placements is not None and k < len(in_placements) else None
            if isinstance(arg, DTensor):
                if want is not None and tuple(arg.placements) != tuple(want):
                    if not redistribute_inputs:
                        raise ValueError(
                            f"local_map: argument {k} has placements {list(arg.placements)} but "
                            f"in_placements says {list(want)}; redistribute it first or pass "
                            "redistribute_inputs=True")
                    arg = arg.redistribute(mesh, want)
                grad = in_grad_placements[k] if in_grad_placements is not None else None
                local_args.append(arg.to_local(grad_placements=grad))
            else:
                local_args.append(arg)
        local_kwargs = tree_map(lambda a: a.to_local() if isinstance(a, DTensor) else a, kwargs)
        out = func(*local_args, **local_kwargs)
        return _wrap_outputs(out, out_placements, mesh, dtensors)

    return wrapped


def _wrap_outputs(out, out_placements, mesh, inputs):
    if isinstance(out, (tuple, list)):
        if len(out_placements) != len(out) or isinstance(out_placements[0], Placement):
            placements = [out_placements] * len(out) if isinstance(out_placements[0], Placement) \
                else out_placements
        else:
            placements = out_placements
        wrapped = [_wrap_one(o, p, mesh, inputs) for o, p in zip(out, placements)]
        return type(out)(wrapped)
    placements = out_placements
    if isinstance(placements, (list, tuple)) and placements and \
            isinstance(placements[0], (list, tuple)):
        placements = placements[0]
    return _wrap_one(out, placements, mesh, inputs)


def _wrap_one(o, placements, mesh, inputs):
    if placements is None or not isinstance(o, torch.Tensor):
        return o
    placements = tuple(placements)
    if not any(p.is_shard() for p in placements):
        return DTensor.from_local(o, mesh, placements)
    # Uneven shards make "global = local * mesh size" wrong. An input laid out the same way with
    # the same local shape tells the global shape for free; otherwise gather the local shapes.
    for dt in inputs:
        if dt._spec.placements == placements and dt._local_tensor.shape == o.shape:
            return DTensor.from_local(o, mesh, placements, shape=dt.shape)
    return DTensor.from_local(o, mesh, placements, run_check=True)
