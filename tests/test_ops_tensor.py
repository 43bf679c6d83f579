"""Tensor and indexing ops against plain torch (forward and backward) over many placements on
1-D (4) and 2-D (2x2) meshes with uneven shapes: cat/stack, index_select, gather/scatter,
index/index_put, copies and fills, *_like / new_*, sort/topk, tril/triu, repeat/flip/roll,
data-dependent ops, and the Python-bool comparisons; CommDebugMode pins the local paths."""
import pytest
import torch

from dtensor_lite import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.debug import CommDebugMode
from tests.harness import distributed

R = Replicate()
close = torch.testing.assert_close
PLACEMENTS_2D = [[Shard(0), R], [R, Shard(1)], [Shard(0), Shard(1)], [Shard(0), Shard(0)],
                 [Shard(1), Shard(0)], [R, R]]


def _mesh2d():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _fit(placements, ndim):
    """Placements usable for an ndim tensor (shards of missing dims become Replicate)."""
    return [p if not p.is_shard() or p.dim < ndim else R for p in placements]


def _check_grad(fn, inputs, placements, mesh):
    """fn on plain leaves vs on DTensor leaves: outputs and input grads agree."""
    plain = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    want = fn(*plain)
    (want.float() * torch.linspace(-1, 1, want.numel()).reshape(want.shape)).sum().backward()
    dts = [distribute_tensor(t, mesh, _fit(p, t.ndim)) for t, p in zip(inputs, placements)]
    dts = [d.requires_grad_() if d.is_floating_point() else d for d in dts]
    got = fn(*dts)
    weight = distribute_tensor(torch.linspace(-1, 1, want.numel()).reshape(want.shape), mesh,
                               [R] * mesh.ndim)
    close(got.full_tensor(), want.detach())
    (got.float() * weight).sum().backward()
    for p, d in zip(plain, dts):
        if p.requires_grad:
            close(d.grad.full_tensor(), p.grad)


# ------------------------------------------------------------------ cat / stack
@distributed(world_size=4)
def test_cat_and_stack():
    mesh = _mesh2d()
    a, b = torch.randn(5, 3), torch.randn(2, 3)
    for pa in PLACEMENTS_2D:
        for pb in PLACEMENTS_2D[::2]:
            da, db = distribute_tensor(a, mesh, pa), distribute_tensor(b, mesh, pb)
            close(torch.cat([da, db]).full_tensor(), torch.cat([a, b]))
            close(torch.cat([da.t(), db.t()], dim=-1).full_tensor(), torch.cat([a.t(), b.t()], 1))
            close(torch.stack([da, da * 2], dim=pb[0].dim if pb[0].is_shard() else 2).full_tensor(),
                  torch.stack([a, a * 2], dim=pb[0].dim if pb[0].is_shard() else 2))
    # sharded along a kept dim: local, no communication
    da = distribute_tensor(a, mesh, [Shard(1), R])
    db = distribute_tensor(b, mesh, [Shard(1), R])
    with CommDebugMode() as comm:
        c = torch.cat([da, db], 0)
        s = torch.stack([da, da], 0)
    assert comm.get_total_counts() == 0
    assert c.placements == (Shard(1), R) and s.placements == (Shard(2), R)
    # Partial with replicated inputs: Partial kept (R -> P is free) and right
    x = torch.randn(5, 3)
    px = distribute_tensor(x, mesh, [R, R]).redistribute(mesh, [Partial(), R])
    rb = distribute_tensor(b, mesh, [R, R])
    with CommDebugMode() as comm:
        c = torch.cat([px, rb])
    assert comm.get_total_counts() == 0 and c.placements[0] == Partial()
    close(c.full_tensor(), torch.cat([x, b]))
    # legacy empty 1-D inputs are skipped; backward splits the gradient
    empty = distribute_tensor(torch.zeros(0), mesh, [R, R])
    close(torch.cat([da, empty, db]).full_tensor(), torch.cat([a, b]))
    _check_grad(lambda a, b: torch.cat([a, b * 2], 0), [a, b],
                [[Shard(1), Shard(0)], [R, Shard(1)]], mesh)
    _check_grad(lambda a: torch.stack([a, a.exp()], 1), [a], [[Shard(0), Shard(1)]], mesh)


# ------------------------------------------------------------------ index_select / gather
@distributed(world_size=4)
def test_index_select_all_paths():
    mesh = _mesh2d()
    x = torch.randn(7, 5)
    idx = torch.tensor([6, 0, 3, 3, 1])
    for px in PLACEMENTS_2D:
        for pi in ([R, R], [Shard(0), R], [R, Shard(0)], [Shard(0), Shard(0)]):
            dx, di = distribute_tensor(x, mesh, px), distribute_tensor(idx, mesh, pi)
            for dim in (0, 1):
                close(dx.index_select(dim, di % x.shape[dim]).full_tensor(),
                      x.index_select(dim, idx % x.shape[dim]))
    # the masked lookup: rows sharded, ids replicated -> Partial(sum), nothing moves
    dx = distribute_tensor(x, mesh, [Shard(0), Shard(0)])
    di = distribute_tensor(idx, mesh, [R, R])
    with CommDebugMode() as comm:
        out = dx.index_select(0, di)
    assert comm.get_total_counts() == 0 and out.placements == (Partial(), Partial())
    close(out.full_tensor(), x.index_select(0, idx))
    # sharded ids shard the output; a non-indexed shard stays
    rx, si = distribute_tensor(x, mesh, [R, R]), distribute_tensor(idx, mesh, [Shard(0), R])
    with CommDebugMode() as comm:
        o1 = rx.index_select(0, si)
    assert comm.get_total_counts() == 0
    o2_in = distribute_tensor(x, mesh, [Shard(1), R])
    with CommDebugMode() as comm2:
        o2 = o2_in.index_select(0, di)
    assert o2.placements == (Shard(1), R) and comm2.get_total_counts() == 0
    assert o1.placements == (Shard(0), R)
    for px, pi in (([Shard(0), R], [R, R]), ([R, R], [Shard(0), R]),
                   ([Shard(1), Shard(0)], [R, Shard(0)])):
        _check_grad(lambda x, i: x.index_select(0, i), [x, idx], [px, pi], mesh)
    with pytest.raises(Exception, match="out of range"):
        dx.index_select(0, distribute_tensor(torch.tensor([7]), mesh, [R, R]))
    # a 0-d source (replicated or Partial) gives a 0-d result, with 0-d or 1-element ids
    s0 = distribute_tensor(torch.tensor(5.0), mesh, [R, R])
    for src in (s0, s0.redistribute(mesh, [Partial(), R])):
        for ids in (torch.tensor([0]), torch.tensor(0)):
            out = src.index_select(0, distribute_tensor(ids, mesh, [R, R]))
            close(out.full_tensor(), torch.tensor(5.0).index_select(0, ids))


@distributed(world_size=4)
def test_gather_and_scatter_family():
    mesh = _mesh2d()
    x = torch.randn(5, 6)
    idx = torch.randint(0, 6, (5, 4))
    src = torch.randn(5, 4)
    for px in PLACEMENTS_2D:
        for pi in ([R, R], [Shard(0), R], [R, Shard(1)], [Shard(1), Shard(0)]):
            dx, di, ds = (distribute_tensor(t, mesh, p) for t, p in ((x, px), (idx, pi), (src, pi)))
            close(dx.gather(1, di).full_tensor(), x.gather(1, idx))
            close(dx.scatter(1, di, ds).full_tensor(), x.scatter(1, idx, src))
            close(dx.scatter(1, di, 2.5).full_tensor(), x.scatter(1, idx, 2.5))
            close(dx.scatter_add(1, di, ds).full_tensor(), x.scatter_add(1, idx, src))
            close(dx.scatter_reduce(1, di, ds, "amax").full_tensor(),
                  x.scatter_reduce(1, idx, src, "amax"))
            close(dx.scatter_reduce(1, di, ds, "mean", include_self=False).full_tensor(),
                  x.scatter_reduce(1, idx, src, "mean", include_self=False))
        idx0 = torch.randint(0, 5, (3, 6))
        dx = distribute_tensor(x, mesh, px)
        close(dx.gather(0, distribute_tensor(idx0, mesh, [R, Shard(0)])).full_tensor(),
              x.gather(0, idx0))
    # no communication: gather against row pieces (masked), scatter into row pieces (padded)
    dx = distribute_tensor(x, mesh, [Shard(1), Shard(1)])
    di, ds = distribute_tensor(idx, mesh, [R, R]), distribute_tensor(src, mesh, [R, R])
    with CommDebugMode() as comm:
        g = dx.gather(1, di)
        s = dx.scatter_add(1, di, ds)
        t = dx.clone().scatter_(1, di, ds)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    assert g.placements == (Partial(), Partial()) and s.placements == (Shard(1), Shard(1))
    assert t.placements == (Shard(1), Shard(1))
    close(g.full_tensor(), x.gather(1, idx))
    close(s.full_tensor(), x.scatter_add(1, idx, src))
    close(t.full_tensor(), x.scatter(1, idx, src))
    # ids sharded along the scattered dim: each rank adds its share -> Partial(sum)
    rx, si, ss = (distribute_tensor(t, mesh, p) for t, p in
                  ((x, [R, R]), (idx, [Shard(1), R]), (src, [Shard(1), R])))
    with CommDebugMode() as comm:
        p = rx.scatter_add(1, si, ss)
    assert comm.get_total_counts() == 0 and p.placements[0] == Partial()
    close(p.full_tensor(), x.scatter_add(1, idx, src))
    # backward (gather -> scatter_add, scatter -> gather)
    for px, pi in (([Shard(0), R], [Shard(0), R]), ([Shard(1), R], [R, R]), ([R, R], [R, Shard(1)])):
        _check_grad(lambda x, i: x.gather(1, i), [x, idx], [px, pi], mesh)
        _check_grad(lambda x, i, s: x.scatter_add(1, i, s), [x, idx, src], [px, pi, pi], mesh)
        uniq = torch.stack([torch.randperm(6)[:4] for _ in range(5)])  # scatter grads need unique ids
        _check_grad(lambda x, i, s: x.scatter(1, i, s), [x, uniq, src], [px, pi, pi], mesh)


@distributed(world_size=4)
def test_scatter_reduce_every_mode_on_sharded_inputs():
    """Every reduce mode x include_self, on sharded layouts of self / index / src (1-D mesh of 4
    and 2x2), and on Partial self / src: the result equals plain torch's."""
    x = torch.randn(10, 5)
    idx = torch.tensor([[0, 1, 2, 3, 4], [9, 8, 7, 6, 5], [0, 0, 9, 9, 4], [3, 3, 3, 3, 3],
                        [5, 6, 5, 6, 5]])  # OpInfo's shapes, with collisions
    src = torch.randn(5, 5)
    layouts = [(init_device_mesh("cpu", (4,)), [Shard(0)]), (_mesh2d(), [Shard(0), Shard(1)]),
               (_mesh2d(), [Shard(0), Shard(0)]), (_mesh2d(), [R, Shard(0)])]
    for mesh, pl in layouts:
        for reduce in ("sum", "prod", "mean", "amax", "amin"):
            for include_self in (True, False):
                for dim in (0, 1):
                    i = idx if dim == 0 else idx % 5
                    want = x.scatter_reduce(dim, i, src, reduce, include_self=include_self)
                    for pi in (pl, [R] * mesh.ndim):  # index/src sharded like self, or whole
                        dx, di, ds = (distribute_tensor(t, mesh, p) for t, p in
                                      ((x, pl), (i, pi), (src, pi)))
                        got = dx.scatter_reduce(dim, di, ds, reduce, include_self=include_self)
                        close(got.full_tensor(), want)
        rx, rs = (distribute_tensor(t, mesh, [R] * mesh.ndim) for t in (x, src))
        di = distribute_tensor(idx, mesh, [R] * mesh.ndim)
        for reduce, partial in (("sum", Partial("sum")), ("amax", Partial("max")),
                                ("amin", Partial("min"))):
            px, ps = (t.redistribute(mesh, [partial] * mesh.ndim) for t in (rx, rs))
            for include_self in (True, False):
                close(px.scatter_reduce(0, di, ps, reduce, include_self=include_self).full_tensor(),
                      x.scatter_reduce(0, idx, src, reduce, include_self=include_self))


@distributed(world_size=4)
def test_index_add_copy_fill():
    mesh = _mesh2d()
    x, idx = torch.randn(7, 4), torch.tensor([5, 0, 6, 2])
    src = torch.randn(4, 4)
    for px in PLACEMENTS_2D:
        for pi in ([R, R], [Shard(0), R]):
            dx, di = distribute_tensor(x, mesh, px), distribute_tensor(idx, mesh, pi)
            ds = distribute_tensor(src, mesh, [pi[0], _fit([px[1]], 2)[0]])
            close(dx.index_add(0, di, ds, alpha=2).full_tensor(), x.index_add(0, idx, src, alpha=2))
            close(dx.index_copy(0, di, ds).full_tensor(), x.index_copy(0, idx, src))
            close(dx.index_fill(0, di, -1.0).full_tensor(), x.index_fill(0, idx, -1.0))
            close(dx.index_fill(1, di % 4 - 4, 3.0).full_tensor(), x.index_fill(1, idx % 4 - 4, 3.0))
            y = dx.clone()
            y.index_add_(0, di, ds)
            assert y.placements == dx.placements
            close(y.full_tensor(), x.index_add(0, idx, src))
    dx = distribute_tensor(x, mesh, [Shard(0), Shard(0)])
    di, ds = distribute_tensor(idx, mesh, [R, R]), distribute_tensor(src, mesh, [R, R])
    with CommDebugMode() as comm:
        a = dx.index_add(0, di, ds)
        f = dx.index_fill(0, di, 0.0)
    assert comm.get_total_counts() == 0 and a.placements == f.placements == (Shard(0), Shard(0))
    close(a.full_tensor(), x.index_add(0, idx, src))
    _check_grad(lambda x, s, i: x.index_add(0, i, s), [x, src, idx],
                [[Shard(0), R], [R, R], [R, R]], mesh)


# ------------------------------------------------------------------ x[idx], x[mask], x[idx] = v
@distributed(world_size=4)
def test_advanced_indexing_reads():
    mesh = _mesh2d()
    x = torch.randn(6, 5, 3)
    i0, i1 = torch.tensor([5, -1, 0, 2]), torch.tensor([[4], [0]])
    mask = x[:, :, 0] > 0
    for px in PLACEMENTS_2D + [[Shard(2), Shard(1)]]:
        dx = distribute_tensor(x, mesh, px)
        for pi in ([R, R], [Shard(0), R]):
            d0 = distribute_tensor(i0, mesh, pi)
            d1 = distribute_tensor(i1, mesh, pi)
            close(dx[d0].full_tensor(), x[i0])
            close(dx[:, d1].full_tensor(), x[:, i1])
            close(dx[d1, d0 % 5].full_tensor(), x[i1, i0 % 5])  # broadcast index block
            close(dx[d0, :, d0 % 3].full_tensor(), x[i0, :, i0 % 3])  # non-adjacent: block in front
        close(dx[distribute_tensor(mask, mesh, _fit(px, 2))].full_tensor(), x[mask])
        close(dx[:, distribute_tensor(mask[0], mesh, [R, R])].full_tensor(), x[:, mask[0]])
    dx = distribute_tensor(x, mesh, [Shard(0), Shard(2)])
    d0 = distribute_tensor(i0, mesh, [R, R])
    with CommDebugMode() as comm:
        out = dx[d0]
    assert comm.get_total_counts() == 0 and out.placements == (Partial(), Shard(2))
    for px, pi in (([Shard(0), R], [R, R]), ([Shard(1), Shard(0)], [R, Shard(0)]),
                   ([R, R], [Shard(0), R])):
        _check_grad(lambda x, i: x[i], [x, i0], [px, pi], mesh)
        _check_grad(lambda x, i: x[:, i], [x, i1], [px, pi], mesh)
    _check_grad(lambda x, m: x[m], [x, mask], [[Shard(0), Shard(1)], [Shard(0), R]], mesh)


@distributed(world_size=4)
def test_index_put_writes():
    mesh = _mesh2d()
    x = torch.randn(6, 4)
    i0 = torch.tensor([5, 0, -2, 0])
    v, v2 = torch.randn(4, 4), torch.randn(6, 2)
    mask = x > 0.5
    for px in PLACEMENTS_2D:
        for pi in ([R, R], [Shard(0), R]):
            di, dv = distribute_tensor(i0, mesh, pi), distribute_tensor(v, mesh, pi)
            for acc in (False, True):
                dx = distribute_tensor(x, mesh, px)
                close(dx.index_put((di,), dv, accumulate=acc).full_tensor(),
                      x.index_put((i0,), v, accumulate=acc))
            y, dy = x.clone(), distribute_tensor(x, mesh, px)
            y[i0[:2]] = 1.0
            dy[di[:2].redistribute(mesh, [R, R])] = 1.0
            y[mask] = 0.0
            dy[distribute_tensor(mask, mesh, px)] = 0.0
            y[:, i0[:2] % 4] = v2
            dy[:, (di[:2] % 4).redistribute(mesh, [R, R])] = distribute_tensor(v2, mesh, pi)
            assert dy.placements == tuple(px)
            close(dy.full_tensor(), y)
    # writes into row pieces: padded, no communication
    dx = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    di, dv = distribute_tensor(i0, mesh, [R, R]), distribute_tensor(v, mesh, [R, Shard(1)])
    with CommDebugMode() as comm:
        out = dx.index_put((di,), dv, accumulate=True)
        dx.index_put_((di,), dv)
    assert comm.get_total_counts() == 0 and out.placements == (Shard(0), Shard(1))
    close(out.full_tensor(), x.index_put((i0,), v, accumulate=True))
    close(dx.full_tensor(), x.index_put((i0,), v))
    # the internal spellings that decompositions and autograd use
    aten = torch.ops.aten
    dx = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    aten._index_put_impl_(dx, [di], dv, True)
    assert dx.placements == (Shard(0), Shard(1))
    close(dx.full_tensor(), x.index_put((i0,), v, accumulate=True))
    close(aten._unsafe_index(dx, [di]).full_tensor(), aten._unsafe_index(dx.full_tensor(), [i0]))
    close(aten._unsafe_index_put(dx, [di], dv).full_tensor(),
          aten._unsafe_index_put(dx.full_tensor(), [i0], v))
    _check_grad(lambda x, v, i: x.index_put((i,), v, accumulate=True), [x, v, i0],
                [[Shard(0), R], [Shard(0), R], [Shard(0), R]], mesh)


# ------------------------------------------------------------------ copies, fills, constructors
@distributed(world_size=4)
def test_new_factories_shaped_like_a_sharded_input_keep_its_layout():
    """x.new_empty_strided(x.shape, x.stride()) and friends (a strategy author's buffer "like the
    input"): the same global size keeps the input's Shard placements (uneven pieces, transposed
    strides too) and communicates nothing; Partial stays Partial only where the values allow it
    (empty, zeros); another size is replicated."""
    mesh = _mesh2d()
    x = torch.randn(7, 5)
    xt = x.t()  # a transposed global layout: strides (1, 5)
    for pl in ([Shard(0), Shard(1)], [Shard(1), R], [R, Shard(0)], [Partial(), Shard(0)]):
        for src in (x, xt):
            dx = distribute_tensor(src.contiguous(), mesh, pl) if src is x else \
                distribute_tensor(x, mesh, pl).t()
            keep = tuple(p for p in dx.placements)
            with CommDebugMode() as comm:
                outs = {"empty_strided": dx.new_empty_strided(dx.shape, dx.stride()),
                        "empty": dx.new_empty(dx.shape), "zeros": dx.new_zeros(dx.shape),
                        "ones": dx.new_ones(dx.shape), "full": dx.new_full(dx.shape, 3.0)}
            assert comm.get_total_counts() == 0
            for name, out in outs.items():
                partial_ok = name in ("empty_strided", "empty", "zeros")
                want = tuple(R if p.is_partial() and not partial_ok else p for p in keep)
                assert out.placements == want, (name, pl, out.placements)
                assert out.shape == src.shape and out.to_local().shape == \
                    out._spec.local_shape()
            assert outs["empty_strided"].stride() == dx.stride()
            local = outs["empty_strided"].to_local()
            if src is xt and local.numel() > 1:  # pieces transposed like the global layout
                assert local.stride() == (1, local.shape[0]), local.stride()
            close(outs["zeros"].full_tensor(), torch.zeros(src.shape))
            close(outs["ones"].full_tensor(), torch.ones(src.shape))
            close(outs["full"].full_tensor(), torch.full(src.shape, 3.0))
            buf = outs["empty_strided"]
            buf.copy_(dx)  # filled like the input: the values are the input's
            close(buf.full_tensor(), src)
        other = distribute_tensor(x, mesh, pl).new_zeros(3, 2)
        assert other.placements == (R, R)


@distributed(world_size=4)
def test_copies_fills_and_constructors():
    mesh = _mesh2d()
    x, row = torch.randn(5, 3), torch.randn(3)
    for pl in PLACEMENTS_2D:
        dx = distribute_tensor(x, mesh, pl)
        for like in (torch.zeros_like, torch.ones_like, lambda t: torch.full_like(t, 7.0)):
            out = like(dx)
            assert out.placements == dx.placements
            close(out.full_tensor(), like(x))
        assert torch.empty_like(dx).shape == x.shape
        for new in (lambda t: t.new_zeros(4, 2), lambda t: t.new_ones((2,)),
                    lambda t: t.new_full((3, 3), 2.0), lambda t: t.new_empty(2, 2).fill_(1.0)):
            out = new(dx)
            # a shard stays on a dim whose size the new tensor keeps (3 columns)
            kept = tuple(p if p == Shard(1) and out.ndim == 2 and out.shape[1] == 3 else R
                         for p in dx.placements)
            assert out.placements == kept, (pl, out.shape)
            close(out.full_tensor(), new(x))
        for src_pl in PLACEMENTS_2D[::2]:
            dst = torch.zeros_like(dx)
            dst.copy_(distribute_tensor(x * 2, mesh, src_pl))
            assert dst.placements == dx.placements
            close(dst.full_tensor(), x * 2)
            dst.copy_(distribute_tensor(row, mesh, _fit(src_pl, 1)))  # broadcast source
            close(dst.full_tensor(), row.expand(5, 3))
        di = dx.to(torch.int64)
        close(di.full_tensor(), x.to(torch.int64))
        close(dx.double().clone().full_tensor(), x.double())
        y = dx.clone()
        y.fill_(3.0)
        close(y.full_tensor(), torch.full((5, 3), 3.0))
        y.zero_()
        close(y.full_tensor(), torch.zeros(5, 3))
        y.fill_(distribute_tensor(torch.tensor(2.0), mesh, [R, R]))
        close(y.full_tensor(), torch.full((5, 3), 2.0))
    # Partial destinations: fill_/copy_ count the value once, without communication
    for op in ("sum", "avg", "max"):
        p = distribute_tensor(x, mesh, [R, R]).redistribute(mesh, [Partial(op), Shard(0)])
        with CommDebugMode() as comm:
            p.fill_(2.0)
        assert comm.get_total_counts() == 0 and p.placements == (Partial(op), Shard(0))
        close(p.full_tensor(), torch.full((5, 3), 2.0))
        src = distribute_tensor(x, mesh, [R, Shard(0)])
        with CommDebugMode() as comm:
            p.copy_(src)
        assert comm.get_total_counts() == 0
        close(p.full_tensor(), x)
        p.copy_(distribute_tensor(x * 3, mesh, [R, R]).redistribute(mesh, [Partial(op), R]))
        close(p.full_tensor(), x * 3)
    p = distribute_tensor(x.double(), mesh, [R, R]).redistribute(mesh, [Partial(), R])
    q = torch.zeros(5, 3, dtype=torch.int32)
    dq = distribute_tensor(q, mesh, [R, R]).redistribute(mesh, [Partial(), R])
    dq.copy_(p * 3.7)  # float -> int does not commute with sum: the source is reduced first
    close(dq.full_tensor(), (x.double() * 3.7).to(torch.int32))
    # clone and detach keep any placement and gradients flow through copies
    _check_grad(lambda t: t.double().float() * 2, [x], [[Shard(0), Shard(1)]], mesh)
    _check_grad(lambda t: torch.zeros_like(t).copy_(t) * 3, [x], [[Shard(1), R]], mesh)


# ------------------------------------------------------------------ along-dim ops
@distributed(world_size=4)
def test_sort_topk_tril_repeat_flip_roll():
    mesh = _mesh2d()
    x = torch.randn(5, 7)
    fns = [
        lambda t: t.sort(1)[0], lambda t: t.sort(0, descending=True)[1],
        lambda t: torch.sort(t, dim=1, stable=True)[1], lambda t: t.topk(3, dim=1)[0],
        lambda t: t.topk(2, dim=0, largest=False)[1], lambda t: t.argsort(1),
        lambda t: t.repeat(2, 1), lambda t: t.repeat(1, 1, 2), lambda t: t.flip(0),
        lambda t: t.flip(-1, 0), lambda t: t.roll(2, 1), lambda t: t.roll((1, -3), (0, 1)),
        lambda t: t.roll(4),
    ] + [lambda t, k=k: t.tril(k) for k in (-3, -1, 0, 2, 6)] + \
        [lambda t, k=k: t.triu(k) for k in (-2, 0, 1, 4)]
    for pl in PLACEMENTS_2D:
        dx = distribute_tensor(x, mesh, pl)
        for k, fn in enumerate(fns):
            close(fn(dx).full_tensor(), fn(x), msg=lambda m: f"fn {k} {pl}: {m}")
    # no communication along unsharded dims; tril/triu on any shards
    for pl, fn in (([Shard(0), R], lambda t: t.sort(1)[0]), ([R, Shard(0)], lambda t: t.topk(2)[1]),
                   ([Shard(0), Shard(1)], lambda t: t.tril(1)),
                   ([Shard(1), Shard(0)], lambda t: t.triu(-1)),
                   ([Shard(1), R], lambda t: t.flip(0)), ([Shard(1), R], lambda t: t.roll(2, 0)),
                   ([Shard(0), R], lambda t: t.repeat(1, 3))):
        dx = distribute_tensor(x, mesh, pl)
        with CommDebugMode() as comm:
            out = fn(dx)
        assert comm.get_total_counts() == 0, (pl, comm.get_comm_counts())
        close(out.full_tensor(), fn(x))
    # tril keeps a Partial (zeroing commutes with the sum), batched tril on 3-D
    p = distribute_tensor(x, mesh, [R, R]).redistribute(mesh, [Partial(), Shard(1)])
    with CommDebugMode() as comm:
        t = p.tril()
    assert comm.get_total_counts() == 0 and t.placements == (Partial(), Shard(1))
    close(t.full_tensor(), x.tril())
    b = torch.randn(3, 5, 4)
    close(distribute_tensor(b, mesh, [Shard(0), Shard(2)]).triu(1).full_tensor(), b.triu(1))
    for fn in (lambda t: t.sort(1)[0], lambda t: t.topk(3, dim=0)[0], lambda t: t.tril(-1),
               lambda t: t.repeat(2, 2), lambda t: t.flip(1), lambda t: t.roll(1, 0)):
        _check_grad(fn, [x], [[Shard(0), Shard(1)]], mesh)


@distributed(world_size=4)
def test_pad_rot90_lookups_and_selections_along_a_dim():
    mesh = _mesh2d()
    x = torch.randn(5, 6)
    bounds = torch.tensor([-1.0, 0.0, 0.5])
    seq2d = torch.randn(5, 4).sort(1)[0]
    ids = torch.randint(0, 6, (5, 3))
    fns = [
        lambda t, b, s, i: torch.nn.functional.pad(t, (1, 2)),
        lambda t, b, s, i: torch.nn.functional.pad(t, (0, 0, 2, 1), value=1.5),
        lambda t, b, s, i: torch.nn.functional.pad(t, (-1, 1)),
        lambda t, b, s, i: torch.rot90(t), lambda t, b, s, i: torch.rot90(t, 2),
        lambda t, b, s, i: torch.rot90(t, -1, (1, 0)),
        lambda t, b, s, i: torch.bucketize(t, b), lambda t, b, s, i: torch.bucketize(t, b, right=True),
        lambda t, b, s, i: torch.searchsorted(b, t), lambda t, b, s, i: torch.searchsorted(s, t[:, :3]),
        lambda t, b, s, i: torch.isin(i, i[0]), lambda t, b, s, i: torch.isin(i, 3),
        lambda t, b, s, i: t.kthvalue(2, 1)[0], lambda t, b, s, i: t.kthvalue(3, 0, keepdim=True)[1],
        lambda t, b, s, i: t.median(1)[0], lambda t, b, s, i: t.round().mode(0)[0],
        lambda t, b, s, i: t.nanmedian(0)[1], lambda t, b, s, i: torch.take_along_dim(t, i, 1),
        lambda t, b, s, i: t.index_reduce(0, i[0] % 5, t[:3], "amax"),
        lambda t, b, s, i: torch.nn.functional.logsigmoid(t),
    ]
    for pl in PLACEMENTS_2D:
        args = (x, bounds, seq2d, ids)
        dargs = [distribute_tensor(t, mesh, _fit(pl, t.ndim) if t.ndim > 1 else [R, R]) for t in args]
        for k, fn in enumerate(fns):
            close(fn(*dargs).full_tensor(), fn(*args), msg=lambda m: f"fn {k} {pl}: {m}")
    dx = distribute_tensor(x, mesh, [Shard(0), R])
    db = distribute_tensor(bounds, mesh, [R, R])
    with CommDebugMode() as comm:
        outs = [torch.nn.functional.pad(dx, (1, 1)), torch.bucketize(dx, db), dx.median(1)[0]]
    assert comm.get_total_counts() == 0 and all(o.placements == (Shard(0), R) for o in outs)
    # a nonzero pad value under Partial(sum) is added once
    p = distribute_tensor(x, mesh, [R, R]).redistribute(mesh, [Partial(), Shard(0)])
    with CommDebugMode() as comm:
        padded = torch.nn.functional.pad(p, (1, 1), value=2.0)
    assert comm.get_total_counts() == 0 and padded.placements == (Partial(), Shard(0))
    close(padded.full_tensor(), torch.nn.functional.pad(x, (1, 1), value=2.0))
    _check_grad(lambda t: torch.nn.functional.pad(t, (1, 2, 0, 1)), [x], [[Shard(0), Shard(1)]], mesh)
    _check_grad(lambda t: t.kthvalue(2, 1)[0], [x], [[Shard(0), Shard(1)]], mesh)


@distributed(world_size=4)
def test_one_dim_mesh_with_empty_pieces_and_non_default_shard_order():
    from dtensor_lite import _StridedShard
    mesh = init_device_mesh("cpu", (4,))
    x = torch.randn(5, 7)  # rows on 4 ranks: 2, 2, 1, 0
    ids, src = torch.tensor([4, 0, 3]), torch.randn(3, 7)
    fns = [lambda t, i, s: t.tril(2), lambda t, i, s: t.triu(-1), lambda t, i, s: t.sort(1)[0],
           lambda t, i, s: torch.cat([t, t], 1), lambda t, i, s: t.index_select(0, i),
           lambda t, i, s: t[i], lambda t, i, s: t.index_put((i,), s, accumulate=True),
           lambda t, i, s: t.index_add(0, i, s), lambda t, i, s: t.flip(1).roll(1, 1),
           lambda t, i, s: t.gather(0, i.unsqueeze(1).expand(3, 7).contiguous()),
           lambda t, i, s: t.scatter(0, i.unsqueeze(1).expand(3, 7).contiguous(), s)]
    di, ds = distribute_tensor(ids, mesh, [R]), distribute_tensor(src, mesh, [R])
    for pl in ([Shard(0)], [Shard(1)], [R]):
        dx = distribute_tensor(x, mesh, pl)
        for k, fn in enumerate(fns):
            with CommDebugMode() as comm:
                out = fn(dx, di, ds)
            if pl == [Shard(0)]:  # every one of these runs on the row pieces as they are
                assert comm.get_total_counts() == 0, (k, comm.get_comm_counts())
            close(out.full_tensor(), fn(x, ids, src), msg=lambda m: f"fn {k} {pl}: {m}")
    # FSDP-over-TP style order: mesh dim 1 splits the rows first, then mesh dim 0
    mesh = _mesh2d()
    pl = [_StridedShard(0, split_factor=2), Shard(0)]
    x = torch.randn(7, 5)
    dx = distribute_tensor(x, mesh, pl)
    ids = torch.tensor([4, 1])
    di = distribute_tensor(ids, mesh, [R, R])
    for fn in (lambda t, i: t.tril(1), lambda t, i: t.flip(1), lambda t, i: t.sort(1)[0],
               lambda t, i: t + 1, lambda t, i: torch.cat([t, t * 2], 1),
               lambda t, i: t.index_select(1, i), lambda t, i: torch.zeros_like(t),
               lambda t, i: t.repeat(1, 2), lambda t, i: t.clone().fill_(2.0)):
        with CommDebugMode() as comm:
            out = fn(dx, di)
        assert comm.get_total_counts() == 0
        assert out.placements == dx.placements, out.placements
        close(out.full_tensor(), fn(x, ids))


def _pick(options):
    return options[int(torch.randint(len(options), ()))]


@distributed(world_size=4)
def test_random_indexing_cases():
    """Seeded random cases (the same on every rank): reads and writes along a random dim of a
    random-shaped tensor placed Shard / Replicate / Partial per mesh dim, ids replicated or
    sharded, negative ids where torch allows them."""
    mesh = _mesh2d()
    aten = torch.ops.aten
    for case in range(48):
        ndim = int(torch.randint(1, 4, ()))
        shape = [int(s) for s in torch.randint(1, 6, (ndim,))]
        dim = int(torch.randint(ndim, ()))
        n = int(torch.randint(1, 6, ()))
        x = torch.randn(shape)
        ids = torch.randint(-shape[dim], shape[dim], (n,))
        pos = ids % shape[dim]
        opts = [R, Partial("sum"), Partial("max")] + [Shard(d) for d in range(ndim)]
        px = [_pick(opts), _pick(opts)]
        if {p.reduce_op for p in px if p.is_partial()} == {"sum", "max"}:
            px[1] = R
        pi = [_pick([R, Shard(0)]), _pick([R, Shard(0)])]
        dx = distribute_tensor(x, mesh, [R, R]).redistribute(mesh, px)
        di, dpos = distribute_tensor(ids, mesh, pi), distribute_tensor(pos, mesh, pi)
        res_shape = shape[:dim] + [n] + shape[dim + 1:]
        src = torch.randn(res_shape)
        gids = torch.randint(0, shape[dim], res_shape)
        dsrc = distribute_tensor(src, mesh, [_pick(opts[:1] + opts[3:]) for _ in range(2)])
        dg = distribute_tensor(gids, mesh, [_pick([R] + opts[3:]) for _ in range(2)])
        lead = [None] * dim
        cases = [
            (lambda: aten.index.Tensor(dx, lead + [di]), lambda: aten.index.Tensor(x, lead + [ids])),
            (lambda: dx.index_select(dim, dpos), lambda: x.index_select(dim, pos)),
            (lambda: aten.index_put.default(dx, lead + [di], dsrc, True),
             lambda: aten.index_put.default(x, lead + [ids], src, True)),
            (lambda: dx.index_add(dim, dpos, dsrc), lambda: x.index_add(dim, pos, src)),
            (lambda: dx.gather(dim, dg), lambda: x.gather(dim, gids)),
            (lambda: dx.scatter_add(dim, dg, dsrc), lambda: x.scatter_add(dim, gids, src)),
        ]
        got, want = cases[case % len(cases)]
        close(got().full_tensor(), want(), msg=lambda m: f"case {case} {shape} dim {dim} {px} "
                                                         f"ids {pi}: {m}")


# ------------------------------------------------------------------ data-dependent and bools
@distributed(world_size=4)
def test_data_dependent_ops_and_python_bools():
    mesh = _mesh2d()
    x = torch.randn(5, 3)
    x[1] = 0.0
    for pl in PLACEMENTS_2D:
        dx = distribute_tensor(x, mesh, pl)
        close(dx.nonzero().full_tensor(), x.nonzero())
        close(dx.masked_select(dx > 0).full_tensor(), x.masked_select(x > 0))
        close(torch.unique(dx.round()).full_tensor(), torch.unique(x.round()))
        for other_pl in PLACEMENTS_2D[::2]:
            other = distribute_tensor(x, mesh, other_pl)
            assert torch.equal(dx, other) and torch.allclose(dx, other)
            assert dx.is_same_size(other)
            assert not torch.equal(dx, other + 1e-3)
            assert torch.allclose(dx, other + 1e-9)
    # one rank's piece differs: every rank answers False (no rank may disagree)
    mesh1 = init_device_mesh("cpu", (4,))
    a = distribute_tensor(torch.arange(8.0), mesh1, [Shard(0)])
    local = a.to_local().clone()
    if mesh1.get_rank() == 2:
        local[0] += 1
    b = DTensor.from_local(local, mesh1, [Shard(0)])
    assert not torch.equal(a, b) and not torch.allclose(a, b)
    assert torch.equal(a, a) and not torch.equal(a, distribute_tensor(torch.arange(4.0), mesh1, [R]))
    assert not a.is_same_size(distribute_tensor(torch.arange(4.0), mesh1, [R]))
    short = distribute_tensor(torch.arange(4.0), mesh1, [Shard(0)])
    with CommDebugMode() as comm:  # shapes differ: answered from metadata alone
        assert not torch.equal(a, short)
    assert comm.get_total_counts() == 0
    # Partial operands compare by value; replicated ones need no agreement step
    p = distribute_tensor(torch.arange(8.0), mesh1, [R]).redistribute(mesh1, [Partial()])
    assert torch.equal(p, a)
    r1 = distribute_tensor(torch.arange(8.0), mesh1, [R])
    r2 = distribute_tensor(torch.arange(8.0), mesh1, [R])
    with CommDebugMode() as comm:
        assert torch.equal(r1, r2) and torch.allclose(r1, r2)
    assert comm.get_total_counts() == 0


@distributed(world_size=4)
def test_clear_errors():
    mesh = init_device_mesh("cpu", (4,))
    dx = distribute_tensor(torch.randn(6, 3), mesh, [Shard(0)])
    with pytest.raises(ValueError, match="plain torch.Tensor"):
        dx[torch.tensor([0, 1])]
    with pytest.raises(IndexError, match="out of range"):
        dx[distribute_tensor(torch.tensor([6]), mesh, [R])]
    with pytest.raises(IndexError, match="out of range"):
        dx.scatter_add(0, distribute_tensor(torch.tensor([[9, 0, 0]]), mesh, [R]),
                       distribute_tensor(torch.ones(1, 3), mesh, [R]))
    with pytest.raises(ValueError, match="plain torch.Tensor"):
        torch.equal(dx, torch.randn(6, 3))
