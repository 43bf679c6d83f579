"""scaled_dot_product_attention on DTensors. On CPU: ``aten._scaled_dot_product_flash_attention_for_cpu``
(and its backward), which is what ``F.scaled_dot_product_attention`` reaches in torch 2.13; on CUDA
the flash / memory-efficient / cuDNN kernels (batch and head sharding; see the end of the file).

q/k/v are ``[*batch, L|S, E]`` (``[B, H, L, E]`` from the usual callers):

* batch or head dims shard straight through (each (batch, head) attends on its own); the mask
  follows where it spans that dim and is replicated where it broadcasts;
* query rows may be sharded with keys/values whole (each query row attends on its own), so a
  sequence-sharded q/k/v needs only k and v gathered -- or, usually cheaper when there are heads
  to split, an all-to-all of q/k/v from sequence to heads (as in Ulysses); the dispatcher weighs
  the two. Causal masking of sharded rows needs each rank's global row offset, so the local call
  gets an explicit causal mask for its rows;
* key/value sequence sharding would need an online softmax across ranks (ring attention): those
  are gathered instead;
* with dropout every strategy but full replication is refused (the dropout mask is drawn inside
  the kernel, so it could not match the unsharded op).

The CPU kernel crashes on empty heads or query rows, which uneven shards produce; such ranks
compute nothing and return empty/zero pieces.

Inputs the fused kernel does not take (a value head dim unlike the query's, no head dim, GQA,
dropout) go down the composite math path instead: matmuls and ``aten._safe_softmax`` (see
``nn.py``), each with its own rule. With ``is_causal`` that path builds its mask from scratch
(``ones(L, S).tril()``): a plain tensor, which DTensor ops refuse to mix with DTensors. The mask
depends on global shapes only -- every rank builds the same one -- so while SDPA's composite runs on
DTensors, tensors it creates from no input are made replicated DTensors (``_ReplicateCreated``).
``F.scaled_dot_product_attention`` is CompositeImplicitAutograd: with autograd on it decomposes
before any DTensor sees it, so its autograd-CPU kernel is wrapped (plain tensors: torch's own
composite, unchanged) to run that scope for DTensor inputs; in inference mode the op reaches the
dispatcher whole and the rules below do the same. A plain (non-0-d) ``attn_mask`` or q/k/v mixed
with DTensors is an error, as everywhere: it is checked first, since inside the scope its
conversions would otherwise look like tensors created from scratch.
"""
from __future__ import annotations

import functools

import torch


from .. import _torch_names as torch_names
from .._torch_names import TorchDispatchMode, tree_flatten
from ..dtensor import DTensor
from ..placements import Partial, Replicate, Shard
from ..spec import DTensorSpec, TensorMeta
from ._registry import Decompose, intercept_composite, register_rule
from .kit import arg, choose, input_names, strategy, target_spec
from .nn import sharding_mesh_dims

aten = torch_names.aten
R = Replicate()
P = Partial()
SDPA_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA_CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _mask_placement(mask, q: DTensorSpec, d: int):
    """The mask's placement when dim ``d`` of q (and the output) is sharded."""
    if not isinstance(mask, DTensorSpec):
        return None
    dd = d - (q.ndim - mask.ndim)
    return Shard(dd) if dd >= 0 and mask.shape[dd] == q.shape[d] else R


def _sdpa_strategies(call, outs_for, rows_outs, **row_extra):
    """Strategies shared by forward and backward. ``outs_for(d)``: outputs when dim d of
    q/k/v is sharded; ``rows_outs``: outputs when only the query rows are."""
    q, k, v = arg(call, "query"), arg(call, "key"), arg(call, "value")
    mask = arg(call, "attn_mask")
    n_out = len(call.op._schema.returns)
    strategies = [strategy(call, (R,) * n_out)]
    if arg(call, "dropout_p") != 0:
        return strategies
    kv_like = [n for n in input_names(call) if n not in ("attn_mask",)]
    for d in range(q.ndim - 2):  # batch / head dims (a size-1 dim would leave ranks idle)
        if q.shape[d] == k.shape[d] == v.shape[d] > 1:
            ins = {n: Shard(d) for n in kv_like}
            strategies.append(strategy(call, outs_for(d), attn_mask=_mask_placement(mask, q, d),
                                       **ins))
    rows = q.ndim - 2
    ins = {n: Shard(rows) for n in row_extra}
    strategies.append(strategy(call, rows_outs(rows), attn_mask=_mask_placement(mask, q, rows),
                               **ins))
    return strategies


def _row_offset(call, full):
    """Global index of this rank's first query row when the rows are sharded, else None."""
    j = input_names(call).index("query")
    spec = target_spec(call, full, j)
    rows = spec.ndim - 2
    if not sharding_mesh_dims(spec.placements, rows):
        return None
    return spec.local_shape_and_offset()[1][rows]


@register_rule(SDPA_CPU)
def _sdpa(call):
    strategies = _sdpa_strategies(
        call, outs_for=lambda d: (Shard(d), Shard(d)), rows_outs=lambda r: (Shard(r), Shard(r)),
        query=None)
    full = choose(call, strategies)
    start = _row_offset(call, full) if _any_sharded(call, full) and arg(call, "is_causal") \
        else None
    full.local_fn = functools.partial(_sdpa_local, row_start=start)
    return full


@register_rule(SDPA_CPU_BACKWARD)
def _sdpa_backward(call):
    # sharded query rows: each rank's rows contribute to every key/value grad -> Partial(sum)
    strategies = _sdpa_strategies(
        call, outs_for=lambda d: (Shard(d),) * 3, rows_outs=lambda r: (Shard(r), P, P),
        grad_out=None, query=None, out=None, logsumexp=None)
    full = choose(call, strategies)
    start = _row_offset(call, full) if _any_sharded(call, full) and arg(call, "is_causal") \
        else None
    full.local_fn = functools.partial(_sdpa_backward_local, row_start=start)
    return full


def _any_sharded(call, full):
    """Whether some rank may hold an empty piece or need a row offset (else: the plain op)."""
    spec = target_spec(call, full, input_names(call).index("query"))
    return any(p.is_shard() for p in spec.placements)


def _causal_mask(q, k, row_start):
    """The causal mask (top-left aligned, as torch's is_causal) of query rows from row_start."""
    allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
    allowed = allowed.tril(diagonal=row_start)
    return torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(
        ~allowed, float("-inf"))


def _empty(q, k, v):
    return q.numel() == 0 or k.numel() == 0 or v.numel() == 0


def _unit_stride(*ts):
    """The tensors with a last-dim stride of 1: the CPU flash kernels read a gathered piece of
    the head dim (strides (.., 1, 90)) as if it were contiguous and return garbage; the CUDA
    fused kernels refuse it ("query: last dimension must be contiguous", seen on an H200)."""
    return [t.contiguous() if isinstance(t, torch.Tensor) and t.ndim and t.stride(-1) != 1
            else t for t in ts]


def _sdpa_local(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                scale=None, row_start):
    query, key, value, attn_mask = _unit_stride(query, key, value, attn_mask)
    if _empty(query, key, value):  # the kernel dies (SIGFPE) on empty heads or rows
        metas = SDPA_CPU(*[t.to("meta") for t in (query, key, value)], dropout_p, is_causal,
                         scale=scale)
        return tuple(torch.zeros(m.shape, dtype=m.dtype, device=query.device) for m in metas)
    if row_start is not None:
        attn_mask, is_causal = _causal_mask(query, key, row_start), False
    return SDPA_CPU(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


def _sdpa_backward_local(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                         attn_mask=None, scale=None, row_start):
    grad_out, query, key, value, out, attn_mask = _unit_stride(grad_out, query, key, value, out,
                                                               attn_mask)
    if _empty(query, key, value):  # no queries here: nothing flows to any key or value
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    if row_start is not None:
        attn_mask, is_causal = _causal_mask(query, key, row_start), False
    return SDPA_CPU_BACKWARD(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                             attn_mask=attn_mask, scale=scale)


# ----------------------------------------------------------------------------- the composite entry
SDPA = aten.scaled_dot_product_attention.default
SDPA_MATH = aten._scaled_dot_product_attention_math.default
_SDPA_ARGS = ("query", "key", "value", "attn_mask")


class _ReplicateCreated(TorchDispatchMode):
    """Inside SDPA's composite on DTensors: a tensor made from no tensor input (or only 0-d ones),
    such as the math path's causal mask, is a function of global shapes, the same on every rank:
    it becomes a replicated DTensor. Random ones would differ by rank: those are refused."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or isinstance(out, DTensor) or out.ndim == 0:
            return out
        if any(isinstance(a, torch.Tensor) and a.ndim > 0 for a in tree_flatten((args, kwargs))[0]):
            return out  # made from a plain tensor: left plain, so mixing it stays an error
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise RuntimeError(f"scaled_dot_product_attention on DTensors: its composite drew "
                               f"random values with {func} outside any DTensor; they would differ "
                               "by rank (a bug: report it with the arguments)")
        meta = TensorMeta(out.shape, tuple(out.stride()), out.dtype)
        return DTensor(out, DTensorSpec(self.mesh, (R,) * self.mesh.ndim, meta))


def _sdpa_on_dtensors(op, args, kwargs):
    """Run ``op``'s composite (SDPA, or its math path) with created tensors replicated."""
    names = [a.name for a in op._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    tensors = {n: bound.get(n) for n in _SDPA_ARGS}
    mesh = next(t.device_mesh for t in tensors.values() if isinstance(t, DTensor))
    for n, t in tensors.items():
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.ndim > 0:
            raise ValueError(
                f"scaled_dot_product_attention: {n} is a plain torch.Tensor (shape "
                f"{tuple(t.shape)}) while other inputs are DTensors. Make it a DTensor first, e.g. "
                f"distribute_tensor({n}, mesh, [Replicate()] * mesh.ndim), or shard it like the "
                "attention scores (only 0-d tensors are treated as replicated automatically)")
    with _ReplicateCreated(mesh):
        return op.decompose(*args, **kwargs)


intercept_composite(SDPA, lambda *args, **kwargs: _sdpa_on_dtensors(SDPA, args, kwargs),
                    torch.nn.functional.scaled_dot_product_attention)


@register_rule(SDPA, SDPA_MATH)
def _sdpa_composite(call):
    # reached whole only without autograd keys (inference mode): decompose in the DTensor scope
    op = call.op
    return Decompose(lambda *args, **kwargs: _sdpa_on_dtensors(op, args, kwargs))


# ----------------------------------------------------------------------------- CUDA fused kernels
# On CUDA, F.scaled_dot_product_attention reaches one of these kernels (flash for fp16/bf16,
# memory-efficient for fp32 or with a bias, cuDNN where enabled). Each (batch, head) attends on
# its own, so batch and head dims shard straight through, forward and backward; a sequence-sharded
# q/k/v is gathered to one of those (or replicated) by the dispatcher. Their per-call RNG state,
# cumulative sequence lengths and debug masks are empty or 0-d: replicated.
_CUDA_FUSED = {
    # op: (DTensor inputs sharded with q, outputs sharded with q; the rest are replicated)
    aten._scaled_dot_product_flash_attention.default: (
        ("query", "key", "value"), ("output", "logsumexp")),
    aten._scaled_dot_product_flash_attention_backward.default: (
        ("grad_out", "query", "key", "value", "out", "logsumexp"),
        ("grad_query", "grad_key", "grad_value")),
    aten._scaled_dot_product_efficient_attention.default: (
        ("query", "key", "value"), ("output", "log_sumexp")),
    aten._scaled_dot_product_efficient_attention_backward.default: (
        ("grad_out_", "query", "key", "value", "out", "logsumexp"), (0, 1, 2)),
    aten._scaled_dot_product_cudnn_attention.default: (
        ("query", "key", "value"), ("output", "logsumexp")),
    aten._scaled_dot_product_cudnn_attention_backward.default: (
        ("grad_out", "query", "key", "value", "out", "logsumexp"), (0, 1, 2)),
}
# the bias of the efficient / cuDNN kernels, and (efficient backward only) its gradient's index
_BIAS_GRAD_OUT = {aten._scaled_dot_product_efficient_attention_backward.default: 3}


def _fused_cuda_rule(call):
    sharded_ins, sharded_outs = _CUDA_FUSED[call.op]
    returns = call.op._schema.returns
    out_sharded = [k in sharded_outs or r.name in sharded_outs for k, r in enumerate(returns)]
    q, k, v = arg(call, "query"), arg(call, "key"), arg(call, "value")
    names = input_names(call)
    bias = arg(call, "attn_bias") if "attn_bias" in names else None
    strategies = [strategy(call, (R,) * len(returns))]
    if arg(call, "dropout_p") == 0:  # dropout draws inside the kernel: only replication matches
        for d in range(q.ndim - 2):  # batch / head dims (a size-1 dim would leave ranks idle)
            if not q.shape[d] == k.shape[d] == v.shape[d] > 1:
                continue
            bias_placement = _mask_placement(bias, q, d)
            if bias is not None and bias_placement == R:
                continue  # a bias broadcast over d: its gradient would be a partial sum; gather
            outs = [Shard(d) if s else R for s in out_sharded]
            if call.op in _BIAS_GRAD_OUT and bias is not None:
                outs[_BIAS_GRAD_OUT[call.op]] = bias_placement
            ins = {n: Shard(d) for n in sharded_ins if n in names}
            strategies.append(strategy(call, tuple(outs), attn_bias=bias_placement, **ins))
    return choose(call, strategies, functools.partial(_fused_local, call.op))


_BIAS_ALIGNMENT = 16  # elements: the memory-efficient kernel's rule for a bias's row strides


def _aligned_bias(bias):
    """``bias`` with row strides the memory-efficient kernel accepts. SDPA pads its bias this way
    itself, but a bias the dispatcher had to gather or re-shard arrives as a fresh contiguous
    piece: pad the last dim to the alignment and slice it back (a view, values unchanged)."""
    if all(st % _BIAS_ALIGNMENT == 0 for st in bias.stride()[:-1]):
        return bias
    last = bias.shape[-1]
    pad = -last % _BIAS_ALIGNMENT
    return torch.nn.functional.pad(bias, (0, pad))[..., :last]


def _fused_local(op, *args, **kwargs):
    """The kernel on this rank's pieces; an empty piece (uneven batch/head shards) computes
    nothing and returns zeros of the kernel's output shapes (its gradients are zero too)."""
    names = [a.name for a in op._schema.arguments]
    # a redistributed piece may have any strides
    args, kwargs = tuple(_unit_stride(*args)), dict(zip(kwargs, _unit_stride(*kwargs.values())))
    if "attn_bias" in names:
        j = names.index("attn_bias")
        if j < len(args) and isinstance(args[j], torch.Tensor) and args[j].numel():
            args = args[:j] + (_aligned_bias(args[j]),) + args[j + 1:]
    if any(isinstance(a, torch.Tensor) and a.numel() == 0 for a in args[:4]):
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        metas = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
        return tuple(torch.zeros(m.shape, dtype=m.dtype, device=device)
                     if isinstance(m, torch.Tensor) else m for m in metas)
    return op(*args, **kwargs)


register_rule(*_CUDA_FUSED)(_fused_cuda_rule)
