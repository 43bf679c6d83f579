"""Sharding rules: how each aten op maps input placements to output placements.

A rule is a function ``rule(call: OpCall)`` returning either

* a list of **per-mesh-dim strategies** ``(outs, ins)``: ``outs`` holds one placement per tensor
  output (or a single placement), ``ins`` one placement per DTensor input in ``call.inputs``
  order. The dispatcher expands them over every mesh dim, picking per dim the strategy that moves
  the least data (ties: the one that moves nothing, then list order). This is the shape PyTorch's
  ``register_sharding`` uses, and most rules are a few lines of it; or
* a :class:`Decompose` running a composition of other (DTensor) ops instead; or
* a :class:`FullStrategy` spelling out every mesh dim at once, optionally with a ``local_fn`` that
  replaces the op on local pieces (used where the local computation differs from the global one,
  e.g. a mean over a sharded dim, or a vocab-sharded embedding lookup).

Rules are registered per ``OpOverload`` with :func:`register_rule` (or for a whole overload
packet). The public, PyTorch-compatible spelling is :func:`dtensor_lite.register_sharding`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .._shortcuts import NOT_TAKEN, first as first_shortcut
from .._torch_names import OpOverloadPacket, is_missing, tree_flatten
from ..dtensor import DTensor
from ..spec import DTensorSpec

__all__ = ["OpCall", "FullStrategy", "Decompose", "register_rule", "set_rule", "get_rule",
           "key_scalars_by_value", "intercept_composite", "RULES", "SIGN_KEYED",
           "UnsupportedOpError"]

RULES: dict = {}


class UnsupportedOpError(NotImplementedError):
    """An op on DTensors that dtensor_lite cannot run (and will not guess at)."""


class OpCall:
    """What a rule sees: the op, its args with DTensors replaced by their DTensorSpec."""

    __slots__ = ("op", "args", "kwargs", "inputs", "mesh")

    def __init__(self, op, args, kwargs, inputs: list[DTensorSpec], mesh):
        self.op = op
        self.args = args        # DTensorSpec where the call had a DTensor
        self.kwargs = kwargs
        self.inputs = inputs    # the DTensorSpecs, in flattened argument order
        self.mesh = mesh

    @property
    def name(self) -> str:
        return str(self.op)

    def __repr__(self):
        return f"OpCall({self.op}, inputs={self.inputs})"


@dataclass
class FullStrategy:
    """Placements for every mesh dim: ``outs[k]`` for output k (None for a non-tensor output),
    ``ins[j]`` for DTensor input j (None: keep as is). ``local_fn(*local_args, **kwargs)`` runs
    instead of the op when given. ``out_orders[k]`` optionally gives output k's shard order."""
    outs: Sequence
    ins: Sequence
    local_fn: Callable | None = None
    out_orders: Sequence | None = None
    in_orders: Sequence | None = None


@dataclass
class Decompose:
    """Run ``fn(*args, **kwargs)`` on the DTensor arguments instead of the op: each op inside is
    dispatched (and resharded) on its own. For ops whose sharded form is a short composition of
    supported ops, e.g. an exact variance over a sharded dim as mean, then squared deviations."""
    fn: Callable


# ids of the ops whose decisions the dispatcher caches by the *sign* of their Python number
# arguments, not their values (see register_rule). Ids, as in the dispatcher's keys: op objects
# live forever and OpOverload.__hash__ is a Python method.
SIGN_KEYED: set = set()

# ops whose result is well defined over inputs on different meshes ({op: fn(*args, **kwargs)}
# that runs it per mesh): the foreach ops and the fused optimizer kernels, each index on its own
# mesh (the norm family: each tensor's result on its own mesh). Every other op with inputs on two meshes is an error (the dispatcher's _mesh_of).
CROSS_MESH_OPS: dict = {}

# ops whose named keyword arguments may be plain one-element tensors of any number of dims,
# treated as replicated scalars ({op: names}): torch's fused optimizers take a learning rate
# torch.tensor([0.1]) (and GradScaler's (1,)-shaped found_inf). Elsewhere only 0-d tensors are.
SCALAR_TENSOR_KWARGS: dict = {}


def register_rule(*ops, scalars_by_sign: bool = False, override: bool = False):
    """Decorator: register ``rule`` for each aten op overload (or every overload of a packet).

    ``scalars_by_sign=True`` promises that the decision the rule leads to -- placements, whether
    to decompose, the output metadata -- depends on the op's int / float arguments only through
    their type and sign (positive, negative, zero, NaN), and that any ``local_fn`` or
    decomposition reads the values from the arguments it is called with. The dispatcher then
    reuses one decision for every value of a sign: an optimizer's per-step scalars (AdamW's
    bias corrections) hit the cache instead of deciding again, and the cache stops growing.
    A rule that finds out it cannot keep the promise (e.g. a foreach op whose per-element rule
    reads values) calls :func:`key_scalars_by_value`. An op that has a rule already raises
    (so import order never decides which rule runs) unless ``override=True``."""
    def deco(rule):
        for op in ops:
            for overload in overloads_of(op):
                set_rule(overload, rule, scalars_by_sign, override=override)
        return rule
    return deco


def set_rule(overload, rule, scalars_by_sign: bool = False, *, override: bool = False):
    """Register ``rule`` for one overload (what :func:`register_rule` and the public
    ``register_sharding`` do per overload). A second, different rule for the same overload is
    refused unless ``override=True`` (``register_sharding``, like PyTorch's, overrides)."""
    old = RULES.get(overload)
    if old is not None and old is not rule and not override:
        raise ValueError(
            f"set_rule: {overload} already has the rule {getattr(old, '__qualname__', old)!r} "
            f"(from {getattr(old, '__module__', '?')}); registering "
            f"{getattr(rule, '__qualname__', rule)!r} would silently replace it. Pass "
            "override=True to replace it on purpose, or extend the existing rule")
    RULES[overload] = rule
    if scalars_by_sign:
        SIGN_KEYED.add(id(overload))
    else:
        SIGN_KEYED.discard(id(overload))


def key_scalars_by_value(op):
    """From now on, cache ``op``'s decisions by the values of its number arguments."""
    SIGN_KEYED.discard(id(op))


def overloads_of(op):
    """The overloads a registration for ``op`` covers. A packet's ``out=`` overloads are left
    out: the dispatcher runs them as their functional overload plus a copy into ``out``, while
    a rule written for the functional overload would count ``out`` as one more input."""
    if is_missing(op):  # an op this torch does not have (_torch_names): nothing to register
        return []
    if isinstance(op, OpOverloadPacket):
        overloads = [getattr(op, name) for name in op.overloads()]
        return [o for o in overloads if not any(a.is_out for a in o._schema.arguments)]
    return [op]


def get_rule(op):
    return RULES.get(op)


# ------------------------------------------------------------------ composite ops
_AUTOGRAD_KEYS = ("AutogradCPU", "AutogradCUDA")
# the Python function of an intercepted op (``torch._C._nn.linear`` for ``F.linear``) -> what
# its calls with DTensors run instead (DTensor's ``__torch_function__`` looks here first)
BY_FUNCTION: dict = {}
# op -> its autograd-key kernel, for ops intercepted by function while no hook does that
_BY_FUNCTION_KERNELS: dict = {}
_LIBS = {"always": None, "by_function": None}  # torch.library registrations, kept alive here
_HOOK_INTERCEPTS = [False]  # whether DTensor's __torch_function__ now intercepts by function


def intercept_composite(op, dtensor_fn, function=None):
    """Run ``dtensor_fn(*args, **kwargs)`` instead of ``op`` (a CompositeImplicitAutograd op)
    when a DTensor is among its arguments.

    Such ops decompose at the autograd key, before ``__torch_dispatch__`` sees them, so a rule
    never runs for them while autograd is on; where the decomposition cannot work on DTensors
    (it builds plain tensors from scratch, or reads data to choose shapes) or works slower,
    this replaces it. The op's shortcuts (``_shortcuts.py``) are tried before ``dtensor_fn``.

    Where: ``op``'s autograd-CPU and autograd-CUDA kernels are replaced by one that looks for a
    DTensor among the arguments. That kernel is Python, and every call of the op in the process
    passes through it, DTensors or not: 7-9 us more per plain ``F.linear`` or
    ``F.scaled_dot_product_attention`` (60% of the call at small sizes), a cost on code that
    never touches a DTensor. So an op given its Python ``function`` (e.g. ``F.linear``) is
    intercepted by DTensor's ``__torch_function__`` instead, which only calls with a DTensor
    reach, while that hook is installed (``_fast_path``); calls it does not see (from C++, or
    with subclass torch functions disabled) run the op's decomposition on DTensors, as
    PyTorch's DTensor does. Without the hook (``DTENSOR_LITE_FAST_PATH=0``) the
    autograd kernels are registered for these ops too. Without autograd keys (inference mode)
    the op reaches the dispatcher whole: register a rule for it as well."""
    def on_dtensors(*args, **kwargs):
        out = first_shortcut(op, args, kwargs)  # e.g. _local_linear
        return dtensor_fn(*args, **kwargs) if out is NOT_TAKEN else out

    def kernel(*args, **kwargs):
        # every call of the op in the process comes here: look at flat args without a pytree
        # walk (schemas nest at most one list deep)
        for a in (*args, *kwargs.values()):
            if isinstance(a, DTensor) or (isinstance(a, (list, tuple)) and any(
                    isinstance(x, DTensor) for x in tree_flatten(a)[0])):
                return on_dtensors(*args, **kwargs)
        return op.decompose(*args, **kwargs)

    if function is None:
        _register("always", op, kernel)
        return
    BY_FUNCTION[function] = on_dtensors
    _BY_FUNCTION_KERNELS[op] = kernel
    if not _HOOK_INTERCEPTS[0]:
        _register("by_function", op, kernel)


def _register(which: str, op, kernel) -> None:
    lib = _LIBS[which]
    if lib is None:
        lib = _LIBS[which] = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    name = op._schema.name.split("::")[-1] + (
        "." + op._overloadname if op._overloadname != "default" else "")
    for key in _AUTOGRAD_KEYS:  # a DTensor dispatches on its local tensor's device
        lib.impl(name, kernel, key)


def hook_intercepts(on: bool) -> None:
    """DTensor's ``__torch_function__`` intercepts the ops of ``BY_FUNCTION`` from now on (the
    ops' autograd kernels are removed), or (False) no longer does (they are registered)."""
    if on == _HOOK_INTERCEPTS[0]:
        return
    _HOOK_INTERCEPTS[0] = on
    lib = _LIBS["by_function"]
    if on:
        if lib is not None:
            lib._destroy()
            _LIBS["by_function"] = None
    else:
        for op, kernel in _BY_FUNCTION_KERNELS.items():
            _register("by_function", op, kernel)
