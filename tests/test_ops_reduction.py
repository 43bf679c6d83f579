"""Reductions against plain torch, forward and backward, over many placements on a 1-D (4) and a
2-D (2x2) mesh with uneven shapes (empty shards included) and Partial inputs; CommDebugMode
checks that the cheap paths stay cheap."""
import contextlib
import math

import pytest
import torch

from dtensor_lite import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.debug import CommDebugMode
from tests._op_helpers import as_tuple as _as_tuple, leaf_and_input as _leaf_and_input, like as _like
from tests.harness import distributed

R, P = Replicate(), Partial()


def _meshes():
    return (init_device_mesh("cpu", (4,)),
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))


def _placements(mesh, ndim, partial=True):
    """Shard on every dim, Replicate, Partial inputs, and mixed 2-D placements."""
    if mesh.ndim == 1:
        out = [[Shard(d)] for d in range(ndim)] + [[R]]
        return out + ([[P]] if partial else [])
    out = [[Shard(0), Shard(ndim - 1)], [Shard(ndim - 1), Shard(0)], [Shard(0), Shard(0)],
           [R, Shard(ndim - 1)]]
    if ndim > 2:
        out.append([Shard(1), Shard(2)])
    return out + ([[P, Shard(0)], [Shard(ndim - 1), P]] if partial else [])




@contextlib.contextmanager
def _pieces_path():
    """Reductions over a sharded dim choose between gathering the input and combining reduced
    pieces by the planner's cost, which gathers the small tensors these checks use; with no
    latency term the piece-wise compositions (the code worth checking value by value) run."""
    from dtensor_lite import _caches
    from dtensor_lite.ops import reduction
    saved = reduction.COLLECTIVE_LATENCY_BYTES
    reduction.COLLECTIVE_LATENCY_BYTES = 0
    _caches.clear_decisions()
    try:
        yield
    finally:
        reduction.COLLECTIVE_LATENCY_BYTES = saved
        _caches.clear_decisions()


def check(fn, x, meshes, grad=True, placements=None, **tol):
    """``fn`` on DTensors equals ``fn`` on the full tensor, for every placement; so do the
    input gradients of a random weighting of the (floating) outputs."""
    xr = x.clone().requires_grad_(grad)
    refs = _as_tuple(fn(xr))
    weights = [torch.randn(r.shape) if r.is_floating_point() else None for r in refs]
    if grad:
        sum((r * w).sum() for r, w in zip(refs, weights) if w is not None).backward()
    for mesh in meshes:
        for pl in (placements or _placements(mesh, x.ndim)):
            leaf, dx = _leaf_and_input(x, mesh, pl)
            outs = _as_tuple(fn(dx))
            for o, r in zip(outs, refs):
                torch.testing.assert_close(o.full_tensor(), r.detach(), **tol,
                                           msg=lambda m: f"{pl} on {mesh}: {m}")
            if grad:
                loss = sum((o * _like(w, o)).sum() for o, w in zip(outs, weights) if w is not None)
                loss.backward()
                torch.testing.assert_close(leaf.grad.full_tensor(), xr.grad, **tol,
                                           msg=lambda m: f"grad, {pl} on {mesh}: {m}")


@distributed(world_size=4)
def test_sum_mean_and_friends():
    # one check per bundle of ops: the distribute / backward round trips dominate the runtime
    meshes = _meshes()
    for shape in [(5, 3), (2, 5, 3)]:
        check(lambda t: (t.sum(), t.sum(1), t.sum((0, -1), keepdim=True), t.mean(0), t.mean(),
                         t.mean(-1, keepdim=True)), torch.randn(shape), meshes)
    x = torch.randn(5, 3)
    x[1, 2] = float("nan")
    check(lambda t: (t.sum(0, dtype=torch.float64), t.mean(0, dtype=torch.float64),
                     torch.nansum(t, 0), torch.nansum(t)), x, meshes, equal_nan=True)
    check(lambda t: (torch.count_nonzero(t > 0, 0), torch.count_nonzero(t > 0),
                     torch.sum(t > 0, 1)), x, meshes, grad=False)  # bool sums to int64


@distributed(world_size=4)
def test_reducing_a_sharded_dim_is_partial_and_free():
    mesh1, mesh2 = _meshes()
    x = torch.randn(5, 6)  # 5 rows on 4 ranks: the last one is empty
    dx = distribute_tensor(x, mesh1, [Shard(0)])
    with CommDebugMode() as comm:
        s, m, mx, mn = dx.sum(0), dx.mean(0), dx.amax(0), dx.amin(0, keepdim=True)
        full_max, any_pos, all_pos = dx.max(), (dx > 0).any(0), (dx > -9).all()
    assert comm.get_total_counts() == 0
    assert s.placements == (Partial("sum"),) and m.placements == (Partial("sum"),)
    assert mx.placements == (Partial("max"),) and mn.placements == (Partial("min"),)
    assert full_max.placements == (Partial("max"),)
    assert any_pos.placements == (Partial("max"),) and all_pos.placements == (Partial("min"),)
    # the empty shard contributed identities, not zeros or NaN
    torch.testing.assert_close(m.full_tensor(), x.mean(0))
    torch.testing.assert_close(mx.full_tensor(), x.amax(0))
    torch.testing.assert_close(mn.full_tensor(), x.amin(0, keepdim=True))
    torch.testing.assert_close(full_max.full_tensor(), x.max())
    assert torch.equal(any_pos.full_tensor(), (x > 0).any(0))
    assert bool(all_pos.full_tensor()) is True
    # a non-reduced shard stays, and a Partial(max) input passes through amax
    d2 = distribute_tensor(x, mesh2, [Shard(0), Shard(1)])
    rep = distribute_tensor(x, mesh2, [R, R])
    with CommDebugMode() as comm:
        s2 = d2.sum(1)
        pmax = rep.redistribute(mesh2, [Partial("max"), Shard(0)])
        a2 = pmax.amax(1)
    assert comm.get_total_counts() == 0
    assert s2.placements == (Shard(0), Partial("sum"))
    assert a2.placements == (Partial("max"), Shard(0))
    torch.testing.assert_close(s2.full_tensor(), x.sum(1))
    torch.testing.assert_close(a2.full_tensor(), x.amax(1))
    # an all-empty piece on every rank but one: amax over the whole tensor
    tiny = torch.randn(1, 3) - 10
    dt = distribute_tensor(tiny, mesh1, [Shard(0)])
    torch.testing.assert_close(dt.amax().full_tensor(), tiny.amax())
    ints = torch.randint(-5, 5, (5, 3))
    di = distribute_tensor(ints, mesh1, [Shard(0)])
    assert torch.equal(di.amin(0).full_tensor(), ints.amin(0))
    assert torch.equal(di.max().full_tensor(), ints.max())


@distributed(world_size=4)
def test_max_min_family():
    meshes = _meshes()
    x = torch.randn(5, 3)
    check(lambda t: (t.amax(0), t.amin((0, 1), keepdim=True), t.max(), t.min(),
                     *torch.aminmax(t, dim=0), *torch.aminmax(t)), x, meshes)
    ties = torch.tensor([[1.0, 2.0, 2.0], [2.0, 0.0, 2.0], [0.0, 1.0, -1.0], [2.0, 2.0, 1.0],
                         [-3.0, 2.0, 0.0]])
    check(lambda t: (t.amax(1), t.max(), t.amin(0)), ties, meshes)  # ties share the gradient
    pm = Partial("max")
    for placements in ([pm], [pm, Shard(1)]):
        mesh = meshes[len(placements) - 1]
        d = distribute_tensor(x, mesh, [R] * mesh.ndim).redistribute(mesh, placements)
        torch.testing.assert_close(d.amax(0).full_tensor(), x.amax(0))
        torch.testing.assert_close(d.amin(0).full_tensor(), x.amin(0))  # P(max) reduced first


@distributed(world_size=4)
def test_max_dim_and_argmax_give_global_indices():
    meshes = _meshes()
    x = torch.randn(5, 7)
    with _pieces_path():
        _max_dim_checks(x, meshes)
    # the sharded reduction gathers one (value, index) pair per rank, never the large input
    mesh1 = meshes[0]
    big = torch.randn(4096, 8)
    d = distribute_tensor(big, mesh1, [Shard(0)])
    with CommDebugMode() as comm:
        v, i = d.max(0)
    assert set(comm.get_comm_counts()) == {"all_gather"}
    assert comm.get_total_bytes() <= 2 * 3 * 8 * 8
    assert v.placements == (R,) and i.placements == (R,)
    torch.testing.assert_close(i.full_tensor(), big.max(0).indices)
    # a small one is gathered once: one collective costs less than two (the planner's cost)
    small = distribute_tensor(big[:64], mesh1, [Shard(0)])
    with CommDebugMode() as comm:
        v, i = small.max(0)
    assert comm.get_comm_counts() == {"all_gather": 1}
    torch.testing.assert_close(i.full_tensor(), big[:64].max(0).indices)
    # a reduction over an unsharded dim keeps the shards and needs nothing
    with CommDebugMode() as comm:
        v, i = d.max(1)
    assert comm.get_total_counts() == 0 and i.placements == (Shard(0),)


def _max_dim_checks(x, meshes):
    check(lambda t: (*t.max(0), *t.min(1, keepdim=True), *t.max(-1)), x, meshes)
    check(lambda t: (t.argmax(0), t.argmin(1, keepdim=True), t.argmax(), t.argmin(keepdim=True)),
          x, meshes, grad=False)
    x3 = torch.randn(2, 5, 3)
    check(lambda t: (*t.max(1), t.argmax(), t.argmin(2)), x3, meshes)
    # ties go to the first occurrence, NaN wins wherever it is, ints and -inf-only rows work
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 1.0, 3.0]] * 2).t().contiguous()
    nan = torch.randn(7, 2)
    nan[4, 0] = nan[6, 0] = nan[2, 1] = float("nan")
    for t in (ties, nan, torch.full((5, 2), float("-inf")), torch.randint(0, 3, (5, 2))):
        check(lambda t: (*t.max(0), *t.min(0), t.argmax(), t.argmin(1)), t, meshes, grad=False,
              equal_nan=True)


@distributed(world_size=4)
def test_prod():
    meshes = _meshes()
    x = torch.rand(5, 3) + 0.5
    with _pieces_path():
        check(lambda t: (t.prod(0), t.prod(1, keepdim=True), t.prod(),
                         t.prod(0, dtype=torch.float64)), x, meshes, grad=False)
        check(lambda t: (t.prod(0), t.prod()), torch.randint(-3, 4, (5, 3)), meshes, grad=False)
    d = distribute_tensor(torch.rand(64, 4), meshes[0], [Shard(0)])
    with CommDebugMode() as comm:
        d.prod(0)
    assert set(comm.get_comm_counts()) == {"all_gather"}


@distributed(world_size=4)
def test_norms():
    meshes = _meshes()
    x = torch.randn(5, 3)
    vn = torch.linalg.vector_norm
    with _pieces_path():
        check(lambda t: tuple(vn(t, o) for o in (2, 1, 3, 0.5, math.inf, -math.inf)), x, meshes)
        check(lambda t: tuple(vn(t, o, dim=0, keepdim=True) for o in (2, 1, 3, math.inf)) + (
            vn(t, 2, dim=1), vn(t, dtype=torch.float64)), x, meshes)
        x[0, 1] = 0.0
        check(lambda t: (vn(t, 0), vn(t, 0, dim=1)), x, meshes, grad=False)
        check(lambda t: (t.norm(), t.norm(p=3, dim=1), torch.ops.aten.norm.Scalar(t, 2),
                         torch.ops.aten.norm.ScalarOpt_dim(t, math.inf, [0], True)), x, meshes)
    # p = 2 over a sharded dim: one all-reduce of the (small) sum of squares
    d = distribute_tensor(torch.randn(64, 8), meshes[0], [Shard(0)])
    with CommDebugMode() as comm:
        n = vn(d)
    assert comm.get_comm_counts() == {"all_reduce": 1} and n.placements == (R,)
    with CommDebugMode() as comm:
        n = vn(d, math.inf)
    assert comm.get_total_counts() == 0 and n.placements == (Partial("max"),)


@distributed(world_size=4)
@pytest.mark.parametrize("foreach", [False, None])
def test_clip_grad_norm(foreach):
    mesh1, mesh2 = _meshes()
    shapes = [(5, 3), (3, 6), (7,)]
    values = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) * 3 for s in shapes]
    for norm_type in (2.0, math.inf, 3.0):
        ref = [torch.nn.Parameter(v.clone()) for v in values]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        want = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type=norm_type, foreach=foreach)
        for mesh, pls in ((mesh1, [[Shard(0)], [Shard(1)], [Shard(0)]]),
                          (mesh2, [[Shard(0), Shard(1)], [R, Shard(0)], [Shard(0), Shard(0)]])):
            params = []
            for v, g, pl in zip(values, grads, pls):
                p = torch.nn.Parameter(distribute_tensor(v, mesh, pl))
                p.grad = distribute_tensor(g, mesh, pl)
                params.append(p)
            total = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type=norm_type,
                                                   foreach=foreach)
            torch.testing.assert_close(total.full_tensor(), want)
            for p, r in zip(params, ref):
                torch.testing.assert_close(p.grad.full_tensor(), r.grad)
                assert p.grad.placements == p.placements


@distributed(world_size=4)
def test_var_std_exact():
    meshes = _meshes()
    # float64 with a large mean: a naive E[x^2] - E[x]^2 would lose ~12 of its 16 digits
    x = torch.randn(5, 3, dtype=torch.float64) + 1e6
    with _pieces_path():
        _var_checks(x, meshes)
    # the mean is all-reduced once; the variance itself stays Partial(sum) (a large input)
    d = distribute_tensor(torch.randn(4096, 8), meshes[0], [Shard(0)])
    with CommDebugMode() as comm:
        v = torch.var(d, 0)
    assert comm.get_comm_counts() == {"all_reduce": 1} and v.placements == (Partial("sum"),)
    # a small one is gathered once (two round trips cost more under the planner's cost)
    small = distribute_tensor(torch.randn(64, 8), meshes[0], [Shard(0)])
    with CommDebugMode() as comm:
        v = torch.var(small, 0)
    assert comm.get_comm_counts() == {"all_gather": 1} and v.placements == (R,)


def _var_checks(x, meshes):
    check(lambda t: tuple(torch.var(t, dim, correction=c) for dim in (0, 1, None) for c in (0, 1))
          + (torch.std(t, 0, correction=0, keepdim=True), torch.std(t),
             *torch.var_mean(t, 0), *torch.var_mean(t, 1, correction=0),
             *torch.std_mean(t, (0, 1), keepdim=True)), x, meshes)
    check(lambda t: (torch.var(t, 0, correction=2.5), torch.var(t.reshape(2, 5, 3)[:, :4], (1, 2))),
          torch.randn(10, 3), meshes)
    # one row: correction 1 divides by zero (NaN), 2 rows and correction 2: x / 0 (inf)
    check(lambda t: torch.var(t, 0), torch.randn(1, 3), meshes, grad=False, equal_nan=True)
    check(lambda t: torch.var(t, 0, correction=2), torch.randn(2, 3), meshes, grad=False)


@distributed(world_size=4)
def test_all_any_logsumexp_and_scans():
    meshes = _meshes()
    x = torch.randn(5, 3)
    check(lambda t: ((t > -1).all(), (t > 0).any(0), (t > -1).all(1, keepdim=True),
                     torch.any(t > 1, dim=(0, 1))), x, meshes, grad=False)
    big = torch.randn(5, 3) * 50 + 1000  # exp would overflow without the shift by the max
    inf = x.clone()
    inf[:, 1] = float("-inf")
    inf[2, 2] = float("inf")
    with _pieces_path():
        check(lambda t: (t.logsumexp(0), t.logsumexp((0, 1), keepdim=True), t.logsumexp(1)),
              big, meshes)
        check(lambda t: (t.logsumexp(0), (t > 0).long().logsumexp(0)), inf, meshes, grad=False)
    check(lambda t: (t.cumsum(0), t.cumsum(1), t.cumsum(0, dtype=torch.float64)), x, meshes)
    check(lambda t: (t.cumprod(0), t.cumprod(1), t.logcumsumexp(0), *torch.cummax(t, 0),
                     *torch.cummin(t, 1)), x, meshes, grad=False)
    # a scan along an unsharded dim keeps every shard and needs nothing; cumsum keeps Partial
    mesh2 = meshes[1]
    d = distribute_tensor(x, mesh2, [R, Shard(0)]).redistribute(mesh2, [P, Shard(0)])
    with CommDebugMode() as comm:
        c = d.cumsum(1)
    assert comm.get_total_counts() == 0 and c.placements == (P, Shard(0))
    torch.testing.assert_close(c.full_tensor(), x.cumsum(1))


@distributed(world_size=4)
def test_shard_order_survives_reductions():
    # FSDP over TP: mesh dim 1 shards dim 0 first, mesh dim 0 then shards within each piece
    from dtensor_lite import _StridedShard
    mesh = _meshes()[1]
    x = torch.randn(7, 4)
    d = distribute_tensor(x, mesh, [_StridedShard(0, split_factor=2), Shard(0)])
    with CommDebugMode() as comm:
        s, a = d.sum(1), d.amax(1, keepdim=True)
    assert comm.get_total_counts() == 0
    assert s._spec.shard_order == d._spec.shard_order[:1]
    assert a._spec.shard_order == d._spec.shard_order
    torch.testing.assert_close(s.full_tensor(), x.sum(1))
    torch.testing.assert_close(a.full_tensor(), x.amax(1, keepdim=True))
    torch.testing.assert_close(d.max(0).indices.full_tensor(), x.max(0).indices)
    torch.testing.assert_close(torch.var(d, 0).full_tensor(), x.var(0))


@distributed(world_size=4)
def test_bad_arguments_fail_like_torch_and_empty_tensors_reduce():
    mesh = _meshes()[0]
    x = torch.randn(5, 3)
    d = distribute_tensor(x, mesh, [Shard(0)])
    for bad in (lambda t: t.sum(2), lambda t: t.max(2), lambda t: t.argmax(-3), lambda t: t.var(4),
                lambda t: torch.linalg.vector_norm(t, dim=5), lambda t: t.logsumexp(7),
                lambda t: t.prod(3)):
        with pytest.raises((IndexError, RuntimeError), match="out of range"):
            bad(x)
        with pytest.raises(RuntimeError, match=r"aten\.\w+\.\w+.*out of range"):
            bad(d)
    e = distribute_tensor(torch.randn(0, 3), mesh, [Shard(0)])
    torch.testing.assert_close(e.sum(0).full_tensor(), torch.zeros(3))
    torch.testing.assert_close(e.mean(1).full_tensor(), torch.zeros(0))
    s = distribute_tensor(torch.tensor(2.0), mesh, [R])
    torch.testing.assert_close(s.sum(0).full_tensor(), torch.tensor(2.0))
    assert s.max(0).indices.full_tensor().item() == 0


@distributed(world_size=4)
def test_three_dim_mesh():
    mesh3 = init_device_mesh("cpu", (2, 1, 2))
    pls = [[Shard(0), R, Shard(1)], [Shard(1), Shard(0), Shard(1)], [Shard(0), P, Shard(0)]]
    check(lambda t: (t.sum(0), t.mean(1), t.amax(0), *t.max(1), t.argmin(), torch.var(t, 0),
                     torch.linalg.vector_norm(t, 3, dim=1), t.logsumexp(0)),
          torch.randn(5, 7), [mesh3], placements=pls)
