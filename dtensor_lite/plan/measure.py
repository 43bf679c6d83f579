"""Measure one training step of one rank: bytes held by category, communication by mesh dim,
and FLOPs. The same meter runs in the dry run (meta tensors, a fake process group) and in a real
multi-process run, so the two can be compared figure for figure.

What is measured, and how (every figure is this rank's):

Categories are those of :mod:`dtensor_lite.memory_categories` (shared with the measured
``MemoryTracker``):

* ``sharded_params``: storages of the parameters' local pieces when the step starts.
* ``gradients``: storages of the ``.grad`` local pieces when the optimizer step begins (after
  backward and its gradient reduction; FSDP's unsharded gradient buffers of backward count as
  ``comm_buffers`` here, being reduce-scatter inputs).
* ``optimizer_state``: storages of every tensor in ``optimizer.state`` after the step.
* ``activations``: storages created during forward (and the loss) that are still alive when
  backward begins, other than parameters (a sharded parameter's storage made in forward -- FSDP
  gives a shard it lent to the gathered parameter a storage of its own again at reshard, see
  fsdp/param.py ``lend_shard`` -- is a parameter's, counted once in ``sharded_params``): what autograd, activation checkpointing (the inputs it
  keeps, the outputs selective checkpointing saves) and the loss hold for backward. Seen by a
  dispatch mode that notes every fresh output storage; backward begins at the first op the
  autograd engine runs (no saved-tensor hooks: a hook's packed tensor can hold its own node, a
  reference cycle that keeps a retained graph's saved tensors alive for good -- the zero-bubble
  schedules' input-gradient pass retains its graph -- where a run without the meter frees them).
* ``unsharded_params``: storages that modules expose as parameters during forward but that are
  not the sharded parameters (FSDP's gathered ones); the peak of their live bytes is sampled at
  every module's forward exit, every collective, and every re-allocation of such a storage
  (FSDP's unshard in backward), in forward and backward.
* ``comm_buffers``: FSDP's flat buffers, from the recorded collectives: the largest all-gather
  output plus the largest reduce-scatter input (the most alive at once with prefetch depth 1).
* communication: CommDebugMode's records (every collective passes through
  ``dtensor_lite.collectives``), by kind and mesh dim, with each dim's group ranks.
* FLOPs: torch's flop formulas (``torch.utils.flop_counter``) on each op's global shapes, divided
  over the mesh dims where a DTensor op's output is sharded or partial (each rank computes that
  share); ops on plain tensors count whole (they are this rank's own work).
"""
from __future__ import annotations

import math
import weakref
from collections import defaultdict

import torch
import torch.nn as nn
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from .._torch_names import TorchDispatchMode, aten, current_graph_task_id, tree_leaves
from ..debug import CommDebugMode
from ..dtensor import DTensor
from ..memory_categories import (ACTIVATIONS, COMM_BUFFERS, GRADIENTS, OPTIMIZER_STATE,
                                 SHARDED_PARAMS, UNSHARDED_PARAMS)

__all__ = ["StepMeter", "storage_bytes"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor):
    return _local(t).untyped_storage()


def _holds(storages: dict[int, weakref.ref], s) -> bool:
    """Whether ``s`` is one of ``storages`` (key -> weakref): the same storage, not a freed
    one's key reused."""
    ref = storages.get(s._cdata)
    return ref is not None and ref() is not None   # alive: no other storage has its key


def _alive(storages: dict[int, weakref.ref]) -> set[int]:
    return {key for key, ref in storages.items() if ref() is not None}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (DTensors count their local piece; views
    of one storage count once). Works on meta tensors: their storages know their size."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = _storage(t)
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


class _StepMode(TorchDispatchMode):
    """Notes fresh output storages (while ``recording``) and counts FLOPs (always); while
    ``tracking``, keeps the running total of the storages created since tracking began and still
    alive, and its peak (each storage leaves the total when it is freed: a weakref callback)."""

    def __init__(self, on_backward=None):
        super().__init__()
        self.recording = False
        self.on_backward = on_backward   # called at the first op autograd's engine runs
        self.created: dict[int, weakref.ref] = {}  # storage key -> weakref, created in forward
        self.flops = 0
        self.tracking = False
        self.live = 0
        self.peak = 0
        self._tracked: dict[int, weakref.ref] = {}
        self._sizes: dict[int, int] = {}   # tracked storage -> its bytes in ``live``
        self._born: dict[int, int] = {}    # tracked storage -> when it was created (0: before)
        self.created_order = 0

    # it measures the library itself: its buffers and collectives count (see _unseen.py)
    sees_dtensor_lite_internals = True

    def bytes_created_since(self, mark: int, exclude: set[int]) -> int:
        """Bytes of the storages created after ``mark`` (a ``created_order``) still alive."""
        return sum(self._sizes[k] for k, born in self._born.items()
                   if born > mark and k in self._tracked and k not in exclude)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.recording and self.on_backward is not None \
                and current_graph_task_id() != -1:
            self.on_backward()   # backward has begun: recording stops
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in _FLOPS:
            self.flops += _rank_flops(packet, args, kwargs, out)
        if self.recording or self.tracking:
            inputs = {_storage(t)._cdata for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    s = _storage(t)
                    key = s._cdata
                    if key in inputs:
                        continue  # a view or an in-place result: not a new allocation
                    if self.tracking:
                        self._track(key, s)
                    if not self.recording:
                        continue
                    ref = self.created.get(key)
                    if ref is None or ref() is None:  # a freed storage's address reused
                        self.created[key] = weakref.ref(s)
        return out

    def _track(self, key: int, s, new: bool = True):
        """Follow storage ``s`` until it is freed (then its bytes leave the total); ``new``:
        created in the step (its bytes join the total), else from before (already counted in
        the start, which the total is above)."""
        ref = self._tracked.get(key)
        if ref is not None and ref() is not None:
            return
        self._sizes[key] = s.nbytes()

        def freed(_, key=key):
            if self._tracked.get(key) is ref_:
                self.live -= self._sizes.pop(key)
                del self._tracked[key], self._born[key]
        ref_ = weakref.ref(s, freed)
        self._tracked[key] = ref_
        self.created_order += 1
        self._born[key] = self.created_order if new else 0
        if new:
            self.live += self._sizes[key]
        self.peak = max(self.peak, self.live)

    def resized(self, s, nbytes: int):
        """``s.resize_(nbytes)`` is about to run (fsdp frees and re-allocates its gathered
        parameters' storage so, the storage object staying alive)."""
        if not self.tracking:
            return
        key = s._cdata
        self._track(key, s, new=False)
        self.live += nbytes - self._sizes[key]
        self._sizes[key] = nbytes
        self.peak = max(self.peak, self.live)

    def live_bytes(self, exclude: set[int]) -> int:
        total = 0
        for key, ref in self.created.items():
            s = ref()
            if s is not None and key not in exclude:
                total += s.nbytes()
        return total


# the CPU fused attention kernels, which torch's table lacks: the same count as the CUDA ones
_FLOPS = {
    **flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *_, **__: sdpa_flop_count(q.shape, k.shape, v.shape),
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *_, **__: sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape),
}


def _rank_flops(packet, args, kwargs, out) -> int:
    flops = _FLOPS[packet](*args, **kwargs, out_val=out)
    first = next((t for t in tree_leaves(out) if isinstance(t, DTensor)), None)
    if first is None:
        return flops
    mesh = first.device_mesh
    split = math.prod(mesh.size(i) for i, p in enumerate(first.placements)
                      if not p.is_replicate())
    return flops // split


class StepMeter:
    """Context manager around one training step of ``model`` / ``optimizer`` on this rank.

    After the step, ``bytes`` maps each memory category to bytes (``unsharded_params`` and
    ``comm_buffers`` are peaks), ``comm`` is the CommDebugMode of the step, ``flops`` this
    rank's FLOPs (forward, backward and recomputation). ``peak_bytes``: the most bytes of
    storages created in forward and backward (up to the optimizer step) alive at once -- what
    ``MemoryTracker.peak_bytes`` measures from the allocator, less the temporaries that live and
    die inside one op (a pipeline's micro-batches in flight show here, not in ``activations``,
    which is what is held when the *first* backward begins).

    Example::

        >>> with StepMeter(model, opt) as meter:
        ...     train_step(model, opt, inputs, targets)
        >>> meter.bytes["activations"], meter.comm.get_comm_bytes_by_mesh_dim()
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        self.bytes: dict[str, int] = {}
        self.flops = 0
        self.peak_bytes = 0   # see the class docstring
        self.comm = _SamplingComm(self)
        self._mode = _StepMode(self._end_forward)
        # storage key -> weakref, as a storage's key (its address) is reused once it is freed:
        # the sharded parameters' and buffers' at the start (FSDP frees a shard it lends to its
        # gathered parameter, fsdp/param.py lend_shard), and the gathered ones seen in forward
        self._sharded: dict[int, weakref.ref] = {}
        self._at_start: list[torch.Tensor] = []   # the sharded parameters (read between steps)
        self._unsharded: dict[int, weakref.ref] = {}
        self._peak_unsharded = 0
        self._handles = []

    # ---------------------------------------------------------------- sampling
    def _unsharded_live(self) -> int:
        return sum(s.nbytes() for s in (r() for r in self._unsharded.values()) if s is not None)

    def sample(self):
        self._peak_unsharded = max(self._peak_unsharded, self._unsharded_live())

    def _after_forward(self, module, args, output):
        # global forward hooks run before the module's own: FSDP has not resharded yet
        for p in module._parameters.values():
            if isinstance(p, torch.Tensor):
                s = _storage(p)
                if not _holds(self._sharded, s) and not _holds(self._unsharded, s):
                    self._unsharded[s._cdata] = weakref.ref(s)
        self.sample()

    def _end_forward(self):
        self._mode.recording = False
        # the sharded parameters' storages now, not only at the start: a shard FSDP lent to its
        # gathered parameter got a new storage of its own at reshard, inside forward
        now = {_storage(p)._cdata for p in self._at_start}
        exclude = now | _alive(self._sharded) | _alive(self._unsharded)
        self.bytes[ACTIVATIONS] = self._mode.live_bytes(exclude)
        self.sample()

    def _pre_step(self, optimizer, args, kwargs):
        self._mode.tracking = False   # peak_bytes: forward and backward (the pipeline step)
        self.sample()
        self.bytes[GRADIENTS] = storage_bytes(p.grad for p in self._params()
                                              if p.grad is not None)

    def _post_step(self, optimizer, args, kwargs):
        self.bytes[OPTIMIZER_STATE] = storage_bytes(
            t for state in optimizer.state.values() for t in state.values()
            if isinstance(t, torch.Tensor))

    def _params(self):
        return list(self.model.parameters())

    # ---------------------------------------------------------------- context
    def __enter__(self):
        params = self._at_start = self._params()
        self._sharded = {s._cdata: weakref.ref(s)
                         for s in map(_storage, [*params, *self.model.buffers()])}
        self.bytes = {SHARDED_PARAMS: storage_bytes(params), GRADIENTS: 0, OPTIMIZER_STATE: 0,
                      ACTIVATIONS: 0, UNSHARDED_PARAMS: 0, COMM_BUFFERS: 0}
        self._handles = [
            nn.modules.module.register_module_forward_hook(self._after_forward),
            self.optimizer.register_step_pre_hook(self._pre_step),
            self.optimizer.register_step_post_hook(self._post_step)]
        self.comm.__enter__()
        self._mode.__enter__()
        self._mode.recording = True
        self._mode.tracking = True
        for p in params:
            # from before the step: freeing one lowers the total below the start (FSDP frees a
            # shard it lends to the gathered parameter, and allocates it again at reshard)
            s = _storage(p)
            self._mode._track(s._cdata, s, new=False)
        resize, mode, unsharded = torch.UntypedStorage.resize_, self._mode, self._unsharded

        def counted_resize(storage, nbytes):
            mode.resized(storage, nbytes)
            out = resize(storage, nbytes)
            if nbytes and storage._cdata in unsharded:
                # a gathered parameter's storage allocated again (fsdp's unshard in backward):
                # sampled here too, as a gather that is no collective's issue (a backward
                # prefetch issued after the previous group resharded) would otherwise be missed
                self.sample()
            return out
        self._resize = resize
        torch.UntypedStorage.resize_ = counted_resize
        return self

    def __exit__(self, *exc):
        if self._mode.recording:  # no backward ran
            self._end_forward()
        self._mode.__exit__(*exc)
        self.comm.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self.flops = self._mode.flops
        self._mode.tracking = False
        torch.UntypedStorage.resize_ = self._resize
        self.peak_bytes = self._mode.peak
        self.bytes[UNSHARDED_PARAMS] = self._peak_unsharded
        self.bytes[COMM_BUFFERS] = comm_buffer_bytes(self.comm)
        return False


class _SamplingComm(CommDebugMode):
    """CommDebugMode that also samples the meter's unsharded bytes at every collective. It does
    not follow modules through backward: torch's module tracker would keep what the zero-bubble
    schedules' input-gradient pass retains alive until Python's gc runs, memory that the run
    without the meter frees at its weight pass."""
    _follows_backward = False

    def __init__(self, meter: StepMeter):
        super().__init__()
        self._meter = meter

    def _add(self, *args, **kwargs):
        super()._add(*args, **kwargs)
        self._meter.sample()


def comm_buffer_bytes(comm: CommDebugMode) -> int:
    """The largest all-gather output plus the largest reduce-scatter input, from the bytes each
    sent ((n - 1) chunks of the n-chunk buffer): what FSDP holds at once with one prefetch."""
    largest = defaultdict(int)
    for kind, nbytes, n, _, _ in comm.calls:
        if kind in ("all_gather", "reduce_scatter") and n > 1:
            largest[kind] = max(largest[kind], nbytes // (n - 1) * n)
    return largest["all_gather"] + largest["reduce_scatter"]
