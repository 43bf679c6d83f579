"""Autograd through DTensor, checked against the same computation in plain single-process torch.

Every body draws its data from the same seed on every rank, so each rank can compute the plain
torch reference locally and compare its gradients (as full tensors) with it.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtensor_lite import (DTensor, Partial, Replicate, Shard, distribute_module,
                          distribute_tensor, init_device_mesh)
from dtensor_lite.debug import CommDebugMode
from tests.harness import distributed, run_distributed


def _close(actual, expected, **kw):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, **kw)


def _grad_placements(placements):
    """Gradients of a Partial value arrive Replicated: d(sum_r x_r)/dx_r = 1."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


# ----------------------------------------------------------------------------- distribute_tensor


@distributed(world_size=4)
@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Replicate()]], ids=str)
def test_leaf_from_distribute_tensor(placements):
    mesh = init_device_mesh("cpu", (4,))
    x = torch.randn(5, 3, requires_grad=True)
    d = distribute_tensor(x, mesh, placements)
    assert d.is_leaf and d.requires_grad and d.grad_fn is None
    loss = (d * d).sum() + (3 * d).mean()
    loss.backward()
    ref = (x * x).sum() + (3 * x).mean()
    ref.backward()
    _close(loss.full_tensor(), ref.detach())
    assert isinstance(d.grad, DTensor) and d.grad.placements == tuple(placements)
    _close(d.grad.full_tensor(), x.grad)
    assert x.grad is not None  # the plain tensor's own graph was separate
    # a distributed leaf does not route gradients into the source tensor
    x.grad = None
    loss2 = (d * 2).sum()
    loss2.backward()
    assert x.grad is None


@distributed(world_size=4)
def test_distribute_tensor_of_non_grad_tensor_is_not_a_leaf_needing_grad():
    mesh = init_device_mesh("cpu", (2, 2))
    d = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0), Shard(1)])
    assert not d.requires_grad
    assert not (d * 2).requires_grad


# ----------------------------------------------------------------------------- redistribute

S0, S1, R = Shard(0), Shard(1), Replicate()
P, PA, PM = Partial("sum"), Partial("avg"), Partial("max")

# (src, dst) on a 2x2 mesh; together they use every step kind the executor has, on both mesh dims:
# all_gather (S->R), all_to_all (S->S'), pad_to_partial (S->P), chunk (R->S), to_partial (R->P),
# all_reduce (P->R), reduce_scatter (P->S), rescale (sum<->avg), and several kinds at once.
TRANSITIONS = [
    ((S0, R), (R, R)), ((R, S1), (R, R)), ((S0, S1), (R, R)),
    ((S0, R), (S1, R)), ((R, S0), (R, S1)), ((S0, S1), (S1, S0)),
    ((S0, R), (P, R)), ((R, S1), (R, P)),
    ((R, R), (S0, R)), ((R, R), (R, S1)), ((R, R), (S1, S0)),
    ((R, R), (P, R)), ((R, R), (R, P)), ((R, R), (P, P)),
    ((P, R), (R, R)), ((R, P), (R, R)), ((P, P), (R, R)),
    ((P, R), (S0, R)), ((R, P), (R, S1)), ((P, P), (S0, S1)),
    ((P, R), (PA, R)), ((PA, R), (P, R)), ((PA, S0), (R, R)),
    ((S0, S0), (R, R)), ((S0, S0), (S1, S1)), ((R, S0), (S0, S0)),
    ((PM, R), (R, R)), ((S0, R), (R, PM)),
]


def _transition_body(src, dst, shape):
    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.randn(shape)
    w = torch.randn(shape)
    d = distribute_tensor(x.clone().requires_grad_(), mesh, list(src))
    y = d.redistribute(mesh, list(dst))
    assert y.placements == tuple(dst)
    _close(y.full_tensor(), x)  # the forward keeps the global value
    loss = (y.full_tensor() * w).sum()
    loss.backward()
    assert d.grad.placements == _grad_placements(src)
    # d(loss)/d(global x) = w; a Partial leaf's ranks each receive the whole w
    _close(d.grad.full_tensor(), w)
    return d.grad.to_local()


@pytest.mark.parametrize("shape", [(4, 6), (5, 3)], ids=str)
@pytest.mark.parametrize("src,dst", TRANSITIONS, ids=lambda ps: "".join(map(str, ps)))
def test_redistribute_gradients(src, dst, shape):
    run_distributed(4, _transition_body, src, dst, shape)


@distributed(world_size=4)
def test_shard_to_replicate_gradient_is_partial_to_shard():
    """Backward of all_gather is reduce_scatter: a Partial gradient of the replicated value comes
    back as a Shard gradient holding the sum over ranks."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    x = torch.randn(8, 4)
    ws = [torch.randn(8, 4) for _ in range(4)]  # the same list on every rank
    d = distribute_tensor(x.clone().requires_grad_(), mesh, [Shard(0)])
    y = d.redistribute(mesh, [Replicate()])
    seen = []
    y.register_hook(lambda g: seen.append(g.placements))
    # each rank contributes its own term: the local gradients are partial sums
    local = y.to_local(grad_placements=[Partial()])
    loss = (local * ws[rank]).sum()
    with CommDebugMode() as comm:
        loss.backward()
    assert seen == [(Partial("sum"),)]
    assert comm.get_comm_counts() == {"reduce_scatter": 1}
    assert d.grad.placements == (Shard(0),)
    _close(d.grad.to_local(), sum(ws).chunk(4)[rank])
    _close(d.grad.full_tensor(), sum(ws))


@distributed(world_size=4)
def test_redistribute_backward_on_2d_mesh_is_the_transpose():
    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.randn(4, 6)
    d = distribute_tensor(x.clone().requires_grad_(), mesh, [Shard(0), Shard(1)])
    y = d.redistribute(mesh, [Replicate(), Replicate()])
    local = y.to_local(grad_placements=[Partial(), Replicate()])
    w = torch.randn(4, 6)
    # only mesh-dim-0 coordinate 0 contributes; the Partial on dim 0 sums it back to w
    scale = 1.0 if mesh.get_local_rank(0) == 0 else 0.0
    (local * w * scale).sum().backward()
    assert d.grad.placements == (Shard(0), Shard(1))
    _close(d.grad.full_tensor(), w)


# ----------------------------------------------------------------------------- full_tensor


@distributed(world_size=4)
@pytest.mark.parametrize("placements", [[S0, S1], [S1, R], [P, S0], [R, P], [PA, R]], ids=str)
def test_full_tensor_gradient(placements):
    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.randn(5, 7)
    d = distribute_tensor(x.clone().requires_grad_(), mesh, placements)
    full = d.full_tensor()
    assert type(full) is torch.Tensor and full.requires_grad
    xr = x.clone().requires_grad_()
    (torch.sin(full) * full).sum().backward()
    (torch.sin(xr) * xr).sum().backward()
    assert d.grad.placements == _grad_placements(placements)
    _close(d.grad.full_tensor(), xr.grad)


@distributed(world_size=4)
def test_full_tensor_with_grad_placements():
    """full_tensor(grad_placements=[Partial()]): each rank's gradient is a partial sum."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    x = torch.randn(8, 3)
    ws = [torch.randn(8, 3) for _ in range(4)]
    d = distribute_tensor(x.clone().requires_grad_(), mesh, [Shard(0)])
    full = d.full_tensor(grad_placements=[Partial()])
    (full * ws[rank]).sum().backward()
    _close(d.grad.full_tensor(), sum(ws))


# ------------------------------------------------------------------------ from_local / to_local


@distributed(world_size=4)
def test_from_local_gradients():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    x = torch.randn(8, 3)
    w = torch.randn(8, 3)

    local = x.chunk(4)[rank].clone().requires_grad_()
    d = DTensor.from_local(local, mesh, [Shard(0)])
    assert not d.is_leaf and d.requires_grad
    (d.full_tensor() * w).sum().backward()
    _close(local.grad, w.chunk(4)[rank])

    # Replicate: every rank's local tensor *is* the global one, so each gets the whole gradient
    rep = x.clone().requires_grad_()
    (DTensor.from_local(rep, mesh, [Replicate()]) * DTensor.from_local(w, mesh, [Replicate()])) \
        .sum().backward()
    _close(rep.grad, w)

    # Partial(sum): global = sum of the locals, d/dx_r = 1 for every rank
    parts = [torch.randn(8, 3) for _ in range(4)]
    mine = parts[rank].clone().requires_grad_()
    p = DTensor.from_local(mine, mesh, [Partial()])
    out = p.full_tensor()
    _close(out, sum(parts))
    (out * w).sum().backward()
    _close(mine.grad, w)

    # uneven, with shape=: the empty shard gets an empty gradient
    u = torch.randn(5, 2)
    piece = list(u.chunk(4)) + [u[5:]] * (4 - len(u.chunk(4)))
    lu = piece[rank].clone().requires_grad_()
    du = DTensor.from_local(lu, mesh, [Shard(0)], shape=(5, 2))
    (du.full_tensor() ** 2).sum().backward()
    _close(lu.grad, 2 * piece[rank])


@distributed(world_size=4)
def test_from_local_on_2d_mesh_gradients():
    mesh = init_device_mesh("cpu", (2, 2))
    a, b = mesh.get_coordinate()
    x = torch.randn(4, 6)
    w = torch.randn(4, 6)
    local = x.chunk(2, 0)[a].chunk(2, 1)[b].clone().requires_grad_()
    d = DTensor.from_local(local, mesh, [Shard(0), Shard(1)])
    (d * DTensor.from_local(w.chunk(2, 0)[a].chunk(2, 1)[b], mesh, [Shard(0), Shard(1)])).sum() \
        .backward()
    _close(local.grad, w.chunk(2, 0)[a].chunk(2, 1)[b])


@distributed(world_size=4)
def test_to_local_gradients():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    x = torch.randn(8, 3)
    w = torch.randn(8, 3)

    # default: the local gradient is laid out like the DTensor (Shard(0))
    d = distribute_tensor(x.clone().requires_grad_(), mesh, [Shard(0)])
    local = d.to_local()
    assert type(local) is torch.Tensor and local.requires_grad
    (local * w.chunk(4)[rank]).sum().backward()
    assert d.grad.placements == (Shard(0),)
    _close(d.grad.full_tensor(), w)

    # grad_placements=[Partial()] on a replicated DTensor: the gradients are partial sums
    ws = [torch.randn(8, 3) for _ in range(4)]
    r = distribute_tensor(x.clone().requires_grad_(), mesh, [Replicate()])
    (r.to_local(grad_placements=[Partial()]) * ws[rank]).sum().backward()
    _close(r.grad.full_tensor(), sum(ws))

    # grad_placements=[Replicate()] on a replicated DTensor: each rank has the whole gradient
    r2 = distribute_tensor(x.clone().requires_grad_(), mesh, [Replicate()])
    (r2.to_local(grad_placements=[Replicate()]) * w).sum().backward()
    assert r2.grad.placements == (Replicate(),)
    _close(r2.grad.full_tensor(), w)

    # a local gradient that does not match the declared layout is a clear error
    s = distribute_tensor(x.clone().requires_grad_(), mesh, [Shard(0)])
    bad = s.to_local(grad_placements=[Replicate()])
    with pytest.raises(RuntimeError, match="grad_placements"):
        (bad * w.chunk(4)[rank]).sum().backward()


@distributed(world_size=2)
def test_to_local_roundtrip_through_plain_torch_ops():
    """DTensor -> to_local -> plain ops -> from_local -> DTensor, all differentiable."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(6, 4)
    d = distribute_tensor(x.clone().requires_grad_(), mesh, [Shard(1)])
    local = torch.tanh(d.to_local()) * 3
    e = DTensor.from_local(local, mesh, [Shard(1)])
    (e.full_tensor() ** 2).sum().backward()
    xr = x.clone().requires_grad_()
    ((torch.tanh(xr) * 3) ** 2).sum().backward()
    _close(d.grad.full_tensor(), xr.grad)
    _close(d.grad.to_local(), xr.grad.chunk(2, 1)[rank])


# ----------------------------------------------------------------------------- a small model


def _tp_model_body(batch, hidden):
    """Column-parallel Linear -> elementwise ops -> row-parallel Linear -> sum/mean loss."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    w1, b1 = torch.randn(hidden, 4), torch.randn(hidden)
    w2, b2 = torch.randn(3, hidden), torch.randn(3)
    x = torch.randn(batch, 4)

    def leaf(t, placements):
        return distribute_tensor(t.clone().requires_grad_(), mesh, placements)

    W1, B1 = leaf(w1, [Shard(0)]), leaf(b1, [Shard(0)])
    W2, B2 = leaf(w2, [Shard(1)]), leaf(b2, [Replicate()])
    X = distribute_tensor(x, mesh, [Replicate()])
    h = F.linear(X, W1, B1)
    assert h.placements == (Shard(1),)
    h = torch.tanh(h) * 2 + 1 - h.exp() / 4
    out = F.linear(h, W2, B2)
    loss = (out ** 2).mean() + out.sum() * 0.1
    loss.backward()

    ref = [t.clone().requires_grad_() for t in (w1, b1, w2, b2)]
    rh = F.linear(x, ref[0], ref[1])
    rh = torch.tanh(rh) * 2 + 1 - rh.exp() / 4
    rout = F.linear(rh, ref[2], ref[3])
    rloss = (rout ** 2).mean() + rout.sum() * 0.1
    rloss.backward()

    _close(out.full_tensor(), rout.detach())
    _close(loss.full_tensor(), rloss.detach())
    for name, got, want in zip(("w1", "b1", "w2", "b2"), (W1, B1, W2, B2), ref):
        # values only: which placements a gradient arrives in is the dispatcher's (cost-based)
        # choice, e.g. w2's can come back Partial through pow's backward
        assert isinstance(got.grad, DTensor) and got.grad.device_mesh is mesh, name
        _close(got.grad.full_tensor(), want.grad, msg=name)


@pytest.mark.parametrize("world_size,batch,hidden", [(2, 5, 6), (4, 3, 8), (4, 2, 6)])
def test_small_tensor_parallel_model(world_size, batch, hidden):
    run_distributed(world_size, _tp_model_body, batch, hidden)


@distributed(world_size=4)
def test_nn_module_with_distribute_module_matches_plain_training_step():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 2))
    ref = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())

    def partition_fn(name, mod, mesh_):
        if name == "0":
            mod.weight = nn.Parameter(distribute_tensor(mod.weight, mesh_, [Replicate(), Shard(0)]))
            mod.bias = nn.Parameter(distribute_tensor(mod.bias, mesh_, [Replicate(), Shard(0)]))
        elif name == "2":
            mod.weight = nn.Parameter(distribute_tensor(mod.weight, mesh_, [Replicate(), Shard(1)]))

    def input_fn(mod, inputs, mesh_):  # batch sharded over dp, replicated over tp
        return (distribute_tensor(inputs[0], mesh_, [Shard(0), Replicate()]),)

    distribute_module(model, mesh, partition_fn, input_fn=input_fn)
    x = torch.randn(6, 6)
    target = torch.randn(6, 2)
    out = model(x)
    loss = ((out - distribute_tensor(target, mesh, [Shard(0), Replicate()])) ** 2).mean()
    loss.backward()
    rloss = ((ref(x) - target) ** 2).mean()
    rloss.backward()
    _close(loss.full_tensor(), rloss.detach())
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        _close(p.grad.full_tensor(), q.grad, msg=name)

    # one SGD step on both keeps them equal
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            p.sub_(0.1 * p.grad)
            q.sub_(0.1 * q.grad)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        _close(p.full_tensor(), q.detach(), msg=name)


@distributed(world_size=2)
def test_gradients_accumulate_across_backward_calls():
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(4, 3)
    d = distribute_tensor(x.clone().requires_grad_(), mesh, [Shard(0)])
    (d * 2).sum().backward()
    (d * d).sum().backward()
    # (the gradient's placements are whatever autograd produced: d * 2's is Replicate, as it
    # would be in PyTorch; only the global value is promised)
    _close(d.grad.full_tensor(), 2 + 2 * x)
    (d ** 3).mean().backward()
    _close(d.grad.full_tensor(), 2 + 2 * x + 3 * x ** 2 / x.numel())


@distributed(world_size=2)
def test_detach_keeps_spec_and_aliases_the_piece():
    """``aten.detach`` -- what AccumulateGrad calls on every gradient it stores -- returns a
    DTensor of the same spec whose piece is a detached alias of the input's (same storage; the
    wrapper shares the input's version counter), for every placement kind, on even and uneven pieces; its
    gradients land in ``.grad`` with their spec and values."""
    mesh = init_device_mesh("cpu", (2,))
    for rows in (4, 3, 1):
        full = torch.randn(rows, 3)
        for pl in (Shard(0), Shard(1), Replicate(), Partial()):
            d = DTensor.from_local(full.clone(), mesh, [pl]) if pl.is_partial() else \
                distribute_tensor(full, mesh, [pl])
            out = torch.ops.aten.detach.default(d)
            assert type(out) is DTensor and out._spec is d._spec and not out.requires_grad
            assert out._local_tensor.untyped_storage().data_ptr() == \
                d._local_tensor.untyped_storage().data_ptr()
            before = d._version
            out.add_(1.0)  # through the alias: the input's version and values move with it
            assert d._version == before + 1
            torch.testing.assert_close(d.to_local(), out.to_local(), atol=0, rtol=0)
    w = nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
    x = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    (w * x).sum().backward()  # the gradient x, Shard(0), stored through detach
    assert w.grad.placements == (Shard(0),)
    torch.testing.assert_close(w.grad.full_tensor(), x.full_tensor(), atol=0, rtol=0)
