"""Describing tensors without data (``dtensor_lite.describe``): the trainer's model described on
the engine-only ranks and the engine's on the trainer-only ranks (including ``Shard(1)``, which
``from_local`` with an empty piece refuses outside the mesh), planned and run by
``plan_relayout``: the engine's pieces equal ``distribute_tensor``'s; a ``MeshLayout`` (a mesh
known by its ranks only) plans the same bytes as the ``DeviceMesh`` it describes; errors."""

import pytest
import torch
import torch.distributed as dist

from dtensor_lite import DeviceMesh, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.debug import CommDebugMode
from dtensor_lite.describe import MeshLayout, describe, describe_mesh, describe_model
from dtensor_lite.relayout import plan_relayout
from tests.harness import distributed


def _weights():
    torch.manual_seed(0)
    return {"w1": torch.randn(6, 5), "w2": torch.randn(3, 7), "b": torch.randn(7)}


def _engine_placements(name, shape):
    return [Shard(len(shape) - 1)]  # Shard(1) of the weights, Shard(0) of the bias


@distributed(world_size=4)
def test_each_side_describes_the_other_and_the_relayout_matches_distribute_tensor():
    rank = dist.get_rank()
    full = _weights()
    trainer, engine = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])
    if rank < 2:  # the trainer holds its pieces and describes the engine's layout
        src = {n: distribute_tensor(t, trainer, [Shard(0)]) for n, t in full.items()}
        dst = describe_model({n: t.shape for n, t in full.items()}, engine,
                             _engine_placements, dtype=torch.bfloat16)
    else:         # the engine holds its buffers and describes the trainer's model
        with torch.device("meta"):
            meta = {n: torch.empty(t.shape) for n, t in full.items()}
        src = describe_model(meta, trainer, [Shard(0)])
        dst = {n: distribute_tensor(torch.zeros(t.shape, dtype=torch.bfloat16), engine,
                                    _engine_placements(n, t.shape)) for n, t in full.items()}
    plan = plan_relayout(src, dst, dtype=torch.bfloat16)
    with CommDebugMode() as comm:
        plan.run(src, dst)
    assert comm.get_comm_bytes().get("cross_mesh", 0) == plan.bytes_sent().get(rank, 0)
    # every element crosses once, in bf16
    assert sum(plan.bytes_sent().values()) == sum(t.numel() for t in full.values()) * 2
    if rank >= 2:
        for n, t in full.items():
            want = distribute_tensor(t.bfloat16(), engine, _engine_placements(n, t.shape))
            assert torch.equal(dst[n].to_local(), want.to_local()), n
    # a mesh known by its ranks only plans the same moves as the DeviceMesh it describes
    layout = describe_mesh(engine)
    assert isinstance(layout, MeshLayout) and layout.mesh.tolist() == [2, 3]
    described = {n: describe(t.shape, torch.bfloat16, layout, _engine_placements(n, t.shape))
                 for n, t in full.items()}
    assert plan_relayout(src, described, dtype=torch.bfloat16).pair_bytes() == plan.pair_bytes()


@distributed(world_size=4)
def test_describe_a_sliced_mesh_keeps_every_instance():
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "tp"))["tp"]
    layout = describe_mesh(tp, rank_offset=10)
    assert [i.tolist() for i in layout.instances] == [[10, 11], [12, 13]]
    spec = describe((4, 4), torch.float32, layout, [Shard(1)])
    assert spec.mesh is layout and spec.local_shape_and_offset((1,)) == ((4, 2), (0, 2))


@distributed(world_size=2)
def test_describe_errors_are_clear():
    mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(ValueError, match=r"describe\(4, 4\): got 2 placements .* one placement "
                                         "per mesh dimension"):
        describe((4, 4), torch.float32, mesh, [Shard(0), Replicate()])
    with pytest.raises(ValueError, match=r"Shard\(dim=2\) is out of range for a 2-D tensor"):
        describe((4, 4), torch.float32, mesh, [Shard(2)])
    with pytest.raises(ValueError, match="negative size"):
        describe((4, -1), torch.float32, mesh, [Shard(0)])
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        describe((4, 4), "float32", mesh, [Shard(0)])
    with pytest.raises(TypeError, match="mesh must be a DeviceMesh or a MeshLayout"):
        describe((4, 4), torch.float32, [0, 1], [Shard(0)])
    with pytest.raises(ValueError, match="ranks must be distinct"):
        MeshLayout("cpu", [[0, 0]])
    with pytest.raises(ValueError, match="pass dtype="):
        describe_model({"w": (4, 4)}, mesh, [Shard(0)])
    # a rank of the mesh that passes a description where its data is needed: every such rank
    # raises before anything moves
    spec = describe((4, 4), torch.float32, mesh, [Shard(0)])
    dst = {"w": distribute_tensor(torch.zeros(4, 4), mesh, [Shard(1)])}
    with pytest.raises(ValueError, match=r"holds part of source 'w' .* pass the DTensor itself"):
        plan_relayout({"w": spec}, dst).run({"w": spec}, dst)
