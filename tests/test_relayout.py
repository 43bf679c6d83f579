"""Whole-model relayout (dtensor_lite.relayout): FSDP-4 -> TP-2 x 2, FSDP+TP 2x2 -> TP-4,
FSDP on ranks 0-3 -> TP-2 on ranks 4-5 (6 processes), a bf16 cast on the way and a fused qkv
destination; the destination model's outputs equal one process's with the same weights; the
dry-run report; optimizer state for an elastic resize; every error clear on every rank."""

import copy

import pytest
import torch
import torch.distributed as dist

from dtensor_lite import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.debug import CommDebugMode
from dtensor_lite.relayout import Concat, plan_relayout, relayout_, relayout_optimizer_state_
from examples.llama import Llama, LlamaConfig
from examples.llama_parallel import parallelize_llama
from fsdp import fully_shard
from tests.harness import distributed

CFG = LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=4, ffn_dim=24, max_seq_len=8)


def _models(seed=0):
    torch.manual_seed(seed)
    trained = Llama(CFG)           # the trainer's weights (one process's copy: the oracle)
    torch.manual_seed(seed + 1)
    rollout = Llama(CFG)           # the rollout copy starts with other weights
    return trained, rollout


def _tokens():
    torch.manual_seed(7)
    return torch.randint(0, CFG.vocab_size, (2, 6))


def _check_outputs(dst_model, oracle, inside: bool):
    tokens = _tokens()
    out = dst_model(tokens)
    if inside:
        torch.testing.assert_close(out, oracle(tokens))


@distributed(world_size=4)
def test_fsdp4_to_tp2x2_colocated():
    trained, rollout = _models()
    src = copy.deepcopy(trained)
    fully_shard(src, mesh=init_device_mesh("cpu", (4,)))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "tp"))
    parallelize_llama(rollout, mesh["tp"])          # two TP-2 replicas: rows [0, 1] and [2, 3]
    with CommDebugMode() as comm:
        plan = relayout_(src, rollout, bucket_bytes=4096)
    _check_outputs(rollout, trained, True)
    # each rank sends at most the bytes of its own pieces, once per replica that needs them
    own = sum(p.to_local().numel() * 4 for p in src.parameters())
    assert comm.get_comm_bytes().get("cross_mesh", 0) <= 2 * own
    assert plan.bytes_sent().get(dist.get_rank(), 0) == comm.get_comm_bytes().get("cross_mesh", 0)
    assert len(plan.buckets) > 1
    assert max(plan.peak_extra_bytes().values()) <= 3 * 4096


@distributed(world_size=4)
def test_fsdp_tp_2x2_to_tp4():
    trained, rollout = _models()
    src = copy.deepcopy(trained)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_llama(src, mesh["tp"])
    fully_shard(src, mesh=mesh["dp"])
    parallelize_llama(rollout, init_device_mesh("cpu", (4,)))
    relayout_(src, rollout)
    _check_outputs(rollout, trained, True)


@distributed(world_size=6)
def test_fsdp_on_ranks_0_3_to_tp2_on_ranks_4_5_bf16():
    rank = dist.get_rank()
    trained, rollout = _models()
    trainer = DeviceMesh("cpu", [0, 1, 2, 3])
    engine = DeviceMesh("cpu", [4, 5])
    if rank < 4:
        src = copy.deepcopy(trained)
        fully_shard(src, mesh=trainer)
        src_tensors = dict(src.named_parameters())
    else:  # the rollout ranks hold no trainer pieces: empty DTensors with the trainer's layout
        src_tensors = {n: distribute_tensor(p.detach(), trainer, [Shard(0)])
                       for n, p in trained.named_parameters()}
    rollout = rollout.to(torch.bfloat16)
    parallelize_llama(rollout, engine)
    with CommDebugMode() as comm:
        plan = relayout_(src_tensors, rollout, dtype=torch.bfloat16)
    sent = comm.get_comm_bytes().get("cross_mesh", 0)
    if rank >= 4:
        assert sent == 0
        for n, p in rollout.named_parameters():  # the trained weights, cast to bf16
            whole = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            assert torch.equal(whole, dict(trained.named_parameters())[n].bfloat16())
        _check_outputs(rollout, trained.to(torch.bfloat16), False)
    else:  # a trainer rank sends its pieces in bf16 (half their fp32 bytes): TP-sharded ones
        # once, the norms (plain, whole on both engine ranks) once per engine rank
        own = sum(p.to_local().numel() for p in src_tensors.values())
        assert sent == plan.bytes_sent()[rank] and own * 2 <= sent <= 2 * own * 2
    assert set(a for a, _ in plan.pair_bytes()) <= {0, 1, 2, 3}


@distributed(world_size=4)
def test_fused_qkv_moves_only_needed_bytes():
    torch.manual_seed(0)
    q, k, v = torch.randn(8, 6), torch.randn(4, 6), torch.randn(4, 6)
    A = init_device_mesh("cpu", (4,))
    B = DeviceMesh("cpu", [2, 3])
    src = {n: distribute_tensor(t, A, [Shard(0)]) for n, t in
           (("wq", q), ("wk", k), ("wv", v))}
    dst = {"qkv": distribute_tensor(torch.zeros(16, 6), B, [Shard(0)])}
    fused = {"qkv": Concat(["wq", "wk", "wv"], dim=0, per_rank=False)}
    plan = plan_relayout(src, dst, fused=fused)
    report = plan.report()
    assert "bytes per rank pair" in report and "peak extra memory" in report
    with CommDebugMode() as comm:
        plan.run(src, dst)
    ref = distribute_tensor(torch.cat([q, k, v]), B, [Shard(0)])
    assert torch.equal(dst["qkv"].to_local(), ref.to_local())
    # rank 2 needs qkv rows 0-7 (= wq; it holds wq[4:6] itself), rank 3 rows 8-15 (= wk, wv;
    # it holds wk[3] and wv[3]): every other needed element crosses exactly once
    needed = {2: 8 * 6, 3: 8 * 6}
    held_locally = {2: 2 * 6, 3: 2 * 6}
    total = sum(plan.bytes_sent().values())
    assert total == sum(needed[r] - held_locally[r] for r in needed) * 4
    assert comm.get_comm_bytes().get("cross_mesh", 0) == plan.bytes_sent().get(dist.get_rank(), 0)


@distributed(world_size=4)
def test_elastic_resize_optimizer_state_continues_at_parity():
    """FSDP-4 trains a step, its weights and Adam state move to FSDP-2 on ranks 0-1, which
    continues; one process training without the resize gives the same weights."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    big = copy.deepcopy(ref)
    fully_shard(big, mesh=init_device_mesh("cpu", (4,)))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    big_opt = torch.optim.Adam(big.parameters(), lr=0.1)
    torch.manual_seed(1)
    batches = [torch.randn(4, 6) for _ in range(2)]
    for model, opt in ((ref, ref_opt), (big, big_opt)):
        model(batches[0]).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    small_mesh = DeviceMesh("cpu", [0, 1])
    small = copy.deepcopy(ref)
    if rank < 2:
        fully_shard(small, mesh=small_mesh)
        small_params = dict(small.named_parameters())
    else:
        small_params = {n: distribute_tensor(p.detach(), small_mesh, [Shard(0)])
                        for n, p in small.named_parameters()}
    small_opt = torch.optim.Adam(list(small_params.values()), lr=0.1)
    relayout_(big, small_params)
    relayout_optimizer_state_(big, big_opt, small_params, small_opt)
    if rank < 2:
        small(batches[1]).pow(2).sum().backward()
        small_opt.step()
        ref(batches[1]).pow(2).sum().backward()
        ref_opt.step()
        for (n, p), rp in zip(small.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.full_tensor(), rp.detach())


@distributed(world_size=4)
def test_relayout_errors_are_clear_on_every_rank():
    rank = dist.get_rank()
    A = init_device_mesh("cpu", (4,))
    B = DeviceMesh("cpu", [0, 1])
    src = {"w": distribute_tensor(torch.randn(4, 4), A, [Shard(0)])}
    with pytest.raises(ValueError, match="shape mismatch"):
        plan_relayout(src, {"w": distribute_tensor(torch.zeros(4, 5), B, [Shard(0)])})
    with pytest.raises(ValueError, match="pass dtype="):
        plan_relayout(src, {"w": distribute_tensor(torch.zeros(4, 4).double(), B, [Shard(0)])})
    with pytest.raises(KeyError, match="name_map"):
        plan_relayout(src, {"x": distribute_tensor(torch.zeros(4, 4), B, [Shard(0)])})
    with pytest.raises(ValueError, match="one placement per mesh dimension"):
        distribute_tensor(torch.zeros(4, 4), B, [Shard(0), Replicate()])
    # a rank with another plan (rank 3 asks for a larger bucket): every rank raises
    dst = {"w": distribute_tensor(torch.zeros(4, 4), B, [Shard(1)])}
    plan = plan_relayout(src, dst, bucket_bytes=64 if rank != 3 else 1 << 20)
    with pytest.raises(ValueError, match="different relayout plans"):
        plan.run(src, dst)


def test_relayout_dry_run_cli_at_scale_sizes_every_byte_once(capsys):
    """``python -m dtensor_lite.plan relayout`` on one process: 4 FSDP ranks -> TP-2 on two
    other ranks, bf16 on the wire: every element crosses once, the norms (whole on both TP
    ranks) twice."""
    import json
    import math

    from dtensor_lite.plan.__main__ import main
    from dtensor_lite.plan.presets import model_fields
    from examples.llama import LlamaConfig
    main(["relayout", "--model", "example", "--src", "dp_shard=4", "--dst", "tp=2",
          "--dst-first-rank", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        model = Llama(LlamaConfig(**model_fields("example")))
    total = sum(p.numel() * (2 if "norm" in n else 1) for n, p in model.named_parameters())
    assert out["world"] == 6 and out["total_bytes"] == total * 2
    assert out["link_bytes"]["intra-node"] == out["total_bytes"]  # 6 ranks: one node of 8
    assert not dist.is_initialized()
    assert math.isfinite(out["estimate_seconds"])


@distributed(world_size=4)
def test_peak_extra_memory_of_a_bucketed_relayout_is_at_most_two_buckets():
    """Measured with MemoryTracker (the allocator's events): moving 8 tensors of 64 KiB from
    FSDP-4 to Shard(1) on two ranks in 16 KiB buckets (each destination rank receives 32 KiB of
    each tensor: every tensor is split across buckets) holds at most one bucket's receive
    buffers and the next one's send and receive buffers beyond the destination pieces
    (allocated before): the plan's peak_extra_bytes, within 3 buckets."""
    from dtensor_lite.debug import MemoryTracker
    torch.manual_seed(0)
    full = {f"w{i}": torch.randn(128, 128) for i in range(8)}
    A, B = init_device_mesh("cpu", (4,)), DeviceMesh("cpu", [0, 1])
    src = {n: distribute_tensor(t, A, [Shard(0)]) for n, t in full.items()}
    dst = {n: distribute_tensor(torch.zeros(128, 128), B, [Shard(1)]) for n in full}
    bucket = 16 * 1024
    plan = plan_relayout(src, dst, bucket_bytes=bucket)
    with MemoryTracker(torch.nn.Module()) as mem:
        plan.run(src, dst)
    # (+ the plan check's two 16-byte fingerprint tensors)
    planned = plan.peak_extra_bytes().get(dist.get_rank(), 0)
    assert mem.peak_bytes <= planned + 64, (mem.peak_bytes, planned)
    biggest = max(sum(plan.bucket_traffic(k)[side].get(dist.get_rank(), 0) for side in (0, 1))
                  for k in range(len(plan.buckets)))
    assert planned <= 3 * biggest <= 3 * bucket
    assert len(plan.buckets) >= 2 * len(full)
    for n, t in full.items():
        assert torch.equal(dst[n].to_local(), distribute_tensor(t, B, [Shard(1)]).to_local())


class _QKV(torch.nn.Module):
    def __init__(self, dim, fused):
        super().__init__()
        if fused:
            self.qkv = torch.nn.Linear(dim, 3 * dim)
        else:
            self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x):
        if hasattr(self, "qkv"):
            return self.qkv(x)
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


@distributed(world_size=4)
def test_fsdp_q_k_v_into_a_fused_tp_qkv_model_outputs_equal_one_process():
    from tp import ColwiseParallel, parallelize_module
    torch.manual_seed(0)
    ref = _QKV(8, fused=False)
    src = copy.deepcopy(ref)
    fully_shard(src, mesh=init_device_mesh("cpu", (4,)))
    dst = _QKV(8, fused=True)
    parallelize_module(dst, DeviceMesh("cpu", [1, 2]), {"qkv": ColwiseParallel(
        output_layouts=Replicate())})
    fused = {f"qkv.{w}": Concat([f"q.{w}", f"k.{w}", f"v.{w}"], dim=0, per_rank=False)
             for w in ("weight", "bias")}
    relayout_(src, dst, fused=fused)
    x = torch.randn(3, 8)
    out = dst(x)
    if dist.get_rank() in (1, 2):
        torch.testing.assert_close(out, ref(x))
