"""The op dispatcher behind ``DTensor.__torch_dispatch__``.

Per aten op: build a cache key from the op, the input specs and the non-tensor arguments; on a
miss, ask the op's sharding rule for strategies, pick the cheapest, and record a *decision* (the
specs each input must have, the output specs, and how to run the local op); on every call,
redistribute the inputs that differ, run the op on local pieces and wrap the results.

A cache hit does only what cannot be cached: walk the arguments once to build the key and collect
the local tensors, run the local op, and build the output wrappers.

Python numbers are in the key by type and value (they can change dtype promotion and some
rules), except for ops registered with ``scalars_by_sign`` (pointwise, foreach and fused optimizer
ops, whose rules read signs only): there only their type and sign are, so an optimizer's per-step
scalars and an LR schedule reuse one decision. The cache is an LRU of bounded size.

Read top-down: the cache key and the hot path (``dispatch``), a decision and how it runs,
``_decide`` (rule -> strategies -> targets and output specs), then the decisions that are not a
rule's: plain tensors inside backward, decompositions, and ops without a rule (``_fallback``).
In-place view ops, ``out=`` overloads and views that had to copy live in ``_aliasing``.

A local kernel that raises on data only this rank holds (ids of a sharded index tensor out of
range, an empty piece) is reported to the other ranks (``_failures.on_kernel_error``) so they
stop at their next collective instead of waiting for it.
"""
from __future__ import annotations

import itertools
import operator
from contextvars import ContextVar

import torch

from . import _aliasing, _caches, _failures, _fallback, _unchecked, debug, debug_state
from ._aliasing import COPIED_VIEWS
from .compile_support import is_traced
from ._quick_call import quick_callable
from ._torch_names import (aten, current_autograd_node, len_torch_dispatch_stack,
                           make_wrapper_subclass, tree_map)
from .dtensor import DTensor, use_dispatcher
from .ops import _registry
from .ops._expansion import expand_strategies
from .ops._registry import Decompose, FullStrategy, OpCall, UnsupportedOpError
from .ops.kit import target_spec
from .random import ensure_rng_synced
from .redistribute import plan_redistribute, redistribute_local, redistribute_locals
from .placements import Replicate as _Replicate
from .spec import DTensorSpec, TensorMeta, contiguous_stride as _contiguous_stride, \
    outside_shape as _outside_shape

__all__ = ["dispatch"]

# bounded (see _caches): a program that keeps meeting new shapes or by-value scalars re-decides
# its oldest combinations instead of growing
_DECISIONS: dict = _caches.register_decisions(_caches.LRUCache(_caches.DECISIONS_MAX))
_touch = _DECISIONS.move_to_end
_DETACH = aten.detach.default
_SIGN_KEYED = _registry.SIGN_KEYED
_NUMBER_TYPES = (int, float, bool, complex)


# ------------------------------------------------------------------ cache key
_INTS = object()  # in the key of a list / tuple of ints only: (type, _INTS, the ints)


def _key(a, dts: list):
    """Hashable stand-in for one argument; collects DTensors into ``dts`` (flattened order)."""
    t = type(a)
    if t is DTensor:
        dts.append(a)
        return a._spec
    if t in _NUMBER_TYPES:
        return (t, a)  # 1, 1.0 and True promote differently: keep the type in the key
    if t is list or t is tuple:
        for x in a:
            if type(x) is not int:
                # ints inline (shapes, dims): the key _key would give them
                return (t, tuple([(int, x) if type(x) is int else _key(x, dts) for x in a]))
        return (t, _INTS, tuple(a))  # only ints (a shape, dims): the ints themselves
    if isinstance(a, DTensor):
        dts.append(a)
        return a._spec
    if isinstance(a, torch.Tensor):
        if a.ndim == 0:  # a 0-d plain tensor acts as a replicated scalar; its value is not in the key
            return ("0-d", a.dtype, a.device)
        return ("plain", tuple(a.shape))
    return a


def _signed(a, dts: list):
    """Like :func:`_key`, but an int / float stands for its type and sign class only."""
    t = type(a)
    if t is float or t is int:
        return (t, (a > 0) - (a < 0) if a == a else 2)  # 2: NaN
    if t is list or t is tuple:
        # a foreach op's list of DTensors (every parameter, every optimizer step): keyed by
        # their specs in one C-level pass
        if _only_dtensors(a):
            dts.extend(a)
            return (t, tuple(map(_SPEC_OF, a)))
        return (t, tuple([_signed(x, dts) for x in a]))
    return _key(a, dts)


_SPEC_OF = operator.attrgetter("_spec")
_LOCAL_OF = operator.attrgetter("_local_tensor")
_ONLY_DTENSOR = {DTensor}


def _only_dtensors(a) -> bool:
    """Whether the non-empty list / tuple ``a`` holds exactly-DTensor objects only (C-level)."""
    return bool(a) and set(map(type, a)) == _ONLY_DTENSOR


_BY_SIGN = object()  # marks sign-class keys: never equal to a by-value key of the same op
# non-empty while _fast_path learns what one torch function dispatches: each entry is a list
# that collects (op, args, kwargs, decision, result) for every op dispatched meanwhile
RECORDERS: list = []


def cache_key(op, args, kwargs, dts: list) -> tuple:
    """The decision cache's key for one call; collects the call's DTensors into ``dts``."""
    opid = id(op)  # OpOverload.__hash__ is a Python method; op objects live forever, ids are stable
    if opid in _SIGN_KEYED:  # foreach / fused optimizer ops: the rule promised to read signs only
        key = [opid, _BY_SIGN]
        key += [_signed(a, dts) for a in args]
        if kwargs:
            key.append(tuple([(k, _signed(v, dts)) for k, v in kwargs.items()]))
        return tuple(key)
    key = [opid]
    for a in args:
        t = type(a)
        if t is DTensor:
            dts.append(a)
            key.append(a._spec)
        elif t in _NUMBER_TYPES:
            key.append(t)  # 1, 1.0 and True promote differently: the type is part of the key
            key.append(a)
        else:
            key.append(_key(a, dts))
    if kwargs:
        key.append(tuple([(k, _key(v, dts)) for k, v in kwargs.items()]))
    return tuple(key)


def _observed(op, args, kwargs):
    """``dispatch`` of a call someone watches: CommDebugMode (which op caused each collective)
    or ``_fast_path`` learning what a torch function dispatches (RECORDERS)."""
    if debug_state.COMM_SINKS:  # CommDebugMode records which op caused each collective
        with debug_state.comm_cause(op):
            # a call _fast_path learns under CommDebugMode must still be recorded: an empty
            # recording would mark its function as never replayable
            return _recorded(op, args, kwargs) if RECORDERS else dispatch(op, args, kwargs, True)
    if RECORDERS:
        return _recorded(op, args, kwargs)
    return dispatch(op, args, kwargs, True)


def dispatch(op, args, kwargs, observed=False):
    if not observed and (RECORDERS or debug_state.COMM_SINKS):
        return _observed(op, args, kwargs)  # once; its own dispatch passes observed=True
    if op is _DETACH and not (kwargs or COPIED_VIEWS) and type(args[0]) is DTensor and \
            type(args[0]._local_tensor) is torch.Tensor:
        # autograd's own detach (AccumulateGrad storing each gradient, every step): what its
        # decision gives -- the piece's detach under the same spec -- without key or lookup
        a = args[0]
        return _wrap_as(a._local_tensor.detach(), a._spec)
    # The hot path: one pass over the args builds the key and collects the DTensors. Specs are
    # interned, so hashing the key never calls back into Python.
    dts: list = []
    if id(op) in _SIGN_KEYED or kwargs:
        key = cache_key(op, args, kwargs, dts)
    else:  # cache_key's common case inline: positional args only
        key = [id(op)]
        for a in args:
            t = type(a)
            if t is DTensor:
                dts.append(a)
                key.append(a._spec)
            elif t in _NUMBER_TYPES:
                key.append(t)
                key.append(a)
            else:
                key.append(_key(a, dts))
        key = tuple(key)
    if not kwargs:
        kwargs = _EMPTY
    d = _DECISIONS.get(key)
    if d is None:
        d = _decide(op, args, kwargs, dts)
        if len(key) < 2 or key[1] is not _BY_SIGN or id(op) in _SIGN_KEYED:
            _DECISIONS[key] = d  # else the rule withdrew its sign promise: the next call keys by value
        return d.run(args, kwargs, dts, validate=True)
    _touch(key)
    if not d.fast:
        return d.run(args, kwargs, dts)
    # cache hit of the common shape: DTensors at top level, nothing to move
    if COPIED_VIEWS:
        _aliasing.check_not_copied_view(d, dts)
    largs = list(args)
    for pos, dt in zip(d.flat_positions, dts):
        largs[pos] = dt._local_tensor
    try:
        out = d.local_fn(*largs, **kwargs)
    except Exception as e:  # an error only this rank's data raises must not strand the others
        _failures.on_kernel_error(op, e, [dt._spec for dt in dts],
                                  [dt._local_tensor for dt in dts])
        raise
    if d.mutated is not None:
        return dts[d.mutated]  # in-place: the destination DTensor already has the right spec
    # positional: (cls, size, strides, storage_offset, memory_format, dtype, layout, device)
    r = _make_wrapper(DTensor, d.out_shape, d.wrap_stride, None, None, d.out_dtype, out.layout,
                      out.device)
    r._local_tensor = out
    r._spec = d.out_specs
    if COPIED_VIEWS and d.view_src is not None:
        _aliasing.mark_if_copied_view(d, dts, r)
    return r


def _recorded(op, args, kwargs):
    """``dispatch``, telling every active recorder which decision ran and what it returned."""
    out = dispatch(op, args, kwargs, True)
    d = _DECISIONS.get(cache_key(op, args, kwargs, []))
    for recorder in RECORDERS:
        recorder.append((op, args, kwargs, d, out))
    return out


_EMPTY: dict = {}
_make_wrapper = make_wrapper_subclass


def _wrap_as(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """``DTensor(local, spec)`` with the wrapper built from positional arguments (as the hot
    path builds it: the keyword form costs more per call)."""
    meta = spec.tensor_meta
    r = _make_wrapper(DTensor, meta.shape, meta.stride, None, None, meta.dtype, local.layout,
                      local.device)
    r._local_tensor = local
    r._spec = spec
    return r


# ------------------------------------------------------------------ decisions
class _Decision:
    """What to do for one (op, input specs, non-tensor args) combination."""

    __slots__ = ("op", "targets", "out_specs", "out_kind", "local_fn", "flat_positions",
                 "mutated", "needs_redistribute", "out_shape", "out_dtype", "wrap_stride", "fast",
                 "view_src", "copies_view", "relayout")

    def run(self, args, kwargs, dts, validate=False):
        if COPIED_VIEWS:
            _aliasing.check_not_copied_view(self, dts)
        targets = self.targets
        if self.relayout:  # before anything moves: the destination's piece must be its own
            why = _aliasing.relayout_blocker(dts[self.mutated])
            if why is not None:
                return _aliasing.write_through(self.op, args, kwargs, dts[self.mutated],
                                               targets[self.mutated], why)
        if self.needs_redistribute:
            if debug_state.EXPLICIT:
                _observe_rule_redistribute(self.op, dts, targets)
            if _unchecked.any_marked(dts):  # pieces no rank compared: sizes checked first
                with _unchecked.checking():
                    locals_ = _redistribute_attributed(self.op, dts, targets)
            elif debug_state.COMM_SINKS:
                locals_ = _redistribute_attributed(self.op, dts, targets)
            elif len(dts) > 1:  # several inputs may share one collective (redistribute_locals)
                locals_ = redistribute_locals([dt._local_tensor for dt in dts],
                                              [dt._spec for dt in dts], targets)
            else:
                locals_ = [dt._local_tensor if tgt is None else
                           redistribute_local(dt._local_tensor, dt._spec, tgt)
                           for dt, tgt in zip(dts, targets)]
        elif self.flat_positions is None and not self.relayout:
            locals_ = None  # lists of DTensors (foreach ops): pieces taken per argument below
        else:
            locals_ = [dt._local_tensor for dt in dts]
        if self.relayout:  # the destination itself becomes its reduced piece and spec
            _aliasing.relayout_destination(dts[self.mutated], locals_[self.mutated],
                                           targets[self.mutated])
        positions = self.flat_positions
        if positions is not None:
            largs = list(args)
            for pos, loc in zip(positions, locals_):
                largs[pos] = loc
            lkwargs = kwargs
        elif locals_ is None:
            largs = [_pieces(a) for a in args]
            lkwargs = {k: _pieces(v) for k, v in kwargs.items()}
        else:
            it = iter(locals_)
            largs = [_swap(a, it) for a in args]
            lkwargs = {k: _swap(v, it) for k, v in kwargs.items()}
        try:
            out = self.local_fn(*largs, **lkwargs)
        except Exception as e:  # an error only this rank's data raises must not strand the others
            _failures.on_kernel_error(self.op, e, [dt._spec if t is None else t for dt, t in
                                                   zip(dts, targets)],
                                      locals_ or [dt._local_tensor for dt in dts])
            raise
        if validate:
            _validate_outputs(self, out)
        if self.view_src is None:
            return self._wrap(out, dts)
        return _aliasing.mark_if_copied_view(self, dts, self._wrap(out, dts))

    def _wrap(self, out, dts):
        kind = self.out_kind
        if kind == "tensor":
            if self.mutated is not None:
                return dts[self.mutated]
            return _wrap_as(out, self.out_specs)
        if kind == "seq":
            res = [o if s is None else _wrap_as(o, s) for o, s in zip(out, self.out_specs)]
            return tuple(res) if isinstance(out, tuple) else res
        return out  # non-tensor result (e.g. a Python scalar from item())


def _redistribute_attributed(op, dts, targets) -> list:
    """The inputs' local pieces as ``targets`` want them, each move labelled with its input's
    index for CommDebugMode."""
    return redistribute_locals([dt._local_tensor for dt in dts], [dt._spec for dt in dts],
                               targets, cause=lambda j: debug_state.comm_cause(op, j))


def _observe_rule_redistribute(op, dts, targets):
    moves = [(j, dt._spec, t, plan_redistribute(dt._spec, t).cost)
             for j, (dt, t) in enumerate(zip(dts, targets)) if t is not None]
    debug.observe_implicit_redistribute(op, moves, "the sharding rule needs other input placements")


def _swap(a, locals_iter):
    """``a`` with its DTensors replaced, in order, by the local tensors from ``locals_iter``
    (one level of list/tuple nesting, which is all aten schemas have: cat, foreach ops)."""
    if isinstance(a, DTensor):
        return next(locals_iter)
    if isinstance(a, (list, tuple)):
        if _only_dtensors(a):  # a foreach op's list: the next len(a) pieces, taken in C
            swapped = list(itertools.islice(locals_iter, len(a)))
        else:
            swapped = [next(locals_iter) if isinstance(x, DTensor) else x for x in a]
        return swapped if type(a) is list else type(a)(swapped)
    return a


def _pieces(a):
    """``a`` with its DTensors replaced by their own local pieces: ``_swap`` where nothing was
    moved, without first collecting every piece into one list (a foreach op over every
    parameter: the lists mapped in C)."""
    if isinstance(a, DTensor):
        return a._local_tensor
    if isinstance(a, (list, tuple)):
        if _only_dtensors(a):
            swapped = list(map(_LOCAL_OF, a))
        else:
            swapped = [x._local_tensor if isinstance(x, DTensor) else x for x in a]
        return swapped if type(a) is list else type(a)(swapped)
    return a


def _validate_outputs(decision, out):
    """First run of a decision: the local results must be the pieces the output specs promise."""
    if decision.out_kind == "tensor":
        pairs = [(out, decision.out_specs)]
    elif decision.out_kind == "seq":
        pairs = list(zip(out, decision.out_specs))
    else:
        return
    for o, spec in pairs:
        if spec is None or not isinstance(o, torch.Tensor):
            continue
        if tuple(o.shape) != spec.local_shape():
            raise RuntimeError(
                f"sharding rule for {decision.op} produced a local result of shape "
                f"{tuple(o.shape)} but its output spec {spec} expects {spec.local_shape()} on "
                "this rank (a bug in the rule)")


def _mesh_of(op, dts):
    mesh = dts[0]._spec.mesh
    for dt in dts[1:]:
        if dt._spec.mesh != mesh:
            raise ValueError(f"{op}: DTensor inputs live on different meshes ({mesh} and "
                             f"{dt._spec.mesh}); redistribute them onto one mesh first")
    return mesh


# ops answered from shapes alone: a plain tensor among their arguments is no ambiguity (torch's
# ``is_same_size(dtensor, tensor)`` compares the global shape with the tensor's)
_SHAPE_ONLY_OPS = (aten.is_same_size.default,)


def _spec_args(op, args, kwargs):
    """Args with DTensors replaced by their specs; plain non-scalar tensors are an error."""
    scalar_kwargs = _registry.SCALAR_TENSOR_KWARGS.get(op, ())

    def conv(a):
        if isinstance(a, DTensor):
            return a._spec
        if isinstance(a, torch.Tensor) and a.ndim > 0 and op not in _SHAPE_ONLY_OPS:
            # not a TypeError: Tensor.__add__ & co turn TypeErrors into NotImplemented, which
            # Python then reports as a bare "unsupported operand" without this explanation
            raise ValueError(
                f"{op}: got a mix of DTensor and plain torch.Tensor (shape {tuple(a.shape)}) "
                "arguments. Convert the plain tensor with distribute_tensor(t, mesh, placements) "
                "or DTensor.from_local(t, mesh, placements) first, or, if it holds the same values "
                "on every rank, run the op under dtensor_lite.experimental.implicit_replication() "
                "(only Python scalars and 0-d tensors are treated as replicated automatically)")
        return a
    return tree_map(conv, list(args)), {
        k: v if k in scalar_kwargs and _one_element(v) else tree_map(conv, v)
        for k, v in kwargs.items()}


def _one_element(a) -> bool:
    return isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.numel() == 1


def _meta_outputs(op, args, kwargs):
    def to_meta(a):
        if isinstance(a, DTensor):
            s = a._spec
            return torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta")
        if isinstance(a, torch.Tensor):
            return a.to("meta")
        if isinstance(a, torch.device):
            return torch.device("meta")  # e.g. _to_copy(device=cpu): no data may leave meta
        return a
    try:
        return op(*tree_map(to_meta, list(args)), **tree_map(to_meta, dict(kwargs)))
    except Exception as e:  # noqa: BLE001 - surface the op and shapes, keep the cause
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        raise RuntimeError(f"{op}: could not compute the output shape for global inputs "
                           f"{shapes}: {e}") from e


def _mutated_arg(op, args, kwargs, dts):
    """Index (in dts) of the DTensor an in-place / out= op writes and returns, else None."""
    schema = op._schema
    if not schema.is_mutable or not schema.returns or schema.returns[0].alias_info is None:
        return None
    alias = schema.returns[0].alias_info
    for k, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write and \
                set(arg.alias_info.before_set) == set(alias.before_set):
            value = args[k] if k < len(args) else kwargs.get(arg.name)
            for j, dt in enumerate(dts):
                if dt is value:
                    return j
    return None


def _decide(op, args, kwargs, dts):
    if not dts:  # only reachable through odd subclass paths: nothing distributed here
        raise RuntimeError(f"{op}: dispatched to DTensor without DTensor arguments")
    if op in _registry.CROSS_MESH_OPS and len({id(dt._spec.mesh) for dt in dts}) > 1:
        # well defined across meshes (norms of a list of tensors): the rule handles each mesh
        return _DecomposeDecision(_registry.CROSS_MESH_OPS[op])
    decision = _decide_on_one_mesh(op, args, kwargs, dts)
    if dts[0]._spec.mesh._coordinate is None:
        if isinstance(decision, _Decision):
            return _OutsideMeshDecision(decision)
        if isinstance(decision, _FallbackDecision):
            return _OutsideMeshFallback(op, args, kwargs, decision)
    return decision


def _outside_local(spec: DTensorSpec) -> torch.Tensor:
    """The local piece of ``spec`` on a rank outside its mesh (torch's default tensor)."""
    return torch.zeros(_outside_shape(spec.ndim), dtype=spec.dtype,
                       device=torch.device(spec.mesh.device_type))


class _OutsideMeshDecision:
    """A rank outside the inputs' mesh runs no kernel and no collective: it wraps empty pieces
    in the output specs the members decide (so later metadata-only decisions agree)."""

    fast = False

    def __init__(self, inner: "_Decision"):
        self.inner = inner
        self.targets = inner.targets
        self.view_src = self.copies_view = None

    def run(self, args, kwargs, dts, validate=False):
        d = self.inner
        if d.mutated is not None:
            if d.relayout and not dts[d.mutated]._is_view() and \
                    not _aliasing.piece_lent(dts[d.mutated]):
                # members moved the destination (a view, or a piece to_local() handed out, they
                # write through, see _aliasing): its spec here must agree. A member whose piece
                # merely has live views writes through as well, which this rank's empty piece
                # cannot tell: then only the spec here says reduced (this rank holds no data and
                # joins none of the mesh's collectives)
                dts[d.mutated]._spec = d.targets[d.mutated]
            return dts[d.mutated]
        if d.out_kind == "tensor":
            return DTensor(_outside_local(d.out_specs), d.out_specs)
        if d.out_kind == "seq":
            res = [None if s is None else DTensor(_outside_local(s), s) for s in d.out_specs]
            return tuple(res)
        return None  # a Python scalar (item()): torch's non-members get None too


class _OutsideMeshFallback:
    """A rank outside the mesh for an op without a rule: Replicate empty results."""

    fast = False

    def __init__(self, op, args, kwargs, inner):
        self.op, self.mesh, self.mutated = op, inner.mesh, inner.mutated
        self.targets, self.view_src, self.copies_view = inner.targets, None, None
        self.meta = _meta_outputs(op, args, kwargs) if any(
            "Tensor" in str(r.type) for r in op._schema.returns) else None

    def run(self, args, kwargs, dts, validate=False):
        if self.mutated is not None:
            return dts[self.mutated]

        def wrap(o):
            if not isinstance(o, torch.Tensor):
                return None
            spec = DTensorSpec(self.mesh, [_Replicate()] * self.mesh.ndim,
                               TensorMeta(o.shape, tuple(o.stride()), o.dtype))
            return DTensor(_outside_local(spec), spec)
        meta = self.meta
        return type(meta)(wrap(o) for o in meta) if isinstance(meta, (tuple, list)) else wrap(meta)


def _decide_on_one_mesh(op, args, kwargs, dts):
    mesh = _mesh_of(op, dts)
    scalar_kwargs = _registry.SCALAR_TENSOR_KWARGS.get(op, ())
    if any(_is_plain(a) or (isinstance(a, (list, tuple)) and any(_is_plain(x) for x in a))
           for a in (*args, *[v for k, v in kwargs.items()
                              if not (k in scalar_kwargs and _one_element(v))])):
        return _PlainAsReplicatedDecision(op, mesh)
    rule = _registry.get_rule(op)
    if rule is None:
        if _aliasing.INPLACE_VIEW in op.tags:
            decision = _aliasing.inplace_view_decision(op, args, kwargs, dts,
                                                           _decide_on_one_mesh)
            if decision is not None:
                return decision
        if (any(a.is_out for a in op._schema.arguments)
                and _aliasing.functional_overload(op) is not None):
            return _aliasing.OutDecision(op)
        return _FallbackDecision(op, args, kwargs, dts, mesh)
    spec_args, spec_kwargs = _spec_args(op, args, kwargs)
    inputs = [dt._spec for dt in dts]
    call = OpCall(op, spec_args, spec_kwargs, inputs, mesh)
    mutated = _mutated_arg(op, args, kwargs, dts)
    result = rule(call)
    if isinstance(result, Decompose):
        return _DecomposeDecision(result.fn)
    if isinstance(result, FullStrategy):
        full = result
    else:
        full = expand_strategies(call, list(result), mutated)
    # ops returning no tensor (item(), is_same_size, ...) have no output metadata to infer
    returns_tensor = any("Tensor" in str(r.type) for r in op._schema.returns)
    meta_out = _meta_outputs(op, args, kwargs) if returns_tensor else None

    d = _Decision()
    d.op = op
    d.mutated = mutated
    # the raw C++ callable skips OpOverload.__call__'s Python frame on every hit
    d.local_fn = full.local_fn or getattr(op, "_op", op)
    targets = []
    for j, spec in enumerate(inputs):
        tgt = target_spec(call, full, j)
        targets.append(None if tgt == spec else tgt)
    # an in-place destination moves only to reduce a Partial the op cannot keep (_aliasing)
    d.relayout = mutated is not None and targets[mutated] is not None
    if d.relayout and not _aliasing.relayout_allowed(inputs[mutated], targets[mutated],
                                                     full.outs[0] if full.outs else None):
        raise RuntimeError(
            f"{op} writes into a DTensor with placements {list(dts[mutated].placements)}, but the "
            f"result must be {list(targets[mutated].placements)}; in-place ops cannot change "
            "placements. Redistribute first or use the out-of-place op")
    d.targets = tuple(targets)
    d.needs_redistribute = any(t is not None for t in targets)
    # a view op's output aliases its first input (``self``) in plain torch
    d.view_src = 0 if op.is_view and isinstance(args[0] if args else None, DTensor) else None
    d.copies_view = d.view_src is not None and targets[0] is not None
    outs = full.outs
    orders = full.out_orders or [None] * len(outs)
    d.out_shape = d.out_dtype = d.wrap_stride = None
    if isinstance(meta_out, torch.Tensor):
        d.out_kind = "tensor"
        d.out_specs = _out_spec(mesh, outs[0], meta_out, orders[0])
        meta = d.out_specs.tensor_meta
        d.out_shape, d.out_dtype = meta.shape, meta.dtype
        # the strides the hot path builds its wrapper with: None where contiguous (the wrapper
        # computes those itself, 0.15 us sooner); symbolic sizes as given (no guards added)
        d.wrap_stride = meta.stride
        if all(type(n) is int for n in (*meta.shape, *meta.stride)) and \
                tuple(meta.stride) == _contiguous_stride(meta.shape):
            d.wrap_stride = None
    elif isinstance(meta_out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in meta_out):
        d.out_kind = "seq"
        d.out_specs = tuple(
            _out_spec(mesh, outs[k] if k < len(outs) else None, o, orders[k] if k < len(orders) else None)
            if isinstance(o, torch.Tensor) else None for k, o in enumerate(meta_out))
    else:
        d.out_kind = "other"
        d.out_specs = None
    flat = flat_kwargs = not kwargs or not any(isinstance(v, (DTensor, list, tuple))
                                               for v in kwargs.values())
    positions = []
    for k, a in enumerate(args):
        if isinstance(a, DTensor):
            positions.append(k)
        elif isinstance(a, (list, tuple)) and any(isinstance(x, DTensor) for x in a):
            flat = False
    d.flat_positions = tuple(positions) if flat else None
    # the common case that dispatch() runs inline: nothing to move, one fresh tensor out
    d.fast = not d.needs_redistribute and d.flat_positions is not None and d.out_kind == "tensor"
    if full.local_fn is None and not d.needs_redistribute and not d.relayout and \
            not len_torch_dispatch_stack() and not is_traced(dts[0]._local_tensor) and \
            (d.flat_positions is not None or flat_kwargs):
        # torch.<name> / Tensor.<name> where it runs exactly this op on these local pieces (a
        # foreach op's lists too: over every parameter the generated parser saves ~0.1 us each)
        local_args = [_pieces(a) for a in args]
        fn = quick_callable(op, local_args, kwargs, d.local_fn)
        if fn is not d.local_fn and not op._schema.returns:
            fn = _returning_nothing(fn)  # torch._foreach_add_ returns its list; the op nothing
        d.local_fn = fn
    return d


def _returning_nothing(fn):
    def call(*args, **kwargs):
        fn(*args, **kwargs)
    return call


def _is_plain(a):
    return isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.ndim > 0


# True inside experimental.implicit_replication(): plain tensors among DTensors join as Replicate
IMPLICIT_REPLICATION: ContextVar[bool] = ContextVar("dtensor_lite.implicit_replication",
                                                    default=False)


class _PlainAsReplicatedDecision:
    """Plain tensors among DTensors: an error in user code (see :func:`_spec_args`), but inside a
    backward formula they are tensors the formula built itself (trace's backward indexes with an
    ``arange``), the same on every rank, and under ``implicit_replication()`` the user promises
    that: there they join as Replicate DTensors. Checked per call (the decision is cached)."""

    fast = False

    def __init__(self, op, mesh):
        self.op = op
        self.mesh = mesh

    def run(self, args, kwargs, dts, validate=False):
        if current_autograd_node() is None and not IMPLICIT_REPLICATION.get():
            _spec_args(self.op, args, kwargs)  # raises the mixing error
        mesh = self.mesh

        def conv(a):
            return _fallback.wrap_replicated(a, mesh) if _is_plain(a) else a
        return self.op(*tree_map(conv, list(args)), **tree_map(conv, dict(kwargs)))


class _DecomposeDecision:
    """A rule chose to run a composition of DTensor ops instead of the op itself."""

    fast = False

    def __init__(self, fn):
        self.fn = fn

    def run(self, args, kwargs, dts, validate=False):
        return self.fn(*args, **kwargs)


# ------------------------------------------------------------------ ops without a rule
class _FallbackDecision:
    """No rule: run the op on whole tensors (see :mod:`._fallback`): replicated inputs as they
    are, others gathered first (with a warning); writes into gathered inputs are written back."""

    fast = False
    __slots__ = ("op", "mesh", "targets", "written", "mutated", "view_src", "copies_view",
                 "random")

    def __init__(self, op, args, kwargs, dts, mesh):
        _spec_args(op, args, kwargs)  # a plain (non-scalar) tensor among DTensors is an error
        self.op = op
        self.mesh = mesh
        self.targets = _fallback.replicated_targets(dts)
        self.written = _aliasing.written_inputs(op, args, kwargs, dts)
        self.mutated = self.written[0] if self.written else None
        gathers = any(t is not None for t in self.targets)
        if gathers and _aliasing.INPLACE_VIEW in op.tags:
            raise UnsupportedOpError(
                f"{op} changes the view of a DTensor with placements "
                f"{[list(dt.placements) for dt in dts]} in place and has no sharding rule; the "
                "pieces cannot be re-viewed. Use the out-of-place op, or redistribute to "
                "Replicate() first")
        self.view_src = 0 if op.is_view and args and isinstance(args[0], DTensor) else None
        self.copies_view = self.view_src is not None and self.targets[0] is not None
        # a random op drawing on whole tensors gives one-process values when every rank's
        # generator agrees (the check random ops with rules make, see ops/random.py)
        self.random = torch.Tag.nondeterministic_seeded in op.tags

    def run(self, args, kwargs, dts, validate=False):
        if COPIED_VIEWS:
            _aliasing.check_not_copied_view(self, dts)
        op = self.op
        locals_ = _fallback.gather_whole(op, dts, self.targets, warn=True)
        if self.random:
            ensure_rng_synced(self.mesh, kwargs.get("generator"))
        it = iter(locals_)
        out = op(*[_swap(a, it) for a in args], **{k: _swap(v, it) for k, v in kwargs.items()})
        for j in self.written:
            dt = dts[j]
            if self.targets[j] is not None:
                _fallback.write_back(op, dt, locals_[j])
            elif tuple(dt._local_tensor.shape) != tuple(dt.shape) or \
                    tuple(dt._local_tensor.stride()) != tuple(dt.stride()):
                _aliasing.rewrap_in_place(op, args, kwargs, dt)
        out = _fallback.wrap_whole(out, self.mesh, dts, locals_)
        if self.view_src is None:
            return out
        return _aliasing.mark_if_copied_view(self, dts, out)


def _out_spec(mesh, placements, meta: torch.Tensor, order):
    if placements is None:
        raise RuntimeError(f"sharding rule gave no placement for a tensor output of shape "
                           f"{tuple(meta.shape)} (a bug in the rule)")
    if order is not None:  # orders derived from placements may stop short of the output's rank
        order = tuple(order) + ((),) * (meta.ndim - len(order))
    return DTensorSpec(mesh, placements, TensorMeta(meta.shape, tuple(meta.stride()), meta.dtype),
                       order)


use_dispatcher(dispatch)
