"""The rule kit: the few helpers every sharding rule shares, written once.

A rule receives an ``OpCall`` (the op, its arguments with every DTensor replaced by its
``DTensorSpec``, the specs in ``call.inputs``, the mesh) and returns per-mesh-dim strategies or a
``FullStrategy``. Reading arguments, naming inputs, building one strategy, letting the dispatcher
choose (when the local computation depends on the choice) and knowing what an input will look
like after that choice are the same in every op family; they live here.
"""
from __future__ import annotations

import torch

from .._torch_names import tree_map
from ..placements import LINEAR_REDUCE_OPS, Replicate, reductions_mix
from ..spec import DTensorSpec
from ._expansion import expand_strategies
from ._registry import FullStrategy

__all__ = ["arg", "arg_at", "bound_args", "input_names", "input_locations", "mutated_input",
           "strategy", "replace_args", "choose", "target_spec", "empty_piece_safe"]

R = Replicate()


# ----------------------------------------------------------------------------- arguments
def _value(k, a, args, kwargs):
    """Argument ``a`` (schema position ``k``): positional, keyword, or the schema default."""
    if k < len(args):
        return args[k]
    if a.name in kwargs:
        return kwargs[a.name]
    return a.default_value if a.has_default_value() else None


def arg(call, name):
    """The value of argument ``name`` (positional or keyword; the schema default if omitted)."""
    for k, a in enumerate(call.op._schema.arguments):
        if a.name == name:
            return _value(k, a, call.args, call.kwargs)
    raise KeyError(f"{call.op} has no argument {name!r}")


def bound_args(op, args, kwargs) -> dict:
    """Every argument of ``op`` by schema name, as ``arg`` reads one: for a local function that
    gets the op's arguments as the op would."""
    return {a.name: _value(k, a, args, kwargs) for k, a in enumerate(op._schema.arguments)}


def arg_at(call, pos, name=None, default=None):
    """``args[pos]`` if passed positionally, else ``kwargs[name]``, else ``default``: the
    schema-free reader for hot rules that know an argument's position (``pos`` may be None for a
    keyword-only argument)."""
    if pos is not None and pos < len(call.args):
        return call.args[pos]
    return call.kwargs.get(name, default) if name is not None else default


def replace_args(op, args, kwargs, **changes):
    """``(args, kwargs)`` of an aten call with some arguments (by schema name) replaced."""
    args, kwargs = list(args), dict(kwargs)
    for k, a in enumerate(op._schema.arguments):
        if a.name in changes:
            if k < len(args):
                args[k] = changes[a.name]
            else:
                kwargs[a.name] = changes[a.name]
    return args, kwargs


# ----------------------------------------------------------------------------- inputs
def input_names(call) -> list[str]:
    """Schema names of the DTensor inputs, in ``call.inputs`` order."""
    schema = call.op._schema.arguments
    names = []
    for k, a in enumerate(call.args):
        if isinstance(a, DTensorSpec):
            names.append(schema[k].name)
    for name, v in call.kwargs.items():
        if isinstance(v, DTensorSpec):
            names.append(name)
    return names


def input_locations(call) -> list:
    """Where each DTensor input sits, in the dispatcher's flattening order: ``(k,)`` for
    ``args[k]``, ``(k, m)`` for ``args[k][m]``, ``(name,)`` / ``(name, m)`` for kwargs."""
    locs = []
    for key, a in list(enumerate(call.args)) + list(call.kwargs.items()):
        if isinstance(a, DTensorSpec):
            locs.append((key,))
        elif isinstance(a, (list, tuple)):
            locs += [(key, m) for m, x in enumerate(a) if isinstance(x, DTensorSpec)]
    return locs


def mutated_input(call):
    """Index in ``call.inputs`` of the DTensor an in-place op writes (its ``self``), else None."""
    schema = call.op._schema
    first = schema.arguments[0] if schema.arguments else None
    if (first is not None and first.alias_info is not None and first.alias_info.is_write
            and call.args and isinstance(call.args[0], DTensorSpec)):
        return 0
    return None


# ----------------------------------------------------------------------------- strategies
def strategy(call, outs, **ins):
    """One per-mesh-dim strategy with input placements given by argument name.

    DTensor inputs not named are Replicate; a name given ``None`` keeps its input as it is; names
    of absent optional inputs (a ``None`` bias) are ignored."""
    names = input_names(call)
    return (outs, tuple(ins.get(n, R) for n in names))


def choose(call, strategies, local_fn=None) -> FullStrategy:
    """The dispatcher's own per-mesh-dim choice among ``strategies`` (cheapest per dim), with
    ``local_fn`` attached: for rules whose local computation depends on what was chosen (a vocab
    offset, a collective over the mesh dims that shard a reduced dim).

    Mesh dims choose independently, so the choice could put Partial(max) on one dim and
    Partial(avg) on another of one tensor, which has no meaning: such a mix is retried with one
    family of Partial strategies at a time."""
    strategies = list(strategies)
    mutated = mutated_input(call)
    full = expand_strategies(call, strategies, mutated)
    if not _consistent(full):
        full = None
        for allowed in (set(LINEAR_REDUCE_OPS), {"max"}, {"min"}, {"max", "min"}, {"product"},
                        set()):
            subset = [s for s in strategies if _strategy_partials(s) <= allowed]
            try:
                candidate = expand_strategies(call, subset, mutated)
            except RuntimeError:  # an in-place destination needs a Partial this family lacks
                continue
            if _consistent(candidate):
                full = candidate
                break
        if full is None:
            raise RuntimeError(f"{call.op}: no consistent placements for inputs {call.inputs}")
    if local_fn is not None:
        full.local_fn = local_fn
    return full


def _strategy_partials(strategy) -> set:
    outs, ins = strategy
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return {p.reduce_op for p in list(outs) + list(ins) if p is not None and p.is_partial()}


def _consistent(full: FullStrategy) -> bool:
    return all(reductions_mix(p.reduce_op for p in pl if p is not None and p.is_partial())
               for pl in list(full.outs) + list(full.ins) if pl is not None)


def target_spec(call, full: FullStrategy, j: int) -> DTensorSpec:
    """The spec input ``j`` has when the local function runs (as the dispatcher makes it)."""
    spec = call.inputs[j]
    want = full.ins[j]
    if want is None:
        return spec
    if any(p.is_shard() and not 0 <= p.dim < spec.ndim for p in want):
        raise RuntimeError(f"sharding rule for {call.op} asks input {j} of shape "
                           f"{tuple(spec.shape)} to be {list(want)} (a bug in the rule)")
    order = full.in_orders[j] if full.in_orders is not None else None
    if order is None:
        if tuple(want) == spec.placements:
            return spec
    return DTensorSpec(call.mesh, want, spec.tensor_meta, order)


# ----------------------------------------------------------------------------- local functions
def empty_piece_safe(op, first: int = 0):
    """A local function running ``op``, except where this rank's piece of ``args[first]`` is
    empty: there it returns zeros shaped as the op's meta kernel says (an empty result, or a sum
    over nothing). Some CPU kernels fail on empty inputs (MKL's FFT raises, batch norm's backward
    over zero channels dies of a division by zero) while the other ranks go on to their next
    collective; an uneven shard gives a rank such a piece."""
    def run(*args, **kwargs):
        if args[first].numel():
            return op(*args, **kwargs)
        meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t,
                        (args, kwargs))
        out = op(*meta[0], **meta[1])
        return tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=args[first].device)
                        if isinstance(t, torch.Tensor) else t, out)
    return run
