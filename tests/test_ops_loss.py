"""Loss rules against plain torch, forward and backward: cross_entropy / nll_loss on batch- and
class-sharded inputs (ignore_index, class weights, every reduction), nll_loss2d, and the
elementwise losses -- with uneven and EMPTY shards (5 rows on 4 ranks), where a local mean would
be NaN."""
import pytest
import torch
import torch.nn.functional as F

from dtensor_lite import Partial, Replicate, Shard, init_device_mesh
from dtensor_lite.debug import CommDebugMode
from tests.harness import distributed
from tests.test_ops_nn import _dist, _meshes, _rand, check

R = Replicate()
REDUCTIONS = ["mean", "sum", "none"]


def _targets(n, classes, seed=1, ignored=()):
    t = torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))
    for i in ignored:
        t[i] = -100
    return t


# logits placements, target placements: rows, classes, both, replicated, Partial logits
CE_1D = [([Shard(0)], [Shard(0)]), ([Shard(0)], [R]), ([R], [Shard(0)]), ([Shard(1)], [R]),
         ([Shard(1)], [Shard(0)]), ([R], [R]), ([Partial()], [R])]
CE_2D = [([Shard(0), Shard(1)], [Shard(0), R]), ([Shard(1), Shard(1)], [R, R]),
         ([Shard(0), Shard(0)], [Shard(0), Shard(0)]), ([Shard(1), Shard(0)], [R, Shard(0)]),
         ([R, Shard(1)], [Shard(0), R])]


@distributed(world_size=4)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy(reduction):
    # 5 rows on 4 ranks (one empty row shard), 7 classes (chunks 2,2,2,1); rows 1 and 4 ignored
    logits, target = _rand(5, 7), _targets(5, 7, ignored=(1, 4))
    weight = _rand(7, seed=2).abs() + 0.1
    for mesh, cases in zip(_meshes(), [CE_1D, CE_2D]):
        rep = [R] * mesh.ndim
        for pl, pt in cases:
            check(lambda x, t: F.cross_entropy(x, t, reduction=reduction), [logits, target],
                  [pl, pt], mesh)
            pw = [Shard(0) if p.is_shard(1) else R for p in pl]  # class weights split like classes
            for pweight in (rep, pw):
                check(lambda x, t, w: F.cross_entropy(x, t, w, reduction=reduction),
                      [logits, target, weight], [pl, pt, pweight], mesh, no_grad=(2,))
    # every target of a shard ignored, and every target ignored (torch: NaN for the mean)
    mesh = init_device_mesh("cpu", (4,))
    for t in (_targets(5, 7, ignored=(0, 1, 2)), _targets(5, 7, ignored=range(5))):
        for pl, pt in CE_1D[:5]:
            check(lambda x, t: F.cross_entropy(x, t, reduction=reduction), [logits, t], [pl, pt],
                  mesh, tol=dict(equal_nan=True))


@distributed(world_size=4)
def test_nll_loss_on_log_probs_and_unbatched():
    mesh = init_device_mesh("cpu", (4,))
    logp = F.log_softmax(_rand(6, 9), -1)
    target = _targets(6, 9, ignored=(2,))
    for reduction in REDUCTIONS:
        for pl, pt in CE_1D:
            check(lambda x, t: F.nll_loss(x, t, reduction=reduction), [logp, target], [pl, pt],
                  mesh)
    # one sample, no batch dim: classes sharded, 0-d target
    x, t = _rand(7), torch.tensor(5)
    for px in ([Shard(0)], [R]):
        for reduction in REDUCTIONS:
            check(lambda x, t: F.cross_entropy(x, t, reduction=reduction), [x, t], [px, [R]],
                  mesh)


@distributed(world_size=4)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_2d(reduction):
    # [N, C, H, W] logits, [N, H, W] targets: aten.nll_loss2d_forward / backward
    logits = _rand(3, 5, 4, 3)
    target = torch.randint(0, 5, (3, 4, 3), generator=torch.Generator().manual_seed(1))
    target[0, 1, :] = -100
    weight = _rand(5, seed=2).abs() + 0.1
    mesh1, mesh2 = _meshes()
    for pl, pt in [([Shard(0)], [Shard(0)]), ([Shard(1)], [R]), ([Shard(2)], [Shard(1)]),
                   ([Shard(3)], [Shard(2)]), ([Shard(2)], [R])]:
        check(lambda x, t: F.cross_entropy(x, t, reduction=reduction), [logits, target],
              [pl, pt], mesh1)
        check(lambda x, t, w: F.cross_entropy(x, t, w, reduction=reduction),
              [logits, target, weight], [pl, pt, [R]], mesh1, no_grad=(2,))
    for pl, pt in [([Shard(0), Shard(1)], [Shard(0), R]),
                   ([Shard(2), Shard(3)], [Shard(1), Shard(2)]), ([Shard(1), Shard(1)], [R, R])]:
        check(lambda x, t: F.cross_entropy(x, t, reduction=reduction), [logits, target],
              [pl, pt], mesh2)
    # 3-D logits [N, C, L] (a sequence of class scores) reach nll_loss2d through views
    logits3 = _rand(4, 6, 5)
    target3 = torch.randint(0, 6, (4, 5), generator=torch.Generator().manual_seed(3))
    for pl, pt in [([Shard(0)], [Shard(0)]), ([Shard(1)], [R]), ([Shard(2)], [Shard(1)])]:
        check(lambda x, t: F.cross_entropy(x, t, reduction=reduction), [logits3, target3],
              [pl, pt], mesh1)


@distributed(world_size=4)
def test_class_sharded_cross_entropy_never_gathers_logits():
    logits, target = _rand(6, 10), _targets(6, 10, ignored=(3,))
    ref = logits.clone().requires_grad_()
    loss_ref = F.cross_entropy(ref, target)
    loss_ref.backward()
    for mesh, pl, pt, fwd, bwd in [
            # loss parallel: log_softmax all-reduces row max and sum-exp; the count is local
            (init_device_mesh("cpu", (4,)), [Shard(1)], [R], {"all_reduce": 2}, {"all_reduce": 1}),
            # dp x tp: the mean's total weight is also summed over the batch shards
            (init_device_mesh("cpu", (2, 2)), [Shard(0), Shard(1)], [Shard(0), R],
             {"all_reduce": 3}, {"all_reduce": 1})]:
        x, t = _dist(logits, mesh, pl), _dist(target, mesh, pt)
        with CommDebugMode() as comm:
            loss = F.cross_entropy(x, t)
        assert comm.get_comm_counts() == fwd
        assert loss.placements == (Partial(),) * mesh.ndim
        with CommDebugMode() as comm:
            loss.backward()
        assert comm.get_comm_counts() == bwd
        assert x.grad.placements == tuple(pl)
        torch.testing.assert_close(loss.full_tensor(), loss_ref)
        torch.testing.assert_close(x.grad.full_tensor(), ref.grad)


@distributed(world_size=4)
def test_cross_entropy_label_smoothing_and_probabilities():
    # composite paths (sums over the class dim, pointwise ops): no rule of their own
    logits, target = _rand(5, 7), _targets(5, 7, ignored=(2,))
    probs = F.softmax(_rand(5, 7, seed=3), -1)
    mesh = init_device_mesh("cpu", (4,))
    for pl, pt in [([Shard(0)], [Shard(0)]), ([Shard(1)], [R])]:
        check(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), [logits, target],
              [pl, pt], mesh)
        check(lambda x, p: F.cross_entropy(x, p), [logits, probs], [pl, pl], mesh, no_grad=(1,))


# ----------------------------------------------------------------------------- elementwise losses
def _elementwise_cases():
    """(name, fn(input, target), input maker, target maker, target differentiable)."""
    def logits(*s):
        return _rand(*s)

    def probs(*s):
        return torch.sigmoid(_rand(*s, seed=5))

    def labels(*s):
        return torch.sign(_rand(*s, seed=6))

    cases = []
    for red in REDUCTIONS:
        cases += [
            (f"mse/{red}", lambda x, y, r=red: F.mse_loss(x, y, reduction=r), logits, logits, True),
            (f"l1/{red}", lambda x, y, r=red: F.l1_loss(x, y, reduction=r), logits, logits, True),
            (f"smooth_l1/{red}", lambda x, y, r=red: F.smooth_l1_loss(x, y, reduction=r, beta=0.5),
             logits, logits, True),
            (f"huber/{red}", lambda x, y, r=red: F.huber_loss(x, y, reduction=r, delta=0.7),
             logits, logits, True),
            (f"bce/{red}", lambda x, y, r=red: F.binary_cross_entropy(torch.sigmoid(x), y,
                                                                       reduction=r),
             logits, probs, False),
            (f"bce_logits/{red}", lambda x, y, r=red: F.binary_cross_entropy_with_logits(
                x, y, reduction=r), logits, probs, False),
            (f"soft_margin/{red}", lambda x, y, r=red: F.soft_margin_loss(x, y, reduction=r),
             logits, labels, False),
            (f"kl/{red}", lambda x, y, r=red: F.kl_div(F.log_softmax(x, -1), y, reduction=r),
             logits, probs, True),
        ]
    cases += [
        ("kl/batchmean", lambda x, y: F.kl_div(F.log_softmax(x, -1), y, reduction="batchmean"),
         logits, probs, True),
        ("kl/log_target", lambda x, y: F.kl_div(x, y.log(), reduction="sum", log_target=True),
         logits, probs, True),
    ]
    return cases


LOSS_1D = [([Shard(0)], [Shard(0)]), ([Shard(1)], [Shard(1)]), ([Shard(0)], [R])]
LOSS_EXTRA = [([Partial()], [R]), ([Shard(0), Shard(1)], [Shard(0), Shard(1)]),
              ([Shard(1), Shard(0)], [R, Shard(0)])]


@distributed(world_size=4)
def test_elementwise_losses():
    shape = (5, 3)  # on 4 ranks, rows split 2,2,1,0 and columns 1,1,1,0: empty shards both ways
    mesh1, mesh2 = _meshes()
    for name, fn, make_x, make_y, y_grad in _elementwise_cases():
        x, y = make_x(*shape), make_y(*shape)
        no_grad = () if y_grad else (1,)
        # every reduction on the 1-D cases; Partial inputs and 2-D meshes for the means
        cases = LOSS_1D + (LOSS_EXTRA if name.endswith("mean") else [])
        for px, py in cases:
            mesh = mesh1 if len(px) == 1 else mesh2
            try:
                check(fn, [x, y], [px, py], mesh, no_grad=no_grad)
            except Exception as e:
                raise AssertionError(f"{name} with {px}, {py}: {e}") from e


@distributed(world_size=4)
def test_bce_with_logits_weights():
    x, y = _rand(5, 3), torch.sigmoid(_rand(5, 3, seed=1))
    w, pw = _rand(3, seed=2).abs(), _rand(3, seed=3).abs()
    mesh = init_device_mesh("cpu", (4,))
    for red in REDUCTIONS:
        for px, pwt in [([Shard(0)], [R]), ([Shard(1)], [Shard(0)]), ([R], [Shard(0)])]:
            check(lambda x, y, w, pw: F.binary_cross_entropy_with_logits(
                x, y, w, reduction=red, pos_weight=pw), [x, y, w, pw], [px, px, pwt, pwt], mesh,
                no_grad=(1, 2, 3))
            check(lambda x, y, w: F.binary_cross_entropy(torch.sigmoid(x), y, w, reduction=red),
                  [x, y, w], [px, px, pwt], mesh, no_grad=(1, 2))


@distributed(world_size=4)
def test_sharded_mean_loss_is_local_partial_and_not_nan():
    mesh = init_device_mesh("cpu", (4,))
    x, y = _rand(5, 3), _rand(5, 3, seed=1)  # rank 3 holds no rows
    dx, dy = _dist(x, mesh, [Shard(0)]), _dist(y, mesh, [Shard(0)], grad=False)
    with CommDebugMode() as comm:
        loss = F.mse_loss(dx, dy)
        loss.backward()
    assert comm.get_total_counts() == 0  # local sums / global count; gradients stay sharded
    assert loss.placements == (Partial(),) and dx.grad.placements == (Shard(0),)
    assert not torch.isnan(loss.to_local())
    ref = x.clone().requires_grad_()
    F.mse_loss(ref, y).backward()
    torch.testing.assert_close(loss.full_tensor(), F.mse_loss(x, y))
    torch.testing.assert_close(dx.grad.full_tensor(), ref.grad)
