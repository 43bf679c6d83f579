"""Communication primitives for hand-written strategies: ring shifts, point-to-point pairs, the
uneven all-to-all, and where each rank's shard lies in the global tensor.

They work on *local* tensors -- inside ``local_map``, a custom op's local function, or on
``dt.to_local()`` -- and are differentiable: the backward of a shift is the opposite shift, of a
send the matching receive, of an all-to-all the reverse all-to-all with the splits swapped.
Their bytes go through :mod:`dtensor_lite.collectives`, so ``CommDebugMode`` counts them (kinds
``ring_shift``, ``send_recv``, ``all_to_all``).

``async_op=True`` returns a ``Pending``: issue the next block's transfer, compute on the current
one, then ``wait()`` for the received tensor (already joined to the autograd graph)::

    >>> nxt = ring_shift(kv, mesh, "cp", async_op=True)   # kv travels to coordinate + 1
    >>> out = attend(q, kv)                               # overlaps with the transfer
    >>> kv = nxt.wait()                                   # coordinate - 1's block
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import collectives
from .device_mesh import DeviceMesh
from .dtensor import DTensor
from .placements import as_placement
from .spec import DTensorSpec, TensorMeta, contiguous_stride

__all__ = ["ring_shift", "send_recv", "all_to_all_single", "compute_local_shape_and_global_offset"]


def ring_shift(tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int | str, shift: int = 1, *,
               recv_shape: Sequence[int] | None = None, async_op: bool = False):
    """Every rank sends ``tensor`` to mesh coordinate ``c + shift`` and receives the tensor of
    coordinate ``c - shift`` (mod the mesh dim's size) along ``mesh_dim``. ``recv_shape``: the
    incoming tensor's shape where ranks hold different shapes (uneven shards; see
    :func:`compute_local_shape_and_global_offset`). Backward: the gradient shifts by ``-shift``.

    Example::

        >>> right = ring_shift(x, mesh, 0)     # on coordinate c: coordinate c-1's x
    """
    dim = _check(tensor, mesh, mesh_dim, "ring_shift")
    if not isinstance(shift, int):
        raise TypeError(f"ring_shift: shift must be an int, got {shift!r}")
    n, me = mesh.size(dim), mesh.get_local_rank(dim)
    return _exchange(tensor, mesh, dim, (me + shift) % n, (me - shift) % n, recv_shape, None,
                     async_op, "ring_shift")


def send_recv(tensor: torch.Tensor | None, mesh: DeviceMesh, mesh_dim: int | str,
              dst: int | None = None, src: int | None = None, *,
              recv_shape: Sequence[int] | None = None, recv_dtype: torch.dtype | None = None,
              requires_grad: bool = False, async_op: bool = False):
    """A point-to-point exchange along ``mesh_dim``: send ``tensor`` to coordinate ``dst`` and/or
    receive from coordinate ``src`` (``recv_shape`` / ``recv_dtype`` default to ``tensor``'s).
    Each rank names its own peers, so one call expresses a pair (the sender passes ``dst``, the
    receiver ``src``) or any permutation. Returns the received tensor.

    Autograd: the received tensor's gradient goes back to ``src`` (a rank that only receives asks
    for that with ``requires_grad=True``; a rank that also sends follows ``tensor``). A rank that
    only sends gets an empty tensor joined to the graph in its place: backward through it
    (``handle.sum()`` added to the loss, or ``handle.sum().backward()``) receives the gradient of
    ``tensor`` from ``dst``. Both ends must run that backward, or the other one waits.

    Example (a two-stage pipeline, coordinate 0 -> 1)::

        >>> if me == 0:
        ...     handle = send_recv(stage0(x), mesh, 0, dst=1)
        ...     handle.sum().backward()               # gradient arrives from coordinate 1
        ... else:
        ...     h = send_recv(None, mesh, 0, src=0, recv_shape=(B, H), recv_dtype=torch.float32,
        ...                   requires_grad=True)
        ...     stage1(h).sum().backward()            # h's gradient is sent to coordinate 0
    """
    dim = _check(tensor, mesh, mesh_dim, "send_recv")
    n = mesh.size(dim)
    for name, peer in (("dst", dst), ("src", src)):
        if peer is not None and not (isinstance(peer, int) and 0 <= peer < n):
            raise ValueError(f"send_recv: {name}={peer!r} is not a coordinate of mesh dim "
                             f"{mesh_dim} (size {n}); give 0..{n - 1} or None")
    if dst is not None and tensor is None:
        raise ValueError(f"send_recv: dst={dst} but no tensor to send")
    if src is not None and tensor is None and (recv_shape is None or recv_dtype is None):
        raise ValueError("send_recv: a rank that only receives must give recv_shape and recv_dtype")
    if dst is None and src is None:
        raise ValueError("send_recv: give dst, src or both")
    if tensor is None and requires_grad and torch.is_grad_enabled():
        tensor = torch.empty(0, requires_grad=True)  # an anchor: the graph starts here
        return _exchange(tensor, mesh, dim, None, src, recv_shape, recv_dtype, async_op,
                         "send_recv", send=False)
    return _exchange(tensor, mesh, dim, dst, src, recv_shape, recv_dtype, async_op, "send_recv")


def all_to_all_single(tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int | str,
                      output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, *, async_op: bool = False):
    """torch's ``all_to_all_single`` along ``mesh_dim``, uneven splits included: the first
    ``input_split_sizes[0]`` rows of ``tensor`` go to coordinate 0, the next to coordinate 1, ...;
    the result concatenates ``output_split_sizes[k]`` rows from each coordinate k in mesh order.
    Nothing is padded. Backward: the reverse all-to-all (splits swapped).

    Example (dispatching tokens to the rank of their expert)::

        >>> counts = all_to_all_single(send_counts, mesh, "ep")          # how many come back
        >>> got = all_to_all_single(tokens, mesh, "ep", counts.tolist(), send_counts.tolist())
    """
    dim = _check(tensor, mesh, mesh_dim, "all_to_all_single")
    out_splits = None if output_split_sizes is None else [int(s) for s in output_split_sizes]
    in_splits = None if input_split_sizes is None else [int(s) for s in input_split_sizes]
    pending = collectives.all_to_all_single(tensor.detach(), mesh, dim, out_splits, in_splits,
                                            async_op=True)
    if _tracks_grad(tensor):
        n = mesh.size(dim)
        back_out = in_splits or [tensor.shape[0] // n] * n
        back_in = out_splits or [tensor.shape[0] // n] * n
        pending.then(lambda got: _attach(_AllToAllSingle, tensor, got, mesh, dim, back_out,
                                         back_in))
    return pending if async_op else pending.wait()


def compute_local_shape_and_global_offset(global_shape: Sequence[int], mesh: DeviceMesh,
                                          placements, coordinate: Sequence[int] | None = None):
    """(local shape, global offset) of the piece that the rank at mesh ``coordinate`` (default:
    this rank) holds of a tensor of ``global_shape`` placed by ``placements`` -- from metadata
    only, ``torch.chunk`` layout (uneven and empty pieces included), several mesh dims sharding
    one tensor dim nested in mesh order (``_StridedShard`` for other orders).

    Example::

        >>> compute_local_shape_and_global_offset((13, 8), mesh, [Shard(0)], coordinate=[3])
        ((1, 8), (12, 0))                      # torch.chunk(13 rows, 4): 4, 4, 4, 1
    """
    shape = torch.Size(global_shape)
    meta = TensorMeta(shape, contiguous_stride(shape), torch.float32)
    spec = DTensorSpec(mesh, tuple(as_placement(p, "placements entries") for p in placements),
                       meta)
    if coordinate is not None:
        coordinate = list(coordinate)
        if len(coordinate) != mesh.ndim or any(not 0 <= c < s for c, s in
                                               zip(coordinate, mesh.shape)):
            raise ValueError(f"coordinate {coordinate} is not a coordinate of the mesh of shape "
                             f"{mesh.shape}; give one index per mesh dim")
    return spec.local_shape_and_offset(coordinate)


# ----------------------------------------------------------------------------- autograd
def _check(tensor, mesh, mesh_dim, what: str) -> int:
    if isinstance(tensor, DTensor):
        raise TypeError(f"{what} moves local tensors; got a DTensor placed "
                        f"{list(tensor.placements)}: call it inside local_map, or on "
                        "dt.to_local()")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what}: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    return mesh._dim_index(mesh_dim)


def _tracks_grad(tensor) -> bool:
    return tensor is not None and tensor.requires_grad and torch.is_grad_enabled()


class _Box:
    """Hands a tensor to an autograd Function without making it an input of the graph."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _attach(fn, tensor, received, *args):
    """``received`` joined to the graph as ``fn`` of ``tensor`` (at wait: grad mode may differ)."""
    with torch.enable_grad():
        return fn.apply(tensor, _Box(received), *args)


def _exchange(tensor, mesh, dim, dst, src, recv_shape, recv_dtype, async_op, kind, send=True):
    sent = tensor.detach() if tensor is not None and send else None
    pending = collectives.send_recv(sent, mesh, dim, dst, src, recv_shape, recv_dtype,
                                    async_op=True, kind=kind)
    if _tracks_grad(tensor):
        pending.then(lambda got: _attach(_Exchange, tensor, got, mesh, dim, dst, src, kind))
    return pending if async_op else pending.wait()


class _Exchange(torch.autograd.Function):
    """The received tensor as a function of the sent one; backward runs the exchange reversed."""

    @staticmethod
    def forward(ctx, tensor, box, mesh, dim, dst, src, kind):
        ctx.args = (mesh, dim, dst, src, kind, tensor.shape, tensor.dtype)
        # a send-only rank: an empty stand-in whose backward fetches tensor's gradient
        return box.value if box.value is not None else tensor.new_empty(0)

    @staticmethod
    def backward(ctx, grad):
        mesh, dim, dst, src, kind, shape, dtype = ctx.args
        back = grad.contiguous() if src is not None else None
        got = collectives.send_recv(back, mesh, dim, src, dst, shape, dtype, kind=kind)
        # None on a rank that only received (its input was an anchor, not a sent tensor)
        return got, None, None, None, None, None, None


class _AllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, box, mesh, dim, back_out, back_in):
        ctx.args = (mesh, dim, back_out, back_in)
        return box.value

    @staticmethod
    def backward(ctx, grad):
        mesh, dim, back_out, back_in = ctx.args
        got = collectives.all_to_all_single(grad.contiguous(), mesh, dim, back_out, back_in)
        return got, None, None, None, None, None
