"""In-place view ops (t_, transpose_, swapdims_, squeeze_, unsqueeze_) on DTensors: the DTensor
itself changes shape, strides and placements (a Shard's dim moves with the op), its pieces keep
their storage, and the global values match plain torch on a 1-D (4) and a 2x2 mesh with uneven
shapes. squeeze_ goes by the *global* sizes, never the local ones."""
import pytest
import torch

from dtensor_lite import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.debug import CommDebugMode
from tests.harness import distributed

R, P = Replicate(), Partial()

# (name, the in-place op, its out-of-place twin, global shape)
CASES = [
    ("t_", lambda t: t.t_(), lambda t: t.t(), (5, 3)),
    ("transpose_", lambda t: t.transpose_(0, 2), lambda t: t.transpose(0, 2), (5, 3, 6)),
    ("transpose_ neg", lambda t: t.transpose_(-1, 1), lambda t: t.transpose(-1, 1), (5, 3, 6)),
    ("swapdims_", lambda t: t.swapdims_(0, 1), lambda t: t.swapdims(0, 1), (5, 3, 6)),
    ("swapaxes_", lambda t: t.swapaxes_(2, 0), lambda t: t.swapaxes(2, 0), (5, 3, 6)),
    ("unsqueeze_ 0", lambda t: t.unsqueeze_(0), lambda t: t.unsqueeze(0), (5, 3)),
    ("unsqueeze_ 1", lambda t: t.unsqueeze_(1), lambda t: t.unsqueeze(1), (5, 3)),
    ("unsqueeze_ -1", lambda t: t.unsqueeze_(-1), lambda t: t.unsqueeze(-1), (5, 3)),
    ("squeeze_", lambda t: t.squeeze_(), lambda t: t.squeeze(), (5, 1, 6, 1)),
    ("squeeze_ dim", lambda t: t.squeeze_(1), lambda t: t.squeeze(1), (5, 1, 6, 1)),
    ("squeeze_ dim not 1", lambda t: t.squeeze_(0), lambda t: t.squeeze(0), (5, 1, 6, 1)),
    ("squeeze_ dims", lambda t: t.squeeze_((1, -1)), lambda t: t.squeeze((1, -1)), (5, 1, 6, 1)),
]


def _placements(mesh, ndim):
    """Shard on every dim (size-1 dims too), Replicate, Partial; on 2x2 mixes of them."""
    if mesh.ndim == 1:
        return [[Shard(d)] for d in range(ndim)] + [[R], [P]]
    last = ndim - 1
    return [[Shard(0), Shard(last)], [Shard(last), Shard(0)], [Shard(0), Shard(0)],
            [R, Shard(last)], [P, Shard(0)], [Shard(1), R], [Shard(last), Shard(1)]]


def _meshes():
    return (init_device_mesh("cpu", (4,)),
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))


def _size1_shard(x0, pl):
    return any(p.is_shard() and x0.shape[p.dim] == 1 for p in pl)


@distributed(world_size=4)
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_inplace_view_matches_plain_torch(name):
    _, inplace, functional, shape = next(c for c in CASES if c[0] == name)
    full = torch.randn(shape)
    ref = full.clone()
    assert inplace(ref) is ref
    for mesh in _meshes():
        for pl in _placements(mesh, len(shape)):
            x = distribute_tensor(full, mesh, pl)
            want = functional(distribute_tensor(full, mesh, pl))  # the out-of-place placements
            local, storage = x._local_tensor, x._local_tensor.untyped_storage()._cdata
            with CommDebugMode() as comm:
                out = inplace(x)
            msg = f"{name}, {pl} on {mesh}"
            assert out is x, msg
            assert x.shape == ref.shape and x.stride() == ref.stride(), msg
            assert x.placements == want.placements, (msg, x.placements, want.placements)
            if not _size1_shard(full, pl):
                assert comm.get_total_counts() == 0, (msg, dict(comm.get_comm_counts()))
            if local.numel() or not _size1_shard(full, pl):  # else: see the size-1 shard test
                assert x._local_tensor is local, msg  # the piece changed in place
                assert local.untyped_storage()._cdata == storage, msg
            assert tuple(x._local_tensor.shape) == x._spec.local_shape(), msg
            torch.testing.assert_close(x.full_tensor(), ref, rtol=0, atol=0, msg=msg)
            # once more from the cached decision: the inverse gets the original back
            if name.startswith(("t_", "transpose_", "swap")):
                inplace(x)
                assert x.shape == shape and x.placements == tuple(pl), msg
                torch.testing.assert_close(x.full_tensor(), full, rtol=0, atol=0, msg=msg)


@distributed(world_size=4)
def test_pieces_stay_aliased():
    # a view taken before the in-place view op still sees writes made through the DTensor after
    for mesh in _meshes():
        pl = [Shard(1)] if mesh.ndim == 1 else [Shard(1), Shard(0)]
        x = distribute_tensor(torch.arange(15.).view(5, 3), mesh, pl)
        alias = x.view(5, 3)
        x.t_()
        x.mul_(2)
        torch.testing.assert_close(alias.full_tensor(), 2 * torch.arange(15.).view(5, 3))
        assert x.to_local().data_ptr() == alias.to_local().data_ptr() or x.to_local().numel() == 0


@distributed(world_size=4)
def test_squeeze_goes_by_global_size():
    mesh = init_device_mesh("cpu", (4,))
    # every rank holds (1, 6) of a (4, 6): nothing is squeezed, locally or globally
    x = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])
    assert x.squeeze_() is x and x.shape == (4, 6) and x.to_local().shape == (1, 6)
    assert x.squeeze_(0).shape == (4, 6) and x.placements == (Shard(0),)


@distributed(world_size=4)
def test_squeeze_sharded_size1_dim():
    # a size-1 dim sharded over 4 ranks: rank 0 holds it, the others hold empty pieces. squeeze_
    # drops it by its global size; the mesh dim that sharded it becomes Replicate (as out-of-place
    # squeeze gives), rank 0 keeps its own storage and the others receive a copy.
    import torch.distributed as dist
    full = torch.randn(3, 1, 5)
    for mesh, pl, after in [
            (init_device_mesh("cpu", (4,)), [Shard(1)], (R,)),
            (init_device_mesh("cpu", (2, 2)), [Shard(1), Shard(2)], (R, Shard(1))),
            (init_device_mesh("cpu", (2, 2)), [Shard(1), Shard(1)], (R, R)),
            (init_device_mesh("cpu", (2, 2)), [Shard(0), Shard(1)], (Shard(0), R))]:
        for op in (lambda t: t.squeeze_(), lambda t: t.squeeze_(1), lambda t: t.squeeze_([1])):
            x = distribute_tensor(full, mesh, pl)
            old = x._local_tensor
            owner = old.numel() > 0
            assert op(x) is x and x.shape == (3, 5) and x.placements == after, (pl, x.placements)
            assert x.to_local().shape == x._spec.local_shape()
            if owner:  # the rank that held the element keeps its storage
                assert x._local_tensor is old
            torch.testing.assert_close(x.full_tensor(), full.squeeze(1), rtol=0, atol=0)
    assert dist.get_world_size() == 4


@distributed(world_size=4)
def test_autograd_through_inplace_views():
    for mesh in _meshes():
        pl = [Shard(0)] if mesh.ndim == 1 else [Shard(1), Shard(0)]
        full, weight = torch.randn(5, 3), torch.randn(3, 1, 5)
        ref = full.clone().requires_grad_()
        y = ref * 1
        y.t_().unsqueeze_(1)
        (y * weight).sum().backward()
        leaf = distribute_tensor(full, mesh, pl).requires_grad_()
        y = leaf * 1
        assert y.t_().unsqueeze_(1) is y
        (y * distribute_tensor(weight, mesh, [R] * mesh.ndim)).sum().backward()
        torch.testing.assert_close(leaf.grad.full_tensor(), ref.grad)
        # as in plain torch: a leaf that requires grad cannot change in place, except under no_grad
        with pytest.raises(RuntimeError, match="leaf Variable"):
            leaf.t_()
        with torch.no_grad():
            assert leaf.t_() is leaf and leaf.shape == (3, 5)


@distributed(world_size=4)
def test_matmul_with_1d_operands():
    for mesh in _meshes():
        v, m, b = torch.randn(6), torch.randn(6, 5), torch.randn(2, 6, 5)
        pls = [[Shard(0)], [R]] if mesh.ndim == 1 else [[Shard(0), Shard(0)], [R, Shard(0)]]
        for pl in pls:
            dv = distribute_tensor(v, mesh, pl)
            for other in (m, b):
                for opl in ([R] * mesh.ndim, [Shard(other.ndim - 1)] + [R] * (mesh.ndim - 1)):
                    do = distribute_tensor(other, mesh, opl)
                    torch.testing.assert_close(torch.matmul(dv, do).full_tensor(), v @ other)
                    torch.testing.assert_close(
                        torch.matmul(do.transpose(-1, -2), dv).full_tensor(),
                        other.transpose(-1, -2) @ v)


@distributed(world_size=4)
def test_as_strided_inplace_only_as_a_no_op():
    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])
    assert x.as_strided_((5, 3), (3, 1)) is x and x.shape == (5, 3)
    with pytest.raises(NotImplementedError, match=r"as_strided_.*view / reshape"):
        x.as_strided_((3, 5), (5, 1))
    assert x.shape == (5, 3) and x.placements == (Shard(0),)


# ----------------------------------------------------------------------------- copied views
@distributed(world_size=4, timeout=60)
@pytest.mark.parametrize("write", ["mul_", "copy_", "view of view", "index_put"])
def test_write_into_a_view_that_had_to_copy_raises(write):
    """(5, 4) Shard(0) on 4 ranks holds rows 2, 2, 1, 0: view(-1) must move data, so its result
    is a copy. Plain torch would write through; we refuse instead of losing the write."""
    mesh = init_device_mesh("cpu", (4,))
    full = torch.arange(20.).reshape(5, 4)
    x = distribute_tensor(full, mesh, [Shard(0)])
    y = x.view(-1)
    torch.testing.assert_close(y.full_tensor(), full.view(-1))  # reading is fine
    with pytest.raises(RuntimeError, match="had to be redistributed"):
        if write == "mul_":
            y.mul_(2)
        elif write == "copy_":
            y.copy_(distribute_tensor(torch.zeros(20), mesh, [Shard(0)]))
        elif write == "view of view":
            y[3:7].zero_()
        else:
            y[0] = 1.0
    assert torch.equal(x.full_tensor(), full)
    z = y.clone()                 # a separate tensor is meant: fine
    z.mul_(2)
    torch.testing.assert_close(z.full_tensor(), full.view(-1) * 2)


@distributed(world_size=4, timeout=60)
def test_write_into_a_view_that_aliases_reaches_the_original():
    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(24.).reshape(4, 6)
    x = distribute_tensor(full, mesh, [Shard(0), Replicate()])
    expected = full.clone()
    x.view(2, 2, 6)[:, 1].mul_(10)    # keeps Shard(0): every piece is a real view
    expected.view(2, 2, 6)[:, 1].mul_(10)
    torch.testing.assert_close(x.full_tensor(), expected)


@distributed(world_size=4, timeout=60)
def test_gradients_through_copied_views_accumulate():
    """Autograd's own writes (gradient accumulation into .grad) are not user writes into a view:
    two backwards through a view that had to copy must sum, as in plain torch."""
    mesh = init_device_mesh("cpu", (4,))
    full = torch.arange(20.).reshape(5, 4)
    w = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
    w_ref = full.clone().requires_grad_()
    c = torch.linspace(-1, 1, 20)
    for _ in range(2):
        (w.view(-1) * distribute_tensor(c, mesh, [Shard(0)])).sum().backward()
        (w_ref.view(-1) * c).sum().backward()
    torch.testing.assert_close(w.grad.full_tensor(), w_ref.grad)
    opt = torch.optim.SGD([w], lr=0.1)
    opt.step()                     # in-place updates of the parameter and friends
    torch.testing.assert_close(w.full_tensor(), full - 0.1 * w_ref.grad)
