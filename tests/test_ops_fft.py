"""FFT rules against plain torch, forward and backward, real and complex, on 4 ranks with uneven
and empty shards: a shard of a dim the transform does not touch stays (CommDebugMode: nothing
moves), a shard of a transformed dim leaves that dim only."""
import torch

from dtensor_lite import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.debug import CommDebugMode
from tests.harness import distributed

R = Replicate()
fft = torch.fft


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _loss(out, weight):
    """A real scalar weighting every real and imaginary part of ``out`` differently."""
    if out.is_complex():
        return (out.real * weight).sum() + (out.imag * weight.flip(-1)).sum()
    return (out * weight).sum()


def _check(fn, x, placements, mesh):
    """fn on a DTensor == fn on the plain tensor: the result and the input's gradient. float32
    FFTs of <= 8 points per dim round at ~1e-6 relative; gathered and local transforms run the
    same kernel on the same lines, so only the Partial case adds in another order."""
    where = f"{placements}"
    ref_in = x.clone().requires_grad_()
    want = fn(ref_in)
    weight = _rand(*want.shape, seed=9)
    _loss(want, weight).backward()
    base = [R if p.is_partial() else p for p in placements]
    leaf = distribute_tensor(x, mesh, base, src_data_rank=None).requires_grad_()
    dx = leaf.redistribute(mesh, placements) if base != list(placements) else leaf
    got = fn(dx)
    torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{where}: {m}")
    gw = [R if p.is_partial() else p for p in got.placements]
    _loss(got, distribute_tensor(weight, mesh, gw, src_data_rank=None)).backward()
    torch.testing.assert_close(leaf.grad.full_tensor(), ref_in.grad, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"grad, {where}: {m}")
    return got


FNS = {
    "fft": lambda x: fft.fft(x, dim=1),
    "ifft n=4": lambda x: fft.ifft(x, n=4, dim=2, norm="ortho"),
    "fftn": lambda x: fft.fftn(x, dim=(1, 2)),
    "fft2 s": lambda x: fft.fft2(x, s=(3, 8), dim=(0, 2)),
    "ifftshift": lambda x: fft.ifftshift(fft.ifftn(x, dim=(2,)), dim=2),
}
REAL_FNS = {
    "rfft": lambda x: fft.rfft(x, dim=1),
    "irfft": lambda x: fft.irfft(fft.rfft(x, dim=2), n=7, dim=2),
    "rfft2": lambda x: fft.rfft2(x, dim=(0, 2), norm="forward"),
    "hfft": lambda x: fft.hfft(x, dim=1),
    "ihfft": lambda x: fft.ihfft(x, dim=2),
    "irfftn": lambda x: fft.irfftn(x, s=(6,), dim=(1,)),
}
PLACEMENTS = [[Shard(0)], [Shard(1)], [Shard(2)], [R], [Partial()]]


@distributed(world_size=4)
def test_fft_matches_torch_real_and_complex():
    mesh = init_device_mesh("cpu", (4,))
    x = _rand(5, 6, 7)  # 5 rows on 4 ranks: 2, 2, 1, 0 (an empty piece)
    z = torch.complex(x, _rand(5, 6, 7, seed=1))
    for pl in PLACEMENTS:
        for name, fn in FNS.items():
            _check(fn, x, pl, mesh)
            _check(fn, z, pl, mesh)
        for name, fn in REAL_FNS.items():
            _check(fn, x if name in ("rfft", "irfft", "rfft2", "ihfft") else z, pl, mesh)


@distributed(world_size=4)
def test_fft_2d_mesh():
    mesh = init_device_mesh("cpu", (2, 2))
    z = torch.complex(_rand(5, 6, 7), _rand(5, 6, 7, seed=1))
    for pl in ([Shard(0), Shard(2)], [Shard(0), Shard(0)], [Shard(1), Shard(2)]):
        _check(FNS["fft"], z, pl, mesh)
        _check(REAL_FNS["rfft2"], z.real.contiguous(), pl, mesh)


@distributed(world_size=4)
def test_fft_of_untouched_sharded_dims_moves_nothing():
    mesh = init_device_mesh("cpu", (2, 2))
    x = distribute_tensor(_rand(5, 6, 7), mesh, [Shard(0), Shard(2)], src_data_rank=None)
    x.requires_grad_()
    grad = distribute_tensor(_rand(5, 6, 7, seed=2), mesh, [Shard(0), Shard(2)],
                             src_data_rank=None)
    with CommDebugMode() as comm:
        y = fft.rfft(x, dim=1)
        z = fft.irfft(y, n=6, dim=1)
        z.backward(grad)
        c = fft.ifft(fft.fft(y, dim=1), dim=1)
    assert comm.get_total_counts() == 0
    assert y.placements == z.placements == c.placements == (Shard(0), Shard(2))
    assert x.grad.placements == (Shard(0), Shard(2))


@distributed(world_size=4)
def test_fft_of_a_sharded_dim_moves_only_that_dim():
    # fftn over dims 0 and 1 of a dim-0 shard: the shard moves to dim 2 (an all-to-all) or the
    # dim is gathered -- either way the input crosses ranks once, and dim 2 is never transformed
    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(_rand(8, 6, 4), mesh, [Shard(0)], src_data_rank=None)
    with CommDebugMode() as comm:
        y = fft.fftn(x, dim=(0, 1))
    assert comm.get_total_counts() == 1
    assert y.placements in ((Shard(2),), (R,))
    torch.testing.assert_close(y.full_tensor(), fft.fftn(x.full_tensor(), dim=(0, 1)))
