"""The public API for writing parallel strategies: ``register_sharding`` and ``local_map``.

Both use only public placement types, so a user's strategy looks exactly like a built-in one.
"""
from __future__ import annotations

from typing import Callable, Sequence

from . import _caches
from ._local_map import local_map
from .ops._registry import overloads_of, set_rule
from .placements import Placement, torch_placements_to_ours
from .spec import DTensorSpec

__all__ = ["register_sharding", "local_map"]


def register_sharding(op):
    """Register (or override) the sharding strategies of an aten op, PyTorch-style.

    The decorated function receives the op's arguments with every DTensor replaced by its
    ``DTensorSpec`` (``.shape``, ``.ndim``, ``.placements``) and returns a list of
    ``(output_placements, input_placements)`` pairs for ONE mesh dim: one placement per output
    and one per schema argument, keyword-only ones such as ``out=`` included, in schema order
    (``None`` for non-tensor arguments), as torch's. dtensor_lite expands
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
            for overload in overloads_of(o):
                # a user rule may read any value: cache by value; it overrides, as torch's
                set_rule(overload, rule, override=True)
        _caches.clear_decisions()  # decisions made under the old rule must not be reused
        return fn

    return deco


def _as_tuple(p):
    # a rule written for torch may answer with torch's own placements: taken by value
    p = torch_placements_to_ours(p)
    if isinstance(p, Placement) or p is None:
        return (p,)
    return tuple(p)


def _align_inputs(call, in_placements):
    """Map per-argument placements (one per schema argument, in schema order: positional
    arguments, then keyword-only ones such as ``out=``, as torch's rules list them) onto the
    DTensor inputs in the dispatcher's flattened order (positional args, then kwargs as given)."""
    per_arg = list(torch_placements_to_ours(in_placements))
    index = {a.name: i for i, a in enumerate(call.op._schema.arguments)}
    given = [(k, arg) for k, arg in enumerate(call.args)]
    given += [(index.get(name, len(per_arg)), arg) for name, arg in call.kwargs.items()]
    out = []
    for k, arg in given:
        p = per_arg[k] if k < len(per_arg) else None
        if isinstance(arg, DTensorSpec):
            if not isinstance(p, Placement):
                raise ValueError(f"register_sharding rule for {call.op} gave {p!r} for the DTensor "
                                 f"argument {_arg_name(call.op, k)}; give a Placement (None is "
                                 "only for non-tensor args)")
            out.append(p)
        elif isinstance(arg, (list, tuple)) and any(isinstance(a, DTensorSpec) for a in arg):
            ps = p if isinstance(p, (list, tuple)) else [p] * len(arg)
            out.extend(q for a, q in zip(arg, ps) if isinstance(a, DTensorSpec))
    if len(out) != len(call.inputs):
        raise ValueError(f"register_sharding rule for {call.op} gave placements for {len(out)} "
                         f"DTensor arguments, but the call has {len(call.inputs)}; give one "
                         "entry per schema argument, keyword-only ones (out=) included")
    return tuple(out)


def _arg_name(op, k: int) -> str:
    args = op._schema.arguments
    return f"{k} ({args[k].name!r})" if k < len(args) else str(k)
