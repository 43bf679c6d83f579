"""OpInfo-driven coverage: PyTorch's own sample inputs for the ops of every rule family, run on
DTensors with several placements on a 2x2 mesh, compared with the plain result via full_tensor().

Each family is one test; the body returns per-op (passed, tried, first failure) from rank 0, the
driver prints a coverage summary (ops passed / tried) and fails for any op that is neither fully
passing nor listed in NOT_SUPPORTED with its reason.
"""
import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

from tests import conftest
from tests.harness import run_distributed

FAMILIES = {
    "pointwise": ["add", "sub", "mul", "div", "neg", "abs", "exp", "log", "sin", "cos", "tanh",
                  "sigmoid", "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu",
                  "pow", "sqrt", "rsqrt", "where", "clamp", "maximum", "minimum", "lerp",
                  "addcmul", "addcdiv", "masked_fill", "clone", "fill"],
    "matrix": ["mm", "addmm", "bmm", "baddbmm", "matmul", "nn.functional.linear", "einsum"],
    "reduction": ["sum", "mean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "norm",
                  "linalg.vector_norm", "var", "std", "all", "any", "logsumexp", "cumsum"],
    "view": ["view", "reshape", "flatten", "unflatten", "transpose", "permute", "t", "squeeze",
             "unsqueeze", "expand", "contiguous", "narrow", "select", "split", "chunk", "unbind"],
    "tensor": ["cat", "stack", "index_select", "gather", "scatter", "scatter_add", "tril", "triu",
               "repeat", "sort", "topk", "zeros_like", "ones_like", "full_like", "new_zeros",
               "new_ones"],
    "nn": ["nn.functional.embedding", "nn.functional.layer_norm", "nn.functional.rms_norm",
           "softmax", "log_softmax", "nn.functional.cross_entropy", "nn.functional.nll_loss",
           "nn.functional.mse_loss", "nn.functional.conv1d", "nn.functional.conv2d",
           "nn.functional.conv_transpose1d", "nn.functional.scaled_dot_product_attention"],
}

# Ops of the families above that are knowingly not (fully) supported, and why.
NOT_SUPPORTED: dict[str, str] = {
}

SAMPLES_PER_OP = 4


def _placements_for(ndim, pattern):
    from dtensor_lite import Replicate, Shard
    if pattern == "R,R" or ndim == 0:
        return [Replicate(), Replicate()]
    if pattern == "S0,S-1":
        return [Shard(0), Shard(ndim - 1)]
    if pattern == "S0,S0":
        return [Shard(0), Shard(0)]
    first, second = pattern.split(",")  # "S1,R" or "R,S0": shard one tensor dim on one mesh dim
    sharded = first if first != "R" else second
    d = int(sharded[1:])
    if d >= ndim:
        return [Replicate(), Replicate()]
    return [Shard(d), Replicate()] if first != "R" else [Replicate(), Shard(d)]


PATTERNS = ["R,R", "S0,R", "S1,R", "S2,R", "R,S0", "R,S1", "S0,S-1", "S0,S0"]


def _run_family(family):
    """On every rank: run each op's samples with each placement pattern; rank results agree."""
    from torch.testing._internal.common_methods_invocations import op_db
    from dtensor_lite import DTensor, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2))
    results = {}
    infos: dict = {}
    for o in op_db:  # every variant of an op (e.g. div's rounding modes) counts for that op
        if o.name in FAMILIES[family]:
            infos.setdefault(o.name, []).append(o)
    for name in FAMILIES[family]:
        if dist.get_rank() == 0:
            print(f"opinfo {family}: {name}", flush=True)  # shows which op a timeout hit
        passed = tried = 0
        failure = None
        if name not in infos:
            results[name] = (0, 0, "no OpInfo entry")
            continue
        torch.manual_seed(0)
        cases = [(info, sample) for info in infos[name] for sample in list(
            info.sample_inputs("cpu", torch.float32, requires_grad=False))[:SAMPLES_PER_OP]]
        for info, sample in cases:
            args = (sample.input, *sample.args)
            kwargs = dict(sample.kwargs)
            try:
                expected = info.op(*args, **kwargs)
            except Exception:  # noqa: BLE001 - a sample plain torch rejects is not a test
                continue
            for pattern in PATTERNS:
                def place(t):
                    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                        pl = _placements_for(t.ndim, pattern) if t.is_floating_point() \
                            else _placements_for(0, "R,R")
                        return distribute_tensor(t, mesh, pl, src_data_rank=None)
                    return t
                tried += 1
                try:
                    out = info.op(*tree_map(place, args), **tree_map(place, kwargs))
                    got, _ = tree_flatten(out)
                    want, _ = tree_flatten(expected)
                    assert len(got) == len(want), f"{len(got)} outputs, expected {len(want)}"
                    for g, w in zip(got, want):
                        if isinstance(w, torch.Tensor):
                            g = g.full_tensor() if isinstance(g, DTensor) else g
                            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, equal_nan=True,
                                                       check_stride=False)
                        else:
                            assert g == w, f"{g!r} != {w!r}"
                    passed += 1
                except Exception as e:  # noqa: BLE001 - recorded and reported by the driver
                    if failure is None:
                        shapes = [tuple(t.shape) for t in tree_flatten(args)[0]
                                  if isinstance(t, torch.Tensor)]
                        failure = f"{pattern} on {shapes}: {type(e).__name__}: {str(e)[:300]}"
        results[name] = (passed, tried, failure)
    return results


@pytest.mark.parametrize("family", list(FAMILIES))
def test_opinfo_family(family):
    results = run_distributed(4, _run_family, family, timeout=600)[0]
    ops_ok = sum(1 for p, t, _ in results.values() if t and p == t)
    cases_ok = sum(p for p, _, _ in results.values())
    cases = sum(t for _, t, _ in results.values())
    conftest.SUMMARY_LINES.append(
        f"OpInfo {family:10s}: {ops_ok}/{len(results)} ops fully pass, {cases_ok}/{cases} cases")
    unexpected = {name: r for name, r in results.items()
                  if name not in NOT_SUPPORTED and (r[1] == 0 or r[0] != r[1])}
    assert not unexpected, "\n".join(
        f"{name}: {p}/{t} passed; first failure: {f}" for name, (p, t, f) in unexpected.items())
