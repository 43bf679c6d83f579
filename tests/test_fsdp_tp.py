"""fully_shard on top of tensor parallelism: DTensor parameters over the "tp" dim of a 2-D / 3-D
mesh are sharded again over the data-parallel dims and become ONE DTensor over all dims.

The oracle is single-process torch: ``full_tensor()`` of every parameter equals the unsharded
weight before and after training, and losses match training on the global batch.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dtensor_lite import (DTensor, Partial, Replicate, Shard, _StridedShard, distribute_tensor,
                          init_device_mesh)
from fsdp import fully_shard
from tests.harness import TEST_DEVICE, distributed

MESHES = {
    "fsdp+tp 2x2": ((2, 2), ("dp", "tp")),
    "hsdp+tp 2x2x2": ((2, 2, 2), ("dp_replicate", "dp_shard", "tp")),
}


def _meshes(shape, names):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return mesh, mesh[names[:-1]], mesh["tp"]


def _mlp(dims):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dims[0], dims[1]), nn.ReLU(), nn.Linear(dims[1], dims[2]))


def _tp_by_hand(model, tp):
    """Column-wise first linear, row-wise second: placements set by hand (no tp package)."""
    first, second = model[0], model[2]
    first.weight = nn.Parameter(distribute_tensor(first.weight.detach(), tp, [Shard(0)]))
    first.bias = nn.Parameter(distribute_tensor(first.bias.detach(), tp, [Shard(0)]))
    second.weight = nn.Parameter(distribute_tensor(second.weight.detach(), tp, [Shard(1)]))
    second.bias = nn.Parameter(distribute_tensor(second.bias.detach(), tp, [Replicate()]))


def _dp_rank(dp):
    coord = dp.get_coordinate()
    return coord[0] if len(coord) == 1 else coord[0] * dp.shape[1] + coord[1]


def _train_and_compare(shape, names, dims, steps=4):
    mesh, dp, tp = _meshes(shape, names)
    ref = _mlp(dims)
    model = copy.deepcopy(ref)
    _tp_by_hand(model, tp)
    fully_shard(model, mesh=dp)
    params = dict(model.named_parameters())
    for name, p_ref in ref.named_parameters():
        assert params[name].device_mesh == mesh and params[name].device_mesh.ndim == len(shape)
        assert torch.equal(params[name].full_tensor(), p_ref), name
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    rows, n_dp, me = 3, dp.size(), _dp_rank(dp)
    worst = 0.0
    for _ in range(steps):
        x = torch.randn(rows * n_dp, dims[0], generator=g)
        ref_loss = ref(x).pow(2).mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out = model(DTensor.from_local(x[me * rows:(me + 1) * rows], tp, [Replicate()]))
        loss = out.full_tensor().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        worst = max(worst, abs(float(mean) - float(ref_loss)) / abs(float(ref_loss)))
    assert worst <= 1e-5, worst
    for name, p_ref in ref.named_parameters():
        torch.testing.assert_close(params[name].full_tensor(), p_ref, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


@distributed(world_size=4, timeout=120)
@pytest.mark.parametrize("dims", [(6, 8, 6), (5, 7, 3)], ids=["even", "uneven"])
def test_fsdp_over_tp_2d(dims):
    _train_and_compare(*MESHES["fsdp+tp 2x2"], dims)


@distributed(world_size=8, timeout=180)
def test_hsdp_over_tp_3d():
    _train_and_compare(*MESHES["hsdp+tp 2x2x2"], (5, 7, 3))


@distributed(world_size=4, timeout=60)
def test_layouts_when_both_shard_dim_0():
    """dp splits each TP piece: the public spelling is PyTorch's _StridedShard."""
    mesh, dp, tp = _meshes(*MESHES["fsdp+tp 2x2"])
    model = _mlp((6, 8, 6))
    _tp_by_hand(model, tp)
    fully_shard(model, mesh=dp)
    w1, w2, b2 = model[0].weight, model[2].weight, model[2].bias
    assert w1.placements == (_StridedShard(0, split_factor=2), Shard(0))
    assert w2.placements == (Shard(0), Shard(1))
    assert b2.placements == (Shard(0), Replicate())
    # rank (dp, tp): TP holds rows [4 tp, 4 tp + 4), dp takes half of that
    dp_rank, tp_rank = mesh.get_coordinate()
    start = 4 * tp_rank + 2 * dp_rank
    torch.manual_seed(0)
    expected = nn.Linear(6, 8).weight.detach()[start:start + 2]
    assert torch.equal(w1.to_local(), expected)


@distributed(world_size=4, timeout=60)
def test_tp_param_from_another_mesh_is_refused():
    mesh, dp, _ = _meshes(*MESHES["fsdp+tp 2x2"])
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _mlp((4, 4, 4))
    _tp_by_hand(model, other["tp"])
    with pytest.raises(ValueError, match="sliced from one mesh"):
        fully_shard(model, mesh=dp)


@distributed(world_size=4, timeout=60)
def test_partial_tp_param_is_refused():
    mesh, dp, tp = _meshes(*MESHES["fsdp+tp 2x2"])
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(DTensor.from_local(torch.zeros(4, 4), tp, [Partial()]))
    with pytest.raises(ValueError, match="cannot be Partial"):
        fully_shard(model, mesh=dp)


@distributed(world_size=4, timeout=120)
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no-sp"])
def test_llama_grads_and_clip_grad_norm(sequence_parallel):
    """Every gradient equals plain torch's, every parameter lives on the one 2-D mesh (plain
    norms too, as Replicate over tp), so torch's own clip_grad_norm_ works and agrees."""
    from examples.llama import Llama, LlamaConfig, loss_fn
    from examples.llama_parallel import parallelize_llama

    mesh, dp, tp = _meshes(*MESHES["fsdp+tp 2x2"])
    cfg = LlamaConfig(vocab_size=64, dim=16, n_layers=2, n_heads=4, ffn_dim=24, max_seq_len=16)
    torch.manual_seed(0)
    ref = Llama(cfg)
    model = copy.deepcopy(ref)
    parallelize_llama(model, tp, sequence_parallel=sequence_parallel)
    for block in model.layers:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    assert {p.device_mesh for p in model.parameters()} == {mesh}
    tokens = torch.randint(0, cfg.vocab_size, (4, 9))
    loss_fn(ref(tokens[:, :-1]), tokens[:, 1:]).backward()
    me = _dp_rank(dp)
    mine = tokens[2 * me:2 * me + 2]
    loss_fn(model(mine[:, :-1]), mine[:, 1:]).backward()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.placements == p.placements, name
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"grad of {name}: {m}")
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    torch.testing.assert_close(norm.full_tensor(), ref_norm, rtol=1e-5, atol=1e-6)
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"clipped grad of {name}: {m}")


@distributed(world_size=4, timeout=120)
def test_meta_init_gives_the_weights_of_plain_torch():
    """Build on meta, TP + FSDP, then materialise and re-initialise: each rank writes only its
    piece, and the random inits give exactly the single-process weights of the same seed."""
    from examples.llama import Llama, LlamaConfig
    from examples.llama_parallel import parallelize_llama

    mesh, dp, tp = _meshes(*MESHES["fsdp+tp 2x2"])
    cfg = LlamaConfig(vocab_size=62, dim=16, n_layers=1, n_heads=4, ffn_dim=22, max_seq_len=16)
    with torch.device("meta"):
        model = Llama(cfg)
    parallelize_llama(model, tp, sequence_parallel=True)
    for block in model.layers:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    model.to_empty(device=TEST_DEVICE)

    def init(m):
        torch.manual_seed(0)
        for sub in m.modules():
            if hasattr(sub, "reset_parameters"):
                sub.reset_parameters()
        return m

    init(model)
    ref = init(Llama(cfg))
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert p.device_mesh == mesh and p.to_local().device.type == "cpu", name
        assert torch.equal(p.full_tensor(), p_ref), name


FEATURES = ["cpu offload", "frozen params", "zero-2", "reshard to 1",
            "grad accumulation", "tp outer mesh dim"]


@distributed(world_size=4, timeout=180)
@pytest.mark.parametrize("feature", FEATURES)
def test_fsdp_features_compose_with_tp(feature):
    """FSDP's options on a TP'd Llama (2x2, sequence parallel): 4 AdamW steps, losses equal to
    single-process training."""
    from examples.llama import Llama, LlamaConfig, loss_fn
    from examples.llama_parallel import parallelize_llama
    from fsdp import CPUOffloadPolicy

    names = ("tp", "dp") if feature == "tp outer mesh dim" else ("dp", "tp")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    cfg = LlamaConfig(vocab_size=62, dim=16, n_layers=2, n_heads=4, ffn_dim=22, max_seq_len=16)
    torch.manual_seed(0)
    ref = Llama(cfg)
    model = copy.deepcopy(ref)
    if feature == "frozen params":
        for m in (model, ref):
            m.layers[0].attention.wq.weight.requires_grad_(False)
            m.tok_embeddings.weight.requires_grad_(False)
    kwargs = {}
    if feature == "cpu offload":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    reshard = {"zero-2": False, "reshard to 1": 1}.get(feature, True)
    parallelize_llama(model, mesh["tp"], sequence_parallel=True)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard, **kwargs)
    fully_shard(model, mesh=mesh["dp"], **kwargs)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    micro = 2 if feature == "grad accumulation" else 1
    g = torch.Generator().manual_seed(3)
    me, worst = mesh.get_local_rank("dp"), 0.0
    for _ in range(4):
        tokens = torch.randint(0, cfg.vocab_size, (4 * micro, 9), generator=g)
        ref_loss = loss_fn(ref(tokens[:, :-1]), tokens[:, 1:])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        total = torch.zeros(())
        for k in range(micro):
            model.set_requires_gradient_sync(k == micro - 1)
            mine = tokens[4 * k:4 * k + 4][2 * me:2 * me + 2]
            loss = loss_fn(model(mine[:, :-1]), mine[:, 1:]) / micro
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        worst = max(worst, abs(float(total) / 4 - float(ref_loss)) / float(ref_loss))
    assert worst <= 1e-5, worst


@distributed(world_size=4, timeout=180)
def test_fsdp_tp_mixed_precision_matches_tp_in_bf16():
    """FSDP(bf16 params, fp32 reduce) over TP (2x2, sequence parallel) against the same TP model
    without FSDP computing with a bf16 copy of its fp32 masters on this dp rank's rows: the same
    bf16 kernels on the same local shapes, so losses and bf16 gradients are identical bit for bit
    on any CPU; the fp32 sum over 2 dp ranks is one rounding either way round and halving is
    exact, so gradients, AdamW steps and parameters stay identical too."""
    from examples.llama import Llama, LlamaConfig, loss_fn
    from examples.llama_parallel import parallelize_llama
    from fsdp import MixedPrecisionPolicy
    from tests.test_fsdp import bf16_copy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cfg = LlamaConfig(vocab_size=62, dim=16, n_layers=2, n_heads=4, ffn_dim=22, max_seq_len=16)
    torch.manual_seed(0)
    ref = parallelize_llama(Llama(cfg), mesh["tp"], sequence_parallel=True)
    model = copy.deepcopy(ref)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    me, dp_group = mesh.get_local_rank("dp"), mesh["dp"].get_group()
    for _ in range(3):
        mine = torch.randint(0, cfg.vocab_size, (4, 9), generator=g)[2 * me:2 * me + 2]
        low = bf16_copy(ref)
        ref_loss = loss_fn(low(mine[:, :-1]), mine[:, 1:])
        ref_loss.backward()
        loss = loss_fn(model(mine[:, :-1]), mine[:, 1:])
        loss.backward()
        assert torch.equal(loss.detach(), ref_loss.detach())
        for p_ref, p_low in zip(ref.parameters(), low.parameters()):
            grad = p_low.grad.full_tensor().float()
            dist.all_reduce(grad, group=dp_group)
            p_ref.grad = distribute_tensor(grad / 2, mesh["tp"], p_ref.placements)
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad.full_tensor(), p_ref.grad.full_tensor()), name
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.full_tensor(), p_ref.full_tensor()), name
