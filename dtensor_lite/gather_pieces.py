"""Gather local pieces of an unknown global size exactly, in one collective once warm.

A plain local tensor declared ``Shard(d)`` (a TP style's input, a sequence split the mesh size
may not divide) has a global size that no rank knows alone. PyTorch assumes even pieces
(global = local x n): silently wrong, or a gloo abort, on an uneven piece (the last batch). The
exact way is to exchange the pieces' shapes first (``piece_check``: one fixed-size row per rank)
and then gather: two collectives per call. When the piece is gathered anyway (Shard -> Replicate),
the size rides with the data instead:

* every rank sends one byte buffer of an *agreed* size: an 8-byte header (its rows along ``d``,
  or -1 when its piece does not fit the agreement) then its rows, padded to ``pad`` rows;
* the agreement (``pad`` rows of a given row shape and dtype) is a cache entry every rank holds
  identically, because each is derived from a previous collective's result (the gathered headers
  or the shape exchange), never from this rank's own piece;
* every rank reads every header from the one result, so all see the same thing: the sizes fit
  and form ``torch.chunk`` pieces (the result is exact, one collective), or some rank's piece
  did not fit or fits no global tensor (all take the exact path: the shape exchange, which raises
  the same clear error everywhere when the pieces form no tensor, then the gather).

Cost once warm: the collectives PyTorch issues, plus 8 bytes per rank. Those 8 bytes cannot be
saved in general: when every piece fills its ``pad`` rows (even pieces) no padding is left in
which a rank could say "my piece changed", and without saying it the others would be wrong. The
first call per (call site, mesh) has no agreement yet and pays the shape exchange.

A piece that is *not* gathered (``SequenceParallel``'s input stays ``Shard``) has no data
collective to ride on: once warm its shape costs one all_gather of the headers alone (8 bytes a
rank, against the exchange's fixed ~1.6 kB row), still one collective more than PyTorch, which
assumes even pieces.
"""
from __future__ import annotations

import torch

from . import _caches
from ._unseen import unseen_fn
from . import collectives as C
from .piece_check import checked_global_shape
from .dtensor import DTensor, _as_grad_dtensor, _redistribute_grad_target, _redistributed
from .placements import Replicate, Shard, chunk_range
from .spec import DTensorSpec, TensorMeta, contiguous_stride

__all__ = ["gather_local_pieces", "local_pieces_shape", "pieces_global_shape", "agreement_applies"]

_HEADER = 8  # one int64: this rank's rows along the shard dim, or -1 (does not fit)
# (call site, mesh) -> the agreement: (dim, ndim, dtype, pad rows, shape of one row). Keyed by
# nothing of the local piece, which may differ between ranks: every rank must take the same path.
_AGREED: dict = _caches.register({})


@unseen_fn
def gather_local_pieces(local: torch.Tensor, mesh, dim: int, *, who: str = "") -> DTensor:
    """The Replicate DTensor whose ``Shard(dim)`` pieces (on the 1-D ``mesh``) are the ranks'
    ``local`` tensors, of whatever sizes ``torch.chunk`` gives; differentiable (the gradient
    comes back as ``Shard(dim)``, as redistribute's). Raises ValueError on every rank when the
    pieces form no global tensor."""
    key = (who, mesh)
    agreed = _AGREED.get(key)
    if agreed is not None:
        out = _gather_fitted(local, mesh, dim, agreed, True)
        if out is not None:
            full, most = out
            _AGREED[key] = agreed[:3] + (max(agreed[3], most),) + agreed[4:]
            return _Gathered.apply(_sharded(local, mesh, dim, full.shape), full)
    shape = _exchanged_shape(local, mesh, dim, who, key, agreed)
    return _sharded(local, mesh, dim, shape).redistribute(mesh, [Replicate()])


def agreement_applies(mesh) -> bool:
    """Whether the agreed-pad path serves pieces on ``mesh``: a 1-D mesh this rank is on (the
    header rides in one all_gather over it); anything else takes the metadata exchange."""
    return mesh.ndim == 1 and mesh.get_coordinate() is not None


@unseen_fn
def pieces_global_shape(local: torch.Tensor, mesh, placements, *, who: str,
                        what: str) -> torch.Size:
    """The global shape of the ranks' pieces laid out as ``placements`` (a Shard among them) for
    a piece that is not gathered: ``local_pieces_shape`` where the agreement applies, else the
    metadata exchange (``what`` names the input in its errors)."""
    if agreement_applies(mesh):
        return local_pieces_shape(local, mesh, placements[0].dim, who=who)
    return checked_global_shape(local, mesh, placements, what=what)


@unseen_fn
def local_pieces_shape(local: torch.Tensor, mesh, dim: int, *, who: str = "") -> torch.Size:
    """The global shape of the ranks' ``Shard(dim)`` pieces on the 1-D ``mesh``, for a piece
    that is not gathered: once warm, one all_gather of an 8-byte header per rank (the full
    metadata exchange, with its clear errors, when a piece does not fit the agreement)."""
    key = (who, mesh)
    agreed = _AGREED.get(key)
    if agreed is not None:
        out = _gather_fitted(local, mesh, dim, agreed, False)
        if out is not None:
            return out[0]
    return _exchanged_shape(local, mesh, dim, who, key, agreed)


def _exchanged_shape(local, mesh, dim, who, key, agreed) -> torch.Size:
    """The exact path: the metadata exchange (same ValueError on every rank when the pieces form
    no tensor), and the agreement for the next call."""
    shape = checked_global_shape(local, mesh, [Shard(dim)], what=f"{who or 'from_local'}: "
                                 "local input")
    # the pieces agree on ndim and dtype now (checked); the pad is the largest piece
    rows = -(-shape[dim] // mesh.shape[0])
    rest = tuple(shape[:dim]) + tuple(shape[dim + 1:])
    new = (dim, local.ndim, local.dtype, rows, rest)
    if agreed is not None and agreed[:3] + agreed[4:] == new[:3] + new[4:]:
        new = new[:3] + (max(rows, agreed[3]), rest)  # keep the larger pad: no shrink, re-grow
    _AGREED[key] = new
    return shape


def _gather_fitted(local, mesh, dim, agreed, carry: bool):
    """One all_gather of the agreed size: with ``carry``, (global tensor, the largest piece's
    rows); without (headers only), (global shape, that). None when some rank's piece did not
    fit the agreement or the pieces form no torch.chunk split (every rank sees the same
    headers, so every rank returns None together). The buffer's size comes from the agreement
    alone, never from this rank's piece."""
    a_dim, a_ndim, a_dtype, pad, rest = agreed
    row_bytes = a_dtype.itemsize
    for s in rest:
        row_bytes *= s
    pad = pad if carry else 0
    rows_first = local.movedim(dim, 0) if dim else local
    fits = (dim == a_dim and local.ndim == a_ndim and local.dtype == a_dtype and
            tuple(rows_first.shape[1:]) == rest and (not carry or rows_first.shape[0] <= pad))
    buf = torch.zeros(_HEADER + pad * row_bytes, dtype=torch.uint8, device=local.device)
    buf[:_HEADER].view(torch.int64)[0] = rows_first.shape[0] if fits else -1
    if fits and carry:
        data = rows_first.detach().contiguous().view(-1).view(torch.uint8)
        buf[_HEADER:_HEADER + data.numel()] = data
    n = mesh.shape[0]
    table = C.all_gather(buf, mesh, 0).view(n, -1)
    sizes = table[:, :_HEADER].contiguous().view(torch.int64).view(-1).tolist()
    if min(sizes) < 0:
        return None
    total = sum(sizes)
    if sizes != [chunk_range(total, n, k)[1] for k in range(n)]:
        return None
    if not carry:
        return torch.Size(rest[:dim] + (total,) + rest[dim:]), max(sizes)
    pieces = [table[k, _HEADER:_HEADER + s * row_bytes] for k, s in enumerate(sizes)]
    full = torch.cat(pieces).view(a_dtype).view((total,) + rest)
    return (full.movedim(0, dim) if dim else full).contiguous(), max(sizes)


def _sharded(local, mesh, dim, shape) -> DTensor:
    return DTensor.from_local(local, mesh, [Shard(dim)], shape=tuple(shape))


class _Gathered(torch.autograd.Function):
    """``sharded`` redistributed to Replicate, its data already gathered (``full``); backward
    as redistribute's."""

    @staticmethod
    @unseen_fn
    def forward(ctx, sharded, full):
        ctx.src = sharded._spec
        meta = TensorMeta(full.shape, contiguous_stride(full.shape), full.dtype)
        return DTensor(full, DTensorSpec(ctx.src.mesh, (Replicate(),), meta))

    @staticmethod
    @unseen_fn
    def backward(ctx, grad):
        grad = _as_grad_dtensor(grad, ctx.src)
        return _redistributed(grad, _redistribute_grad_target(ctx.src, grad._spec), False), None
