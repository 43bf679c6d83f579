"""Measured pipeline bubble per schedule beside the analytical one (4 CPU processes).

    torchrun --standalone --nproc-per-node 4 benchmarks/pipeline_bubble.py [--microbatches 8]

A compute-heavy stage (a stack of 512x512 linear layers with tanh, the same on every stage) so
that compute, not the sends, decides the timeline. Every schedule runs a warm-up step and
``--steps`` timed ones; a rank's idle fraction is 1 - (time in its forward / backward actions) /
step time, the median over the timed steps, next to the schedule played in unit time (F = 1,
B = 2, I = W = 1, free communication). Prints a table and writes JSON (``--json FILE``). Times on
a shared machine are noisy: compare schedules within one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtensor_lite import init_device_mesh  # noqa: E402
from dtensor_lite.pipelining import (PipelineScheduleSingle, PipelineStage,  # noqa: E402
                                     get_schedule_class)

SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("LoopedBFS", 2), ("Interleaved1F1B", 2),
             ("InterleavedZeroBubble", 2)]


def stage_module(layers: int, dim: int) -> nn.Module:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.Tanh())])


def run(name, per_rank, args, mesh):
    pp = mesh.size()
    num_stages = pp * per_rank
    rank = mesh.get_local_rank()
    torch.manual_seed(0)
    # the same work per rank whatever the stages per rank: layers split over the local stages
    mods = [stage_module(args.layers // per_rank, args.dim) for _ in range(per_rank)]
    stages = [PipelineStage(m, rank + k * pp, num_stages, "cpu", group=mesh)
              for k, m in enumerate(mods)]
    cls = get_schedule_class(name)
    sched = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages,
                args.microbatches, loss_fn=lambda y, t: (y - t).pow(2).mean())
    x = torch.randn(args.microbatches * args.rows, args.dim)
    idle = []
    for step in range(args.steps + 1):
        sched.step(x, target=x)
        if step:
            idle.append(sched.last_step_timing["idle"])
    return {"schedule": name, "pp_rank": rank, "measured": statistics.median(idle),
            "analytical": sched.analytical_bubble()["idle"][rank]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=16, help="rows per micro-batch")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4, help="layers per pp rank")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    rows = []
    for name, per_rank in SCHEDULES:
        mine = run(name, per_rank, args, mesh)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        rows += gathered
    if dist.get_rank() == 0:
        print(f"pp={mesh.size()}, {args.microbatches} micro-batches, {args.layers} layers of "
              f"{args.dim} per rank, {args.rows} rows per micro-batch")
        print(f"{'schedule':24} {'measured idle per pp rank':34} {'mean':>6} {'analytical':>11}")
        for name, _ in SCHEDULES:
            rs = [r for r in rows if r["schedule"] == name]
            per = " ".join(f"{100 * r['measured']:4.0f}%" for r in rs)
            mean = statistics.mean(r["measured"] for r in rs)
            ana = statistics.mean(r["analytical"] for r in rs)
            print(f"{name:24} {per:34} {100 * mean:5.0f}% {100 * ana:10.0f}%")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
