"""fully_shard(mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...)) (torch 2.13): parameters
are DTensors on the full mesh, Replicate on the data-parallel dims, and stay on the full mesh.

The oracle is single-process torch: every step's loss and every gradient (``full_tensor()``)
equal training on the whole batch. fp32 throughout; the only differences are the order of the
sums (a batch split over ranks, a matmul split over TP), a few ulps, so rtol 1e-5.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dtensor_lite import Replicate, Shard, _StridedShard, distribute_tensor, init_device_mesh
from fsdp import DataParallelMeshDims, fully_shard
from tests.harness import distributed
from tp import ColwiseParallel, RowwiseParallel, parallelize_module


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))


def _on_full_mesh(model, ref, mesh, tp_name=None):
    """Each parameter as a DTensor on the whole ``mesh``: its TP placement (after
    parallelize_module on mesh[tp_name]) on ``tp_name``, Replicate on every other dim."""
    refs = dict(ref.named_parameters())
    for mod_name, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            full = refs[f"{mod_name}.{name}" if mod_name else name].detach()
            placements = [p.placements[0] if n == tp_name else Replicate()
                          for n in mesh.mesh_dim_names]
            module._parameters[name] = nn.Parameter(distribute_tensor(full, mesh, placements))


def _copy_on_full_mesh(ref, mesh):
    """A copy of ``ref`` whose parameters are Replicate DTensors on the whole ``mesh``."""
    model = copy.deepcopy(ref)
    _on_full_mesh(model, ref, mesh)
    return model


def _train_and_compare(model, ref, data_rank, n_data, steps=3):
    """SGD on both; this rank takes its slice of the batch (ranks with one data rank share it)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    rows = 2
    for step in range(steps):
        x = torch.randn(rows * n_data, 6, generator=g)
        ref_loss = ref(x).pow(2).mean()
        ref_loss.backward()
        loss = model(x[data_rank * rows:(data_rank + 1) * rows]).pow(2).mean()
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank's loss: the mean over data ranks is the whole batch's
        torch.testing.assert_close(mean / dist.get_world_size(), ref_loss.detach(),
                                   rtol=1e-5, atol=0, msg=lambda m: f"step {step} loss: {m}")
        params = dict(model.named_parameters())
        for name, p_ref in ref.named_parameters():
            torch.testing.assert_close(params[name].grad.full_tensor(), p_ref.grad,
                                       rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"step {step} grad {name}: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


@distributed(world_size=4, timeout=60)
@pytest.mark.parametrize("names", [("dp", "tp"), ("tp", "dp")], ids=["dp-tp", "tp-dp"])
def test_fsdp_tp_on_full_mesh(names):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    ref = _mlp()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    _on_full_mesh(model, ref, mesh, "tp")
    dims = DataParallelMeshDims(shard="dp")
    fully_shard(model[0], mesh=mesh, dp_mesh_dims=dims)  # bottom-up: two groups
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    for p in model.parameters():
        assert p.device_mesh is mesh
    w1, w2, b2 = model[0].weight, model[2].weight, model[2].bias
    if names == ("dp", "tp"):  # tp splits first, dp each piece: torch's _StridedShard spelling
        assert w1.placements == (_StridedShard(0, split_factor=2), Shard(0))
        assert w2.placements == (Shard(0), Shard(1))
        assert b2.placements == (Shard(0), Replicate())
    else:                      # the same split in mesh order: plain Shard on both
        assert w1.placements == (Shard(0), Shard(0))
        assert w2.placements == (Shard(1), Shard(0))
        assert b2.placements == (Replicate(), Shard(0))
    for name, p_ref in ref.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name].full_tensor(), p_ref), name
    _train_and_compare(model, ref, mesh.get_local_rank("dp"), 2)


@distributed(world_size=4, timeout=60)
def test_hsdp_on_full_mesh():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref = _mlp()
    model = _copy_on_full_mesh(ref, mesh)
    fully_shard(model, mesh=mesh,
                dp_mesh_dims=DataParallelMeshDims(shard="shard", replicate="replicate"))
    for p in model.parameters():
        assert p.device_mesh is mesh and p.placements == (Replicate(), Shard(0))
    _train_and_compare(model, ref, dist.get_rank(), 4)


@distributed(world_size=4, timeout=60)
def test_shard_names_tuple_is_flattened():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    ref = _mlp()
    model = _copy_on_full_mesh(ref, mesh)
    fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("a", "b")))
    w = model[0].weight
    assert w.device_mesh == mesh["a_b"] and w.placements == (Shard(0),)
    assert w.to_local().shape == (2, 6)  # 8 rows over 4 ranks
    _train_and_compare(model, ref, dist.get_rank(), 4)


def test_neither_field_set_is_refused():
    with pytest.raises(ValueError, match="at least one of shard= and replicate="):
        DataParallelMeshDims()


@distributed(world_size=4, timeout=60)
def test_bad_inputs_are_refused():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref = _mlp()

    def model_on_mesh():
        return _copy_on_full_mesh(ref, mesh)

    with pytest.raises(ValueError, match=r"names \['pp'\] that are not dims .*'dp', 'tp'"):
        fully_shard(model_on_mesh(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="pp"))
    with pytest.raises(ValueError, match="names a mesh dim twice"):
        fully_shard(model_on_mesh(), mesh=mesh,
                    dp_mesh_dims=DataParallelMeshDims(shard="dp", replicate="dp"))
    with pytest.raises(ValueError, match="has no shard dim"):
        fully_shard(model_on_mesh(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))
    with pytest.raises(ValueError, match="is a plain Parameter"):
        fully_shard(copy.deepcopy(ref), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    model = model_on_mesh()
    w = model[0].weight.detach().full_tensor()
    model[0].weight = nn.Parameter(distribute_tensor(w, mesh, [Shard(0), Replicate()]))
    with pytest.raises(ValueError, match=r"must be Replicate\(\) \(got Shard\(dim=0\) on 'dp'\)"):
        fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    with pytest.raises(TypeError, match="must be a DataParallelMeshDims"):
        fully_shard(model_on_mesh(), mesh=mesh, dp_mesh_dims={"shard": "dp"})


@distributed(world_size=4, timeout=60)
def test_users_parameters_count_as_replaced():
    """The user's full-mesh parameters, not the front end's intermediate ones, are what an
    optimizer built too early holds and what a weight tied across two calls refers to."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dims = DataParallelMeshDims(shard="dp")
    ref = _mlp()
    model = _copy_on_full_mesh(ref, mesh)
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    with pytest.raises(RuntimeError, match="Build the optimizer after fully_shard"):
        early.step()
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    tied = nn.Sequential(a, b)
    _on_full_mesh(tied, copy.deepcopy(tied), mesh)
    b.weight = a.weight
    fully_shard(a, mesh=mesh, dp_mesh_dims=dims)
    with pytest.raises(ValueError, match="already managed by fully_shard"):
        fully_shard(tied, mesh=mesh, dp_mesh_dims=dims)
