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
from tests.harness import DistributedTestFailure, run_distributed

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


# ============================================================================ the whole op_db
# Every op of PyTorch's op_db that has float32 CPU samples, on five layouts of 4 ranks, forward
# and (where the OpInfo supports autograd) backward, compared with plain torch via full_tensor().
#
# Outcomes per (op, pass): "pass"; "error" -- a clean ValueError / RuntimeError /
# NotImplementedError, what a user may meet for an unsupported case; "mismatch" -- a wrong value
# without an error; "internal" -- any other exception (IndexError, TypeError, ...) or ranks that
# disagree. The test requires zero mismatches, zero internal errors, and errors only for the ops
# in NOT_SUPPORTED_OP_DB (each with its reason).
#
# The suite runs a sample (the whole measurement takes long on 2 cores): per pass a
# deterministic subset of ops, chosen by a seed that changes daily so that coverage rotates
# (printed; DTL_OPINFO_SEED=<n> replays a run), one sample per op.
# DTL_OPINFO_FULL=1 runs every op with up to 2 samples on every pass and prints the counts;
# DTL_OPINFO_OPS=<regex> runs only the matching ops, DTL_OPINFO_PASSES="S0|R" only those passes; DTL_OPINFO_REPORT=<path> saves every outcome.
import datetime
import hashlib
import os
import re

OP_DB_PASSES = {  # name -> (mesh shape, placements for a tensor of ndim >= 1)
    "S0": ((4,), lambda nd: ["S0"]),
    "R": ((4,), lambda nd: ["R"]),
    "S0,S-1": ((2, 2), lambda nd: ["S0", f"S{nd - 1}"]),
    "S0,S0": ((2, 2), lambda nd: ["S0", "S0"]),
    "R,S0": ((2, 2), lambda nd: ["R", "S0"]),
}
# Run by name only (DTL_OPINFO_PASSES): inputs Partial on one mesh dim, each rank holding a
# different weighted piece (a sum over ranks; the in-place variants' destinations in particular)
OPT_IN_PASSES = {
    "P": ((4,), lambda nd: ["P"]),
    "S0,P": ((2, 2), lambda nd: ["S0", "P"]),
}
FULL_OP_DB = os.environ.get("DTL_OPINFO_FULL") == "1"
# DTL_OPINFO_INPLACE=1: run each OpInfo's in-place variant (ops without one are skipped), forward
# only, comparing the result and the written tensor
INPLACE_OP_DB = os.environ.get("DTL_OPINFO_INPLACE") == "1"
# DTL_OPINFO_IMPL=torch: the same measurement on torch's own DTensor (its pass counts beside
# ours on the installed torch; the test then only prints them, it asserts nothing of torch's)
TORCH_IMPL = os.environ.get("DTL_OPINFO_IMPL", "ours") == "torch"
OP_DB_SEED = int(os.environ.get("DTL_OPINFO_SEED", datetime.date.today().toordinal()))
OPS_PER_PASS = 20  # sampled mode: 5 passes x 20 ops, forward and backward
OP_DB_BATCH = 8 if FULL_OP_DB else 24  # ops per call into the worker pool (a hang loses one)

# Ops of op_db that are knowingly not supported on DTensors, and why (an entry here allows clean
# errors for the op on every pass, never mismatches or internal errors).
NOT_SUPPORTED_OP_DB: dict[str, str] = {
    # sparse layouts: DTensor pieces are strided tensors
    "to_sparse": "sparse layouts (a DTensor's pieces are strided tensors)",
    "sparse.mm.reduce": "sparse CSR inputs (a DTensor's pieces are strided tensors)",
    "sparse.sampled_addmm": "sparse CSR inputs (a DTensor's pieces are strided tensors)",
    # Python decompositions that build a plain tensor in forward code and mix it with DTensors;
    # in user code that mix is an error by design (see DESIGN: only scalars / 0-d tensors are
    # taken as replicated), and forward code cannot tell torch's own helper tensors from a user's
    "__getitem__": "a Python list index becomes a plain index tensor mixed with the DTensor",
    "combinations": "the decomposition builds a plain mask tensor",
    "linalg.matrix_power": "the decomposition copies a plain identity matrix into a DTensor",
    "linalg.matrix_rank": "the decomposition multiplies by a plain tolerance tensor",
    "linalg.matrix_rank.hermitian": "the decomposition multiplies by a plain tolerance tensor",
    "masked.std": "the decomposition divides by a plain count tensor",
    "masked.var": "the decomposition divides by a plain count tensor",
    "quantile": "the decomposition fills through a plain mask tensor",
    "pca_lowrank": "the decomposition multiplies by a plain random matrix",
    "svd_lowrank": "the decomposition multiplies by a plain random matrix",
    "nn.functional.fractional_max_pool2d": "the functional draws its random samples as a plain "
                                           "tensor",
    "nn.functional.fractional_max_pool3d": "the functional draws its random samples as a plain "
                                           "tensor",
    # host reads of tensor data and in-place geometry changes
    "tensor_split": "a tensor of split indices is read on the host (pass a list)",
    "resize_": "resizing a sharded DTensor in place has no per-piece meaning (works replicated)",
    "resize_as_": "resizing a sharded DTensor in place has no per-piece meaning (works "
                  "replicated)",
    # backward formulas that write into views of a matrix the forward gathered: the view is a
    # copy, so the write is refused instead of being lost (forward works)
    "linalg.householder_product": "its backward writes into a view of a gathered matrix",
    "ormqr": "its backward writes into a view of a gathered matrix",
}

CLEAN_ERRORS = (ValueError, RuntimeError, NotImplementedError)


def _op_key(info):
    return info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")


def _lib():
    """The DTensor library under test: ours, or torch's own (DTL_OPINFO_IMPL=torch)."""
    from types import SimpleNamespace
    if TORCH_IMPL:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    else:
        from dtensor_lite import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
    return SimpleNamespace(DTensor=DTensor, Replicate=Replicate, Shard=Shard,
                           distribute_tensor=distribute_tensor, init_device_mesh=init_device_mesh)


def _op_db_entries():
    """(key, index in op_db) of the entries with float32 CPU support, in op_db order."""
    from torch.testing._internal.common_methods_invocations import op_db
    return [(_op_key(o), i) for i, o in enumerate(op_db)
            if torch.float32 in o.supported_dtypes("cpu") and not o.name.startswith("jiterator")]


def _placement(code, Replicate=None, Shard=None):
    if Replicate is None:
        from dtensor_lite import Replicate, Shard
    if code == "P":
        from dtensor_lite import Partial
        return Partial()
    return Replicate() if code == "R" else Shard(int(code[1:]))


def _weighted_partial(t, mesh, pl):
    """``t`` on ``mesh`` with each Partial mesh dim split into pieces t/2, t/2, 0, ... (by
    coordinate): an op that should have reduced first gives other values (2 f(t/2) + (n-2) f(0)
    is not f(t)), and the sum is exact in any order (ill-conditioned ops such as tan near its
    poles would turn a rounded split into a mismatch)."""
    from dtensor_lite import DTensor, Replicate, distribute_tensor
    d = distribute_tensor(t, mesh, [Replicate() if p.is_partial() else p for p in pl],
                          src_data_rank=None)
    local = d.to_local().clone()
    for i, p in enumerate(pl):
        if p.is_partial():
            local = local * (0.5 if mesh.get_coordinate()[i] < 2 else 0.0)
    return DTensor.from_local(local, mesh, pl, shape=t.shape, stride=t.stride())


def place_sample(args, kwargs, mesh, codes, distribute, Replicate=None, Shard=None):
    """A sample's tensors distributed on ``mesh`` by the layout ``codes`` (0-d ones replicated),
    each leaf that requires grad a DTensor leaf that does too: (args, kwargs, those leaves).
    ``distribute`` / ``Replicate`` / ``Shard``: one library's (ours by default; the comparison
    with torch's DTensor passes torch's)."""
    placed = []

    def place(t):
        if not isinstance(t, torch.Tensor) or hasattr(t, "device_mesh"):  # not a DTensor yet
            return t
        if t.ndim == 0:
            pl = [_placement("R", Replicate, Shard)] * mesh.ndim
        else:
            pl = [_placement(c, Replicate, Shard) for c in codes(t.ndim)]
        if any(p.is_partial() for p in pl) and t.is_floating_point():
            d = _weighted_partial(t.detach(), mesh, pl)
        else:
            if any(p.is_partial() for p in pl):  # integer / bool tensors stay whole
                pl = [_placement("R", Replicate, Shard)] * mesh.ndim
            d = distribute(t.detach(), mesh, pl, src_data_rank=None)
        if t.requires_grad:
            d.requires_grad_()
            placed.append(d)
        return d
    dargs, dkwargs = tree_map(place, (args, kwargs))
    return dargs, dkwargs, placed


def _compare(got, want, what):
    """Raises _Mismatch when a value differs. float32 tolerances: sharded reductions add in
    another order, each partial sum rounding at ~1e-7 relative; 1e-4 leaves room for the few
    hundred terms of OpInfo's samples and for ops that amplify it a little (norms, solves)."""
    DTensor = _lib().DTensor
    got_flat, _ = tree_flatten(got)
    want_flat, _ = tree_flatten(want)
    if len(got_flat) != len(want_flat):
        raise _Mismatch(f"{what}: {len(got_flat)} results, expected {len(want_flat)}")
    for k, (g, w) in enumerate(zip(got_flat, want_flat)):
        if isinstance(g, DTensor):
            g = g.full_tensor()
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                raise _Mismatch(f"{what} {k}: got {type(g).__name__}, expected a tensor")
            try:
                torch.testing.assert_close(g.detach(), w.detach(), rtol=1e-4, atol=1e-5,
                                           equal_nan=True, check_stride=False)
            except AssertionError as e:
                raise _Mismatch(f"{what} {k}: {str(e)[:300]}") from None
        elif g != w and not (isinstance(w, float) and w != w and g != g):
            raise _Mismatch(f"{what} {k}: {g!r} != {w!r}")


class _Mismatch(Exception):
    pass


class _NoVariant(Exception):
    pass


def _weighted_sum(outs, like_dtensor):
    """A scalar that depends on every element of every float result with its own weight
    (a plain sum would hide permuted elements)."""
    lib = _lib()
    total = None
    for o in tree_flatten(outs)[0]:
        if not isinstance(o, torch.Tensor) or not o.is_floating_point() or not o.requires_grad:
            continue
        g = torch.Generator().manual_seed(o.numel())
        w = torch.rand(o.shape, generator=g) + 0.5
        if isinstance(o, lib.DTensor):
            w = lib.distribute_tensor(w, o.device_mesh, [lib.Replicate()] * o.device_mesh.ndim,
                                      src_data_rank=None)
        term = (o * w).sum()
        total = term if total is None else total + term
    return total


def _own_storage(t):
    """``t`` in a storage of its own, laid out with its strides: what a DTensor models (a
    sample that is a view into a larger buffer would let as_strided read outside the tensor)."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return t
    try:
        own = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t.detach())
    except RuntimeError:  # overlapping strides (an expanded sample): keep it as it is
        return t
    return own.requires_grad_(t.requires_grad)


def _one_case(info, sample, mesh, codes, seed):
    """One sample on one layout: forward, then backward where autograd applies."""
    lib = _lib()
    args, kwargs = tree_map(_own_storage, ((sample.input, *sample.args), dict(sample.kwargs)))
    plain_leaves = [t for t in tree_flatten((args, kwargs))[0]
                    if isinstance(t, torch.Tensor) and t.requires_grad]
    fn = info.inplace_variant if INPLACE_OP_DB else info.op
    torch.manual_seed(seed)
    dargs, dkwargs, placed = place_sample(args, kwargs, mesh, codes, lib.distribute_tensor,
                                          lib.Replicate, lib.Shard)
    want = fn(*args, **kwargs)
    torch.manual_seed(seed)
    got = fn(*dargs, **dkwargs)
    if INPLACE_OP_DB:
        if got is not dargs[0]:
            raise _Mismatch("in-place variant: the result is not the written DTensor")
        _compare(dargs[0], args[0], "written tensor")
    if info.name.startswith(("empty", "new_empty")) or "empty" in info.name.split("."):
        want, got = tree_map(lambda t: t.shape if isinstance(t, torch.Tensor) else t,
                             (want, got))  # uninitialised memory: shapes only
    _compare(got, want, "result")
    if not plain_leaves:
        return
    loss = _weighted_sum(want, False)
    if loss is None:
        return
    grads = torch.autograd.grad(loss, plain_leaves, allow_unused=True)
    dloss = _weighted_sum(got, True)
    if dloss is None:
        raise _Mismatch("backward: the DTensor result does not require grad")
    dgrads = torch.autograd.grad(dloss, placed, allow_unused=True)
    for k, (g, w) in enumerate(zip(dgrads, grads)):
        if w is None and g is None:
            continue
        w = torch.zeros_like(plain_leaves[k]) if w is None else w
        g = torch.zeros_like(w) if g is None else g
        _compare(g, w, "grad of input")


def _outcome_code(status):
    return ["pass", "error", "mismatch", "internal", "skip"].index(status)


def _run_op_db_batch(pass_name, keys, n_samples):
    """On every rank: run ``keys`` (op_db entries) on one layout; per key (status, detail).
    Ranks check after each op that they agree (which also keeps them in step)."""
    import warnings
    from torch.testing._internal.common_methods_invocations import op_db
    warnings.filterwarnings("ignore")  # OpInfo samples call deprecated ops; fallbacks warn
    by_key = {_op_key(o): o for o in op_db}
    mesh_shape, codes = {**OP_DB_PASSES, **OPT_IN_PASSES}[pass_name]
    mesh = _lib().init_device_mesh("cpu", mesh_shape)
    results = {}
    for key in keys:
        info = by_key[key]
        if FULL_OP_DB:  # shows where each rank is if a batch hangs
            print(f"op_db {pass_name} rank {dist.get_rank()}: {key}", flush=True)
        status, detail = "skip", "no sample plain torch runs"
        try:
            torch.manual_seed(0)
            samples = []
            if INPLACE_OP_DB and info.inplace_variant is None:
                raise _NoVariant
            for s in info.sample_inputs("cpu", torch.float32,
                                        requires_grad=info.supports_autograd and not INPLACE_OP_DB):
                try:
                    torch.manual_seed(1)
                    if INPLACE_OP_DB:
                        info.inplace_variant(_own_storage(s.input), *s.args, **s.kwargs)
                    else:
                        info.op(s.input, *s.args, **s.kwargs)
                except Exception:  # noqa: BLE001 - a sample plain torch rejects is no test
                    continue
                samples.append(s)
                if len(samples) == n_samples:
                    break
            for s in samples:
                _one_case(info, s, mesh, codes, 1)
                status, detail = "pass", ""
        except _NoVariant:
            status, detail = "skip", "no in-place variant"
        except _Mismatch as e:
            status, detail = "mismatch", str(e)
        except CLEAN_ERRORS as e:
            status, detail = "error", f"{type(e).__name__}: {str(e)[:300]}"
        except Exception as e:  # noqa: BLE001 - the outcome this test exists to find
            import traceback
            status, detail = "internal", f"{type(e).__name__}: {str(e)[:200]} @ " + \
                "".join(traceback.format_tb(e.__traceback__)[-8:])[-2500:]
        if FULL_OP_DB:
            print(f"op_db {pass_name} rank {dist.get_rank()}: {key} -> {status} {detail[:300]}",
                  flush=True)
        code = torch.tensor([_outcome_code(status), -_outcome_code(status)])
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        if code[0] != -code[1]:
            status, detail = "internal", f"ranks disagree ({status} here): {detail}"
        results[key] = (status, detail)
    return results


def _chosen_ops(pass_name, keys):
    if FULL_OP_DB:
        return keys
    rank = lambda k: hashlib.sha256(f"{OP_DB_SEED}/{pass_name}/{k}".encode()).hexdigest()
    return sorted(keys, key=rank)[:OPS_PER_PASS]


def test_opinfo_whole_op_db():
    only = os.environ.get("DTL_OPINFO_OPS", "")  # a regex: run only the matching ops
    keys = [k for k, _ in _op_db_entries() if re.search(only, k)]
    n_samples = 2 if FULL_OP_DB else 1
    results: dict = {}
    passes = os.environ.get("DTL_OPINFO_PASSES", "|".join(OP_DB_PASSES)).split("|")
    for pass_name in passes:
        chosen = _chosen_ops(pass_name, keys)
        for i in range(0, len(chosen), OP_DB_BATCH):
            batch = chosen[i:i + OP_DB_BATCH]
            try:
                out = run_distributed(4, _run_op_db_batch, pass_name, batch, n_samples,
                                      timeout=60 + 30 * len(batch))[0]
            except DistributedTestFailure as e:  # a hang or a dead rank: blame the whole batch
                out = {k: ("internal", f"batch failed: {str(e)[-3000:]}") for k in batch}
            results.update({(pass_name, k): r for k, r in out.items()})
    lines = [f"op_db ({'full' if FULL_OP_DB else f'sample, seed {OP_DB_SEED}'}, "
             f"{len(keys)} entries, {'torch' if TORCH_IMPL else 'our'} DTensor, "
             f"torch {torch.__version__}):"]
    for pass_name in passes:
        rs = [r for (p, _), r in results.items() if p == pass_name]
        count = {s: sum(1 for st, _ in rs if st == s) for s in
                 ("pass", "error", "mismatch", "internal", "skip")}
        tried = len(rs) - count["skip"]
        lines.append(f"  {pass_name:7s}: {count['pass']}/{tried} ops pass, {count['error']} "
                     f"clean errors, {count['mismatch']} mismatches, {count['internal']} internal")
    conftest.SUMMARY_LINES.extend(lines)
    print("\n".join(lines))
    if os.environ.get("DTL_OPINFO_REPORT"):
        import json
        with open(os.environ["DTL_OPINFO_REPORT"], "w") as f:
            json.dump({f"{p}|{k}": r for (p, k), r in results.items()}, f, indent=1)
    if TORCH_IMPL:
        return  # a measurement of torch's DTensor, printed above
    bad = {pk: r for pk, r in results.items() if r[0] in ("mismatch", "internal") or (
        r[0] == "error" and pk[1] not in NOT_SUPPORTED_OP_DB)}
    assert not bad, f"OpInfo seed {OP_DB_SEED}:\n" + "\n".join(
        f"{p} {k}: {s}: {d}" for (p, k), (s, d) in sorted(bad.items()))
