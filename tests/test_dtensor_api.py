"""The public DTensor API against plain single-process torch: distribute_tensor, from_local,
to_local, full_tensor, the factories, distribute_module, pickling, and clear errors.

Oracles: a Shard/Replicate piece must equal the nested ``torch.chunk`` of the global tensor (in
mesh-dim order, trailing ranks possibly empty); any placement, Partial included, must
*reconstruct* to the global tensor when the per-rank pieces are concatenated / reduced mesh dim
by mesh dim (``_reconstruct``, computed in the driver from every rank's piece).
"""

import copy
import io
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.distributed as dist
import torch.nn as nn

import dtensor_lite as dl
from dtensor_lite import (DTensor, DeviceMesh, Partial, Replicate, Shard, _StridedShard,
                          distribute_module, distribute_tensor, init_device_mesh)
from tests.harness import distributed, run_distributed

# ----------------------------------------------------------------------------- oracles


def _chunk(t: torch.Tensor, n: int, dim: int, index: int) -> torch.Tensor:
    """torch.chunk's piece ``index`` of ``n``, or an empty piece when chunk returns fewer."""
    pieces = t.chunk(n, dim)
    if index < len(pieces):
        return pieces[index]
    return t.narrow(dim, t.shape[dim], 0)


def _expected_piece(x, mesh_shape, coord, placements):
    """What the rank at ``coord`` holds: nested torch.chunk, mesh dims left to right."""
    t = x
    for n, c, p in zip(mesh_shape, coord, placements):
        if isinstance(p, Shard):
            t = _chunk(t, n, p.dim % x.ndim, c)
    return t


_REDUCE = {"sum": lambda ts: torch.stack(ts).sum(0), "avg": lambda ts: torch.stack(ts).mean(0),
           "max": lambda ts: torch.stack(ts).amax(0), "min": lambda ts: torch.stack(ts).amin(0)}


def _reconstruct(grid, placements, ndim):
    """Global tensor from a nested list of per-rank pieces (one nesting level per mesh dim)."""
    if not placements:
        return grid
    p, rest = placements[0], placements[1:]
    subs = [_reconstruct(g, rest, ndim) for g in grid]
    if isinstance(p, Shard):
        return torch.cat(subs, dim=p.dim % ndim)
    if isinstance(p, Replicate):
        for s in subs[1:]:
            torch.testing.assert_close(s, subs[0], rtol=0, atol=0)
        return subs[0]
    return _REDUCE[p.reduce_op](subs)


def _grid(values, mesh_shape):
    """Per-rank values (rank order) as a nested list shaped like a rank-ordered mesh."""
    if len(mesh_shape) == 1:
        return list(values)
    step = len(values) // mesh_shape[0]
    return [_grid(values[k * step:(k + 1) * step], mesh_shape[1:]) for k in range(mesh_shape[0])]


def _coord(rank, mesh_shape):
    coord = []
    for n in reversed(mesh_shape):
        coord.append(rank % n)
        rank //= n
    return list(reversed(coord))


def _global(shape, dtype=torch.float32):
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=dtype).reshape(shape) * 0.5 - 3


# ----------------------------------------------------------------------------- distribute_tensor


def _distribute_body(mesh_shape, shape, placements, src_data_rank=0):
    mesh = init_device_mesh("cpu", mesh_shape)
    x = _global(shape)
    d = distribute_tensor(x, mesh, placements, src_data_rank=src_data_rank)
    assert isinstance(d, DTensor)
    assert d.shape == x.shape and d.dtype == x.dtype and d.stride() == x.stride()
    assert d.device_mesh is mesh
    torch.testing.assert_close(d.full_tensor(), x, rtol=0, atol=0)
    return d.to_local()


SHAPES = [(8, 6), (5, 3), (1, 5), (4, 1)]  # even, uneven, empty shards on dim 0 / dim 1
PLACEMENTS_1D = [Shard(0), Shard(1), Shard(-1), Shard(-2), Replicate(), Partial("sum"),
                 Partial("avg"), Partial("max"), Partial("min")]


def _check_pieces(locals_, mesh_shape, shape, placements):
    x = _global(shape)
    if not any(isinstance(p, Partial) for p in placements):
        for rank, local in enumerate(locals_):
            expected = _expected_piece(x, mesh_shape, _coord(rank, mesh_shape), placements)
            assert local.shape == expected.shape, (rank, local.shape, expected.shape)
            torch.testing.assert_close(local, expected, rtol=0, atol=0)
    rebuilt = _reconstruct(_grid(locals_, mesh_shape), list(placements), len(shape))
    torch.testing.assert_close(rebuilt, x)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("placement", PLACEMENTS_1D, ids=str)
def test_distribute_tensor_1d(placement, shape):
    locals_ = run_distributed(4, _distribute_body, (4,), shape, [placement])
    _check_pieces(locals_, (4,), shape, [placement])


def _compatible(placements) -> bool:
    """max/min Partials cannot be mixed with other reductions (see test_placement_errors)."""
    ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
    return len(ops) <= 1 or ops <= {"sum", "avg"}


PAIRS_2D = [(a, b) for a in (Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("max"))
            for b in (Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("avg"))
            if _compatible((a, b))]


@pytest.mark.parametrize("shape", [(8, 6), (5, 3)])  # more shapes: the hypothesis test below
@pytest.mark.parametrize("placements", PAIRS_2D, ids=lambda ps: "-".join(map(str, ps)))
def test_distribute_tensor_2d(placements, shape):
    locals_ = run_distributed(4, _distribute_body, (2, 2), shape, list(placements))
    _check_pieces(locals_, (2, 2), shape, placements)


def _strided_body(shape):
    mesh = init_device_mesh("cpu", (2, 2))
    x = _global(shape)
    # mesh dim 1 splits dim 0 first (outer), mesh dim 0 then splits each half (inner)
    d = distribute_tensor(x, mesh, [_StridedShard(0, split_factor=2), Shard(0)])
    assert d.placements == (_StridedShard(0, split_factor=2), Shard(0))
    torch.testing.assert_close(d.full_tensor(), x)
    a, b = mesh.get_coordinate()
    torch.testing.assert_close(d.to_local(), _chunk(_chunk(x, 2, 0, b), 2, 0, a))
    # to the default (left-to-right) order and back
    e = d.redistribute(mesh, [Shard(0), Shard(0)])
    torch.testing.assert_close(e.to_local(), _chunk(_chunk(x, 2, 0, a), 2, 0, b))
    back = e.redistribute(mesh, [_StridedShard(0, split_factor=2), Shard(0)])
    torch.testing.assert_close(back.to_local(), d.to_local())
    return d.to_local()


@pytest.mark.parametrize("shape", [(8, 3), (5, 2), (3, 4)], ids=str)
def test_strided_shard_is_the_reverse_order(shape):
    locals_ = run_distributed(4, _strided_body, shape)
    x = _global(shape)
    # rank order (0, 1, 2, 3) = coordinates (0,0), (0,1), (1,0), (1,1): outer chunk by mesh dim 1
    assert torch.equal(torch.cat([locals_[0], locals_[2], locals_[1], locals_[3]]), x)


def test_uneven_local_shapes():
    locals_ = run_distributed(4, _distribute_body, (4,), (5, 3), [Shard(0)])
    assert [tuple(t.shape) for t in locals_] == [(2, 3), (2, 3), (1, 3), (0, 3)]
    locals_ = run_distributed(4, _distribute_body, (4,), (2, 6), [Shard(0)])
    assert [t.shape[0] for t in locals_] == [1, 1, 0, 0]
    locals_ = run_distributed(4, _distribute_body, (2, 2), (5, 3), [Shard(0), Shard(0)])
    assert [t.shape[0] for t in locals_] == [2, 1, 1, 1]  # chunk(5,2) = 3|2, then 2|1 and 1|1
    locals_ = run_distributed(4, _distribute_body, (2, 2), (5, 3), [Shard(0), Shard(1)])
    assert [tuple(t.shape) for t in locals_] == [(3, 2), (3, 1), (2, 2), (2, 1)]


def test_distribute_tensor_world_2_and_src_none():
    for shape in [(3, 4), (1, 1)]:
        locals_ = run_distributed(2, _distribute_body, (2,), shape, [Shard(0)], None)
        _check_pieces(locals_, (2,), shape, [Shard(0)])


@distributed(world_size=4)
def test_distribute_tensor_normalizes_placements_and_keeps_dtype():
    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.arange(24, dtype=torch.int32).reshape(2, 3, 4)
    d = distribute_tensor(x, mesh, [Shard(-1), Shard(-3)])
    assert d.placements == (Shard(2), Shard(0))
    assert d.dtype == torch.int32 and d.to_local().dtype == torch.int32
    assert torch.equal(d.full_tensor(), x)
    r = distribute_tensor(x, mesh)  # placements default to Replicate everywhere
    assert r.placements == (Replicate(), Replicate())
    assert torch.equal(r.to_local(), x)
    b = distribute_tensor(x > 5, mesh, [Shard(1), Replicate()])
    assert b.dtype == torch.bool and torch.equal(b.full_tensor(), x > 5)


def _src_data_rank_body(placements, src):
    """Every rank passes *different* data: who wins depends on src_data_rank."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    mine = torch.arange(12.0).reshape(6, 2) + 100 * rank
    d = distribute_tensor(mine, mesh, placements, src_data_rank=src)
    return d.to_local(), d.full_tensor()


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate(), Partial("sum"),
                                       Partial("max")], ids=str)
def test_src_data_rank_0_vs_none(placement):
    data = [torch.arange(12.0).reshape(6, 2) + 100 * r for r in range(4)]
    # src_data_rank=0: rank 0's values win everywhere
    results = run_distributed(4, _src_data_rank_body, [placement], 0)
    for rank, (local, full) in enumerate(results):
        torch.testing.assert_close(full, data[0])
        if not isinstance(placement, Partial):
            torch.testing.assert_close(local, _expected_piece(data[0], (4,), [rank], [placement]))
    # src_data_rank=None: no communication, every rank slices its own data
    results = run_distributed(4, _src_data_rank_body, [placement], None)
    for rank, (local, _) in enumerate(results):
        if not isinstance(placement, Partial):
            own = _expected_piece(data[rank], (4,), [rank], [placement])
            torch.testing.assert_close(local, own)
    if placement == Partial("max"):  # each rank keeps its own partial value
        torch.testing.assert_close(results[0][1], data[3])


@distributed(world_size=4)
def test_src_data_rank_is_a_rank_within_the_mesh():
    """As in PyTorch, src_data_rank counts within each mesh dim: on a sub-mesh or a non-sorted
    mesh the default 0 is the mesh's first rank, not global rank 0."""
    rank = dist.get_rank()
    mine = torch.arange(8.0).reshape(4, 2) + 100 * rank
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]  # ranks {0, 1} or {2, 3}
    first = tp.mesh.tolist()[0]
    d = distribute_tensor(mine, tp, [Shard(0)])
    torch.testing.assert_close(d.full_tensor(), torch.arange(8.0).reshape(4, 2) + 100 * first)
    r = distribute_tensor(mine, tp, [Replicate()])
    torch.testing.assert_close(r.to_local(), torch.arange(8.0).reshape(4, 2) + 100 * first)

    odd = DeviceMesh("cpu", [[3, 1], [2, 0]])
    d = distribute_tensor(mine, odd, [Shard(0), Shard(1)])  # source: coordinate (0, 0) = rank 3
    torch.testing.assert_close(d.full_tensor(), torch.arange(8.0).reshape(4, 2) + 300)
    d = distribute_tensor(mine, mesh, [Replicate(), Shard(0)], src_data_rank=1)  # (1, 1) = rank 3
    torch.testing.assert_close(d.full_tensor(), torch.arange(8.0).reshape(4, 2) + 300)
    with pytest.raises(ValueError, match="src_data_rank=2"):
        distribute_tensor(mine, mesh, [Shard(0), Replicate()], src_data_rank=2)


_PLACEMENT_CHOICES = [Shard(0), Shard(1), Shard(-1), Replicate(), Partial("sum"), Partial("avg"),
                      Partial("max"), Partial("min")]


def _property_body(shape, placements):
    mesh = init_device_mesh("cpu", (2, 2))
    x = _global(shape)
    d = distribute_tensor(x, mesh, placements)
    torch.testing.assert_close(d.full_tensor(), x)
    local = d.to_local()
    # from_local(run_check=True) must rebuild the same global tensor from the pieces alone
    if not any(isinstance(p, Partial) for p in placements):
        again = DTensor.from_local(local, mesh, placements, run_check=True)
        assert again.shape == x.shape
        torch.testing.assert_close(again.full_tensor(), x)
    return local


@settings(max_examples=25, deadline=None)
@given(shape=st.tuples(st.integers(0, 7), st.integers(0, 6)),
       placements=st.lists(st.sampled_from(_PLACEMENT_CHOICES), min_size=2, max_size=2)
       .filter(_compatible))
def test_distribute_tensor_property(shape, placements):
    """Any shape (empty dims included) and any pair of placements on a 2x2 mesh."""
    locals_ = run_distributed(4, _property_body, shape, placements)
    _check_pieces(locals_, (2, 2), shape, placements)


# ------------------------------------------------------------------------ from_local / to_local


@distributed(world_size=4)
def test_from_local_even():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    x = _global((8, 3))
    d = DTensor.from_local(x.chunk(4)[rank], mesh, [Shard(0)])
    assert d.shape == (8, 3) and d.placements == (Shard(0),)
    torch.testing.assert_close(d.full_tensor(), x)
    torch.testing.assert_close(d.to_local(), x.chunk(4)[rank])

    r = DTensor.from_local(x, mesh, [Replicate()])
    assert r.shape == x.shape
    torch.testing.assert_close(r.full_tensor(), x)

    parts = [torch.randn(8, 3) for _ in range(4)]  # same seed on every rank: same list
    p = DTensor.from_local(parts[rank], mesh, [Partial()])
    torch.testing.assert_close(p.full_tensor(), sum(parts))
    pm = DTensor.from_local(parts[rank], mesh, [Partial("max")])
    torch.testing.assert_close(pm.full_tensor(), torch.stack(parts).amax(0))

    mesh2 = init_device_mesh("cpu", (2, 2))
    dp, tp = divmod(rank, 2)
    y = _global((4, 6))
    d2 = DTensor.from_local(y.chunk(2, 0)[dp].chunk(2, 1)[tp], mesh2, [Shard(0), Shard(1)])
    assert d2.shape == (4, 6)
    torch.testing.assert_close(d2.full_tensor(), y)
    z = _global((3, 8))  # 8 columns: 4 | 4, then 2 | 2 -- even at both levels
    d3 = DTensor.from_local(z.chunk(2, 1)[dp].chunk(2, 1)[tp], mesh2, [Shard(1), Shard(1)])
    assert d3.shape == (3, 8)
    torch.testing.assert_close(d3.full_tensor(), z)


@distributed(world_size=4)
def test_from_local_uneven_with_shape_and_run_check():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    x = _global((5, 3))
    local = _chunk(x, 4, 0, rank)  # 2, 2, 1, 0 rows
    d = DTensor.from_local(local, mesh, [Shard(0)], shape=(5, 3))
    assert d.shape == (5, 3) and d.stride() == (3, 1)
    torch.testing.assert_close(d.full_tensor(), x)

    d = DTensor.from_local(local, mesh, [Shard(0)], shape=(5, 3), stride=(3, 1))
    torch.testing.assert_close(d.full_tensor(), x)

    c = DTensor.from_local(local, mesh, [Shard(0)], run_check=True)
    assert c.shape == (5, 3)
    torch.testing.assert_close(c.full_tensor(), x)

    c = DTensor.from_local(local, mesh, [Shard(0)], run_check=True, shape=(5, 3))
    torch.testing.assert_close(c.full_tensor(), x)

    mesh2 = init_device_mesh("cpu", (2, 2))
    coord = mesh2.get_coordinate()
    piece = _expected_piece(x, (2, 2), coord, [Shard(0), Shard(0)])  # 2, 1, 1, 1 rows
    c2 = DTensor.from_local(piece, mesh2, [Shard(0), Shard(0)], run_check=True)
    assert c2.shape == (5, 3)
    torch.testing.assert_close(c2.full_tensor(), x)
    piece = _expected_piece(x, (2, 2), coord, [Shard(1), Shard(0)])
    c3 = DTensor.from_local(piece, mesh2, [Shard(1), Shard(0)], run_check=True)
    assert c3.shape == (5, 3)
    torch.testing.assert_close(c3.full_tensor(), x)


@distributed(world_size=4)
def test_from_local_errors():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    with pytest.raises(ValueError, match=r"does not match global shape \(8, 3\)"):
        DTensor.from_local(torch.ones(3, 3), mesh, [Shard(0)], shape=(8, 3))
    with pytest.raises(ValueError, match="one placement per mesh dimension"):
        DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0), Replicate()])
    with pytest.raises(ValueError, match="out of range"):
        DTensor.from_local(torch.ones(2, 3), mesh, [Shard(2)])
    with pytest.raises(TypeError, match="plain local torch.Tensor"):
        DTensor.from_local(distribute_tensor(torch.ones(4), mesh, [Shard(0)]), mesh, [Shard(0)])
    # run_check: the pieces add up to 5 rows, not 6
    local = _chunk(_global((5, 3)), 4, 0, rank)
    with pytest.raises(ValueError, match=r"shape=\(6, 3\) but the ranks' pieces add up to \(5, 3"):
        DTensor.from_local(local, mesh, [Shard(0)], run_check=True, shape=(6, 3))
    # run_check: replicas that differ between ranks are not an error: as torch's, rank 0's
    # piece is broadcast (test_torch_test_files.py checks the values)
    replicas = DTensor.from_local(torch.full((2,), float(rank == 2)), mesh, [Replicate()],
                                  run_check=True)
    assert torch.equal(replicas.to_local(), torch.zeros(2))
    # run_check: pieces that are not torch.chunk's layout (1, 2, 2, 0 rows instead of 2, 2, 1, 0)
    with pytest.raises(ValueError, match="do not form one global tensor"):
        DTensor.from_local(torch.ones([1, 2, 2, 0][rank], 3), mesh, [Shard(0)], run_check=True)
    # run_check: pieces that disagree on a dim they do not split
    with pytest.raises(ValueError, match="do not form one global tensor"):
        DTensor.from_local(torch.ones(2, 3 + (rank == 1)), mesh, [Shard(0)], run_check=True)
    # the group still works after all those errors
    torch.testing.assert_close(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]).full_tensor(),
                               torch.ones(4, 2))


@distributed(world_size=4)
def test_from_local_grad_placements_partial_skips_the_all_reduce():
    """Oracle: plain torch, f(X) = sum_r (X * w_r).sum(), so X.grad = sum_r w_r. By default
    from_local's Replicate input gets that gradient on every rank (one all_reduce);
    grad_placements=[Partial()] leaves each rank its own term w_r (no collective), and the
    terms add up to torch's gradient. Integer-valued w_r: every sum is exact."""
    from dtensor_lite.debug import CommDebugMode
    mesh = init_device_mesh("cpu", (4,))
    r = mesh.get_local_rank()
    x0 = torch.randn(5, 3)  # same seed on every rank: a valid replica
    ws = torch.randint(-8, 9, (4, 5, 3), generator=torch.Generator().manual_seed(1)).float()
    oracle = x0.clone().requires_grad_()
    sum((oracle * w).sum() for w in ws).backward()
    for grad_placements, counts in ((None, {"all_reduce": 1}), ([Partial()], {})):
        x = x0.clone().requires_grad_()
        dt = DTensor.from_local(x, mesh, [Replicate()], grad_placements=grad_placements)
        loss = (dt.to_local(grad_placements=[Partial()]) * ws[r]).sum()
        with CommDebugMode() as comm:
            loss.backward()
        assert comm.get_comm_counts() == counts, grad_placements
        if grad_placements is None:
            assert torch.equal(x.grad, oracle.grad)
        else:
            assert torch.equal(x.grad, ws[r])
            total = x.grad.clone()
            dist.all_reduce(total)
            assert torch.equal(total, oracle.grad)


@distributed(world_size=4)
def test_from_local_grad_placements_on_a_2d_mesh():
    """A (2, 2) mesh, [Shard(0), Replicate()] pieces. Oracle: d/dX sum(X * W) = W. With
    grad_placements=[Shard(0), Partial()] the two ranks of a mesh-dim-1 row hold terms adding up
    to W's row chunk; with the default each holds the chunk itself."""
    mesh = init_device_mesh("cpu", (2, 2))
    c0, c1 = mesh.get_coordinate()
    xg = torch.randn(6, 4)
    wg = torch.randint(-8, 9, (6, 4), generator=torch.Generator().manual_seed(2)).float()
    w = distribute_tensor(wg, mesh, [Shard(0), Shard(1)])
    for grad_placements in (None, [Shard(0), Partial()]):
        x = xg.chunk(2)[c0].clone().requires_grad_()
        dt = DTensor.from_local(x, mesh, [Shard(0), Replicate()],
                                grad_placements=grad_placements)
        assert torch.equal(dt.full_tensor(), xg)
        (dt * w).sum().backward()
        total = x.grad.clone()
        if grad_placements is not None:
            dist.all_reduce(total, group=mesh.get_group(1))
        assert torch.equal(total, wg.chunk(2)[c0]), grad_placements
    # a gradient laid out as grad_placements must fit the local tensor, on every rank
    piece = xg.chunk(2)[c0]
    with pytest.raises(ValueError, match=r"grad_placements \[Replicate\(\), Replicate\(\)\] give "
                                         r"the rank at mesh coordinate \[0, 0\] a gradient of "
                                         r"shape \(6, 4\).*has shape \(3, 4\)"):
        DTensor.from_local(piece, mesh, [Shard(0), Replicate()],
                           grad_placements=[Replicate(), Replicate()])
    with pytest.raises(ValueError, match="one placement per mesh dimension"):
        DTensor.from_local(piece, mesh, [Shard(0), Replicate()], grad_placements=[Shard(0)])
    with pytest.raises(ValueError, match="Partial max/min"):
        DTensor.from_local(piece, mesh, [Shard(0), Partial("max")],
                           grad_placements=[Shard(0), Partial()])


@distributed(world_size=4)
def test_from_local_run_check_same_replicas_passes():
    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.randn(4, 4)  # same seed on every rank
    d = DTensor.from_local(x.chunk(2)[mesh.get_local_rank(0)], mesh, [Shard(0), Replicate()],
                           run_check=True)
    torch.testing.assert_close(d.full_tensor(), x)


@distributed(world_size=4)
def test_to_local_and_full_tensor():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    x = _global((6, 5))
    d = distribute_tensor(x, mesh, [Shard(1)])
    local = d.to_local()
    assert type(local) is torch.Tensor
    torch.testing.assert_close(local, _chunk(x, 4, 1, rank))
    with torch.no_grad():
        assert d.to_local() is d._local_tensor
    full = d.full_tensor()
    assert type(full) is torch.Tensor
    torch.testing.assert_close(full, x)
    # full_tensor does not change the DTensor itself
    assert d.placements == (Shard(1),)
    torch.testing.assert_close(d.to_local(), _chunk(x, 4, 1, rank))
    # the wrapper reports the global metadata
    assert d.shape == (6, 5) and d.ndim == 2 and d.numel() == 30 and d.size(1) == 5


@distributed(world_size=2)
def test_default_mesh_when_none_is_given():
    rank = dist.get_rank()
    x = _global((5, 3))
    d = distribute_tensor(x, placements=[Shard(0)])
    assert d.device_mesh.shape == (2,) and d.device_mesh.mesh.tolist() == [0, 1]
    torch.testing.assert_close(d.to_local(), x.chunk(2)[rank])
    r = distribute_tensor(x)
    assert r.placements == (Replicate(),)
    f = DTensor.from_local(x.chunk(2)[rank], placements=[Shard(0)], shape=(5, 3))
    torch.testing.assert_close(f.full_tensor(), x)
    z = dl.zeros(4, 2, placements=[Shard(1)])
    assert z.device_mesh is d.device_mesh and z.to_local().shape == (4, 1)


# ----------------------------------------------------------------------------- factories


@pytest.mark.parametrize("mesh_shape,placements,shape", [
    ((4,), [Shard(0)], (5, 3)),
    ((4,), [Shard(1)], (2, 7)),
    ((4,), [Replicate()], (3, 2)),
    ((2, 2), [Shard(0), Shard(1)], (5, 3)),
    ((2, 2), [Shard(1), Shard(1)], (2, 9)),
    ((2, 2), [Replicate(), Shard(0)], (3, 4)),
], ids=str)
def test_factories_values_and_local_shapes(mesh_shape, placements, shape):
    run_distributed(4, _factories_body, mesh_shape, placements, shape)


def _factories_body(mesh_shape, placements, shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    want = tuple(_expected_piece(torch.empty(shape), mesh_shape, coord, placements).shape)
    cases = [
        (dl.zeros(*shape, device_mesh=mesh, placements=placements), torch.zeros(shape)),
        (dl.ones(shape, device_mesh=mesh, placements=placements), torch.ones(shape)),
        (dl.full(shape, 2.5, device_mesh=mesh, placements=placements), torch.full(shape, 2.5)),
        (dl.full(shape, 7, device_mesh=mesh, placements=placements), torch.full(shape, 7)),
        (dl.ones(*shape, dtype=torch.float64, device_mesh=mesh, placements=placements),
         torch.ones(shape, dtype=torch.float64)),
    ]
    for d, ref in cases:
        assert isinstance(d, DTensor)
        assert d.shape == ref.shape and d.dtype == ref.dtype
        assert d.placements == tuple(placements)
        assert tuple(d.to_local().shape) == want
        torch.testing.assert_close(d.full_tensor(), ref, rtol=0, atol=0)
    e = dl.empty(*shape, device_mesh=mesh, placements=placements)
    assert e.shape == shape and tuple(e.to_local().shape) == want
    g = dl.zeros(*shape, requires_grad=True, device_mesh=mesh, placements=placements)
    assert g.requires_grad and g.is_leaf

    for factory, ref_fn in ((dl.rand, torch.rand), (dl.randn, torch.randn)):
        torch.manual_seed(1234)
        d = factory(*shape, device_mesh=mesh, placements=placements)
        after = torch.rand(3)  # the generator must be where the plain call leaves it
        torch.manual_seed(1234)
        ref = ref_fn(shape)
        ref_after = torch.rand(3)
        assert tuple(d.to_local().shape) == want
        piece = _expected_piece(ref, mesh_shape, coord, placements)
        torch.testing.assert_close(d.to_local(), piece, rtol=0, atol=0)
        torch.testing.assert_close(d.full_tensor(), ref, rtol=0, atol=0)
        torch.testing.assert_close(after, ref_after, rtol=0, atol=0)


@distributed(world_size=4)
@pytest.mark.parametrize("reduce_op", ["sum", "avg", "max", "min"])
def test_factories_with_partial(reduce_op):
    mesh = init_device_mesh("cpu", (2, 2))
    for placements in ([Partial(reduce_op), Replicate()], [Shard(0), Partial(reduce_op)],
                       [Partial(reduce_op), Partial(reduce_op)]):
        o = dl.ones(5, 3, device_mesh=mesh, placements=placements)
        assert o.placements == tuple(placements)
        torch.testing.assert_close(o.full_tensor(), torch.ones(5, 3), rtol=0, atol=0)
        f = dl.full((5, 3), 3.0, device_mesh=mesh, placements=placements)
        torch.testing.assert_close(f.full_tensor(), torch.full((5, 3), 3.0), rtol=0, atol=0)
        z = dl.zeros(5, 3, device_mesh=mesh, placements=placements)
        torch.testing.assert_close(z.full_tensor(), torch.zeros(5, 3), rtol=0, atol=0)
        torch.manual_seed(7)
        r = dl.randn(5, 3, device_mesh=mesh, placements=placements)
        torch.manual_seed(7)
        torch.testing.assert_close(r.full_tensor(), torch.randn(5, 3))


# ----------------------------------------------------------------------------- distribute_module


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def _replicate_inputs(mod, inputs, mesh):
    return tuple(distribute_tensor(t, mesh, [Replicate()]) for t in inputs)


@distributed(world_size=4)
def test_distribute_module_default_replicates():
    mesh = init_device_mesh("cpu", (4,))
    model = _Net()
    ref = copy.deepcopy(model)
    seen = []

    def output_fn(mod, outputs, mesh_):
        seen.append(outputs.placements)
        return outputs.to_local()

    out_model = distribute_module(model, mesh, input_fn=_replicate_inputs, output_fn=output_fn)
    assert out_model is model
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), name
        assert p.placements == (Replicate(),) and p.requires_grad
        torch.testing.assert_close(p.to_local(), dict(ref.named_parameters())[name].detach())
    assert isinstance(model.scale, DTensor) and model.scale.placements == (Replicate(),)

    x = torch.randn(5, 4)
    out = model(x)
    assert type(out) is torch.Tensor  # output_fn's return value replaces the output
    assert seen == [(Replicate(),)]
    torch.testing.assert_close(out, ref(x))

    with pytest.raises(RuntimeError, match="already applied"):
        distribute_module(model, mesh)


@distributed(world_size=4)
def test_distribute_module_partition_fn_shards_linear():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    model = _Net()
    ref = copy.deepcopy(model)
    calls = []

    def partition_fn(name, mod, mesh_):
        calls.append(name)
        if name == "fc1":  # column-wise: 6 output features over 4 ranks -> 2, 2, 2, 0
            mod.weight = nn.Parameter(distribute_tensor(mod.weight, mesh_, [Shard(0)]))
            mod.bias = nn.Parameter(distribute_tensor(mod.bias, mesh_, [Shard(0)]))
        elif name == "fc2":  # row-wise: bias is left to be replicated
            mod.weight = nn.Parameter(distribute_tensor(mod.weight, mesh_, [Shard(1)]))

    def output_fn(mod, outputs, mesh_):
        return outputs.full_tensor()

    distribute_module(model, mesh, partition_fn, input_fn=_replicate_inputs, output_fn=output_fn)
    assert calls == ["", "fc1", "fc2"]
    assert model.fc1.weight.placements == (Shard(0),)
    assert tuple(model.fc1.weight.to_local().shape) == [(2, 4), (2, 4), (2, 4), (0, 4)][rank]
    assert model.fc2.weight.placements == (Shard(1),)
    assert tuple(model.fc2.weight.to_local().shape) == [(3, 2), (3, 2), (3, 2), (3, 0)][rank]
    assert model.fc2.bias.placements == (Replicate(),)
    torch.testing.assert_close(model.fc1.weight.full_tensor(), ref.fc1.weight.detach())

    x = torch.randn(5, 4)
    out = model(x)
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    ref(x).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), dict(ref.named_parameters())[name].grad,
                                   msg=name)


@distributed(world_size=2)
def test_distribute_module_input_fn_can_shard_inputs():
    """input_fn's return replaces the inputs: a batch-sharded input through replicated params."""
    mesh = init_device_mesh("cpu", (2,))
    model = nn.Linear(3, 2)
    ref = copy.deepcopy(model)

    def input_fn(mod, inputs, mesh_):
        return (distribute_tensor(inputs[0], mesh_, [Shard(0)]),)

    def output_fn(mod, outputs, mesh_):
        assert outputs.placements == (Shard(0),)
        return outputs.full_tensor()

    distribute_module(model, mesh, input_fn=input_fn, output_fn=output_fn)
    x = torch.randn(5, 3)
    torch.testing.assert_close(model(x), ref(x))


# ----------------------------------------------------------------------------- pickling, repr


@distributed(world_size=4)
def test_pickle_deepcopy_and_save_keep_values():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = _global((5, 4))
    d = distribute_tensor(x, mesh, [Shard(0), Shard(1)])

    for clone in (pickle.loads(pickle.dumps(d)), copy.deepcopy(d)):
        assert isinstance(clone, DTensor)
        assert clone.placements == d.placements and clone.shape == d.shape
        assert clone.device_mesh == mesh
        torch.testing.assert_close(clone.to_local(), d.to_local())
        torch.testing.assert_close(clone.full_tensor(), x)

    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded.full_tensor(), x)

    # deepcopy owns its data and keeps requires_grad
    g = distribute_tensor(x.clone().requires_grad_(), mesh, [Replicate(), Shard(0)])
    gc = copy.deepcopy(g)
    assert gc.requires_grad and gc.is_leaf
    with torch.no_grad():
        gc.to_local().add_(1)
    torch.testing.assert_close(g.full_tensor(), x)
    torch.testing.assert_close(gc.full_tensor(), x + 1)

    # a pickled mesh is usable
    m2 = pickle.loads(pickle.dumps(mesh["tp"]))
    assert m2 == mesh["tp"] and m2.get_group() is mesh["tp"].get_group()


@distributed(world_size=2)
def test_repr_shows_placements_and_mesh():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    d = distribute_tensor(torch.ones(4, 2), mesh, [Shard(1)])
    text = repr(d)
    assert "DTensor" in text and "Shard(dim=1)" in text and "tp" in text
    assert "Partial(sum)" in repr(distribute_tensor(torch.ones(4, 2), mesh, [Partial()]))


# ----------------------------------------------------------------------------- errors


@distributed(world_size=4)
def test_plain_tensor_mixed_with_dtensor_is_a_clear_error():
    """The error is a ValueError, not a TypeError: Tensor's binary operators turn a TypeError into
    NotImplemented, and `d + t` would then end as Python's bare "unsupported operand type(s)"."""
    mesh = init_device_mesh("cpu", (4,))
    d = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    plain = torch.ones(4, 4)
    hint = (r"mix of DTensor and plain torch.Tensor \(shape \(4, 4\)\)"
            r".*distribute_tensor.*from_local")
    with pytest.raises(ValueError, match=hint):
        d + plain
    with pytest.raises(ValueError, match=hint):
        plain * d
    with pytest.raises(ValueError, match=hint):
        torch.add(d, plain)
    with pytest.raises(ValueError, match=hint):
        d @ plain
    with pytest.raises(ValueError, match=hint):
        torch.mm(plain, d)
    # Python scalars and 0-d tensors are unambiguous: treated as replicated
    torch.testing.assert_close((d + 2).full_tensor(), torch.full((4, 4), 3.0))
    torch.testing.assert_close((d * torch.tensor(3.0)).full_tensor(), torch.full((4, 4), 3.0))
    torch.testing.assert_close(torch.add(d, torch.tensor(1.0)).full_tensor(),
                               torch.full((4, 4), 2.0))
    torch.testing.assert_close((2 - d).full_tensor(), torch.full((4, 4), 1.0))


@distributed(world_size=4)
def test_placement_errors():
    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.ones(4, 4)
    with pytest.raises(ValueError, match="got 1 placements.*one placement per mesh dimension"):
        distribute_tensor(x, mesh, [Shard(0)])
    with pytest.raises(ValueError, match="got 3 placements"):
        distribute_tensor(x, mesh, [Shard(0), Replicate(), Replicate()])
    with pytest.raises(ValueError, match=r"Shard\(dim=2\) is out of range for a 2-D tensor"):
        distribute_tensor(x, mesh, [Shard(2), Replicate()])
    with pytest.raises(ValueError, match=r"Shard\(dim=-3\) is out of range"):
        distribute_tensor(x, mesh, [Replicate(), Shard(-3)])
    with pytest.raises(ValueError, match="out of range for a 0-D tensor"):
        distribute_tensor(torch.tensor(1.0), mesh, [Shard(0), Replicate()])
    with pytest.raises(ValueError, match=r"mix Partial reductions \['max', 'sum'\]"):
        distribute_tensor(x, mesh, [Partial("sum"), Partial("max")])
    with pytest.raises(ValueError, match="mix Partial reductions"):
        dl.ones(4, 4, device_mesh=mesh, placements=[Partial("min"), Partial("avg")])
    with pytest.raises(TypeError, match="Shard/Replicate/Partial"):
        distribute_tensor(x, mesh, [Shard(0), "replicate"])
    with pytest.raises(ValueError, match="reduce_op must be one of"):
        Partial("mean")
    with pytest.raises(ValueError, match="use .redistribute"):
        distribute_tensor(distribute_tensor(x, mesh, [Shard(0), Replicate()]), mesh,
                          [Replicate(), Replicate()])

    d = distribute_tensor(x, mesh, [Shard(0), Replicate()])
    with pytest.raises(ValueError, match="one placement per mesh dimension"):
        d.redistribute(mesh, [Replicate()])
    with pytest.raises(ValueError, match="mix Partial reductions"):
        d.redistribute(mesh, [Partial("sum"), Partial("max")])
    with pytest.raises(ValueError, match="out of range"):
        d.redistribute(mesh, [Shard(2), Replicate()])


@distributed(world_size=4)
def test_different_mesh_errors():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = init_device_mesh("cpu", (4,))
    d = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Replicate()])
    # redistribute onto another mesh works (tests/test_cross_mesh.py); ops across meshes raise
    assert torch.equal(d.redistribute(flat, [Replicate()]).to_local(), torch.ones(4, 4))
    other = distribute_tensor(torch.ones(4, 4), flat, [Shard(0)])
    with pytest.raises(ValueError, match="different meshes"):
        d + other
    # the failed calls left everything usable
    torch.testing.assert_close(d.full_tensor(), torch.ones(4, 4))


# ----------------------------------------------------------------------------- torch's module names
def test_torch_submodule_names_switch_by_import_line():
    """``torch.distributed.tensor.{placement_types,experimental,debug}`` names exist under
    ``dtensor_lite.`` (context_parallel excepted: see dtensor_lite/experimental.py)."""
    import torch.distributed.tensor.experimental as t_exp
    import torch.distributed.tensor.placement_types as t_pt

    from dtensor_lite import experimental, placement_types
    assert set(t_pt.__all__) <= set(placement_types.__all__)
    assert set(t_exp.__all__) - {"context_parallel"} <= set(experimental.__all__)
    assert placement_types.Shard is Shard and experimental.local_map is dl.local_map


@distributed(world_size=4)
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_implicit_replication_takes_plain_tensors_as_replicated(mesh_shape):
    from dtensor_lite.experimental import implicit_replication
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Shard(0)] + [Shard(1)] * (len(mesh_shape) - 1)
    x = torch.randn(7, 6)  # uneven rows over 4 (or 2) ranks
    scale, shift = torch.linspace(-1, 1, 6), torch.randn(7, 6)
    dx = distribute_tensor(x, mesh, placements).requires_grad_()
    with pytest.raises(ValueError, match="implicit_replication"):
        dx * scale
    with implicit_replication():
        out = dx * scale + shift
    assert isinstance(out, DTensor) and out.placements == tuple(placements)
    torch.testing.assert_close(out.full_tensor(), x * scale + shift)
    out.sum().backward()  # the DTensor's gradient, through the replicated plain tensors
    torch.testing.assert_close(dx.grad.full_tensor(), scale.expand(7, 6))
    with pytest.raises(ValueError, match="mix of DTensor and plain"):
        dx * scale  # the decision is cached, the mode is checked per call


def _visualized(shape, mesh_shape, placements):
    import contextlib
    import io

    from dtensor_lite.debug import visualize_sharding
    from dtensor_lite._visualize import sharding_blocks
    mesh = init_device_mesh("cpu", mesh_shape)
    dt = distribute_tensor(torch.zeros(shape), mesh, placements)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        visualize_sharding(dt, header="title")
    return out.getvalue(), sharding_blocks(dt)


def test_visualize_sharding_blocks_and_table():
    # 2-D: rows over mesh dim 0, columns over dim 1, uneven (5 rows, 3 columns over 2 x 2)
    outs = run_distributed(4, _visualized, (5, 3), (2, 2), [Shard(0), Shard(1)])
    text, blocks = outs[0]
    assert blocks == {((0, 3), (0, 2)): [0], ((0, 3), (2, 3)): [1], ((3, 5), (0, 2)): [2],
                      ((3, 5), (2, 3)): [3]}
    for cell in ("row 0-2", "row 3-4", "col 0-1", "col 2-2", "cpu:0", "cpu:3", "title"):
        assert cell in text
    assert all(o[0] == "" for o in outs[1:])        # printed once, by coordinate (0, 0)
    # replicated over a dim: both ranks of a cell listed; an empty trailing piece left out
    text, blocks = run_distributed(4, _visualized, (3,), (4,), [Shard(0)])[0]
    assert blocks == {((0, 1),): [0], ((1, 2),): [1], ((2, 3),): [2]}
    text, blocks = run_distributed(4, _visualized, (4, 2), (2, 2), [Replicate(), Shard(0)])[0]
    assert blocks == {((0, 2), (0, 2)): [0, 2], ((2, 4), (0, 2)): [1, 3]}
    assert "cpu:0, cpu:2" in text
    text, _ = run_distributed(4, _visualized, (4, 2), (4,), [Partial()])[0]
    assert "partial values: Partial(sum) on mesh dim 0" in text


def test_visualize_sharding_refuses_3d():
    with pytest.raises(Exception, match="1-D and 2-D"):
        run_distributed(2, _visualized, (2, 2, 2), (2,), [Shard(0)])
