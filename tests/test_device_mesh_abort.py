"""``DeviceMesh.abort`` (torch 2.15): aborts the mesh's process groups without a collective; the
mesh, its slices and every mesh over the same groups then raise a clear error, a mesh built
later gets new groups, and a slice refuses to abort (as torch's)."""
import pytest
import torch
import torch.distributed as dist

import dtensor_lite as dl
from dtensor_lite import Replicate, Shard, init_device_mesh
from tests.harness import distributed


@distributed(world_size=4)
def test_abort_ends_the_mesh_groups_and_later_meshes_get_new_ones():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    twin = init_device_mesh("cpu", (2, 2))  # the same rows: the same (cached) groups
    flat = mesh["dp", "tp"].flatten("dp_tp")
    x = torch.arange(8.0).reshape(4, 2)
    d = dl.distribute_tensor(x, mesh, [Shard(0), Replicate()])
    assert torch.equal(d.full_tensor(), x)
    old = mesh.get_all_groups()
    default = dist.distributed_c10d._get_default_group()
    assert twin.get_all_groups() == old

    with pytest.raises(RuntimeError, match="not supported on a submesh"):
        mesh["tp"].abort()
    mesh.abort()  # not collective: each rank may call it alone

    for what in (lambda: mesh.get_group("tp"), lambda: mesh["dp"],
                 lambda: twin.get_all_groups(), lambda: flat.get_group(),
                 lambda: d.full_tensor()):
        with pytest.raises(RuntimeError, match=r"aborted \(DeviceMesh.abort\(\)\)"):
            what()
    # torch's registries forgot them too, where the release has that cleanup
    registered = dist.distributed_c10d._world.pg_map
    assert all(g not in registered for g in old)
    # the default group (used internally for whole-mesh scatters) was left alone
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 4.0 and dist.distributed_c10d._get_default_group() is default

    fresh = init_device_mesh("cpu", (2, 2))
    assert all(g is not o for g, o in zip(fresh.get_all_groups(), old))
    d2 = dl.distribute_tensor(x, fresh, [Shard(0), Shard(1)])
    assert torch.equal(d2.full_tensor(), x)
    assert torch.equal(d2.redistribute(fresh, [Replicate(), Replicate()]).to_local(), x)
