"""Measured pipeline bubble per schedule beside the analytical one (4 CPU processes).

    torchrun --standalone --nproc-per-node 4 benchmarks/pipeline_bubble.py [--microbatches 8]

A compute-heavy stage (a stack of 512x512 linear layers with tanh, the same on every stage, 64
rows per micro-batch: tens of milliseconds per action against sends of 128 KiB) so that compute,
not the messages, decides the timeline. Every schedule runs a warm-up step and ``--steps`` timed
ones. A rank's measured bubble is the time it spent *blocked waiting for a neighbour* (in its
receives, and for its last sends) over the step's wall time, by its own clock
(``schedule.last_step_timing["waiting"]``), the median over the timed steps -- not "1 - compute /
step", which on a loaded machine counts every descheduling as bubble. Beside it: the schedule
played in unit time (F = 1, B = 2, I = W = 1, free communication), and ``(p-1)/(m+p-1)``
(GPipe / 1F1B's formula; the interleaved ones divide the fill by the stages per rank). And a
load-proof figure: the order *replayed* with every action's measured CPU time (thread time, which
descheduling does not inflate) and free communication: the bubble the schedule leaves with the
real costs (B is not exactly 2 F, the last stage adds the loss). Prints a
table and writes JSON (``--json FILE``). On a machine with fewer cores than processes the waits
also hold the neighbours' descheduling: compare schedules within one run.
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
             ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)]


def stage_module(layers: int, dim: int) -> nn.Module:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.Tanh())])


def run(name, per_rank, args, mesh):
    pp = mesh.size()
    num_stages = pp * per_rank
    rank = mesh.get_local_rank()
    torch.manual_seed(0)
    # the same work per rank whatever the stages per rank: layers split over the local stages
    mods = [stage_module(args.layers // per_rank, args.dim) for _ in range(per_rank)]
    cls = get_schedule_class(name)
    stages = [PipelineStage(m, s, num_stages, "cpu", group=mesh)
              for s, m in zip(cls.stages_of(rank, pp, per_rank), mods)]
    sched = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages,
                args.microbatches, loss_fn=lambda y, t: (y - t).pow(2).mean())
    x = torch.randn(args.microbatches * args.rows, args.dim)
    waiting, busy, replayed = [], [], []
    for step in range(args.steps + 1):
        dist.barrier()   # every schedule's step starts together
        sched.step(x, target=x)
        if step:
            timing = sched.last_step_timing
            waiting.append(timing["waiting"])
            busy.append(1 - timing["idle"])
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, timing["actions"])
            costs = {a: c for rank_costs in every for a, c in rank_costs.items()}
            replayed.append(sched.replayed_bubble(costs)["idle"][rank])
    return {"schedule": name, "pp_rank": rank, "measured": statistics.median(waiting),
            "compute": statistics.median(busy), "replayed": statistics.median(replayed),
            "analytical": sched.analytical_bubble()["idle"][rank]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
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
        p, m = mesh.size(), args.microbatches
        print(f"{'schedule':22} {'waiting per pp rank':26} {'mean':>6} {'replayed':>9} "
              f"{'played':>7} {'formula':>8} {'compute':>8}")
        for name, per_rank in SCHEDULES:
            rs = [r for r in rows if r["schedule"] == name]
            per = " ".join(f"{100 * r['measured']:4.0f}%" for r in rs)
            mean = statistics.mean(r["measured"] for r in rs)
            rep = statistics.mean(r["replayed"] for r in rs)
            ana = statistics.mean(r["analytical"] for r in rs)
            formula = (p - 1) / (per_rank * m + p - 1)
            busy = statistics.mean(r["compute"] for r in rs)
            print(f"{name:22} {per:26} {100 * mean:5.1f}% {100 * rep:8.1f}% {100 * ana:6.1f}% "
                  f"{100 * formula:7.1f}% {100 * busy:7.0f}%")
        print("waiting: wall time blocked for a neighbour / step (median of the timed steps); "
              "replayed: the order played with every action's measured CPU time (free "
              "communication); played: in unit time (F = I = W = 1, B = 2); formula: "
              "(p-1)/(v m + p-1); compute: share of the step's wall time in forward/backward")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
