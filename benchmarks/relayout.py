"""Whole-model relayout benchmark: ``dtensor_lite.relayout`` against the two by-hand syncs
(per-parameter ``full_tensor()`` + ``distribute_tensor``; rank 0 gathers and sends every
parameter whole to each engine rank), on the example Llama and on a larger synthetic one
(>= 200 MB of fp32 weights). Runs examples/rl_weight_sync.py's loop; prints a table, writes JSON.

    torchrun --standalone --nproc-per-node 4 benchmarks/relayout.py               # colocated
    torchrun --standalone --nproc-per-node 6 benchmarks/relayout.py --rollout 2   # 4 + 2
    python benchmarks/relayout.py --two-jobs     # 4 + 2 as two torchrun jobs, fused engine

``--two-jobs`` launches examples/rl_weight_sync.py ``--trainer-job`` (4 processes) and
``--engine-job`` (2, vLLM's fused layout) as two torchrun subprocesses joined by
``dtensor_lite.jobs`` and reads the per-rank figures they write (second sync).

The one-world rows use the engine as a vLLM-style engine holds it (examples/rl_engine.py:
``[q_r; k_r; v_r]``, ``[gate_r; up_r]`` per TP rank: ``Concat(per_rank=True)``); "relayout" is the
default bucket (no tuning), "relayout 16 MiB" a hand-picked one beside it; the by-hand syncs fill
the same buffers through the engine's weight loader.

Columns: bytes sent by the busiest rank (CommDebugMode; the broadcast's point-to-point sends
counted by hand), wall time of the slowest rank (the median of ``--repeats`` runs of every method,
interleaved, and their range: on a shared machine one stalled process sets a run's time), peak
memory above the start on the worst rank (MemoryTracker: the profiler's allocator events). Below
the table, whether the default bucket is below both by-hand syncs in time and peak and at most
the 16 MiB bucket's peak; the plan's own figures beside the measured ones: the busiest rank's
bytes (must be equal) and ``estimate_seconds`` with this machine's point-to-point link
(``plan.measure_link``) against the measured time, as a ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.rl_weight_sync import parse_args, run  # noqa: E402

MODELS = {"example": ["--dim", "64", "--layers", "2"],
          # 66M parameters: 265 MB of fp32 weights
          "synthetic": ["--dim", "1280", "--layers", "4", "--ffn", "2560"]}


def two_jobs(models: list, json_path: str) -> None:
    """The two-job form: per model, both jobs launched, their second sync's figures."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    rows = []
    for name in models:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        # the same weights as the one-world rows (no GQA there): q, k, v of equal sizes
        metrics_dir = Path(tempfile.mkdtemp(prefix="relayout_two_jobs_"))
        argv = MODELS[name] + ["--steps", "2", "--metrics", str(metrics_dir), "--dtype",
                               "bfloat16", "--kv-heads", "4"]
        jobs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc-per-node={n}", str(repo / "examples" /
                                                               "rl_weight_sync.py"),
                                  flag, address, *argv], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
                for flag, n in (("--trainer-job", 4), ("--engine-job", 2))]
        outs = [j.communicate(timeout=1800)[0] for j in jobs]
        if any(j.returncode for j in jobs):
            raise SystemExit("a job failed:\n" + "\n".join(o[-3000:] for o in outs))
        warm = [json.loads(f.read_text()) for f in sorted(metrics_dir.glob("*_sync1.json"))]
        shutil.rmtree(metrics_dir)
        rows.append({"model": name, "method": "relayout, two jobs",
                     "busiest_rank_bytes": max(m["sent"] for m in warm),
                     "seconds": max(m["seconds"] for m in warm),
                     "peak_extra_bytes_max": max(m["peak"] for m in warm), "per_rank": warm})
    print("\nrelayout benchmark, two torchrun jobs 4 + 2 (engine: fused per-rank layout), "
          "default bucket")
    print(f"{'model':>10} {'method':>20} {'busiest MiB':>12} {'ms':>9} {'peak MiB':>9}")
    for r in rows:
        print(f"{r['model']:>10} {r['method']:>20} {r['busiest_rank_bytes'] / 2**20:12.3f} "
              f"{r['seconds'] * 1e3:9.1f} {r['peak_extra_bytes_max'] / 2**20:9.2f}")
    Path(json_path).write_text(json.dumps({"mode": "two jobs 4+2", "rows": rows}, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollout", type=int, default=0)
    ap.add_argument("--models", default="example,synthetic")
    ap.add_argument("--bucket-mb", default="auto,16",
                    help="MiB, or auto: the relayout's rule; several, comma-separated: the first "
                    "is 'relayout', the others rows beside it (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="runs of every method per sync, interleaved; the table gives the "
                    "median and the range (default %(default)s)")
    ap.add_argument("--json", default="relayout_benchmark.json")
    ap.add_argument("--two-jobs", action="store_true",
                    help="launch a 4-process trainer job and a 2-process engine job (no torchrun)")
    args = ap.parse_args()
    if args.two_jobs:
        two_jobs(args.models.split(","), args.json)
        return
    dist.init_process_group("gloo")
    table = []
    for name in args.models.split(","):
        argv = MODELS[name] + ["--rollout", str(args.rollout), "--syncs", "2", "--engine",
                               "fused", "--sync-every", "1", "--bucket-mb", args.bucket_mb,
                               "--repeats", str(args.repeats)]
        rows = run(parse_args(argv))
        for row in rows:
            if row["sync"] == 1:  # the second sync: warm (the first pays one-time set-up)
                table.append({"model": name, **row})
    if dist.get_rank() == 0:
        mode = f"disjoint {dist.get_world_size() - args.rollout}+{args.rollout}" if args.rollout \
            else f"colocated on {dist.get_world_size()}"
        print(f"\nrelayout benchmark, {mode}, engine in vLLM's fused layout, bucket "
              f"{args.bucket_mb} MiB, median of {args.repeats} interleaved runs")
        print(f"{'model':>9} {'method':>15} {'busiest MiB':>11} {'ms':>7} {'ms range':>13} "
              f"{'peak MiB':>8}")
        for r in table:
            lo, hi = r["seconds_per_repeat"][0], r["seconds_per_repeat"][-1]
            print(f"{r['model']:>9} {r['method']:>15} {r['busiest_rank_bytes'] / 2**20:11.3f} "
                  f"{r['seconds'] * 1e3:7.1f} {f'{lo * 1e3:.0f}-{hi * 1e3:.0f}':>13} "
                  f"{r['peak_extra_bytes_max'] / 2**20:8.2f}")
        for model in dict.fromkeys(r["model"] for r in table):
            ours = next(r for r in table if r["model"] == model and r["method"] == "relayout")
            link = ours["link"]
            print(f"{model}: plan vs measured: busiest rank "
                  f"{ours['planned_busiest_rank_bytes']} B planned, "
                  f"{ours['busiest_rank_bytes']} B measured"
                  f" ({'equal' if ours['planned_busiest_rank_bytes'] == ours['busiest_rank_bytes'] else 'DIFFER'}; with the plan check's all-reduce)"
                  f"; time {ours['estimated_seconds'] * 1e3:.1f} ms estimated with this machine's "
                  f"link ({link['bandwidth'] / 1e9:.2f} GB/s, {link['latency'] * 1e6:.0f} us), "
                  f"{ours['seconds'] * 1e3:.1f} ms measured: "
                  f"{ours['seconds'] / max(ours['estimated_seconds'], 1e-12):.2f}x")
            by_hand = [r for r in table if r["model"] == model and not
                       r["method"].startswith("relayout")]
            tuned = [r for r in table if r["model"] == model and r["method"].startswith(
                "relayout ")]
            print(f"{model}: default bucket vs by hand: time below both: "
                  f"{all(ours['seconds'] < r['seconds'] for r in by_hand)}, peak below both: "
                  f"{all(ours['peak_extra_bytes_max'] < r['peak_extra_bytes_max'] for r in by_hand)}"
                  + "".join(f"; peak <= {r['method']}'s: "
                            f"{ours['peak_extra_bytes_max'] <= r['peak_extra_bytes_max']}"
                            for r in tuned))
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
