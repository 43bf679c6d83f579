"""DTensor: a torch.Tensor wrapper subclass holding this rank's piece of a global tensor.

The wrapper carries the *global* shape, stride, dtype and requires_grad, so autograd and ordinary
PyTorch code see the global tensor; ``__torch_dispatch__`` runs every aten op on the local pieces
(see ``_dispatch``, which installs itself with ``use_dispatcher``). The conversions between global and local views -- ``from_local``,
``to_local``, ``redistribute`` and ``full_tensor`` -- are autograd Functions whose backward is the
transpose of the forward (the gradient of Shard->Replicate comes back as Partial->Shard).
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .device_mesh import DeviceMesh, _rebuild_mesh
from .placements import Partial, Placement, Replicate, Shard, _StridedShard
from .redistribute import redistribute_local, redistribute_target
from .redistribute.planner import _PLANS
from .spec import (DTensorSpec, TensorMeta, contiguous_stride, normalize_placements,
                   outside_shape)
from . import _caches, _dcp, _unchecked, debug_state
from .compile_support import boundary, register_constants
from ._torch_names import disabled_torch_function_impl, make_wrapper_subclass
from ._unseen import unseen_fn

__all__ = ["DTensor"]


class DTensor(torch.Tensor):
    """A distributed tensor: global metadata on the wrapper, this rank's piece inside.

    Example::

        >>> mesh = init_device_mesh("cpu", (4,))
        >>> x = distribute_tensor(torch.arange(10.), mesh, [Shard(0)])
        >>> x.to_local()          # rank 3 holds the last chunk: tensor([9.])
        >>> (x * 2).full_tensor() # tensor([0., 2., ..., 18.]) on every rank
    """

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    # _pending: a collective still in flight (redistribute(async_op=True)); _local_tensor stays
    # unset until first use, when __getattr__ waits for it
    # _lent: a weakref to the local piece that to_local() last handed out as itself (under
    # no_grad); unset until then. Read only by _aliasing.piece_lent.
    __slots__ = ("_local_tensor", "_spec", "_pending", "_lent")

    # Every decision is made in __torch_dispatch__; ``_fast_path`` replaces this with a shortcut
    # that replays already-decided calls needing nothing from autograd (use_torch_function).
    __torch_function__ = disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False):
        meta = spec.tensor_meta
        # positional: (cls, size, strides, storage_offset, memory_format, dtype, layout, device,
        # pin_memory, requires_grad) -- the keyword form parses 0.5 us slower per wrapper
        r = make_wrapper_subclass(cls, meta.shape, meta.stride, None, None, meta.dtype,
                                  local_tensor.layout, local_tensor.device, False, requires_grad)
        r._local_tensor = local_tensor
        r._spec = spec
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if _unchecked.MARKED:  # results of pieces no rank compared are such pieces too
            return _unchecked.propagate(args, kwargs, _dispatch_op(func, args, kwargs))
        return _dispatch_op(func, args, kwargs)

    @staticmethod
    def _from_pending(pending, spec: DTensorSpec, like: torch.Tensor) -> "DTensor":
        """A DTensor whose local piece is the result of ``pending`` (a ``collectives.Pending``),
        waited for at the first use of ``_local_tensor`` -- any op, to_local, a redistribute."""
        r = DTensor(like, spec)  # ``like``: a tensor on the right device, for the wrapper only
        del r._local_tensor
        r._pending = pending
        return r

    def __getattr__(self, name):
        # reached only when normal lookup fails: for _local_tensor, while a collective is pending
        if name == "_local_tensor":
            try:
                pending = object.__getattribute__(self, "_pending")
            except AttributeError:
                pending = None
            if pending is not None:
                local = pending.wait()
                self._local_tensor = local
                self._pending = None
                return local
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __repr__(self):
        return (f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, "
                f"placements={list(self.placements)})")

    # --- tensor-subclass protocol (torch.compile, DCP, deepcopy)
    def __tensor_flatten__(self):
        return ["_local_tensor"], (self._spec, self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        spec, requires_grad = flatten_spec
        return DTensor(inner_tensors["_local_tensor"], spec, requires_grad=requires_grad)

    def __coerce_same_metadata_as_tangent__(self, flatten_spec, expected_type=None):
        """torch.compile's backward guessed each output gradient's layout (its spec) while
        tracing; a gradient that arrives laid out otherwise (a Replicate gradient of a Partial
        or Shard output) is redistributed to the guessed layout -- no data moves for those two
        (Replicate -> Partial keeps coordinate 0's value, Replicate -> Shard slices)."""
        if expected_type is not None:
            return None  # a different tensor type expected: torch's protocol says "cannot"
        spec = flatten_spec[0]
        if spec.placements == self._spec.placements and spec.shard_order == self._spec.shard_order:
            return self
        target = DTensorSpec(spec.mesh, spec.placements, self._spec.tensor_meta, spec.shard_order)
        return _redistributed(self, target, False)

    def __reduce_ex__(self, protocol):
        return (_rebuild_dtensor, (self._local_tensor, self._spec, self.requires_grad))

    def __deepcopy__(self, memo):
        out = DTensor(self._local_tensor.clone(), self._spec, requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out

    # --- torch.distributed.checkpoint hooks (one box per rank; see _dcp.py)
    def __create_write_items__(self, fqn: str, object):
        return _dcp.create_write_items(fqn, self)

    def __create_chunk_list__(self):
        return _dcp.create_chunk_list(self)

    def __get_tensor_shard__(self, index):
        return _dcp.get_tensor_shard(self, index)

    # --- public surface
    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh dim (non-default shard orders show as ``_StridedShard``)."""
        return self._spec.public_placements()

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    def local_offset(self) -> tuple[int, ...]:
        """Where this rank's piece starts in the global tensor, per dim (metadata only; uneven
        and nested shards follow ``torch.chunk``). Other ranks' pieces:
        ``compute_local_shape_and_global_offset(dt.shape, mesh, placements, coordinate)``.

        Example::

            >>> x = distribute_tensor(torch.randn(13, 8), mesh, [Shard(0)])   # 4 ranks
            >>> x.local_offset()     # rank 3 holds row 12 only: (12, 0)
        """
        return self._spec.local_shape_and_offset()[1]

    @staticmethod
    @boundary
    def from_local(local_tensor: torch.Tensor, device_mesh: DeviceMesh | None = None,
                   placements=None, *, run_check: bool = False, shape=None,
                   stride=None, grad_placements=None) -> "DTensor":
        """Wrap each rank's ``local_tensor`` as the pieces of one global DTensor.

        Without ``shape``, Shard dims are assumed even (global = local * mesh size); pass
        ``shape`` for uneven shards, or ``run_check=True`` to gather the local shapes and derive
        the exact global shape (pieces that form no global tensor raise ValueError on every
        rank) and, as torch's, broadcast the piece of coordinate 0 of every Replicate mesh dim
        to the others (into ``local_tensor`` when it is contiguous). Differentiable.

        In backward the DTensor's gradient is redistributed to ``grad_placements`` before it
        becomes ``local_tensor``'s gradient (default: ``placements``, with Partial dims as
        Replicate). E.g. ``grad_placements=[Partial()]`` on a Replicate input leaves each rank
        its own term of the gradient, with no all-reduce. Each rank's piece under
        ``grad_placements`` must have ``local_tensor``'s shape.

        Example::

            >>> x = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])  # global (2*n, 4)
        """
        if not isinstance(local_tensor, torch.Tensor) or isinstance(local_tensor, DTensor):
            raise TypeError(f"from_local needs a plain local torch.Tensor, got {type(local_tensor).__name__}")
        mesh = given_or_current_mesh(device_mesh, local_tensor)
        placements = normalize_placements(placements, mesh, local_tensor.ndim)
        if local_tensor.device.type != mesh.device_type and local_tensor.device.type != "meta":
            local_tensor = local_tensor.to(mesh.device_type)
        outside = mesh.get_coordinate() is None
        if run_check and not outside:
            with debug_state.outermost_cause("from_local(run_check)"):
                shape, local_tensor = _run_check(local_tensor, mesh, placements, shape,
                                                 stride=stride)
        if shape is None:
            shape = list(local_tensor.shape)
            for i, p in enumerate(placements):
                if p.is_shard():
                    shape[p.dim] *= mesh.shape[i]
        shape = torch.Size(shape)
        if stride is None:
            stride = contiguous_stride(shape) if outside or local_tensor.is_contiguous() else \
                _strides_of_pieces(local_tensor, mesh, placements)
        spec = DTensorSpec(mesh, placements, TensorMeta(shape, tuple(stride), local_tensor.dtype))
        if outside:  # a rank outside the mesh holds an empty piece, whatever it was given
            local_tensor = local_tensor.new_zeros(outside_shape(len(shape)))
        expected = spec.local_shape()
        if tuple(local_tensor.shape) != expected:
            raise ValueError(
                f"from_local: local tensor of shape {tuple(local_tensor.shape)} on rank "
                f"{mesh.get_rank()} does not match global shape {tuple(shape)} with placements "
                f"{list(placements)} (this rank should hold {expected}); pass the right shape= "
                "or use run_check=True to derive it from all ranks")
        grad_layout = _grad_layout(spec, grad_placements)
        if grad_layout is not None:
            _check_grad_layout_fits(spec, grad_layout)
        out = _FromLocal.apply(local_tensor, spec, grad_layout)
        if not run_check and not outside and mesh.size() > 1:
            # no rank compared its piece with the others': collectives on it check sizes first
            _unchecked.mark(out)
        return out

    @boundary
    def to_local(self, *, grad_placements=None) -> torch.Tensor:
        """This rank's piece. ``grad_placements`` says how the local gradient is laid out
        (default: as this DTensor is)."""
        if not torch.is_grad_enabled():
            local = self._local_tensor
            # the caller now holds the piece itself, which no count tells apart from our own
            # reference without reading reference counts: recorded, so that an in-place op
            # writes through it rather than move this DTensor off it (_aliasing)
            self._lent = weakref.ref(local)
            return local
        return _ToLocal.apply(self, grad_placements)

    @boundary
    def redistribute(self, device_mesh: DeviceMesh | None = None, placements=None, *,
                     async_op: bool = False, forward_dtype: torch.dtype | None = None,
                     backward_dtype: torch.dtype | None = None) -> "DTensor":
        """The same global tensor with new ``placements``, at the least communication.

        ``async_op=True`` returns as soon as the plan's last collective is *issued*: the result's
        local piece waits for it at its first use (any op on it, ``to_local``, a further
        redistribute), so compute placed in between overlaps with the communication. Its
        backward redistributes the gradient the same way. Values equal the synchronous path.

        ``forward_dtype`` casts the local piece before the collectives (the result is in that
        dtype: e.g. bf16 communication of an fp32 tensor moves half the bytes).
        ``backward_dtype`` casts the gradient before the backward collectives; after them it is
        cast back to this DTensor's dtype. Without it the backward runs at this DTensor's dtype
        (not ``forward_dtype``).

        Example::

            >>> y = x.redistribute(mesh, [Replicate(), Shard(1)])
            >>> print(explain_redistribute(x, mesh, [Replicate(), Shard(1)]))  # the plan
            >>> y16 = x.redistribute(mesh, [Replicate()], forward_dtype=torch.bfloat16)
        """
        dst = redistribute_target(self._spec, device_mesh, placements)
        for name, dtype in (("forward_dtype", forward_dtype), ("backward_dtype", backward_dtype)):
            if dtype is not None and not isinstance(dtype, torch.dtype):
                raise TypeError(f"redistribute: {name} must be a torch.dtype or None, got "
                                f"{dtype!r}")
        return _Redistribute.apply(self, dst, bool(async_op), forward_dtype, backward_dtype)

    @boundary
    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        """The whole global tensor on every rank (a plain tensor). Differentiable."""
        replicated = self.redistribute(self._spec.mesh, [Replicate()] * self._spec.mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)


# what crosses a torch.compile boundary besides tensors (see compile_support.py)
register_constants(DeviceMesh, DTensorSpec, Shard, _StridedShard, Replicate, Partial)


def _rebuild_dtensor(local, spec, requires_grad):
    return DTensor(local, spec, requires_grad=requires_grad)


# torch.load's default (weights_only=True) unpickles only allow-listed globals: list what a
# pickled DTensor is made of, as torch lists its DTensor, DeviceMesh and placements, so a saved
# DTensor or state dict loads without the caller allow-listing anything
torch.serialization.add_safe_globals([_rebuild_dtensor, _rebuild_mesh, DTensorSpec, TensorMeta,
                                      Shard, _StridedShard, Replicate, Partial])


def _strides_of_pieces(local: torch.Tensor, mesh: DeviceMesh, placements) -> tuple[int, ...]:
    """The global stride of pieces laid out as ``local`` is (e.g. transposed): a dim whose
    stride steps over a sharded dim's steps over all of its shards (torch's rule), so
    ``from_local(piece.t(), ...).stride()`` is the transposed global tensor's."""
    stride = list(local.stride())
    for i, p in enumerate(placements):
        if p.is_shard():
            step = stride[p.dim]
            stride = [s * mesh.shape[i] if j != p.dim and s >= step else s
                      for j, s in enumerate(stride)]
    return tuple(stride)


def _cached_per_pair(fn):
    """``fn(spec, grad_spec)`` computed once per pair of (interned) specs: backward passes ask
    it per call, with the same pair every step."""
    cache: dict = _caches.register_decisions({})

    def cached(spec: DTensorSpec, grad_spec: DTensorSpec) -> DTensorSpec:
        key = (spec, grad_spec)
        out = cache.get(key)
        if out is None:
            out = _caches.remember(cache, key, fn(spec, grad_spec), _PLANS)
        return out
    cached.__name__, cached.__doc__ = fn.__name__, fn.__doc__
    return cached


@_cached_per_pair
def _grad_target(spec: DTensorSpec, grad_spec: DTensorSpec) -> DTensorSpec:
    """Gradients of a Partial value arrive Replicated: d(sum_i x_i)/dx_i = 1."""
    placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    order = spec.shard_order
    return DTensorSpec(spec.mesh, placements, grad_spec.tensor_meta, order)


@_cached_per_pair
def _redistribute_grad_target(spec: DTensorSpec, grad_spec: DTensorSpec) -> DTensorSpec:
    """Where redistribute's backward puts the gradient of an input laid out as ``spec``: as
    :func:`_grad_target`, except that a mesh dim where both the input and the arriving gradient
    are linear Partials keeps the gradient's Partial -- it already holds the right global value
    (the DTensor gradient of a Partial input), and reducing it here would only move bytes that
    its consumer may never need (PyTorch keeps it too). from_local's backward, which hands back
    a local piece, still reduces."""
    target = _grad_target(spec, grad_spec)
    if grad_spec.mesh != spec.mesh:  # a cross-mesh move's gradient arrives on the other mesh
        return target
    keep = tuple(g if p.is_partial() and g.is_partial() and p.is_linear and g.is_linear else t
                 for p, g, t in zip(spec.placements, grad_spec.placements, target.placements))
    if keep == target.placements:
        return target
    return DTensorSpec(spec.mesh, keep, grad_spec.tensor_meta, spec.shard_order)


def _as_grad_dtensor(grad, spec: DTensorSpec) -> "DTensor":
    if isinstance(grad, DTensor):
        return grad
    raise RuntimeError(
        f"the gradient flowing into a DTensor of placements {list(spec.placements)} is a plain "
        f"tensor of shape {tuple(grad.shape)}; pass DTensor gradients (e.g. call backward() on a "
        "DTensor loss, or distribute the gradient with the same mesh)")


def _redistributed(dt: "DTensor", dst: DTensorSpec, async_op: bool) -> "DTensor":
    if _unchecked.is_marked(dt):
        return _redistributed_checked(dt, dst, async_op)
    out = redistribute_local(dt._local_tensor, dt._spec, dst, async_op)
    if isinstance(out, torch.Tensor):
        return DTensor(out.view_as(out) if out is dt._local_tensor else out, dst)
    return DTensor._from_pending(out, dst, dt._local_tensor)


def _redistributed_checked(dt: "DTensor", dst: DTensorSpec, async_op: bool) -> "DTensor":
    """``_redistributed`` of pieces no rank compared (see _unchecked.py): each collective checks
    that every rank's buffers and global shape agree first (synchronously, ``async_op`` or
    not). On a 1-D mesh that check covered every rank of the mesh, so the source and the result
    are known to agree from then on; on more dims only the dims moved were checked."""
    with _unchecked.checking(dt._spec):
        local = dt._local_tensor
        out = redistribute_local(local, dt._spec, dst, async_op=False)
    res = DTensor(out.view_as(out) if out is local else out, dst)
    if dst.mesh.ndim > 1 and dst.mesh.size() > 1:
        _unchecked.mark(res)
    elif dt._spec.mesh is dst.mesh:
        _unchecked.unmark(dt)
    return res


def _grad_layout(spec: DTensorSpec, grad_placements) -> DTensorSpec | None:
    """The layout the user's ``grad_placements`` give a gradient of a tensor laid out as
    ``spec`` (from_local and to_local; None when not given)."""
    if grad_placements is None:
        return None
    placements = normalize_placements(grad_placements, spec.mesh, spec.ndim)
    return DTensorSpec(spec.mesh, placements, spec.tensor_meta)


def _check_grad_layout_fits(spec: DTensorSpec, grad_layout: DTensorSpec) -> None:
    """from_local's gradient is the local piece of ``grad_layout``: it must fit the local tensor
    on every rank (checked for all coordinates, so every rank raises or none does)."""
    import itertools
    mesh = spec.mesh
    for coord in itertools.product(*(range(n) for n in mesh.shape)):
        have = spec.local_shape_and_offset(coord)[0]
        want = grad_layout.local_shape_and_offset(coord)[0]
        if have != want:
            raise ValueError(
                f"from_local: grad_placements {list(grad_layout.placements)} give the rank at "
                f"mesh coordinate {list(coord)} a gradient of shape {want}, but its local tensor "
                f"(placements {list(spec.placements)}, global shape {tuple(spec.shape)}) has "
                f"shape {have}; a local tensor's gradient must have its shape: use "
                "grad_placements that shard the same dims (e.g. Partial() or Replicate() where "
                "placements replicate)")
    if grad_layout.placements != _grad_target(spec, spec).placements and any(
            p.is_partial() and p.reduce_op in ("max", "min") for p in spec.placements):
        raise ValueError(
            f"from_local: grad_placements {list(grad_layout.placements)} with Partial max/min "
            f"placements {list(spec.placements)} are not supported (the gradient goes to the "
            "rank(s) holding the extreme, which needs it laid out as the default, Replicate on "
            "the Partial dims); leave grad_placements=None")


class _FromLocal(torch.autograd.Function):
    @staticmethod
    @unseen_fn
    def forward(ctx, local, spec, grad_layout=None):
        ctx.spec, ctx.grad_layout = spec, grad_layout
        if any(p.is_partial() and p.reduce_op != "sum" for p in spec.placements):
            ctx.save_for_backward(local)  # max/min need to know which rank held the extreme
        return DTensor(local.view_as(local), spec)

    @staticmethod
    def backward(ctx, grad):
        with debug_state.outermost_cause("from_local.backward"):
            return _FromLocal._backward(ctx, grad)

    @staticmethod
    @unseen_fn
    def _backward(ctx, grad):
        local_grad = local_grad_of(grad, ctx.spec, ctx.grad_layout)
        if ctx.saved_tensors:
            local_grad = _partial_local_grad(local_grad, ctx.saved_tensors[0], ctx.spec)
        return local_grad, None, None


def local_grad_of(grad, spec: DTensorSpec, grad_layout: DTensorSpec | None = None):
    """The local piece of ``grad`` (a DTensor gradient of a tensor laid out as ``spec``) that the
    tensor's own local piece receives: laid out as ``spec`` with Partial dims Replicated, or as
    the user's ``grad_layout`` (Partial dims included: a Partial gradient stays unreduced)."""
    grad = _as_grad_dtensor(grad, spec)
    if grad_layout is None:
        target = _grad_target(spec, grad._spec)
    else:
        target = DTensorSpec(grad_layout.mesh, grad_layout.placements, grad._spec.tensor_meta,
                             grad_layout.shard_order)
    return redistribute_local(grad._local_tensor, grad._spec, target)


def _partial_local_grad(grad: torch.Tensor, local: torch.Tensor, spec: DTensorSpec):
    """d(global)/d(local piece) for Partial reductions other than sum: avg spreads the gradient
    evenly (1/n), max/min send it to the rank(s) holding the extreme, split evenly among ties
    (as torch.amax's backward does)."""
    from . import collectives
    extreme_dims = [i for i, p in enumerate(spec.placements) if p.is_partial() and
                    p.reduce_op in ("max", "min")]
    for i, p in enumerate(spec.placements):
        if p.is_partial("avg"):
            grad = grad / spec.mesh.shape[i]
    if any(p.is_partial("product") for p in spec.placements):
        grad = grad * _product_of_the_others(local.detach(), spec)
    if extreme_dims:
        op = spec.placements[extreme_dims[0]].reduce_op
        extreme = local.detach()
        for i in extreme_dims:  # the global extreme is over every max/min mesh dim together
            extreme = collectives.all_reduce(extreme, spec.mesh, i, op)
        holds = (local.detach() == extreme).to(grad.dtype)
        ties = holds
        for i in extreme_dims:
            ties = collectives.all_reduce(ties, spec.mesh, i, "sum")
        grad = grad * holds / ties
    return grad


def _product_of_the_others(local: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """d(prod over ranks)/d(this rank's piece): the product of every other rank's piece over the
    Partial("product") mesh dims, from gathered pieces (exact where a piece holds zeros, which
    dividing the whole product by this rank's piece would not be)."""
    from . import collectives
    others, piece = torch.ones_like(local), local
    for i, p in enumerate(spec.placements):
        if p.is_partial("product"):
            coord = spec.mesh.get_coordinate()[i]
            pieces = collectives.all_gather(piece.unsqueeze(0), spec.mesh, i)
            others = others * torch.cat([pieces[:coord], pieces[coord + 1:]]).prod(0)
            piece = pieces.prod(0)  # the row's product: the piece of the next product dim
    return others


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt, grad_placements):
        # grad_placements: the user's (checked here), or a DTensorSpec made by the library
        ctx.spec = grad_placements if type(grad_placements) is DTensorSpec else \
            _grad_layout(dt._spec, grad_placements) or dt._spec
        return dt._local_tensor.view_as(dt._local_tensor)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        if tuple(grad.shape) != spec.local_shape():
            raise RuntimeError(
                f"to_local backward: local gradient of shape {tuple(grad.shape)} does not match "
                f"placements {list(spec.placements)} (expected {spec.local_shape()}); pass "
                "grad_placements= that describe the local gradient")
        if grad.dtype == spec.dtype:
            return DTensor(grad, spec), None
        meta = TensorMeta(spec.shape, spec.stride, grad.dtype)
        return DTensor(grad, DTensorSpec(spec.mesh, spec.placements, meta, spec.shard_order)), None


def _with_dtype(spec: DTensorSpec, dtype: torch.dtype) -> DTensorSpec:
    return DTensorSpec(spec.mesh, spec.placements, spec.tensor_meta._replace(dtype=dtype),
                       spec.shard_order)


def _cast(dt: "DTensor", dtype: torch.dtype | None) -> "DTensor":
    """``dt`` with its local piece cast to ``dtype`` (no communication; None: unchanged)."""
    if dtype is None or dt.dtype == dtype:
        return dt
    return DTensor(dt._local_tensor.to(dtype), _with_dtype(dt._spec, dtype))


class _Redistribute(torch.autograd.Function):
    # CommDebugMode labels: "redistribute" unless an op's dispatch is redistributing (its label)
    @staticmethod
    @unseen_fn
    def forward(ctx, dt, dst, async_op, forward_dtype=None, backward_dtype=None):
        ctx.src, ctx.async_op, ctx.backward_dtype = dt._spec, async_op, backward_dtype
        if forward_dtype is not None:  # cast before the collectives: they move forward_dtype
            dt, dst = _cast(dt, forward_dtype), _with_dtype(dst, forward_dtype)
        with debug_state.outermost_cause("redistribute"):
            return _redistributed(dt, dst, async_op)

    @staticmethod
    @unseen_fn
    def backward(ctx, grad):
        grad = _as_grad_dtensor(grad, ctx.src)
        # the backward collectives run at backward_dtype, by default at the input's dtype (not
        # the forward's); the input's gradient is always in the input's dtype
        grad = _cast(grad, ctx.backward_dtype or ctx.src.dtype)
        target = _redistribute_grad_target(ctx.src, grad._spec)
        with debug_state.outermost_cause("redistribute.backward"):
            out = _redistributed(grad, target, ctx.async_op)
        return _cast(out, ctx.src.dtype), None, None, None, None


_DEFAULT_MESHES: dict = _caches.register({})  # device type -> 1-D world mesh


def given_or_current_mesh(device_mesh: DeviceMesh | None, like: torch.Tensor) -> DeviceMesh:
    """The mesh a call given ``device_mesh`` uses: that one, else the innermost ``with mesh:``
    block's (as torch's), else a 1-D mesh over the whole world."""
    if device_mesh is not None:
        return device_mesh
    from .device_mesh import current_mesh
    return current_mesh() or default_mesh(like)


def default_mesh(like: torch.Tensor) -> DeviceMesh:
    """A 1-D mesh over the whole world, used when a call gives no device_mesh."""
    from .device_mesh import drop_stale_groups, init_device_mesh
    if not dist.is_initialized():
        raise RuntimeError("no device_mesh given and torch.distributed is not initialised")
    # after destroy + init this drops every cache (this one included), so the default mesh is
    # rebuilt on the new group instead of failing as "destroyed"
    drop_stale_groups()
    device_type = "cuda" if like.is_cuda else "cpu"
    mesh = _DEFAULT_MESHES.get(device_type)
    if mesh is None:
        mesh = _DEFAULT_MESHES[device_type] = init_device_mesh(device_type,
                                                               (dist.get_world_size(),))
    return mesh


def _run_check(local, mesh, placements, shape, stride=None):
    """run_check=True, as torch's: every rank's piece metadata, exchanged to derive the exact
    global shape; see ``piece_check``: pieces of different sizes, dims or dtypes make every rank
    raise the same ValueError before anything sized by a piece crosses ranks (gloo would abort).
    Then, on each Replicate mesh dim, the piece of coordinate 0 is broadcast to the others (in
    place when ``local`` is contiguous, as torch's ``mesh_broadcast`` writes into it): replicas
    that differed hold coordinate 0's values after (torch 2.13 and 2.15 alike). Returns the
    global shape and the piece to wrap."""
    from .collectives import broadcast
    from .piece_check import checked_global_shape
    global_shape = checked_global_shape(local, mesh, placements, shape, stride)
    if local.device.type != "meta" and any(p.is_replicate() for p in placements):
        local = local.contiguous()  # differentiable: a strided piece's copy keeps its graph
        with torch.no_grad():  # the values of coordinate 0 are data, not a differentiable op
            for i, p in enumerate(placements):
                if p.is_replicate():
                    broadcast(local, mesh, i, 0)
    return torch.Size(global_shape), local


def _dispatch_op(func, args, kwargs):
    raise RuntimeError("DTensor's dispatcher is not installed: import dtensor_lite, not only "
                       "dtensor_lite.dtensor")


def use_dispatcher(dispatch) -> None:
    """Route every aten op on DTensors to ``dispatch`` (``_dispatch`` installs itself on import:
    the dispatcher needs DTensor, so DTensor cannot import the dispatcher)."""
    global _dispatch_op
    _dispatch_op = dispatch


def use_torch_function(torch_function) -> None:
    """Make ``torch_function(cls, func, types, args, kwargs)`` DTensor's ``__torch_function__``
    (``_fast_path`` installs itself this way, for the same reason as ``use_dispatcher``); None
    restores the default: every call goes straight to ``__torch_dispatch__``."""
    DTensor.__torch_function__ = disabled_torch_function_impl \
        if torch_function is None else classmethod(torch_function)
