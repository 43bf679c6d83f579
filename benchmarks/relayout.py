"""Whole-model relayout benchmark: ``dtensor_lite.relayout`` against the two by-hand syncs
(per-parameter ``full_tensor()`` + ``distribute_tensor``; rank 0 gathers and sends every
parameter whole to each engine rank), on the example Llama and on a larger synthetic one
(>= 200 MB of fp32 weights). Runs examples/rl_weight_sync.py's loop; prints a table, writes JSON.

    torchrun --standalone --nproc-per-node 4 benchmarks/relayout.py               # colocated
    torchrun --standalone --nproc-per-node 6 benchmarks/relayout.py --rollout 2   # 4 + 2

Columns: bytes sent by the busiest rank (CommDebugMode; the broadcast's point-to-point sends
counted by hand), wall time of the slowest rank, peak memory above the start on the worst rank
(MemoryTracker: the profiler's allocator events). The methods run interleaved in one process
group, so machine load hits them alike; on a shared machine, compare ratios.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.rl_weight_sync import parse_args, run  # noqa: E402

MODELS = {"example": ["--dim", "64", "--layers", "2"],
          # 66M parameters: 265 MB of fp32 weights
          "synthetic": ["--dim", "1280", "--layers", "4", "--ffn", "2560"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollout", type=int, default=0)
    ap.add_argument("--models", default="example,synthetic")
    ap.add_argument("--bucket-mb", default="auto", help="MiB, or auto: the relayout's rule")
    ap.add_argument("--json", default="relayout_benchmark.json")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    table = []
    for name in args.models.split(","):
        argv = MODELS[name] + ["--rollout", str(args.rollout), "--syncs", "2",
                               "--sync-every", "1", "--bucket-mb", args.bucket_mb]
        rows = run(parse_args(argv))
        for row in rows:
            if row["sync"] == 1:  # the second sync: warm (the first pays one-time set-up)
                table.append({"model": name, **row})
    if dist.get_rank() == 0:
        mode = f"disjoint {dist.get_world_size() - args.rollout}+{args.rollout}" if args.rollout \
            else f"colocated on {dist.get_world_size()}"
        print(f"\nrelayout benchmark, {mode}, bucket {args.bucket_mb} MiB")
        print(f"{'model':>10} {'method':>16} {'busiest MiB':>12} {'ms':>9} {'peak MiB':>9}")
        for r in table:
            print(f"{r['model']:>10} {r['method']:>16} {r['busiest_rank_bytes'] / 2**20:12.3f} "
                  f"{r['seconds'] * 1e3:9.1f} {r['peak_extra_bytes_max'] / 2**20:9.2f}")
        for model in dict.fromkeys(r["model"] for r in table):
            ours = next(r for r in table if r["model"] == model and r["method"] == "relayout")
            for r in table:
                if r["model"] == model and r is not ours:
                    print(f"{model}: {r['method']} / relayout: bytes "
                          f"{r['busiest_rank_bytes'] / max(ours['busiest_rank_bytes'], 1):.1f}x,"
                          f" time {r['seconds'] / ours['seconds']:.1f}x, peak "
                          f"{r['peak_extra_bytes_max'] / max(ours['peak_extra_bytes_max'], 1):.1f}x")
        Path(args.json).write_text(json.dumps({"mode": mode, "rows": table}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
