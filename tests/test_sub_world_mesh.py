"""Meshes over part of the world (as torch allows): every rank builds them, ranks outside get no
coordinate, hold empty pieces and never block; DTensors, factories, redistribute, slicing,
flattening and a TP layer on a mesh of 2 and of 3 of 4 ranks. Ops across meshes: the norm
family of foreach ops and clip_grad_norm_ over parameters on different meshes."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import dtensor_lite
from dtensor_lite import (DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor,
                          init_device_mesh)
from tests.harness import distributed
from tp import ColwiseParallel, RowwiseParallel, parallelize_module


@distributed(world_size=4)
def test_sub_world_mesh_basics():
    rank = dist.get_rank()
    sub = DeviceMesh("cpu", [2, 3], mesh_dim_names=("tp",))
    inside = rank in (2, 3)
    assert (sub.get_coordinate() == [rank - 2]) if inside else sub.get_coordinate() is None
    assert sub.size() == 2 and sub.shape == (2,)
    if inside:
        assert sub.get_local_rank() == rank - 2
    else:
        with pytest.raises(RuntimeError, match="not part of"):
            sub.get_local_rank()
    first = init_device_mesh("cpu", (3,))  # torch's: ranks 0..2, rank 3 outside
    assert first.mesh.tolist() == [0, 1, 2]
    assert (first.get_coordinate() is None) == (rank == 3)
    # a 2-D mesh over 3 of... no: 2x1 over ranks 1, 3; slicing and flattening work on every rank
    m2 = DeviceMesh("cpu", [[1], [3]], mesh_dim_names=("a", "b"))
    a = m2["a"]
    assert a.shape == (2,)
    assert (a.get_coordinate() is None) == (rank not in (1, 3))
    flat = m2["a", "b"]._flatten("ab")
    assert flat.mesh.tolist() == [1, 3]
    x = torch.arange(6.0).reshape(3, 2)
    d = distribute_tensor(x, flat, [Shard(0)])
    if rank in (1, 3):
        assert torch.equal(d.full_tensor(), x)
    else:
        assert d.to_local().numel() == 0


@distributed(world_size=4)
@pytest.mark.parametrize("ranks", [[1, 2], [0, 1, 3]])
def test_dtensors_on_a_sub_world_mesh(ranks):
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", ranks)
    inside = rank in ranks
    torch.manual_seed(0)
    x = torch.randn(7, 4)
    d = distribute_tensor(x, mesh, [Shard(0)])
    z = dtensor_lite.zeros(5, 3, device_mesh=mesh, placements=[Shard(1)])
    r = dtensor_lite.randn(4, 4, device_mesh=mesh, placements=[Shard(0)])
    y = (d * 2 + 1).sum(dim=1)          # ops run on members only
    p = d.redistribute(mesh, [Replicate()])
    q = distribute_tensor(x, mesh, [Partial()]).redistribute(mesh, [Shard(1)])
    if inside:
        k = ranks.index(rank)
        assert torch.equal(d.to_local(), x.chunk(len(ranks))[k])
        assert torch.equal(z.to_local(), torch.zeros(5, 3).chunk(len(ranks), 1)[k]) or \
            z.to_local().numel() == 0
        assert r.to_local().shape[1] == 4
        torch.testing.assert_close(y.full_tensor(), (x * 2 + 1).sum(dim=1))
        assert torch.equal(p.to_local(), x)
        assert torch.equal(q.full_tensor(), x)
    else:  # outside: empty pieces, global metadata intact, nothing waited for
        for t in (d, z, r, y, p, q):
            assert t.to_local().numel() == 0
        assert y.shape == (7,) and p.placements == (Replicate(),) and q.placements == (Shard(1),)
        assert d.full_tensor().numel() == 0


@distributed(world_size=4)
@pytest.mark.parametrize("ranks", [[2, 3], [1, 2, 3]])
def test_tp_layer_on_a_sub_world_mesh(ranks):
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", ranks)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 5))
    model = nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 5))
    model.load_state_dict(ref.state_dict())
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(3, 6)
    out = model(x)
    if rank in ranks:
        torch.testing.assert_close(out, ref(x))
        out.sum().backward()
        ref(x).sum().backward()
        torch.testing.assert_close(model[0].weight.grad.full_tensor(), ref[0].weight.grad)
    else:
        assert model[0].weight.to_local().numel() == 0


# ----------------------------------------------------------------------------- across meshes
@distributed(world_size=4)
def test_foreach_norm_different_mesh_as_torch():
    """torch's test_foreach_norm_different_mesh: each norm lives on its own input's mesh."""
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    mesh_x, mesh_y = mesh_2d["x"], mesh_2d["y"]
    torch.manual_seed(0)
    grad0, grad1 = torch.randn(12, 8), torch.randn(8, 8)
    g0 = DTensor.from_local(grad0, mesh_x, [Replicate()])
    g1 = DTensor.from_local(grad1, mesh_y, [Replicate()])
    n0, n1 = torch.ops.aten._foreach_norm([g0, g1], 2)
    assert n0.device_mesh == mesh_x and n1.device_mesh == mesh_y
    torch.testing.assert_close(n0.full_tensor(), grad0.norm())
    torch.testing.assert_close(n1.full_tensor(), grad1.norm())
    # sharded, on two sub-world meshes (ranks outside one mesh get empty results from it)
    a, b = DeviceMesh("cpu", [0, 2]), DeviceMesh("cpu", [0, 1, 3])
    s0, s1 = distribute_tensor(grad0, a, [Shard(0)]), distribute_tensor(grad1, b, [Shard(1)])
    m0, m1 = torch._foreach_norm([s0, s1], 3)
    assert m0.device_mesh is a and m1.device_mesh is b
    if a.get_coordinate() is not None:
        torch.testing.assert_close(m0.to_local(), grad0.norm(3))
    if b.get_coordinate() is not None:
        torch.testing.assert_close(m1.to_local(), grad1.norm(3))
    # other ops across meshes keep their clear error
    with pytest.raises(ValueError, match="different meshes"):
        g0.sum() + g1.sum()


@distributed(world_size=4)
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_over_two_sub_meshes_equals_one_process(norm_type):
    torch.manual_seed(0)
    stage0, stage1 = nn.Linear(8, 6), nn.Linear(6, 4)
    ref0, ref1 = nn.Linear(8, 6), nn.Linear(6, 4)
    ref0.load_state_dict(stage0.state_dict())
    ref1.load_state_dict(stage1.state_dict())
    m0, m1 = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])
    parallelize_module(stage0, m0, ColwiseParallel())
    parallelize_module(stage1, m1, RowwiseParallel())
    x = torch.randn(5, 8)
    h = ref0(x)
    (ref1(h) ** 2).sum().backward()
    # each stage on its own mesh: the gradients of one process's backward, distributed
    for mod, ref in ((stage0, ref0), (stage1, ref1)):
        for p, rp in zip(mod.parameters(), ref.parameters()):
            p.grad = distribute_tensor(rp.grad, p.device_mesh, p.placements)
    params = list(stage0.parameters()) + list(stage1.parameters())
    total = dtensor_lite.clip_grad_norm_(params, max_norm=0.5, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(list(ref0.parameters()) + list(ref1.parameters()),
                                              max_norm=0.5, norm_type=norm_type)
    torch.testing.assert_close(total, expected)  # the same total on every rank
    for mod, ref in ((stage0, ref0), (stage1, ref1)):
        for p, rp in zip(mod.parameters(), ref.parameters()):
            if p.device_mesh.get_coordinate() is not None:
                torch.testing.assert_close(p.grad.full_tensor(), rp.grad)
            else:
                assert p.grad.to_local().numel() == 0
