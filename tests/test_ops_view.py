"""Shape ops against plain torch, forward and backward, over many placements on a 1-D (4) and a
2-D (2x2) mesh with uneven shapes (empty shards included) and Partial inputs; CommDebugMode
checks that the paths which keep shards really move nothing."""
import torch

from dtensor_lite import (Partial, Replicate, Shard, _StridedShard, distribute_tensor,
                          init_device_mesh)
from dtensor_lite.debug import CommDebugMode
from tests._op_helpers import as_tuple as _as_tuple, leaf_and_input as _leaf_and_input, like as _like
from tests.harness import distributed

R, P = Replicate(), Partial()


def _meshes():
    return (init_device_mesh("cpu", (4,)),
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))


def _placements(mesh, ndim):
    """Shard on every dim, Replicate, Partial inputs, and mixed 2-D placements."""
    if mesh.ndim == 1:
        return [[Shard(d)] for d in range(ndim)] + [[R], [P]]
    out = [[Shard(0), Shard(ndim - 1)], [Shard(ndim - 1), Shard(0)], [Shard(0), Shard(0)],
           [R, Shard(ndim - 1)], [P, Shard(0)]]
    return out + ([[Shard(1), Shard(2)], [Shard(ndim - 1), Shard(ndim - 1)]] if ndim > 2 else [])




def check(fn, x, meshes, grad=True, placements=None):
    """``fn`` on DTensors equals ``fn`` on the full tensor for every placement, and so do the
    input gradients of a random weighting of the outputs."""
    xr = x.clone().requires_grad_(grad)
    refs = _as_tuple(fn(xr))
    weights = [torch.randn(r.shape) for r in refs]
    if grad:
        sum((r * w).sum() for r, w in zip(refs, weights)).backward()
    for mesh in meshes:
        for pl in (placements or _placements(mesh, x.ndim)):
            leaf, dx = _leaf_and_input(x, mesh, pl)
            outs = _as_tuple(fn(dx))
            assert len(outs) == len(refs)
            for o, r in zip(outs, refs):
                assert o.shape == r.shape, (pl, o.shape, r.shape)
                torch.testing.assert_close(o.full_tensor(), r.detach(),
                                           msg=lambda m: f"{pl} on {mesh}: {m}")
            if grad:
                sum((o * _like(w, o)).sum() for o, w in zip(outs, weights)).backward()
                torch.testing.assert_close(leaf.grad.full_tensor(), xr.grad,
                                           msg=lambda m: f"grad, {pl} on {mesh}: {m}")


def no_comm(fn):
    with CommDebugMode() as comm:
        out = fn()
    assert comm.get_total_counts() == 0, dict(comm.get_comm_counts())
    return out


@distributed(world_size=4)
def test_permutations_move_shards_for_free():
    meshes = _meshes()
    x = torch.randn(5, 3, 2)
    check(lambda t: (t.transpose(0, 2), t.permute(1, 2, 0), t.swapaxes(-1, 1), t.movedim(0, -1),
                     t[:, :, 0].t(), t.mT, t.transpose(0, 1).contiguous()), x, meshes)
    mesh2 = meshes[1]
    d = distribute_tensor(x, mesh2, [Shard(0), Shard(2)])
    p = no_comm(lambda: d.permute(2, 0, 1))
    assert p.placements == (Shard(1), Shard(0))
    c = no_comm(lambda: d.transpose(0, 1).contiguous())
    assert c.placements == (Shard(1), Shard(2))


@distributed(world_size=4)
def test_reshapes_forward_and_backward():
    meshes = _meshes()
    check(lambda t: (t.view(8, 6), t.reshape(4, 2, 6), t.flatten(), t.flatten(1), t.view(-1, 3),
                     t.unflatten(0, (2, 4)), t.unsqueeze(1), t.view(2, 4, 3, 2)),
          torch.randn(8, 3, 2), meshes)
    # uneven: 5 rows on 4 ranks are 2, 2, 1, 0; on 2 ranks 3, 2
    check(lambda t: (t.view(20), t.reshape(5, 2, 2), t.view(5, 4, 1), t.unsqueeze(0).squeeze(0),
                     t.view(1, 5, 4).squeeze(), t.flatten(0, 1).unflatten(0, (10, 2))),
          torch.randn(5, 4), meshes)
    check(lambda t: (t.view(7, 3), t.squeeze(1), t.squeeze((1, 3)), t.reshape(21)),
          torch.randn(7, 1, 3, 1), meshes)
    check(lambda t: (t.reshape(3, 10), t.reshape(6, 5), t.transpose(1, 2).reshape(2, 15)),
          torch.randn(2, 5, 3), meshes)
    check(lambda t: (t.view(()), t.view(1, 1)), torch.randn(1), meshes)


@distributed(world_size=4)
def test_reshapes_keep_shards_where_pieces_stay_whole():
    mesh1, mesh2 = _meshes()
    x = torch.randn(8, 3, 2)
    d = distribute_tensor(x, mesh1, [Shard(0)])
    for v, want in ((lambda: d.view(8, 6), [Shard(0)]), (lambda: d.flatten(), [Shard(0)]),
                    (lambda: d.view(4, 2, 6), [Shard(0)]), (lambda: d.view(2, 4, 6), [R]),
                    (lambda: d.unflatten(0, (4, 2)), [Shard(0)])):
        out = v() if want == [R] else no_comm(v)
        assert list(out.placements) == want, (out.placements, want)
    # a head split keeps the tensor-parallel shard: (b, s, h * d) -> (b, s, h, d)
    act = distribute_tensor(torch.randn(2, 3, 8), mesh2, [Shard(0), Shard(2)])
    heads = no_comm(lambda: act.view(2, 3, 4, 2))
    assert heads.placements == (Shard(0), Shard(2))
    torch.testing.assert_close(heads.full_tensor(), act.full_tensor().view(2, 3, 4, 2))
    merged = no_comm(lambda: heads.reshape(2, 3, 8))
    assert merged.placements == (Shard(0), Shard(2))
    # two mesh dims sharding one dim that a view splits: they go to successive new dims
    y = torch.randn(8, 6)
    dy = distribute_tensor(y, mesh2, [Shard(0), Shard(0)])
    split = no_comm(lambda: dy.view(2, 4, 6))
    assert split.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(split.full_tensor(), y.view(2, 4, 6))
    back = no_comm(lambda: split.view(8, 6))
    assert back.placements == (Shard(0), Shard(0))
    # uneven inner pieces: only the innermost mesh dim has to give up its shard
    z = torch.randn(6, 4)  # outer pieces 3, 3; inner pieces 2, 1: (2 + 1) * 4 is no chunk of 24
    flat = distribute_tensor(z, mesh2, [Shard(0), Shard(0)]).view(24)
    assert flat.placements == (Shard(0), R)
    torch.testing.assert_close(flat.full_tensor(), z.view(24))
    # Partial passes through every reshape; empty tensors need no communication at all
    pz = distribute_tensor(z, mesh2, [R, Shard(1)]).redistribute(mesh2, [P, Shard(1)])
    v = no_comm(lambda: pz.view(3, 2, 4).unsqueeze(0))
    assert v.placements == (P, Shard(3))
    torch.testing.assert_close(v.full_tensor(), z.view(1, 3, 2, 4))
    e = distribute_tensor(torch.randn(0, 6), mesh1, [Shard(1)])
    ev = no_comm(lambda: e.view(0, 2, 3))
    assert ev.shape == (0, 2, 3) and ev.full_tensor().shape == (0, 2, 3)


@distributed(world_size=4)
def test_shard_order_survives_shape_ops():
    # FSDP over TP: mesh dim 1 splits dim 0 first, mesh dim 0 then splits within each piece
    mesh2 = _meshes()[1]
    x = torch.randn(8, 3, 2)
    d = distribute_tensor(x, mesh2, [_StridedShard(0, split_factor=2), Shard(0)])
    for fn in (lambda t: t.view(8, 6), lambda t: t.flatten(), lambda t: t.transpose(0, 1),
               lambda t: t.unsqueeze(0), lambda t: t[:, 1:], lambda t: t[:, 0],
               lambda t: t.expand(2, 8, 3, 2)):
        out = no_comm(lambda: fn(d))
        torch.testing.assert_close(out.full_tensor(), fn(x))
    check(lambda t: (t.view(8, 6), t.transpose(0, 2), t[:, :2]), x, [mesh2],
          placements=[[_StridedShard(0, split_factor=2), Shard(0)]])


@distributed(world_size=4)
def test_expand():
    meshes = _meshes()
    check(lambda t: (t.expand(5, 4), t.expand(2, 5, 4), t.unsqueeze(0).expand(3, 5, 1)),
          torch.randn(5, 1), meshes)
    check(lambda t: (t.expand(3, 5, 4), t.expand_as(torch.empty(2, 3, 5, 4))),
          torch.randn(3, 1, 4), meshes)
    mesh2 = meshes[1]
    d = distribute_tensor(torch.randn(5, 1), mesh2, [Shard(0), R])
    e = no_comm(lambda: d.expand(2, 5, 7))
    assert e.placements == (Shard(1), R)


@distributed(world_size=4)
def test_slicing_forward_and_backward():
    meshes = _meshes()
    x = torch.randn(9, 6)
    check(lambda t: (t[1:7], t[:, 2:], t[::2], t[1::3, ::2], t[-3:], t[:, -1:], t[4:2],
                     t.narrow(0, 2, 5), t.narrow(1, 0, 6), t[0], t[:, 3], t[-1], t[5, 1]),
          x, meshes)
    check(lambda t: (t[:, 1], t[1:, :, ::2], t.select(2, -1), t[:1]), torch.randn(5, 3, 2), meshes)


@distributed(world_size=4)
def test_slicing_an_unsharded_dim_keeps_shards():
    mesh1, mesh2 = _meshes()
    x = torch.randn(9, 6)
    d = distribute_tensor(x, mesh2, [Shard(0), R])
    s = no_comm(lambda: d[:, 1:4])
    assert s.placements == (Shard(0), R)
    c = no_comm(lambda: d[:, 2])
    assert c.placements == (Shard(0), R)
    torch.testing.assert_close(c.full_tensor(), x[:, 2])
    full = no_comm(lambda: d[:])  # a whole slice of the sharded dim
    assert full.placements == (Shard(0), R)
    # x[::2] of an even split: every rank already holds its piece of the result
    e = distribute_tensor(torch.randn(8, 3), mesh1, [Shard(0)])
    strided = no_comm(lambda: e[::2])
    assert strided.placements == (Shard(0),)
    torch.testing.assert_close(strided.full_tensor(), e.full_tensor()[::2])
    # a short slice or a select of a sharded dim: zero-padded pieces, Partial(sum), no comm
    tail = no_comm(lambda: d[-2:])
    row = no_comm(lambda: d[7])
    assert tail.placements == (P, R) and row.placements == (P, R)
    torch.testing.assert_close(tail.full_tensor(), x[-2:])
    torch.testing.assert_close(row.full_tensor(), x[7])
    aligned = no_comm(lambda: d[1:])  # rows 1-4 and 5-8 are chunks of 8: each rank has its own
    assert aligned.placements == (Shard(0), R)
    torch.testing.assert_close(aligned.full_tensor(), x[1:])
    long = d[2:]  # longer than half the dim and not aligned: gathered instead
    assert long.placements == (R, R)
    torch.testing.assert_close(long.full_tensor(), x[2:])
    flags = distribute_tensor(x > 0, mesh1, [Shard(0)])  # bool: no exact sum, gathered
    assert flags[3].placements == (R,)
    assert torch.equal(flags[3].full_tensor(), x[3] > 0)


@distributed(world_size=4)
def test_split_chunk_unbind():
    meshes = _meshes()
    x = torch.randn(7, 6)
    check(lambda t: (*t.split(3), *t.split(4, 1), *t.chunk(3, 1), *t.split([1, 5], 1),
                     *t.tensor_split(3, 0)), x, meshes)
    check(lambda t: (*t.unbind(1), *t[:3].unbind(0)), torch.randn(5, 3), meshes)
    mesh2 = meshes[1]
    d = distribute_tensor(x, mesh2, [Shard(0), R])
    parts = no_comm(lambda: d.split(2, 1))
    assert all(p.placements == (Shard(0), R) for p in parts)
    cols = no_comm(lambda: d.unbind(1))
    assert all(c.placements == (Shard(0), R) for c in cols)
    whole = no_comm(lambda: d.split(7))  # one piece: nothing to move even on the sharded dim
    assert whole[0].placements == (Shard(0), R)


@distributed(world_size=4)
def test_bad_arguments_fail_like_torch():
    import pytest
    mesh = _meshes()[0]
    x = torch.randn(5, 3)
    d = distribute_tensor(x, mesh, [Shard(0)])
    for bad in (lambda t: t.view(7), lambda t: t[7], lambda t: t[:, 4],
                lambda t: t.permute(1, 0, 2),
                lambda t: t.transpose(0, 3), lambda t: t.expand(4, 3), lambda t: t.split(2, 3),
                lambda t: t.unsqueeze(4), lambda t: t.narrow(0, 4, 3)):
        with pytest.raises((IndexError, RuntimeError)) as plain:
            bad(x)
        with pytest.raises((IndexError, RuntimeError)) as dist:
            bad(d)
        # torch's own check before dispatch, or ours naming the op and the global shapes
        assert str(dist.value) == str(plain.value) or "aten." in str(dist.value), dist.value


@distributed(world_size=4)
def test_complex_views_as_in_rotary_embeddings():
    meshes = _meshes()
    x = torch.randn(2, 5, 4)
    freqs = torch.polar(torch.ones(5, 2), torch.randn(5, 2))

    def rotary(t):
        f = distribute_tensor(freqs, t.device_mesh, [R] * t.device_mesh.ndim) if hasattr(
            t, "device_mesh") else freqs
        c = torch.view_as_complex(t.reshape(2, 5, 2, 2))
        return torch.view_as_real(c * f).flatten(2)
    check(rotary, x, meshes, grad=False)  # (complex mul's backward conj is not a view op)
    check(lambda t: torch.view_as_real(torch.view_as_complex(t.reshape(2, 5, 2, 2)) * 2.0 - 1.0)
          .flatten(2), x, meshes)
    d = distribute_tensor(x, meshes[1], [Shard(0), Shard(1)])
    out = no_comm(lambda: torch.view_as_real(torch.view_as_complex(d.view(2, 5, 2, 2))))
    assert out.placements == (Shard(0), Shard(1))


@distributed(world_size=4)
def test_three_dim_mesh():
    mesh3 = init_device_mesh("cpu", (2, 1, 2))
    pls = [[Shard(0), R, Shard(1)], [Shard(1), Shard(0), Shard(1)], [Shard(0), P, Shard(0)]]
    check(lambda t: (t.view(5, 2, 3), t.flatten(), t.transpose(0, 1), t[1:3], t[:, 2], t[4],
                     *t.split(2, 1), t.unsqueeze(1).expand(5, 2, 6)),
          torch.randn(5, 6), [mesh3], placements=pls)
