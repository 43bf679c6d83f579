"""RL weight sync between two separately launched jobs: a trainer job (FSDP over its own world)
and an inference-engine job (``rl_engine.EngineLlama``: TP over its own world, vLLM's fused
``[q_r; k_r; v_r]`` / ``[gate_r; up_r]`` layout in its own buffers), each started by its own
``torchrun``, joined through a rendezvous address (``dtensor_lite.jobs``):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/rl_weight_sync.py \
        --trainer-job 127.0.0.1:29600
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/rl_weight_sync.py \
        --engine-job 127.0.0.1:29600

The trainer trains one step, syncs, and again (``--steps``); after each sync the engine
generates greedily. The engine passes what only it knows (its fused tensors, the wire dtype);
the trainer passes nothing. ``--out DIR`` saves the trained weights (trainer rank 0), each engine
rank's buffers and the engine's tokens per sync, for a checker (tests/test_jobs.py).
``--pause-mid-sync K`` (with ``--out``): in sync K every engine rank stops after its first
bucket, writes ``engine_mid_sync_rank<r>.pid`` (its pid) there and waits to be killed: a test
kills the engine job from outside at that point (tests/test_jobs.py), and the trainer must raise
within ``--timeout``. ``--bucket-kb``: the bucket (the engine gives it; default: the relayout's
rule), small enough for the example model to take several buckets.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtensor_lite import collectives as C  # noqa: E402
from dtensor_lite import init_device_mesh  # noqa: E402
from dtensor_lite.debug import CommDebugMode, MemoryTracker  # noqa: E402
from dtensor_lite.jobs import connect_jobs  # noqa: E402
from examples.llama import Llama, LlamaConfig, loss_fn  # noqa: E402
from examples.rl_engine import EngineLlama  # noqa: E402
from fsdp import fully_shard  # noqa: E402

PROMPT = torch.arange(5).reshape(1, 5) + 1


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    role = ap.add_mutually_exclusive_group(required=True)
    role.add_argument("--trainer-job", metavar="HOST:PORT", help="run the trainer job")
    role.add_argument("--engine-job", metavar="HOST:PORT", help="run the engine job")
    ap.add_argument("--steps", type=int, default=3, help="train steps, a sync after each")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the other job")
    ap.add_argument("--out", default=None)
    ap.add_argument("--pause-mid-sync", type=int, default=-1, metavar="K",
                    help="engine: stop in sync K after the first bucket, say so in --out and "
                    "wait to be killed")
    ap.add_argument("--bucket-kb", type=int, default=None,
                    help="engine: the relayout's bucket in KiB (default: its own rule)")
    ap.add_argument("--metrics", default=None, metavar="DIR",
                    help="write per rank and sync a json file of bytes sent, seconds and peak "
                    "extra memory there (benchmarks/relayout.py --two-jobs)")
    return ap.parse_args(argv)


def config(args) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                       n_kv_heads=args.kv_heads, ffn_dim=args.ffn, max_seq_len=64)


def measured(args, role: str, step: int, link, sync) -> float:
    """Run ``sync()``; with ``--metrics DIR`` write this rank's bytes sent, seconds and peak
    extra memory (the allocator's events) to a json file there. Returns the seconds. Both jobs
    line up first, so neither times the other's training or generation."""
    link.all_reduce_max([0], "line up for the sync")
    with CommDebugMode() as comm, MemoryTracker(torch.nn.Module()) as mem:
        start = time.perf_counter()
        sync()
        seconds = time.perf_counter() - start
    if args.metrics:
        rank = dist.get_rank()
        (Path(args.metrics) / f"{role}_{rank}_sync{step}.json").write_text(json.dumps(
            {"role": role, "rank": rank, "sync": step, "seconds": seconds,
             "sent": sum(comm.get_comm_bytes().values()), "peak": mem.peak_bytes}))
    return seconds


def trainer_job(args) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Llama(config(args))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    link = connect_jobs(args.trainer_job, "trainer", timeout=args.timeout)
    plan = link.plan_relayout(model)  # the engine gives the fused layout and the wire dtype
    if rank == 0:
        print(plan.report(), flush=True)
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        tokens = torch.randint(0, 256, (2, 17), generator=g)
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        seconds = measured(args, "trainer", step, link, lambda: plan.run(model))
        trained = {n: p.full_tensor() for n, p in model.named_parameters()}  # for the checker
        if rank == 0:
            print(f"sync {step}: {seconds * 1e3:.1f} ms", flush=True)
            if args.out:
                torch.save(trained, Path(args.out) / f"trained_{step}.pt")
    link.close()


def engine_job(args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    engine = EngineLlama(config(args), init_device_mesh("cpu", (world,)), dtype)
    weights = engine.weights()
    link = connect_jobs(args.engine_job, "engine", timeout=args.timeout)
    bucket = {} if args.bucket_kb is None else {"bucket_bytes": args.bucket_kb * 1024}
    plan = link.plan_relayout(weights, dtype=dtype, fused=engine.fused(), **bucket)
    for step in range(args.steps):
        if step == args.pause_mid_sync:
            _pause_after_first_bucket(Path(args.out) / f"engine_mid_sync_rank{rank}.pid")
        measured(args, "engine", step, link, lambda: plan.run(weights))
        tokens = engine.generate(PROMPT, 8)
        if args.out:
            torch.save(engine.local, Path(args.out) / f"engine_{step}_rank{rank}.pt")
            if rank == 0:
                (Path(args.out) / f"tokens_{step}.json").write_text(json.dumps(tokens.tolist()))
        if rank == 0:
            print(f"sync {step}: engine tokens {tokens[0].tolist()}", flush=True)
    link.close()


def _pause_after_first_bucket(marker: Path) -> None:
    """From now on, the second bucket this rank would exchange is never sent: it writes its pid
    to ``marker`` and waits (the trainer is mid-sync, waiting for it) until it is killed."""
    calls = []
    exchange = C.exchange_pieces

    def pausing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(str(os.getpid()))
            tmp.rename(marker)  # whole or absent: the test reads it once it exists
            threading.Event().wait()
        return exchange(*args, **kwargs)
    C.exchange_pieces = pausing


def main(argv=None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    try:
        (trainer_job if args.trainer_job else engine_job)(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
