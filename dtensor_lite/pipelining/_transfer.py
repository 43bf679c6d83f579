"""What crosses a stage boundary, and how: tensor metadata agreed once, pieces moved by tag.

A stage's output is a tensor or a tuple of tensors. Each travels as its *local piece*: a plain
tensor as itself, a DTensor as ``to_local()``. A DTensor must live on a sub-mesh of the pipeline's
mesh that leaves out the pp dim (``mesh["dp_shard", "tp"]``): the piece goes to the rank at the
same coordinate of the next stage's sub-mesh (its neighbour along pp), which wraps it again with
the same placements, global shape and stride on *its* sub-mesh of those dims -- no gather, no
reshuffle. Gradients come back the same way.

The metadata (local shape, dtype, whether it needs a gradient, and for a DTensor its mesh dims,
placements, global shape and stride) is sent once, with the first micro-batch of the first step;
later micro-batches send only bytes and are checked against it on the sending rank.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch

from .. import collectives
from ..dtensor import DTensor

__all__ = ["TensorMeta", "meta_of", "local_piece", "rebuild", "send_object", "recv_object",
           "message_tag"]


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple                  # the local piece's shape: what travels
    dtype: torch.dtype
    requires_grad: bool
    mesh_dims: tuple | None = None   # a DTensor's: names of its mesh's dims
    placements: tuple | None = None
    global_shape: tuple | None = None
    global_stride: tuple | None = None

    def __str__(self):
        if self.mesh_dims is None:
            return f"tensor{list(self.shape)} {self.dtype}"
        return (f"DTensor{list(self.global_shape)} {self.dtype} on mesh dims {self.mesh_dims} "
                f"{list(self.placements)} (local {list(self.shape)})")


def meta_of(t: torch.Tensor, pp_mesh, what: str, get_mesh=None) -> TensorMeta:
    """What the neighbour needs to rebuild ``t``. A DTensor travels as its mesh's dim names: a
    named slice of the pipeline's own mesh, or (with torch 2.15's ``get_mesh`` callback, for a
    stage built on a ProcessGroup as torchtitan does) any mesh with dim names the callback
    resolves on the receiving side."""
    if not isinstance(t, DTensor):
        return TensorMeta(tuple(t.shape), t.dtype, t.requires_grad)
    mesh = t.device_mesh
    names = mesh.mesh_dim_names
    in_pp_root = getattr(mesh, "_root", None) is pp_mesh._root
    if names is None or (not in_pp_root and get_mesh is None):
        raise ValueError(f"pipelining: {what} is a DTensor on {mesh!r}, which is not a named "
                         f"slice of the pipeline's mesh {pp_mesh._root!r}; build the stage "
                         "with group=mesh['pp'] and its DTensors on mesh['dp_shard', 'tp'] "
                         "(or other dims of that mesh), or pass get_mesh= (torch's callback "
                         "from mesh dim names to the mesh)")
    pp_dims = set(pp_mesh.root_dims[0])
    if in_pp_root and any(pp_dims & set(dims) for dims in mesh.root_dims):
        raise ValueError(f"pipelining: {what} is a DTensor on mesh dims {names}, which include "
                         "the pipeline's own dim; a stage's DTensors live on its stage's "
                         "sub-mesh (the other dims)")
    return TensorMeta(tuple(t._local_tensor.shape), t.dtype, t.requires_grad, tuple(names),
                      tuple(t.placements), tuple(t.shape), tuple(t.stride()))


def local_piece(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def rebuild(piece: torch.Tensor, meta: TensorMeta, pp_mesh, get_mesh=None) -> torch.Tensor:
    """The received ``piece`` as what the sender had: a plain tensor, or a DTensor on this
    rank's mesh of the same dim names (``get_mesh(names, None)`` where the stage was given
    torch's callback, else the slice of the pipeline's own mesh)."""
    if meta.mesh_dims is None:
        return piece
    if get_mesh is not None:
        mesh = get_mesh(meta.mesh_dims, None)
        if mesh is None:
            raise ValueError(f"pipelining: get_mesh{(meta.mesh_dims, None)} returned None; it "
                             "must return this rank's mesh of those dim names")
    else:
        mesh = pp_mesh._root[meta.mesh_dims]
    return DTensor.from_local(piece, mesh, meta.placements, run_check=False,
                              shape=meta.global_shape, stride=meta.global_stride)


# message kinds in the tag: each (kind, stage, micro-batch, tensor index) has its own tag, so a
# receive names its message whatever order two ranks post theirs in
ACTIVATION, GRADIENT, META_SIZE, META_BYTES = range(4)
_MAX_TENSORS = 64


def message_tag(kind: int, stage: int, mb: int, index: int, num_stages: int) -> int:
    if index >= _MAX_TENSORS:
        raise ValueError(f"pipelining: a stage passes at most {_MAX_TENSORS} tensors to the next")
    return ((mb * num_stages + stage) * 4 + kind) * _MAX_TENSORS + index


def send_object(obj, pp_mesh, dst: int, tag_size: int, tag_bytes: int, device) -> list:
    """Send a picklable ``obj`` (its size, then its bytes); returns the pending sends."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    return [collectives.send(size, pp_mesh, 0, dst, tag=tag_size, async_op=True, kind="pp_meta"),
            collectives.send(data, pp_mesh, 0, dst, tag=tag_bytes, async_op=True, kind="pp_meta")]


def recv_object(pp_mesh, src: int, tag_size: int, tag_bytes: int, device):
    size = collectives.recv((1,), torch.int64, pp_mesh, 0, src, device=device, tag=tag_size,
                            kind="pp_meta")
    data = collectives.recv((int(size.item()),), torch.uint8, pp_mesh, 0, src, device=device,
                            tag=tag_bytes, kind="pp_meta")
    return pickle.loads(data.cpu().numpy().tobytes())
