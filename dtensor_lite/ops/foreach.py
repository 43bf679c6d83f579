"""``_foreach_*`` ops (what torch.optim and clip_grad_* run with foreach=True) and the fused
optimizer kernels (``_fused_adam_`` & co, fused=True).

A foreach op over lists of DTensors is, per list index, the matching elementwise op
(``_foreach_add_.List`` -> ``add_.Tensor`` on ``self[k], other[k]``). The rule asks that op's own
rule for each index, lets the dispatcher's per-mesh-dim chooser pick placements exactly as it
would for the single op, and stitches the answers into one decision for the whole list, so the
foreach op then runs *once* on the lists of local pieces (one cache lookup and one fused local
kernel, not one dispatch per parameter). Where stitching is impossible -- a tensor shared by all
indices (``_foreach_mul_.Tensor``'s scale) wanted at different placements by different indices,
or an element rule that needs its own local function (norms) -- the op is decomposed into one
DTensor op per index instead: same result, one dispatch per element.
"""
from __future__ import annotations

import math

import torch

from .. import _torch_names as torch_names
from ..dtensor import DTensor
from ..redistribute import redistribute_local
from .. import collectives as C
from ..placements import Replicate
from ..spec import DTensorSpec
from ._registry import (CROSS_MESH_OPS, SCALAR_TENSOR_KWARGS, Decompose, FullStrategy, OpCall, get_rule,
                        key_scalars_by_value, register_rule)
from ._expansion import expand_strategies, only_reduces_partials
from .pointwise import reads_number_signs_only

aten = torch_names.aten

__all__ = ["foreach_rule", "fused_optimizer_rule"]

# foreach ops whose per-element op is a reduction (per-element results, decomposed)
_REDUCING = {"norm", "max", "powsum"}
# foreach ops with a Scalar operand whose single-tensor op has another name
_SCALAR_RENAMES = {"maximum": "clamp_min", "minimum": "clamp_max"}


class _Slot:
    """A DTensor argument's place in the flattened input order (what FullStrategy.ins indexes)."""
    __slots__ = ("pos", "spec")

    def __init__(self, pos, spec):
        self.pos, self.spec = pos, spec


def _slotted(args, kwargs):
    """args/kwargs with each DTensorSpec wrapped in a _Slot numbered in the dispatcher's
    flattening order (positional args first, then kwargs, lists element by element)."""
    counter = [0]

    def wrap(a):
        if isinstance(a, DTensorSpec):
            counter[0] += 1
            return _Slot(counter[0] - 1, a)
        if isinstance(a, (list, tuple)):
            return type(a)(wrap(x) for x in a)
        return a
    s_args = [wrap(a) for a in args]
    s_kwargs = {k: wrap(v) for k, v in kwargs.items()}
    return s_args, s_kwargs


def _flat_slots(args, kwargs):
    out = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, _Slot):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, _Slot))
    return out


def _unslot(a):
    if isinstance(a, _Slot):
        return a.spec
    if isinstance(a, (list, tuple)):
        return type(a)(_unslot(x) for x in a)
    return a


# ---------------------------------------------------------------- the per-element op
def _is_tensor(a):
    return isinstance(a, (DTensorSpec, _Slot, torch.Tensor))


def _type_ok(typ: str, value) -> bool:
    if typ == "Tensor":
        return _is_tensor(value)
    if typ == "Optional[Tensor]":
        return value is None or _is_tensor(value)
    if typ == "number":
        return isinstance(value, (int, float, bool, complex)) and not _is_tensor(value)
    return not _is_tensor(value)


def _bind(schema, pos: list, kw: dict):
    """(args, kwargs) fitting ``schema``, or None: positional values beyond the schema's
    positional parameters fill its keyword-only ones in order (``addcdiv``'s ``value``)."""
    params = schema.arguments
    positional = [p for p in params if not p.kwarg_only]
    if len(pos) > len(params):
        return None
    kw = dict(kw)
    extra = pos[len(positional):]
    kw_only = [p for p in params if p.kwarg_only]
    for p, v in zip(kw_only, extra):
        if p.name in kw:
            return None
        kw[p.name] = v
    pos = pos[:len(positional)]
    names = {p.name for p in params}
    if any(k not in names for k in kw):
        return None
    for i, p in enumerate(params):
        if not p.kwarg_only and i < len(pos):
            v = pos[i]
        elif p.name in kw:
            v = kw[p.name]
        elif p.default_value is not None or str(p.type).startswith("Optional"):
            continue
        else:
            return None
        if not _type_ok(str(p.type), v):
            return None
    return pos, kw


class _ForeachInfo:
    """How to turn a foreach call into the single-tensor call for list index k."""

    def __init__(self, op):
        name = op._schema.name.split("::")[1][len("_foreach_"):]
        self.op = op
        self.inplace = name.endswith("_")
        self.base = name.rstrip("_")
        self.list_positions = {i for i, a in enumerate(op._schema.arguments)
                               if str(a.type).startswith("List[")}
        self.elem = None  # resolved on the first call, from real argument types

    def element(self, args, kwargs, k):
        pos = [a[k] if i in self.list_positions else a for i, a in enumerate(args)]
        kw = {n: (v[k] if isinstance(v, (list, tuple)) else v) for n, v in kwargs.items()}
        return pos, kw

    def resolve(self, args, kwargs):
        """The single-tensor OpOverload and whether it writes in place (None: none fits)."""
        if self.elem is not None:
            return self.elem
        pos, kw = self.element(args, kwargs, 0)
        base = self.base
        if self.op._overloadname in ("Scalar", "ScalarList"):
            base = _SCALAR_RENAMES.get(base, base)
        names = [base + "_", base] if self.inplace else [base]
        for packet_name in names:
            packet = torch_names.find_op(packet_name)
            if packet is None:
                continue
            for ov in packet.overloads():
                cand = getattr(packet, ov)
                if any(a.is_out for a in cand._schema.arguments):
                    continue
                bound = _bind(cand._schema, pos, kw)
                if bound is not None and get_rule(cand) is not None:
                    self.elem = (cand, packet_name.endswith("_"))
                    return self.elem
        return None


_INFOS: dict = {}


def _info(op) -> _ForeachInfo:
    info = _INFOS.get(op)
    if info is None:
        info = _INFOS[op] = _ForeachInfo(op)
    return info


def _fit(elem_op, pos, kw):
    return _bind(elem_op._schema, pos, kw)


# ---------------------------------------------------------------- the rule
def foreach_rule(call: OpCall):
    _check_lengths(call.op, call.args)
    info = _info(call.op)
    if info.base in _REDUCING:
        return Decompose(_reducing_decomposition(call.op, info))
    elem = info.resolve(call.args, call.kwargs)
    if elem is None:
        raise NotImplementedError(
            f"{call.op}: dtensor_lite found no single-tensor op with a sharding rule to run per "
            "list element; run the op per tensor instead, or register a rule for it")
    elem_op, elem_inplace = elem
    if not reads_number_signs_only(elem_op):
        key_scalars_by_value(call.op)  # the element rule may read values: so must the cache
    s_args, s_kwargs = _slotted(call.args, call.kwargs)
    n = _list_length(s_args, info)
    ins = [None] * len(call.inputs)
    in_orders = [None] * len(call.inputs)
    decided = [False] * len(call.inputs)
    outs, out_orders = [], []
    for k in range(n):
        pos, kw = info.element(s_args, s_kwargs, k)
        pos, kw = _fit(elem_op, pos, kw)
        slots = _flat_slots(pos, kw)
        e_call = OpCall(elem_op, [_unslot(a) for a in pos],
                        {name: _unslot(v) for name, v in kw.items()}, [s.spec for s in slots],
                        call.mesh)
        mutated = 0 if info.inplace else None
        try:
            result = get_rule(elem_op)(e_call)
            if not isinstance(result, (FullStrategy, Decompose)):
                result = expand_strategies(e_call, list(result), mutated)
        except RuntimeError as e:
            raise RuntimeError(f"{call.op}, list element {k}: {e}") from e
        if isinstance(result, Decompose) or (isinstance(result, FullStrategy)
                                             and result.local_fn is not None):
            return Decompose(_per_element(call.op, info, elem_op, elem_inplace))
        full = result
        if info.inplace and not _keeps_destination(slots[0].spec, full):
            if not elem_inplace:  # e.g. maximum for _foreach_maximum_: compute, then copy_
                return Decompose(_per_element(call.op, info, elem_op, elem_inplace))
            if only_reduces_partials(slots[0].spec.placements, full.ins[0]):
                # a Partial the op cannot keep: the element's own in-place op reduces it first
                # (the dispatcher moves that destination, see expand_strategies)
                return Decompose(_per_element(call.op, info, elem_op, elem_inplace))
            raise RuntimeError(
                f"{call.op}: list element {k} is written in place with placements "
                f"{list(slots[0].spec.placements)}, which the op cannot keep; in-place ops "
                "cannot change placements. Redistribute that tensor first (e.g. resolve a "
                "Partial with .redistribute(mesh, [Replicate()]))")
        for j, slot in enumerate(slots):
            want = full.ins[j]
            order = full.in_orders[j] if full.in_orders is not None else None
            if want is not None and tuple(want) == slot.spec.placements and order in (
                    None, slot.spec.shard_order):
                want, order = None, None  # already there
            if decided[slot.pos]:
                if (ins[slot.pos], in_orders[slot.pos]) != (want, order):
                    # a tensor shared by all indices is wanted differently by two of them
                    return Decompose(_per_element(call.op, info, elem_op, elem_inplace))
                continue
            decided[slot.pos] = True
            ins[slot.pos], in_orders[slot.pos] = want, order
        if not info.inplace:
            outs.append(full.outs[0])
            out_orders.append(full.out_orders[0] if full.out_orders else None)
    return FullStrategy(outs=outs, ins=ins, local_fn=None, out_orders=out_orders or None,
                        in_orders=in_orders)


def _check_lengths(op, args):
    """torch's own checks of a foreach call's list lengths, with its messages (its kernel makes
    them; a rule reading the lists index by index must make them first)."""
    tensors, scalars = [], []
    for a, param in zip(args, op._schema.arguments):
        if isinstance(a, (list, tuple)):
            (tensors if "Tensor" in str(param.type) else scalars).append(len(a))
    if not tensors:
        return
    for n in tensors[1:]:
        if n != tensors[0]:
            raise RuntimeError(f"Tensor lists must have the same number of tensors, got "
                               f"{tensors[0]} and {n}")
    if any(n != tensors[0] for n in scalars):
        raise RuntimeError("Tensor list must have same number of elements as scalar list.")


def _list_length(s_args, info):
    for i in sorted(info.list_positions):
        if i < len(s_args) and isinstance(s_args[i], (list, tuple)):
            return len(s_args[i])
    return 0


def _keeps_destination(spec, full):
    want = full.ins[0]
    out = full.outs[0] if full.outs else None
    return (want is None or tuple(want) == spec.placements) and (
        out is None or tuple(out) == spec.placements)


def _per_element(op, info, elem_op, elem_inplace):
    """One DTensor op per list index (each dispatched and resharded on its own)."""
    def run(*args, **kwargs):
        n = _list_length(list(args), info)
        results = []
        for k in range(n):
            pos, kw = _fit(elem_op, *info.element(list(args), kwargs, k))
            r = elem_op(*pos, **kw)
            if info.inplace and not elem_inplace:  # e.g. _foreach_maximum_: maximum, then copy
                pos[0].copy_(r)
            results.append(r)
        return None if info.inplace else results
    return run


def _reducing_decomposition(op, info):
    """Per-element reductions (``_foreach_norm``, ``_foreach_max``, ``_foreach_powsum``) as ONE
    batched all-reduce per mesh dim for the whole list, instead of one per tensor: each rank
    reduces its pieces to one value per tensor, the values are stacked into a vector that is
    reduced once, and each entry comes back as a replicated 0-d DTensor."""
    def run(*args, **kwargs):
        tensors = args[0]
        if info.base == "max":
            return _batched(tensors, "max", None, None)
        ord_ = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("exponent", 2))
        dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
        return _batched(tensors, "norm" if info.base == "norm" else "powsum", float(ord_), dtype)
    return run


def _norm_kind(ord_):
    if ord_ == math.inf:
        return "max"
    if ord_ == -math.inf:
        return "min"
    return "sum"


def _out_dtype(what, x, ord_, dtype):
    meta = torch.empty(1, dtype=x.dtype, device="meta")
    if what == "max":
        return x.dtype
    return torch.linalg.vector_norm(meta, ord_ if ord_ is not None else 2, dtype=dtype).dtype


def _local_value(what, x, ord_, acc):
    """This rank's contribution for one tensor (identity of the reduction on an empty piece)."""
    if what == "max":
        if x.numel():
            return x.amax()
        return torch.tensor(-math.inf if x.is_floating_point() else torch.iinfo(x.dtype).min,
                            dtype=x.dtype, device=x.device)
    a = x.abs().to(acc)
    kind = _norm_kind(ord_)
    if kind == "max":  # |x| >= 0, so 0 is max's identity here
        return a.amax() if a.numel() else a.new_zeros(())
    if kind == "min":
        return a.amin() if a.numel() else a.new_full((), math.inf)
    if ord_ == 0:
        return (a != 0).sum().to(acc)
    if ord_ == 1:
        return a.sum()
    if ord_ == 2:
        return (a * a).sum()
    return a.pow(ord_).sum()


def _batched(tensors, what, ord_, dtype):
    results = [None] * len(tensors)
    groups: dict = {}
    for k, t in enumerate(tensors):
        spec = t._spec
        if any(p.is_partial() for p in spec.placements):  # not linear: reduce the input first
            t = t.redistribute(spec.mesh, [Replicate() if p.is_partial() else p
                                           for p in spec.placements])
            spec = t._spec
        x = t._local_tensor
        out_dtype = _out_dtype(what, x, ord_, dtype)
        acc = x.dtype if what == "max" else (
            torch.float64 if out_dtype in (torch.float64, torch.complex128) else torch.float32)
        reduce_op = "max" if what == "max" else {"sum": "sum", "max": "max", "min": "min"}[
            _norm_kind(ord_)]
        v = _local_value(what, x, ord_, acc)
        coord = spec.mesh.get_coordinate()
        if coord is None:  # outside this tensor's mesh: an empty result, no collective
            results[k] = DTensor.from_local(torch.zeros((), dtype=out_dtype, device=x.device),
                                            spec.mesh, [Replicate()] * spec.mesh.ndim)
            continue
        if reduce_op == "sum":
            # a sum over ranks must count a tensor's value once per piece: on mesh dims that do
            # not shard it, only coordinate 0 contributes
            if any(not p.is_shard() and coord[i] != 0 for i, p in enumerate(spec.placements)):
                v = torch.zeros_like(v)
        groups.setdefault((spec.mesh, acc, reduce_op), []).append((k, v, out_dtype))
    for (mesh, acc, reduce_op), items in groups.items():
        full = torch.stack([v for _, v, _ in items])
        # a handful of scalars: latency, not bandwidth, so one plain all-reduce per mesh dim
        for i in range(mesh.ndim):
            full = C.all_reduce(full, mesh, i, reduce_op)
        for (k, _, out_dtype), value in zip(items, full.unbind(0)):
            if what == "norm" and _norm_kind(ord_) == "sum" and ord_ not in (0.0, 1.0):
                value = value.sqrt() if ord_ == 2 else value.pow(1.0 / ord_)
            results[k] = DTensor.from_local(value.to(out_dtype), mesh,
                                            [Replicate()] * mesh.ndim)
    return results


# ---------------------------------------------------------------- fused optimizer kernels
def fused_optimizer_rule(call: OpCall):
    """``_fused_adam_`` & co are elementwise per parameter: every tensor of index k must sit at
    ``params[k]``'s placements. Read-only inputs (and grads, unless a grad scale is given) are
    simply redistributed; state written in place that sits elsewhere (fused SGD creates its
    momentum buffers with ``empty_like(grad)``) goes through a temporary at the parameter's
    placements that is copied back after the step."""
    params = call.args[0]
    for k, p in enumerate(params):
        if isinstance(p, DTensorSpec) and any(pl.is_partial() for pl in p.placements):
            raise RuntimeError(f"{call.op}: parameter {k} is Partial {list(p.placements)}; "
                               "parameters must be Shard or Replicate for a fused optimizer step")
    ins = [None] * len(call.inputs)
    in_orders = [None] * len(call.inputs)
    s_args, s_kwargs = _slotted(call.args, call.kwargs)
    written = _written_lists(call.op, call.kwargs)
    for i, k, s in _indexed_slots(s_args, len(params)):
        p = params[k]
        if s.spec.placements == p.placements and s.spec.shard_order == p.shard_order:
            continue
        if i in written:
            return Decompose(_fused_through_temporaries(call.op, written))
        ins[s.pos], in_orders[s.pos] = p.placements, p.shard_order
    for s in _flat_slots([], s_kwargs):  # lr / grad_scale / found_inf given as DTensors
        ins[s.pos] = (Replicate(),) * call.mesh.ndim
    return FullStrategy(outs=[], ins=ins, local_fn=_contiguous_kernel(call.op),
                        in_orders=in_orders)


def _contiguous_kernel(op):
    """The fused CPU kernels walk raw memory and silently ignore strides (torch 2.13: a
    non-contiguous exp_avg gives wrong numbers), and redistributed pieces are often strided
    views: run on contiguous copies, copying written ones back."""
    mutable = {i for i, a in enumerate(op._schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write}

    def run(*args, **kwargs):
        back = []
        args = list(args)
        for i, a in enumerate(args):
            if isinstance(a, (list, tuple)) and any(
                    isinstance(t, torch.Tensor) and not t.is_contiguous() for t in a):
                args[i] = [t.contiguous() if isinstance(t, torch.Tensor) else t for t in a]
                if i in mutable:
                    back += [(t, c) for t, c in zip(a, args[i]) if c is not t]
        op(*args, **kwargs)
        for t, c in back:
            t.copy_(c)
    return run


def _written_lists(op, kwargs):
    """Positions of the tensor lists the fused kernel writes; grads only when unscaled in place."""
    out = set()
    for i, a in enumerate(op._schema.arguments):
        if a.kwarg_only or a.alias_info is None or not a.alias_info.is_write:
            continue
        if a.name == "grads" and kwargs.get("grad_scale") is None:
            continue
        out.add(i)
    return out


def _indexed_slots(s_args, n):
    """(arg position, list index, slot) of every DTensor in the per-parameter tensor lists."""
    for i, a in enumerate(s_args):
        if isinstance(a, (list, tuple)):
            for k, s in enumerate(a):
                if isinstance(s, _Slot) and k < n:
                    yield i, k, s


def _fused_through_temporaries(op, written):

    def run(*args, **kwargs):
        args = [list(a) if isinstance(a, (list, tuple)) else a for a in args]
        params = args[0]
        copy_back = []
        for i, a in enumerate(args):
            if not isinstance(a, list):
                continue
            for k, t in enumerate(a):
                if not isinstance(t, DTensor) or k >= len(params):
                    continue
                want = params[k]._spec
                src = t._spec
                if src.placements == want.placements and src.shard_order == want.shard_order:
                    continue
                spec = DTensorSpec(want.mesh, want.placements, src.tensor_meta, want.shard_order)
                a[k] = DTensor(redistribute_local(t._local_tensor, t._spec, spec), spec)
                if i in written:
                    copy_back.append((t, a[k]))
        op(*args, **kwargs)
        for orig, tmp in copy_back:
            orig.copy_(tmp)
    return run


# ---------------------------------------------------------------- lists over several meshes
def _per_mesh(op):
    """Run ``op`` once per mesh over the indices whose tensors live there: torch.optim groups
    parameters by device and dtype only, so one foreach / fused call may hold parameters of
    several meshes (pipeline stages, experts beside dense layers). Every index is independent, so
    the result is well defined: each call sees the sublists (and ``Scalar[]`` / a ``scalars``
    tensor's entries) of its indices; other arguments (a shared learning rate) go to every call."""
    per_index_tensor = {i for i, a in enumerate(op._schema.arguments)
                        if a.name == "scalars" and str(a.type) == "Tensor"}
    names = [a.name for a in op._schema.arguments]
    returns_list = bool(op._schema.returns) and str(op._schema.returns[0].type) == "List[Tensor]"

    def run(*args, **kwargs):
        n = len(args[0])
        groups: dict[int, list[int]] = {}
        for k in range(n):
            dt = next((a[k] for a in args if isinstance(a, (list, tuple)) and len(a) == n
                       and isinstance(a[k], DTensor)), None)
            groups.setdefault(id(dt._spec.mesh) if dt is not None else 0, []).append(k)

        def pick(a, position, idx):
            if isinstance(a, (list, tuple)) and len(a) == n:
                return [a[k] for k in idx]
            if position in per_index_tensor and isinstance(a, torch.Tensor) and a.ndim == 1:
                return a[idx]
            return a
        results = [None] * n
        for idx in groups.values():
            out = op(*[pick(a, i, idx) for i, a in enumerate(args)],
                     **{k: pick(v, names.index(k) if k in names else -1, idx)
                        for k, v in kwargs.items()})
            if returns_list:
                for k, o in zip(idx, out):
                    results[k] = o
        return results if returns_list else None
    return run


def _register_all():
    names = sorted({s.name for s in torch_names.jit_get_all_schemas()
                    if s.name.startswith("aten::_foreach_")})
    for full_name in names:
        name = full_name.split("::")[1]
        if name == "_foreach_mm":
            continue  # a matrix product per element: not elementwise
        packet = getattr(aten, name)
        for ov in packet.overloads():
            overload = getattr(packet, ov)
            if not any(a.is_out for a in overload._schema.arguments):
                # per-element rules see numbers by sign only (pointwise), or the rule decomposes
                # into ops that read the runtime values: cache by sign (foreach_rule withdraws
                # this for an element rule that reads values)
                register_rule(overload, scalars_by_sign=True)(foreach_rule)
                info = _info(overload)
                if info.base in _REDUCING:  # per-tensor results: grouped by mesh in _batched
                    CROSS_MESH_OPS[overload] = _reducing_decomposition(overload, info)
                else:
                    CROSS_MESH_OPS[overload] = _per_mesh(overload)
    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"):
        packet = torch_names.find_op(name)
        if packet is not None:
            for ov in packet.overloads():
                # lr, betas, eps, ...: passed through to the kernel, never read by the rule
                overload = getattr(packet, ov)
                register_rule(overload, scalars_by_sign=True)(fused_optimizer_rule)
                CROSS_MESH_OPS[overload] = _per_mesh(overload)
                # torch's fused Adam takes lr=torch.tensor([0.1]) as well as a 0-d tensor
                SCALAR_TENSOR_KWARGS[overload] = frozenset(("lr", "grad_scale", "found_inf"))


_register_all()
