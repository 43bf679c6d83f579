"""Ops without a sharding rule: replicated inputs run locally, others are gathered (with a
warning, once per op and placements), writes into gathered inputs are written back, and
ExplicitRedistributionContext refuses every redistribute the user did not ask for."""
import warnings

import pytest
import torch

from dtensor_lite import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.debug import (CommDebugMode, ExplicitRedistributionContext,
                                FallbackRedistributeWarning, ImplicitRedistributionError,
                                reset_fallback_warnings, strict_redistribute)
from tests.harness import distributed

R = Replicate()


def _fallback_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, FallbackRedistributeWarning)]


@distributed(world_size=4)
def test_replicated_inputs_need_no_rule():
    """Tensor, tuple and in-place results, views that alias, out=, random ops: no communication,
    no warning, plain torch's values."""
    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.randn(5, 5)
    d = distribute_tensor(x, mesh, [R, R])
    with CommDebugMode() as comm:
        (tr, (inv, info), diag), caught = _fallback_warnings(
            lambda: (torch.trace(d), torch.linalg.inv_ex(d), torch.diagonal(d, 1)))
    assert comm.get_total_counts() == 0 and not caught
    torch.testing.assert_close(tr.full_tensor(), torch.trace(x))
    torch.testing.assert_close(inv.full_tensor(), torch.linalg.inv_ex(x)[0])
    assert info.placements == (R, R) and info.dtype == torch.int32
    diag.mul_(0)  # a real view: the write reaches the viewed DTensor, as in plain torch
    x2 = x.clone()
    torch.diagonal(x2, 1).mul_(0)
    torch.testing.assert_close(d.full_tensor(), x2)
    y = d.clone()
    assert y.renorm_(2, 0, 1.0) is y  # in place: returns the destination itself
    torch.testing.assert_close(y.full_tensor(), x2.renorm(2, 0, 1.0))
    out = distribute_tensor(torch.zeros(5, 5), mesh, [R, R])
    torch.kron(d[:1, :1], d, out=out)
    torch.testing.assert_close(out.full_tensor(), torch.kron(x2[:1, :1], x2))
    rates = distribute_tensor(torch.rand(4, 3) * 5, mesh, [R, R])
    torch.manual_seed(7)
    got = torch.poisson(rates)
    torch.manual_seed(7)
    torch.testing.assert_close(got.full_tensor(), torch.poisson(rates.full_tensor()))


@distributed(world_size=4)
def test_sharded_inputs_fall_back_correctly():
    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.randn(7, 5)
    d = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    reset_fallback_warnings()  # other tests in this worker may have run these ops already
    (tr, (sign, logabs)), caught = _fallback_warnings(
        lambda: (torch.trace(d), torch.linalg.slogdet(d[:5])))
    torch.testing.assert_close(tr.full_tensor(), torch.trace(x))
    torch.testing.assert_close(logabs.full_tensor(), torch.linalg.slogdet(x[:5])[1])
    msg = str(caught[0].message)
    assert "aten.trace.default" in msg and "Shard(dim=0)" in msg and "bytes/rank" in msg
    # once per (op, placements): the same call again is silent, other placements warn again
    _, again = _fallback_warnings(lambda: torch.trace(d))
    assert not again
    _, other = _fallback_warnings(lambda: torch.trace(d.redistribute(mesh, [Shard(1), R])))
    assert len(other) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=FallbackRedistributeWarning)
        torch.histc(d, bins=3)  # users can filter the category
    # a Partial input is reduced first
    p = distribute_tensor(x, mesh, [R, R]).redistribute(mesh, [Partial(), R])
    torch.testing.assert_close(torch.trace(p).full_tensor(), torch.trace(x))
    # in place on a sharded (or Partial) self: the write is re-sharded into its own pieces
    for dst in (d.clone(), p.clone()):
        placements = dst.placements
        dst.cumprod_(1)
        assert dst.placements == placements
        torch.testing.assert_close(dst.full_tensor(), x.cumprod(1))
    # a view of a gathered input is a copy: writing into it raises instead of being lost
    v = torch.diagonal(d)
    torch.testing.assert_close(v.full_tensor(), torch.diagonal(x))
    with pytest.raises(RuntimeError, match="view op whose input had to be redistributed"):
        v.mul_(2)
    # out= of sharded placements receives its pieces
    out = distribute_tensor(torch.zeros(5), mesh, [Shard(0), R])
    torch.diag(d, out=out)
    torch.testing.assert_close(out.full_tensor(), torch.diag(x))
    assert out.placements == (Shard(0), R)


@distributed(world_size=4)
def test_fallback_backward_matches_plain_torch():
    mesh = init_device_mesh("cpu", (4,))
    x = torch.randn(6, 6, requires_grad=True)
    d = distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
    _fallback_warnings(lambda: (torch.trace(d) * 3).backward())
    (torch.trace(x) * 3).backward()
    torch.testing.assert_close(d.grad.full_tensor(), x.grad)


@distributed(world_size=4)
def test_explicit_redistribution_context():
    mesh = init_device_mesh("cpu", (4,))
    a = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)])
    r = distribute_tensor(torch.randn(8, 8), mesh, [R])
    with ExplicitRedistributionContext():
        with pytest.raises(ImplicitRedistributionError, match=r"aten.add.Tensor.*Shard.*bytes"):
            a + b  # the rule wants b as Shard(0): an all-to-all the user did not ask for
        with pytest.raises(ImplicitRedistributionError, match=r"trace.*no sharding rule.*Shard"):
            torch.trace(a)
        torch.testing.assert_close(  # asked for explicitly: fine
            (a + b.redistribute(mesh, [Shard(0)])).full_tensor(),
            a.full_tensor() + b.full_tensor())
        a + r  # Replicate -> Shard(0) moves no data: allowed unless strict
        with ExplicitRedistributionContext(enable=False):
            torch.testing.assert_close((a + b).full_tensor(), a.full_tensor() + b.full_tensor())
    with strict_redistribute():
        with pytest.raises(ImplicitRedistributionError, match=r"0 bytes/rank"):
            a + r
    with ExplicitRedistributionContext(mode="warn"):
        with pytest.warns(UserWarning, match="implicit redistribute"):
            a + b
    a + b  # outside: as before
    with pytest.raises(ValueError, match="mode"):
        ExplicitRedistributionContext(mode="explode")


@distributed(world_size=4)
def test_slicewise_ops_keep_batch_shards():
    """Linear algebra on a batch of matrices and pooling over batch/channel shards move nothing;
    only the dims an op mixes are gathered."""
    import torch.nn.functional as F
    mesh = init_device_mesh("cpu", (2, 2))
    a = torch.randn(5, 3, 4, 4) + 4 * torch.eye(4)
    da = distribute_tensor(a, mesh, [Shard(0), Shard(1)])
    img = torch.randn(6, 3, 8, 8)
    dimg = distribute_tensor(img, mesh, [Shard(0), Shard(1)])
    counts = []
    for fn in (lambda: torch.linalg.inv(da), lambda: F.max_pool2d(dimg, 2),
               lambda: F.interpolate(dimg, scale_factor=2, mode="bilinear")):
        with CommDebugMode() as comm:
            counts.append((fn(), comm.get_total_counts()))
    (inv, c1), (pooled, c2), (up, c3) = counts
    # inv moves only its status codes (one gather per mesh dim: every rank must raise together
    # for a singular matrix anywhere), never the matrices
    assert (c1, c2, c3) == (mesh.ndim, 0, 0)
    assert inv.placements == pooled.placements == up.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(inv.full_tensor(), torch.linalg.inv(a))
    torch.testing.assert_close(pooled.full_tensor(), F.max_pool2d(img, 2))
    torch.testing.assert_close(up.full_tensor(), F.interpolate(img, scale_factor=2,
                                                               mode="bilinear"))
    mixed = distribute_tensor(a, mesh, [Shard(2), R])  # a matrix dim: gathered, still correct
    torch.testing.assert_close(torch.linalg.inv(mixed).full_tensor(), torch.linalg.inv(a))
