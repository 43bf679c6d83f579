"""Splitting a batch into micro-batches and merging the last stage's outputs back (torch's
``torch.distributed.pipelining.microbatch`` names).

A tensor argument is split along its chunk dim (default 0) into ``chunks`` pieces with
``torch.tensor_split`` semantics; anything that is not a tensor (or a ``_Replicate`` spec) is
given whole to every micro-batch. Gradients match one process exactly only when the pieces are
equal (the schedule averages the micro-batches' gradients), so the schedules ask for a batch the
micro-batch count divides.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["TensorChunkSpec", "split_args_kwargs_into_chunks", "merge_chunks"]


class TensorChunkSpec:
    """Split (or merge) a tensor along ``split_dim``. ``TensorChunkSpec(1)``"""

    def __init__(self, split_dim: int):
        self.split_dim = split_dim

    def __repr__(self):
        return f"TensorChunkSpec({self.split_dim})"


class _Replicate:
    """Give the whole value to every micro-batch."""


def _split_one(value, spec, chunks: int, where: str) -> list:
    if spec is _Replicate or isinstance(spec, _Replicate) or not isinstance(value, torch.Tensor):
        return [value] * chunks
    dim = spec.split_dim if spec is not None else 0
    size = value.shape[dim] if value.ndim else 0
    if size < chunks:
        raise ValueError(f"pipelining: {where} has {size} rows along dim {dim}, fewer than the "
                         f"{chunks} micro-batches; pass a larger batch or fewer n_microbatches")
    return list(torch.tensor_split(value, chunks, dim=dim))


def split_args_kwargs_into_chunks(args: tuple, kwargs: dict | None, chunks: int,
                                  args_chunk_spec=None, kwargs_chunk_spec=None):
    """``(args, kwargs)`` as ``chunks`` micro-batches: ``(list of args tuples, list of kwargs
    dicts)``. ``split_args_kwargs_into_chunks((x,), {}, 4)`` -> 4 row blocks of ``x``."""
    kwargs = kwargs or {}
    specs = args_chunk_spec or (None,) * len(args)
    if len(specs) != len(args):
        raise ValueError(f"pipelining: args_chunk_spec has {len(specs)} entries for {len(args)} "
                         "positional arguments")
    kspecs = kwargs_chunk_spec or {}
    split_args = [_split_one(a, s, chunks, f"positional argument {i}")
                  for i, (a, s) in enumerate(zip(args, specs))]
    split_kwargs = {k: _split_one(v, kspecs.get(k), chunks, f"keyword argument '{k}'")
                    for k, v in kwargs.items()}
    arg_mbs = [tuple(a[i] for a in split_args) for i in range(chunks)]
    kwarg_mbs = [{k: v[i] for k, v in split_kwargs.items()} for i in range(chunks)]
    return arg_mbs, kwarg_mbs


def merge_chunks(chunks: list, chunk_spec=None) -> Any:
    """The micro-batches' outputs concatenated back along dim 0 (or the spec's dim); tuples of
    tensors merge element-wise; anything else comes back as the list."""
    if not chunks:
        return chunks
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        dim = chunk_spec.split_dim if isinstance(chunk_spec, TensorChunkSpec) else 0
        return torch.cat(chunks, dim=dim) if first.ndim else torch.stack(chunks)
    if isinstance(first, (tuple, list)):
        specs = chunk_spec if isinstance(chunk_spec, (tuple, list)) else [None] * len(first)
        return type(first)(merge_chunks([c[i] for c in chunks], specs[i])
                           for i in range(len(first)))
    return chunks
