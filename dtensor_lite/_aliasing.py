"""Where DTensor ops must behave like aliasing in plain torch: in-place view ops, ``out=``
overloads, writes through in-place ops, and views that had to copy.

The dispatcher (``_dispatch``) decides and runs ordinary ops; everything here is about *which
tensor a result is*, not how it is sharded: an in-place view op changes the DTensor itself, an
``out=`` op writes into the given DTensors, a view whose input had to be redistributed is a
copy that must refuse writes (plain torch would write through to the viewed tensor), and an
in-place op on a Partial it cannot keep reduces its destination in place, or writes through
where other tensors alias it.
"""
from __future__ import annotations

import weakref

import torch

from . import _inflight, debug, debug_state
from . import _torch_names as N
from ._torch_names import aten, find_op, no_dispatch
from .dtensor import DTensor
from .ops import _registry
from .ops._expansion import only_reduces_partials
from .ops._registry import UnsupportedOpError
from .placements import Replicate
from .redistribute import plan_redistribute, redistribute_local
from .spec import DTensorSpec, TensorMeta

__all__ = ["COPIED_VIEWS", "check_not_copied_view", "mark_if_copied_view", "OutDecision",
           "functional_overload", "written_inputs", "rewrap_in_place", "INPLACE_VIEW",
           "inplace_view_decision", "piece_lent", "relayout_allowed", "relayout_blocker",
           "write_through", "relayout_destination"]

INPLACE_VIEW = torch.Tag.inplace_view


# ------------------------------------------------------------------ views that copied
# Views that are not views: a view op (view, reshape's view, flatten, select, ...) whose input
# had to be redistributed returns a DTensor over *new* local pieces, where plain torch returns an
# alias. Writing into it in place would silently not reach the original, so in-place ops on
# these (and on views of them) raise. Keyed by id (a WeakSet would compare tensors with ==), each
# entry leaves when its DTensor dies; the hot path tests only whether the dict is empty.
COPIED_VIEWS: dict[int, tuple] = {}  # id -> (weakref, scope: None or a backward node's seq nr)


_GRAD_STORE = "torch::autograd::AccumulateGrad"


def _backward_scope():
    """None in forward code; inside a backward formula, the running node's sequence number;
    ``False`` while autograd stores a ``.grad`` (no formula, nothing of the user's to alias)."""
    node = N.current_autograd_node()
    if node is None:
        return None
    return False if node.name() == _GRAD_STORE else node._sequence_nr()


def _add_copied_view(dt: DTensor, scope=None):
    key = id(dt)
    COPIED_VIEWS[key] = (weakref.ref(dt, lambda _ref, key=key: COPIED_VIEWS.pop(key, None)),
                         scope)


def check_not_copied_view(d, dts):
    """Called only while some copied view is alive: refuse writes into one. A copy made inside a
    backward formula counts only within that formula (which may write into its own views, as
    householder_product's does); the gradient it becomes is a tensor of its own afterwards
    (accumulated, clipped in place)."""
    if d.mutated is None:
        return
    entry = COPIED_VIEWS.get(id(dts[d.mutated]))
    if entry is not None and (entry[1] is None or entry[1] == _backward_scope()):
        dt = dts[d.mutated]
        raise RuntimeError(
            f"{d.op} writes in place into a DTensor {tuple(dt.shape)} {list(dt.placements)} that "
            "came out of a view op whose input had to be redistributed, so it holds a copy: plain "
            "torch would write through to the viewed tensor, here the write would be lost. "
            "Redistribute the input first so that the view moves no data (e.g. to a layout that "
            "keeps the viewed dims whole), or .clone() the view if a separate tensor is meant")


def mark_if_copied_view(d, dts, out):
    """Mark the results of a view that copied, and views of such copies (they alias the copy,
    not the original), with the scope they were made in."""
    src = COPIED_VIEWS.get(id(dts[d.view_src])) if d.view_src is not None else None
    if d.copies_view or src is not None:
        scope = _backward_scope()
        if scope is False:
            return out  # a .grad being stored: accumulating into it later is no write into a view
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, DTensor):
                _add_copied_view(o, scope)
    return out


# ------------------------------------------------------------------ out= overloads
class OutDecision:
    """An ``out=`` overload: run the functional op (through the dispatcher, so its rule picks
    the placements), then write the result into the ``out`` DTensors at their placements."""

    fast = False

    def __init__(self, op):
        self.functional = functional_overload(op)
        self.out_names = [a.name for a in op._schema.arguments if a.is_out]
        self.op = op

    def run(self, args, kwargs, dts, validate=False):
        kwargs = dict(kwargs)
        outs = [kwargs.pop(name) for name in self.out_names]
        returns_nothing = not self.op._schema.returns
        if len(outs) == 1 and isinstance(outs[0], (list, tuple)):
            outs = list(outs[0])  # foreach out=: one list of outs, one per result
        result = self.functional(*args, **kwargs)
        results = result if isinstance(result, (tuple, list)) else (result,)
        for out, res in zip(outs, results):
            if not isinstance(out, DTensor):
                raise ValueError(f"{self.op}: out= must be a DTensor when the inputs are DTensors")
            if out.shape != res.shape:
                raise ValueError(f"{self.op}: out= has shape {tuple(out.shape)} but the result "
                                 f"has shape {tuple(res.shape)}; pass an out of the result's shape")
            if res._spec.placements != out._spec.placements or \
                    res._spec.shard_order != out._spec.shard_order:
                if debug_state.EXPLICIT:
                    debug.observe_implicit_redistribute(self.op, [(
                        0, res._spec, out._spec, plan_redistribute(res._spec, out._spec).cost)],
                        "the result is written into out= of other placements")
                res = res.redistribute(out.device_mesh, out.placements)
            out._local_tensor.copy_(res._local_tensor)
        if returns_nothing:
            return None
        return outs[0] if len(outs) == 1 else tuple(outs)


def functional_overload(op, packet_name=None):
    """The non-mutating overload of ``packet_name`` (default: the op's own packet) taking the op's
    non-out arguments; where several take the same names (squeeze.dim / squeeze.dims), the one
    whose types match too."""
    packet = find_op(packet_name or op._schema.name.split("::")[-1])
    if packet is None:  # an in-place op without a functional twin (in this torch)
        return None
    args = [a for a in op._schema.arguments if not a.is_out]
    wanted = [a.name for a in args]
    cands = [getattr(packet, name) for name in packet.overloads()]
    cands = [c for c in cands if not c._schema.is_mutable and
             [a.name for a in c._schema.arguments] == wanted]
    typed = [c for c in cands if [str(a.type) for a in c._schema.arguments] ==
             [str(a.type) for a in args]]
    if typed or cands:
        return (typed or cands)[0]
    return None


def written_inputs(op, args, kwargs, dts) -> tuple:
    """Indices (in dts) of the DTensors that the op writes into (in-place self, out=, ...)."""
    ids = set()
    for k, arg in enumerate(op._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[k] if k < len(args) else kwargs.get(arg.name)
        for v in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(v, DTensor):
                ids.add(id(v))
    return tuple(j for j, dt in enumerate(dts) if id(dt) in ids)


def rewrap_in_place(op, args, kwargs, dt):
    """A replicated DTensor whose local tensor the op re-shaped in place (an in-place view op,
    resize_): its spec and wrapper follow the local tensor."""
    loc = dt._local_tensor
    dt._spec = DTensorSpec(dt._spec.mesh, dt._spec.placements,
                           TensorMeta(loc.shape, tuple(loc.stride()), loc.dtype))
    _set_wrapper_meta(op, args, kwargs)
    if tuple(dt.shape) != tuple(loc.shape):
        raise RuntimeError(f"{op}: the DTensor wrapper could not follow its local tensor's new "
                           f"shape {tuple(loc.shape)} (it stayed {tuple(dt.shape)})")


# ------------------------------------------------------------------ in-place destinations that move
# An in-place op whose destination is Partial and whose values cannot stay a sum of pieces
# (``sqrt_``, ``clamp_``, ``exp_``, ``mul_(-1)`` of a Partial(min), ...): plain torch's values
# require the Partial reduced first. The destination DTensor itself is redistributed -- its local
# piece and spec become the reduced ones -- and the op then writes into the new piece, so the
# user's tensor object holds the right values at the new placement, with one reduction (torch's
# DTensor raises here). That is only sound where nothing else aliases the piece: a view of another
# DTensor, or a DTensor with views or other aliases of its piece, would keep the old placement
# over memory that now means something else. There the op runs out of place and its result is
# copied into the destination at the destination's own placements (``write_through``): the
# same values, every alias sees them, and the destination stays Partial.

def relayout_allowed(spec: DTensorSpec, target: DTensorSpec, out_placements) -> bool:
    """Decided once per cached decision: may an in-place op move its destination from ``spec``
    to ``target``? Only by reducing Partial mesh dims (what the values force), writing the
    result at ``target``'s placements."""
    return out_placements is not None and tuple(out_placements) == tuple(target.placements) \
        and only_reduces_partials(spec.placements, target.placements)


def relayout_blocker(dt: DTensor):
    """Per call, before anything moves: None if ``dt``'s piece is its own, else why not.

    Decided from what this library itself did to ``dt`` and its memory, never from reference
    counts: a Python reference count also counts whoever merely *looks* at the piece -- a
    debugger's or tracer's frame locals, a profiler's hooks, an interpreter that does or does not
    borrow an argument, what a failed torch.compile left behind -- so reading it let another
    library flip this decision (torch 2.15: 11 in-place-on-Partial results stayed Partial after a
    failed compile in the same process), and only on the rank where that library ran, leaving
    the ranks with different placements. Three facts instead, each the same on every rank of an
    SPMD program that takes the same views and makes the same calls:

    * ``dt`` is a view of another DTensor (the wrapper's own view tracking);
    * its piece is the very tensor object ``to_local()`` handed out (``_lent``). The caller may
      still hold it, and nothing short of a reference count could tell that it let go: such a
      piece is written through for as long as it is ``dt``'s (the safe path: the same values, the
      placement kept), until ``dt`` gets another piece;
    * another tensor shares the piece's memory (``_shares_memory``).
    """
    if dt._is_view():
        return "it is a view of another DTensor"
    if piece_lent(dt):
        return "its local piece was handed out by to_local() and may still be held"
    return _shares_memory(dt._local_tensor)


def piece_lent(dt: DTensor) -> bool:
    """Whether ``dt``'s current piece is the tensor object ``to_local()`` handed out."""
    lent = getattr(dt, "_lent", None)  # unset until to_local() hands the piece out
    return lent is not None and lent() is dt._local_tensor


def write_through(op, args, kwargs, dt: DTensor, target: DTensorSpec, why: str):
    """``op`` on an aliased destination ``dt`` (see above): the functional op, then ``copy_``
    into ``dt`` at its own placements (a Partial takes a Replicate or Shard result for free)."""
    name = op._schema.name.split("::")[-1]
    functional = functional_overload(op, name[:-1]) if name.endswith("_") else None
    if functional is None:
        raise RuntimeError(
            f"{op} writes in place into a DTensor {tuple(dt.shape)} with placements "
            f"{list(dt.placements)}, which the op cannot keep: the DTensor would have to become "
            f"{list(target.placements)} in place, but {why}, and the op has no out-of-place "
            f"overload to write through. Reduce it first (redistribute the tensor the views were "
            f"taken from to {list(target.placements)})")
    # the destination's Partial dims reduced to Replicate (one reduction each), so the result
    # comes replicated there and copying it back into the Partial is local (a Shard the
    # in-place decision might prefer could cost a gather to turn back, under a nested shard order)
    # (redistribute_local, not DTensor.redistribute: this runs below autograd, whose node for
    # the in-place op itself is already recorded)
    spec = dt._spec
    reduced = spec.with_placements([Replicate() if p.is_partial() else p for p in spec.placements],
                                   spec.shard_order)
    moved = DTensor(redistribute_local(dt._local_tensor, spec, reduced), reduced)
    swap = lambda a: moved if a is dt else a  # noqa: E731
    result = functional(*[swap(a) for a in args], **{k: swap(v) for k, v in kwargs.items()})
    return dt.copy_(result)


def _shares_memory(local: torch.Tensor):
    """None if no other tensor is over ``local``'s memory, else why not.

    Counts the holders of its storage (``torch._C._storage_Use_Count``): one per tensor whose
    memory this is, plus storage objects. Expected: ``local`` itself, the storage object asked for
    here, the base ``local`` is a view of, and private aliases that a finished collective's
    backend has not yet let go of (``_inflight``). The base a piece was viewed from (a temporary,
    from_local's argument, the piece of the DTensor it was redistributed from) is not counted as
    an alias: writes into it never show through this DTensor's spec, as in plain torch a
    redistribute's result is no view of its input.

    Why this count may stay where a reference count may not: nothing raises it but another tensor
    (or storage object) over these very bytes -- a view, an alias, a tensor that can read and
    write them -- so whatever raises it, a library's included, is an alias the write must reach,
    and it only ever sends the op down the safe path (write through: the same values, the
    placement kept). Merely holding, inspecting or tracing ``local`` or ``dt`` leaves it as it
    is. A view made by the program is made on every rank alike.
    """
    storage = local.untyped_storage()
    expected = 2 + (local._base is not None) + _inflight.aliases_of(storage)
    if N.storage_use_count(storage._cdata) > expected:
        return "another tensor shares its memory (a view of it, or an alias of its local piece)"
    return None


def relayout_destination(dt: DTensor, local: torch.Tensor, target: DTensorSpec) -> None:
    """Give ``dt`` its redistributed piece and spec (the wrapper's sizes and strides, global
    ones, do not change)."""
    dt._local_tensor = local
    dt._spec = target


# ------------------------------------------------------------------ in-place view ops
INPLACE_VIEW = torch.Tag.inplace_view


def inplace_view_decision(op, args, kwargs, dts, decide):
    """``t_``, ``transpose_``, ``squeeze_``, ``unsqueeze_`` (``swapdims_`` & co decompose into
    these before dispatch): decided as the functional op (by the dispatcher's ``decide``), then
    applied to the DTensor itself. None where the functional op has no rule (the caller falls
    back to running on whole tensors)."""
    x = dts[0]
    if op is aten.as_strided_.default:
        size, stride = args[1], args[2]
        offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
        if tuple(size) == tuple(x.shape) and tuple(stride) == tuple(x.stride()) and \
                offset in (None, x.storage_offset()):
            return _Unchanged()
        raise UnsupportedOpError(
            f"{op}: a DTensor cannot take arbitrary sizes/strides in place (placements "
            f"{list(x.placements)}, shape {tuple(x.shape)} -> {tuple(size)}, stride "
            f"{tuple(x.stride())} -> {tuple(stride)}): strides address one global storage that "
            "no rank holds. Use view / reshape / permute / transpose (out of place), or "
            "full_tensor() and as_strided on the plain tensor")
    functional = functional_overload(op, op._schema.name.split("::")[-1].rstrip("_"))
    if functional is None or _registry.get_rule(functional) is None:
        return None
    inner = decide(functional, args, kwargs, dts)
    if getattr(inner, "out_kind", None) != "tensor":  # the rule decomposed: no piece to re-view
        raise UnsupportedOpError(
            f"{op} on DTensors with placements {[list(dt.placements) for dt in dts]}: the "
            f"rule of {functional} runs it as a composition of ops, which cannot re-view the "
            "DTensor in place; use the out-of-place op")
    tgt, spec = inner.targets[0], x._spec
    if tgt is not None and (any(
            p != q and not (p.is_shard() and x.shape[p.dim] == 1 and q.is_replicate())
            for p, q in zip(spec.placements, tgt.placements)) or any(
            n != 1 and a != b for n, a, b in zip(x.shape, spec.shard_order, tgt.shard_order))):
        # only the gather of a size-1 shard keeps every element where it was (see run())
        raise RuntimeError(
            f"{op} on a DTensor with placements {list(x.placements)} and shape "
            f"{tuple(x.shape)} would need it redistributed to {list(tgt.placements)}, which an "
            f"in-place view cannot do; use the out-of-place {functional} instead")
    return _InplaceViewDecision(op, inner)


class _Unchanged:
    """An in-place view op that keeps sizes and strides as they are."""

    fast = False

    def run(self, args, kwargs, dts, validate=False):
        return dts[0]


class _InplaceViewDecision:
    """Run the functional op's decision, then give its spec and local piece to the input DTensor
    itself and change the wrapper's sizes and strides in place, as the op does to a plain tensor.

    Each rank's piece keeps its storage, so views taken earlier still alias it: a piece that the
    functional op only viewed takes the view's geometry in place. The one redistribution allowed
    is squeezing a size-1 dim sharded over some mesh dims (squeeze goes by the *global* size):
    that dim becomes Replicate, which the rank holding the element(s) already has -- it re-views
    its own piece -- and the other ranks, whose pieces were empty, take the gathered copy."""

    fast = False

    def __init__(self, op, inner):
        self.op = op
        self.inner = inner

    def run(self, args, kwargs, dts, validate=False):
        x = dts[0]
        old = x._local_tensor
        new = self.inner.run(args, kwargs, dts, validate)._local_tensor
        if _same_storage(old, new):
            old.as_strided_(new.size(), new.stride(), new.storage_offset())
        elif old.numel() == new.numel():
            v = old.view(new.shape)
            old.as_strided_(v.size(), v.stride(), v.storage_offset())
        elif old.numel() == 0:
            x._local_tensor = new
        else:
            raise RuntimeError(f"{self.op}: local piece of shape {tuple(old.shape)} cannot "
                               f"become {tuple(new.shape)} in place (a bug in the rule)")
        x._spec = self.inner.out_specs
        _set_wrapper_meta(self.op, args, kwargs)
        if validate and (tuple(x.shape) != tuple(x._spec.shape) or
                         tuple(x.stride()) != tuple(x._spec.stride)):
            raise RuntimeError(f"{self.op}: wrapper became {tuple(x.shape)}/{x.stride()} but the "
                               f"spec says {x._spec.shape}/{x._spec.stride} (a bug)")
        return x


def _same_storage(a, b):
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def _set_wrapper_meta(op, args, kwargs):
    """Apply an in-place view op to the wrapper's own sizes/strides: its meta kernel, with
    dispatch to subclasses off (what torch's return_and_correct_aliasing does for these ops)."""
    with no_dispatch():
        meta_in_tls = N.meta_in_tls_dispatch_include()
        N.set_meta_in_tls_dispatch_include(True)
        try:
            op(*args, **kwargs)
        finally:
            N.set_meta_in_tls_dispatch_include(meta_in_tls)
