"""Splitting a batch into micro-batches and merging the last stage's outputs back: torch's
``torch.distributed.pipelining.microbatch`` API and semantics.

``split_args_kwargs_into_chunks`` flattens args and kwargs with pytree (nested lists, tuples and
dicts alike) and, leaf by leaf, splits a tensor along its ``TensorChunkSpec``'s dim with
``torch.tensor_split`` (default: dim 0) or gives a ``_Replicate`` leaf (by default every
non-tensor) whole to every micro-batch. As torch's, a batch with fewer rows than ``chunks`` along
a split dim gives fewer micro-batches (the schedules refuse that with a clear error). A DTensor is
split locally, each micro-batch a DTensor of the right global shape, with no communication.

``merge_chunks`` is the inverse: leaf by leaf, ``TensorChunkSpec`` leaves are concatenated (0-d
tensors stacked), other leaves must agree across micro-batches and are kept once, and the
result has the micro-batches' structure (a dict of outputs merges into a dict).
Gradients match one process exactly only when the pieces are equal (the schedule averages the
micro-batches' gradients), so the schedules ask for a batch the micro-batch count divides.
"""
from __future__ import annotations

import operator
from typing import Any

import torch

from .._torch_names import tree_flatten, tree_map, tree_unflatten
from ..dtensor import DTensor

__all__ = ["TensorChunkSpec", "split_args_kwargs_into_chunks", "merge_chunks"]

DEFAULT_CHUNK_DIM = 0


class _CustomReducer:
    """Merge a leaf by reducing the micro-batches' values (torch's): ``reduce_fn(acc, value)``
    from ``init_value``."""

    def __init__(self, init_value, reduce_fn):
        self.init_value = init_value
        self.reduce_fn = reduce_fn


class _LossReducer(_CustomReducer):
    pass


sum_reducer = _LossReducer(torch.tensor(0.0), operator.add)


class TensorChunkSpec:
    """Split (or merge) a tensor along ``split_dim``. ``TensorChunkSpec(1)``"""

    split_dim: int

    def __init__(self, split_dim: int):
        self.split_dim = split_dim

    def __repr__(self):
        return f"{type(self).__module__}.{type(self).__name__}({self.split_dim})"

    def __str__(self):
        return f"TensorChunkSpec({self.split_dim})"

    @staticmethod
    def from_tuple(chunk_dims: tuple):
        """One spec per positional argument: ``TensorChunkSpec.from_tuple((0, 0, 1))`` splits
        three arguments along dims 0, 0 and 1 (nested tuples / lists keep their structure)."""
        return _map_dims(chunk_dims)

    @staticmethod
    def from_dict(chunk_dims: dict):
        """One spec per keyword argument: ``TensorChunkSpec.from_dict({"id": 0, "mask": 1})``."""
        return _map_dims(chunk_dims)


def _map_dims(dims):
    if isinstance(dims, dict):
        return {k: _map_dims(v) for k, v in dims.items()}
    if isinstance(dims, (tuple, list)):
        return type(dims)(_map_dims(v) for v in dims)
    return TensorChunkSpec(dims)


class _Replicate:
    """Give the whole value to every micro-batch."""


def _is_replicate(spec) -> bool:
    return spec is _Replicate or isinstance(spec, _Replicate)


def _split_tensor(tensor: torch.Tensor, spec: TensorChunkSpec, chunks: int) -> list:
    dim = spec.split_dim
    if isinstance(tensor, DTensor):
        # each rank splits its own piece; every micro-batch is a DTensor of its global rows
        # (no communication: dispatching tensor_split on a DTensor sharded along dim would
        # gather it first)
        local = tensor.to_local()
        pieces = torch.tensor_split(local, chunks, dim)
        quotient, remainder = divmod(tensor.shape[dim], chunks)
        out = []
        for i, piece in enumerate(pieces):
            shape = list(tensor.shape)
            shape[dim] = quotient + (1 if i < remainder else 0)
            out.append(DTensor.from_local(piece, tensor.device_mesh, tensor.placements,
                                          shape=torch.Size(shape), run_check=False))
    else:
        out = list(torch.tensor_split(tensor, chunks, dim))
    if tensor.requires_grad and tensor.is_leaf:
        for piece in out:  # views of a leaf: keep their .grad for the stage's backward
            piece.retain_grad()
    return out


def _shard_dict_of_args(args_dict: dict, specs: dict, chunks: int) -> list[dict]:
    """``args_dict`` as ``min(chunks, rows of the smallest split leaf)`` dicts of micro-batch
    values (torch's rule), split leaf by leaf as ``specs`` (same structure) says."""
    if not args_dict:
        return [{} for _ in range(chunks)]
    if len(args_dict) != len(specs):
        raise ValueError(f"pipelining: the chunk spec names {list(specs)} but the call passes "
                         f"{list(args_dict)}; give one spec per argument")
    values, tree = tree_flatten(args_dict)
    leaf_specs, _ = tree_flatten(specs)
    if len(values) != len(leaf_specs):
        raise ValueError(f"pipelining: the chunk spec {specs} does not match the structure of "
                         "the arguments; give one spec per tensor")
    sizes = []
    for v, spec in zip(values, leaf_specs):
        if _is_replicate(spec):
            sizes.append(chunks)
        elif isinstance(v, torch.Tensor):
            if not isinstance(spec, TensorChunkSpec):
                raise ValueError(f"pipelining: a tensor argument has chunk spec {spec!r}; give a "
                                 "TensorChunkSpec (or _Replicate)")
            sizes.append(v.size(spec.split_dim))
        else:
            raise ValueError(f"pipelining: unsupported chunk spec {spec!r} for value {v!r}")
    n = min(*sizes, chunks)
    columns = []
    for v, spec in zip(values, leaf_specs):
        columns.append([v] * n if _is_replicate(spec) else _split_tensor(v, spec, n))
    return [tree_unflatten([col[i] for col in columns], tree) for i in range(n)]


def _default_spec(v):
    return TensorChunkSpec(DEFAULT_CHUNK_DIM) if isinstance(v, torch.Tensor) else _Replicate()


def split_args_kwargs_into_chunks(args: tuple, kwargs: dict | None, chunks: int,
                                  args_chunk_spec=None, kwargs_chunk_spec=None):
    """``(args, kwargs)`` as micro-batches: ``(list of args tuples, list of kwargs dicts)``.
    ``split_args_kwargs_into_chunks((x,), {}, 4)`` -> 4 row blocks of ``x``. The specs have the
    structure of ``args`` / ``kwargs`` (default: tensors along dim 0, anything else replicated);
    a batch with fewer rows than ``chunks`` gives as many micro-batches as it has rows."""
    kwargs = kwargs or {}
    if args_chunk_spec is None:
        args_chunk_spec = tree_map(_default_spec, args)
    if kwargs_chunk_spec is None:
        kwargs_chunk_spec = tree_map(_default_spec, kwargs)
    if len(args_chunk_spec) != len(args):
        raise ValueError(f"pipelining: args_chunk_spec has {len(args_chunk_spec)} entries for "
                         f"{len(args)} positional arguments")
    arg_specs = dict(enumerate(args_chunk_spec))
    args_split = _shard_dict_of_args(dict(enumerate(args)), arg_specs, chunks)
    n = len(args_split)
    kwargs_split = _shard_dict_of_args(kwargs, kwargs_chunk_spec, n)
    if len(kwargs_split) < n:  # a keyword argument splits into fewer: split the args again
        n = len(kwargs_split)
        args_split = _shard_dict_of_args(dict(enumerate(args)), arg_specs, n)
    if len(args_split) != len(kwargs_split):
        raise RuntimeError("pipelining: args and kwargs split into different numbers of "
                           f"micro-batches: {len(args_split)}, {len(kwargs_split)}")
    return [tuple(a[i] for i in range(len(a))) for a in args_split], kwargs_split


def _cat(values: list, dim: int):
    if isinstance(values[0], DTensor):
        if not all(isinstance(v, DTensor) for v in values):
            raise ValueError("merge_chunks: some micro-batches' outputs are DTensors and others "
                             "plain tensors")
        first = values[0]
        if any(v.placements != first.placements for v in values):
            raise ValueError(f"merge_chunks: the micro-batches' outputs have different placements "
                             f"{[list(v.placements) for v in values]}")
        shape = list(first.shape)
        shape[dim] = sum(v.shape[dim] for v in values)
        return DTensor.from_local(torch.cat([v.to_local() for v in values], dim=dim),
                                  first.device_mesh, first.placements, shape=torch.Size(shape),
                                  run_check=False)
    if values[0].ndim == 0:  # per-micro-batch scalars (torch.cat refuses them): one per row
        return torch.stack(values)
    return torch.cat(values, dim=dim)


def merge_chunks(chunks: list, chunk_spec=None) -> Any:
    """The micro-batches' outputs merged back into one value of the same structure (tuples,
    lists, dicts): leaves whose spec is a ``TensorChunkSpec`` concatenated along its dim (default:
    every tensor along dim 0), reducer leaves reduced, other leaves must be equal in every
    micro-batch and are kept once."""
    if not chunks:
        return chunks
    if chunk_spec is not None:
        spec_flat, tree = tree_flatten(chunk_spec)
    else:
        first_flat, tree = tree_flatten(chunks[0])
        spec_flat = [TensorChunkSpec(DEFAULT_CHUNK_DIM) if isinstance(v, torch.Tensor) else None
                     for v in first_flat]
    flat = []
    for chunk in chunks:
        values, _ = tree_flatten(chunk)
        if len(values) != len(spec_flat):
            raise ValueError(f"merge_chunks: a micro-batch's output {chunk} does not match the "
                             f"chunk spec {chunk_spec}")
        flat.append(values)
    merged = []
    for k, spec in enumerate(spec_flat):
        column = [values[k] for values in flat]
        if isinstance(spec, TensorChunkSpec):
            merged.append(_cat(column, spec.split_dim))
        elif isinstance(spec, _CustomReducer):
            acc = spec.init_value
            for v in column:
                acc = spec.reduce_fn(acc, v)
            merged.append(acc)
        else:
            value = column[0]
            for v in column[1:]:
                same = torch.equal(v, value) if isinstance(value, torch.Tensor) else v == value
                if not same:
                    raise ValueError(f"merge_chunks: a leaf without a TensorChunkSpec differs "
                                     f"between micro-batches ({value!r} and {v!r}); give it a "
                                     "TensorChunkSpec to concatenate it")
            merged.append(value)
    return tree_unflatten(merged, tree)
