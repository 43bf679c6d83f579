"""FSDP API added in torch 2.15, against a plain single-process model as the oracle:

* manual backward finalization: ``set_manual_backward_finalization``, ``finalize_backward``
  (sync and ``async_op=True`` with its ``GradientReductionHandle``) -- when the reductions
  happen, the gradients they give, and torch's errors;
* ``set_keep_unsharded_storage``: the unsharded storage survives resharding (same addresses);
* ``MixedPrecisionPolicy(param_dtype_override_fn=)``: per-parameter compute dtypes.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dtensor_lite import init_device_mesh
from dtensor_lite.debug import CommDebugMode
from fsdp import FSDPModule, GradientReductionHandle, MixedPrecisionPolicy, fully_shard
from tests.harness import distributed

WORLD = 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.out(x)


def _models(**kw):
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (WORLD,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return ref, model


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4 * WORLD, 6, generator=g)


def _mine(x):
    return x.chunk(WORLD)[dist.get_rank()]


def _loss(model, x):
    return model(x).pow(2).mean()


def _ref_grads(ref, seeds):
    """The reference's gradients of the mean loss of each global batch, summed over batches
    (what FSDP's averaged gradients of equal halves add up to)."""
    ref.zero_grad()
    for s in seeds:
        _loss(ref, _batch(s)).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _assert_grads(model, want):
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.allclose(p.grad.full_tensor(), want[name], atol=1e-6), name


def _rs(mode) -> int:
    return mode.get_comm_counts().get("reduce_scatter", 0)


@distributed(world_size=WORLD)
def test_manual_finalization_reduces_accumulated_gradients_once():
    ref, model = _models()
    model.set_manual_backward_finalization(True)
    model.set_requires_gradient_sync(False)
    with CommDebugMode() as backward_comm:
        for s in (1, 2):
            _loss(model, _mine(_batch(s))).backward()
    assert _rs(backward_comm) == 0
    assert all(p.grad is None for p in model.parameters())
    model.set_requires_gradient_sync(True)
    with CommDebugMode() as finalize_comm:
        assert model.finalize_backward() is None
    assert _rs(finalize_comm) == 3  # one reduce-scatter per group, all here
    _assert_grads(model, _ref_grads(ref, (1, 2)))
    # the next step runs as usual in the same mode
    model.zero_grad()
    _loss(model, _mine(_batch(3))).backward()
    model.finalize_backward()
    _assert_grads(model, _ref_grads(ref, (3,)))


@distributed(world_size=WORLD)
def test_manual_finalization_leaves_the_last_reduction_to_finalize():
    ref, model = _models()
    _loss(model, _mine(_batch(1))).backward()  # automatic: everything is in .grad after it
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad()

    model.set_manual_backward_finalization(True)
    with CommDebugMode() as backward_comm:
        _loss(model, _mine(_batch(1))).backward()
    assert _rs(backward_comm) == 3  # issued during backward, as their gradients completed
    # the last one is still in flight: its group's gradients are not in .grad yet
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert 0 < len(missing) < len(list(model.parameters())), missing
    with CommDebugMode() as finalize_comm:
        model.finalize_backward()
    assert _rs(finalize_comm) == 0
    _assert_grads(model, _ref_grads(ref, (1,)))


@distributed(world_size=WORLD)
def test_async_finalization_returns_a_handle():
    ref, model = _models()
    model.set_manual_backward_finalization(True)
    _loss(model, _mine(_batch(1))).backward()
    handle = model.finalize_backward(async_op=True)
    assert isinstance(handle, GradientReductionHandle)
    with pytest.raises(RuntimeError, match="waited on before finalizing backward again"):
        model.finalize_backward()
    with pytest.raises(RuntimeError, match="waited on before forward"):
        model(_mine(_batch(1)))
    handle.wait()
    handle.wait()  # a second wait does nothing
    _assert_grads(model, _ref_grads(ref, (1,)))
    model(_mine(_batch(2)))  # forward is allowed again


@distributed(world_size=WORLD)
def test_reset_iter_state_invalidates_the_handle():
    ref, model = _models()
    model.set_manual_backward_finalization(True)
    _loss(model, _mine(_batch(1))).backward()
    handle = model.finalize_backward(async_op=True)
    model.reset_iter_state()
    with pytest.raises(RuntimeError, match="handle was invalidated"):
        handle.wait()
    model.zero_grad()
    _loss(model, _mine(_batch(2))).backward()  # the next iteration runs normally
    model.finalize_backward()
    _assert_grads(model, _ref_grads(ref, (2,)))


@distributed(world_size=WORLD)
def test_manual_finalization_errors_as_torch():
    _, model = _models()
    assert model.finalize_backward() is None  # before the first forward: a no-op
    model.finalize_backward(async_op=True).wait()
    _loss(model, _mine(_batch(1))).backward()
    with pytest.raises(RuntimeError, match=r"requires manual backward finalization.*"
                                           r"set_manual_backward_finalization\(True\)"):
        model.finalize_backward()
    with pytest.raises(RuntimeError, match="must be called on the root"):
        model.blocks[0].set_manual_backward_finalization(True)
    model.set_manual_backward_finalization(True)
    _loss(model, _mine(_batch(1))).backward()
    with pytest.raises(RuntimeError, match="cannot change mode after backward starts"):
        model.set_manual_backward_finalization(False)
    with pytest.raises(RuntimeError, match="finalize_backward must be called on the root"):
        model.blocks[1].finalize_backward()
    model.finalize_backward()
    model.set_manual_backward_finalization(False)  # allowed again once finalized
    with pytest.raises(TypeError, match="takes a bool"):
        model.set_manual_backward_finalization(1)

    _, other = _models()
    other.blocks[0].set_manual_backward_finalization(True)  # not known as non-root yet
    with pytest.raises(RuntimeError, match="must be called on the root FSDP module"):
        other(_mine(_batch(1)))


@distributed(world_size=WORLD)
def test_keep_unsharded_storage_keeps_the_same_memory():
    ref, model = _models()
    seen = []
    model.blocks[1].register_forward_pre_hook(
        lambda mod, args: seen.append(mod.weight.untyped_storage().data_ptr()))
    block = fully_shard.state(model.blocks[1]).group
    _loss(model, _mine(_batch(1))).backward()
    assert block.unsharded_nbytes() == 0  # default: freed at reshard

    model.set_keep_unsharded_storage(True)
    model.zero_grad()
    for step in (2, 3):
        _loss(model, _mine(_batch(step))).backward()
        assert block.unsharded_nbytes() == sum(p.numel() for p in ref.blocks[1].parameters()) * 4
        _assert_grads(model, _ref_grads(ref, (step,)))
        model.zero_grad()
    assert seen[-1] == seen[-2]  # refilled in place
    model.set_keep_unsharded_storage(False, recurse=True)
    _loss(model, _mine(_batch(4))).backward()
    assert block.unsharded_nbytes() == 0
    # recurse=False: the root's own group only
    model.set_keep_unsharded_storage(True, recurse=False)
    assert all(p.keep_unsharded_storage for p in fully_shard.state(model).group.params)
    assert not any(p.keep_unsharded_storage for p in block.params)


class Scaled(nn.Module):
    """A linear layer in the compute dtype, then a scale kept in float32."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.seen = []

    def forward(self, x):
        self.seen.append((self.lin.weight.dtype, self.scale.dtype, x.dtype))
        return self.lin(x).float() * self.scale


def _scaled_ref(model, x):
    """The reference computes what the policy asks for: the linear layer in bfloat16."""
    lin = model.lin
    y = nn.functional.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16())
    return y.float() * model.scale


@distributed(world_size=WORLD)
def test_param_dtype_override_fn_keeps_chosen_parameters_in_their_dtype():
    torch.manual_seed(0)
    ref = Scaled()
    model = copy.deepcopy(ref)
    asked = []
    scale = model.scale  # the override sees the user's parameters, before sharding

    def keep_scale(p):
        asked.append(tuple(p.shape))
        return p.dtype if p is scale else None

    mesh = init_device_mesh("cpu", (WORLD,))
    refused = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                   param_dtype_override_fn=lambda p: torch.float16)
    with pytest.raises(ValueError, match="param_dtype_override_fn must return None"):
        fully_shard(model, mesh=mesh, mp_policy=refused)
    assert not isinstance(model, FSDPModule)  # refused before anything was sharded
    assert all(type(p) is nn.Parameter for p in model.parameters())

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                              param_dtype_override_fn=keep_scale)
    asked.clear()
    fully_shard(model, mesh=mesh, mp_policy=mp)
    assert sorted(asked) == sorted([(6, 6), (6,), (6,)])  # once per parameter, when applied
    x = _batch(1)  # the same batch on every rank: the averaged gradient is the reference's
    model(x).pow(2).mean().backward()
    assert model.seen == [(torch.bfloat16, torch.float32, torch.bfloat16)]
    _scaled_ref(ref, x).pow(2).mean().backward()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32  # the sharded parameters keep their own dtype
        assert torch.equal(p.grad.full_tensor(), dict(ref.named_parameters())[name].grad), name


def test_param_dtype_override_fn_rejects_other_dtypes():
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                              param_dtype_override_fn=lambda p: torch.float16)
    with pytest.raises(ValueError, match="must return None, param_dtype, or the parameter's "
                                         "original dtype but got torch.float16"):
        mp._resolve_for_param(nn.Parameter(torch.zeros(2)))
    bad = MixedPrecisionPolicy(param_dtype_override_fn=lambda p: "float32")
    with pytest.raises(ValueError, match="must return a torch.dtype or None"):
        bad._resolve_for_param(nn.Parameter(torch.zeros(2)))
    keep = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                param_dtype_override_fn=lambda p: p.dtype)
    assert keep._resolve_for_param(nn.Parameter(torch.zeros(2))).param_dtype == torch.float32
    with pytest.raises(TypeError):  # keyword only, as torch's
        MixedPrecisionPolicy(None, None, None, True, lambda p: None)
