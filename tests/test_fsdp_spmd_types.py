"""``fully_shard(mesh=full_mesh, dp_mesh_dims=...)`` over plain parameters annotated with
``spmd_types`` (torch 2.15's local SPMD types; torchtitan 0.3's default ``spmd_backend``).

The module computes on plain tensors -- this rank's TP piece -- exactly as without FSDP; FSDP
stores each parameter as the DTensor its annotation describes and reduces gradients over the data-
parallel dims, and over TP where the annotation's backward type is Partial (``R`` beside
activations that differ across TP ranks). Oracle: the same model in one process.

``spmd_types`` is a separate package (not a dependency here): skipped where it is not installed.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dtensor_lite import DTensor, init_device_mesh
from fsdp import DataParallelMeshDims, fully_shard
from tests.harness import distributed

spmd = pytest.importorskip("spmd_types")

OUT, IN, ROWS = 6, 4, 3


class Block(nn.Module):
    """``sum((x * g) @ w.T)`` on this rank's pieces: ``w`` column-parallel (rows sharded over
    TP), ``g`` replicated -- its gradient on a TP rank covers that rank's columns only (a partial
    sum over TP)."""

    def __init__(self, w, g):
        super().__init__()
        self.w = nn.Parameter(w)
        self.g = nn.Parameter(g)
        self.seen = []

    def forward(self, x):
        self.seen.append((type(self.w), tuple(self.w.shape)))
        return ((x * self.g) @ self.w.T).sum()


def _global(seed):
    torch.manual_seed(seed)
    return torch.randn(OUT, IN), torch.randn(IN), torch.randn(4, ROWS, IN)


@pytest.mark.parametrize("annotate_dp", [False, True])
@distributed(world_size=4)
def test_annotated_plain_params_train_as_one_process(annotate_dp):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    tp_axis = spmd.MeshAxis.of(mesh.get_group("tp"))
    dp_axis = spmd.MeshAxis.of(mesh.get_group("dp"))
    w, g, x = _global(0)
    w_local = w.chunk(2, 0)[tp].clone()
    model = Block(w_local, g.clone())
    w_type, g_type = {tp_axis: spmd.S(0)}, {tp_axis: spmd.R}
    if annotate_dp:  # an annotation on a data-parallel axis may say R (FSDP owns it)
        w_type, g_type = {**w_type, dp_axis: spmd.R}, {**g_type, dp_axis: spmd.R}
    spmd.assert_type(model.w, w_type)
    spmd.assert_type(model.g, g_type)
    fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))

    # stored as DTensors on the full mesh, computed on as plain TP pieces
    assert isinstance(model.w, DTensor) and model.w.device_mesh == mesh
    assert model.w.shape == (OUT, IN)
    torch.testing.assert_close(model.w.full_tensor(), w, rtol=0, atol=0)
    for step in range(2):
        loss = model(x[2 * dp:2 * dp + 2])
        loss.backward()
    assert model.seen and all(not issubclass(kind, DTensor) and shape == (OUT // 2, IN)
                              for kind, shape in model.seen)

    # oracle: one process, the whole batch, FSDP's mean over the data-parallel ranks, 2 steps
    wr, gr = w.clone().requires_grad_(), g.clone().requires_grad_()
    for step in range(2):
        sum(((x[2 * r:2 * r + 2] * gr) @ wr.T).sum() for r in range(2)).div(2).backward()
    # float32 sums of a few products, reduced in a different order: a few ulps
    torch.testing.assert_close(model.w.grad.full_tensor(), wr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.g.grad.full_tensor(), gr.grad, rtol=1e-5, atol=1e-5)


@distributed(world_size=4)
def test_missing_or_wrong_annotations_are_refused():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dims = DataParallelMeshDims(shard="dp")
    tp_axis = spmd.MeshAxis.of(mesh.get_group("tp"))
    dp_axis = spmd.MeshAxis.of(mesh.get_group("dp"))

    only_dp = Block(torch.ones(3, IN), torch.ones(IN))
    spmd.assert_type(only_dp.w, {dp_axis: spmd.R})
    spmd.assert_type(only_dp.g, {dp_axis: spmd.R})
    with pytest.raises(ValueError, match=r"none for the non-data-parallel mesh dim 'tp'"):
        fully_shard(only_dp, mesh=mesh, dp_mesh_dims=dims)

    invariant_on_dp = Block(torch.ones(3, IN), torch.ones(IN))
    spmd.assert_type(invariant_on_dp.w, {dp_axis: spmd.I, tp_axis: spmd.S(0)})
    spmd.assert_type(invariant_on_dp.g, {tp_axis: spmd.R})
    with pytest.raises(ValueError, match=r"data-parallel mesh dim 'dp'.*must be spmd.R"):
        fully_shard(invariant_on_dp, mesh=mesh, dp_mesh_dims=dims)

    unannotated = Block(torch.ones(3, IN), torch.ones(IN))
    with pytest.raises(ValueError, match=r"every parameter must be a DTensor on the full mesh"):
        fully_shard(unannotated, mesh=mesh, dp_mesh_dims=dims)
    assert dist.get_world_size() == 4
