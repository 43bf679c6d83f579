"""Do the ranks' local pieces form one global tensor? (``from_local(run_check=True)``, and the
callers that must learn a global shape from the pieces: ``local_map``, tp's layout hooks.)

Each rank's metadata -- dims, dtype, shape, and the ``shape=`` / ``stride=`` it was given -- is
one int64 row of a *fixed* length, gathered over every mesh dim (innermost first, so the rows come
in row-major mesh-coordinate order). Fixed-length rows are the point: gloo aborts the whole
process when ranks hand it buffers of different sizes, so nothing sized by a piece may cross ranks
before the pieces are known to agree. Every rank then holds the same table and reaches the same
verdict from it, so all raise the same error (naming every rank's shape and dtype) together, and
none is left waiting in a collective.
"""
from __future__ import annotations

import torch

from . import collectives as C
from ._unseen import unseen_fn
from .spec import DTensorSpec, TensorMeta, contiguous_stride

__all__ = ["checked_global_shape"]

MAX_DIMS = 64  # torch tensors have at most 64 dims
_ROW = 5 + 3 * MAX_DIMS  # ndim, dtype code, has shape=, has stride=, spare; shape, shape=, stride=


def _padded(values) -> list[int]:
    values = [int(v) for v in values] if values is not None else []
    return values + [0] * (MAX_DIMS - len(values))


def _gather_rows(local: torch.Tensor, mesh, shape, stride) -> list[dict]:
    """Every rank's metadata, in row-major mesh-coordinate order (one all_gather per mesh dim)."""
    row = ([local.ndim, C.dtype_code(local.dtype), int(shape is not None),
            int(stride is not None), 0] + _padded(local.shape) + _padded(shape) + _padded(stride))
    device = local.device if local.device.type != "meta" else "cpu"
    table = torch.tensor([row], dtype=torch.int64, device=device)
    for i in reversed(range(mesh.ndim)):
        table = C.all_gather(table, mesh, i, gather_dim=0)
    rows = []
    for r in table.tolist():
        n = r[0]
        rows.append({
            "ndim": n, "dtype": C.dtype_from_code(r[1]),
            "shape": tuple(r[5:5 + n]),
            "given_shape": tuple(r[5 + MAX_DIMS:5 + MAX_DIMS + n]) if r[2] else None,
            "given_stride": tuple(r[5 + 2 * MAX_DIMS:5 + 2 * MAX_DIMS + n]) if r[3] else None})
    return rows


def _coordinates(mesh_shape: tuple) -> list[tuple]:
    coords = [()]
    for size in mesh_shape:
        coords = [c + (i,) for c in coords for i in range(size)]
    return coords


def _describe(rows: list[dict], ranks: list[int], limit: int = 16) -> str:
    parts = [f"rank {rank}: {row['shape']} {row['dtype']}"
             for rank, row in zip(ranks[:limit], rows[:limit])]
    if len(rows) > limit:
        parts.append(f"... ({len(rows) - limit} more)")
    return "; ".join(parts)


@unseen_fn
def checked_global_shape(local: torch.Tensor, mesh, placements, shape=None, stride=None,
                         *, what: str = "from_local(run_check=True)") -> torch.Size:
    """The global shape the ranks' ``local`` pieces form under ``placements`` (torch.chunk
    pieces); raises ValueError on every rank if they do not form one (dims, dtypes, sizes), or
    if the ranks were given different ``shape=`` / ``stride=`` or ones the pieces contradict."""
    rows = _gather_rows(local, mesh, shape, stride)
    coords = _coordinates(tuple(mesh.shape))
    ranks = mesh.mesh.flatten().tolist()
    where = f"under placements {list(placements)} on mesh {tuple(mesh.shape)}"

    def fail(problem: str, advice: str):
        raise ValueError(f"{what}: {problem} {where} ({_describe(rows, ranks)}); {advice}")

    if len({r["dtype"] for r in rows}) > 1:
        fail("the local pieces have different dtypes", "every rank must pass the same dtype")
    if len({r["ndim"] for r in rows}) > 1:
        fail("the local pieces have different numbers of dims",
             "every rank must pass a piece of the same global tensor")
    for key, arg in (("given_shape", "shape="), ("given_stride", "stride=")):
        if len({r[key] for r in rows}) > 1:
            fail(f"the ranks passed different {arg} "
                 f"({', '.join(f'rank {k}: {r[key]}' for k, r in zip(ranks, rows))})",
                 f"pass the same {arg} on every rank")
    # each dim's global size: the pieces along the mesh dims that split it (others at coordinate 0)
    ndim = rows[0]["ndim"]
    splitters = [[i for i, p in enumerate(placements) if p.is_shard() and p.dim == d]
                 for d in range(ndim)]
    derived = []
    for d in range(ndim):
        along = [k for k, c in enumerate(coords)
                 if all(c[i] == 0 for i in range(len(c)) if i not in splitters[d])]
        derived.append(sum(rows[k]["shape"][d] for k in along) if splitters[d]
                       else rows[0]["shape"][d])
    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(
        torch.Size(derived), contiguous_stride(derived), local.dtype))
    bad = [k for k, c in enumerate(coords)
           if tuple(spec.local_shape_and_offset(c)[0]) != rows[k]["shape"]]
    if bad:
        want = "; ".join(f"rank {ranks[k]} should hold "
                         f"{tuple(spec.local_shape_and_offset(coords[k])[0])}" for k in bad[:8])
        fail(f"the local pieces do not form one global tensor (they add up to {tuple(derived)}, "
             f"in which {want})",
             "shards must be torch.chunk pieces of one global tensor and agree on the dims they "
             "do not split")
    given = rows[0]["given_shape"]
    if given is not None and given != tuple(derived):
        fail(f"shape={given} but the ranks' pieces add up to {tuple(derived)}",
             "pass the global shape the pieces form, or leave shape= out")
    return torch.Size(derived)
