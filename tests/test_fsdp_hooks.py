"""Hook scheduling in the cases that break naive FSDP: a module called twice, forward without
backward, nested and non-differentiable outputs, frozen blocks, manual unshard, explicit
prefetching, runtime knobs; and clear errors for bad inputs."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dtensor_lite import DTensor, DeviceMesh, Replicate, Shard, init_device_mesh
from dtensor_lite.debug import CommDebugMode
from examples.llama import Llama, loss_fn
from fsdp import FSDPModule, fully_shard
from tests.harness import distributed
from tests.test_fsdp import CFG, batches, global_mean, make_mesh, my_rows, rel, shard_llama


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.lin = nn.Linear(h, h)
        self.norm = nn.LayerNorm(h)

    def forward(self, x):
        return self.norm(torch.tanh(self.lin(x))) + x


class Net(nn.Module):
    def __init__(self, d=6, h=10, n=2, out=3):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.blocks = nn.ModuleList(Block(h) for _ in range(n))
        self.head = nn.Linear(h, out)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def shard_net(net, mesh, **kw):
    for b in net.blocks:
        fully_shard(b, mesh=mesh, **kw)
    return fully_shard(net, mesh=mesh)


def data(rows=8, d=6):
    g = torch.Generator().manual_seed(7)
    return torch.randn(rows, d, generator=g)


def assert_grads_match(model, ref, tol=1e-5):
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (p_ref.grad is None), name
        if p.grad is not None:
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements
            torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, rtol=tol, atol=tol,
                                       msg=lambda m: f"grad of {name}: {m}")


def step_both(model, ref, loss_of):
    """loss_of(module, x) on this rank's rows vs on the whole batch; compare gradients."""
    x = data()
    loss_of(ref, x).backward()
    loss = loss_of(model, my_rows(x))
    loss.backward()
    assert_grads_match(model, ref)
    return loss


def _copy(ref):
    import copy
    return copy.deepcopy(ref)


# ----------------------------------------------------------------------------- call patterns


class Twice(Net):
    def forward(self, x):
        h = self.inp(x)
        h = self.blocks[0](h)
        h = self.blocks[0](h)  # the same FSDP module twice in one forward
        return self.head(self.blocks[1](h))


@distributed(world_size=4)
@pytest.mark.parametrize("raf", [True, False, 2], ids=lambda v: f"raf={v}")
def test_module_called_twice_in_one_forward(raf):
    ref = Twice()
    model = shard_net(_copy(ref), make_mesh((4,)), reshard_after_forward=raf)
    x = data()
    ref(x).square().mean().backward()
    with CommDebugMode() as comm:
        model(my_rows(x)).square().mean().backward()
    assert_grads_match(model, ref)
    per_call = [(c[0], c[1]) for c in comm.calls]
    # one reduce-scatter per group even though block 0 ran twice
    assert comm.get_comm_counts()["reduce_scatter"] == 3
    # forward: root, block 0 (again for its second call unless kept), block 1;
    # backward: block 1, then block 0 once for both of its calls
    fwd_ag = 4 if raf is not False else 3
    bwd_ag = 2 if raf is not False else 0
    assert comm.get_comm_counts()["all_gather"] == fwd_ag + bwd_ag, per_call


@distributed(world_size=2)
def test_forward_without_backward_reshards_everything():
    ref = Net()
    model = shard_net(_copy(ref), make_mesh((2,)))
    x = my_rows(data())
    with torch.no_grad(), CommDebugMode() as comm:
        y_eval = model.eval()(x)
    assert comm.get_comm_counts() == {"all_gather": 3}
    assert all(isinstance(p, DTensor) for p in model.parameters())  # root resharded too
    model.train()
    y = model(x)  # grad enabled, but never backpropagated
    torch.testing.assert_close(y, y_eval)
    del y
    loss = step_both(model, ref, lambda m, x: m(x).square().mean())  # a normal step after it
    assert all(isinstance(p, DTensor) for p in model.parameters())
    del loss


@dataclasses.dataclass
class Extra:
    z: torch.Tensor
    note: str = "x"


class NestedOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x):
        y = self.lin(x)
        mask = (y > 0).long()  # an output that does not require grad
        return {"y": y, "aux": [mask, Extra(z=y.sin())], "const": torch.ones(2)}


class NestedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = NestedOut()
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        out = self.a(x)
        return self.b(out["y"] * out["aux"][1].z).sum() + out["aux"][0].sum() * 0


@distributed(world_size=2)
def test_nested_dict_list_dataclass_outputs():
    ref = NestedNet()
    model = _copy(ref)
    mesh = make_mesh((2,))
    fully_shard(model.a, mesh=mesh)
    fully_shard(model, mesh=mesh)
    step_both(model, ref, lambda m, x: m(x) / x.shape[0])


@distributed(world_size=4)
def test_frozen_blocks_first_and_middle():
    """A frozen first layer fed with plain data has outputs that need no grad; the frozen
    blocks[0] sits in the middle, where its outputs do need grad, so backward re-gathers it."""
    ref = Net(n=2)
    for p in list(ref.blocks[0].parameters()) + list(ref.inp.parameters()):
        p.requires_grad_(False)
    model = _copy(ref)
    mesh = make_mesh((4,))
    fully_shard(model.inp, mesh=mesh)  # frozen, input without grad: outputs need no grad
    shard_net(model, mesh)             # blocks[0]: frozen in the middle of the graph
    for _ in range(2):
        step_both(model, ref, lambda m, x: m(x).square().mean())
        ref.zero_grad()
        model.zero_grad()
    assert all(isinstance(p, DTensor) for p in model.parameters())


@distributed(world_size=2)
def test_list_of_modules_is_one_group():
    ref = Net(n=3)
    model = _copy(ref)
    mesh = make_mesh((2,))
    fully_shard([model.blocks[0], model.blocks[1]], mesh=mesh)
    fully_shard(model.blocks[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model.blocks[0], FSDPModule) and isinstance(model.blocks[1], FSDPModule)
    x = data()
    ref(x).square().mean().backward()
    with CommDebugMode() as comm:
        model(my_rows(x)).square().mean().backward()
    assert_grads_match(model, ref)
    assert comm.get_comm_counts() == {"all_gather": 3 + 2, "reduce_scatter": 3}


# ----------------------------------------------------------------------------- placement options


@distributed(world_size=4)
def test_shard_placement_fn_and_ignored_params():
    ref = Net()
    model = _copy(ref)
    mesh = make_mesh((4,))
    ignored = [model.head.bias]
    for b in model.blocks:
        fully_shard(b, mesh=mesh, shard_placement_fn=lambda p: Shard(p.ndim - 1))
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    assert model.blocks[0].lin.weight.placements == (Shard(1),)
    assert not isinstance(model.head.bias, DTensor)
    x = data()
    ref(x).square().mean().backward()
    model(my_rows(x)).square().mean().backward()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        if name == "head.bias":  # ignored: a plain local gradient, not reduced
            assert p.grad is not None and not isinstance(p.grad, DTensor)
            continue
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the FSDPModule API


@distributed(world_size=2)
def test_manual_unshard_reshard_and_async_handle():
    ref = Net()
    model = shard_net(_copy(ref), make_mesh((2,)))
    block = model.blocks[0]
    block.unshard()
    assert not isinstance(block.lin.weight, DTensor)
    torch.testing.assert_close(block.lin.weight, ref.blocks[0].lin.weight.detach())
    block.reshard()
    assert isinstance(block.lin.weight, DTensor)
    handle = model.blocks[1].unshard(async_op=True)
    handle.wait()
    torch.testing.assert_close(model.blocks[1].lin.weight, ref.blocks[1].lin.weight.detach())
    # a pending async unshard is finished by the module's forward
    model.blocks[1].reshard()
    model.blocks[1].unshard(async_op=True)
    step_both(model, ref, lambda m, x: m(x).square().mean())


@distributed(world_size=4)
def test_explicit_prefetch_keeps_counts_and_results():
    torch.manual_seed(0)
    model = shard_llama(Llama(CFG), make_mesh((4,)))
    layers = list(model.layers)
    layers[0].set_modules_to_forward_prefetch([layers[1]])
    layers[1].set_modules_to_backward_prefetch([layers[0]])
    tokens = batches(1)[0]
    mine = my_rows(tokens)
    with CommDebugMode() as comm:
        loss = loss_fn(model(mine[:, :-1]), mine[:, 1:])
        loss.backward()
    assert comm.get_comm_counts() == {"all_gather": 3 + 2, "reduce_scatter": 3}
    torch.manual_seed(0)
    plain = Llama(CFG)
    ref_loss = loss_fn(plain(tokens[:, :-1]), tokens[:, 1:])
    assert rel(global_mean(loss), ref_loss) < 1e-5


@distributed(world_size=2)
def test_divide_factor_and_reshard_after_backward():
    ref = Net()
    model = shard_net(_copy(ref), make_mesh((2,)))
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum instead of average
    x = data()
    ref(x).square().mean().backward()
    model(my_rows(x)).square().mean().backward()
    for p, p_ref in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), 2 * p_ref.grad, rtol=1e-5, atol=1e-5)
    # parameters kept unsharded after backward: the next forward all-gathers nothing
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)
    model(my_rows(x)).square().mean().backward()
    assert not isinstance(model.blocks[0].lin.weight, DTensor)
    with CommDebugMode() as comm:
        out = model(my_rows(x))
    assert comm.get_comm_counts() == {}
    model.set_reshard_after_backward(True)
    model.set_requires_gradient_sync(True)
    out.square().mean().backward()
    assert all(isinstance(p, DTensor) for p in model.parameters())


@distributed(world_size=4)
def test_synced_backwards_accumulate_into_sharded_grads():
    ref = Net()
    model = shard_net(_copy(ref), make_mesh((4,)), reshard_after_forward=2)
    for scale in (1.0, 3.0):  # no zero_grad in between: the second reduce adds
        x = data() * scale
        ref(x).square().mean().backward()
        model(my_rows(x)).square().mean().backward()
    assert_grads_match(model, ref)


@distributed(world_size=2)
def test_root_can_reshard_after_forward_when_asked():
    ref = Net()
    model = shard_net(_copy(ref), make_mesh((2,)))
    model.set_reshard_after_forward(True, recurse=False)
    x = data()
    out = model(my_rows(x))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    ref(x).square().mean().backward()
    out.square().mean().backward()
    assert_grads_match(model, ref)


@distributed(world_size=2)
def test_reshard_after_forward_none_is_torchs_default():
    """``None`` (torch's default): blocks reshard after forward, the root keeps its parameters."""
    ref = Net()
    model = _copy(ref)
    for b in model.blocks:
        fully_shard(b, mesh=make_mesh((2,)), reshard_after_forward=None)
    fully_shard(model, mesh=make_mesh((2,)), reshard_after_forward=None)
    x = data()
    out = model(my_rows(x))
    assert all(isinstance(p, DTensor) for b in model.blocks for p in b.parameters())
    root_own = [p for n, p in model.named_parameters(recurse=True) if not n.startswith("blocks")]
    assert root_own and not any(isinstance(p, DTensor) for p in root_own)
    ref(x).square().mean().backward()
    out.square().mean().backward()
    assert_grads_match(model, ref)


# ----------------------------------------------------------------------------- errors


@distributed(world_size=4)
def test_bad_inputs_raise_clear_errors():
    mesh = make_mesh((4,))
    net = Net()
    fully_shard(net.blocks[0], mesh=mesh)
    with pytest.raises(RuntimeError, match="already applied"):
        fully_shard(net.blocks[0], mesh=mesh)
    with pytest.raises(ValueError, match="cuda"):
        fully_shard(Net(), mesh=DeviceMesh("cuda", list(range(4))))
    with pytest.raises(ValueError, match="1-D mesh .* or a 2-D mesh"):
        fully_shard(Net(), mesh=init_device_mesh("cpu", (1, 2, 2)))
    with pytest.raises(ValueError, match="reshard_after_forward"):
        fully_shard(Net(), mesh=mesh, reshard_after_forward=3)
    with pytest.raises(TypeError, match="shard_placement_fn"):
        fully_shard(Net(), mesh=mesh, shard_placement_fn=lambda p: Replicate())
    # a weight tied between two modules that are sharded by two separate calls
    tied = Net()
    tied.head.weight = nn.Parameter(torch.randn(3, 10))
    tied.inp2 = nn.Linear(10, 3)
    tied.inp2.weight = tied.head.weight
    fully_shard(tied.head, mesh=mesh)
    with pytest.raises(ValueError, match="already managed by fully_shard"):
        fully_shard(tied.inp2, mesh=mesh)
    # ... while tying inside one call works (one parameter, two owners)
    ok = Net()
    ok.extra = nn.Linear(10, 3)
    ok.extra.weight = ok.head.weight
    fully_shard(ok, mesh=mesh)
    assert ok.extra.weight is ok.head.weight and isinstance(ok.head.weight, DTensor)
    with pytest.raises(ValueError, match="0-d"):
        scalar = nn.Module()
        scalar.s = nn.Parameter(torch.tensor(1.0))
        fully_shard(scalar, mesh=mesh)
    dist.barrier()
