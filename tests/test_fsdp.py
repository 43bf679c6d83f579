"""fully_shard trains a Llama-style model exactly like single-process torch on the global batch.

Every rank builds the same reference model from the same seed and trains it on the whole batch;
the FSDP copy trains on this rank's rows. Losses (averaged over ranks) must match the reference at
every step (fp32: relative difference <= 1e-5), and so must the parameters at the end.

The other fsdp test files import the helpers below.
"""
import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dtensor_lite import init_device_mesh
from examples.llama import Llama, LlamaConfig, loss_fn, rotary_tables
from fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from tests.harness import TEST_DEVICE, distributed

# uneven on purpose: 18 rows over 4 ranks are pieces of 5, 5, 5, 3; 66 of 17, 17, 17, 15
CFG = LlamaConfig(vocab_size=66, dim=18, n_layers=2, n_heads=3, ffn_dim=30, max_seq_len=16)
BATCH, SEQ = 8, 9
LR = 1e-2


def make_mesh(shape):
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def shard_llama(model, mesh, **kwargs):
    """fully_shard each block, then the root (embeddings, final norm, output)."""
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kwargs)
    kwargs.pop("reshard_after_forward", None)
    return fully_shard(model, mesh=mesh, **kwargs)


def batches(steps, micro=1):
    """The same global batches on every rank."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
            for _ in range(steps * micro)]


def my_rows(tokens):
    world, rank = dist.get_world_size(), dist.get_rank()
    n = tokens.shape[0] // world
    return tokens[rank * n:(rank + 1) * n]


def global_mean(x):
    t = x.detach().float().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def rel(a, b):
    a, b = (float(x.detach()) if torch.is_tensor(x) else float(x) for x in (a, b))
    return abs(a - b) / max(abs(b), 1e-12)


def reference_and_sharded(mesh, *, freeze=(), meta=False, **kwargs):
    torch.manual_seed(0)
    ref = Llama(CFG)
    for name, p in ref.named_parameters():
        if name in freeze:
            p.requires_grad_(False)
    if meta:
        with torch.device("meta"):
            model = Llama(CFG)
        for name, p in model.named_parameters():
            if name in freeze:
                p.requires_grad_(False)
    else:
        model = copy.deepcopy(ref)
    shard_llama(model, mesh, **kwargs)
    if meta:
        model.to_empty(device=TEST_DEVICE)
        torch.manual_seed(0)  # the reference's init draws, in the same order
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        model.rope_cos, model.rope_sin = rotary_tables(CFG)
    return ref, model


def train_and_compare(mesh, *, steps=10, micro=1, freeze=(), meta=False, tol=1e-5, **kwargs):
    ref, model = reference_and_sharded(mesh, freeze=freeze, meta=meta, **kwargs)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    data = batches(steps, micro)
    worst = 0.0
    for step in range(steps):
        ref_loss = loss = 0.0
        for m in range(micro):
            tokens = data[step * micro + m]
            if micro > 1:
                model.set_requires_gradient_sync(m == micro - 1)
            rl = loss_fn(ref(tokens[:, :-1]), tokens[:, 1:]) / micro
            rl.backward()
            mine = my_rows(tokens)
            fl = loss_fn(model(mine[:, :-1]), mine[:, 1:]) / micro
            fl.backward()
            ref_loss, loss = ref_loss + rl.item(), loss + global_mean(fl).item()
        worst = max(worst, rel(loss, ref_loss))
        assert rel(loss, ref_loss) <= tol, f"step {step}: loss {loss} vs reference {ref_loss}"
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        full = p.full_tensor()
        torch.testing.assert_close(full, p_ref.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"parameter {name}: {m}")
    return worst, ref, model


# ----------------------------------------------------------------------------- fp32 parity


@distributed(world_size=2)
def test_llama_parity_world2():
    train_and_compare(make_mesh((2,)))


@distributed(world_size=4)
@pytest.mark.parametrize("raf", [True, False, 2], ids=lambda v: f"raf={v}")
def test_llama_parity_world4(raf):
    _, _, model = train_and_compare(make_mesh((4,)), reshard_after_forward=raf)
    assert isinstance(model, FSDPModule) and type(model).__name__ == "FSDPLlama"


@distributed(world_size=4)
def test_llama_parity_hsdp_2x2():
    train_and_compare(make_mesh((2, 2)))


@distributed(world_size=4)
def test_llama_parity_hsdp_2x2_reshard_to_2():
    # N=2 is the whole shard dim here: the same as True
    train_and_compare(make_mesh((2, 2)), steps=4, reshard_after_forward=2)


@distributed(world_size=8, timeout=300)
def test_llama_parity_hsdp_2x4_reshard_to_2():
    """HSDP with 4-way shards that keep 2-way pieces between forward and backward."""
    train_and_compare(make_mesh((2, 4)), steps=3, reshard_after_forward=2)


@distributed(world_size=4)
def test_llama_parity_gradient_accumulation():
    train_and_compare(make_mesh((4,)), steps=6, micro=2)


@distributed(world_size=4)
def test_llama_parity_frozen_params():
    frozen = ("layers.0.attention.wq.weight", "layers.1.attention_norm.weight",
              "layers.1.feed_forward.w2.weight", "norm.weight")
    _, ref, model = train_and_compare(make_mesh((4,)), steps=6, freeze=frozen)
    tokens = batches(1)[0]
    mine = my_rows(tokens)
    loss_fn(model(mine[:, :-1]), mine[:, 1:]).backward()
    for name, p in model.named_parameters():
        assert p.requires_grad == (name not in frozen), name
        assert (p.grad is None) == (name in frozen), name


@distributed(world_size=4)
def test_llama_parity_meta_init():
    """meta -> fully_shard -> to_empty -> reset_parameters: the same init as the reference."""
    mesh = make_mesh((4,))
    ref, model = reference_and_sharded(mesh, meta=True)
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert p.to_local().device.type == "cpu"
        torch.testing.assert_close(p.full_tensor(), p_ref.detach(), msg=lambda m: f"{name}: {m}")
    train_and_compare(mesh, steps=4, meta=True)


@distributed(world_size=2)
def test_meta_init_deterministic_values():
    """Deterministic inits on sharded parameters materialise only this rank's piece."""
    mesh = make_mesh((2,))
    with torch.device("meta"):
        model = Llama(CFG)
    shard_llama(model, mesh)
    model.to_empty(device=TEST_DEVICE)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(0.01 * (i + 1))
    for i, p in enumerate(model.parameters()):
        chunk = math.ceil(p.shape[0] / 2)
        assert p.to_local().shape[0] == min(chunk, p.shape[0] - chunk * dist.get_rank())
        torch.testing.assert_close(p.full_tensor(), torch.full(p.shape, 0.01 * (i + 1)))


# ----------------------------------------------------------------------------- mixed precision


def _cast_inputs_hook(dtype):
    def hook(module, args, kwargs):
        def cast(x):
            return x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
    return hook


def bf16_copy(module, blocks="layers"):
    """What FSDP computes with under ``param_dtype=bf16``: a bf16 copy of the fp32 masters, with
    floating inputs cast to bf16 at every FSDP module (the root and each of its ``blocks``)."""
    low = copy.deepcopy(module)
    for m in low.modules():  # new Parameters: ``p.data = ...`` would not recast a DTensor's local
        for name, p in m.named_parameters(recurse=False):
            setattr(m, name, nn.Parameter(p.detach().to(torch.bfloat16)))
    for m in [low, *getattr(low, blocks)]:
        m.register_forward_pre_hook(_cast_inputs_hook(torch.bfloat16), with_kwargs=True)
    return low


def fp32_sum_bound(parts):
    """Largest difference between two fp32 sums of ``parts`` taken in different orders: each is
    within gamma_(n-1) * sum|x| of the exact sum (n - 1 roundings of unit 2**-24), so they are
    within twice that of each other. A division by the world size adds one rounding each."""
    n = len(parts)
    return 2 * (n + 1) * 2.0 ** -24 * sum(x.abs() for x in parts)


@distributed(world_size=4)
def test_llama_bf16_params_fp32_reduce():
    """bf16 compute, fp32 reduce-scatter, fp32 sharded parameters.

    The reference runs the very same bf16 kernels on the very same inputs: on every rank a bf16
    copy of the current fp32 masters computes this rank's rows (the shapes FSDP computes), so its
    loss and bf16 gradients are identical bit for bit, on any CPU, thread count or oneDNN setting.
    The only computation whose order may differ is the fp32 sum over ranks (our all_reduce vs
    FSDP's reduce-scatter), bounded by ``fp32_sum_bound``. Comparing fresh at every step (the
    reference restarts from FSDP's masters) keeps AdamW, which turns tiny gradient differences on
    near-zero elements into whole LR-sized steps, from amplifying that bound across steps.
    """
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = make_mesh((4,))
    ref, model = reference_and_sharded(mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for tokens in batches(4):
        with torch.no_grad():
            for p, p_ref in zip(model.parameters(), ref.parameters()):
                p_ref.copy_(p.full_tensor())
        low = bf16_copy(ref)
        mine = my_rows(tokens)
        ref_loss = loss_fn(low(mine[:, :-1]), mine[:, 1:])
        ref_loss.backward()
        logits = model(mine[:, :-1])
        assert logits.dtype == torch.bfloat16
        loss = loss_fn(logits, mine[:, 1:])
        loss.backward()
        assert torch.equal(loss.detach(), ref_loss.detach())
        for (name, p), p_low in zip(model.named_parameters(), low.parameters()):
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
            parts = [torch.empty_like(p_low.grad, dtype=torch.float32) for _ in range(4)]
            dist.all_gather(parts, p_low.grad.float())
            expected = sum(parts) / 4
            err = (p.grad.full_tensor() - expected).abs()
            assert bool((err <= fp32_sum_bound(parts)).all()), (name, float(err.max()))
        opt.step()
        opt.zero_grad()
