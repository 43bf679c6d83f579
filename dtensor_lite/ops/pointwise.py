"""Elementwise ops: shard any output dim the inputs share (broadcast dims stay replicated);
keep Partial where the op commutes with the Partial's reduction, resolve it everywhere else.

Which ops: every aten overload tagged ``torch.Tag.pointwise`` (minus ``out=`` overloads, which the
dispatcher routes through their functional op, seeded random ops, which ``random.py`` owns, and
list ops, which ``foreach.py`` owns), plus the untagged elementwise ops listed in ``_EXTRA``.

When a Partial survives (one strategy per mesh dim, picked by the dispatcher's cost model):

* copies and casts that are linear / monotone for the dtypes involved keep any Partial;
* ``neg``: sum/avg stay, max <-> min swap; non-decreasing unary ops keep max/min;
* ``add``/``sub``/``rsub``/``where``/``masked_fill``: sum/avg when every operand is (made) Partial
  -- a replicated DTensor operand becomes Partial for free (zeros off coordinate 0), and a Python
  scalar or 0-d plain tensor is applied on coordinate 0 only, so ``P + 1`` adds 1 exactly once;
  max/min when the other operands are replicated (a shift or a selection commutes with max);
* ``mul``: one Partial(sum/avg) factor times replicated ones; by a Python scalar also max/min
  (swapped for a negative scalar); ``div``: a Partial numerator over a replicated denominator;
* ``lerp``/``addcmul``/``addcdiv``: jointly linear in (self, the other Partial operand);
* ``maximum``/``minimum`` & co: monotone in each operand, so max/min Partials survive (not the
  NaN-dropping ``fmax``/``fmin``/``sign``/``nan_to_num``: max/min Partials propagate NaN).
"""
from __future__ import annotations

import torch

from .. import _torch_names as torch_names
from ..placements import LINEAR_REDUCE_OPS, Partial, Replicate, Shard
from ..spec import DTensorSpec
from ._registry import Decompose, FullStrategy, get_rule, register_rule
from .kit import arg_at, choose, input_locations

aten = torch_names.aten
R = Replicate()

__all__ = ["pointwise_strategies", "with_scalar_zeroing", "reads_number_signs_only", "POINTWISE_OPS"]

_FLIP = {"sum": "sum", "avg": "avg", "max": "min", "min": "max"}
_NUMBER = (int, float, bool, complex)

# ------------------------------------------------------------------ which ops
# elementwise but not tagged pointwise in this torch version
_EXTRA = [
    "_to_copy", "alias", "detach", "lift_fresh", "_conj", "resolve_conj", "resolve_neg",
    "floor_divide", "float_power", "isreal", "hardswish", "abs_", "copysign_", "xlogy_",
    "polygamma_", "where", "masked_fill", "rsub", "elu_backward", "hardtanh_backward",
    "leaky_relu_backward", "softplus_backward", "hardswish_backward", "hardsigmoid_backward",
    "mish_backward", "softshrink_backward", "hardshrink_backward", "native_dropout_backward",
    "_conj_physical", "conj_physical", "clamp", "clip", "log_sigmoid_backward", "complex",
    "polar", "_prelu_kernel", "_prelu_kernel_backward",
]

# partial behaviour by base op name (in-place and functional variants alike)
_COPY = {"clone", "alias", "detach", "lift_fresh", "positive", "_conj", "resolve_conj",
         "resolve_neg", "contiguous"}
# Non-decreasing *and* NaN-preserving: max / min reductions propagate NaN, so an op that maps NaN
# to a number (sign, sgn, nan_to_num; fmax / fmin below) would let one rank's NaN be outvoted.
_NON_DECREASING = {
    "asinh", "atan", "ceil", "deg2rad", "erf", "exp", "exp2", "expm1", "floor", "rad2deg",
    "relu", "relu6", "round", "sigmoid", "sinh", "tanh", "trunc", "hardshrink", "hardtanh",
    "hardsigmoid", "softplus", "selu", "special_i1", "clamp", "clamp_min", "clamp_max", "clip",
}
_NON_INCREASING = {"erfc"}
_MAXIMUM = {"maximum", "max"}        # max.other: the binary elementwise overload
_MINIMUM = {"minimum", "min"}


def _base(op) -> str:
    name = op._schema.name.split("::")[-1]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _candidate_names():
    """Qualified names ("aten::add.Tensor") of every registered aten overload that is tagged
    pointwise or named in _EXTRA. ``dir(aten)`` would only list the packets loaded so far, so
    the coverage would depend on import order; the registry lists them all."""
    extra = set(_EXTRA) | {n.rstrip("_") for n in _EXTRA}
    out = []
    for name in torch_names.dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        qualified, _, overload = name.partition(".")
        base = qualified[len("aten::"):]
        if base in extra or base.rstrip("_") in extra:
            out.append((base, overload))
            continue
        if torch.Tag.pointwise in _tags(qualified, base, overload):
            out.append((base, overload))
    return out


def _tags(qualified, base, overload):
    try:  # the tags without building an OpOverload object (3000 of those take ~1 s)
        found = torch_names.get_operation_overload(qualified, overload)
        return found[2] if found is not None else ()
    except (AttributeError, TypeError, IndexError):  # private API changed or gone: the slow way
        return getattr(getattr(aten, base), overload or "default").tags


def _discover():
    keep = []
    for base, overload in _candidate_names():
        op = getattr(getattr(aten, base), overload or "default")
        schema = op._schema
        if torch.Tag.nondeterministic_seeded in op.tags:
            continue  # random ops: random.py makes them reproducible across meshes
        if any(a.is_out for a in schema.arguments):
            continue  # the dispatcher runs out= through the functional overload
        if any("[]" in str(a.type) or "List[" in str(a.type)  # Tensor[] prints as List[Tensor]
               for a in list(schema.arguments) + list(schema.returns)):
            continue  # foreach / list ops (foreach.py), where(cond) -> nonzero (tensor_ops.py)
        if not any("Tensor" in str(r.type) for r in schema.returns):
            continue
        keep.append(op)
    return sorted(keep, key=str)


# ------------------------------------------------------------------ shared helpers
def _zero_like(v):
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v)
    return type(v)(0)


def with_scalar_zeroing(call, full: FullStrategy, value_slots) -> FullStrategy:
    """Where the output is Partial(sum) on a mesh dim, additive scalar operands (Python numbers,
    0-d plain tensors) at ``value_slots`` (arg positions or kwarg names) must count once: they
    are applied on coordinate 0 of those mesh dims and replaced by 0 elsewhere."""
    sum_dims = [i for i, p in enumerate(full.outs[0]) if p is not None and p.is_partial("sum")]
    if not sum_dims:
        return full
    coord = call.mesh.get_coordinate()
    if all(coord[i] == 0 for i in sum_dims):
        return full
    zero = [s for s in value_slots
            if _is_scalar(arg_at(call, s) if isinstance(s, int) else arg_at(call, None, s))]
    if not zero:
        return full
    op = full.local_fn or call.op

    def local_fn(*args, **kwargs):
        args = list(args)
        for s in zero:
            if isinstance(s, int):
                args[s] = _zero_like(args[s])
            else:
                kwargs[s] = _zero_like(kwargs[s])
        return op(*args, **kwargs)

    return FullStrategy(full.outs, full.ins, local_fn, full.out_orders, full.in_orders)


def _is_scalar(a) -> bool:
    return isinstance(a, _NUMBER) or (isinstance(a, torch.Tensor) and a.ndim == 0)


def _number(a):
    return a if isinstance(a, (int, float, bool)) else None


def _n_outputs(op) -> int:
    return sum(1 for r in op._schema.returns if "Tensor" in str(r.type))


# ------------------------------------------------------------------ strategies
def pointwise_strategies(call, n_out: int | None = None) -> list:
    """Replicate, plus Shard(d) for every output dim d: inputs whose dim d is broadcast (size 1
    against a larger output, or missing) stay replicated."""
    inputs = call.inputs
    n_out = _n_outputs(call.op) if n_out is None else n_out
    out_ndim = max(s.ndim for s in inputs)
    out_shape = list(torch.broadcast_shapes(*[s.shape for s in inputs]))
    strategies = [((R,) * n_out, (R,) * len(inputs))]
    for d in range(out_ndim):
        ins = []
        for spec in inputs:
            dd = d - (out_ndim - spec.ndim)
            ins.append(Shard(dd) if dd >= 0 and spec.shape[dd] == out_shape[d] else R)
        strategies.append(((Shard(d),) * n_out, tuple(ins)))
    return strategies


def _by_arg(call, out, placed: dict, default=R):
    """One strategy: output ``out``; the DTensor at arg position k gets ``placed[k]``."""
    ins = tuple(placed.get(loc[0], default) for loc in input_locations(call))
    return ((out,), ins)


def _partial_ops(call) -> list:
    return sorted({p.reduce_op for s in call.inputs for p in s.placements if p.is_partial()})


def _dt_positions(call, positions):
    return [k for k in positions if isinstance(arg_at(call, k), DTensorSpec)]


def _additive(call, ops, name):
    """add/sub/rsub: sum/avg with every DTensor operand Partial (a replicated one becomes
    Partial for free); max/min with one Partial operand shifted by replicated others (swapped
    when that operand enters with a negative sign)."""
    alpha = call.kwargs.get("alpha", call.args[2] if len(call.args) > 2 else 1)
    s = (alpha > 0) - (alpha < 0) if isinstance(alpha, (int, float)) else 0
    # the sign each operand enters with: a + alpha*b, a - alpha*b, and rsub's b - alpha*a
    signs = {"add": (1, s), "sub": (1, -s), "rsub": (-s, 1)}[name]
    dts = _dt_positions(call, (0, 1))
    out = []
    for r in ops:
        if r in LINEAR_REDUCE_OPS:
            out.append(_by_arg(call, Partial(r), {k: Partial(r) for k in dts}))
            continue
        for k in dts:
            if signs[k]:
                out.append(_by_arg(call, Partial(r if signs[k] > 0 else _FLIP[r]), {k: Partial(r)}))
    return out


def _selecting(call, ops, value_positions):
    """where / masked_fill: the result takes each element from one of the value operands, so any
    reduction commutes when every value operand is Partial alike (replicated ones become Partial
    for free: zeros off coordinate 0 for sum, the value itself for avg/max/min)."""
    dts = _dt_positions(call, value_positions)
    return [_by_arg(call, Partial(r), {k: Partial(r) for k in dts}) for r in ops]


def _scaling(call, ops, name):
    """mul: exactly one Partial(sum/avg) factor; div: a Partial numerator. A Python-scalar factor
    keeps max/min too (swapped when negative)."""
    dts = _dt_positions(call, (0, 1))
    factors = dts if name == "mul" else [k for k in dts if k == 0]
    out = []
    for r in ops:
        if r in LINEAR_REDUCE_OPS:
            out += [_by_arg(call, Partial(r), {k: Partial(r)}) for k in factors]
        elif len(dts) == 1 and dts[0] == 0:
            c = _number(call.args[1]) if len(call.args) > 1 else None
            if c is None or (name == "div" and c == 0):
                continue
            out.append(_by_arg(call, Partial(r if c >= 0 else _FLIP[r]), {0: Partial(r)}))
    return out


def _monotone_binary(call, ops, keep):
    """maximum-like (keep='max') / minimum-like: f(., y) is non-decreasing, so one Partial(max or
    min) operand with a replicated other survives; both Partial(keep) survive too."""
    dts = _dt_positions(call, (0, 1))
    out = [_by_arg(call, Partial(keep), {k: Partial(keep) for k in dts})] if keep in ops else []
    for r in ops:
        if r in ("max", "min"):
            out += [_by_arg(call, Partial(r), {k: Partial(r)}) for k in dts]
    return out


def _cast_keeps(src: torch.dtype, dst: torch.dtype, r: str) -> bool:
    """Does casting src -> dst commute with the reduction r over ranks?"""
    if src == dst:
        return True
    if torch.bool in (src, dst):
        return False  # bool(a + b) != bool(a) + bool(b), and not monotone for negatives
    if r in LINEAR_REDUCE_OPS:
        if dst.is_floating_point or dst.is_complex:
            return True  # linear up to rounding (complex -> real drops a part linearly)
        # truncating floats is not linear; integer -> integer wraps linearly (sum only)
        return r == "sum" and not (src.is_floating_point or src.is_complex)
    # max / min need a non-decreasing cast
    if src.is_complex or dst.is_complex:
        return False
    if dst.is_floating_point:
        return True
    if not dst.is_signed and (src.is_floating_point or src.is_signed):
        return False  # negatives wrap around
    return src.is_floating_point or dst.itemsize >= src.itemsize  # no overflow wrap-around


def _partial_strategies(call, name, ops) -> list:
    n_out = _n_outputs(call.op)
    if n_out != 1 or not ops:
        return []
    nd = len(call.inputs)
    if name in _COPY:
        return [((Partial(r),), (Partial(r),) * nd) for r in ops]
    if name == "_to_copy":
        dst = call.kwargs.get("dtype") or call.inputs[0].dtype
        return [((Partial(r),), (Partial(r),)) for r in ops
                if _cast_keeps(call.inputs[0].dtype, dst, r)]
    if name == "neg":
        return [((Partial(_FLIP[r]),), (Partial(r),)) for r in ops]
    if name in ("add", "sub", "rsub"):
        return _additive(call, ops, name)
    if name in ("mul", "div") and not (name == "div" and "rounding_mode" in call.kwargs
                                       and call.kwargs["rounding_mode"] is not None):
        return _scaling(call, ops, name)
    if name == "where":
        return _selecting(call, ops, (1, 2))
    if name == "masked_fill":
        return _selecting(call, ops, (0, 2))
    if name == "lerp":
        return [_by_arg(call, Partial(r), {0: Partial(r), 1: Partial(r)})
                for r in ops if r in LINEAR_REDUCE_OPS]
    if name in ("addcmul", "addcdiv"):
        factors = (1, 2) if name == "addcmul" else (1,)
        return [_by_arg(call, Partial(r), {0: Partial(r), k: Partial(r)})
                for r in ops if r in LINEAR_REDUCE_OPS for k in factors]
    if name in _MAXIMUM or (name == "clamp_min" and nd == 2):
        return _monotone_binary(call, ops, "max")
    if name in _MINIMUM or (name == "clamp_max" and nd == 2):
        return _monotone_binary(call, ops, "min")
    if name in ("clamp", "clip") and isinstance(call.args[0], DTensorSpec):
        # non-decreasing in self for fixed (replicated) bounds
        return [_by_arg(call, Partial(r), {0: Partial(r)}) for r in ops if r in ("max", "min")]
    if nd == 1 and (name in _NON_DECREASING or _monotone_with_args(call, name)):
        return [((Partial(r),), (Partial(r),)) for r in ops if r in ("max", "min")]
    if nd == 1 and name in _NON_INCREASING:
        return [((Partial(_FLIP[r]),), (Partial(r),)) for r in ops if r in ("max", "min")]
    return []


def _monotone_with_args(call, name) -> bool:
    """Ops that are non-decreasing for some argument values only."""
    if name == "leaky_relu":
        slope = call.args[1] if len(call.args) > 1 else call.kwargs.get("negative_slope", 0.01)
        return isinstance(slope, (int, float)) and slope >= 0
    if name in ("elu", "celu"):
        alpha = call.args[1] if len(call.args) > 1 else call.kwargs.get("alpha", 1.0)
        return isinstance(alpha, (int, float)) and alpha > 0
    if name == "threshold":  # x if x > t else v: non-decreasing iff v <= t
        return len(call.args) > 2 and call.args[2] <= call.args[1]
    return False


# slots of additive scalar operands that must count once under Partial(sum)
_VALUE_SLOTS = {"add": (0, 1), "sub": (0, 1), "rsub": (0, 1), "where": (1, 2),
                "masked_fill": (2,)}


def _to_copy_on_device(call):
    """``_to_copy(..., device=d)`` (autograd's backward of a cast passes the device): the pieces
    stay where the mesh keeps them, so a same-device ``device=`` is dropped (the metadata pass
    cannot copy a meta tensor "to cpu"); a real move between devices is refused."""
    device = torch.device(call.kwargs["device"])
    mesh_type = call.mesh.device_type
    if device.type != mesh_type:
        raise ValueError(f"{call.op}: moving a DTensor on a {mesh_type!r} mesh to {device} is not "
                         "supported; build the DTensor on a mesh of that device type instead "
                         "(e.g. distribute_tensor(t.to(device), mesh_on_device, placements))")

    def run(x, *args, **kwargs):
        kwargs.pop("device")
        return aten._to_copy.default(x, *args, **kwargs)
    return Decompose(run)


# ops whose rule compares number arguments with each other (threshold: v <= t), not with zero
_READS_VALUES = {"threshold"}


def reads_number_signs_only(op) -> bool:
    """Whether ``op``'s rule (when it is ``pointwise_rule``) looks at its int / float arguments
    only through their sign: ``alpha``'s sign for add/sub, a factor's sign and zero-ness for
    mul/div, slopes for leaky_relu/elu; additive scalars are zeroed by a ``local_fn`` that reads
    the runtime values. The foreach rule relies on this to cache by sign (see register_rule)."""
    return get_rule(op) is pointwise_rule and _base(op) not in _READS_VALUES


def pointwise_rule(call):
    name = _base(call.op)
    if name == "_to_copy" and call.kwargs.get("device") is not None:
        return _to_copy_on_device(call)
    strategies = pointwise_strategies(call)
    ops = _partial_ops(call)
    if not ops:
        return strategies  # nothing Partial: the dispatcher expands the list itself
    # Partial strategies last: on a tie the plain Shard/Replicate ones win
    full = choose(call, strategies + _partial_strategies(call, name, ops))
    if name in _VALUE_SLOTS:
        full = with_scalar_zeroing(call, full, _VALUE_SLOTS[name])
    return full


@register_rule(aten.log_sigmoid_forward.default)
def _log_sigmoid_forward(call):
    """(output, buffer), both elementwise. CUDA kernels return an empty buffer (their backward
    ignores it) where the metadata pass promises the input's shape: such a buffer is replaced by
    a zero-memory expanded one of the promised shape."""
    strategies = pointwise_strategies(call, n_out=2)
    if call.mesh.device_type == "cpu":
        return strategies
    full = choose(call, strategies)

    def run(x):
        out, buffer = aten.log_sigmoid_forward.default(x)
        if buffer.shape != x.shape:
            buffer = x.new_zeros(()).expand(x.shape)
        return out, buffer
    full.local_fn = run
    return full


POINTWISE_OPS = _discover()
for _op in POINTWISE_OPS:
    # decisions keyed by the numbers' sign, not value: a for-loop optimizer or an LR schedule
    # passes new floats every step, and value keys would grow the decision cache every step
    register_rule(_op, scalars_by_sign=_base(_op) not in _READS_VALUES)(pointwise_rule)
