"""``local_map(..., spmd_types=)`` (torch 2.15): ``False`` (the default) is local_map as before;
``True`` asks for torch's runtime SPMD type checking of ``func``, which dtensor_lite does not
provide: refused with a clear error once DTensors are passed (without any, ``func`` runs as is,
as torch's does)."""
import pytest
import torch
import torch.distributed as dist

import dtensor_lite as dl
from dtensor_lite import Partial, Replicate, Shard, init_device_mesh
from dtensor_lite.experimental import local_map
from tests.harness import distributed


@distributed(world_size=2)
def test_spmd_types_false_is_plain_local_map():
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(4, 3)
    w = torch.randn(3, 2)
    dx = dl.distribute_tensor(x.clone().requires_grad_(), mesh, [Shard(0)])
    dw = dl.distribute_tensor(w.clone().requires_grad_(), mesh, [Replicate()])
    f = local_map(torch.mm, out_placements=[Shard(0)], in_placements=([Shard(0)], [Replicate()]),
                  spmd_types=False)
    out = f(dx, dw)
    assert torch.allclose(out.full_tensor(), x @ w)
    out.full_tensor().sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (xr @ wr).sum().backward()
    assert torch.allclose(dx.grad.full_tensor(), xr.grad)
    assert torch.allclose(dw.grad.full_tensor(), wr.grad)  # derived Partial gradient, reduced


@distributed(world_size=2)
def test_spmd_types_true_is_refused_with_dtensors_and_runs_without():
    mesh = init_device_mesh("cpu", (2,))
    d = dl.distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    f = local_map(lambda t: t + 1, out_placements=[Shard(0)], in_placements=([Shard(0)],),
                  spmd_types=True)
    with pytest.raises(NotImplementedError,
                       match=r"spmd_types=True.*not supported.*without spmd_types"):
        f(d)
    # no DTensor argument: func runs on plain tensors as torch's does
    assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))
    # as a decorator with arguments, too
    deco = local_map(out_placements=[Partial()], spmd_types=True)(lambda t: t)
    with pytest.raises(NotImplementedError, match="spmd_types=True"):
        deco(d)
    with pytest.raises(TypeError, match="spmd_types must be a bool"):
        local_map(lambda t: t, out_placements=[Shard(0)], spmd_types="yes")
