"""The caches behind dispatch stay bounded in a long run: a decision is keyed by what can change
it (Python numbers by type and sign where the rule reads no more), so an optimizer's per-step
scalars and an LR schedule reuse decisions; and every cache has a size bound (see _caches)."""
import pytest
import torch
import torch.nn.functional as F

from dtensor_lite import Replicate, Shard, distribute_tensor
from dtensor_lite import _caches, _dispatch, spec
from dtensor_lite.redistribute import planner
from tests.harness import distributed
from tests.test_optim import PARAMS, _mesh, _params, _set_grads

OPTIMIZERS = [
    (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, foreach=False)),
    (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, foreach=True)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=False)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=True)),
]


@distributed(world_size=4)
@pytest.mark.parametrize("k", range(len(OPTIMIZERS)),
                         ids=[f"{c.__name__}-foreach={kw['foreach']}" for c, kw in OPTIMIZERS])
def test_cached_decisions_stop_growing_under_an_lr_schedule(k):
    """The leak: a for-loop AdamW step passes new floats (bias corrections, the scheduled LR)
    to pointwise ops every step; keyed by value, each step added decisions (~14 per step)."""
    cls, kwargs = OPTIMIZERS[k]
    mesh = _mesh()
    torch.manual_seed(0)
    plain, dtensors = _params(mesh)
    ref, opt = cls(plain, **kwargs), cls(dtensors, **kwargs)
    schedules = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=50) for o in (ref, opt)]
    for step in range(8):
        _set_grads(plain, dtensors, mesh)
        ref.step()
        opt.step()
        for s in schedules:
            s.step()
        if step == 1:  # step 0 takes the fresh-state branches
            warm = len(_dispatch._DECISIONS)
    assert len(_dispatch._DECISIONS) == warm
    for p, d in zip(plain, dtensors):
        torch.testing.assert_close(d.full_tensor(), p.detach())


@distributed(world_size=2)
def test_every_cache_is_bounded():
    """Shrunk bounds: new shapes and by-value scalars (threshold's rule compares its numbers)
    evict old entries, results stay right, and specs in use are never dropped."""
    from dtensor_lite import init_device_mesh
    mesh = init_device_mesh("cpu", (2,))
    bounds = [(_dispatch._DECISIONS, 16), (planner._PLANS, 4), (spec._AS_GIVEN, 8)]
    saved = [c.max_size for c, _ in bounds] + [spec._NEXT_SWEEP[0], _caches.SPECS_MAX]
    _caches.clear_all()  # what earlier tests in this worker cached
    kept = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
    kept_spec = kept._spec
    try:
        for cache, size in bounds:
            cache.max_size = size
        spec._NEXT_SWEEP[0] = _caches.SPECS_MAX = 32
        for n in range(1, 60):
            x = torch.randn(n, 3)
            d = distribute_tensor(x, mesh, [Shard(0)])
            out = F.threshold(d * 2.0, float(n % 7) / 7, -1.0).redistribute(mesh, [Replicate()])
            torch.testing.assert_close(out.full_tensor(), F.threshold(x * 2.0, (n % 7) / 7, -1.0))
            for cache, size in bounds:
                assert len(cache) <= size
            assert len(spec._INTERNED) <= 2 * 32 + 8
        # the spec of a live DTensor is still the interned one: equal specs stay identical
        again = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
        assert again._spec is kept_spec
        torch.testing.assert_close((kept + again).full_tensor(), 2 * torch.arange(6.0))
    finally:
        for (cache, _), size in zip(bounds, saved):
            cache.max_size = size
        spec._NEXT_SWEEP[0], _caches.SPECS_MAX = saved[-2:]
        _caches.clear_decisions()
