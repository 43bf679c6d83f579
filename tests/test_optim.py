"""torch.optim and grad clipping on DTensor parameters: the same parameters and norms as on plain
tensors, through the for-loop, foreach and fused paths, with no communication where the
placements already line up."""
import math

import pytest
import torch
import torch.nn as nn

from dtensor_lite import (Partial, Replicate, Shard, _StridedShard, distribute_tensor,
                          init_device_mesh)
from dtensor_lite.debug import CommDebugMode
from tests._spies import process_group_calls
from tests.harness import distributed

# uneven shards, empty shards (3 rows on 2x2), one dim split by two mesh dims in both orders
PARAMS = [
    ((5, 3), [Shard(0), Shard(1)]),
    ((7,), [Shard(0), Shard(0)]),
    ((4, 6), [Replicate(), Shard(1)]),
    ((3, 1), [Shard(0), Shard(0)]),
    ((2, 3), [Replicate(), Replicate()]),
    ((8, 4), [_StridedShard(0, split_factor=2), Shard(0)]),
]

OPTIMIZERS = [
    ("sgd", torch.optim.SGD, dict(lr=0.1)),
    ("sgd_momentum_nesterov_wd", torch.optim.SGD,
     dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("sgd_momentum_dampening", torch.optim.SGD, dict(lr=0.1, momentum=0.8, dampening=0.3)),
    ("adam_wd", torch.optim.Adam, dict(lr=0.01, weight_decay=0.1)),
    ("adam_amsgrad_maximize", torch.optim.Adam, dict(lr=0.01, amsgrad=True, maximize=True)),
    ("adamw", torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    ("adamw_amsgrad", torch.optim.AdamW, dict(lr=0.01, amsgrad=True)),
]


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _params(mesh):
    full = [torch.randn(shape) for shape, _ in PARAMS]
    plain = [nn.Parameter(t.clone()) for t in full]
    dist_ = [nn.Parameter(distribute_tensor(t.clone(), mesh, pl))
             for t, (_, pl) in zip(full, PARAMS)]
    return plain, dist_


def _set_grads(plain, dist_, mesh, grad_placements=None):
    for k, (p, d) in enumerate(zip(plain, dist_)):
        g = torch.randn(p.shape)
        p.grad = g.clone()
        pl = d.placements if grad_placements is None else grad_placements(k, d)
        d.grad = distribute_tensor(g, mesh, pl)


@distributed(world_size=4)
@pytest.mark.parametrize("name,cls,kwargs", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_optimizer_steps_match_plain_tensors(name, cls, kwargs):
    mesh = _mesh()
    for path in ("for-loop", "foreach", "fused"):
        torch.manual_seed(0)
        plain, dist_ = _params(mesh)
        opts = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True),
                "fused": dict(fused=True)}[path]
        ref, opt = cls(plain, **kwargs, **opts), cls(dist_, **kwargs, **opts)
        for step in range(3):
            _set_grads(plain, dist_, mesh)
            ref.step()
            with CommDebugMode() as comm:
                opt.step()
            # grads and optimizer state already sit where their parameter is: nothing moves
            assert comm.get_total_counts() == 0, (path, comm.get_comm_counts())
            for p, d, (_, pl) in zip(plain, dist_, PARAMS):
                assert d.placements == tuple(pl), path
                torch.testing.assert_close(d.full_tensor(), p.detach(),
                                           msg=lambda m: f"{path}: {m}")
        for p, d in zip(plain, dist_):
            for key, value in ref.state[p].items():
                other = opt.state[d][key]
                if isinstance(value, torch.Tensor) and value.ndim > 0:
                    assert other.placements == d.placements, (path, key)
                    torch.testing.assert_close(other.full_tensor(), value)


@distributed(world_size=4)
def test_optimizer_with_partial_and_misplaced_grads():
    """Grads that are Partial (not yet reduced) or placed differently from their parameter are
    brought to the parameter's placements; the result is still exact."""
    mesh = _mesh()

    def grad_placements(k, d):
        if all(p.is_replicate() for p in d.placements):
            return [Partial(), Replicate()]
        return [Replicate(), Replicate()] if k % 2 else [Shard(0), Replicate()]

    for cls, kw in [(torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                    (torch.optim.AdamW, dict(lr=0.01))]:
        for opts in (dict(foreach=False), dict(foreach=True), dict(fused=True)):
            torch.manual_seed(0)
            plain, dist_ = _params(mesh)
            ref, opt = cls(plain, **kw, **opts), cls(dist_, **kw, **opts)
            for _ in range(2):
                _set_grads(plain, dist_, mesh, grad_placements)
                ref.step()
                opt.step()
            for p, d in zip(plain, dist_):
                torch.testing.assert_close(d.full_tensor(), p.detach())


@distributed(world_size=4)
def test_foreach_step_reduces_partial_grads_in_one_all_reduce_per_mesh_dim():
    """Partial gradients of one foreach step that each need one sum all-reduce over the same
    mesh dim travel as one flat all-reduce (a per-step collective, not one per parameter);
    the values are those of separate reductions."""
    mesh = _mesh()
    torch.manual_seed(0)
    shapes = [(5, 3), (7,), (2, 3), (4,)]
    full = [torch.randn(s) for s in shapes]
    plain = [nn.Parameter(t.clone()) for t in full]
    dist_ = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Replicate(), Replicate()]))
             for t in full]
    grad_pl = [[Partial(), Replicate()]] * 3 + [[Replicate(), Partial()]]  # dim 0 x3, dim 1 x1
    for p, d, pl in zip(plain, dist_, grad_pl):
        g = torch.randn(p.shape)
        p.grad = g.clone()
        d.grad = distribute_tensor(g, mesh, [Replicate(), Replicate()]).redistribute(mesh, pl)
    ref = torch.optim.SGD(plain, lr=0.1, foreach=True)
    opt = torch.optim.SGD(dist_, lr=0.1, foreach=True)
    ref.step()
    with CommDebugMode() as comm:
        opt.step()
    assert comm.get_comm_counts() == {"all_reduce": 2}, comm.get_comm_counts()
    for p, d in zip(plain, dist_):
        assert d.placements == (Replicate(), Replicate())
        torch.testing.assert_close(d.full_tensor(), p.detach())


@distributed(world_size=4)
def test_foreach_steps_reuse_the_flat_all_reduce_grouping():
    """The grouping into flat all-reduces is worked out once from the specs and reused by every
    later step: each step issues one all-reduce per (mesh dim, dtype) -- float32 and float64
    Partial gradients on one dim travel apart -- and its values equal plain SGD's, step after
    step, with new gradients each time."""
    mesh = _mesh()
    torch.manual_seed(0)
    shapes = [(5, 3), (7,), (2, 3), (4,), (3, 3)]
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float64, torch.float32]
    full = [torch.randn(s, dtype=dt) for s, dt in zip(shapes, dtypes)]
    plain = [nn.Parameter(t.clone()) for t in full]
    dist_ = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Replicate(), Replicate()]))
             for t in full]
    ref = torch.optim.SGD(plain, lr=0.1, foreach=True)
    opt = torch.optim.SGD(dist_, lr=0.1, foreach=True)
    # counted where every all-reduce reaches the backend, whatever Python issued it
    with process_group_calls("allreduce") as calls:
        for step in range(3):
            for p, d in zip(plain, dist_):
                g = torch.randn(p.shape, dtype=p.dtype)
                p.grad = g.clone()
                d.grad = distribute_tensor(g, mesh, [Replicate(), Replicate()]).redistribute(
                    mesh, [Partial(), Replicate()])
            calls.clear()
            ref.step()
            opt.step()
            issued = [t.dtype for _, (tensors, *_) in calls for t in tensors]
            assert sorted(map(str, issued)) == ["torch.float32", "torch.float64"], (step, issued)
            for p, d in zip(plain, dist_):
                assert d.placements == (Replicate(), Replicate())
                torch.testing.assert_close(d.full_tensor(), p.detach(), atol=0, rtol=0)


def _lists(mesh, placements, shapes, seed):
    torch.manual_seed(seed)
    full = [torch.randn(s) for s in shapes]
    return full, [distribute_tensor(t, mesh, pl) for t, pl in zip(full, placements)]


def _close_lists(dts, plain):
    assert len(dts) == len(plain)
    for d, p in zip(dts, plain):
        torch.testing.assert_close(d.full_tensor(), p)


@distributed(world_size=4)
def test_foreach_ops_match_plain_foreach_ops():
    mesh = _mesh()
    shapes = [s for s, _ in PARAMS]
    pls = [pl for _, pl in PARAMS]
    a, da = _lists(mesh, pls, shapes, 1)
    b, db = _lists(mesh, pls, shapes, 2)
    c, dc = _lists(mesh, pls, shapes, 3)
    b = [x.abs() + 0.5 for x in b]
    db = [x.abs() + 0.5 for x in db]
    scale = torch.tensor(1.7)
    dscale = distribute_tensor(scale, mesh, [Replicate(), Replicate()])
    scalars = [0.5 * (k + 1) for k in range(len(shapes))]
    functional = [
        ("add.List", lambda x, y, z, s: torch._foreach_add(x, y, alpha=0.3)),
        ("sub.Scalar", lambda x, y, z, s: torch._foreach_sub(x, 2.0)),
        ("mul.ScalarList", lambda x, y, z, s: torch._foreach_mul(x, scalars)),
        ("div.Tensor (0-d DTensor)", lambda x, y, z, s: torch._foreach_div(x, s)),
        ("mul.Tensor (0-d plain)", lambda x, y, z, s: torch._foreach_mul(x, scale)),
        ("sqrt", lambda x, y, z, s: torch._foreach_sqrt(y)),
        ("exp", lambda x, y, z, s: torch._foreach_exp(x)),
        ("maximum.List", lambda x, y, z, s: torch._foreach_maximum(x, z)),
        ("maximum.Scalar", lambda x, y, z, s: torch._foreach_maximum(x, 0.1)),
        ("pow.Scalar", lambda x, y, z, s: torch._foreach_pow(y, 1.5)),
        ("pow.ScalarAndTensor", lambda x, y, z, s: torch._foreach_pow(2.0, x)),
        ("addcdiv.ScalarList", lambda x, y, z, s: torch._foreach_addcdiv(x, z, y, scalars)),
        ("lerp.List", lambda x, y, z, s: torch._foreach_lerp(x, z, [t * 0 + 0.25 for t in y])),
        ("clamp_min.Scalar", lambda x, y, z, s: torch._foreach_clamp_min(x, -0.2)),
    ]
    with CommDebugMode() as comm:
        results = [(name, fn(da, db, dc, dscale)) for name, fn in functional]
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    for (name, got), (_, fn) in zip(results, functional):
        assert all(g.placements == d.placements for g, d in zip(got, da)), name
        _close_lists(got, fn(a, b, c, scale))
    inplace = [
        ("add_.List", lambda x, y, z: torch._foreach_add_(x, y, alpha=-0.5)),
        ("mul_.Scalar", lambda x, y, z: torch._foreach_mul_(x, 0.9)),
        ("addcmul_.Scalar", lambda x, y, z: torch._foreach_addcmul_(x, y, z, 0.01)),
        ("lerp_.Scalar", lambda x, y, z: torch._foreach_lerp_(x, z, 0.1)),
        ("maximum_.List", lambda x, y, z: torch._foreach_maximum_(x, z)),
        ("neg_", lambda x, y, z: torch._foreach_neg_(x)),
        ("clamp_max_.Scalar", lambda x, y, z: torch._foreach_clamp_max_(x, 0.3)),
        ("copy_", lambda x, y, z: torch._foreach_copy_(x, z)),
        ("zero_", lambda x, y, z: torch._foreach_zero_(x)),
    ]
    for name, fn in inplace:
        with CommDebugMode() as comm:
            fn(da, db, dc)
        assert comm.get_total_counts() == 0, (name, comm.get_comm_counts())
        fn(a, b, c)
        _close_lists(da, a)
        assert [d.placements for d in da] == [tuple(pl) for pl in pls] or name == "zero_", name


@distributed(world_size=4)
def test_foreach_ops_reshard_mismatched_and_keep_partials():
    mesh = _mesh()
    shapes = [(5, 3), (4, 6)]
    a, da = _lists(mesh, [[Shard(0), Shard(1)], [Replicate(), Shard(0)]], shapes, 1)
    b, db = _lists(mesh, [[Replicate(), Replicate()], [Shard(1), Replicate()]], shapes, 2)
    # other operands are brought to the in-place destination's placements
    torch._foreach_add_(da, db, alpha=2.0)
    torch._foreach_add_(a, b, alpha=2.0)
    _close_lists(da, a)
    assert [d.placements for d in da] == [(Shard(0), Shard(1)), (Replicate(), Shard(0))]
    # Partial lists stay Partial through linear ops, with no communication
    pa = [d.redistribute(mesh, [Partial(), Replicate()]) for d in
          (distribute_tensor(t, mesh, [Replicate(), Replicate()]) for t in a)]
    pb = [d.redistribute(mesh, [Partial(), Replicate()]) for d in
          (distribute_tensor(t, mesh, [Replicate(), Replicate()]) for t in b)]
    with CommDebugMode() as comm:
        s = torch._foreach_add(pa, pb)
        torch._foreach_mul_(s, 3.0)
    assert comm.get_total_counts() == 0
    assert all(x.placements == (Partial(), Replicate()) for x in s)
    _close_lists(s, [(x + y) * 3.0 for x, y in zip(a, b)])
    # a non-linear in-place op on a Partial destination cannot keep it: each one is reduced
    # first, then written (tests/test_ops_inplace_partial.py)
    pc = [distribute_tensor(t.abs(), mesh, [Replicate(), Replicate()]).redistribute(
        mesh, [Partial(), Replicate()]) for t in a]
    torch._foreach_sqrt_(pc)
    assert all(not x.placements[0].is_partial() for x in pc), [x.placements for x in pc]
    _close_lists(pc, [t.abs().sqrt() for t in a])
    # a shared scalar wanted Replicate by one element and Partial by another: per-element path
    coef = distribute_tensor(torch.tensor(2.5), mesh, [Replicate(), Replicate()]).redistribute(
        mesh, [Partial(), Replicate()])
    mixed = [pa[0], distribute_tensor(b[1], mesh, [Replicate(), Shard(0)])]
    out = torch._foreach_mul(mixed, coef)
    _close_lists(out, [a[0] * 2.5, b[1] * 2.5])


@distributed(world_size=4)
def test_foreach_ops_on_0d_dtensors_and_tensor_scalars():
    """0-d DTensors (e.g. step counters kept as DTensors) and 0-d plain tensor operands."""
    mesh = _mesh()
    steps = [distribute_tensor(torch.tensor(float(k)), mesh, [Replicate(), Replicate()])
             for k in range(3)]
    torch._foreach_add_(steps, 1)
    torch._foreach_add_(steps, torch.tensor(0.5))
    torch._foreach_mul_(steps, [1.0, 2.0, 3.0])
    assert [s.to_local().item() for s in steps] == [1.5, 5.0, 10.5]
    pw = torch._foreach_pow(0.9, steps)
    torch.testing.assert_close(torch.stack([p.to_local() for p in pw]),
                               0.9 ** torch.tensor([1.5, 5.0, 10.5]))


@distributed(world_size=4)
def test_foreach_norm_is_one_batched_all_reduce_per_mesh_dim():
    mesh = _mesh()
    shapes = [s for s, _ in PARAMS]
    full, dts = _lists(mesh, [pl for _, pl in PARAMS], shapes, 4)
    for ord_ in (2, 1, 3, 0, math.inf, -math.inf, 2.5):
        with CommDebugMode() as comm:
            norms = torch._foreach_norm(dts, ord_)
        assert comm.get_comm_counts() == {"all_reduce": 2}, (ord_, comm.get_comm_counts())
        for n, ref in zip(norms, torch._foreach_norm(full, ord_)):
            assert n.placements == (Replicate(), Replicate())
            torch.testing.assert_close(n.to_local(), ref)
    for m, ref in zip(torch._foreach_max(dts), torch._foreach_max(full)):
        torch.testing.assert_close(m.to_local(), ref)
    # a Partial input is reduced first (a norm is not linear); float64 stays float64
    p = distribute_tensor(full[0].double(), mesh, [Replicate(), Replicate()]).redistribute(
        mesh, [Partial(), Replicate()])
    torch.testing.assert_close(torch._foreach_norm([p], 2)[0].to_local(),
                               torch.linalg.vector_norm(full[0].double()))


def _decisions():
    from dtensor_lite import _dispatch
    return len(_dispatch._DECISIONS)


@distributed(world_size=4)
def test_changing_scalars_in_foreach_ops_reuse_one_decision():
    """AdamW passes new Python scalars every step (bias corrections, as floats and ScalarLists):
    foreach ops cache their decision by the scalars' type and sign, so a new value is a cache hit
    -- with the values of this call, and a new decision where a sign changes the placements."""
    mesh = _mesh()
    shapes = [s for s, _ in PARAMS]
    full, dts = _lists(mesh, [pl for _, pl in PARAMS], shapes, 5)
    _, others = _lists(mesh, [pl for _, pl in PARAMS], shapes, 6)
    others = [o.abs() + 0.5 for o in others]
    plain = [t.clone() for t in full]
    plain_others = [o.full_tensor() for o in others]
    for step in range(4):
        c = 1.0 + 0.1 * step
        cs = [c + 0.01 * k for k in range(len(dts))]
        torch._foreach_mul_(dts, c)
        torch._foreach_mul_(plain, c)
        torch._foreach_div_(dts, cs)
        torch._foreach_div_(plain, cs)
        torch._foreach_addcdiv_(dts, others, others, [-x for x in cs])
        torch._foreach_addcdiv_(plain, plain_others, plain_others, [-x for x in cs])
        torch._foreach_lerp_(dts, others, 0.1 / c)
        torch._foreach_lerp_(plain, plain_others, 0.1 / c)
        if step == 0:
            after_first = _decisions()
        _close_lists(dts, plain)
    assert _decisions() == after_first

    # a whole AdamW (foreach) run: after the first step, no step adds a decision
    torch.manual_seed(0)
    ref_params, params = _params(mesh)
    ref, opt = (torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, foreach=True)
                for p in (ref_params, params))
    for step in range(4):
        _set_grads(ref_params, params, mesh)
        ref.step()
        opt.step()
        if step == 1:  # step 0 takes other branches (fresh state)
            after = _decisions()
    assert _decisions() == after
    for p, d in zip(ref_params, params):
        torch.testing.assert_close(d.full_tensor(), p.detach())

    # the sign still matters: a factor's sign decides whether Partial(max) stays max or turns min,
    # and dividing by zero does not keep it
    rep = [distribute_tensor(t, mesh, [Replicate(), Replicate()]) for t in full[:2]]
    pmax = [r.redistribute(mesh, [Partial("max"), Replicate()]) for r in rep]
    for c, kept in ((2.0, Partial("max")), (3.0, Partial("max")), (-2.0, Partial("min")),
                    (-0.5, Partial("min")), (0.0, Partial("max"))):
        out = torch._foreach_mul(pmax, c)
        assert all(o.placements == (kept, Replicate()) for o in out), (c, out[0].placements)
        _close_lists(out, [t * c for t in full[:2]])
    for c in (2.0, 0.0, -0.0, float("nan"), 5.0, float("inf")):
        out = torch._foreach_div(pmax, c)
        assert all(o.placements[0].is_partial() == (c != 0) for o in out), (c, out[0].placements)
        for o, t in zip(out, full[:2]):
            torch.testing.assert_close(o.full_tensor(), t / c, equal_nan=True)


@distributed(world_size=4)
def test_foreach_ops_key_by_value_when_the_element_rule_may_read_values():
    """A user rule for the per-element op may look at any value: then the foreach op's
    decisions are cached by value again (and the user rule sees every value)."""
    from dtensor_lite import register_sharding
    from dtensor_lite._caches import clear_decisions
    from dtensor_lite.ops import _registry
    from dtensor_lite.ops.foreach import foreach_rule

    aten = torch.ops.aten
    foreach_op, elem_op = aten._foreach_mul.Scalar, aten.mul.Scalar
    old_rule = _registry.get_rule(elem_op)
    seen = []
    mesh = _mesh()
    full, dts = _lists(mesh, [[Shard(0), Replicate()]] * 2, [(4, 3), (6,)], 7)
    try:
        @register_sharding(elem_op)
        def rule(x, other):
            seen.append(other)  # a rule that looks at the magnitude: sharded above 2 only
            placement = Shard(0) if other > 2 else Replicate()
            return [([placement], [placement, None])]
        assert id(elem_op) not in _registry.SIGN_KEYED
        for c in (1.0, 3.0, 1.5, 3.0):
            out = torch._foreach_mul(dts, c)
            want = (Shard(0), Shard(0)) if c > 2 else (Replicate(), Replicate())
            assert all(o.placements == want for o in out), (c, out[0].placements)
            _close_lists(out, [t * c for t in full])
        assert sorted(set(seen)) == [1.0, 1.5, 3.0]
        assert id(foreach_op) not in _registry.SIGN_KEYED
    finally:
        _registry.set_rule(elem_op, old_rule, override=True)
        _registry.set_rule(foreach_op, foreach_rule, scalars_by_sign=True, override=True)
        clear_decisions()


def _grad_setup(mesh, grad_partial):
    torch.manual_seed(0)
    plain, dist_ = _params(mesh)

    def grad_placements(k, d):
        if grad_partial and all(p.is_replicate() for p in d.placements):
            return [Partial(), Replicate()]
        return d.placements
    _set_grads(plain, dist_, mesh, grad_placements)
    return plain, dist_


@distributed(world_size=4)
def test_clip_grad_norm_matches_plain_tensors():
    mesh = _mesh()
    for foreach in (False, True):
        for norm_type in (2.0, math.inf, 1.0):
            for grad_partial in (False, True):
                plain, dist_ = _grad_setup(mesh, grad_partial)
                ref = nn.utils.clip_grad_norm_(plain, 0.5, norm_type=norm_type, foreach=foreach)
                with CommDebugMode() as comm:
                    total = nn.utils.clip_grad_norm_(dist_, 0.5, norm_type=norm_type,
                                                     foreach=foreach, error_if_nonfinite=True)
                if foreach and not grad_partial:  # per-tensor norms: one all-reduce per mesh dim
                    assert comm.get_comm_counts() == {"all_reduce": 2}, comm.get_comm_counts()
                torch.testing.assert_close(total.full_tensor(), ref)
                for p, d in zip(plain, dist_):
                    torch.testing.assert_close(d.grad.full_tensor(), p.grad)


@distributed(world_size=4)
def test_clip_grad_value_matches_plain_tensors():
    mesh = _mesh()
    for foreach in (False, True):
        plain, dist_ = _grad_setup(mesh, False)
        nn.utils.clip_grad_value_(plain, 0.3, foreach=foreach)
        with CommDebugMode() as comm:
            nn.utils.clip_grad_value_(dist_, 0.3, foreach=foreach)
        assert comm.get_total_counts() == 0
        for p, d in zip(plain, dist_):
            torch.testing.assert_close(d.grad.full_tensor(), p.grad)


@distributed(world_size=4)
def test_fused_optimizer_errors_name_the_problem():
    mesh = _mesh()
    p = nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate(), Replicate()])
                     .redistribute(mesh, [Partial(), Replicate()]))
    p.grad = distribute_tensor(torch.randn(4, 4), mesh, [Replicate(), Replicate()])
    with pytest.raises(RuntimeError, match="Partial"):
        torch.optim.Adam([p], fused=True).step()


@distributed(world_size=4)
def test_fused_step_with_state_at_other_placements():
    """State written in place at other placements than its parameter (fused SGD makes its
    momentum buffers with empty_like(grad)) is updated through a temporary and keeps its
    placements."""
    mesh = _mesh()
    torch.manual_seed(0)
    w, g = torch.randn(5, 4), torch.randn(5, 4)
    ref = nn.Parameter(w.clone())
    q = nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0), Shard(1)]))
    # a tensor learning rate takes the fused kernels' tensor_lr overload
    opt_ref = torch.optim.Adam([ref], lr=torch.tensor(0.01), fused=True)
    opt = torch.optim.Adam([q], lr=torch.tensor(0.01), fused=True)
    for step in range(3):
        ref.grad = g * (step + 1)
        q.grad = distribute_tensor(g * (step + 1), mesh, [Shard(1), Replicate()])
        opt_ref.step()
        opt.step()
        if step == 0:
            opt.state[q]["exp_avg"] = opt.state[q]["exp_avg"].redistribute(
                mesh, [Replicate(), Replicate()])
    torch.testing.assert_close(q.full_tensor(), ref.detach())
    assert opt.state[q]["exp_avg"].placements == (Replicate(), Replicate())
    torch.testing.assert_close(opt.state[q]["exp_avg"].full_tensor(), opt_ref.state[ref]["exp_avg"])
