"""Shortcut: a tensor-parallel ``linear`` run on the local pieces, as one autograd node.

Column-parallel (x Replicate, weight and bias Shard(0): output Shard(-1)) and row-parallel
(x Shard(-1), weight Shard(1), bias Replicate: output Partial) linears on a 1-D mesh need no
communication. Through the general path, while autograd records, ``linear``'s composite is four
DTensor ops (view, t, addmm, view) and its backward about ten, a dispatch each. Here the forward
is torch's own composite on the local pieces, and the backward the very kernels autograd would
run for it (``mm_mat1_backward`` / ``mm_mat2_backward`` of its ``addmm`` or ``mm``, ``sum_to``
for the bias), so values and gradients equal the general path's to the bit
(tests/test_step_fast_paths.py). Each input's gradient is laid out as the DTensor ops give it:
column-parallel x gets a Partial gradient (its contraction is over the sharded features), weight
and bias their own Shard; row-parallel weight and x their own Shard, and the bias (added on
coordinate 0 only, as the composite's Replicate -> Partial does) a Replicate gradient.

Taken for 2-D and 3-D inputs of one real dtype on one 1-D mesh with the default shard order, while
autograd records and no dispatch mode or trace is active; decided once per input specs.
"""
from __future__ import annotations

import math

import torch

from . import _caches, debug_state
from . import _torch_names as torch_names
from ._shortcuts import NOT_TAKEN, shortcut
from ._unseen import unseen_fn
from .compile_support import is_traced
from .dtensor import DTensor, local_grad_of
from .placements import Partial, Replicate, Shard
from .redistribute import redistribute_local
from .redistribute.planner import _PLANS
from .spec import DTensorSpec, TensorMeta, contiguous_stride

__all__ = ["local_linear", "plan_of", "forward_local", "backward_local"]

aten = torch_names.aten
R = Replicate()
_grad_enabled = torch.is_grad_enabled
_dispatch_modes = torch_names.len_torch_dispatch_stack
_LINEAR_PLANS: dict = _caches.register_decisions({})
_NOT_LOCAL = object()
_composite = aten.linear.default.decompose  # torch's own linear on plain tensors
_linear = torch.nn.functional.linear  # the same composite kernel, through torch's faster binding
_mode_on = torch_names.torch_function_mode_enabled


class _LinearPlan:
    __slots__ = ("out_spec", "x_grad", "w_grad", "b_grad", "bias_partial")


@shortcut(aten.linear.default)
def local_linear(input, weight, bias=None):
    if not (_grad_enabled() and type(input) is DTensor and type(weight) is DTensor and
            (bias is None or type(bias) is DTensor)):
        return NOT_TAKEN
    plan = plan_of(input._spec, weight._spec, None if bias is None else bias._spec)
    if plan is None or _dispatch_modes() or \
            is_traced(input._local_tensor) or is_traced(weight._local_tensor):
        return NOT_TAKEN
    return _LocalLinear.apply(input, weight, bias, plan)


def plan_of(x_spec, w_spec, b_spec) -> "_LinearPlan | None":
    """The local plan of ``linear`` on DTensors of these specs (cached), or None: not local."""
    key = (x_spec, w_spec, b_spec)
    plan = _LINEAR_PLANS.get(key)
    if plan is None:
        plan = _caches.remember(_LINEAR_PLANS, key, _plan(*key) or _NOT_LOCAL, _PLANS)
    return None if plan is _NOT_LOCAL else plan


def _plan(x, w, b) -> "_LinearPlan | None":  # specs
    mesh = x.mesh
    specs = [x, w] + ([] if b is None else [b])
    if mesh.ndim != 1 or mesh._coordinate is None or w.ndim != 2 or x.ndim not in (2, 3) or \
            x.dtype.is_complex or \
            x.shape[-1] != w.shape[1] or any(
                s.mesh is not mesh or not s.has_default_order or
                s.dtype != x.dtype for s in specs) or \
            (b is not None and (b.ndim != 1 or b.shape[0] != w.shape[0])):
        return None
    last = x.ndim - 1
    xp, wp = x.placements[0], w.placements[0]
    bp = None if b is None else b.placements[0]
    plan = _LinearPlan()
    plan.bias_partial = None
    if xp.is_replicate() and wp.is_shard(0) and bp in (None, Shard(0)):  # column-parallel
        out, x_grad, b_grad = Shard(last), (Partial("sum"),), (Shard(0),)
    elif xp.is_shard(last) and wp.is_shard(1) and bp in (None, R):  # row-parallel
        out, x_grad, b_grad = Partial("sum"), (xp,), (R,)
        if b is not None:
            plan.bias_partial = b.with_placements((Partial("sum"),))
    else:
        return None
    plan.x_grad = x.with_placements(x_grad)
    plan.w_grad = w.with_placements((wp,))
    plan.b_grad = None if b is None else b.with_placements(b_grad)
    shape = tuple(x.shape[:-1]) + (w.shape[0],)
    plan.out_spec = DTensorSpec(mesh, (out,), TensorMeta(torch.Size(shape),
                                                         contiguous_stride(shape), x.dtype))
    return plan


class _LocalLinear(torch.autograd.Function):
    @staticmethod
    @unseen_fn
    def forward(ctx, x, w, b, plan):
        ctx.plan, ctx.has_bias = plan, b is not None
        return DTensor(forward_local(ctx, x._local_tensor, w, b, plan), plan.out_spec)

    @staticmethod
    def backward(ctx, grad):
        with debug_state.outermost_cause("from_local.backward"):
            return _LocalLinear._backward(ctx, grad)

    @staticmethod
    @unseen_fn
    def _backward(ctx, grad):
        return (*backward_local(ctx, local_grad_of(grad, ctx.plan.out_spec)), None)


def forward_local(ctx, xl, w, b, plan):
    """The local result of the linear ``plan`` on ``x``'s piece ``xl``; saves what
    :func:`backward_local` needs on ``ctx``."""
    # contiguous: the local kernels the composite would pick for this (contiguous) wrapper
    xl, wl = xl.contiguous(), w._local_tensor
    bl = None
    if b is not None:
        bl = b._local_tensor
        if plan.bias_partial is not None:  # Replicate -> Partial: zeros off coordinate 0
            bl = redistribute_local(bl, b._spec, plan.bias_partial)
    ctx.save_for_backward(xl, wl)
    return _local_linear_kernel(xl, wl, bl)


def _local_linear_kernel(xl, wl, bl):
    """torch's ``linear`` composite on the local pieces (autograd off: inside a Function's
    forward). ``F.linear`` reaches that very kernel for plain tensors at half the call cost of
    ``decompose``; a subclass piece (whose ``__torch_function__`` could take ``F.linear`` over)
    or an active TorchFunctionMode (which would see our internal call) gets ``decompose``,
    which runs the composite whatever the pieces' hooks, as the general path's ops would."""
    return (_linear if bindings_see_plain(xl, wl, bl) else _composite)(xl, wl, bl)


_PLAIN = (torch.Tensor, type(None))


def bindings_see_plain(*pieces) -> bool:
    """Whether a local kernel may go through torch's Python bindings: every piece a plain
    tensor (or None) and no TorchFunctionMode active (see ``_local_linear_kernel``)."""
    return all(type(p) in _PLAIN for p in pieces) and not _mode_on()


def backward_local(ctx, g):
    """(x, weight, bias) gradients of :func:`forward_local` as DTensors (None where not needed),
    from ``g``, the local piece of the output's gradient laid out as the plan's output with
    Partial as Replicate (as from_local's backward gives it)."""
    plan = ctx.plan
    xl, wl = ctx.saved_tensors
    # the composite ran addmm (bias) or mm on x reshaped 2-D (explicit sizes: a piece may be
    # empty) and weight.t(): their backwards, through the reshapes' own
    g2, x2 = (g, xl) if xl.ndim == 2 else (_rows(g), _rows(xl))
    gx = gw = gb = None
    need = ctx.needs_input_grad
    if need[0]:
        gx = DTensor(_mat1_grad(g2, wl.t(), x2).reshape(xl.shape), plan.x_grad)
    if need[1]:
        gw = DTensor(_mat2_grad(g2, x2, wl.t()).t(), plan.w_grad)
    if ctx.has_bias and need[2]:
        gb = DTensor(g2.sum(0), plan.b_grad)  # sum_to(grad, bias shape): the leading dim
    return gx, gw, gb


def _rows(t):
    """``t`` as (rows, last dim), as torch's linear flattens it."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _mat1_grad(grad, mat2, mat1):
    """autograd's ``mm_mat1_backward(grad, mat2, ...)`` (alpha 1), branch for branch."""
    s, n = mat1.stride(), mat1.shape
    if s[0] == 1 and s[1] == n[0]:  # a column-major input gets a column-major gradient
        return mat2.mm(grad.t()).t()
    return grad.mm(mat2.t())


def _mat2_grad(grad, mat1, mat2):
    """autograd's ``mm_mat2_backward(grad, mat1, ...)`` (alpha 1), branch for branch."""
    s, n = mat2.stride(), mat2.shape
    if s[0] == 1 and s[1] == n[0]:
        return grad.t().mm(mat1).t()
    return mat1.t().mm(grad)
