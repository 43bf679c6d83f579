"""Gradients through DTensor.from_local for every Partial reduction: sum hands every rank the
whole gradient, avg 1/n of it, max/min only the rank(s) holding the extreme (split among ties)."""
import pytest
import torch
import torch.distributed as dist

from dtensor_lite import DTensor, Partial, Shard, init_device_mesh
from tests.harness import distributed


def _pieces(world):
    torch.manual_seed(1)
    return [torch.randn(3, 4) for _ in range(world)]


@distributed(world_size=4)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_from_local_partial_grad_matches_plain_reduction(op):
    rank, world = dist.get_rank(), dist.get_world_size()
    pieces = [p.requires_grad_() for p in _pieces(world)]
    reduce = {"sum": lambda t: t.sum(0), "avg": lambda t: t.mean(0),
              "max": lambda t: t.amax(0), "min": lambda t: t.amin(0)}[op]
    weights = torch.arange(12.0).reshape(3, 4)
    (reduce(torch.stack(pieces)) * weights).sum().backward()
    local = pieces[rank].detach().clone().requires_grad_()
    dt = DTensor.from_local(local, init_device_mesh("cpu", (4,)), [Partial(op)])
    (dt.full_tensor() * weights).sum().backward()
    torch.testing.assert_close(local.grad, pieces[rank].grad)


@distributed(world_size=4)
def test_from_local_max_over_two_mesh_dims_with_shard():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2))
    pieces = [p.requires_grad_() for p in _pieces(2)]  # one piece per coordinate on mesh dim 0
    coord = mesh.get_coordinate()
    torch.stack(pieces).amax(0).sum().backward()
    local = pieces[coord[0]].detach()[:, coord[1] * 2:(coord[1] + 1) * 2].clone().requires_grad_()
    dt = DTensor.from_local(local, mesh, [Partial("max"), Shard(1)])
    dt.full_tensor().sum().backward()
    expected = pieces[coord[0]].grad[:, coord[1] * 2:(coord[1] + 1) * 2]
    torch.testing.assert_close(local.grad, expected, msg=f"rank {rank}")
