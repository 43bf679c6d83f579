"""Batch norm: per-channel statistics over every dim but the channel dim (dim 1); and group
norm, whose per-sample statistics keep a batch shard local.

Training mode, a tensor sharded on a reduced dim (batch, or a spatial dim): the input stays where
it is. Each rank sums its piece per channel and the sums are all-reduced -- C numbers, never the
input -- twice: the sum, giving the mean, then the sum of squared deviations from that global
mean. That is the two-pass variance one-process torch computes (in float64 for float inputs, as
torch's CPU kernel accumulates), so the statistics differ from one process only by the order in
which partial sums are added. The count is global metadata (numel / C), so it is never sent.

A shard of the channel dim keeps each channel's statistics local: weight, bias, running and saved
statistics follow as Shard(0) on that mesh dim, and nothing is communicated.

Running statistics are updated in place, on every rank alike, from the global batch statistics
(the unbiased variance with the global count). They are written, so they cannot be re-laid out:
if their layout differs from the channel shard (replicated running stats of a channel-sharded
input), the few batch statistics are redistributed to them instead (a C-sized gather at most).

Backward (training): the input gradient needs two per-channel sums over the whole batch, sum(dy)
and sum(dy * (x - mean)), which are the bias and weight gradients too: one all-reduce of 2C
numbers, and the parameter gradients come out Replicate. When the input needs no gradient the
sums stay Partial (no communication).

Evaluation mode normalises with the running statistics: per channel pointwise, no communication;
its backward's weight / bias gradients are sums over the reduced dims, so Partial.

Instance norm is batch norm on a (1, N*C, ...) view (an even batch shard becomes a channel
shard). Group norm normalises each sample on its own: a batch shard stays, each rank runs the op
on its samples (with its own sample count), and the weight / bias gradients are Partial sums.
"""
from __future__ import annotations

import functools

import torch

from .. import _torch_names as torch_names
from ..placements import Partial, Replicate, Shard
from ..redistribute.entry import redistribute_local
from ..spec import DTensorSpec, TensorMeta
from ._registry import Decompose, FullStrategy, intercept_composite, register_rule
from .kit import arg, bound_args, choose, input_names, replace_args, strategy
from .nn import all_reduce_over

aten = torch_names.aten
R = Replicate()
P = Partial()
CHANNEL = 1

# forward ops -> whether they compute batch statistics (True / False / by their ``training`` arg)
_FORWARD = {
    aten.native_batch_norm.default: "arg",
    aten._native_batch_norm_legit.default: "arg",
    aten._native_batch_norm_legit.no_stats: "arg",
    aten._native_batch_norm_legit_no_training.default: False,
    aten._batch_norm_with_update.default: True,
    aten._batch_norm_no_update.default: "no_running",  # batch statistics only without running ones
}
_BACKWARD = {aten.native_batch_norm_backward.default: "train",
             aten.batch_norm_backward.default: "update"}


# ----------------------------------------------------------------------------- layouts
class _Layout:
    """How one call is laid out, per mesh dim: the input's placements (``x``), those of every
    per-channel vector (weight, statistics: Shard(0) where the input is channel-sharded), and
    the mesh dims that shard a reduced dim (their per-channel sums are partial)."""

    def __init__(self, x: DTensorSpec):
        self.x, self.channel, self.reduced = [], [], []
        channel_taken = False
        for i, p in enumerate(x.placements):
            if type(p) is Shard and p.dim == CHANNEL and not channel_taken:
                channel_taken = True  # a second mesh dim on the channels is gathered
                self.x.append(p)
                self.channel.append(Shard(0))
            elif type(p) is Shard and p.dim != CHANNEL:
                self.x.append(p)
                self.channel.append(R)
                self.reduced.append(i)
            else:  # Replicate stays; Partial, a second channel shard: made whole
                self.x.append(R)
                self.channel.append(R)
        self.x, self.channel, self.reduced = tuple(self.x), tuple(self.channel), tuple(self.reduced)

    def summed(self):
        """Placements of a per-channel sum left unreduced over the reduced mesh dims."""
        return tuple(P if i in self.reduced else c for i, c in enumerate(self.channel))


def _ins(call, by_name: dict):
    """``FullStrategy.ins`` from placements by argument name; an input not named (or named with
    None) keeps its layout."""
    return [by_name.get(n) for n in input_names(call)]


def _meta_dtypes(call):
    """The dtypes of the op's outputs, from a run on meta tensors (saved statistics follow the
    parameters' dtype, not the input's, when they differ)."""
    def meta(a):
        if isinstance(a, DTensorSpec):
            return torch.empty(a.shape, dtype=a.dtype, device="meta")
        return a
    args = [meta(a) for a in call.args]
    kwargs = {k: meta(v) for k, v in call.kwargs.items()}
    return [o.dtype if isinstance(o, torch.Tensor) else None for o in call.op(*args, **kwargs)]


def _check_running(call, names):
    for n in names:
        spec = arg(call, n)
        if isinstance(spec, DTensorSpec) and any(
                not (p.is_replicate() or p == Shard(0)) for p in spec.placements):
            raise ValueError(
                f"{call.op}: {n} has placements {list(spec.placements)}; running statistics are "
                "updated in place, so they must be Replicate() or Shard(0) on every mesh dim. "
                f"Redistribute {n} first (e.g. to Replicate())")


def _acc(dtype):
    # torch's CPU kernel accumulates float statistics in double (at::acc_type<float, false>)
    return torch.float64 if dtype in (torch.float16, torch.bfloat16, torch.float32) else dtype


def _per_channel(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


# ----------------------------------------------------------------------------- forward
def _is_training(call) -> bool:
    how = _FORWARD[call.op]
    if how == "arg":
        return bool(arg(call, "training"))
    if how == "no_running":
        return arg(call, "running_mean") is None
    return how


@register_rule(*_FORWARD)
def _batch_norm(call):
    x = arg(call, "input")
    if not isinstance(x, DTensorSpec) or x.ndim < 2:  # torch's own error (shape check) applies
        return [((R,) * len(call.op._schema.returns), (R,) * len(call.inputs))]
    lay = _Layout(x)
    names = input_names(call)
    n_out = len(call.op._schema.returns)
    training = _is_training(call)
    by_name = {"input": lay.x, "weight": lay.channel, "bias": lay.channel}
    if not training:
        return Decompose(functools.partial(_eval_forward, call.op))
    updates = "running_mean" in names  # (_batch_norm_no_update trains only without them)
    if updates:
        _check_running(call, ("running_mean", "running_var"))
        by_name.update(running_mean=None, running_var=None)  # written in place: never moved
    count = x.shape.numel() // x.shape[CHANNEL] if x.shape[CHANNEL] else 0
    dtypes = _meta_dtypes(call)
    stats = DTensorSpec(call.mesh, lay.channel,
                        TensorMeta(torch.Size([x.shape[CHANNEL]]), (1,), dtypes[1]))
    running = ((arg(call, "running_mean"), arg(call, "running_var")) if updates else None)
    outs = (lay.x, lay.channel, lay.channel) + ((R,) * call.mesh.ndim,) * (n_out - 3)
    local = functools.partial(_train_forward, op=call.op, n_out=n_out, mesh=call.mesh,
                              mesh_dims=lay.reduced, count=count, stats=stats, running=running,
                              dtypes=dtypes)
    return FullStrategy(outs=outs, ins=_ins(call, by_name), local_fn=local)


def _eval_forward(op, *args, **kwargs):
    """Evaluation mode as per-channel pointwise DTensor ops (a channel shard of the input slices
    the running statistics; nothing moves). Not the op itself on local pieces: on CPU its saved
    statistics are empty tensors while its meta kernel promises C-sized ones, so no output spec
    could describe them both."""
    a = bound_args(op, args, kwargs)
    x, w, b = a["input"], a["weight"], a["bias"]
    if a["running_mean"] is None or a["running_var"] is None:
        raise RuntimeError(f"{op}: evaluation mode needs running_mean and running_var (got "
                           "None); pass them, or training=True to use batch statistics")
    # aten ops: inside the dispatcher, composites such as Tensor.to would not decompose
    shape = [1, -1] + [1] * (x.ndim - 2)
    acc = _acc(x.dtype)
    invstd = aten.rsqrt.default(aten.add.Tensor(_cast(a["running_var"], acc), a["eps"]))
    scale = invstd if w is None else aten.mul.Tensor(invstd, _cast(w, acc))
    shift = aten.mul.Tensor(aten.neg.default(_cast(a["running_mean"], acc)), scale)
    if b is not None:
        shift = aten.add.Tensor(shift, _cast(b, acc))
    y = aten.add.Tensor(aten.mul.Tensor(_cast(x, acc), aten.view.default(scale, shape)),
                        aten.view.default(shift, shape))
    stat_dtype = w.dtype if w is not None else a["running_mean"].dtype
    empty = aten.new_empty.default(x, [0], dtype=stat_dtype)  # what torch's CPU kernel saves
    extra = (aten.new_empty.default(x, [0], dtype=torch.uint8),) \
        if len(op._schema.returns) == 4 else ()
    return (_cast(y, x.dtype), empty, aten.clone.default(empty)) + extra


def _cast(t, dtype):
    return t if t.dtype == dtype else aten._to_copy.default(t, dtype=dtype)


def _batch_stats(xa, mesh, mesh_dims, count):
    """Global per-channel mean and sum of squared deviations (two passes, each one all-reduce
    over the mesh dims that shard a reduced dim), and ``xa`` minus the mean."""
    dims = [0, *range(2, xa.ndim)]
    mean = all_reduce_over(xa.sum(dims), mesh, mesh_dims, "sum") / count
    centered = xa - _per_channel(mean, xa.ndim)
    m2 = all_reduce_over((centered * centered).sum(dims), mesh, mesh_dims, "sum")
    return mean, m2, centered


def _train_forward(*args, op, n_out, mesh, mesh_dims, count, stats, running, dtypes, **kwargs):
    a = bound_args(op, args, kwargs)
    x, w, b, eps = a["input"], a["weight"], a["bias"], a["eps"]
    xa = x.to(_acc(x.dtype))
    mean, m2, centered = _batch_stats(xa, mesh, mesh_dims, count)
    invstd = (m2 / count + eps).rsqrt()
    y = centered * _per_channel(invstd, x.ndim)
    if w is not None:
        y = y * _per_channel(w, x.ndim)
    if b is not None:
        y = y + _per_channel(b, x.ndim)
    if running is not None:
        momentum = a["momentum"]
        for buf, spec, value in ((a["running_mean"], running[0], mean),
                                 (a["running_var"], running[1], m2 / (count - 1))):
            if buf is None:
                continue
            src = DTensorSpec(mesh, stats.placements, TensorMeta(stats.shape, (1,), buf.dtype))
            piece = redistribute_local(value.to(buf.dtype), src, spec)
            buf.copy_(buf * (1 - momentum) + piece * momentum)
    outs = [y.to(dtypes[0]), mean.to(dtypes[1]), invstd.to(dtypes[2])]
    if n_out == 4:  # the reserve of _batch_norm_with_update (empty on CPU)
        outs.append(torch.empty(0, dtype=dtypes[3], device=x.device))
    return tuple(outs)


# ----------------------------------------------------------------------------- the composite entry
def _batch_norm_on_dtensors(input, weight, bias, running_mean, running_var, training, momentum,
                            eps, cudnn_enabled=True):
    """``F.batch_norm`` (``torch.batch_norm``) on DTensors: ``native_batch_norm``, whose rules
    are above. It is what the composite reaches on CPU anyway; on CUDA the composite would pick
    cuDNN's kernel, which no rule serves (replicated: right values, the whole batch gathered --
    seen on an H200)."""
    return torch.native_batch_norm(input, weight, bias, running_mean, running_var, training,
                                   momentum, eps)[0]


intercept_composite(aten.batch_norm.default, _batch_norm_on_dtensors, torch.batch_norm)


@register_rule(aten.batch_norm.default)
def _batch_norm_composite(call):
    # reached whole only without autograd keys (inference mode)
    return Decompose(_batch_norm_on_dtensors)


# ----------------------------------------------------------------------------- backward
@register_rule(*_BACKWARD)
def _batch_norm_backward(call):
    x = arg(call, "input")
    if not isinstance(x, DTensorSpec) or x.ndim < 2:
        return [((R, R, R), (R,) * len(call.inputs))]
    lay = _Layout(x)
    mask = list(arg(call, "output_mask"))
    training = bool(arg(call, _BACKWARD[call.op]))
    by_name = {"grad_out": lay.x, "input": lay.x, "weight": lay.channel}
    if not training:
        # dy * invstd * w per channel; the parameter gradients are sums over the reduced dims
        by_name.update(running_mean=lay.channel, running_var=lay.channel)
        local = functools.partial(_eval_backward, op=call.op, dtypes=_meta_dtypes(call))
        return FullStrategy(outs=(lay.x, lay.summed(), lay.summed()), ins=_ins(call, by_name),
                            local_fn=local)
    by_name.update(save_mean=lay.channel, save_invstd=lay.channel, save_var=lay.channel)
    # the input gradient needs the whole sums: reduced there, and then the parameter gradients
    # are whole too; without it they are left partial
    reduce = bool(mask[0] and lay.reduced)
    params = lay.channel if mask[0] else lay.summed()
    count = x.shape.numel() // x.shape[CHANNEL] if x.shape[CHANNEL] else 0
    local = functools.partial(_train_backward, op=call.op, mesh=call.mesh,
                              mesh_dims=lay.reduced if reduce else (), count=count,
                              dtypes=_meta_dtypes(call))
    return FullStrategy(outs=(lay.x, params, params), ins=_ins(call, by_name), local_fn=local)


def _train_backward(*args, op, mesh, mesh_dims, count, dtypes, **kwargs):
    a = bound_args(op, args, kwargs)
    dy, x, w = a["grad_out"], a["input"], a["weight"]
    mean = a["save_mean"]
    invstd = a["save_invstd"] if "save_invstd" in a else a["save_var"]  # CPU saves invstd
    mask = a["output_mask"]
    acc = _acc(x.dtype)
    nd = x.ndim
    dims = [0, *range(2, nd)]
    dya = dy.to(acc)
    centered = x.to(acc) - _per_channel(mean.to(acc), nd)
    sums = torch.stack([dya.sum(dims), (dya * centered).sum(dims)])
    sum_dy, sum_dy_xmu = all_reduce_over(sums, mesh, mesh_dims, "sum")
    invstd = invstd.to(acc)
    grad_input = grad_weight = grad_bias = None
    if mask[0]:
        scale = invstd if w is None else invstd * w.to(acc)
        proj = _per_channel(sum_dy_xmu * invstd * invstd / count, nd)
        grad_input = ((dya - _per_channel(sum_dy / count, nd) - centered * proj)
                      * _per_channel(scale, nd)).to(dtypes[0])
    if mask[1]:
        grad_weight = (sum_dy_xmu * invstd).to(dtypes[1])
    if mask[2]:
        grad_bias = sum_dy.to(dtypes[2])
    return grad_input, grad_weight, grad_bias


def _eval_backward(*args, op, dtypes, **kwargs):
    """Evaluation mode's backward on this rank's piece: dy * invstd * w, and the parameter
    gradients as this piece's sums (Partial). Not torch's kernel: it dies of a division by zero
    on a piece with no channels, which an uneven channel shard gives a rank."""
    a = bound_args(op, args, kwargs)
    dy, x, w, mask = a["grad_out"], a["input"], a["weight"], a["output_mask"]
    acc = _acc(x.dtype)
    nd = x.ndim
    dims = [0, *range(2, nd)]
    invstd = (a["running_var"].to(acc) + a["eps"]).rsqrt()
    dya = dy.to(acc)
    grad_input = grad_weight = grad_bias = None
    if mask[0]:
        scale = invstd if w is None else invstd * w.to(acc)
        grad_input = (dya * _per_channel(scale, nd)).to(dtypes[0])
    if mask[1]:
        centered = x.to(acc) - _per_channel(a["running_mean"].to(acc), nd)
        grad_weight = ((dya * centered).sum(dims) * invstd).to(dtypes[1])
    if mask[2]:
        grad_bias = dya.sum(dims).to(dtypes[2])
    return grad_input, grad_weight, grad_bias


# ----------------------------------------------------------------------------- group norm
@register_rule(aten.native_group_norm.default)
def _group_norm(call):
    # outputs: y and the (N, group) mean and rstd, all split by sample
    strategies = [strategy(call, (R, R, R)), strategy(call, (Shard(0),) * 3, input=Shard(0))]
    return choose(call, strategies, local_fn=functools.partial(_with_local_n, call.op, "input"))


@register_rule(aten.native_group_norm_backward.default)
def _group_norm_backward(call):
    rows = {n: Shard(0) for n in ("grad_out", "input", "mean", "rstd")}
    strategies = [strategy(call, (R, R, R)), strategy(call, (Shard(0), P, P), **rows)]
    return choose(call, strategies, local_fn=functools.partial(_with_local_n, call.op, "input"))


def _with_local_n(op, name, *args, **kwargs):
    """``op`` with its sample count ``N`` (global in the call) set to this rank's piece's. The
    kernel wants contiguous tensors (F.group_norm makes its input so; a piece gathered along a
    later dim is a strided view)."""
    n = bound_args(op, args, kwargs)[name].shape[0]
    args = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]
    kwargs = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    args, kwargs = replace_args(op, args, kwargs, N=n)
    return op(*args, **kwargs)
