"""The ``*_copy`` ops (``view_copy``, ``t_copy``, ``split_copy``, ...: functionalization's
non-aliasing twins of the view ops) share their view op's rule: same placements, and the local
result is a fresh contiguous tensor instead of a view of the piece.

Registered for every view op that has a rule and a ``_copy`` twin of the same overload, so a new
view rule gets its copy variant for free.
"""
from __future__ import annotations

import torch

from .. import _torch_names as torch_names
from ._registry import RULES, Decompose, FullStrategy, OpCall, get_rule, set_rule

aten = torch_names.aten


def _fresh(out):
    """A copy that owns its memory (a view rule's local result may alias the piece)."""
    if isinstance(out, torch.Tensor):
        return torch.clone(out, memory_format=torch.contiguous_format)
    return type(out)(_fresh(o) for o in out)


def _copy_rule(view_op, view_rule):
    def rule(call):
        # the view rule sees its own op (some rules test which op they serve)
        result = view_rule(OpCall(view_op, call.args, call.kwargs, call.inputs, call.mesh))
        if isinstance(result, FullStrategy) and result.local_fn is not None:
            view_fn = result.local_fn
            result.local_fn = lambda *a, **k: _fresh(view_fn(*a, **k))
        elif isinstance(result, Decompose):  # runs DTensor ops: clone its DTensor results
            view_dt_fn = result.fn
            result = Decompose(lambda *a, **k: _fresh(view_dt_fn(*a, **k)))
        return result  # without a local_fn the dispatcher runs the copy op itself on the piece
    return rule


def _register_copy_variants():
    for view_op in list(RULES):
        if not view_op.is_view:
            continue
        twin = torch_names.find_op(view_op._schema.name.split("::")[-1] + "_copy")
        copy_op = getattr(twin, view_op._overloadname, None) if twin is not None else None
        if copy_op is not None and get_rule(copy_op) is None:
            set_rule(copy_op, _copy_rule(view_op, RULES[view_op]))


_register_copy_variants()


# ``narrow_copy`` has no view twin of the same overload (``narrow`` is composite, it becomes a
# ``slice``): its rule is the slice rule's for [start, start + length), so a narrow of an
# unsharded dim keeps the shards (no fallback gathering the whole input).
def _narrow_copy(call):
    spec = call.inputs[0]
    dim, start, length = call.args[1:4]
    if spec.ndim == 0:
        raise RuntimeError("narrow() cannot be applied to a 0-dim tensor.")
    d = dim % spec.ndim
    n = spec.shape[d]
    start = start + n if start < 0 else start
    if not 0 <= start <= n or length < 0 or start + length > n:
        raise RuntimeError(f"start ({call.args[2]}) + length ({length}) exceeds dimension size "
                           f"({n}) or is out of range.")
    return _copy_rule(aten.slice.Tensor, RULES[aten.slice.Tensor])(
        OpCall(aten.slice.Tensor, (call.args[0], d, start, start + length, 1), {}, call.inputs,
               call.mesh))


set_rule(aten.narrow_copy.default, _narrow_copy)


# ``_conj`` / ``_neg_view`` are views that only set a bit on the tensor. A DTensor wrapper cannot
# carry that bit (torch's composite code reads ``is_conj()`` on the wrapper to decide whether to
# resolve it, and some kernels, e.g. ``_fft_c2r``, ignore an unresolved bit on the piece), so the
# piece is conjugated / negated physically: the value is the same and nothing is left pending.
def _physical_twin(view_op, view_rule, local_fn):

    def rule(call):
        from ._expansion import expand_strategies  # noqa: PLC0415 - rules module order
        result = view_rule(call)
        if not isinstance(result, FullStrategy):
            result = expand_strategies(call, list(result))
        result.local_fn = local_fn
        return result
    set_rule(view_op, rule, override=True)  # wraps the rule it replaces


_ELEMENTWISE = get_rule(aten._conj.default)  # the pointwise family's rule: placements kept
_physical_twin(aten._conj.default, _ELEMENTWISE, torch.conj_physical)
_physical_twin(aten._neg_view.default, _ELEMENTWISE, torch.neg)
