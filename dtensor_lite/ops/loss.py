"""Losses: nll_loss (the core of cross_entropy) and the elementwise losses.

Reductions over sharded dims never divide by a local count: ``sum`` gives ``Partial(sum)``, and
``mean`` is (local sum) / (global count) summed over ranks, so a rank with an empty shard adds 0
instead of 0/0 = NaN. Two cases need the count of the data itself:

* ``nll_loss`` mean divides by the total weight of the non-ignored targets: each rank's share
  is all-reduced (one scalar) and the mean is local sum / global weight, ``Partial(sum)``.
* **class-sharded** logits/log-probs (Shard on the class dim, as a vocab-parallel loss has them):
  each rank picks only the targets in its class range and the pieces sum: ``Partial(sum)``; the
  logits are never gathered (the log_softmax beneath is sharded too, see ``nn.py``).

Composite losses (l1_loss, kl_div, cross_entropy with probabilities or label smoothing, ...)
reach the dispatcher as pointwise ops and reductions and need no rule of their own.
"""
from __future__ import annotations

import functools

import torch

from .. import _torch_names as torch_names
from ..placements import LINEAR_REDUCE_OPS, Partial, Replicate, Shard
from ..spec import DTensorSpec
from ._registry import register_rule
from .kit import arg, choose, input_names, replace_args, strategy, target_spec
from .nn import all_reduce_over, sharding_mesh_dims

aten = torch_names.aten
R = Replicate()
P = Partial()
NONE, MEAN, SUM = 0, 1, 2  # at::Reduction


# ----------------------------------------------------------------------------- nll_loss
def _nll_layout(x: DTensorSpec):
    """(class dim, [(input dim, target dim)] for the row dims) of nll_loss / nll_loss2d."""
    if x.ndim < 2:
        return 0, []
    return 1, [(d, d if d == 0 else d - 1) for d in range(x.ndim) if d != 1]


def _nll_strategies(call, reduction, backward: bool):
    x = arg(call, "self")
    cdim, rows = _nll_layout(x)
    strategies = []
    if backward:
        keep_tw = R if reduction == MEAN else None  # only the mean reads total_weight
        strategies.append(strategy(call, R, total_weight=keep_tw))
        for d, td in rows:
            strategies.append(strategy(
                call, Shard(d), self=Shard(d), target=Shard(td), total_weight=keep_tw,
                grad_output=Shard(td) if reduction == NONE else R))
        strategies.append(strategy(call, Shard(cdim), self=Shard(cdim), weight=Shard(0),
                                   total_weight=keep_tw))
        return strategies
    # forward: (output, total_weight). total_weight is 0 under 'none', and the mean's local
    # function all-reduces it, so only 'sum' leaves it Partial.
    tw = P if reduction == SUM else R
    strategies.append(strategy(call, (R, R)))
    for d, td in rows:
        out = Shard(td) if reduction == NONE else P
        strategies.append(strategy(call, (out, tw), self=Shard(d), target=Shard(td)))
    strategies.append(strategy(call, (P, tw), self=Shard(cdim), weight=Shard(0)))
    return strategies


@register_rule(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def _nll_loss_forward(call):
    reduction = arg(call, "reduction")
    full = choose(call, _nll_strategies(call, reduction, backward=False))
    class_range, row_dims, class_dims = _nll_sharding(call, full)
    if row_dims or class_dims:
        full.local_fn = functools.partial(_nll_forward_local, op=call.op, class_range=class_range,
                                          mesh=call.mesh, row_dims=row_dims, class_dims=class_dims)
    return full


@register_rule(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def _nll_loss_backward(call):
    reduction = arg(call, "reduction")
    full = choose(call, _nll_strategies(call, reduction, backward=True))
    class_range, _, _ = _nll_sharding(call, full)
    if class_range is not None:
        full.local_fn = functools.partial(_nll_backward_local, op=call.op, class_range=class_range)
    return full


def _nll_sharding(call, full):
    """(this rank's class range or None when classes are whole, the mesh dims sharding rows,
    the mesh dims sharding classes)."""
    j = input_names(call).index("self")
    spec = target_spec(call, full, j)
    cdim, _ = _nll_layout(spec)
    class_dims = tuple(sharding_mesh_dims(spec.placements, cdim))
    row_dims = tuple(i for i, p in enumerate(spec.placements) if p.is_shard() and p.dim != cdim)
    if not class_dims:
        return None, row_dims, class_dims
    shape, offset = spec.local_shape_and_offset()
    return (offset[cdim], shape[cdim]), row_dims, class_dims


def _local_targets(target, ignore_index, class_range):
    """Targets as indices into this rank's classes; the others become the ignored index."""
    start, size = class_range
    local = target - start
    keep = (target != ignore_index) & (local >= 0) & (local < size)
    sentinel = -1  # never a valid local class
    return torch.where(keep, local, sentinel), sentinel


def _nll_forward_local(x, target, weight, reduction, ignore_index, *, op, class_range, mesh,
                       row_dims, class_dims):
    global_target, global_ignore = target, ignore_index
    if class_range is not None:
        target, ignore_index = _local_targets(target, ignore_index, class_range)
    local_reduction = SUM if reduction == MEAN else reduction
    out, total_weight = op(x, target, weight, local_reduction, ignore_index)
    if reduction != MEAN:
        return out, total_weight
    # mean: divide the local sum by the weight of every non-ignored target, over all shards
    if class_dims and weight is None:
        # unweighted: the targets are whole along the class shards, so the count is local there
        total_weight = (global_target != global_ignore).sum().to(total_weight.dtype)
        total_weight = all_reduce_over(total_weight, mesh, row_dims, "sum")
    else:
        total_weight = all_reduce_over(total_weight, mesh, row_dims + class_dims, "sum")
    return out / total_weight, total_weight


def _nll_backward_local(grad, x, target, weight, reduction, ignore_index, total_weight, *, op,
                        class_range):
    target, ignore_index = _local_targets(target, ignore_index, class_range)
    return op(grad, x, target, weight, reduction, ignore_index, total_weight)


# ----------------------------------------------------------------------------- elementwise losses
# loss op -> (tensor operands, broadcast against each other); reduction is an argument of each
ELEMENTWISE_LOSSES = [aten.mse_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default,
                      aten.soft_margin_loss.default, aten.binary_cross_entropy.default,
                      aten.binary_cross_entropy_with_logits.default]
ELEMENTWISE_LOSS_BACKWARDS = [aten.mse_loss_backward.default, aten.smooth_l1_loss_backward.default,
                              aten.huber_loss_backward.default,
                              aten.soft_margin_loss_backward.default,
                              aten.binary_cross_entropy_backward.default]


def _broadcast_strategies(call, out_ndim, out_shape, exclude=()):
    """Per output dim d: the operands that span d are Shard on it, broadcast ones Replicate."""
    names = input_names(call)
    per_dim = []
    for d in range(out_ndim):
        ins = {}
        for name, spec in zip(names, call.inputs):
            if name in exclude:
                continue
            dd = d - (out_ndim - spec.ndim)
            ins[name] = Shard(dd) if dd >= 0 and spec.shape[dd] == out_shape[d] else R
        per_dim.append(ins)
    return per_dim


@register_rule(*ELEMENTWISE_LOSSES)
def _elementwise_loss(call):
    reduction = arg(call, "reduction")
    shape = torch.broadcast_shapes(*[s.shape for s in call.inputs])
    strategies = [strategy(call, R)]
    for d, ins in enumerate(_broadcast_strategies(call, len(shape), shape)):
        strategies.append(strategy(call, Shard(d) if reduction == NONE else P, **ins))
    full = choose(call, strategies)
    if reduction != NONE and any(p.is_partial() for p in full.outs[0]):
        full.local_fn = functools.partial(_reduce_locally, op=call.op, reduction=reduction,
                                          count=shape.numel())
    return full


@register_rule(*ELEMENTWISE_LOSS_BACKWARDS)
def _elementwise_loss_backward(call):
    reduction = arg(call, "reduction")
    x = arg(call, "self")
    shape = x.shape  # the gradient has the input's shape
    strategies = [strategy(call, R)]
    exclude = () if reduction == NONE else ("grad_output",)  # a 0-d grad_output stays whole
    for d, ins in enumerate(_broadcast_strategies(call, len(shape), shape, exclude)):
        strategies.append(strategy(call, Shard(d), **ins))
    if reduction != NONE:  # linear in the (scalar) incoming gradient
        strategies += [strategy(call, Partial(op), grad_output=Partial(op))
                       for op in LINEAR_REDUCE_OPS]
    full = choose(call, strategies)
    xspec = target_spec(call, full, input_names(call).index("self"))
    if reduction == MEAN and any(p.is_shard() for p in xspec.placements):
        full.local_fn = functools.partial(_reduce_locally, op=call.op, reduction=MEAN,
                                          count=shape.numel())
    return full


def _reduce_locally(*args, op, reduction, count, **kwargs):
    """The op with reduction 'sum' on local pieces; a mean then divides by the GLOBAL count (a
    local mean would be wrong for uneven shards and NaN for empty ones)."""
    args, kwargs = replace_args(op, args, kwargs, reduction=SUM)
    out = op(*args, **kwargs)
    return out / count if reduction == MEAN else out
