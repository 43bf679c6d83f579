"""Neural-network layers: embedding, layer/RMS norm, softmax, convolution.

The communication-saving cases, and why they are exact:

* **vocab-sharded embedding** (weight ``Shard(0)``): each rank looks up only the ids in its row
  range (others read as zero rows), so the sum over ranks is the lookup: ``Partial(sum)``, and the
  table is never gathered. The backward writes only the local rows: a ``Shard(0)`` weight grad.
* **softmax over a sharded dim** (e.g. class-sharded logits for a vocab-parallel loss): the max and
  the sum of exponentials are all-reduced (one row-sized value each); the output stays sharded.
* **norms over sequence-sharded activations**: rows normalise independently, so a shard on a
  non-normalised dim stays; the weight/bias grads are sums over rows, so they come out Partial.

Notes: ``embedding_dense_backward`` cannot see the weight's placement, so with replicated ids and
gradient it returns the ``Shard(0)`` grad (each rank's rows) even for a replicated table; an
optimizer step into a replicated weight then gathers it. On CPU ``F.rms_norm`` decomposes above
the dispatcher (pow, mean, add, rsqrt, mul: generic rules); the ``_fused_rms_norm`` rules serve
devices where that op has a kernel. Dropout: ``native_dropout`` is a random op (``random.py``),
its backward is pointwise (``pointwise.py``).

Helpers at the top (argument access by schema name, per-mesh-dim expansion with a local function)
are shared with ``loss.py`` and ``attention.py``.
"""
from __future__ import annotations

import functools
import itertools

import torch

from .. import _torch_names as torch_names
from .. import collectives
from ..placements import LINEAR_REDUCE_OPS, Partial, Replicate, Shard
from ..spec import DTensorSpec, TensorMeta
from ._registry import register_rule
from .kit import arg, choose, input_names, strategy, target_spec

aten = torch_names.aten
R = Replicate()
P = Partial()

__all__ = ["sharding_mesh_dims", "all_reduce_over"]


# ----------------------------------------------------------------------------- shared helpers
def sharding_mesh_dims(placements, dim: int) -> list[int]:
    return [i for i, p in enumerate(placements) if p.is_shard(dim)]


def all_reduce_over(t: torch.Tensor, mesh, mesh_dims, reduce_op: str) -> torch.Tensor:
    """All-reduce over several mesh dims (sum/max/min compose dim by dim)."""
    for i in mesh_dims:
        t = collectives.all_reduce(t, mesh, i, reduce_op)
    return t


# ----------------------------------------------------------------------------- embedding
@register_rule(aten.embedding.default)
def _embedding(call):
    weight, indices = arg(call, "weight"), arg(call, "indices")
    nd = indices.ndim  # a 0-d plain index tensor acts as replicated (and is no input)
    strategies = [strategy(call, R)]
    strategies += [strategy(call, Shard(d), indices=Shard(d)) for d in range(nd)]
    strategies.append(strategy(call, Shard(nd), weight=Shard(1)))
    strategies.append(strategy(call, P, weight=Shard(0)))  # vocab-parallel: masked local lookup
    strategies += [strategy(call, Partial(op), weight=Partial(op)) for op in LINEAR_REDUCE_OPS]
    full = choose(call, strategies)
    return _with_vocab_range(call, full, full_table_rows=weight.shape[0])


def _with_vocab_range(call, full, full_table_rows):
    wspec = target_spec(call, full, input_names(call).index("weight"))
    if sharding_mesh_dims(wspec.placements, 0):
        shape, offset = wspec.local_shape_and_offset()
        full.local_fn = functools.partial(_masked_lookup, start=offset[0], rows=shape[0],
                                          num_weights=full_table_rows)
    return full


def _masked_lookup(weight, indices, *args, start, rows, num_weights, **kwargs):
    """Embedding of the ids in [start, start + rows) from this rank's rows; other ids give 0.
    An id outside the whole table is an error, as in the plain kernel: raised here on CPU; on a
    GPU asserted asynchronously on the device (torch's own kernel asserts there too; a host
    check would stall every lookup), never masked to a zero row."""
    if indices.numel():
        what = f"embedding: an index is out of range for a table of {num_weights} rows"
        if indices.device.type == "cpu":
            low, high = int(indices.min()), int(indices.max())
            if low < 0 or high >= num_weights:
                raise IndexError(f"{what} (ids span [{low}, {high}])")
        else:
            aten._assert_async.msg(((indices >= 0) & (indices < num_weights)).all(), what)
    local = indices - start
    valid = (local >= 0) & (local < rows)
    if rows == 0:  # an empty vocab shard holds no rows to look up
        return weight.new_zeros(tuple(indices.shape) + (weight.shape[1],))
    out = aten.embedding.default(weight, torch.where(valid, local, 0))
    return out.masked_fill_(~valid.unsqueeze(-1), 0)


@register_rule(aten.embedding_dense_backward.default)
def _embedding_backward(call):
    grad, indices = arg(call, "grad_output"), arg(call, "indices")
    num_weights, scale_by_freq = arg(call, "num_weights"), arg(call, "scale_grad_by_freq")
    if not isinstance(indices, DTensorSpec):
        raise ValueError(f"{call.op}: indices must be a DTensor when the gradient is one")
    nd = indices.ndim
    # Listed first, so it wins the tie with all-Replicate: with replicated ids and gradient each
    # rank writes only its own rows -- the vocab-sharded grad of a vocab-parallel table, without
    # materialising the full table's gradient on every rank.
    strategies = [strategy(call, Shard(0))]
    if not scale_by_freq:  # id frequencies must be counted over all ids: keep the ids whole
        strategies += [strategy(call, P, grad_output=Shard(d), indices=Shard(d))
                       for d in range(nd)]
    strategies.append(strategy(call, Shard(1), grad_output=Shard(nd)))
    strategies += [strategy(call, Partial(op), grad_output=Partial(op)) for op in LINEAR_REDUCE_OPS]
    strategies.append(strategy(call, R))
    full = choose(call, strategies)
    width = grad.shape[-1]
    out_order = full.out_orders[0] if full.out_orders else None
    if out_order is not None:  # orders derived from placements may stop short of dim 1
        out_order = tuple(out_order) + ((),) * (2 - len(out_order))
    out_spec = DTensorSpec(call.mesh, full.outs[0],
                           TensorMeta(torch.Size([num_weights, width]), (width, 1), grad.dtype),
                           out_order)
    if sharding_mesh_dims(out_spec.placements, 0):
        shape, offset = out_spec.local_shape_and_offset()
        full.local_fn = functools.partial(_masked_embedding_backward, start=offset[0],
                                          rows=shape[0])
    return full


def _masked_embedding_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq, *,
                               start, rows):
    """Gradient of rows [start, start + rows) only. Ids outside the range go to one spare row
    that is dropped, so frequency counts of the real rows stay exact."""
    local = indices - start
    valid = (local >= 0) & (local < rows)
    local = torch.where(valid, local, rows)
    pad = padding_idx - start if padding_idx >= 0 and 0 <= padding_idx - start < rows else -1
    out = aten.embedding_dense_backward.default(grad, local, rows + 1, pad, scale_grad_by_freq)
    return out[:rows]


# ----------------------------------------------------------------------------- norms
def _norm_axis(call):
    x = arg(call, "input")
    return x.ndim - len(arg(call, "normalized_shape"))


@register_rule(aten.native_layer_norm.default, aten._fused_rms_norm.default)
def _norm(call):
    # Rows normalise independently: a shard on a row dim stays, a normalised dim is replicated
    # (or, cheaper, moved to a row dim: the dispatcher weighs an all-to-all against a gather).
    n_out = len(call.op._schema.returns)
    strategies = [strategy(call, (R,) * n_out)]
    strategies += [strategy(call, (Shard(d),) * n_out, input=Shard(d))
                   for d in range(_norm_axis(call))]
    return strategies


@register_rule(aten.native_layer_norm_backward.default)
def _layer_norm_backward(call):
    return _norm_backward(call, ("grad_out", "input", "mean", "rstd"), n_param_grads=2)


@register_rule(aten._fused_rms_norm_backward.default)
def _rms_norm_backward(call):
    return _norm_backward(call, ("grad_out", "input", "rstd"), n_param_grads=1)


def _norm_backward(call, row_inputs, n_param_grads):
    strategies = [strategy(call, (R,) * (1 + n_param_grads))]
    for d in range(_norm_axis(call)):
        # the input grad keeps the row shard; weight/bias grads are sums over rows: Partial
        ins = {name: Shard(d) for name in row_inputs}
        strategies.append(strategy(call, (Shard(d),) + (P,) * n_param_grads, **ins))
    for op in LINEAR_REDUCE_OPS:  # every gradient is linear in grad_out
        strategies.append(strategy(call, (Partial(op),) * (1 + n_param_grads),
                                   grad_out=Partial(op)))
    return strategies


# ----------------------------------------------------------------------------- softmax
_SOFTMAX_KIND = {aten._softmax.default: "softmax", aten._log_softmax.default: "log",
                 aten._safe_softmax.default: "safe"}  # safe: rows that are all -inf give 0


@register_rule(*_SOFTMAX_KIND)
def _softmax(call):
    x = call.inputs[0]
    dim = call.args[1] % max(x.ndim, 1)
    strategies = [((R,), (R,))] + [((Shard(d),), (Shard(d),)) for d in range(x.ndim)]
    full = choose(call, strategies)
    reduce_dims = sharding_mesh_dims(full.ins[0], dim) if x.ndim else []
    if reduce_dims:
        full.local_fn = functools.partial(_sharded_softmax, kind=_SOFTMAX_KIND[call.op],
                                          mesh=call.mesh, mesh_dims=tuple(reduce_dims))
    return full


def _acc_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _sharded_softmax(x, dim, *rest, kind, mesh, mesh_dims, **kwargs):
    """(log-)softmax over a dim split across ``mesh_dims``: the row max and the sum of
    exponentials are all-reduced (one value per row each); the logits never move.

    The third argument is ``half_to_float`` of _softmax/_log_softmax, or _safe_softmax's dtype."""
    dtype_arg = rest[0] if rest else kwargs.get("dtype", kwargs.get("half_to_float"))
    if kind == "safe":
        out_dtype = dtype_arg or x.dtype
    else:
        out_dtype = torch.float32 if dtype_arg else x.dtype
    xf = x.to(_acc_dtype(out_dtype))
    if x.shape[dim] > 0:
        row_max = xf.amax(dim, keepdim=True)
    else:  # an empty shard contributes the identity of max
        shape = list(x.shape)
        shape[dim] = 1
        row_max = xf.new_full(shape, float("-inf"))
    row_max = all_reduce_over(row_max, mesh, mesh_dims, "max")
    shifted = xf - row_max
    sum_exp = all_reduce_over(shifted.exp().sum(dim, keepdim=True), mesh, mesh_dims, "sum")
    if kind == "log":
        out = shifted - sum_exp.log()
    else:
        out = shifted.exp() / sum_exp
        if kind == "safe":
            out = out.masked_fill(row_max == float("-inf"), 0)
    return out.to(out_dtype)


@register_rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def _softmax_backward(call):
    out = call.inputs[1]
    dim = call.args[2] % max(out.ndim, 1)
    strategies = [((R,), (R, R))] + [((Shard(d),), (Shard(d), Shard(d))) for d in range(out.ndim)]
    strategies += [((Partial(op),), (Partial(op), R)) for op in LINEAR_REDUCE_OPS]  # linear in grad
    full = choose(call, strategies)
    reduce_dims = sharding_mesh_dims(full.ins[1], dim) if out.ndim else []
    if reduce_dims:
        full.local_fn = functools.partial(
            _sharded_softmax_backward, log=call.op is aten._log_softmax_backward_data.default,
            mesh=call.mesh, mesh_dims=tuple(reduce_dims))
    return full


def _sharded_softmax_backward(grad, out, dim, input_dtype, *, log, mesh, mesh_dims):
    acc = _acc_dtype(grad.dtype)
    g, y = grad.to(acc), out.to(acc)
    if log:  # d/dx log_softmax: g - softmax * sum(g)
        s = all_reduce_over(g.sum(dim, keepdim=True), mesh, mesh_dims, "sum")
        res = g - y.exp() * s
    else:  # d/dx softmax: y * (g - sum(g * y))
        s = all_reduce_over((g * y).sum(dim, keepdim=True), mesh, mesh_dims, "sum")
        res = y * (g - s)
    return res.to(input_dtype)


# ----------------------------------------------------------------------------- convolution
# Every decision here reads global metadata only (shapes, placements, the mesh): a rank's own piece
# may be empty or short, and a rule that looked at it could send ranks down different paths (one
# redistributing, one not) and hang them in mismatched collectives.
#
# Channel sharding with groups > 1: a rank can run its piece of a grouped conv on its own only if
# it holds whole groups -- the same groups -- of the input channels, the weight's dim 0 (out
# channels, or in channels of a transposed conv; both group-major) and the output channels. Then
# the local conv runs with fewer groups ("group-parallel"). Whether every rank's chunk lines up
# with groups is worked out for all mesh coordinates at once; where some chunk cuts a group, the
# strategy is dropped and the channels are replicated instead, on every rank alike.
def _conv_channel_dims(call):
    """(out-channel dim, in-channel dim) of the weight; transposed convs store [in, out, ...]."""
    return (1, 0) if arg(call, "transposed") else (0, 1)


@register_rule(aten.convolution.default)
def _convolution(call):
    w_out, w_in = _conv_channel_dims(call)
    groups = arg(call, "groups")
    strategies = [strategy(call, R), strategy(call, Shard(0), input=Shard(0))]
    for op in LINEAR_REDUCE_OPS:  # linear in the input and in the weight (bias added once)
        strategies.append(strategy(call, Partial(op), input=Partial(op), bias=Partial(op)))
        strategies.append(strategy(call, Partial(op), weight=Partial(op), bias=Partial(op)))
    if groups == 1:
        strategies.append(strategy(call, Shard(1), weight=Shard(w_out), bias=Shard(0)))
        strategies.append(strategy(call, P, input=Shard(1), weight=Shard(w_in), bias=P))
        grouped = []
    else:
        grouped = [strategy(call, Shard(1), input=Shard(1), weight=Shard(0), bias=Shard(0))]
    full = _choose_conv(call, strategies, grouped, out_channels=_out_channels(call))
    return _with_conv_local_fn(call, full, w_out, _conv_local)


@register_rule(aten.convolution_backward.default)
def _convolution_backward(call):
    w_out, w_in = _conv_channel_dims(call)
    groups = arg(call, "groups")
    strategies = [strategy(call, (R, R, R)),
                  strategy(call, (Shard(0), P, P), grad_output=Shard(0), input=Shard(0))]
    strategies += [strategy(call, (Partial(op),) * 3, grad_output=Partial(op))
                   for op in LINEAR_REDUCE_OPS]
    if groups == 1:
        strategies.append(strategy(call, (P, Shard(w_out), Shard(0)), grad_output=Shard(1),
                                   weight=Shard(w_out)))
        strategies.append(strategy(call, (Shard(1), Shard(w_in), R), input=Shard(1),
                                   weight=Shard(w_in)))
        grouped = []
    else:
        grouped = [strategy(call, (Shard(1), Shard(0), Shard(0)), grad_output=Shard(1),
                            input=Shard(1), weight=Shard(0))]
    full = _choose_conv(call, strategies, grouped, out_channels=None)
    return _with_conv_local_fn(call, full, w_out, _conv_backward_local)


def _out_channels(call):
    w = arg(call, "weight")
    return w.shape[1] * arg(call, "groups") if arg(call, "transposed") else w.shape[0]


def _choose_conv(call, strategies, grouped, out_channels):
    """The cheapest strategy, group-parallel ones included only if every rank's chunks of the
    channel dims hold the same whole groups (decided for all mesh coordinates, never locally)."""
    if grouped:
        full = choose(call, strategies + grouped)
        if not _group_split(call, full) or _groups_line_up(call, full, out_channels):
            return full
    return choose(call, strategies)


def _group_split(call, full) -> bool:
    """Whether ``full`` shards the channels group-parallel (the weight's dim 0 is sharded)."""
    if arg(call, "groups") == 1:
        return False
    wspec = target_spec(call, full, input_names(call).index("weight"))
    return bool(sharding_mesh_dims(wspec.placements, 0))


def _groups_line_up(call, full, out_channels) -> bool:
    """Every mesh coordinate holds the same whole groups of every channel-sharded tensor."""
    groups = arg(call, "groups")
    names = input_names(call)
    # (spec as the local op sees it, its channel dim) for each tensor split by groups
    pieces = []
    for name, dim in (("input", 1), ("weight", 0), ("grad_output", 1), ("bias", 0)):
        if name in names:
            pieces.append((target_spec(call, full, names.index(name)), dim))
    if out_channels is not None:  # the forward's output: its channel chunks must line up too
        x = arg(call, "input")
        shape = (x.shape[0], out_channels) + tuple(x.shape[2:])
        meta = TensorMeta(torch.Size(shape), tuple(range(len(shape))), x.dtype)
        order = full.out_orders[0] if full.out_orders else None
        if order is not None:
            order = tuple(order) + ((),) * (len(shape) - len(order))
        pieces.append((DTensorSpec(call.mesh, full.outs[0], meta, order), 1))
    for coord in itertools.product(*(range(n) for n in call.mesh.shape)):
        held = set()
        for spec, dim in pieces:
            per_group = spec.shape[dim] // groups
            shape, offset = spec.local_shape_and_offset(coord)
            if offset[dim] % per_group or shape[dim] % per_group:
                return False
            held.add((offset[dim] // per_group, shape[dim] // per_group))
        if len(held) > 1:
            return False
    return True


def _with_conv_local_fn(call, full, w_out, local_fn):
    """Channel-sharded pieces need local care (empty pieces, local bias sizes, local groups)."""
    names = input_names(call)
    sharded = any(sharding_mesh_dims(target_spec(call, full, j).placements, d)
                  for j, name in enumerate(names) if name in ("input", "weight", "grad_output")
                  for d in (0, 1))
    if sharded:
        in_per_group = None
        if _group_split(call, full):
            in_per_group = arg(call, "input").shape[1] // arg(call, "groups")
        full.local_fn = functools.partial(local_fn, w_out=w_out, in_per_group=in_per_group)
    return full


def _local_groups(input, groups, in_per_group):
    """Groups of this rank's piece: all of them, or (group-parallel) those it holds."""
    return groups if in_per_group is None else input.shape[1] // in_per_group


def _conv_local(input, weight, bias, stride, padding, dilation, transposed, output_padding,
                groups, *, w_out, in_per_group):
    groups = _local_groups(input, groups, in_per_group)
    n_out = weight.shape[1] * groups if transposed else weight.shape[0]
    if n_out == 0 or input.shape[1] == 0:
        # torch rejects an empty weight, and gives a wrong shape for empty input channels: run
        # one zero channel (no out-channels here: keep none; no in-channels: just the bias)
        x = input.new_zeros((input.shape[0], 1) + tuple(input.shape[2:]))
        shape = list(weight.shape)
        shape[1 - w_out] = 1  # the in-channel dim
        shape[w_out] = max(n_out, 1)
        out = aten.convolution.default(x, weight.new_zeros(shape), bias if n_out else None,
                                       stride, padding, dilation, transposed, output_padding, 1)
        return out[:, :n_out]
    return aten.convolution.default(input, weight, bias, stride, padding, dilation, transposed,
                                    output_padding, groups)


def _conv_backward_local(grad, input, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask, *, w_out, in_per_group):
    groups = _local_groups(input, groups, in_per_group)
    # bias_sizes is global; the local bias grad has the local grad's channel count
    if bias_sizes is not None:
        bias_sizes = [grad.shape[1]]
    if weight.shape[w_out] == 0 or input.shape[1] == 0 or groups == 0:
        # no out- or no in-channels here: torch's kernel rejects or mishandles (a zero bias grad)
        # such pieces. Only the bias grad can be nonzero: the sum of the grad over all but channels
        return (torch.zeros_like(input) if output_mask[0] else None,
                torch.zeros_like(weight) if output_mask[1] else None,
                grad.sum([d for d in range(grad.ndim) if d != 1]) if output_mask[2] else None)
    return aten.convolution_backward.default(grad, input, weight, bias_sizes, stride, padding,
                                             dilation, transposed, output_padding, groups,
                                             output_mask)
