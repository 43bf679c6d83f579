"""``linspace`` / ``logspace`` (torch 2.15's ``torch.distributed.tensor.linspace`` / ``logspace``):
globally bit-identical to ``torch.linspace`` / ``torch.logspace``, each rank's piece the
``torch.chunk`` piece of it (uneven and empty pieces included)."""
import pytest
import torch
import torch.distributed as dist

import dtensor_lite as dl
from dtensor_lite import Partial, Replicate, Shard, _StridedShard, init_device_mesh
from tests.harness import distributed


def _piece(t, n, i):
    pieces = t.chunk(n)
    return pieces[i] if i < len(pieces) else t[t.numel():]


CASES = [  # (start, end, steps, dtype): uneven (7 on 4), empty pieces (2 on 4), one, none, ints
    (0.0, 1.0, 7, None), (-3.5, 12.25, 1000, torch.float64), (2.0, -1.0, 2, None),
    (5.0, 5.0, 1, None), (0.0, 1.0, 0, None), (0, 100, 13, torch.int64),
    (0.0, 1.0, 9, torch.bfloat16), (1 + 1j, 3 - 2j, 5, None),
]


@distributed(world_size=4)
@pytest.mark.parametrize("start,end,steps,dtype", CASES)
def test_linspace_matches_torch_bit_for_bit(start, end, steps, dtype):
    rank = dist.get_rank()
    want = torch.linspace(start, end, steps, dtype=dtype)
    mesh = init_device_mesh("cpu", (4,))
    d = dl.linspace(start, end, steps, dtype=dtype, device_mesh=mesh, placements=[Shard(0)])
    assert d.dtype == want.dtype and d.shape == want.shape
    assert torch.equal(d.to_local(), _piece(want, 4, rank))
    assert torch.equal(d.full_tensor(), want)
    r = dl.linspace(start, end, steps, dtype=dtype, device_mesh=mesh)  # default: replicated
    assert r.placements == (Replicate(),) and torch.equal(r.to_local(), want)


@distributed(world_size=4)
@pytest.mark.parametrize("base", [10.0, 2.0, 0.5])
def test_logspace_matches_torch_bit_for_bit(base):
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2))
    want = torch.logspace(-2.0, 3.0, 11, base)
    d = dl.logspace(-2.0, 3.0, 11, base, device_mesh=mesh, placements=[Shard(0), Shard(0)])
    # two mesh dims shard dim 0, nested in mesh order
    assert torch.equal(d.to_local(), _piece(_piece(want, 2, rank // 2), 2, rank % 2))
    assert torch.equal(d.full_tensor(), want)
    assert torch.equal(dl.logspace(0, 3, 4, device_mesh=mesh).full_tensor(),
                       torch.logspace(0, 3, 4))  # the default base is 10, as torch's


@distributed(world_size=2)
def test_spaced_factories_options():
    mesh = init_device_mesh("cpu", (2,))
    # 0-d tensors as endpoints, requires_grad, Partial keeps the global value
    d = dl.linspace(torch.tensor(1.0), torch.tensor(2.0), 5, requires_grad=True,
                    device_mesh=mesh, placements=[Partial()])
    assert d.requires_grad and d.is_leaf
    assert torch.equal(d.full_tensor(), torch.linspace(1.0, 2.0, 5))
    with mesh:  # the current mesh when none is given
        assert torch.equal(dl.logspace(0, 1, 3, placements=[Shard(0)]).full_tensor(),
                           torch.logspace(0, 1, 3))
    with pytest.raises(ValueError, match="0-dimensional"):
        dl.linspace(torch.zeros(2), 1.0, 3, device_mesh=mesh)
    with pytest.raises(ValueError, match="_StridedShard"):
        dl.linspace(0.0, 1.0, 4, device_mesh=mesh, placements=[_StridedShard(0, 2)])
    with pytest.raises(ValueError, match="steps must be a non-negative int"):
        dl.linspace(0.0, 1.0, -1, device_mesh=mesh)
    with pytest.raises(ValueError, match="out of range for a 1-D"):
        dl.linspace(0.0, 1.0, 4, device_mesh=mesh, placements=[Shard(1)])
