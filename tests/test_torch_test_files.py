"""Gaps that PyTorch's own test files found when run with torch's names pointed at ours (issue
40): each test repeats what the named torch test does, with our names, and checks the values
against plain single-process torch (and torch's own DTensor where its behaviour is the point)."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from dtensor_lite import (DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh,
                          register_sharding)
from dtensor_lite.debug import CommDebugMode
from dtensor_lite.experimental import local_map
from dtensor_lite.pipelining import TensorChunkSpec, merge_chunks, split_args_kwargs_into_chunks
from tests.harness import distributed

funcol_py = torch.ops.c10d_functional


# ----------------------------------------------------------------- debug/test_comm_mode.py
@distributed(world_size=4)
def test_comm_debug_mode_counts_functional_collectives_user_code_issues():
    """torch's CommDebugMode counts funcol.* that user code calls inside it (test_comm_mode's
    test_comm_mode_with_c10d / funcol cases); ours counts them too, under torch's keys and ours,
    and our own collectives once (not again as the c10d calls they make)."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode
    mesh = init_device_mesh("cpu", (4,))
    tmesh = torch_init_device_mesh("cpu", (4,))
    x = torch.randn(4, 3)

    def user_code(m):
        funcol.all_reduce(x, "sum", m).wait()
        funcol.all_gather_tensor(x, 0, m).wait()
        funcol.reduce_scatter_tensor(x, "sum", 0, m).wait()
        funcol.all_to_all_single(x, None, None, m).wait()
        funcol.broadcast(x, 0, m).wait()
        funcol.all_reduce_coalesced([x, x], "sum", m)
        funcol.all_gather_into_tensor_coalesced([x], m)

    with TorchCommDebugMode() as theirs:
        user_code(tmesh)
    with CommDebugMode() as ours:
        user_code(mesh)
    assert dict(theirs.get_comm_counts()) == {
        funcol_py.all_reduce: 1, funcol_py.all_gather_into_tensor: 1,
        funcol_py.reduce_scatter_tensor: 1, funcol_py.all_to_all_single: 1,
        funcol_py.broadcast: 1, funcol_py.all_reduce_coalesced: 1,
        funcol_py.all_gather_into_tensor_coalesced: 1}
    assert ours.get_comm_counts() == dict(theirs.get_comm_counts())  # torch's keys
    assert ours.get_total_counts() == theirs.get_total_counts() == 7
    assert ours.get_comm_counts()[funcol_py.all_reduce] == 1
    assert ours.get_comm_counts()[torch.ops._dtensor.shard_dim_alltoall] == 0
    assert ours.get_comm_counts()["all_reduce"] == 2  # ours: by kind (coalesced included)
    assert ours.get_comm_counts_by_op()["funcol.all_reduce"] == {"all_reduce": 1}
    n = x.numel() * x.element_size()
    assert ours.get_comm_bytes()["all_gather"] == 2 * 3 * n  # each: (n-1) pieces of x
    # inside a module's forward: attributed to it, as torch's
    lin = nn.Linear(3, 3)
    lin.register_forward_hook(lambda m, i, o: funcol.all_reduce(o, "sum", mesh).wait())
    with CommDebugMode() as ours:
        lin(x)
    assert ours.comm_module_counts["Linear"]["forward"] == {"all_reduce": 1}

    # our own collectives count once, not again as the c10d / funcol calls underneath
    d = distribute_tensor(x, mesh, [Shard(0)])
    with CommDebugMode() as ours:
        d.full_tensor()
        d.redistribute(mesh, [Replicate()]).redistribute(mesh, [Partial()]).full_tensor()
    assert ours.get_comm_counts() == {"all_gather": 2, "all_reduce": 1}
    assert ours.get_comm_counts()[funcol_py.all_gather_into_tensor] == 2


# ----------------------------------------------------------- experimental/test_local_map.py
def _mm_allreduce_forward(device_mesh, a, b):
    return funcol.all_reduce(torch.mm(a, b), "sum", device_mesh).wait()


@distributed(world_size=2)
def test_local_map_takes_a_device_mesh_as_a_positional_argument():
    """torch's test_local_map_correctness: the mesh is the first positional argument, with None
    in in_placements; funcol's all-reduce inside counts once."""
    mesh = init_device_mesh("cpu", (2,))
    x, w = torch.randn(16, 8), torch.randn(8, 12)
    x_dt = distribute_tensor(x, mesh, [Shard(1)])
    w_dt = distribute_tensor(w, mesh, [Shard(0)])
    for kwargs in (dict(device_mesh=mesh), {}):
        fn = local_map(_mm_allreduce_forward, out_placements=[Replicate()],
                       in_placements=(None, [Shard(1)], [Shard(0)]), **kwargs)
        with CommDebugMode() as comm:
            y = fn(mesh, x_dt, w_dt)
        assert comm.get_total_counts() == 1
        assert comm.get_comm_counts()[funcol_py.all_reduce] == 1
        assert y.placements == (Replicate(),)
        torch.testing.assert_close(y.to_local(), x @ w)
    # a placement as a positional argument is one input too
    scaled = local_map(lambda p, a: a * (2.0 if p.is_shard() else 1.0),
                       out_placements=[Shard(0)], in_placements=(None, [Shard(0)]))
    torch.testing.assert_close(scaled(Shard(0), distribute_tensor(x, mesh, [Shard(0)]))
                               .full_tensor(), x * 2)


# ------------------------------------------------------------ pipelining/test_microbatch.py
@distributed(world_size=2)
def test_microbatch_split_and_merge_as_torchs():
    """torch's test_split_and_merge and test_chunk_spec: from_tuple / from_dict, dict kwargs
    merge back into a dict; the same chunks as torch's own microbatch module."""
    from torch.distributed.pipelining import microbatch as torch_mb
    x0, x1, x2 = torch.randn(8, 4), torch.randn(16, 4), torch.randn(32, 4)
    args, kwargs = (x0, x1, x2), {"x0": x0, "x1": x1, "x2": x2}
    arg_chunks, kwarg_chunks = split_args_kwargs_into_chunks(args, kwargs, 2)
    t_args, t_kwargs = torch_mb.split_args_kwargs_into_chunks(args, kwargs, 2)
    assert len(arg_chunks) == len(kwarg_chunks) == 2
    for ours, theirs in ((arg_chunks, t_args), (kwarg_chunks, t_kwargs)):
        torch.testing.assert_close(ours, theirs)
    merged_args = merge_chunks(arg_chunks, (TensorChunkSpec(0),) * 3)
    torch.testing.assert_close(merged_args, args)
    merged_kwargs = merge_chunks(kwarg_chunks, TensorChunkSpec.from_dict(
        {"x0": 0, "x1": 0, "x2": 0}))
    assert isinstance(merged_kwargs, dict)
    torch.testing.assert_close(merged_kwargs, kwargs)
    assert isinstance(merge_chunks(kwarg_chunks, None), dict)  # default spec: dim 0 everywhere

    spec = TensorChunkSpec.from_tuple((0, 1))
    assert [s.split_dim for s in spec] == [0, 1] and str(spec[1]) == "TensorChunkSpec(1)"
    y = torch.randn(4, 6)
    a_chunks, k_chunks = split_args_kwargs_into_chunks(
        (x0, y), {"y": y}, 3, spec, TensorChunkSpec.from_dict({"y": 1}))
    t_a, t_k = torch_mb.split_args_kwargs_into_chunks(
        (x0, y), {"y": y}, 3, torch_mb.TensorChunkSpec.from_tuple((0, 1)),
        torch_mb.TensorChunkSpec.from_dict({"y": 1}))
    torch.testing.assert_close(a_chunks, t_a)
    torch.testing.assert_close(k_chunks, t_k)
    torch.testing.assert_close(merge_chunks(a_chunks, spec), (x0, y))
    # nested outputs, a non-tensor leaf kept once
    outs = [{"h": c[0], "n": 7} for c in a_chunks]
    merged = merge_chunks(outs, {"h": TensorChunkSpec(0), "n": None})
    assert merged["n"] == 7 and torch.equal(merged["h"], x0)

    # a DTensor splits and merges locally, with its global shapes
    mesh = init_device_mesh("cpu", (2,))
    d = distribute_tensor(x1, mesh, [Shard(1)])
    with CommDebugMode() as comm:
        mbs, _ = split_args_kwargs_into_chunks((d,), {}, 4)
        back = merge_chunks([m[0] for m in mbs], TensorChunkSpec(0))
    assert comm.get_total_counts() == 0
    assert [tuple(m[0].shape) for m in mbs] == [(4, 4)] * 4
    torch.testing.assert_close(mbs[1][0].full_tensor(), x1[4:8])
    assert back.placements == (Shard(1),)
    torch.testing.assert_close(back.full_tensor(), x1)


# ----------------------------------------------------------------------- test_optimizers.py
_ADAM_CONFIGS = [dict(lr=0.1, weight_decay=0.05, fused=True),
                 dict(lr=0.1, weight_decay=0.05, amsgrad=True, maximize=True, fused=True),
                 dict(lr=0.1, weight_decay=0.05, foreach=True)]


@distributed(world_size=4)
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_fused_adam_tensor_lr_and_parameters_on_two_meshes(cls):
    """torch's test_adam(w)_1d_sharding: fused=True with lr=torch.tensor(0.1) and
    torch.tensor([0.1]); and parameters on two meshes in one optimizer (torch.optim groups by
    device and dtype only, so one fused / foreach call holds both meshes). Parameters equal a
    single-process model's stepped by the same optimizer."""
    world = init_device_mesh("cpu", (4,))
    mesh2d = init_device_mesh("cpu", (2, 2))
    layout = [(world, [Shard(0)]), (mesh2d, [Shard(0), Shard(1)]), (world, [Replicate()]),
              (mesh2d, [Replicate(), Shard(0)])]
    shapes = [(8, 3), (4, 6), (5,), (6, 2)]
    for config in _ADAM_CONFIGS:
        lrs = [0.1] + ([torch.tensor(0.1), torch.tensor([0.1])] if config.get("fused") else [])
        for lr in lrs:
            torch.manual_seed(0)
            full = [torch.randn(s) for s in shapes]
            plain = [nn.Parameter(t.clone()) for t in full]
            ours = [nn.Parameter(distribute_tensor(t.clone(), m, pl))
                    for t, (m, pl) in zip(full, layout)]
            conf = {**config, "lr": lr.clone() if isinstance(lr, torch.Tensor) else lr}
            ref = cls(plain, **conf)
            opt = cls(ours, **{**config, "lr": lr.clone() if isinstance(lr, torch.Tensor)
                               else lr})
            for step in range(3):
                for p, d, (m, pl) in zip(plain, ours, layout):
                    g = torch.randn(p.shape)
                    p.grad = g.clone()
                    d.grad = distribute_tensor(g, m, pl)
                ref.step()
                opt.step()
            for p, d, (m, pl) in zip(plain, ours, layout):
                assert d.device_mesh is m and d.placements == tuple(pl)
                torch.testing.assert_close(d.full_tensor(), p.detach(),
                                           msg=lambda s: f"{config} lr={lr}: {s}")


# ---------------------------------------------------------------- test_dtensor.py from_local
@distributed(world_size=4)
def test_from_local_run_check_broadcasts_coordinate_zeros_replica():
    """torch 2.13 and 2.15: from_local(run_check=True) broadcasts the piece of coordinate 0 of
    every Replicate mesh dim (into the local tensor when it is contiguous); pieces that differ
    are no error. Values after equal torch's DTensor's for the same pieces."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Replicate as TR, Shard as TS
    rank = dist.get_rank()
    mesh, tmesh = init_device_mesh("cpu", (2, 2)), torch_init_device_mesh("cpu", (2, 2))
    for placements, tplacements in (([Replicate(), Replicate()], [TR(), TR()]),
                                    ([Shard(0), Replicate()], [TS(0), TR()]),
                                    ([Replicate(), Shard(1)], [TR(), TS(1)])):
        piece = torch.arange(6.0).reshape(2, 3) + 10 * rank
        ours = DTensor.from_local(piece.clone(), mesh, placements, run_check=True)
        theirs = TorchDTensor.from_local(piece.clone(), tmesh, tplacements, run_check=True)
        assert torch.equal(ours.to_local(), theirs.to_local()), placements
        torch.testing.assert_close(ours.full_tensor(), theirs.full_tensor())
    # all Replicate: every rank holds rank 0's piece, written into a contiguous local tensor
    local = torch.full((3,), float(rank)).requires_grad_()
    d = DTensor.from_local(local, mesh, [Replicate(), Replicate()], run_check=True)
    assert torch.equal(d.to_local(), torch.zeros(3)) and torch.equal(local.detach(), torch.zeros(3))
    d.to_local().sum().backward()  # still differentiable: the gradient reaches the local tensor
    assert torch.equal(local.grad, torch.ones(3))
    # a strided piece: a contiguous copy is broadcast, the caller's tensor is left alone
    strided = torch.full((3, 2), float(rank)).t()
    d = DTensor.from_local(strided, mesh, [Replicate(), Replicate()], run_check=True)
    assert torch.equal(d.to_local(), torch.zeros(2, 3))
    assert torch.equal(strided, torch.full((2, 3), float(rank)))
    # pieces of different shapes still raise on every rank, before any piece crosses ranks
    with pytest.raises(ValueError, match="do not form one global tensor"):
        DTensor.from_local(torch.ones(2 + rank % 2), mesh, [Replicate(), Replicate()],
                           run_check=True)


# ------------------------------------------------ experimental/test_register_sharding.py
@distributed(world_size=2)
def test_register_sharding_with_dtensor_out_keyword_arguments():
    """torch's test_register_sharding_for_tensor_kwargs: the rule lists placements for every
    schema argument, out= (min, min_indices) included."""
    from dtensor_lite import _caches
    from dtensor_lite.ops._registry import get_rule, set_rule
    aten = torch.ops.aten
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(4, 4)
    x_dt = distribute_tensor(x, mesh, [Replicate()])
    before = get_rule(aten.min.dim_min)
    seen = []
    try:
        @register_sharding(aten.min.dim_min)
        def min_dim_strategy(x, dim, keepdim, min, min_indices):
            seen.append((dim, keepdim))
            return [([Replicate(), Replicate()],
                     [Replicate(), None, None, Replicate(), Replicate()])]

        value_dt = distribute_tensor(torch.randn(4, 1), mesh, [Replicate()])
        indices_dt = distribute_tensor(torch.randn(4, 1).long(), mesh, [Replicate()])
        result = torch.min(x_dt, dim=1, keepdim=True, out=(value_dt, indices_dt))
        assert seen == [(1, True)]
        assert isinstance(result[0], DTensor) and isinstance(result[1], DTensor)
        expected_values, expected_indices = torch.min(x, dim=1, keepdim=True)
        torch.testing.assert_close(result[0].full_tensor(), expected_values)
        torch.testing.assert_close(result[1].full_tensor(), expected_indices)
        torch.testing.assert_close(value_dt.full_tensor(), expected_values)
    finally:
        if before is not None:
            set_rule(aten.min.dim_min, before, override=True)
        _caches.clear_decisions()
