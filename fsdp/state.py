"""FSDP state: one ``FSDPState`` per ``fully_shard`` call, one ``RootContext`` per root.

The root is the FSDP module whose forward runs first with no FSDP forward around it. At that
first forward (lazy init) it collects every FSDP state in its subtree into a ``RootContext``,
which owns what spans groups: the forward order (for prefetching), whether a backward is running,
the one reduction in flight, and the end-of-backward callback that finishes every group.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from dtensor_lite._torch_names import autograd_engine
from dtensor_lite.memory_categories import COMM_BUFFERS, GRADIENTS, UNSHARDED_PARAMS

from .observers import OBSERVERS, notify
from .param_group import ParamGroup, PendingReduce, ShardState

__all__ = ["FSDPState", "RootContext", "all_states"]

_ALL_STATES: "weakref.WeakSet[FSDPState]" = weakref.WeakSet()


def all_states():
    return list(_ALL_STATES)


class FSDPState:
    """Everything ``fully_shard`` attaches to its module(s)."""

    def __init__(self, modules: tuple[nn.Module, ...], group: ParamGroup | None, mp_policy):
        self.modules = modules
        self.group = group
        self.mp_policy = mp_policy
        self.is_root: bool | None = None      # decided at the first forward
        self.ctx: RootContext | None = None
        self.forward_prefetch: list[FSDPState] | None = None   # explicit; None: implicit
        self.backward_prefetch: list[FSDPState] | None = None
        self.root_keeps_params = True         # cleared by an explicit set_reshard_after_forward
        self.default_reshard_after_forward = True  # fully_shard got None (see FSDPModule)
        self.post_optim_event = None          # set_post_optim_event: for the next root forward
        self.to_run: set[int] = set()         # ids of this call's modules still to run this use
        self.running: set[int] = set()        # ids of this call's modules inside their forward
        self.in_method: set[int] = set()      # ... inside a registered forward method
        self.manual_backward_finalization = False  # set_manual_backward_finalization (root's)
        _ALL_STATES.add(self)

    # ----------------------------------------------------------------- lazy init
    def init_as_root(self):
        states: list[FSDPState] = []
        seen = set()
        for top in self.modules:
            for module in top.modules():
                st = module.__dict__.get("_fsdp_state")
                if st is not None and id(st) not in seen:
                    seen.add(id(st))
                    states.append(st)
        if any(st.manual_backward_finalization for st in states if st is not self):
            raise RuntimeError(
                "set_manual_backward_finalization must be called on the root FSDP module "
                f"({type(self.modules[0]).__name__}, whose forward runs first), not on a module "
                "under it")
        ctx = RootContext(self, states)
        for st in states:
            st.is_root = st is self
            st.ctx = ctx
            if st.group is not None:
                st.group.is_root = st is self and st.root_keeps_params
                st.group.root_ctx = ctx


class RootContext:
    """Per-root, per-iteration bookkeeping shared by all groups under one root."""

    def __init__(self, root: FSDPState, states: list[FSDPState]):
        self.root = root
        self.states = states
        self.groups = [s.group for s in states if s.group is not None]
        # one entry per forward use: in pre-forward order (this and the previous iteration, for
        # forward prefetching) and in post-forward order (the reverse of backward's order)
        self.forward_order: list[ParamGroup] = []
        self.prev_forward_order: list[ParamGroup] = []
        self.post_forward_order: list[ParamGroup] = []
        self.in_backward = False
        self.backward_ran = False  # a backward finished since the last forward (retain_graph)
        self.is_last_backward = True
        self.pending_reduce: PendingReduce | None = None
        # manual backward finalization (torch 2.15): the mode the current backward iteration
        # runs in, fixed when its first backward starts (None: no backward since the last
        # finalization); an asynchronous finalize_backward's handle not yet waited on
        self.manual_active: bool | None = None
        self.reduction_token: object | None = None

    # ----------------------------------------------------------------- memory
    def memory_storages(self) -> dict[str, dict[int, int]]:
        """What FSDP itself holds now, by category (dtensor_lite.memory_categories), as
        ``{category: {storage data_ptr: bytes}}``: gathered parameters, unsharded gradients
        awaiting reduction, buffers of collectives in flight."""
        out = {UNSHARDED_PARAMS: {}, GRADIENTS: {}, COMM_BUFFERS: {}}
        for g in self.groups:
            for p in g.params:
                _note(out[UNSHARDED_PARAMS], p.raw, *p.inner_tensors)
            _note(out[GRADIENTS], *g.grads, *g.partial_reduce.values())
            if g.pending_ag is not None:
                _note(out[COMM_BUFFERS], *g.pending_ag.buffers())
            _note(out[COMM_BUFFERS], g.post_forward_buf)
        if self.pending_reduce is not None:
            for *_, inp, out_buf in self.pending_reduce.buckets:
                _note(out[COMM_BUFFERS], inp, out_buf)
        return out

    # ----------------------------------------------------------------- forward
    def begin_iteration(self):
        """Root pre-forward. A previous forward that never got a backward leaves uses pending:
        they are dropped (their autograd nodes can no longer reduce anything)."""
        if self.in_backward:  # a forward re-run inside backward (e.g. recomputation)
            return
        if self.forward_order:
            self.prev_forward_order = self.forward_order
        self.forward_order = []
        self.post_forward_order = []
        self.backward_ran = False
        for g in self.groups:
            g.uses_pending = 0
            g.forward_uses = 0
            g.needs_reduce = False
        self._hand_over_post_optim_event()

    def _hand_over_post_optim_event(self):
        """This iteration's first all-gather waits for the event ``set_post_optim_event`` gave
        (on any module under this root), else for the compute stream; an event is used once."""
        event = None
        for st in self.states:
            event = st.post_optim_event if st.post_optim_event is not None else event
            st.post_optim_event = None
        for streams in {id(g.streams): g.streams for g in self.groups}.values():
            streams.wait_event_instead("all_gather", event)  # None clears an unused one

    def reset_iteration(self):
        """Recover from a forward or backward that raised half-way (torch's ``reset_iter_state``).

        Such an iteration never reached its post-forward / end-of-backward hooks, so it left
        groups unsharded, uses pending, unsharded gradients and a reduce-scatter in flight, and
        ``in_backward`` set -- which made the next forward look like a recomputation and its
        backward skip the groups the failed one had not reached. Collectives already issued were
        issued on every rank: they are waited for (their buffers must outlive them) and their
        results dropped; the failed iteration's gradients not yet in ``.grad`` are lost."""
        pending, self.pending_reduce = self.pending_reduce, None
        if pending is not None:
            pending.wait_and_discard()
        self.manual_active = None
        self.reduction_token = None  # an outstanding GradientReductionHandle is invalid now
        for g in self.groups:
            g.post_backward_pending = False
            g.take_grads()
            g.partial_reduce.clear()  # as torch: gradients kept from set_requires_all_reduce(False)
            g.prefetched_in_backward = False
            g.uses_pending = 0
            g.needs_reduce = False
            if g.state is not ShardState.SHARDED or g.pending_ag is not None:
                g.reshard()
        for st in self.states:
            st.to_run.clear()
            st.running.clear()
        self.in_backward = False
        # a backward retried on the same (retained) graph re-arms every forward use; a new
        # forward starts a new iteration anyway
        self.backward_ran = True

    def end_forward_without_backward(self):
        """Root post-forward when nothing requires grad: no backward will reshard, so do it now."""
        for g in self.groups:
            g.uses_pending = 0
            g.needs_reduce = False
            if g.state is not ShardState.SHARDED:
                g.reshard()

    # ----------------------------------------------------------------- backward
    def on_backward(self):
        """Called by every FSDP backward hook; the first one of a backward queues the callback."""
        if self.in_backward:
            return
        self.in_backward = True
        if self.manual_active is None:
            self.manual_active = self.root.manual_backward_finalization
        if self.backward_ran:
            # another backward through the same forward (retain_graph=True): its gradients are
            # reduced and added to .grad like the first one's, so every use is pending again
            for g in self.groups:
                g.uses_pending = g.forward_uses
                g.needs_reduce = g.forward_uses > 0
        autograd_engine.queue_callback(self.end_of_backward)

    def finish_group(self, group: ParamGroup):
        """All uses of ``group`` have their gradients: reduce (unless no-sync), then reshard.

        The order keeps at most one group's buffers alive at a time: the unsharded parameters
        are freed first (their gradients are already computed), then the previous reduction is
        finished (its input and output freed), and only then is this group's reduce-scatter
        input allocated. The unsharded gradients themselves die when the autograd node that
        delivered them returns, right after this."""
        reduce = group.reduce_grads and group.needs_reduce
        if group.needs_reduce and not reduce:  # no-sync: a later backward or finalize reduces
            group.post_backward_pending = True
        grads = group.take_grads() if reduce else None
        if group.reshard_after_backward:
            group.reshard()
        self.finish_pending_reduce()
        if reduce:
            self.pending_reduce = group.start_reduce(grads)

    def finish_pending_reduce(self):
        """Wait for the reduction in flight, add it into the sharded gradients, free its buffers."""
        pending, self.pending_reduce = self.pending_reduce, None
        if pending is not None:
            pending.group.finish_reduce(pending)

    def end_of_backward(self):
        """Queued once per backward: finish groups whose uses did not all get gradients (an
        output that did not reach the loss), finish the last reduce-scatter, reshard.

        Under manual finalization the user's ``finalize_backward`` does the finishing: such
        groups are only marked, and the last reduce-scatter stays in flight."""
        manual = bool(self.manual_active)
        for g in reversed(self.groups):
            if g.uses_pending > 0:
                g.uses_pending = 0
                if manual and g.reduce_grads:
                    g.post_backward_pending = True
                else:
                    self.finish_group(g)
        if self.is_last_backward and not manual:
            self.end_backward_iteration()
        for g in self.groups[:1]:  # gradients were written on the reduce-scatter stream
            g.streams.join("reduce_scatter")
        for g in self.groups:
            g.prefetched_in_backward = False
            if g.state is not ShardState.SHARDED and g.reshard_after_backward:
                g.reshard()
        self.in_backward = False
        self.backward_ran = True
        if OBSERVERS:
            notify("end_of_backward", self.root)

    # ----------------------------------------------------------------- manual finalization
    def finalize_backward(self):
        """``FSDPModule.finalize_backward``'s work: reduce what the backward passes left pending
        (groups marked under manual finalization, gradients accumulated without sync whose sync
        is back on), then reshard. The last reduction stays in flight: ``end_backward_iteration``
        finishes it."""
        for g in reversed(self.groups):
            if g.post_backward_pending and g.reduce_grads:
                g.post_backward_pending = False
                grads = g.take_grads()
                if g.reshard_after_backward and g.state is not ShardState.SHARDED:
                    g.reshard()
                self.finish_pending_reduce()  # one reduction in flight at a time
                self.pending_reduce = g.start_reduce(grads)
            elif g.reshard_after_backward and g.state is not ShardState.SHARDED:
                g.reshard()

    def end_backward_iteration(self):
        """Finish the reduction in flight (gradients into ``.grad``): the iteration's backward
        is over, and the next one may pick its finalization mode afresh."""
        self.finish_pending_reduce()
        for g in self.groups[:1]:  # gradients were written on the reduce-scatter stream
            g.streams.join("reduce_scatter")
        self.manual_active = None


def _note(into: dict[int, int], *tensors):
    for t in tensors:
        if t is not None and t.untyped_storage().nbytes():
            s = t.untyped_storage()
            into[s.data_ptr()] = s.nbytes()
