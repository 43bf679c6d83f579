"""Creating DTensors: distribute_tensor, distribute_module and the factory functions."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn

from . import collectives as C
from .device_mesh import DeviceMesh
from .placements import _StridedShard
from .dtensor import DTensor, given_or_current_mesh
from .spec import DTensorSpec, TensorMeta, contiguous_stride, local_piece, normalize_placements

__all__ = ["distribute_tensor", "distribute_module", "zeros", "ones", "empty", "full", "rand",
           "randn", "linspace", "logspace"]


def partialize(local: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """Turn a replicated piece into the piece of the same *global* value under spec's Partials:
    for sum, only coordinate 0 of the mesh dim keeps the value (avg/max/min: everyone does)."""
    coord = spec.mesh.get_coordinate()
    if coord is None:  # outside the mesh: an empty piece stays one
        return local
    for i, p in enumerate(spec.placements):
        if p.is_partial("sum") and coord[i] != 0:
            return torch.zeros_like(local)
    return local


def distribute_tensor(tensor: torch.Tensor, device_mesh: DeviceMesh | None = None,
                      placements=None, *, src_data_rank: int | None = 0) -> DTensor:
    """Split a global ``tensor`` over ``device_mesh`` by ``placements``.

    With ``src_data_rank`` (default 0) the values of the rank at mesh coordinate
    ``(src_data_rank, ..., src_data_rank)`` are scattered to every rank (one scatter of padded
    pieces); as in PyTorch it is a rank within each mesh dim, so 0 is the first rank of the mesh
    (global rank 0 on a full mesh). With ``None`` each rank slices its own copy, with no
    communication.
    The result is a leaf that requires grad if ``tensor`` does.

    Example::

        >>> mesh = init_device_mesh("cpu", (2, 2))
        >>> w = distribute_tensor(torch.randn(8, 6), mesh, [Shard(0), Shard(1)])
        >>> w.to_local().shape                  # torch.Size([4, 3])
    """
    if isinstance(tensor, DTensor):
        raise ValueError("distribute_tensor got a DTensor; use .redistribute(mesh, placements) "
                         "to change its placements")
    mesh = given_or_current_mesh(device_mesh, tensor)
    placements = normalize_placements(placements, mesh, tensor.ndim)
    if tensor.device.type != mesh.device_type and tensor.device.type != "meta":
        tensor = tensor.to(mesh.device_type)
    spec = DTensorSpec(mesh, placements, TensorMeta(tensor.shape, contiguous_stride(tensor.shape),
                                                    tensor.dtype))
    data = tensor.detach()
    if mesh.get_coordinate() is None:  # outside the mesh: nothing to hold, no one to talk to
        local = local_piece(data, spec)
    elif src_data_rank is None or tensor.device.type == "meta" or mesh.size() == 1:
        local = local_piece(data, spec).contiguous().clone()
    else:
        local = _scatter_pieces(data, spec, src_data_rank)
    local = partialize(local, spec)
    return DTensor(local.requires_grad_(False), spec, requires_grad=tensor.requires_grad)


def _scatter_pieces(data: torch.Tensor, spec: DTensorSpec, src_rank: int) -> torch.Tensor:
    mesh = spec.mesh
    if mesh.ndim > 1 and mesh.root_layout.numel() != mesh._world_size:
        return _broadcast_then_slice(data, spec, src_rank)
    flat = mesh.flat_view()
    ranks = flat.mesh.tolist()
    # As in PyTorch, src_data_rank is a rank *within* each mesh dim (group rank), not a global
    # rank: the source is the rank at coordinate (s, ..., s). So the default 0 works on any
    # sub-mesh (e.g. mesh["tp"] on the ranks {2, 3}), and means global rank 0 on a full mesh.
    if isinstance(src_rank, bool) or not isinstance(src_rank, int) or \
            not all(0 <= src_rank < n for n in mesh.shape):
        raise ValueError(f"src_data_rank={src_rank!r} must be None or a rank within each dim of "
                         f"{mesh} (0 <= src_data_rank < {min(mesh.shape)})")
    src_global = int(mesh.mesh[(src_rank,) * mesh.ndim])
    src_coord = ranks.index(src_global)
    coords = [tuple(int(c) for c in (mesh.mesh == r).nonzero()[0]) for r in ranks]
    sizes = [math.prod(spec.local_shape_and_offset(c)[0]) for c in coords]
    chunk = max(sizes)
    chunks = None
    if flat.get_rank() == src_global:
        chunks = []
        for c, size in zip(coords, sizes):
            piece = local_piece(data, spec, c).reshape(-1)
            chunks.append(torch.cat([piece, piece.new_zeros(chunk - size)]) if size < chunk else piece)
    out = data.new_empty(chunk)
    C.scatter(chunks, out, flat, 0, src_coord)
    my_shape = spec.local_shape()
    return out[: math.prod(my_shape)].reshape(my_shape)


def _broadcast_then_slice(data: torch.Tensor, spec: DTensorSpec, src_rank: int) -> torch.Tensor:
    """src_data_rank's values on an N-D mesh over part of the world: a 1-D view of all its
    ranks would need a new group, which only every rank of the world can make (the ranks outside
    do not call distribute_tensor). So the source's tensor is broadcast along each mesh dim in
    turn (coordinate ``src_rank`` first) and each rank keeps its piece: whole-tensor traffic,
    paid only on such meshes."""
    mesh = spec.mesh
    if isinstance(src_rank, bool) or not isinstance(src_rank, int) or \
            not all(0 <= src_rank < n for n in mesh.shape):
        raise ValueError(f"src_data_rank={src_rank!r} must be None or a rank within each dim of "
                         f"{mesh} (0 <= src_data_rank < {min(mesh.shape)})")
    coord = mesh.get_coordinate()
    buf = data.contiguous().clone()
    for i in range(mesh.ndim):
        # the ranks that hold the source's values so far: coordinate src_rank on dims >= i
        if all(c == src_rank for c in coord[i + 1:]):
            C.broadcast(buf, mesh, i, src_rank)
    return local_piece(buf, spec).contiguous().clone()


def distribute_module(module: nn.Module, device_mesh: DeviceMesh | None = None,
                      partition_fn: Callable | None = None, input_fn: Callable | None = None,
                      output_fn: Callable | None = None) -> nn.Module:
    """Turn a module's parameters and buffers into DTensors and hook its inputs/outputs.

    ``partition_fn(name, submodule, mesh)`` distributes each submodule's parameters as it likes;
    whatever it leaves as a plain tensor is replicated. ``input_fn(module, inputs, mesh)`` and
    ``output_fn(module, outputs, mesh)`` run before / after forward (e.g. to shard inputs);
    torch's older two-argument ``input_fn(inputs, mesh)`` / ``output_fn(outputs, mesh)`` work
    too, with torch's ``FutureWarning``. Without ``device_mesh``: the ``with mesh:`` block's.

    Example::

        >>> def shard_linear(name, mod, mesh):
        ...     if isinstance(mod, nn.Linear):
        ...         mod.weight = nn.Parameter(distribute_tensor(mod.weight, mesh, [Shard(0)]))
        >>> distribute_module(model, mesh, shard_linear)
    """
    mesh = given_or_current_mesh(device_mesh, next(iter(module.parameters()), torch.empty(0)))
    if getattr(module, "_dtensor_lite_distributed", False):
        raise RuntimeError(f"distribute_module was already applied to {type(module).__name__}; "
                           "apply it once per module")
    for name, sub in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, sub, mesh)
        _replicate_leftovers(sub, mesh)
    if input_fn is not None:
        fn = _with_module_arg(input_fn, "input_fn", "inputs")
        module.register_forward_pre_hook(lambda mod, inputs: fn(mod, inputs, mesh))
    if output_fn is not None:
        fn_out = _with_module_arg(output_fn, "output_fn", "outputs")
        module.register_forward_hook(lambda mod, inputs, outputs: fn_out(mod, outputs, mesh))
    module._dtensor_lite_distributed = True
    return module


def _with_module_arg(fn: Callable, name: str, what: str) -> Callable:
    """distribute_module's ``fn(module, {what}, mesh)``; torch's older ``fn({what}, mesh)`` is
    still accepted with its FutureWarning; other arities raise ValueError (as torch's)."""
    import inspect
    import warnings
    n = len(inspect.signature(fn).parameters)
    if n == 3:
        return fn
    if n == 2:
        warnings.warn(f"Deprecating {name} that takes two arguments ({what}, device_mesh), please "
                      f"use {name} that takes in (module, {what}, device_mesh) instead!",
                      FutureWarning, stacklevel=3)
        return lambda mod, value, mesh: fn(value, mesh)
    raise ValueError(f"distribute_module: {name} should take in 3 arguments (module, {what}, "
                     f"device_mesh), but got {n} arguments!")


def _replicate_leftovers(sub: nn.Module, mesh: DeviceMesh):
    replicate = normalize_placements(None, mesh, None)
    for key, param in list(sub._parameters.items()):
        if param is not None and not isinstance(param, DTensor):
            sub.register_parameter(key, nn.Parameter(
                distribute_tensor(param.data, mesh, replicate), requires_grad=param.requires_grad))
    for key, buf in list(sub._buffers.items()):
        if buf is not None and not isinstance(buf, DTensor):
            sub._buffers[key] = distribute_tensor(buf, mesh, replicate)


# ----------------------------------------------------------------------------- factories
def _factory(fill: Callable, size, *, dtype, layout, requires_grad, device_mesh, placements,
             global_values: bool = False) -> DTensor:
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = tuple(size[0])
    shape = torch.Size(size)
    dtype = dtype or torch.get_default_dtype()
    mesh = given_or_current_mesh(device_mesh, torch.empty(0))
    placements = normalize_placements(placements, mesh, len(shape))
    spec = DTensorSpec(mesh, placements, TensorMeta(shape, contiguous_stride(shape), dtype))
    device = torch.device(mesh.device_type, torch.cuda.current_device()) \
        if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    if mesh.get_coordinate() is None:  # outside the mesh: an empty piece, no rng draw
        from .spec import outside_shape
        local = torch.zeros(outside_shape(len(shape)), dtype=dtype, device=device)
    elif global_values:
        # random values must not depend on the mesh: draw the global tensor, keep this piece
        # (every rank's generator must be in the same state where ranks hold the same values:
        # see set_rng_sync_mode)
        from .random import ensure_rng_synced
        ensure_rng_synced(mesh, placements=placements)
        local = local_piece(fill(shape, dtype=dtype, device=device), spec).contiguous().clone()
    else:
        local = fill(spec.local_shape(), dtype=dtype, device=device)
    local = partialize(local, spec)
    return DTensor(local, spec, requires_grad=requires_grad)


def _make(fill, global_values=False, doc=""):
    def factory(*size, requires_grad: bool = False, dtype: torch.dtype | None = None,
                layout: torch.layout = torch.strided, device_mesh: DeviceMesh | None = None,
                placements=None) -> DTensor:
        return _factory(fill, size, dtype=dtype, layout=layout, requires_grad=requires_grad,
                        device_mesh=device_mesh, placements=placements,
                        global_values=global_values)
    factory.__doc__ = doc
    return factory


zeros = _make(lambda s, **kw: torch.zeros(s, **kw),
              doc="A DTensor of zeros. ``zeros(4, 8, device_mesh=mesh, placements=[Shard(0)])``")
ones = _make(lambda s, **kw: torch.ones(s, **kw),
             doc="A DTensor of ones. ``ones(4, 8, device_mesh=mesh, placements=[Shard(0)])``")
empty = _make(lambda s, **kw: torch.empty(s, **kw),
              doc="An uninitialised DTensor. ``empty(4, 8, device_mesh=mesh)``")
rand = _make(lambda s, **kw: torch.rand(s, **kw), global_values=True,
             doc="Uniform [0, 1) values equal to ``torch.rand`` of the global shape with the same "
                 "seed on every rank (drawn globally, then sliced). ``rand(4, 8, device_mesh=mesh)``")
randn = _make(lambda s, **kw: torch.randn(s, **kw), global_values=True,
              doc="Normal values equal to ``torch.randn`` of the global shape with the same seed "
                  "(drawn globally, then sliced). ``randn(4, 8, device_mesh=mesh)``")


def full(size, fill_value, *, requires_grad: bool = False, dtype: torch.dtype | None = None,
         layout: torch.layout = torch.strided, device_mesh: DeviceMesh | None = None,
         placements=None) -> DTensor:
    """A DTensor filled with ``fill_value``. ``full((4, 8), 3.0, device_mesh=mesh)``"""
    if dtype is None and isinstance(fill_value, bool):
        dtype = torch.bool
    elif dtype is None and isinstance(fill_value, int):
        dtype = torch.int64
    return _factory(lambda s, **kw: torch.full(s, fill_value, **kw), (size,), dtype=dtype,
                    layout=layout, requires_grad=requires_grad, device_mesh=device_mesh,
                    placements=placements)


def _endpoint(value, fn: str, name: str):
    """A linspace / logspace endpoint: a number, or a 0-d tensor (a DTensor's global value)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"{fn}: {name} must be a number or a 0-dimensional tensor, got a "
                             f"tensor of shape {tuple(value.shape)}")
        if isinstance(value, DTensor):
            value = value.full_tensor()
        return value.item()
    return value


def _spaced(fn: str, make: Callable, start, end, steps, *, dtype, layout, requires_grad,
            device_mesh, placements) -> DTensor:
    if layout != torch.strided:
        raise ValueError(f"{fn}: only layout=torch.strided is supported, got {layout}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"{fn}: steps must be a non-negative int, got {steps!r}")
    start, end = _endpoint(start, fn, "start"), _endpoint(end, fn, "end")
    mesh = given_or_current_mesh(device_mesh, torch.empty(0))
    placements = normalize_placements(placements, mesh, 1)
    if any(type(p) is _StridedShard for p in placements):
        raise ValueError(f"{fn}: _StridedShard placements {list(placements)} are not supported "
                         "(as in torch); use Shard(0) or Replicate()")
    device = torch.device(mesh.device_type, torch.cuda.current_device()) \
        if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    # on the mesh's device: its kernel's values are the ones torch.linspace gives there. The
    # dtype follows torch's rule (the default dtype, or its complex counterpart for complex ends)
    global_values = make(start, end, steps, dtype=dtype, device=device)
    shape = global_values.shape
    spec = DTensorSpec(mesh, placements, TensorMeta(shape, contiguous_stride(shape),
                                                    global_values.dtype))
    if mesh.get_coordinate() is None:  # outside the mesh: an empty piece
        from .spec import outside_shape
        local = torch.zeros(outside_shape(1), dtype=global_values.dtype, device=device)
    else:
        # Every rank computes the whole 1-D sequence and keeps its piece: the values are then
        # bit-identical to torch's own (its kernels round differently by position -- from the
        # start below the midpoint, from the end above it, vectorised in blocks), which a
        # per-piece torch.linspace over the piece's sub-range would not be. Costs O(steps)
        # memory for a moment, as rand/randn here do.
        local = local_piece(global_values, spec).contiguous().clone()
        local = partialize(local, spec)
    return DTensor(local, spec, requires_grad=requires_grad)


def linspace(start, end, steps, *, dtype: torch.dtype | None = None,
             layout: torch.layout = torch.strided, requires_grad: bool = False,
             device_mesh: DeviceMesh | None = None, placements=None) -> DTensor:
    """A 1-D DTensor of ``steps`` values evenly spaced from ``start`` to ``end``: globally the
    same values (bit for bit) as ``torch.linspace(start, end, steps, dtype=dtype)``, laid out by
    ``placements`` (``Shard(0)`` pieces follow ``torch.chunk``: uneven and empty pieces are
    exact). ``start`` / ``end``: numbers or 0-d tensors. Without ``device_mesh``: the ``with
    mesh:`` block's; without ``placements``: replicated.

    Example::

        >>> x = linspace(0.0, 1.0, 5, device_mesh=mesh, placements=[Shard(0)])  # 2 ranks
        >>> x.to_local()          # rank 0: tensor([0.00, 0.25, 0.50]); rank 1: [0.75, 1.00]
    """
    return _spaced("linspace", lambda s, e, n, **kw: torch.linspace(s, e, n, **kw),
                   start, end, steps, dtype=dtype, layout=layout, requires_grad=requires_grad,
                   device_mesh=device_mesh, placements=placements)


def logspace(start, end, steps, base: float = 10.0, *, dtype: torch.dtype | None = None,
             layout: torch.layout = torch.strided, requires_grad: bool = False,
             device_mesh: DeviceMesh | None = None, placements=None) -> DTensor:
    """A 1-D DTensor of ``steps`` values ``base ** x`` for ``x`` evenly spaced from ``start``
    to ``end``: globally the same values as ``torch.logspace(start, end, steps, base,
    dtype=dtype)``, laid out by ``placements`` (as :func:`linspace`).

    Example::

        >>> x = logspace(0, 3, 4, device_mesh=mesh, placements=[Shard(0)])  # 2 ranks
        >>> x.full_tensor()       # tensor([1., 10., 100., 1000.])
    """
    return _spaced("logspace",
                   lambda s, e, n, **kw: torch.logspace(s, e, n, base, **kw),
                   start, end, steps, dtype=dtype, layout=layout, requires_grad=requires_grad,
                   device_mesh=device_mesh, placements=placements)
