"""One parameter group per ``fully_shard`` call: flat buffers, unshard / reshard, reduce-scatter.

Unshard = copy every parameter's local piece (padded to its chunk) into ONE flat buffer, ONE
``collectives.flat_all_gather``, then copy each parameter's pieces out into its unsharded tensor.
Reduce = pack the unsharded gradients (padded) into ONE flat buffer per gradient dtype, ONE
``collectives.flat_reduce_scatter``, (HSDP: ONE ``collectives.all_reduce`` across replicas),
divide, and add each piece into the sharded parameter's DTensor ``.grad``.

Buffer layout (per rank; the all-gather output is ``world`` such chunks, rank order)::

    | p0 piece, padded | p1 piece, padded | ... |        one dtype: offsets in elements
    | f32 inputs ... |pad| bf16 inputs ... |pad| i8 ..| mixed dtypes: a uint8 buffer with
                                                      16-byte aligned segments (one collective)

The group also counts its *uses*: each forward call that ran with grad creates one autograd node
(``hooks._Unsharded``); when the last of them has received its gradients the group reduces and
reshards. The end-of-backward callback finishes groups some of whose uses never got gradients.
"""
from __future__ import annotations

import enum

import torch

from dtensor_lite import collectives as C
from dtensor_lite.debug_state import comm_cause

from .param import FSDPParam
from .streams import Streams

__all__ = ["ParamGroup", "ShardState"]

_ALIGN = 16  # bytes; segment alignment in mixed-dtype buffers (any dtype can view it)


class ShardState(enum.Enum):
    SHARDED = "sharded"
    SHARDED_POST_FORWARD = "sharded_post_forward"  # reshard_after_forward=N: N-way between passes
    UNSHARDED = "unsharded"


class _Layout:
    """Offsets of every all-gather input inside one rank's chunk of the flat buffer."""

    def __init__(self, specs: list[list[tuple[int, torch.dtype]]]):
        dtypes = {dtype for per_param in specs for _, dtype in per_param}
        self.mixed = len(dtypes) > 1
        self.dtype = torch.uint8 if self.mixed else (dtypes.pop() if dtypes else torch.uint8)
        self.offsets: list[list[tuple[int, int, torch.dtype]]] = []  # (offset, numel, dtype)
        pos = 0
        for per_param in specs:
            row = []
            for numel, dtype in per_param:
                if self.mixed:
                    pos = -(-pos // _ALIGN) * _ALIGN
                    row.append((pos, numel, dtype))
                    pos += numel * dtype.itemsize
                else:
                    row.append((pos, numel, dtype))
                    pos += numel
            self.offsets.append(row)
        self.chunk = -(-pos // _ALIGN) * _ALIGN if self.mixed else pos
        self.sizes = [numel for row in self.offsets for _, numel, _ in row]

    def _view(self, flat2d: torch.Tensor, off: int, numel: int, dtype: torch.dtype):
        if not self.mixed:
            return flat2d[:, off:off + numel]
        return flat2d[:, off:off + numel * dtype.itemsize].view(dtype)

    def _per_param(self, views) -> list[list[torch.Tensor]]:
        it = iter(views)
        return [[next(it) for _ in row] for row in self.offsets]

    def inputs(self, flat: torch.Tensor) -> list[list[torch.Tensor]]:
        """1-D views of one rank's chunk, per parameter, per input."""
        if not self.mixed:  # segments back to back: one op makes every view
            return self._per_param(flat.split_with_sizes(self.sizes))
        flat2d = flat.view(1, -1)
        return [[self._view(flat2d, o, n, d)[0] for o, n, d in row] for row in self.offsets]

    def outputs(self, flat: torch.Tensor, world: int) -> list[list[torch.Tensor]]:
        """``(world, numel)`` views of the gathered buffer, per parameter, per input."""
        flat2d = flat.view(world, self.chunk)
        if not self.mixed:
            return self._per_param(flat2d.split_with_sizes(self.sizes, dim=1))
        return [[self._view(flat2d, o, n, d) for o, n, d in row] for row in self.offsets]


class _PendingAllGather:
    """An all-gather in flight. ``out``: the gathered flat buffer, or None when it was gathered
    into ``pieces``, one buffer per rank (``ParamGroup._gathers_in_pieces``)."""
    __slots__ = ("work", "inp", "out", "layout", "world", "from_post_forward", "pieces")

    def __init__(self, work, inp, out, layout, world, from_post_forward, pieces=None):
        self.work, self.inp, self.out, self.layout = work, inp, out, layout
        self.world, self.from_post_forward = world, from_post_forward
        self.pieces = pieces

    def buffers(self) -> list[torch.Tensor]:
        return list(self.pieces) if self.pieces is not None else [self.out]


def _even_grad_rows(params, grads, world: int, dtype: torch.dtype):
    """``(world, padded numel)`` views of ``grads`` when each is exactly its rows of the
    reduce-scatter input (dim-0 shards without padding, contiguous, the bucket's dtype), so one
    ``torch.cat`` packs them all; else None (the per-parameter packing pads and moves dims)."""
    rows = []
    for p, g in zip(params, grads):
        if g is None or not p.rows_even or g.dtype != dtype or not g.is_contiguous():
            return None
        rows.append(g.view(world, -1))
    return rows


class PendingReduce:
    """A reduce-scatter in flight: finished (waited, divided, written) by
    ``ParamGroup.finish_reduce``. It holds the reduce-scatter input and output (the only
    references to them), not the unsharded gradients, which were copied into the input."""
    __slots__ = ("group", "buckets")

    def __init__(self, group, buckets):
        self.group, self.buckets = group, buckets  # [(params, offsets, work, inp, out)]

    def wait_and_discard(self):
        """The reduce-scatter of an iteration that failed: let it finish, keep nothing."""
        for _params, _offsets, work, _inp, _out in self.buckets:
            if work is not None:
                work.wait()


class ParamGroup:
    def __init__(self, params: list[FSDPParam], modules, mesh_info, mp_policy, offload: bool,
                 device: torch.device):
        self.params = params
        self.modules = modules
        self.mesh_info = mesh_info
        self.mp_policy = mp_policy
        self.offload = offload
        self.device = device
        self.streams = Streams.shared(device)
        self.trainable = [i for i, p in enumerate(params) if p.requires_grad]
        self.state = ShardState.SHARDED
        self.name = type(modules[0]).__name__
        # policy knobs (FSDPModule.set_*)
        self.reshard_after_forward: bool | int = True
        self.is_root = False               # the root keeps its parameters through backward
        self.root_ctx = None               # state.RootContext, set at the root's lazy init
        self.reshard_after_backward = True
        self.reduce_grads = True           # set_requires_gradient_sync
        self.unshard_in_backward = True    # set_unshard_in_backward
        self.all_reduce_grads = True       # set_requires_all_reduce (HSDP)
        self.force_sum_reduction_for_comms = False  # recorded only: ours always sum
        self.reduce_scatter_unused_params = False   # recorded only: ours always include them
        self.all_reduce_hook = None        # set_all_reduce_hook: fn(reduced flat gradient)
        self.all_reduce_hook_stream = None
        self.divide_factor: float | None = None
        # per-step state
        self.pending_ag: _PendingAllGather | None = None
        self.post_forward_buf: torch.Tensor | None = None
        self._post_forward_layout: _Layout | None = None
        self._post_forward_n_at_reshard: int | None = None
        self.uses_pending = 0              # forward uses whose backward has not run yet
        self.forward_uses = 0              # forward uses with grad in this iteration's forward
        self.needs_reduce = False          # some use with grad ran since the last reduce
        # gradients left unreduced by a backward (no-sync, or manual finalization): reduced by
        # finalize_backward once sync is on
        self.post_backward_pending = False
        self.grads: list[torch.Tensor | None] = [None] * len(self.trainable)
        self.prefetched_in_backward = False
        # HSDP with all_reduce_grads False: reduce-scatter outputs summed over backwards, not yet
        # all-reduced across replicas nor divided, by gradient dtype (one bucket each)
        self.partial_reduce: dict[torch.dtype, torch.Tensor] = {}

    # ================================================================= unshard
    @property
    def param_dtype(self):
        """The group's default; a parameter's own (``param_dtype_override_fn``) is
        ``p.mp_policy.param_dtype``."""
        return self.mp_policy.param_dtype

    def post_forward_n(self) -> int | None:
        """N of ``reshard_after_forward=N`` when it means a real N-way group, else None."""
        n = self.reshard_after_forward
        if isinstance(n, bool) or self.is_root or n >= self.mesh_info.shard_size:
            return None
        return n if n > 1 else None

    def reshards_after_forward(self) -> bool:
        n = self.reshard_after_forward
        if self.is_root:
            return False
        return n is True or (not isinstance(n, bool) and n > 1)

    def lends_in_forward(self) -> bool:
        """Whether a forward's gather lends the shards: for a group that stays gathered into
        backward, whose parameters then sit at the step's peak (the start of backward, every
        activation alive), and in a forward without grad (no backward follows: the forward is
        the peak). A group resharded after forward is gathered again for its backward, and that
        gather lends; lending its short forward gather too saved nothing of the step's peak and
        cost a free, an allocation and a copy per shard (w2 L4 step peak the same; ~1 ms of CPU
        per step of benchmarks/fsdp_step.py)."""
        return not self.reshards_after_forward() or not torch.is_grad_enabled()

    def start_unshard(self):
        """Issue the all-gather (asynchronously); ``wait_unshard`` finishes it."""
        if self.state is ShardState.UNSHARDED or self.uses_pending:
            # about to compute with what was gathered, or to gather for a forward's backward
            self.check_unwritten()
        if self.state is ShardState.UNSHARDED:
            return
        if self.pending_ag is not None:
            return
        info = self.mesh_info
        with torch.no_grad():
            if self.state is ShardState.SHARDED_POST_FORWARD:
                mesh, dim = info.post_forward(self._post_forward_n_at_reshard)
                inp, layout = self.post_forward_buf, self._post_forward_layout
                with self.streams.side("all_gather"), comm_cause("fsdp.all_gather"):
                    out = inp.new_empty(inp.numel() * mesh.size(dim))
                    work = C.flat_all_gather(out, inp, mesh, dim, async_op=True)
                self.pending_ag = _PendingAllGather(work, inp, out, layout, info.shard_size, True)
                return
            for p in self.params:
                p.adopt_replaced_param()
            module = self.modules[0]
            world = info.shard_size
            # on the side stream from here: the inputs (casts, host-to-device copies of offloaded
            # shards) are allocated there too, so nothing the copy-in reads is freed under it
            with self.streams.side("all_gather"):
                inputs = [p.all_gather_inputs(p.mp_policy.param_dtype, module, p.mp_policy)
                          for p in self.params]
                layout = _Layout([[(numel, t.dtype) for t, numel in per_param]
                                  for per_param in inputs])
                if self._gathers_in_pieces(layout, world):
                    self.pending_ag = self._start_gather_pieces(inputs, layout, world)
                    return
                # in place: this rank's input is its own slot of the output, so the all-gather
                # needs no separate input buffer
                out = torch.empty(layout.chunk * world, dtype=layout.dtype, device=self.device)
                inp = out.narrow(0, info.shard_rank * layout.chunk, layout.chunk)
                flat = [t for per_param in inputs for t, _ in per_param]
                if not layout.mixed and sum(t.numel() for t in flat) == layout.chunk:
                    # no padding anywhere: the inputs back to back are the chunk (one op)
                    torch.cat(flat, out=inp)
                else:
                    self._copy_in(inputs, layout, inp)
                work = None
                if world > 1 and layout.chunk:
                    with comm_cause("fsdp.all_gather"):
                        work = C.flat_all_gather(out, inp, info.mesh, info.shard_dim,
                                                 async_op=True)
            self.pending_ag = _PendingAllGather(work, inp, out, layout, world, False)

    def _fused(self, layout: _Layout) -> bool:
        """Whether each parameter's rows are its buffer segments unchanged (one dtype, no
        extension, dim-0 shards without padding): then one op copies the group in or out."""
        return not layout.mixed and all(p.rows_even and not p.by_extension for p in self.params)

    def _gathers_in_pieces(self, layout: _Layout, world: int) -> bool:
        """Gather into one buffer per rank instead of one flat buffer: the piece this rank sent
        is then freed before the unsharded parameters are allocated, and its rows come from the
        shards themselves -- the copy-out holds (world-1)/world of the buffer beside the
        parameters instead of all of it, one block less at the step's peak (the first block's
        backward; benchmarks/memory.py). CPU only: on CUDA the caching allocator reuses the
        buffer anyway, and NCCL's list all-gather would copy through a flat one. Not for groups
        that keep a post-forward N-way piece of the flat buffer."""
        return (not self.streams.is_cuda and world > 1 and layout.chunk > 0
                and self.post_forward_n() is None and self._fused(layout))

    def _start_gather_pieces(self, inputs, layout: _Layout, world: int) -> _PendingAllGather:
        info = self.mesh_info
        pieces = [torch.empty(layout.chunk, dtype=layout.dtype, device=self.device)
                  for _ in range(world)]
        inp = pieces[info.shard_rank]
        torch.cat([t for per_param in inputs for t, _ in per_param], out=inp)
        with comm_cause("fsdp.all_gather"):
            work = C.all_gather_pieces(pieces, info.mesh, info.shard_dim, async_op=True)
        return _PendingAllGather(work, inp, None, layout, world, False, pieces)

    def _copy_out_pieces(self, pending: _PendingAllGather, lend: bool):
        """Fill the unsharded parameters from the gathered pieces: first free this rank's own
        piece (its rows are copied from the shards, cast as the copy-in cast them, and the
        shards lent to them if ``lend``), then each other piece with one
        ``split_with_sizes_copy``, released right after."""
        me, world, layout = self.mesh_info.shard_rank, pending.world, pending.layout
        self.streams.release(pending.inp)
        rows = [p.ready_raw(layout.dtype).view(world, -1) for p in self.params]
        for p, r in zip(self.params, rows):
            r[me].copy_(p.local_tensor().reshape(-1))
            if lend:  # now, not after the copy-out: the shard is gone before the pieces
                p.lend_shard()
        for k, piece in enumerate(pending.pieces):
            if k != me:
                torch.split_with_sizes_copy(piece, layout.sizes, out=[r[k] for r in rows])
                self.streams.release(piece)

    @staticmethod
    def _copy_in(inputs, layout: _Layout, inp: torch.Tensor):
        for per_param, views in zip(inputs, layout.inputs(inp)):
            for (t, _), view in zip(per_param, views):
                n = t.numel()
                if n < view.numel():  # a short (uneven) shard: zero its padding
                    view[n:].zero_()
                    view = view[:n]
                view.copy_(t, non_blocking=True)

    def wait_unshard(self, keep_post_forward_piece: bool = False, lend: bool = True):
        """Finish the all-gather ``start_unshard`` issued. ``lend``: the shards are lent to the
        gathered parameters (``FSDPParam.lend_shard``, CPU) -- worth its copies only where the
        group stays gathered across the step's peak (see ``ParamGroup.lends_in_forward``)."""
        pending = self.pending_ag
        if pending is None:
            return
        self.pending_ag = None
        with torch.no_grad():
            if pending.work is not None:
                pending.work.wait()  # orders this stream after the collective (and its copy-in)
            else:
                # nothing to gather (one shard, or empty shards): the output is the copy-in alone,
                # written on the side stream -- this stream must still wait for it
                self.streams.join("all_gather")
            n = self.post_forward_n()
            if keep_post_forward_piece and n and not pending.from_post_forward:
                # keep 1/n of the whole gathered buffer for the N-way re-gather in backward
                mesh, dim = self.mesh_info.post_forward(n)
                size = pending.out.numel() // n
                j = mesh.get_local_rank(dim)
                self.post_forward_buf = pending.out[j * size:(j + 1) * size].clone()
                self._post_forward_layout = pending.layout
                self._post_forward_n_at_reshard = n
            if pending.pieces is not None:
                self._copy_out_pieces(pending, lend)
            elif self._fused(pending.layout):
                self._copy_out_fused(pending)
            else:
                for p, segments in zip(self.params,
                                       pending.layout.outputs(pending.out, pending.world)):
                    p.copy_out(segments, pending.world, p.mp_policy.param_dtype)
            # copied out; an extension's fsdp_post_all_gather may have kept views of it instead
            if pending.out is not None and pending.work is not None and \
                    not any(p.shares_storage(pending.out) for p in self.params):
                self.streams.release(pending.out)
            for p in self.params:
                if lend:
                    p.lend_shard()
                p.watch_writes()
        self.state = ShardState.UNSHARDED
        # unsharded <=> modules show unsharded tensors (a forward use replaces these with
        # autograd-tracked ones)
        self.publish(self.unsharded_aliases())

    def _copy_out_fused(self, pending: _PendingAllGather):
        """Copy the gathered buffer into every parameter with ONE ``split_with_sizes_copy``
        (one op instead of a few per parameter: the copy-out was the largest Python cost of a
        step); for ``_fused`` groups."""
        layout, world = pending.layout, pending.world
        dsts = [p.ready_raw(layout.dtype).view(world, -1) for p in self.params]
        torch.split_with_sizes_copy(pending.out.view(world, layout.chunk), layout.sizes, dim=1,
                                    out=dsts)

    def check_unwritten(self):
        """Refuse to compute with parameters gathered before an in-place write into their
        shards, or to gather them for the backward of a forward that ran before such a write.

        Plain torch's autograd refuses the latter (a parameter saved for backward and modified
        in place since: "one of the variables needed for gradient computation has been modified
        by an inplace operation"); here the forward saved the gathered parameter, which the
        write did not touch (or touched only this rank's rows, where the shard is lent), so
        autograd cannot see it. The former would compute with stale values. Both are checked
        from the shards' version counters (``FSDPParam.written_since_gather``)."""
        for p in self.params:
            if p.written_since_gather():
                raise self._written_error(p)

    def _written_error(self, p: FSDPParam) -> RuntimeError:
        name = p.describe()
        if self.uses_pending:
            return RuntimeError(
                f"FSDP: the sharded parameter {name} was modified by an in-place operation after "
                "a forward that used it and before that forward's backward (e.g. optimizer.step() "
                "or load_state_dict() between forward and backward). As plain PyTorch refuses a "
                "parameter saved for backward that was modified in place, backward cannot use "
                "it: modify parameters after backward, or run the forward again after modifying "
                "them (reset_iter_state() first, to drop this iteration)")
        return RuntimeError(
            f"FSDP: the sharded parameter {name} was modified in place while its group was kept "
            "gathered (set_reshard_after_backward(False), unshard(), or a forward run with "
            "autograd recording whose backward never came, e.g. an evaluation outside "
            "torch.no_grad()); the gathered parameter this module would compute with holds the "
            "values from before the write. Reshard before modifying parameters: call reshard() "
            "on the module, set_reshard_after_backward(True) before the last backward, or run "
            "forwards without a backward under torch.no_grad()")

    def unshard(self, keep_post_forward_piece: bool = False, lend: bool = True):
        self.start_unshard()
        self.wait_unshard(keep_post_forward_piece, lend)

    # ================================================================= reshard
    def reshard(self):
        """Free the unsharded parameters; modules see the sharded DTensor parameters again."""
        self.wait_unshard()
        for p in self.params:
            p.free()
            p.publish(p.sharded)
        self.post_forward_buf = None
        self._post_forward_layout = None
        self.state = ShardState.SHARDED

    def reshard_post_forward(self):
        if not self.reshards_after_forward() or self.state is not ShardState.UNSHARDED:
            return
        if self.post_forward_buf is None:
            return self.reshard()
        for p in self.params:
            p.free()
            p.publish(p.sharded)
        self.state = ShardState.SHARDED_POST_FORWARD

    # ================================================================= publishing
    def publish(self, tensors):
        """Show modules the unsharded tensors (TP parameters as DTensors over the TP mesh)."""
        for p, t in zip(self.params, tensors):
            p.publish(p.module_view(t))

    def unsharded_aliases(self) -> list[torch.Tensor]:
        return [p.raw.data for p in self.params]

    # ================================================================= gradients
    def accumulate(self, grads):
        """Add one use's unsharded gradients (one per trainable param, None if it got none)."""
        reduce_dtype = self.mp_policy.reduce_dtype
        for k, g in enumerate(grads):
            if g is None:
                continue
            if reduce_dtype is not None and g.dtype != reduce_dtype:
                g = g.to(reduce_dtype)
            acc = self.grads[k]
            self.grads[k] = g if acc is None else acc + g

    def take_grads(self) -> list[torch.Tensor | None]:
        """Hand over the accumulated unsharded gradients (the group keeps no reference)."""
        grads, self.grads = self.grads, [None] * len(self.trainable)
        return grads

    def start_reduce(self, grads) -> PendingReduce | None:
        """Pack ``grads`` (from ``take_grads``) and issue the reduce-scatter(s); nothing keeps
        the gradients once packed."""
        self.needs_reduce = False
        self.post_backward_pending = False
        if not self.trainable:
            return None
        info = self.mesh_info
        world = info.shard_size
        reduce_dtype = self.mp_policy.reduce_dtype
        buckets: dict[torch.dtype, list[int]] = {}
        for k, i in enumerate(self.trainable):
            p = self.params[i]
            dtype = reduce_dtype or (grads[k].dtype if grads[k] is not None
                                     else p.all_gather_dtype(p.mp_policy.param_dtype))
            buckets.setdefault(dtype, []).append(k)
        out_buckets = []
        with torch.no_grad(), self.streams.side("reduce_scatter"):
            for dtype, ks in buckets.items():
                params = [self.params[self.trainable[k]] for k in ks]
                offsets, pos = [], 0
                for p in params:
                    offsets.append(pos)
                    pos += p.padded_numel
                inp = torch.empty(world * pos, dtype=dtype, device=self.device)
                inp2d = inp.view(world, pos)
                rows = _even_grad_rows(params, [grads[k] for k in ks], world, dtype)
                if rows is not None:  # one op packs the bucket (see _even_grad_rows)
                    torch.cat(rows, dim=1, out=inp2d)
                else:
                    for p, k, off in zip(params, ks, offsets):
                        n = p.padded_numel
                        p.pack_grad(grads[k], inp2d[:, off:off + n])
                out = torch.empty(pos, dtype=dtype, device=self.device)
                if world > 1 and pos:
                    with comm_cause("fsdp.reduce_scatter"):
                        work = C.flat_reduce_scatter(out, inp, info.mesh, info.shard_dim, "sum",
                                                     async_op=True)
                else:
                    work = None
                    out.copy_(inp)
                for k in ks:
                    if grads[k] is not None:  # packed on this stream: free once the copy ran
                        self.streams.read_by("reduce_scatter", grads[k])
                    grads[k] = None  # the caller's reference is the last one
                # the input lives only while the collective reads it
                out_buckets.append((params, offsets, work, inp if work is not None else None,
                                    out))
        return PendingReduce(self, out_buckets)

    def finish_reduce(self, pending: PendingReduce):
        info = self.mesh_info
        factor = self.divide_factor if self.divide_factor is not None else info.dp_size
        # on the reduce-scatter stream (CUDA): the compute stream goes on; the buffers freed here
        # can be reused only by later work on that stream, ordered after this wait
        with torch.no_grad(), self.streams.side("reduce_scatter"):
            for params, offsets, work, inp, out in pending.buckets:
                if work is not None:
                    work.wait()
                    self.streams.release(inp)
                if info.replicate_dim is not None and info.replicate_size > 1 and out.numel():
                    out = self._reduce_across_replicas(out)
                    if out is None:
                        continue  # kept for a later backward's all-reduce
                if factor != 1:
                    out.div_(factor)
                if self.all_reduce_hook is not None:
                    self._run_all_reduce_hook(out)
                for p, off in zip(params, offsets):
                    n = p.padded_numel
                    p.accumulate_grad(p.local_grad_from(out[off:off + n]))
        if self.offload:
            self.streams.synchronize_host()

    def _reduce_across_replicas(self, out: torch.Tensor) -> torch.Tensor | None:
        """HSDP: add what earlier backwards kept, then all-reduce across replicas and return the
        sum -- or, with ``all_reduce_grads`` False, keep the sum for a later backward and return
        None (the replicas' sum is linear: all-reducing the accumulated sum once equals summing
        each backward's all-reduce, for one collective instead of one per micro-batch)."""
        info = self.mesh_info
        held = self.partial_reduce.pop(out.dtype, None)
        if held is not None:
            out = out.add_(held)
        if not self.all_reduce_grads:
            self.partial_reduce[out.dtype] = out
            return None
        with comm_cause("fsdp.all_reduce"):
            return C.all_reduce(out, info.mesh, info.replicate_dim, "sum")

    def _run_all_reduce_hook(self, out: torch.Tensor):
        """The user's hook, in place on the reduced (divided) flat gradient before it is written
        into ``.grad``; on CUDA on the reduce-scatter side stream (the current one here), or on
        the stream given with it, ordered both ways around the hook."""
        stream = self.all_reduce_hook_stream
        if stream is None or not self.streams.is_cuda:
            self.all_reduce_hook(out)
            return
        here = torch.cuda.current_stream(self.device)
        stream.wait_stream(here)
        with torch.cuda.stream(stream):
            self.all_reduce_hook(out)
        here.wait_stream(stream)

    # ================================================================= introspection
    def unsharded_nbytes(self) -> int:
        return sum(p.unsharded_nbytes() for p in self.params)

    def __repr__(self):
        return f"ParamGroup({self.name}, {len(self.params)} params, {self.state.value})"
