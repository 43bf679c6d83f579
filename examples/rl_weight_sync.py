"""RL weight sync: a trainer trains the example Llama with FSDP; every ``--sync-every`` steps its
weights are relaid into a tensor-parallel copy used for greedy generation (the rollout engine),
with ``dtensor_lite.relayout`` -- and, for comparison, with the two ways people write it by hand.

    # colocated, then disjoint
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/rl_weight_sync.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 6 examples/rl_weight_sync.py --rollout 2

Two separately launched jobs (the engine in vLLM's fused layout; examples/rl_two_jobs.py):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/rl_weight_sync.py \
        --trainer-job 127.0.0.1:29600
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/rl_weight_sync.py \
        --engine-job 127.0.0.1:29600

``--engine fused``: the engine is examples/rl_engine.py's, in vLLM's own fused per-rank layout
(``[q_r; k_r; v_r]``, ``[gate_r; up_r]``: ``Concat(..., per_rank=True)``), and the by-hand syncs
use its weight loader (``EngineLlama.load_weight``, as vLLM's ``weight_loader``).

Colocated: the trainer is FSDP over all ranks, the engine two TP-2 replicas on the same ranks.
Disjoint (``--rollout R``): the trainer is FSDP on the first ranks, the engine TP-R on the last R.
The engine generates greedily in bf16 (``--dtype float32`` for fp32); the tokens are checked
against one process holding the trained weights. Per sync it prints bytes sent by the busiest
rank, wall time and peak extra memory per rank, beside:

* ``full_tensor``: per parameter ``full_tensor()`` on the trainer, then each engine rank slices
  its piece (colocated) or receives it whole from one trainer rank (disjoint, round robin) --
  every trainer rank holds every parameter whole once;
* ``rank0_broadcast``: rank 0 gathers each parameter and sends it whole to every engine rank.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtensor_lite import (DeviceMesh, DTensor, Replicate, distribute_tensor,  # noqa: E402
                          init_device_mesh)
from dtensor_lite.debug import CommDebugMode, MemoryTracker  # noqa: E402
from dtensor_lite.collectives import all_reduce_cost  # noqa: E402
from dtensor_lite.plan.cost import LinkModel  # noqa: E402
from dtensor_lite.plan.measure_link import measure_link  # noqa: E402
from dtensor_lite.relayout import plan_relayout  # noqa: E402
from examples.llama import Llama, LlamaConfig, loss_fn  # noqa: E402
from examples.llama_parallel import parallelize_llama  # noqa: E402
from examples.rl_engine import EngineLlama  # noqa: E402
from fsdp import fully_shard  # noqa: E402


def build(args):
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = LlamaConfig(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=4,
                      ffn_dim=args.ffn or 2 * args.dim, max_seq_len=64)
    torch.manual_seed(0)
    trainer = Llama(cfg)
    if args.rollout:  # disjoint: trainer ranks first, the engine on the last ``rollout`` ranks
        trainer_mesh = DeviceMesh("cpu", list(range(world - args.rollout)))
        engine_mesh = DeviceMesh("cpu", list(range(world - args.rollout, world)))
    else:             # colocated: FSDP over all, TP-2 replicas on the same ranks
        trainer_mesh = init_device_mesh("cpu", (world,))
        engine_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("rep", "tp"))["tp"]
    if trainer_mesh.get_coordinate() is not None:
        fully_shard(trainer, mesh=trainer_mesh)
        trainer_tensors = dict(trainer.named_parameters())
    else:  # engine-only ranks hold no trainer pieces: empty DTensors of the trainer's layout
        from dtensor_lite import Shard
        trainer_tensors = {n: distribute_tensor(p.detach(), trainer_mesh, [Shard(0)])
                           for n, p in trainer.named_parameters()}
    if args.engine == "fused":  # vLLM's layout: [q_r; k_r; v_r], [gate_r; up_r] per TP rank
        return cfg, trainer, trainer_tensors, trainer_mesh, \
            EngineLlama(cfg, engine_mesh, args.torch_dtype), engine_mesh
    default = torch.get_default_dtype()
    torch.set_default_dtype(args.torch_dtype)  # no fp32 copy of the engine on the way
    try:
        engine = Llama(cfg).to(args.torch_dtype)
    finally:
        torch.set_default_dtype(default)
    parallelize_llama(engine, engine_mesh)
    return cfg, trainer, trainer_tensors, trainer_mesh, engine, engine_mesh


def train_steps(trainer, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 17), generator=g)
        loss = loss_fn(trainer(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()


@torch.no_grad()
def check_weights(engine, engine_mesh, trainer_tensors, dtype):
    """Every engine weight equals the trained one cast to ``dtype``, bit for bit (gathered
    outside the measurement: a check, not part of a sync); a fused engine's buffers equal what
    its weight loader makes of the trained weights."""
    if isinstance(engine, EngineLlama):
        expected = EngineLlama(engine.cfg, engine_mesh, dtype)
    for name, t in trainer_tensors.items():
        trained = t.redistribute(engine_mesh, [Replicate()] * engine_mesh.ndim).to_local()
        if engine_mesh.get_coordinate() is None:
            continue
        if isinstance(engine, EngineLlama):
            expected.load_weight(name, trained)
        else:
            p = dict(engine.named_parameters())[name]
            mine = p.full_tensor() if isinstance(p, DTensor) else p
            assert torch.equal(mine, trained.to(dtype)), name
    if isinstance(engine, EngineLlama) and engine_mesh.get_coordinate() is not None:
        for name, buf in engine.local.items():
            assert torch.equal(buf, expected.local[name]), name


@torch.no_grad()
def generate(model, prompt, n):
    tokens = prompt.clone()
    for _ in range(n):
        logits = model(tokens)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        if logits.numel() == 0:  # a rank outside the engine
            return None
        tokens = torch.cat([tokens, logits[:, -1].float().argmax(-1, keepdim=True)], dim=1)
    return tokens[:, prompt.shape[1]:]


def measured(fn, model):
    """(bytes this rank sent, seconds, peak extra bytes) of ``fn()``."""
    dist.barrier()
    with CommDebugMode() as comm, MemoryTracker(model) as mem:
        start = time.perf_counter()
        extra = fn() or 0
        seconds = time.perf_counter() - start
    return sum(comm.get_comm_bytes().values()) + extra, seconds, mem.peak_bytes


def module_loader(engine):
    """``load(name, whole)`` for a ``parallelize_llama``d engine: its piece of ``whole``."""
    params = dict(engine.named_parameters())

    def load(name, whole):
        p = params[name]
        if isinstance(p, DTensor):
            if p.device_mesh.get_coordinate() is not None:
                p._local_tensor.copy_(distribute_tensor(whole, p.device_mesh, p.placements,
                                                        src_data_rank=None).to_local())
        else:
            p.data.copy_(whole)
    return load


def sync_full_tensor(trainer_tensors, load):
    """By hand: each parameter whole on the trainer ranks, each engine rank keeps its piece
    (``load``: the engine's weight loader, casting as it copies)."""
    for name, t in trainer_tensors.items():
        load(name, t.full_tensor())


def sync_full_tensor_to(trainer_tensors, load, dtype, trainer_ranks, engine_ranks):
    """By hand, disjoint: each parameter whole on every trainer rank (``full_tensor``), trainer
    rank i sends it to the i-th engine rank (round robin), which keeps its piece."""
    rank, sent, buf = dist.get_rank(), 0, None
    source = {e: trainer_ranks[i % len(trainer_ranks)] for i, e in enumerate(engine_ranks)}
    for name, t in trainer_tensors.items():
        whole = t.full_tensor().to(dtype) if rank in trainer_ranks else None
        for e, src in source.items():
            if rank == src:
                dist.send(whole, e)
                sent += whole.numel() * whole.element_size()
            elif rank == e:
                buf = torch.empty(t.shape, dtype=dtype)
                dist.recv(buf, src)
        if rank in engine_ranks:
            load(name, buf)
    return sent


def sync_rank0_broadcast(trainer_tensors, load, dtype, engine_ranks):
    """By hand: rank 0 gathers each parameter and sends it whole to every engine rank."""
    rank, sent = dist.get_rank(), 0
    for name, t in trainer_tensors.items():
        whole = t.full_tensor() if t._spec.mesh.get_coordinate() is not None else None
        buf = whole.to(dtype) if rank == 0 else torch.empty(t.shape, dtype=dtype)
        for r in engine_ranks:
            if r == 0:
                continue
            if rank == 0:
                dist.send(buf, r)
                sent += buf.numel() * buf.element_size()
            elif rank == r:
                dist.recv(buf, 0)
        if rank in engine_ranks:
            load(name, buf)
    return sent


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))
    ap.add_argument("--rollout", type=int, default=0,
                    help="engine ranks, the last ones (default 0: colocated on every rank)")
    ap.add_argument("--syncs", type=int, default=2, help="weight syncs (default %(default)s)")
    ap.add_argument("--sync-every", type=int, default=3,
                    help="training steps between syncs (default %(default)s)")
    ap.add_argument("--dim", type=int, default=64, help="model width (default %(default)s)")
    ap.add_argument("--layers", type=int, default=2, help="blocks (default %(default)s)")
    ap.add_argument("--ffn", type=int, default=0, help="feed-forward width (0: 2 x dim)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the engine's dtype (default %(default)s)")
    ap.add_argument("--engine", default="modules", choices=["modules", "fused"],
                    help="the engine: modules (the example Llama parallelize_llama'd, one "
                    "DTensor per weight) or fused (examples/rl_engine.py: vLLM's per-rank "
                    "[q_r; k_r; v_r] and [gate_r; up_r] buffers) (default %(default)s)")
    ap.add_argument("--bucket-mb", default="auto",
                    help="relayout bucket per rank in MiB (default auto: the relayout's own "
                    "rule); several, comma-separated: each measured, the first checked")
    ap.add_argument("--repeats", type=int, default=1,
                    help="per sync, run every method this many times, interleaved; the rows "
                    "give the median time (default %(default)s)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    jobs = ap.add_argument_group(
        "two separately launched jobs", "run as one side of examples/rl_two_jobs.py (its "
        "options apply: python examples/rl_two_jobs.py --help)")
    side = jobs.add_mutually_exclusive_group()
    side.add_argument("--trainer-job", metavar="HOST:PORT",
                      help="the trainer job; its rank 0 hosts the rendezvous at HOST:PORT")
    side.add_argument("--engine-job", metavar="HOST:PORT", help="the engine job")
    return ap


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    args.torch_dtype = getattr(torch, args.dtype)
    return args


def main(argv=None):
    args = parse_args(argv)
    standalone = not dist.is_initialized()
    if standalone:
        dist.init_process_group("gloo")
    rows = run(args)
    if dist.get_rank() == 0 and args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if standalone:
        dist.destroy_process_group()


def run(args) -> list:
    """Train, sync ``args.syncs`` times by every method, check the engine's tokens; on rank 0
    print and return one row per (sync, method)."""
    rank = dist.get_rank()
    cfg, trainer, trainer_tensors, trainer_mesh, engine, engine_mesh = build(args)
    in_trainer = trainer_mesh.get_coordinate() is not None
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2) if in_trainer else None
    engine_ranks = sorted({int(r) for r in engine_mesh.root_layout.flatten().tolist()}) \
        if not args.rollout else list(range(dist.get_world_size() - args.rollout,
                                            dist.get_world_size()))
    trainer_ranks = [r for r in range(dist.get_world_size()) if r not in engine_ranks] \
        if args.rollout else list(range(dist.get_world_size()))
    fused = isinstance(engine, EngineLlama)
    engine_tensors = engine.weights() if fused else engine  # DTensors over its own buffers
    load = engine.load_weight if fused else module_loader(engine)  # the by-hand syncs'
    tracked = torch.nn.Module() if fused else engine  # MemoryTracker's model (names storages)
    buckets = args.bucket_mb.split(",")  # the first is "relayout"; others are compared with it
    plans = {("relayout" if k == 0 else f"relayout {b} MiB"): plan_relayout(
        trainer_tensors, engine_tensors, dtype=args.torch_dtype,
        fused=engine.fused() if fused else None,
        bucket_bytes=None if b == "auto" else int(float(b) * 2**20))
        for k, b in enumerate(buckets)}
    plan = plans["relayout"]
    if rank == 0:
        print(plan.report().splitlines()[0])
        print(plan.report().splitlines()[-1])
    # the plan's own figures, to check against the measured ones: bytes exactly, time as the
    # ratio of measured to estimated with this machine's point-to-point link
    link = measure_link()
    # + every rank's share of the one all-reduce that compares the plan's fingerprint
    planned_busiest = max(plan.bytes_sent().values(), default=0) + all_reduce_cost(
        2, 8, dist.get_world_size())
    estimated = plan.estimate_seconds(LinkModel(gpus_per_node=dist.get_world_size(),
                                                intra=link, inter=link))
    rows = []
    prompt = torch.arange(5).reshape(1, 5) + 1
    for sync in range(args.syncs):
        if in_trainer:
            train_steps(trainer, opt, args.sync_every, seed=sync)
        results: dict = {name: [] for name in [*plans, "full_tensor", "rank0_broadcast"]}
        for rep in range(args.repeats):  # the methods interleaved: load hits them alike
            for name, p in reversed(plans.items()):  # "relayout" last: its result is checked
                results[name].append(measured(lambda: p.run(trainer_tensors, engine_tensors),
                                              tracked))
            if rep == 0:
                ours = None
                if engine_mesh.get_coordinate() is not None:
                    ours = engine.generate(prompt, 8) if fused else generate(engine, prompt, 8)
                check_weights(engine, engine_mesh, trainer_tensors, args.torch_dtype)
            if not args.rollout:
                results["full_tensor"].append(measured(
                    lambda: sync_full_tensor(trainer_tensors, load), tracked))
            else:  # the engine ranks hold no trainer pieces: the trainer ranks send them whole
                results["full_tensor"].append(measured(
                    lambda: sync_full_tensor_to(trainer_tensors, load, args.torch_dtype,
                                                trainer_ranks, engine_ranks), tracked))
            results["rank0_broadcast"].append(measured(
                lambda: sync_rank0_broadcast(trainer_tensors, load, args.torch_dtype,
                                             engine_ranks), tracked))
        # the oracle: one process with the trained weights (gathered outside the measurement)
        full = {n: (t.full_tensor() if t._spec.mesh.get_coordinate() is not None else None)
                for n, t in trainer_tensors.items()}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {"tokens": ours.tolist() if ours is not None else None,
                                          "results": results})
        if rank == 0:
            oracle = Llama(cfg).to(args.torch_dtype)
            oracle.load_state_dict({n: w.to(args.torch_dtype) for n, w in full.items()})
            expected = generate(oracle, prompt, 8).tolist()
            got = [e["tokens"] for r, e in enumerate(everyone) if r in engine_ranks]
            if args.torch_dtype == torch.float32:
                assert all(t == expected for t in got), (got, expected)
                print(f"sync {sync}: engine tokens {expected[0]} == one process's")
            else:  # the weights are exact (checked below); TP's bf16 partial sums round
                same = all(t == expected for t in got)  # otherwise than one process's matmul
                print(f"sync {sync}: engine tokens {got[0][0]} "
                      f"{'==' if same else 'vs'} one process's {expected[0]} (bf16)")
            del oracle
            for name in results:
                sent = [e["results"][name][0][0] for e in everyone]
                # per repeat the slowest rank's time; the row: their median
                times = sorted(max(e["results"][name][k][1] for e in everyone)
                               for k in range(args.repeats))
                secs = times[len(times) // 2]
                peak = [max(m[2] for m in e["results"][name]) for e in everyone]
                row = {"sync": sync, "method": name, "busiest_rank_bytes": max(sent),
                       "seconds": secs, "seconds_per_repeat": times,
                       "peak_extra_bytes_max": max(peak), "bytes_per_rank": sent,
                       "peak_per_rank": peak}
                if name == "relayout":
                    row.update(planned_busiest_rank_bytes=planned_busiest,
                               estimated_seconds=estimated,
                               link={"bandwidth": link.bandwidth, "latency": link.latency})
                rows.append(row)
                print(f"  {name:>16}: busiest rank sent {max(sent) / 2**20:7.3f} MiB, "
                      f"{secs * 1e3:8.1f} ms, peak extra {max(peak) / 2**20:7.3f} MiB")
        del full
    return rows


if __name__ == "__main__":
    if {"--trainer-job", "--engine-job"} & {a.split("=")[0] for a in sys.argv[1:]}:
        from examples.rl_two_jobs import main as two_jobs  # the two-job form
        two_jobs()
    else:
        main()
