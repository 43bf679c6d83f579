"""Mixed-dtype groups, all-gather extensions on a tensor subclass, dtype/device moves of a sharded
model, CPU offload, gradient clipping and state dicts."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dtensor_lite import DTensor, Shard
from dtensor_lite.debug import CommDebugMode
from examples.llama import Llama, loss_fn
from fsdp import CPUOffloadPolicy, fully_shard
from tests.harness import distributed
from tests.test_fsdp import (CFG, batches, bf16_copy, global_mean, make_mesh, my_rows, rel,
                             shard_llama)
from tests.test_fsdp_hooks import Net, assert_grads_match, data, shard_net


# ----------------------------------------------------------------------------- mixed dtypes


class TwoDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3).double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).double()).float()


@distributed(world_size=4)
def test_mixed_dtype_group_one_all_gather():
    ref = TwoDtypes()
    model = copy.deepcopy(ref)
    fully_shard(model, mesh=make_mesh((4,)))
    model.set_reshard_after_forward(True)
    x = data()
    ref(x).square().mean().backward()
    with CommDebugMode() as comm:
        model(my_rows(x)).square().mean().backward()
    assert_grads_match(model, ref)
    assert model.b.weight.dtype == torch.float64 and model.b.weight.grad.dtype == torch.float64
    # one byte-buffer all-gather per pass (16-byte aligned segments), one reduce-scatter per dtype
    counts = comm.get_comm_counts()
    assert counts == {"all_gather": 2, "reduce_scatter": 2}
    seg = [2 * 6 * 4, 2 * 4, 1 * 5 * 8, 1 * 8]  # per-rank padded pieces in bytes: a.w a.b b.w b.b
    chunk = sum(-(-s // 16) * 16 for s in seg)
    assert comm.get_comm_bytes()["all_gather"] == 2 * 3 * chunk


# ----------------------------------------------------------------------------- extensions


class Int8Weight(torch.Tensor):
    """A float weight that FSDP all-gathers as int8 values plus one float scale per row
    (PyTorch's fsdp_pre_all_gather / fsdp_post_all_gather protocol)."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_subclass(cls, data, False)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        x = self.as_subclass(torch.Tensor)
        chunk = -(-outer_size[0] // mesh.size())
        q, scale = quantize_rows(x)
        pad = chunk - x.shape[0]  # uneven shards: every rank sends padded pieces
        q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
        scale = torch.cat([scale, scale.new_ones(pad)])
        return (q, scale), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        q, scale = outputs
        w = q.to(param_dtype) * scale.to(param_dtype)[:, None]
        if out is not None:
            out.copy_(w[:out.shape[0]])
            return None
        return w, (w,)


def quantize_rows(x):
    scale = x.abs().amax(dim=1).clamp(min=1e-8) / 127
    return torch.round(x / scale[:, None]).to(torch.int8), scale


@distributed(world_size=4)
def test_all_gather_extension_int8_subclass():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 10), nn.Tanh(), nn.Linear(10, 3))
    model = copy.deepcopy(ref)
    # frozen int8-gathered weight; its forward uses the dequantized values
    w = ref[0].weight.detach()
    q, scale = quantize_rows(w)
    ref[0].weight = nn.Parameter(q.float() * scale[:, None], requires_grad=False)
    model[0].weight = nn.Parameter(Int8Weight(w.clone()), requires_grad=False)
    fully_shard(model[0], mesh=make_mesh((4,)))
    fully_shard(model, mesh=make_mesh((4,)))
    assert type(model[0].weight.to_local()) is Int8Weight
    x = data(d=8)
    ref(x).square().mean().backward()
    for _ in range(2):  # the second pass refills the unsharded weight in place (out=)
        model.zero_grad()
        with CommDebugMode() as comm:
            out = model(my_rows(x))
            out.square().mean().backward()
        torch.testing.assert_close(out, ref(my_rows(x)), rtol=1e-5, atol=1e-6)
        assert_grads_match(model, ref)
    # block 0 sends 3 padded int8 rows + 3 scales + 3 bias rows instead of 3 fp32 rows + bias
    first_ag = [c for c in comm.calls if c[0] == "all_gather"][1]
    assert first_ag[1] == 3 * (32 + 16 + 16)
    assert first_ag[1] < 3 * (3 * 8 * 4 + 3 * 4)


# ----------------------------------------------------------------------------- moves, offload


@distributed(world_size=2)
def test_to_cpu_and_to_float64_keep_params_sharded_and_trainable():
    ref = Net()
    model = shard_net(copy.deepcopy(ref), make_mesh((2,)))
    model.to("cpu")
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) and p.requires_grad
               for p in model.parameters())
    ref.double()
    model.to(torch.float64)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float64 for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = data().double()
    for _ in range(2):
        ref(x).square().mean().backward()
        model(my_rows(x)).square().mean().backward()
        assert_grads_match(model, ref)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


@distributed(world_size=2)
def test_cpu_offload_policy_trains():
    ref = Net()
    model = copy.deepcopy(ref)
    for b in model.blocks:
        fully_shard(b, mesh=make_mesh((2,)), offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=make_mesh((2,)), offload_policy=CPUOffloadPolicy())
    x = data()
    ref(x).square().mean().backward()
    model(my_rows(x)).square().mean().backward()
    assert_grads_match(model, ref)
    assert all(p.to_local().device.type == "cpu" and p.grad.to_local().device.type == "cpu"
               for p in model.parameters())


# ----------------------------------------------------------------------------- clipping, state


@distributed(world_size=4)
def test_clip_grad_norm_matches_full_model():
    torch.manual_seed(0)
    ref = Llama(CFG)
    model = shard_llama(copy.deepcopy(ref), make_mesh((4,)))
    tokens = batches(1)[0]
    ref_loss = loss_fn(ref(tokens[:, :-1]), tokens[:, 1:])
    ref_loss.backward()
    mine = my_rows(tokens)
    loss = loss_fn(model(mine[:, :-1]), mine[:, 1:])
    loss.backward()
    assert rel(global_mean(loss), ref_loss) < 1e-5
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    torch.testing.assert_close(norm.full_tensor(), ref_norm, rtol=1e-5, atol=1e-6)
    for p, p_ref in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, rtol=1e-4, atol=1e-6)


@distributed(world_size=2)
def test_state_dict_exposes_dtensors_and_loads():
    ref = Net()
    model = shard_net(copy.deepcopy(ref), make_mesh((2,)))
    sd = model.state_dict()
    assert list(sd) == list(ref.state_dict())
    for k, v in sd.items():
        assert isinstance(v, DTensor) and v.placements == (Shard(0),), k
        torch.testing.assert_close(v.full_tensor(), ref.state_dict()[k])
    other = shard_net(Net(), make_mesh((2,)))
    other.load_state_dict(sd)
    x = my_rows(data())
    torch.testing.assert_close(other(x), model(x))


@distributed(world_size=2)
def test_state_dict_between_forward_and_backward():
    """The root keeps its gathered parameters from forward to backward; a state dict taken in
    between still sees the sharded DTensors, and the backward still matches. Loading one in
    between writes the parameters in place, which plain torch's backward refuses (a saved
    parameter modified in place): so does ours, and reset_iter_state() recovers."""
    ref = Net()
    model = shard_net(copy.deepcopy(ref), make_mesh((2,)))
    x = data()
    loss = model(my_rows(x)).sum()
    sd = model.state_dict()
    for k, v in sd.items():
        assert isinstance(v, DTensor) and v.placements == (Shard(0),), k
        torch.testing.assert_close(v.full_tensor(), ref.state_dict()[k])
    loss.backward()
    ref(x).sum().backward()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert isinstance(p, DTensor), name
        # each rank's loss sums its rows; FSDP averages over the 2 ranks
        torch.testing.assert_close(p.grad.full_tensor() * 2, p_ref.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"grad of {name}: {m}")

    plain = copy.deepcopy(ref)
    loss = plain(x).sum()
    plain.load_state_dict(plain.state_dict())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    loss = model(my_rows(x)).sum()
    model.load_state_dict(model.state_dict())   # in place, into the sharded parameters
    with pytest.raises(RuntimeError, match="modified by an in-place operation after a forward"):
        loss.backward()
    model.reset_iter_state()
    model(my_rows(x)).sum().backward()


@distributed(world_size=2)
def test_output_dtype_input_cast_and_bf16_reduce():
    from fsdp import MixedPrecisionPolicy
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    ref = Net()
    net = copy.deepcopy(ref)
    mesh = make_mesh((2,))
    for b in net.blocks:
        fully_shard(b, mesh=mesh, mp_policy=mp)
    # only the root's outputs go back to fp32: inside, every module computes in bf16
    fully_shard(net, mesh=mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, output_dtype=torch.float32))
    seen = []
    net.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    x = my_rows(data())
    out = net(x)  # reduce_dtype None: gradients are reduced in bf16
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    out.square().mean().backward()
    # the same bf16 kernels on the same rows give identical bf16 gradients; reduced in bf16, the
    # sum of two ranks' values is one rounding either way round (a + b == b + a) and halving is
    # exact, so FSDP's gradient equals (g0 + g1) / 2 in bf16 bit for bit, on any CPU
    low = bf16_copy(ref, blocks="blocks")
    low(x).float().square().mean().backward()
    for p, p_low in zip(net.parameters(), low.parameters()):
        assert p.dtype == p.grad.dtype == torch.float32
        parts = [torch.empty_like(p_low.grad) for _ in range(2)]
        dist.all_gather(parts, p_low.grad)
        assert torch.equal(p.grad.full_tensor(), ((parts[0] + parts[1]) / 2).float())
