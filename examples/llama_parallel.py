"""Tensor-parallel plan for the Llama model of ``examples/llama.py`` (Megatron-style).

Attention and MLP each run as one column-parallel stage (``wq/wk/wv``, ``w1/w3``: heads and
hidden features split over the TP ranks, no communication) followed by one row-parallel stage
(``wo``, ``w2``: partial sums reduced once). The embedding is vocab-parallel, the output layer
column-parallel over the vocab.

* ``sequence_parallel``: between the blocks' matmuls the residual stream stays sharded on the
  sequence dim (norms run on 1/n of the tokens), so each all-reduce becomes a reduce-scatter
  plus an all-gather before the next column-parallel stage.
* ``loss_parallel``: the logits stay sharded over the vocab (a ``Shard(-1)`` DTensor) and the
  loss is computed under ``tp.loss_parallel()`` without gathering them.

Example::

    >>> tp_mesh = init_device_mesh("cpu", (2,))
    >>> model = parallelize_llama(Llama(cfg), tp_mesh, sequence_parallel=True)
    >>> loss = loss_fn(model(tokens), targets)      # tokens: the full batch on every TP rank
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from dtensor_lite import DeviceMesh, Replicate, Shard
from tp import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                SequenceParallel, parallelize_module)

__all__ = ["llama_tp_plan", "parallelize_llama", "apply_activation_checkpointing",
           "matmul_saving_policy", "AC_MODES"]


def llama_tp_plan(model: nn.Module, *, sequence_parallel: bool = False,
                  loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan for ``model`` (an ``examples.llama.Llama``).

    Returns a dict of module path patterns to styles; apply it with ``parallelize_module`` or
    ``parallelize_llama`` (which also checks the TP size fits the model).

    Example::

        >>> plan = llama_tp_plan(model, sequence_parallel=True, loss_parallel=False)
        >>> plan["layers.*.attention.wq"]
        ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(dim=-1), ...)
    """
    if not hasattr(model, "layers") or not hasattr(model, "tok_embeddings"):
        raise ValueError(f"llama_tp_plan expects an examples.llama.Llama, got "
                         f"{type(model).__name__}")
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    # under sequence parallelism the residual stream stays a DTensor: it knows its global sequence
    # length, so a length the TP size does not divide gives torch.chunk pieces (a local tensor
    # declared Shard(1) would make every later hook exchange the pieces' lengths to learn it)
    stream_local = not sp
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual,
                                          use_local_output=stream_local),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=residual,
                                                 use_local_output=stream_local),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=residual,
                                                    use_local_output=stream_local),
        "output": ColwiseParallel(input_layouts=residual,
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    if sp:
        plan.update({
            "layers.*.attention_norm": SequenceParallel(),
            "layers.*.ffn_norm": SequenceParallel(),
            # attention(x, cos, sin): gather x's sequence; cos/sin are plain tables, untouched
            "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                     desired_input_layouts=(Replicate(), None, None)),
            "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                        desired_input_layouts=(Replicate(),)),
            "norm": SequenceParallel(),
        })
    return plan


def parallelize_llama(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False,
                      loss_parallel: bool = False) -> nn.Module:
    """Apply :func:`llama_tp_plan` to ``model`` on the 1-D ``tp_mesh``; returns the model.

    Checks what the model itself needs: whole heads per rank (its attention reshapes with
    ``view(bsz, seq, -1, head_dim)``). Hidden and vocabulary sizes and, with sequence
    parallelism, the sequence length may be uneven (torch.chunk pieces).

    Example::

        >>> model = parallelize_llama(Llama(cfg), mesh["tp"], sequence_parallel=True,
        ...                           loss_parallel=True)
        >>> with tp.loss_parallel():
        ...     loss_fn(model(tokens), targets).backward()
    """
    tp = tp_mesh.size()
    n_heads = model.cfg.n_heads
    n_kv_heads = model.cfg.n_kv_heads or n_heads
    for what, heads in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if heads % tp:
            raise ValueError(f"parallelize_llama: {what}={heads} does not divide by the TP size "
                             f"{tp}; each rank must hold whole attention heads (choose a TP "
                             f"size that divides {heads})")
    plan = llama_tp_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    parallelize_module(model, tp_mesh, plan)
    return model


# ============================================================================ activation checkpointing
AC_MODES = ("none", "full", "selective")
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default}


def matmul_saving_policy(every: int = 1):
    """An op-level selective checkpointing policy: keep the output of every ``every``-th matmul
    (and every attention kernel; counted per checkpointed call), recompute everything else.

    Example::

        >>> ctx_fn = lambda: create_selective_checkpoint_contexts(matmul_saving_policy(2))
        >>> y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=ctx_fn)
    """
    seen = [0]

    def policy(ctx, op, *args, **kwargs):
        if op not in _MATMULS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                  torch.ops.aten.bmm.default):
            seen[0] += 1
            if (seen[0] - 1) % every:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE
    return policy


def _selective_contexts(every: int):
    return create_selective_checkpoint_contexts(matmul_saving_policy(every))


def apply_activation_checkpointing(model: nn.Module, mode: str, *, every: int = 1) -> nn.Module:
    """Wrap every block of ``model.layers`` in ``checkpoint_wrapper`` (non-reentrant), the
    torchtitan order: after tensor parallelism, before ``fully_shard`` (which then shards the
    wrappers). ``mode``: ``"none"``, ``"full"`` (recompute the whole block in backward) or
    ``"selective"`` (keep matmul and attention outputs, see :func:`matmul_saving_policy`).

    Example::

        >>> parallelize_llama(model, mesh["tp"])
        >>> apply_activation_checkpointing(model, "selective")
        >>> for block in model.layers:
        ...     fully_shard(block, mesh=mesh["dp"])
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: use one of {AC_MODES}")
    if mode == "none":
        return model
    kwargs = {} if mode == "full" else {"context_fn": functools.partial(_selective_contexts,
                                                                        every)}
    # a ModuleList, or a pipeline stage's ModuleDict (layers under their model indices)
    items = model.layers.items() if isinstance(model.layers, nn.ModuleDict) \
        else enumerate(model.layers)
    for i, block in list(items):
        model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)
    return model
