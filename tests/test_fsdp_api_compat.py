"""PyTorch 2.13 FSDP2 API surface beyond fully_shard's core: ``register_fsdp_forward_method``,
``set_unshard_in_backward``, ``set_requires_all_reduce`` and the small setters. Every test
compares against the same model in plain single-process torch."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dtensor_lite import DTensor
from fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from tests.harness import distributed
from tests.test_fsdp import make_mesh, my_rows
from tests.test_fsdp_hooks import assert_grads_match, data


# ----------------------------------------------------------------------------- forward methods


class Generator(nn.Module):
    """``generate`` calls the module (forward hooks) and uses the root's weight directly."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.inp(x)))

    def generate(self, x, scale=1.0):
        logits = self(x)
        # the root's parameters outside forward: only unsharded if FSDP's hooks ran around this
        return logits + scale * F.linear(torch.tanh(self.inp(x)), self.head.weight).square()


def sharded_generator(ref):
    model = copy.deepcopy(ref)
    mesh = make_mesh((2,))
    fully_shard(model.inp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model, "generate")
    return model


@distributed(world_size=2)
def test_register_fsdp_forward_method_grads_and_no_grad():
    torch.manual_seed(0)
    ref = Generator()
    model = sharded_generator(ref)
    x = data()
    ref.generate(x, scale=0.5).square().mean().backward()
    for _ in range(2):  # the second step: the hooks keep working, gradients accumulate
        model.generate(my_rows(x), scale=0.5).square().mean().backward()
    ref.generate(x, scale=0.5).square().mean().backward()
    assert_grads_match(model, ref)
    # without grad: values as torch's, every group resharded afterwards (no backward will)
    with torch.no_grad():
        out = model.generate(my_rows(x))
        torch.testing.assert_close(out, my_rows(ref.generate(x)), rtol=1e-5, atol=1e-5)
    for p in model.parameters():
        assert isinstance(p, DTensor), "a parameter stayed unsharded after a no_grad generate"
    # a method that raises ends its use; the next call runs normally
    with pytest.raises(TypeError):
        model.generate(my_rows(x), scale=None)
    torch.testing.assert_close(model(my_rows(x)), my_rows(ref(x)).detach(), rtol=1e-5, atol=1e-5)


@distributed(world_size=2)
def test_register_fsdp_forward_method_bad_inputs():
    plain = Generator()
    generate = plain.generate
    register_fsdp_forward_method(plain, "generate")  # not an FSDP module: left alone (as torch)
    assert plain.generate == generate and not isinstance(plain, FSDPModule)
    model = sharded_generator(Generator())
    with pytest.raises(ValueError, match="Generator has no attribute 'sample'"):
        register_fsdp_forward_method(model, "sample")
    with pytest.raises(ValueError, match="non-callable attribute 'training'"):
        register_fsdp_forward_method(model, "training")
    with pytest.raises(TypeError, match="takes an nn.Module, got int"):
        register_fsdp_forward_method(3, "generate")


# ----------------------------------------------------------------------------- unshard in backward


class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(torch.tanh(self.proj(self.embed(tokens))))


def tokens():
    return torch.randint(0, 20, (8, 5), generator=torch.Generator().manual_seed(3))


def backward_all_gathers(model, x):
    from dtensor_lite.debug import CommDebugMode
    loss = model(x).square().mean()
    with CommDebugMode() as comm:
        loss.backward()
    return comm.get_comm_counts().get("all_gather", 0)


@distributed(world_size=2)
def test_set_unshard_in_backward_embedding_needs_no_all_gather():
    torch.manual_seed(0)
    ref = Embedder()
    model = copy.deepcopy(ref)
    mesh = make_mesh((2,))
    fully_shard(model.embed, mesh=mesh)  # resharded after forward (not the root)
    fully_shard(model, mesh=mesh)        # the root keeps its parameters for backward
    x = tokens()
    ref(x).square().mean().backward()
    model.embed.set_unshard_in_backward(False)
    assert backward_all_gathers(model, my_rows(x)) == 0
    assert_grads_match(model, ref)
    ref(x).square().mean().backward()
    model.embed.set_unshard_in_backward(True)  # the default: one all-gather of the embedding
    assert backward_all_gathers(model, my_rows(x)) == 1
    assert_grads_match(model, ref)
    assert all(isinstance(p, DTensor) for p in model.parameters())


@distributed(world_size=2)
def test_set_unshard_in_backward_module_that_needs_its_parameters():
    model = Embedder()
    mesh = make_mesh((2,))
    fully_shard(model.proj, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.proj.set_unshard_in_backward(False)  # wrong: the linear's backward reads its weight
    loss = model(my_rows(tokens())).square().mean()
    with pytest.raises(RuntimeError, match="out of bounds for storage of size 0"):
        loss.backward()
    model.reset_iter_state()
    with pytest.raises(TypeError, match="takes a bool, got 0"):
        model.proj.set_unshard_in_backward(0)


# ----------------------------------------------------------------------------- all-reduce (HSDP)


@distributed(world_size=4)
def test_set_requires_all_reduce_accumulates_across_micro_batches():
    from dtensor_lite.debug import CommDebugMode
    from tests.test_fsdp_hooks import Net, shard_net
    torch.manual_seed(0)
    ref = Net()
    model = shard_net(copy.deepcopy(ref), make_mesh((2, 2)))  # (replicate, shard)
    micro = [data(rows=8), 2 * data(rows=8).flip(0)]
    for x in micro:  # one process, the whole batch of each micro-batch; gradients accumulate
        ref(x).square().mean().backward()
    counts = []
    for i, x in enumerate(micro):
        model.set_requires_all_reduce(i == len(micro) - 1)
        with CommDebugMode() as comm:
            model(my_rows(x)).square().mean().backward()
        counts.append(comm.get_comm_counts())
        if i == 0:  # kept as partial sums, not written
            assert all(p.grad is None for p in model.parameters())
    # 3 groups (3 + 2 all-gathers): each reduce-scatters per micro-batch, all-reduces once
    assert counts == [{"all_gather": 5, "reduce_scatter": 3},
                      {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 3}]
    assert_grads_match(model, ref)
    assert all(not g.partial_reduce for g in model._get_fsdp_state().ctx.groups)


# ----------------------------------------------------------------------------- small setters


@distributed(world_size=2)
def test_small_setters_divide_factor_sum_reduction_post_optim_event_share_comm_ctx():
    from fsdp import share_comm_ctx
    from tests.test_fsdp_hooks import Net, shard_net
    torch.manual_seed(0)
    ref = Net()
    model = shard_net(copy.deepcopy(ref), make_mesh((2,)))
    x = data()
    ref(x).square().mean().backward()
    for m in (model, *model.blocks):  # not recursive (as torch): every group
        with pytest.warns(DeprecationWarning, match="set_gradient_divide_factor"):
            m.set_reduce_scatter_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # ours sum anyway: values unchanged
    model.set_post_optim_event(torch.Event("cpu"))  # CPU: nothing to wait for
    share_comm_ctx([model, *model.blocks])          # one set of streams per device already
    model(my_rows(x)).square().mean().backward()
    assert model._get_fsdp_state().post_optim_event is None  # used by that forward, once
    for p in ref.parameters():  # divided by 1: the sum over the 2 ranks' mean losses
        p.grad *= 2
    assert_grads_match(model, ref)
    with pytest.raises(TypeError, match="takes a torch.Event .* got str"):
        model.set_post_optim_event("after step")
    with pytest.raises(TypeError, match="takes a bool, got 1"):
        model.set_force_sum_reduction_for_comms(1)
    with pytest.raises(ValueError, match="share_comm_ctx takes modules that fully_shard was "
                                         "applied to, got Linear"):
        share_comm_ctx([model, nn.Linear(2, 2)])


# ----------------------------------------------------------------------------- all-reduce hook


@distributed(world_size=4)
def test_set_all_reduce_hook_replicates_by_hand_and_after_hsdp():
    import torch.distributed as dist
    from tests.test_fsdp_hooks import Net, shard_net
    torch.manual_seed(0)
    ref = Net()
    x = data()
    ref(x).square().mean().backward()
    mesh = make_mesh((2, 2))  # (replicate, shard)
    # 1-D FSDP over "shard"; the hook averages across "replicate" itself: torch's whole-batch mean
    model = shard_net(copy.deepcopy(ref), mesh["shard"])
    replicas = mesh.get_group("replicate")
    seen = []

    def across_replicas(reduced):
        seen.append(reduced.numel())
        dist.all_reduce(reduced, group=replicas)
        reduced.div_(replicas.size())

    for m in (model, *model.blocks):  # not recursive: one call per group
        m.set_all_reduce_hook(across_replicas)
    model(my_rows(x)).square().mean().backward()
    assert_grads_match(model, ref)
    assert len(seen) == 3  # once per group (one gradient dtype each)
    # HSDP: the hook sees the all-reduced, divided gradient
    hsdp = shard_net(copy.deepcopy(ref), mesh)
    for m in (hsdp, *hsdp.blocks):
        m.set_all_reduce_hook(lambda reduced: reduced.mul_(3))
    hsdp(my_rows(x)).square().mean().backward()
    for p, p_ref in zip(hsdp.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), 3 * p_ref.grad, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="stream cannot be set when using HSDP"):
        hsdp.set_all_reduce_hook(lambda r: None, stream=object())
    with pytest.raises(TypeError, match="takes a callable hook.* got int"):
        hsdp.set_all_reduce_hook(3)


# ----------------------------------------------------------------------------- unused parameters


class TwoExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(6, 4) for _ in range(2))

    def forward(self, x, expert):
        return self.experts[expert](x)


@distributed(world_size=2)
def test_set_reduce_scatter_unused_params_ranks_use_different_experts():
    import torch.distributed as dist
    torch.manual_seed(0)
    ref = TwoExperts()
    model = copy.deepcopy(ref)
    fully_shard(model, mesh=make_mesh((2,)))
    model.set_reduce_scatter_unused_params(True)
    x = data()
    rows = x.chunk(2)
    # rank r runs expert r on its rows; the data-parallel loss is the mean of the ranks' losses
    sum(ref(rows[r], r).square().mean() for r in range(2)).div(2).backward()
    rank = dist.get_rank()
    model(my_rows(x), rank).square().mean().backward()
    assert_grads_match(model, ref)
    with pytest.raises(TypeError, match="takes a bool, got None"):
        model.set_reduce_scatter_unused_params(None)
