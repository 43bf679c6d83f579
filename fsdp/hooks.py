"""The forward / backward hooks that schedule unshard, reshard and reduce-scatter.

Timeline of one training step for a group G (not the root)::

    pre-forward   unshard G (all-gather; or wait for a prefetch), prefetch the next group,
                  publish G's unsharded tensors on its modules through ``_Unsharded``
    post-forward  reshard G (unless reshard_after_forward=False / root), hook G's outputs
    pre-backward  (hook on an output's gradient) unshard G again, prefetch the previous group
                  (CUDA; on CPU from the post-backward: ``Streams.prefetch_at_pre_backward``)
    post-backward (``_Unsharded.backward``: all gradients of this use are in) when it was the
                  last pending use: reshard G, finish the previous group's reduction, pack
                  G's gradients and issue their reduce-scatter (state.RootContext.finish_group)
    end of backward (one autograd-engine callback per backward) finish leftovers, wait for the
                  last reduce-scatter, reshard everything

The next pre-backward finishes that reduce-scatter (CPU: waits for it; CUDA: the reduce-scatter
stream waits, the compute stream does not), so a group's gradient buffers never live beside
another group's backward compute (docs/fsdp.md, "Memory").

``_Unsharded`` is how autograd learns about the unsharded parameters: its forward returns the
unsharded tensors (aliases of FSDP's buffers), so every op of the module that uses them saves and
differentiates them as usual; its backward receives, in one call, the gradients of all of them
for that forward use. It takes the sharded parameters as inputs only so that its outputs require
grad; it returns no gradient for them (FSDP writes the reduced gradient itself).

Activation checkpointing re-runs a block's forward inside backward, and the recomputation must
save exactly what the original forward saved and cost no communication:

* checkpoint *inside* the FSDP module (``checkpoint_wrapper`` then ``fully_shard``): no FSDP hook
  runs in the recomputation; it sees whatever the pre-backward hook published. So the pre-backward
  hook publishes grad-tracking tensors too (``_Unsharded``, not counted as a use): with
  non-reentrant checkpointing they only make the recomputed ops save what the forward saved; with
  reentrant checkpointing (forward under no_grad) the gradients arrive through them.
* checkpoint *around* the FSDP module (``fully_shard`` then checkpointing): the FSDP forward hooks
  run again inside backward. They touch no per-iteration state (non-reentrant recomputation may
  stop half-way, before any post-forward), never reshard, and count a use only when the original
  forward ran without grad (reentrant), so the block's gradients are reduced exactly once.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from dtensor_lite._torch_names import current_graph_task_id, disable_dynamo

from .observers import OBSERVERS, notify
from .param_group import ShardState
from .state import FSDPState

__all__ = ["pre_forward", "post_forward", "wrap_forward_method", "reshard_for_state_dict", "map_tensors",
           "collect_tensors"]


# ===================================================================== autograd glue
class _Unsharded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *sharded_trainable):
        ctx.group = group
        ctx.set_materialize_grads(False)  # unused parameters give None, not zero tensors
        outs = tuple(group.unsharded_aliases())
        frozen = [o for o, p in zip(outs, group.params) if not p.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        group = ctx.group
        _post_backward(group, [grads[i] for i in group.trainable])
        return (None,) * (1 + len(group.trainable))


def _post_backward(group, grads):
    ctx = group.root_ctx
    ctx.on_backward()
    group.accumulate(grads)
    group.uses_pending = max(group.uses_pending - 1, 0)
    state = group.modules[0].__dict__["_fsdp_state"]
    if group.uses_pending == 0:
        ctx.finish_group(group)
        if not group.streams.prefetch_at_pre_backward:
            _prefetch_backward_once(state)
    if OBSERVERS:
        notify("post_backward", state)


def _publish_for_forward(group, counted: bool = True):
    """Give the group's modules fresh unsharded tensors for this forward use.

    ``counted``: a forward use whose gradients the group waits for; an uncounted publication
    (backward, recomputation) only makes the tensors track grad, and its node, should gradients
    reach it (reentrant checkpointing), stands in for the forward use it recomputes.
    """
    if torch.is_grad_enabled() and group.trainable:
        tensors = _Unsharded.apply(group, *[group.params[i].sharded for i in group.trainable])
        if counted:
            group.uses_pending += 1
            group.needs_reduce = True
            if not group.root_ctx.in_backward:  # a recomputation counts anew in each backward
                group.forward_uses += 1
    else:
        tensors = group.unsharded_aliases()
    group.publish(tensors)


def _recomputing() -> bool:
    """A module forward running inside the autograd engine: checkpointing's recomputation."""
    return current_graph_task_id() != -1


# ===================================================================== forward hooks
# torch.compile: FSDP's hooks run eagerly, outside any graph (one graph break before and one after
# a compiled module's forward, as in torch's FSDP); they schedule communication and keep
# per-step state, which a graph would freeze. The forward between them compiles, on the
# unsharded tensors the pre-forward hook published.
_eager = disable_dynamo  # imports Dynamo at the first call, not at import


@_eager
def pre_forward(state: FSDPState, module: nn.Module, args, kwargs):
    if id(module) in state.in_method:  # called by its own registered method: already in use
        return _cast_inputs(state, args, kwargs)
    if state.ctx is not None and _recomputing():
        _pre_recompute(state)
        return _cast_inputs(state, args, kwargs)
    if state.ctx is None:
        state.init_as_root()
    ctx = state.ctx
    if ctx.reduction_token is not None:
        # finalize_backward(async_op=True) left reductions in flight that write .grad
        raise RuntimeError(
            f"FSDP forward of {type(module).__name__}: the previous gradient reduction must be "
            "waited on before forward: call wait() on the handle finalize_backward(async_op=True) "
            "returned")
    if id(module) in state.running or (state.is_root and ctx.in_backward):
        # this module's last forward, or the last backward, raised half-way: start afresh
        ctx.reset_iteration()
    state.running.add(id(module))
    new_use = not state.to_run
    if new_use:
        state.to_run = {id(m) for m in state.modules}
        if state.is_root:
            ctx.begin_iteration()
        group = state.group
        if group is not None:
            group.unshard(keep_post_forward_piece=torch.is_grad_enabled(),
                          lend=group.lends_in_forward())
            ctx.forward_order.append(group)
            _prefetch_forward(state, ctx)
            _publish_for_forward(group)
        if OBSERVERS:
            notify("pre_forward", state)
    return _cast_inputs(state, args, kwargs)


def _cast_inputs(state: FSDPState, args, kwargs):
    mp = state.mp_policy
    if mp.cast_forward_inputs and mp.param_dtype is not None:
        args, kwargs = map_tensors(_caster(mp.param_dtype), (args, kwargs))
    return args, kwargs


def _pre_recompute(state: FSDPState):
    """Pre-forward of a recomputation in backward. Non-reentrant: the pre-backward hook has
    gathered the group (no communication here). Reentrant: the original forward ran without grad
    and counted no use, so this one counts, and its all-gather is the one backward needs anyway."""
    group = state.group
    if group is None:
        return
    if group.state is not ShardState.UNSHARDED:
        group.unshard()
    _publish_for_forward(group, counted=group.uses_pending == 0)


@_eager
def post_forward(state: FSDPState, module: nn.Module, args, output):
    if id(module) in state.in_method:  # the method's own post-forward ends the use
        return _cast_output(state, output)
    if _recomputing():  # keep the parameters: the backward running now needs them
        _hook_grad_outputs(state, output)
        return _cast_output(state, output)
    state.to_run.discard(id(module))
    state.running.discard(id(module))
    use_done = not state.to_run
    group = state.group
    if use_done and group is not None:
        group.reshard_post_forward()
        state.ctx.post_forward_order.append(group)
    hooked = _hook_grad_outputs(state, output)
    if use_done and state.is_root and not hooked:
        state.ctx.end_forward_without_backward()
    if use_done and OBSERVERS:
        notify("post_forward", state)
    return _cast_output(state, output)


def wrap_forward_method(module: nn.Module, method: Callable) -> Callable:
    """``method`` (bound to ``module``) run between ``pre_forward`` and ``post_forward``, as
    ``nn.Module.__call__`` runs ``forward`` (``register_fsdp_forward_method``). Calls of the module
    or of another registered method from inside it are part of this use: they run bare."""
    state = module.__dict__["_fsdp_state"]
    key = id(module)

    @functools.wraps(method)
    def run_as_forward(*args, **kwargs):
        if key in state.in_method:
            return method(*args, **kwargs)
        args, kwargs = pre_forward(state, module, args, kwargs)
        state.in_method.add(key)
        try:
            output = method(*args, **kwargs)
        except BaseException:
            state.in_method.discard(key)
            post_forward(state, module, args, None)  # as a raising forward does: end the use
            raise
        state.in_method.discard(key)
        return post_forward(state, module, args, output)

    return run_as_forward


def _hook_grad_outputs(state: FSDPState, output) -> bool:
    """Register the pre-backward hook on every output that requires grad; whether any did."""
    if not torch.is_grad_enabled():
        return False
    grad_outputs = [t for t in collect_tensors(output) if t.requires_grad]
    for t in grad_outputs:
        t.register_hook(_PreBackward(state))
    return bool(grad_outputs)


def _cast_output(state: FSDPState, output):
    if state.mp_policy.output_dtype is not None:
        output = map_tensors(_caster(state.mp_policy.output_dtype), output)
    return output


class _PreBackward:
    """Tensor hook on a forward output: its gradient is about to flow into the module."""
    __slots__ = ("state",)

    def __init__(self, state):
        self.state = state

    def __call__(self, grad):
        state = self.state
        state.ctx.on_backward()
        # the previous group's reduce-scatter: done before this group computes, so its buffers
        # never live beside another group's backward
        state.ctx.finish_pending_reduce()
        group = state.group
        if group is None:
            return None
        group.check_unwritten()  # a shard written since forward gathered it: refused
        if group.state is not ShardState.UNSHARDED and group.unshard_in_backward:
            group.unshard()
        if group.state is ShardState.UNSHARDED:
            # grad-tracking tensors for a checkpointed forward that recomputes inside this
            # module (backward runs with grad off)
            with torch.enable_grad():
                _publish_for_forward(group, counted=False)
        if group.streams.prefetch_at_pre_backward:
            _prefetch_backward_once(state)
        if OBSERVERS:
            notify("pre_backward", state)
        return None


def reshard_for_state_dict(state: FSDPState, *_args, **_kwargs):
    """Before ``state_dict`` / ``load_state_dict``: show the sharded parameters. A backward still
    to come all-gathers them again (into the same storage its saved tensors point at)."""
    group = state.group
    if group is not None and group.state is not ShardState.SHARDED:
        group.reshard()


# ===================================================================== prefetching
def _prefetch(groups, backward: bool = False):
    for g in groups:
        if g is not None and g.state is not ShardState.UNSHARDED and \
                (g.unshard_in_backward or not backward):
            g.start_unshard()


def _prefetch_forward(state: FSDPState, ctx):
    if state.forward_prefetch is not None:
        return _prefetch([s.group for s in state.forward_prefetch])
    # implicit: the group that followed this one in the previous iteration's forward
    pos = len(ctx.forward_order) - 1
    prev = ctx.prev_forward_order
    if pos + 1 < len(prev) and prev[pos] is state.group and prev[pos + 1] is not state.group:
        _prefetch([prev[pos + 1]])


def _prefetch_backward_once(state: FSDPState):
    """Backward prefetch, once per group and backward: from its pre-backward where the
    collective overlaps the group's backward for real (CUDA), else from its post-backward
    (``Streams.prefetch_at_pre_backward`` says why)."""
    group = state.group
    if not group.prefetched_in_backward:
        group.prefetched_in_backward = True
        _prefetch_backward(state, state.ctx)


def _prefetch_backward(state: FSDPState, ctx):
    if state.backward_prefetch is not None:
        return _prefetch([s.group for s in state.backward_prefetch], backward=True)
    # implicit: the group whose forward finished just before this one's (last) forward did
    order = ctx.post_forward_order
    group = state.group
    for i in range(len(order) - 1, -1, -1):
        if order[i] is group:
            for j in range(i - 1, -1, -1):
                if order[j] is not group:
                    if order[j].uses_pending > 0:
                        _prefetch([order[j]], backward=True)
                    return
            return


# ===================================================================== pytrees
def _caster(dtype: torch.dtype) -> Callable:
    def cast(t: torch.Tensor):
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
    return cast


def map_tensors(fn: Callable, obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor inside the containers torch's pytree knows
    (``torch.utils._pytree``: lists, tuples, namedtuples, dicts, OrderedDicts, ...) and inside
    dataclasses, which the pytree takes as leaves (one is copied only where a field changed)."""
    def leaf(x):
        if isinstance(x, torch.Tensor):
            return fn(x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return _map_dataclass(fn, x)
        return x
    return pytree.tree_map(leaf, obj)


def _map_dataclass(fn: Callable, obj: Any) -> Any:
    changes = {}
    for f in dataclasses.fields(obj):
        old = getattr(obj, f.name)
        new = map_tensors(fn, old)
        if new is not old:
            changes[f.name] = new
    if not changes:
        return obj
    out = copy.copy(obj)
    for name, value in changes.items():
        object.__setattr__(out, name, value)  # also works for frozen dataclasses
    return out


def collect_tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def visit(t):
        out.append(t)
        return t
    map_tensors(visit, obj)
    return out
