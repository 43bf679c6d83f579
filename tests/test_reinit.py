"""destroy_process_group + init_process_group inside one process: new meshes work, old ones fail
with a clear RuntimeError (never a hang), and later tests still get a healthy group."""

import pytest
import torch
import torch.distributed as dist

from dtensor_lite import (DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor,
                          init_device_mesh)
from tests.harness import distributed, reinit_process_group, run_distributed

DEAD = "process group that has since been destroyed"


def _round_trip(mesh, x):
    """Scatter, reshard with every collective kind, gather: the values must survive."""
    d = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    torch.testing.assert_close(d.redistribute(mesh, [Replicate(), Shard(0)]).full_tensor(), x)
    torch.testing.assert_close(d.redistribute(mesh, [Shard(1), Shard(0)]).full_tensor(), x)
    p = distribute_tensor(x, mesh, [Partial(), Replicate()])
    torch.testing.assert_close(p.redistribute(mesh, [Shard(0), Replicate()]).full_tensor(), x)
    torch.testing.assert_close((d * 2).full_tensor(), 2 * x)
    return d


def _reinit_body():
    rank = dist.get_rank()
    x = torch.arange(35.0).reshape(7, 5)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    old = _round_trip(mesh, x)
    old_tp_group = mesh.get_group("tp")

    dist.destroy_process_group()
    reinit_process_group()

    # the old mesh, and DTensors on it, fail clearly *before* any new mesh exists ...
    with pytest.raises(RuntimeError, match=DEAD):
        old.redistribute(mesh, [Replicate(), Replicate()])
    with pytest.raises(RuntimeError, match=DEAD):
        old.full_tensor()
    with pytest.raises(RuntimeError, match=DEAD):
        mesh.get_group("tp")

    new = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert new is not mesh
    assert new.get_group("tp") is not old_tp_group
    d = _round_trip(new, x)
    assert d.device_mesh is new
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=new.get_group("tp"))
    assert t.item() == [1.0, 5.0][rank // 2]

    # ... and after it: equal-looking meshes must not let the old one borrow the new groups
    with pytest.raises(RuntimeError, match=DEAD):
        old.redistribute(mesh, [Replicate(), Shard(0)])
    with pytest.raises(RuntimeError, match=DEAD):
        old.full_tensor()
    with pytest.raises(RuntimeError, match=DEAD):
        mesh["tp"].get_group()
    with pytest.raises(RuntimeError, match=DEAD):
        mesh.get_all_groups()
    with pytest.raises(RuntimeError, match=DEAD):
        distribute_tensor(x, mesh, [Shard(0), Replicate()])
    with pytest.raises(RuntimeError, match=DEAD):
        DTensor.from_local(torch.ones(2), mesh, [Replicate(), Replicate()], run_check=True)

    # the new mesh is unaffected by those failures
    torch.testing.assert_close(d.full_tensor(), x)

    # a second cycle, with a differently shaped mesh this time
    dist.destroy_process_group()
    reinit_process_group()
    # calls without a device_mesh build their default mesh on the new group
    dflt = distribute_tensor(x, placements=[Shard(0)])
    torch.testing.assert_close(dflt.full_tensor(), x)
    flat = init_device_mesh("cpu", (dist.get_world_size(),))
    e = distribute_tensor(x, flat, [Shard(1)])
    torch.testing.assert_close(e.redistribute(flat, [Shard(0)]).full_tensor(), x)
    with pytest.raises(RuntimeError, match=DEAD):
        d.full_tensor()
    return e.to_local()


@pytest.mark.parametrize("world_size", [2, 4])
def test_destroy_and_reinit(world_size):
    if world_size == 2:  # a 2x2 mesh needs 4 ranks; on 2 run the same steps on a 1x2 mesh
        locals_ = run_distributed(2, _reinit_body_1x2)
    else:
        locals_ = run_distributed(4, _reinit_body)
    x = torch.arange(35.0).reshape(7, 5)
    torch.testing.assert_close(torch.cat(locals_, dim=1), x)


def _reinit_body_1x2():
    x = torch.arange(35.0).reshape(7, 5)
    mesh = init_device_mesh("cpu", (1, 2))
    old = _round_trip(mesh, x)
    old_default = distribute_tensor(x, placements=[Shard(1)])  # on the implicit 1-D world mesh
    dist.destroy_process_group()
    reinit_process_group()
    # the implicit default mesh is rebuilt on the new group, even before any explicit mesh
    dflt = distribute_tensor(x, placements=[Shard(1)])
    assert dflt.device_mesh is not old_default.device_mesh
    torch.testing.assert_close(dflt.full_tensor(), x)
    with pytest.raises(RuntimeError, match=DEAD):
        old_default.full_tensor()
    with pytest.raises(RuntimeError, match=DEAD):
        old.full_tensor()
    new = init_device_mesh("cpu", (1, 2))
    _round_trip(new, x)
    with pytest.raises(RuntimeError, match=DEAD):
        old.redistribute(mesh, [Replicate(), Replicate()])
    flat = init_device_mesh("cpu", (2,))
    return distribute_tensor(x, flat, [Shard(1)]).to_local()


def _destroy_without_reinit():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    dist.destroy_process_group()  # the harness re-initialises the group for the next test


def test_a_later_test_still_works():
    run_distributed(4, _destroy_without_reinit)
    # the pool re-created the default group; meshes and DTensors work as if nothing happened
    run_distributed(4, _later_body)
    run_distributed(4, _reinit_body)


def _later_body():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.arange(35.0).reshape(7, 5)
    _round_trip(mesh, x)


@distributed(world_size=4)
def test_after_reinit_tests():
    """Runs after the reinit tests in file order: a plain test on the same pool is healthy."""
    _later_body()


def _from_group_reinit_body():
    rank = dist.get_rank()
    x = torch.arange(35.0).reshape(7, 5)
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mesh = DeviceMesh.from_group([cols[rank % 2], rows[rank // 2]], "cpu", mesh=[[0, 1], [2, 3]],
                                 mesh_dim_names=("dp", "tp"))
    old = _round_trip(mesh, x)
    dist.destroy_process_group()
    reinit_process_group()
    # the user's groups died with the default group: the mesh built on them says so, and no
    # cache hands them to a new mesh
    with pytest.raises(RuntimeError, match=DEAD):
        mesh.get_group("tp")
    with pytest.raises(RuntimeError, match=DEAD):
        old.full_tensor()
    new = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert new.get_group("tp") is not rows[rank // 2]
    _round_trip(new, x)


@distributed(world_size=4)
def test_from_group_mesh_dies_with_its_process_group():
    _from_group_reinit_body()
