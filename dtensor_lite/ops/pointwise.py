"""Elementwise ops: shard any output dim the inputs share (broadcast dims stay replicated);
keep Partial where the op is linear in its Partial operand, resolve it everywhere else."""
from __future__ import annotations

import torch

from ..placements import Partial, Replicate, Shard
from ..spec import DTensorSpec
from ._registry import register_rule

aten = torch.ops.aten

# f(x) that commute with a Partial reduction: kept Partial (copies keep every reduction)
COPY_LIKE = ["clone", "detach", "alias", "_to_copy", "contiguous", "lift_fresh", "positive",
             "_conj", "resolve_conj", "resolve_neg"]
NEGATING = ["neg"]  # linear: keeps sum/avg
ADDITIVE = ["add", "sub"]  # P + P -> P when every operand is a DTensor
MULTIPLICATIVE = ["mul"]  # P * R -> P (one Partial operand)
DIVIDING = ["div"]  # P / R -> P (Partial numerator only)

UNARY = [
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "bitwise_not", "ceil", "cos", "cosh",
    "deg2rad", "digamma", "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "floor", "frac",
    "gelu", "hardsigmoid", "hardswish", "hardtanh", "i0", "isfinite", "isinf", "isnan",
    "isneginf", "isposinf", "leaky_relu", "lgamma", "log", "log10", "log1p", "log2",
    "logical_not", "logit", "mish", "nan_to_num", "rad2deg", "reciprocal", "relu", "relu6",
    "round", "rsqrt", "sgn", "sigmoid", "sign", "signbit", "silu", "sin", "sinc", "sinh",
    "softplus", "sqrt", "square", "tan", "tanh", "trunc", "elu", "celu", "selu", "glu_jvp",
    "angle", "conj_physical", "bitwise_left_shift", "polygamma", "mvlgamma", "threshold",
    "hardshrink", "softshrink", "clamp", "clamp_min", "clamp_max", "clip", "pow", "fill",
    "native_dropout_backward", "sigmoid_backward", "tanh_backward", "threshold_backward",
    "gelu_backward", "silu_backward", "hardtanh_backward", "leaky_relu_backward",
    "elu_backward", "softplus_backward", "mish_backward", "hardsigmoid_backward",
    "hardswish_backward", "logit_backward", "rsub", "remainder", "fmod", "atan2", "hypot",
    "maximum", "minimum", "fmax", "fmin", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
    "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "copysign",
    "floor_divide", "true_divide", "xlogy", "special_xlog1py", "nextafter", "lerp", "addcmul",
    "addcdiv", "where", "heaviside", "igamma", "igammac", "ldexp", "logaddexp", "logaddexp2",
    "float_power", "masked_fill", "bitwise_right_shift", "fmod", "sub", "neg",
    "to", "_to_copy", "zero", "exponential", "frexp", "isreal", "clamp_", "copy",
]


def _is_operand(a) -> bool:
    return isinstance(a, (DTensorSpec, torch.Tensor, int, float, complex, bool))


def pointwise_strategies(call, partial_mode: str | None = None):
    """Per-mesh-dim strategies for an elementwise op with broadcasting.

    ``partial_mode``: None (resolve Partial), "copy" (keep any Partial), "neg" (keep sum/avg),
    "add" (all operands Partial alike), "mul" (one Partial operand), "div" (Partial numerator).
    """
    inputs = call.inputs
    out_ndim = max(s.ndim for s in inputs)
    out_shape = list(torch.broadcast_shapes(*[s.shape for s in inputs]))
    n = len(inputs)
    strategies = [((Replicate(),), (Replicate(),) * n)]
    for d in range(out_ndim):
        ins = []
        for spec in inputs:
            dd = d - (out_ndim - spec.ndim)
            ins.append(Shard(dd) if dd >= 0 and spec.shape[dd] == out_shape[d] else Replicate())
        strategies.append(((Shard(d),), tuple(ins)))
    if partial_mode is None:
        return strategies
    operands = [a for a in call.args if _is_operand(a)]
    all_dtensor = all(isinstance(a, DTensorSpec) for a in operands)
    if partial_mode == "copy":
        for op in ("sum", "avg", "max", "min"):
            strategies.append(((Partial(op),), (Partial(op),) * n))
    elif partial_mode == "neg" or (partial_mode == "add" and all_dtensor):
        for op in ("sum", "avg"):
            strategies.append(((Partial(op),), (Partial(op),) * n))
    elif partial_mode in ("mul", "div"):
        positions = range(n) if partial_mode == "mul" else (
            [0] if isinstance(call.args[0], DTensorSpec) else [])
        for j in positions:
            for op in ("sum", "avg"):
                ins = [Replicate()] * n
                ins[j] = Partial(op)
                strategies.append(((Partial(op),), tuple(ins)))
    return strategies


def _register(names, partial_mode=None):
    for name in dict.fromkeys(names):
        for variant in (name, name + "_"):
            packet = getattr(aten, variant, None)
            if packet is None:
                continue
            register_rule(packet)(lambda call, m=partial_mode: pointwise_strategies(call, m))


_register(UNARY)
_register(COPY_LIKE, "copy")
_register(NEGATING, "neg")
_register(ADDITIVE, "add")
_register(MULTIPLICATIVE, "mul")
_register(DIVIDING, "div")
