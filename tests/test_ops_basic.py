"""The first op rules against plain torch: pointwise (broadcast, Partial kept or resolved),
matrix products, sum/mean over sharded dims, views on uneven shards, in-place ops, and errors."""
import pytest
import torch
import torch.nn.functional as F

from dtensor_lite import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.debug import CommDebugMode
from dtensor_lite.debug import reset_fallback_warnings
from tests.harness import distributed

PLACEMENTS_2D = [
    [Shard(0), Replicate()], [Replicate(), Shard(1)], [Shard(0), Shard(1)], [Shard(0), Shard(0)],
    [Shard(1), Shard(0)], [Replicate(), Replicate()],
]


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _partial_from(global_tensor, mesh, placements):
    """A DTensor with Partial(sum) placements whose global value is ``global_tensor``."""
    return distribute_tensor(global_tensor, mesh, [Replicate()] * mesh.ndim).redistribute(
        mesh, placements)


@distributed(world_size=4)
@pytest.mark.parametrize("shape", [(5, 3), (4, 6), (1, 7), (3, 1)])
def test_pointwise_binary_and_broadcast(shape):
    mesh = _mesh()
    a, b, row = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    for pa in PLACEMENTS_2D:
        for pb in PLACEMENTS_2D:
            da, db = distribute_tensor(a, mesh, pa), distribute_tensor(b, mesh, pb)
            torch.testing.assert_close((da + db * 2).full_tensor(), a + b * 2)
            torch.testing.assert_close(torch.maximum(da, db).full_tensor(), torch.maximum(a, b))
        dr = distribute_tensor(row, mesh, [Replicate(), Shard(0)])
        torch.testing.assert_close((da * dr - 1.5).full_tensor(), a * row - 1.5)
        torch.testing.assert_close(torch.where(da > 0, da, dr).full_tensor(),
                                   torch.where(a > 0, a, row))
        torch.testing.assert_close(F.gelu(da).full_tensor(), F.gelu(a))


@distributed(world_size=4)
def test_partial_kept_where_linear_and_resolved_elsewhere():
    mesh = _mesh()
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    px = _partial_from(x, mesh, [Partial(), Replicate()])
    py = _partial_from(y, mesh, [Partial(), Replicate()])
    ry = distribute_tensor(y, mesh, [Replicate(), Replicate()])
    with CommDebugMode() as comm:
        s = px + py
        m = px * ry
        n = -px
        q = px / 3.0
    assert comm.get_total_counts() == 0
    assert s.placements[0] == Partial() and m.placements[0] == Partial()
    assert n.placements[0] == Partial() and q.placements[0] == Partial()
    torch.testing.assert_close(s.full_tensor(), x + y)
    torch.testing.assert_close(m.full_tensor(), x * y)
    torch.testing.assert_close(n.full_tensor(), -x)
    torch.testing.assert_close(q.full_tensor(), x / 3.0)
    # not linear: Partial must be reduced first, and the value is right
    torch.testing.assert_close((px + 1.0).full_tensor(), x + 1.0)
    torch.testing.assert_close((px * py).full_tensor(), x * y)
    torch.testing.assert_close(torch.exp(px).full_tensor(), torch.exp(x))


@distributed(world_size=4)
@pytest.mark.parametrize("m,k,n", [(6, 4, 5), (5, 3, 7), (2, 9, 3)])
def test_matmul_strategies(m, k, n):
    mesh = _mesh()
    a, b, bias = torch.randn(m, k), torch.randn(k, n), torch.randn(n)
    for pa in PLACEMENTS_2D:
        for pb in PLACEMENTS_2D:
            da, db = distribute_tensor(a, mesh, pa), distribute_tensor(b, mesh, pb)
            torch.testing.assert_close((da @ db).full_tensor(), a @ b)
            dbias = distribute_tensor(bias, mesh, [Replicate(), Replicate()])
            torch.testing.assert_close(torch.addmm(dbias, da, db).full_tensor(),
                                       torch.addmm(bias, a, b))
    # the standard shapes need no communication at all
    da = distribute_tensor(a, mesh, [Shard(0), Shard(1)])
    db = distribute_tensor(b, mesh, [Replicate(), Shard(0)])
    with CommDebugMode() as comm:
        out = da @ db
    assert comm.get_total_counts() == 0
    assert out.placements == (Shard(0), Partial())


@distributed(world_size=4)
def test_bmm_and_linear_3d():
    mesh = _mesh()
    x, w, bias = torch.randn(5, 3, 4), torch.randn(6, 4), torch.randn(6)
    for px in ([Shard(0), Replicate()], [Shard(0), Shard(1)], [Replicate(), Shard(2)]):
        dx = distribute_tensor(x, mesh, px)
        for pw in ([Replicate(), Replicate()], [Replicate(), Shard(0)], [Replicate(), Shard(1)]):
            dw = distribute_tensor(w, mesh, pw)
            db = distribute_tensor(bias, mesh, [Replicate(), Replicate()])
            torch.testing.assert_close(F.linear(dx, dw, db).full_tensor(), F.linear(x, w, bias))
    a, b = torch.randn(3, 4, 5), torch.randn(3, 5, 2)
    da, db = distribute_tensor(a, mesh, [Shard(0), Shard(2)]), distribute_tensor(b, mesh, [Shard(0), Shard(1)])
    torch.testing.assert_close(torch.bmm(da, db).full_tensor(), torch.bmm(a, b))


@distributed(world_size=4)
@pytest.mark.parametrize("shape", [(5, 3), (2, 7, 3), (4, 4)])
def test_sum_and_mean_over_sharded_dims(shape):
    mesh = _mesh()
    x = torch.randn(shape)
    for p0 in range(len(shape)):
        for p1 in range(len(shape)):
            dx = distribute_tensor(x, mesh, [Shard(p0), Shard(p1)])
            torch.testing.assert_close(dx.sum().full_tensor(), x.sum())
            torch.testing.assert_close(dx.mean().full_tensor(), x.mean())
            for d in range(len(shape)):
                torch.testing.assert_close(dx.sum(d).full_tensor(), x.sum(d))
                torch.testing.assert_close(dx.mean(d, keepdim=True).full_tensor(),
                                           x.mean(d, keepdim=True))


@distributed(world_size=4)
def test_views_keep_shards_when_aligned_and_stay_correct_when_not():
    mesh = init_device_mesh("cpu", (4,))
    even = torch.randn(8, 3, 2)
    d = distribute_tensor(even, mesh, [Shard(0)])
    with CommDebugMode() as comm:
        v = d.view(8, 6)
        f = d.flatten()
    assert comm.get_total_counts() == 0
    assert v.placements == (Shard(0),) and f.placements == (Shard(0),)
    torch.testing.assert_close(v.full_tensor(), even.view(8, 6))
    torch.testing.assert_close(f.full_tensor(), even.flatten())
    uneven = torch.randn(5, 4)  # pieces of 2, 2, 1, 0 rows: a flat view is not a chunk of 20
    du = distribute_tensor(uneven, mesh, [Shard(0)])
    torch.testing.assert_close(du.view(20).full_tensor(), uneven.view(20))
    torch.testing.assert_close(du.reshape(5, 2, 2).full_tensor(), uneven.reshape(5, 2, 2))
    torch.testing.assert_close(du.t().full_tensor(), uneven.t())
    torch.testing.assert_close(du.unsqueeze(0).full_tensor(), uneven.unsqueeze(0))
    torch.testing.assert_close(du.transpose(0, 1).contiguous().full_tensor(), uneven.t())


@distributed(world_size=4)
def test_inplace_and_like_ops():
    mesh = _mesh()
    x, y = torch.randn(5, 6), torch.randn(5, 6)
    dx = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    dy = distribute_tensor(y, mesh, [Replicate(), Replicate()])
    out = dx.add_(dy, alpha=2.0)
    assert out is dx and dx.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(dx.full_tensor(), x + 2 * y)
    torch.testing.assert_close(torch.ones_like(dx).full_tensor(), torch.ones(5, 6))
    px = _partial_from(x, mesh, [Partial(), Replicate()])
    torch.testing.assert_close(torch.zeros_like(px).full_tensor(), torch.zeros(5, 6))
    assert dx.sum().item() == pytest.approx((x + 2 * y).sum().item(), rel=1e-5)
    dy.mul_(dx)  # the sharded operand is gathered: the destination keeps its placement
    assert dy.placements == (Replicate(), Replicate())
    torch.testing.assert_close(dy.full_tensor(), y * (x + 2 * y))
    # exp of a Partial needs the reduced value: px itself is reduced first, then written
    assert px.exp_() is px and not px.placements[0].is_partial(), px.placements
    torch.testing.assert_close(px.full_tensor(), x.exp())


@distributed(world_size=2)
def test_mixing_plain_tensor_errors_and_missing_rule_warns():
    mesh = init_device_mesh("cpu", (2,))
    dx = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    with pytest.raises(ValueError, match="distribute_tensor"):
        dx + torch.randn(4, 4)
    torch.testing.assert_close((dx + torch.tensor(2.0)).full_tensor(), dx.full_tensor() + 2)
    reset_fallback_warnings()
    with pytest.warns(UserWarning, match="no sharding rule.*register_sharding"):
        tr = torch.trace(dx)  # no rule: gathered, correct, and said so
    torch.testing.assert_close(tr.full_tensor(), torch.trace(dx.full_tensor()))


@distributed(world_size=4)
def test_dtypes_gloo_cannot_move_travel_widened():
    mesh = _mesh()
    x = (torch.randn(5, 3) * 100).to(torch.int16)
    d = distribute_tensor(x, mesh, [Shard(0), Replicate()])
    assert torch.equal(d.full_tensor(), x)
    assert d.full_tensor().dtype == torch.int16
    m = torch.randn(5, 3) > 0
    assert torch.equal(distribute_tensor(m, mesh, [Shard(1), Shard(0)]).full_tensor(), m)


@distributed(world_size=4)
def test_double_backward_cast_and_custom_rule_partials_stay_consistent():
    mesh = _mesh()
    x = torch.randn(4, 6, requires_grad=True)
    dx = distribute_tensor(x.detach(), mesh, [Shard(0), Shard(1)]).requires_grad_()
    dx.double().sum().backward()  # backward of .double() is _to_copy(device=cpu)
    x.double().sum().backward()
    torch.testing.assert_close(dx.grad.full_tensor(), x.grad)


@distributed(world_size=4)
def test_diagonal_of_a_sharded_matrix():
    mesh = _mesh()
    x = torch.randn(5, 6)
    for placements in ([Shard(0), Shard(1)], [Shard(1), Replicate()], [Replicate(), Replicate()]):
        dx = distribute_tensor(x, mesh, placements)
        torch.testing.assert_close(torch.diag(dx).full_tensor(), torch.diag(x))
        torch.testing.assert_close(torch.diag_embed(dx).full_tensor(), torch.diag_embed(x))
    px = _partial_from(x, mesh, [Partial(), Replicate()])
    torch.testing.assert_close(torch.diag(px).full_tensor(), torch.diag(x))
