"""Code written for torch's DeviceMesh: ``_unflatten`` / ``unflatten`` with torch's signature
(checked against torch's own DeviceMesh as the oracle) and ``to_torch()``, an adapter to torch's
own DeviceMesh class over the same groups."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

from dtensor_lite import Shard, distribute_tensor, init_device_mesh
from tests.harness import distributed


def _group_ranks(mesh, dim):
    """The global ranks that ``mesh``'s group along ``dim`` really connects (all-gathered)."""
    group = mesh.get_group(dim)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, torch.tensor([dist.get_rank()]), group=group)
    return sorted(int(t) for t in out)


def _same_layout(ours, theirs):
    assert ours.mesh.tolist() == theirs.mesh.tolist()
    assert ours.mesh_dim_names == theirs.mesh_dim_names
    assert list(ours.get_coordinate()) == list(theirs.get_coordinate())
    for d in range(ours.ndim):
        assert _group_ranks(ours, d) == _group_ranks(theirs, d)


@distributed(world_size=4)
@pytest.mark.parametrize("spelling", ["_unflatten", "unflatten"])
def test_unflatten_world_matches_torch(spelling):
    ours = getattr(init_device_mesh("cpu", (4,), mesh_dim_names=("world",)), spelling)(
        0, (1, 2, 2), ("pp", "dp", "tp"))
    theirs = torch_init_device_mesh("cpu", (4,), mesh_dim_names=("world",))._unflatten(
        0, (1, 2, 2), ("pp", "dp", "tp"))
    _same_layout(ours, theirs)
    for names in (("dp",), ("tp",), ("dp", "tp")):
        _same_layout(ours[names], theirs[names])
    # the new names slice, flatten and carry DTensors like any mesh's
    flat = ours["dp", "tp"]._flatten("dp_tp")
    assert ours["dp_tp"].mesh.tolist() == flat.mesh.tolist() == [0, 1, 2, 3]
    x = torch.arange(24.0).reshape(4, 6)
    d = distribute_tensor(x, ours["dp", "tp"], [Shard(0), Shard(1)])
    torch.testing.assert_close(d.full_tensor(), x)
    # unflattening twice (two layouts of one world, as torchtitan builds them) is fine
    other = init_device_mesh("cpu", (4,), mesh_dim_names=("world",)).unflatten(
        "world", (4, 1), ("dp", "tp"))
    assert other["dp"].mesh.tolist() == [0, 1, 2, 3] and other["tp"].size() == 1


@distributed(world_size=4)
def test_unflatten_one_dim_of_a_2d_mesh_and_of_a_flattened_dim():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ours = mesh._unflatten("dp", (2, 1), ("rep", "shard"))
    theirs = torch_init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))._unflatten(
        "dp", (2, 1), ("rep", "shard"))
    _same_layout(ours, theirs)
    _same_layout(ours["rep", "tp"], theirs["rep", "tp"])
    # a flattened dim split the other way round: (dp, tp) -> dp_tp -> (2, 2) again
    again = mesh["dp", "tp"]._flatten("dptp_interop")._unflatten(0, (2, 2), ("x", "y"))
    assert again.mesh.tolist() == [[0, 1], [2, 3]]
    assert _group_ranks(again, "y") == _group_ranks(mesh, "tp")
    # the tp dim of a 2-D mesh, unflattened on its own, keeps the dp rows apart
    tp_split = mesh["tp"]._unflatten(0, (1, 2), ("a", "b"))
    assert tp_split.mesh.tolist() == [mesh["tp"].mesh.tolist()]
    assert _group_ranks(tp_split, "b") == _group_ranks(mesh, "tp")


@distributed(world_size=4)
def test_unflatten_bad_arguments():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"product of mesh_sizes \(3, 1\) is 3"):
        mesh._unflatten(0, (3, 1), ("a", "b"))
    with pytest.raises(ValueError, match="1 mesh_dim_names"):
        mesh._unflatten(0, (2, 1), ("a",))
    with pytest.raises(ValueError, match="unique"):
        mesh._unflatten("dp", (2, 1), ("a", "tp"))
    with pytest.raises(ValueError, match="'pp' is not a dim"):
        mesh._unflatten("pp", (2, 1), ("a", "b"))
    with pytest.raises(ValueError, match="out of range"):
        mesh._unflatten(2, (2, 1), ("a", "b"))
    with pytest.raises(ValueError, match="needs mesh_dim_names"):
        init_device_mesh("cpu", (2, 2))._unflatten(0, (2, 1), ("a", "b"))
    with pytest.raises(ValueError, match="backend_override key 2 is not a mesh dim"):
        mesh._unflatten(0, (2, 1), ("a", "b"), backend_override={2: "gloo"})


@distributed(world_size=4)
def test_functional_collectives_take_our_mesh_through_to_torch():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.tensor([float(rank), 10.0 * rank])
    tp_ranks = mesh["tp"].mesh.tolist()
    dp_ranks = mesh["dp"].mesh.tolist()
    expect_sum = torch.tensor([float(sum(tp_ranks)), 10.0 * sum(tp_ranks)])
    torch.testing.assert_close(funcol.all_reduce(x, "sum", mesh["tp"].to_torch()), expect_sum)
    gathered = funcol.all_gather_tensor(x, 0, (mesh.to_torch(), 0))
    torch.testing.assert_close(
        gathered, torch.cat([torch.tensor([float(r), 10.0 * r]) for r in dp_ranks]))
    scattered = funcol.reduce_scatter_tensor(x, "sum", 0, (mesh.to_torch(), 1))
    torch.testing.assert_close(scattered, expect_sum[mesh.get_local_rank("tp")].reshape(1))
    assert mesh.to_torch() is mesh.to_torch()  # cached: no new torch mesh per call
    # unnamed N-D meshes get placeholder names on torch's side
    assert init_device_mesh("cpu", (2, 2)).to_torch().mesh_dim_names == ("dim0", "dim1")
    # our mesh itself is accepted too (test_torch_compat.py); to_torch() remains for torch
    # APIs that need torch's class itself
    torch.testing.assert_close(funcol.all_reduce(x, "sum", mesh["tp"]), expect_sum)
