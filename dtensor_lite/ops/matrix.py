"""Matrix products: the standard per-mesh-dim strategies.

For ``out[m, n] = a[m, k] @ b[k, n]``: S(0)·R -> S(0), R·S(1) -> S(1), S(1)·S(0) -> Partial,
Partial·R -> Partial, R·Partial -> Partial, and batch dims shard straight through.
"""
from __future__ import annotations

import torch

from .. import _torch_names as torch_names
from ..dtensor import DTensor
from ..spec import DTensorSpec
from ..placements import LINEAR_REDUCE_OPS, Partial, Replicate, Shard
from ._registry import Decompose, intercept_composite, register_rule

aten = torch_names.aten
R = Replicate()


def _mm_strategies(batch: int, extra_ins: int = 0, bias=None):
    """Strategies for a (possibly batched) matmul with ``batch`` leading batch dims.

    ``bias``: the bias spec of addmm/baddbmm (listed first), broadcast against the output."""
    m, k_a, k_b, n_ = batch, batch + 1, batch, batch + 1  # dims of a[.., m, k] and b[.., k, n]
    out_m, out_n = batch, batch + 1
    cases = [(R, R, R)]
    cases += [(Shard(b), Shard(b), Shard(b)) for b in range(batch)]
    cases += [(Shard(out_m), Shard(m), R), (Shard(out_n), R, Shard(n_)),
              (Partial("sum"), Shard(k_a), Shard(k_b))]
    for op in LINEAR_REDUCE_OPS:
        cases += [(Partial(op), Partial(op), R), (Partial(op), R, Partial(op))]
    strategies = []
    for out, a, b in cases:
        if bias is None:
            strategies.append(((out,), (a, b)))
            continue
        strategies.append(((out,), (_bias_placement(bias, out, batch + 2), a, b)))
    return strategies


def _bias_placement(bias, out, out_ndim):
    if bias is None:
        return None
    if out.is_partial():
        return out  # Replicate -> Partial is free and keeps the sum right
    if out.is_replicate():
        return R
    dd = out.dim - (out_ndim - bias.ndim)
    return Shard(dd) if dd >= 0 and bias.shape[dd] != 1 else R


@register_rule(aten.mm)
def _mm(call):
    return _mm_strategies(0)


@register_rule(aten.matmul.default)
def _matmul(call):
    # CompositeImplicitAutograd: reaches the dispatcher whole only without autograd keys
    # (inference mode). Its operands may be 1-D or batched, which the mm strategies do not
    # describe; torch's own decomposition (views, mm / bmm) runs on the DTensors instead.
    return Decompose(aten.matmul.default.decompose)


@register_rule(aten.bmm)
def _bmm(call):
    return _mm_strategies(1)


@register_rule(aten.addmm)
def _addmm(call):
    return _mm_strategies(0, bias=_dtensor_arg(call.args[0]))


@register_rule(aten.baddbmm)
def _baddbmm(call):
    return _mm_strategies(1, bias=_dtensor_arg(call.args[0]))


@register_rule(aten.addmv)
def _addmv(call):
    # self + mat @ vec: as mv's strategies (rows of mat sharded keep the output sharded, the
    # contraction sharded gives partial sums), self laid out like the output (as addmm's bias);
    # without a rule the fallback gathered all three inputs
    return _vector_product_strategies(_dtensor_arg(call.args[0]), 1, [
        (R, R, R), (Shard(0), Shard(0), R), (Partial("sum"), Shard(1), Shard(0))])


@register_rule(aten.addr)
def _addr(call):
    # self + outer(vec1, vec2): each output dim follows its vector, no contraction
    return _vector_product_strategies(_dtensor_arg(call.args[0]), 2, [
        (R, R, R), (Shard(0), Shard(0), R), (Shard(1), R, Shard(0))])


@register_rule(aten.linalg_cross)
def _cross(call):
    # pointwise over every dim but the one holding the 3-vectors (which must be whole)
    from .kit import arg
    from .pointwise import pointwise_strategies
    dim = arg(call, "dim") % max(s.ndim for s in call.inputs)
    return [s for s in pointwise_strategies(call) if not (s[0][0].is_shard() and
                                                        s[0][0].dim == dim)]


def _vector_product_strategies(bias, out_ndim, cases):
    for op in LINEAR_REDUCE_OPS:  # a linear Partial in one factor stays Partial
        cases = cases + [(Partial(op), Partial(op), R), (Partial(op), R, Partial(op))]
    return [((out,), (_bias_placement(bias, out, out_ndim), a, b)) for out, a, b in cases]


def _dtensor_arg(a):
    if not isinstance(a, DTensorSpec):
        raise TypeError("the bias of addmm/baddbmm must be a DTensor when its matrices are")
    return a


@register_rule(aten.dot, aten.vdot)
def _dot(call):
    # a 1-D contraction: sharded halves give partial sums
    return [((R,), (R, R)), ((Partial("sum"),), (Shard(0), Shard(0)))]


@register_rule(aten.mv)
def _mv(call):
    return [((R,), (R, R)), ((Shard(0),), (Shard(0), R)),
            ((Partial("sum"),), (Shard(1), Shard(0)))]


# _linalg_svd: see batched.py (batch dims stay sharded, the matrix dims are gathered)


# ------------------------------------------------------------------ linear on sequence shards
# aten.linear is a composite: for a 3-D input it flattens (B, S, D) to (B*S, D) before addmm and
# views the result back. With S sharded and B > 1 a rank's rows are not one block of B*S rows,
# so that view must gather. Rows are independent under linear, though: with a replicated weight
# and bias, each rank applies linear to its own rows (local_map; the weight's and bias's
# gradients come back Partial, reduced only when something needs them). Other layouts keep the
# composite, whose flattening loses nothing for them.
def _rows_stay_local(x, weight, bias) -> bool:
    if not isinstance(x, DTensor) or x.ndim < 3 or not isinstance(weight, DTensor) or \
            not x._spec.has_default_order:
        return False
    mesh = x.device_mesh
    for t in (weight, bias):
        if t is not None and (not isinstance(t, DTensor) or t.device_mesh != mesh or
                              not all(p.is_replicate() for p in t.placements)):
            return False
    placements = x._spec.placements
    if any(p.is_partial() or p.is_shard(x.ndim - 1) for p in placements):
        return False
    return any(p.is_shard() and p.dim > 0 for p in placements)  # only these would be gathered


def _linear_on_dtensors(input, weight, bias=None):
    # (a tensor-parallel linear on local pieces is a shortcut taken before this: _local_linear)
    if not _rows_stay_local(input, weight, bias):
        return aten.linear.default.decompose(input, weight, bias)
    from .._local_map import local_map
    out_shape = tuple(input.shape[:-1]) + (weight.shape[0],)
    rows = local_map(torch.nn.functional.linear, out_placements=input._spec.placements,
                     out_shape=out_shape)
    return rows(input, weight) if bias is None else rows(input, weight, bias)


intercept_composite(aten.linear.default, _linear_on_dtensors, torch.nn.functional.linear)


@register_rule(aten.linear.default)
def _linear(call):
    # reached whole only without autograd keys (inference mode); y = x @ w.T + b
    x, has_bias = call.inputs[0], len(call.inputs) == 3

    def case(out, x_p, w_p, b_p=R):
        return ((out,), (x_p, w_p, b_p) if has_bias else (x_p, w_p))

    last = x.ndim - 1
    cases = [case(R, R, R)]
    cases += [case(Shard(d), Shard(d), R) for d in range(last)]       # rows stay local
    cases.append(case(Shard(last), R, Shard(0), Shard(0)))             # output features split
    cases.append(case(Partial("sum"), Shard(last), Shard(1), Partial("sum")))  # contraction
    if not has_bias:
        cases += [case(Partial(op), Partial(op), R) for op in LINEAR_REDUCE_OPS]
    return cases
