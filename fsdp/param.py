"""Per-parameter state: the sharded DTensor parameter, its unsharded buffer, and padding.

A managed parameter of global shape ``G`` sharded on tensor dim ``d`` over ``S`` ranks is stored as
an ``nn.Parameter`` wrapping a DTensor ``Shard(d)`` (``torch.chunk`` pieces: ``ceil(G[d] / S)`` rows
per rank, trailing ranks may hold fewer or none). Padding exists only inside the communication
buffers: in the flat all-gather / reduce-scatter buffers every rank's piece takes the full
``ceil(G[d] / S)`` rows ("padded shard"), so all ranks send equal-sized chunks; copy-out trims it.

Shards on ``d != 0`` are laid out with ``d`` moved to the front (``movedim(d, 0)``) inside the
buffers, so the padding rule is the same for every dim.

The unsharded parameter lives in ``raw``, a plain tensor owned by FSDP and never seen by autograd.
Modules see *aliases* of it (``raw.data``: same storage, own version counter), so refilling
``raw`` in backward does not count as an in-place change of a tensor that autograd saved.
Resharding frees ``raw``'s storage (``resize_(0)``); the aliases that autograd saved point at the
same storage and see the data again once it is re-gathered into it.
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.nn as nn

from dtensor_lite import DTensor, Replicate, distribute_tensor
from dtensor_lite._torch_names import unsafe_set_version_counter
from dtensor_lite._unchecked import unmark
from dtensor_lite.spec import DTensorSpec, TensorMeta, chunk_range, contiguous_stride

from .dp_mesh_dims import in_mesh_order

__all__ = ["FSDPParam"]


def _refill(local: torch.Tensor, storage, rows: torch.Tensor) -> None:
    """``local`` moved onto ``storage`` (at offset 0, ``rows``' shape) and filled from ``rows``."""
    local.set_(storage, 0, rows.shape, rows.stride())
    local.copy_(rows)


class FSDPParam:
    """One managed parameter.

    ``owners`` lists every ``(module, attribute name)`` that refers to the parameter (tied
    weights have several); publishing a tensor writes it into all of them.
    """

    def __init__(self, param: nn.Parameter, owners: list[tuple[nn.Module, str]], mesh_info,
                 shard_dim: int, device: torch.device, offload: bool, pin_memory: bool,
                 replicate_over=None, original: nn.Parameter | None = None):
        self.owners = owners
        self.fqn = owners[0][1] if owners else "?"
        self.mesh_info = mesh_info
        self.shard_dim = shard_dim
        self.device = device
        self.offload = offload
        self.pin_memory = pin_memory and offload and torch.cuda.is_available()
        self.raw: torch.Tensor | None = None      # unsharded data (plain, FSDP-owned)
        self._raw_nbytes = 0
        self.inner_tensors: list[torch.Tensor] = []       # extension tensors whose storage is freed too
        self._inner_nbytes: list[int] = []
        self._ext_meta = None                       # fsdp_pre_all_gather metadata
        self.by_extension = False                   # the last all-gather went through one
        self._ext_shapes: list[torch.Size] = []
        # a DTensor parameter (tensor parallelism): FSDP shards this rank's TP piece further and
        # hands modules the gathered piece as a DTensor with the TP layout again
        self.tp_spec: DTensorSpec | None = param._spec if isinstance(param, DTensor) else None
        self.tp_visible = self.tp_spec is not None
        # a spmd_types-annotated parameter (fsdp/spmd_types_params.py): modules compute on
        # plain pieces, so the TP layout is FSDP's business only
        self.spmd_compute = getattr(param, "_dtl_spmd_compute", None)
        if self.spmd_compute is not None:
            self.tp_visible = False
        if self.tp_spec is None and replicate_over is not None:
            # a plain parameter next to TP ones (a norm without sequence parallelism): it is
            # replicated over the TP dims, so say so and live on the same mesh as its neighbours
            # (one mesh for all parameters: torch's clip_grad_norm_ and foreach optimizers
            # need that); modules still see it as a plain tensor
            meta = TensorMeta(param.shape, contiguous_stride(param.shape), param.dtype)
            self.tp_spec = DTensorSpec(replicate_over, (Replicate(),) * replicate_over.ndim, meta)
        self.layout: DTensorSpec | None = None     # the sharded parameter's spec (any dtype)
        self.mp_policy = None                       # fully_shard's, resolved for this parameter
        self.keep_unsharded_storage = False         # FSDPModule.set_keep_unsharded_storage
        # while unsharded, the local shard may live in its rows of raw (lend_shard): its own
        # storage (weakly) and byte size then
        self._own_storage: tuple | None = None
        # the sharded parameter's write counts when last gathered (watch_writes): a write since
        # leaves the gathered parameter, or a forward's saved tensors, behind (written_since_gather)
        self._gathered_versions: tuple[int, int] | None = None
        # off: keep the shard beside the gathered parameter (tests and benchmarks/memory.py
        # compare the two paths in one process)
        self.lends_shard = True
        self.sharded = self._shard(param)
        self._init_geometry()
        # the replaced plain parameter: another module that still refers to it (a weight tied
        # across two fully_shard calls) must be refused, not silently untied
        # (``original``: the user's, when fully_shard's dp_mesh_dims front end re-expressed it)
        self.original = weakref.ref(param if original is None else original)
        self.publish(self.sharded)

    # ----------------------------------------------------------------- building the shard
    def _shard(self, param: nn.Parameter) -> nn.Parameter:
        info = self.mesh_info
        data = param.detach()
        if isinstance(data, DTensor):
            data = data.to_local()  # this rank's TP piece is what the dp dims shard
        if data.device.type not in ("meta", self.device.type):
            data = data.to(self.device)
        # every rank holds the same full tensor (or a meta one): slice locally, no communication
        dt = distribute_tensor(data, info.mesh, info.placements(self.shard_dim), src_data_rank=None)
        self.layout = dt._spec if self.tp_spec is None else self._joint_spec(dt._spec)
        if info.spmd_mesh is not None:
            self.layout = in_mesh_order(self.layout, info.spmd_mesh)
        local = dt.to_local()
        if self.offload and self.device.type != "cpu" and data.device.type != "meta":
            with torch.no_grad():
                local = local.cpu()
            if self.pin_memory:
                local = local.pin_memory()
        return nn.Parameter(self._wrap_local(local), requires_grad=param.requires_grad)

    def _joint_spec(self, dp_spec: DTensorSpec) -> DTensorSpec:
        """The spec over the dp dims followed by the TP dims: dp placements, then TP's.

        When both shard the same tensor dim, TP's split comes first (outermost) and the dp
        dim splits each TP piece: exactly what sharding the local TP piece did. PyTorch spells
        this order ``_StridedShard``; ``full_tensor()`` undoes it like any other layout.
        """
        tp, info = self.tp_spec, self.mesh_info
        k = info.mesh.ndim
        order = [tuple(k + m for m in dims) for dims in tp.shard_order]
        order[self.shard_dim] += (info.shard_dim,)
        return DTensorSpec(info.mesh.join(tp.mesh), dp_spec.placements + tp.placements,
                           tp.tensor_meta, tuple(order))

    def _wrap_local(self, local: torch.Tensor) -> DTensor:
        """A DTensor with the sharded parameter's layout around ``local`` (its dtype; its device,
        which is the CPU for offloaded shards on a GPU mesh)."""
        spec = self.layout
        if local.dtype != spec.tensor_meta.dtype:
            meta = spec.tensor_meta._replace(dtype=local.dtype)
            spec = DTensorSpec(spec.mesh, spec.placements, meta, spec.shard_order)
        return DTensor(local, spec)

    def module_view(self, unsharded: torch.Tensor) -> torch.Tensor:
        """What the module sees for the unsharded (gathered over dp) tensor: the tensor itself,
        or for a TP parameter a DTensor with the TP layout around it (differentiable: the
        gradient comes back as this rank's TP piece, reduced over TP where it was Partial)."""
        tp = self.tp_spec
        if self.spmd_compute is not None:
            return self.spmd_compute.view(unsharded, tp)
        if not self.tp_visible:
            return unsharded
        view = DTensor.from_local(unsharded, tp.mesh, tp.public_placements(), shape=tp.shape,
                                  stride=tp.stride)
        # the TP layout is the parameter's own, agreed by every rank: nothing to check per
        # collective (see dtensor_lite/_unchecked.py)
        unmark(view)
        return view

    # ----------------------------------------------------------------- geometry
    def _init_geometry(self):
        """Sizes in the flat buffers; fixed by the global shape, so computed once."""
        # what the dp dims shard and gather: the whole parameter, or this rank's TP piece
        shape = tuple(self.sharded.shape) if self.tp_spec is None else self.tp_spec.local_shape()
        world = self.mesh_info.shard_size
        rest = list(shape)
        self.rows = rest.pop(self.shard_dim)
        self.shape = torch.Size(shape)
        self.moved_rest = tuple(rest)
        self.row_numel = math.prod(rest)
        self.chunk_rows = -(-self.rows // world)
        self.padded_numel = self.chunk_rows * self.row_numel  # one rank's piece, padded
        self.local_rows = chunk_range(self.rows, world, self.mesh_info.shard_rank)[1]
        # every rank's piece is whole (no padding) and dim 0 is sharded: the unsharded tensor
        # viewed as (world, padded numel) is exactly the rows of the flat buffers, so a group of
        # such parameters is copied out / packed by one op (ParamGroup's fused paths)
        self.rows_even = self.shard_dim == 0 and self.rows == world * self.chunk_rows

    @property
    def requires_grad(self) -> bool:
        return self.sharded.requires_grad

    @property
    def dtype(self) -> torch.dtype:
        return self.sharded.dtype

    def local_tensor(self) -> torch.Tensor:
        """This rank's piece (call under no_grad: to_local is then a plain attribute read)."""
        return self.sharded.to_local()

    # ----------------------------------------------------------------- all-gather inputs
    def all_gather_inputs(self, param_dtype, module, mp_policy) -> list[tuple[torch.Tensor, int]]:
        """``(flat tensor, padded numel)`` per all-gather input; shorter tensors are zero-padded.

        Without an extension: this rank's piece (dim ``d`` first), in the all-gather dtype.
        With ``fsdp_pre_all_gather`` on the local tensor (PyTorch's extension protocol): whatever
        it returns; each input must have the same shape on every rank.
        """
        local = self.local_tensor()
        world = self.mesh_info.shard_size
        if self.offload and local.device != self.device:
            local = local.to(self.device, non_blocking=True)
        self.by_extension = hasattr(local, "fsdp_pre_all_gather")
        if self.by_extension:
            if not hasattr(local, "fsdp_post_all_gather"):
                raise TypeError(f"parameter {self.fqn}: its tensor type {type(local).__name__} "
                                "defines fsdp_pre_all_gather but not fsdp_post_all_gather; define "
                                "both")
            if self.shard_dim != 0:
                raise ValueError(f"parameter {self.fqn}: all-gather extensions need Shard(0), got "
                                 f"Shard({self.shard_dim})")
            inputs, self._ext_meta = local.fsdp_pre_all_gather(
                self.mesh_info.shard_mesh, self.shape, contiguous_stride(self.shape), module,
                mp_policy)
            chunk = self.chunk_rows
            for t in inputs:
                if local.shape[0] != chunk and (t.ndim == 0 or t.shape[0] != chunk):
                    raise ValueError(
                        f"parameter {self.fqn} is sharded unevenly ({self.rows} rows over {world} "
                        f"ranks): fsdp_pre_all_gather must return inputs padded to {chunk} rows, "
                        f"got shapes {[tuple(t.shape) for t in inputs]}")
            self._ext_shapes = [t.shape for t in inputs]
            return [(t.reshape(-1), t.numel()) for t in inputs]
        x = local.movedim(self.shard_dim, 0) if self.shard_dim else local
        if param_dtype is not None and x.is_floating_point():
            x = x.to(param_dtype)
        return [(x.reshape(-1), self.padded_numel)]

    def all_gather_dtype(self, param_dtype) -> torch.dtype:
        if param_dtype is not None and self.dtype.is_floating_point:
            return param_dtype
        return self.dtype

    # ----------------------------------------------------------------- unsharded storage
    def copy_out(self, gathered: list[torch.Tensor], world: int, param_dtype):
        """Fill ``raw`` from this parameter's segments of the all-gather output.

        ``gathered[j]`` is a ``(world, numel_j)`` view: row ``r`` is rank ``r``'s input ``j``.
        """
        local = self.local_tensor()
        if hasattr(local, "fsdp_post_all_gather"):
            return self._copy_out_extension(local, gathered, world, param_dtype)
        raw = self.ready_raw(self.all_gather_dtype(param_dtype))
        chunk = self.chunk_rows
        src = gathered[0].unflatten(1, (chunk,) + self.moved_rest)      # (world, chunk, *rest)
        dst = raw.movedim(self.shard_dim, 0) if self.shard_dim else raw
        _rows_from_chunks(dst, src, self.rows, chunk)

    def ready_raw(self, dtype: torch.dtype) -> torch.Tensor:
        """``raw`` in ``dtype`` with its storage allocated (contents undefined until copied out)."""
        if self.raw is None or self.raw.dtype != dtype or self.raw.shape != self.shape:
            self.raw = torch.empty(self.shape, dtype=dtype, device=self.device)
            self._raw_nbytes = self.raw.untyped_storage().nbytes()
        self.alloc()
        return self.raw

    def _copy_out_extension(self, local, gathered, world, param_dtype):
        dtype = param_dtype if param_dtype is not None else self.dtype
        outputs = [g.reshape(-1).view((world * s[0],) + tuple(s[1:])) if len(s) else g.reshape(-1)
                   for g, s in zip(gathered, self._ext_shapes)]
        if self.raw is not None and self.raw.dtype == dtype:
            self.alloc()
            local.fsdp_post_all_gather(outputs, self._ext_meta, dtype, out=self.raw)
            return
        full, inner = local.fsdp_post_all_gather(outputs, self._ext_meta, dtype)
        # the result may keep the padded rows: view the global shape at its start
        self.raw = full if full.shape == self.shape else full.as_strided(
            self.shape, contiguous_stride(self.shape), 0)
        self.inner_tensors = [t for t in inner if t.untyped_storage().data_ptr()
                       != self.raw.untyped_storage().data_ptr()]
        self._raw_nbytes = self.raw.untyped_storage().nbytes()
        self._inner_nbytes = [t.untyped_storage().nbytes() for t in self.inner_tensors]

    def alloc(self):
        if self.raw is not None and self.raw.untyped_storage().nbytes() == 0:
            self.raw.untyped_storage().resize_(self._raw_nbytes)
            for t, n in zip(self.inner_tensors, self._inner_nbytes):
                t.untyped_storage().resize_(n)

    def free(self):
        """Release the unsharded data (the tensor objects stay, with empty storage) -- unless
        told to keep it (``set_keep_unsharded_storage``): then the next all-gather refills the
        same storage, at the same addresses (what a captured CUDA graph needs). A lent shard
        (``lend_shard``) gets its own storage back first."""
        self.take_back_shard()
        if self.raw is not None and not self.keep_unsharded_storage:
            self.raw.untyped_storage().resize_(0)
            for t in self.inner_tensors:
                t.untyped_storage().resize_(0)

    # ----------------------------------------------------------------- the shard inside raw
    def can_lend_shard(self) -> bool:
        """Whether this rank's piece is, element for element, a contiguous slice of ``raw``:
        dim-0 shards without padding, gathered in the shard's own dtype (no mixed-precision
        cast), no extension, not offloaded, a plain CPU tensor alone in its storage.
        CPU only: on CUDA the shard's old storage would be freed on the compute stream while
        the all-gather's side stream may still read it."""
        if not (self.lends_shard and self.rows_even and self.raw is not None
                and not self.by_extension
                and not self.offload and not self.keep_unsharded_storage
                and self.device.type == "cpu"):
            return False
        local = self.sharded._local_tensor
        storage = local.untyped_storage()
        # the local tensor fills its storage alone (take_back_shard puts it back at offset 0);
        # a view into a larger buffer (a user's flat buffer) would save nothing anyway
        return (type(local) is torch.Tensor and local.dtype == self.raw.dtype
                and local.device == self.raw.device and local.is_contiguous()
                and local.shape[0] == self.chunk_rows and local.numel() > 0
                and local.storage_offset() == 0 and storage.nbytes() == local.nbytes)

    def lend_shard(self):
        """While unsharded, hold this rank's piece only once: the sharded parameter's local
        tensor becomes a view of its rows of ``raw`` (same values: the all-gather copied them
        there) and lets go of its own storage, which is freed unless something else holds it
        -- the group's parameters then cost ``U_g``, not ``U_g + U_g / S``. The tensor object
        stays (``set_``), so whoever holds the parameter (the optimizer) reads the same values.
        A write into the sharded parameter while lent changes this rank's rows of the gathered
        one; the group refuses to compute with a gathered parameter whose shard was written
        since the gather, lent or not (``ParamGroup.check_unwritten``)."""
        if self._own_storage is not None or not self.can_lend_shard():
            return
        local = self.sharded._local_tensor
        storage = local.untyped_storage()
        # weakly: an alias of the shard taken earlier (a state dict's detach()) keeps the
        # storage alive, and gets its values back at take_back_shard; nothing else does
        self._own_storage = (weakref.ref(storage), storage.nbytes())
        row0 = self.mesh_info.shard_rank * self.chunk_rows * self.row_numel
        self._own_write(local.set_, self.raw.untyped_storage(), self.raw.storage_offset() + row0,
                        local.shape, local.stride())

    def take_back_shard(self):
        """Undo ``lend_shard`` before ``raw`` is freed: the local tensor gets a storage of its
        own again -- the one it had if something kept that alive (its aliases see the values
        again), else a new one -- filled from its rows of ``raw``. A write while lent is kept
        (as without lending) and still counts as a write since the gather; resharding must not
        raise (it is also how a failed iteration is reset)."""
        if self._own_storage is None:
            return
        ref, nbytes = self._own_storage
        self._own_storage = None
        local = self.sharded._local_tensor
        rows = local.detach()   # a view of raw: keeps the values while the local tensor moves
        storage = ref()
        if storage is None:
            storage = torch.empty(nbytes, dtype=torch.uint8, device=local.device).untyped_storage()
        self._own_write(_refill, local, storage, rows)

    # ----------------------------------------------------------------- writes since the gather
    def watch_writes(self):
        """The group was just gathered from the shard as it is now."""
        self._gathered_versions = self._versions()

    def written_since_gather(self) -> bool:
        """Whether the sharded parameter was modified in place since the last gather: the
        gathered parameter (and what a forward saved of it for backward) hold older values."""
        return self._gathered_versions is not None and \
            self._versions() != self._gathered_versions

    def _own_write(self, op, *args):
        """``op(*args)``, FSDP's own in-place op on the local tensor (lending, taking back), which
        is no write of the user's: it keeps the values (moves them to other memory), so the
        local tensor's version counter is put back to what it was -- a parameter unwritten
        before is still unwritten after, one written while lent still counts as written.
        Plain calls, not context managers: this runs for every parameter at every gather and
        reshard."""
        local = self.sharded._local_tensor
        version = local._version
        if local.requires_grad:  # the local piece never does, as built here
            with torch.no_grad():
                op(*args)
        else:
            op(*args)
        unsafe_set_version_counter((local,), (version,))

    def _versions(self) -> tuple[int, int]:
        """The write counts that see an in-place write into the shard: the parameter's own
        (ops on the DTensor: autograd counts them on the wrapper, dtensor_lite's fast path as
        well; the local op runs below autograd and counts nothing) and its local tensor's (a
        write into ``to_local()``). A write through ``.data`` counts in neither, as autograd
        does not see it in plain torch either."""
        return self.sharded._version, self.sharded._local_tensor._version

    def describe(self) -> str:
        """``Linear.weight``-like: the first owning module's class and the parameter's name."""
        where = f"{type(self.owners[0][0]).__name__}." if self.owners else ""
        return f"{where}{self.fqn}"

    def shares_storage(self, t: torch.Tensor) -> bool:
        """Whether the unsharded data lives in ``t``'s storage (an extension's zero-copy views)."""
        ptr = t.untyped_storage().data_ptr()
        return any(x.untyped_storage().data_ptr() == ptr
                   for x in ([self.raw] if self.raw is not None else []) + list(self.inner_tensors))

    def unsharded_nbytes(self) -> int:
        """Bytes currently held by the unsharded data (0 when resharded)."""
        if self.raw is None:
            return 0
        return self.raw.untyped_storage().nbytes() + sum(
            t.untyped_storage().nbytes() for t in self.inner_tensors)

    # ----------------------------------------------------------------- what modules see
    def publish(self, tensor: torch.Tensor):
        """Make every owner's attribute refer to ``tensor`` (sharded param or unsharded alias).

        Written straight into ``_parameters``: an unsharded alias is a plain tensor (possibly
        an autograd output), which ``nn.Module.__setattr__`` would refuse as a parameter.
        """
        for module, name in self.owners:
            module._parameters[name] = tensor

    def adopt_replaced_param(self):
        """If the user assigned a new parameter object while sharded, manage that one instead."""
        module, name = self.owners[0]
        current = module._parameters.get(name)
        if current is self.sharded or current is None or not isinstance(current, nn.Parameter):
            return
        old = self.sharded
        if not isinstance(current, DTensor) or (current.device_mesh, current.placements,
                                                current.shape) != (old.device_mesh,
                                                                   old.placements, old.shape):
            raise ValueError(
                f"parameter {name} of {type(module).__name__} was replaced by a tensor that is not "
                f"a DTensor with FSDP's layout {list(self.sharded.placements)} and shape "
                f"{tuple(self.shape)}; assign sharded values in place instead (param.copy_)")
        self.sharded = current
        self.publish(current)

    # ----------------------------------------------------------------- gradients
    def pack_grad(self, grad: torch.Tensor | None, dst: torch.Tensor):
        """Copy the unsharded ``grad`` into ``dst`` ``(world, padded numel)``, zero-padded."""
        chunk = self.chunk_rows
        dst3 = dst.unflatten(1, (chunk,) + self.moved_rest)
        if grad is None:
            dst.zero_()
            return
        src = grad.movedim(self.shard_dim, 0) if self.shard_dim else grad
        _rows_to_chunks(dst3, src, self.rows, chunk)

    def local_grad_from(self, reduced: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the reduced gradient from its padded segment ``reduced`` (1-D)."""
        chunk = self.chunk_rows
        g = reduced.view((chunk,) + self.moved_rest)[:self.local_rows]
        if self.shard_dim:
            g = g.movedim(0, self.shard_dim)
        return g.to(self.dtype)

    def accumulate_grad(self, local_grad: torch.Tensor):
        """Add this rank's reduced piece into the sharded parameter's (DTensor) ``.grad``."""
        if self.offload and local_grad.device.type != "cpu":
            local_grad = local_grad.to("cpu")
        param = self.sharded
        with torch.no_grad():
            if param.grad is None:
                param.grad = self._wrap_local(local_grad.contiguous())
            else:
                param.grad.to_local().add_(local_grad)


def _rows_from_chunks(dst: torch.Tensor, src: torch.Tensor, rows: int, chunk: int):
    """dst[i] = src[i // chunk, i % chunk] for the first ``rows`` rows (drops the padding)."""
    if chunk == 0 or rows == 0:
        return
    full = rows // chunk
    if full:
        dst[:full * chunk].unflatten(0, (full, chunk)).copy_(src[:full])
    rem = rows - full * chunk
    if rem:
        dst[full * chunk:].copy_(src[full, :rem])


def _rows_to_chunks(dst: torch.Tensor, src: torch.Tensor, rows: int, chunk: int):
    """The inverse of ``_rows_from_chunks``, zero-filling the padding rows."""
    if chunk == 0:
        return
    full = rows // chunk
    if full:
        dst[:full].copy_(src[:full * chunk].unflatten(0, (full, chunk)))
    rem = rows - full * chunk
    used = full
    if rem:
        dst[full, :rem].copy_(src[full * chunk:])
        dst[full, rem:].zero_()
        used += 1
    if used < dst.shape[0]:
        dst[used:].zero_()
