"""Eager against torch.compile'd (per block) training steps of the main example's model on
FSDP + TP (2x2, sequence parallel), ours (fsdp/tp on dtensor_lite) beside torch's
fully_shard / parallelize_module, all four in one run on 4 CPU processes.

Each variant is built once, then the variants alternate step by step (same machine load for
all); the first ``--warmup`` steps (compilation) are not timed. Reports the median step time,
the compile time (first steps minus a timed step) and the loss after the last step.

    python benchmarks/compile_step.py                       # inductor, 4 ranks
    python benchmarks/compile_step.py --backend aot_eager --steps 4

Inductor compiles C++ for each block on CPU: on a shared 2-core box the first steps take
minutes. Timings are noisy there; compare the rows of one run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fsdp_step import spawn_world, write_json  # noqa: E402
from benchmarks.tp_step import _Stack, apply_llama_tp  # noqa: E402
from examples.llama import Llama, loss_fn  # noqa: E402
from examples.train_llama import TrainConfig, corpus_tokens, global_batch  # noqa: E402

SIZES = {"dp_shard": 2, "tp": 2}


def build(impl: str, backend: str | None, cfg: TrainConfig):
    stack = _Stack(impl)
    mesh = stack.init_device_mesh("cpu", tuple(SIZES.values()), mesh_dim_names=tuple(SIZES))
    torch.manual_seed(cfg.seed)
    model = Llama(cfg.model)
    apply_llama_tp(stack, model, mesh["tp"], sequence_parallel=True, loss_parallel=False)
    for block in model.layers:
        stack.fully_shard(block, mesh=mesh["dp_shard"])
        if backend:
            block.compile(backend=backend, dynamic=False)
    stack.fully_shard(model, mesh=mesh["dp_shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    return model, opt, mesh.get_local_rank("dp_shard")


def bench(backend: str, steps: int, warmup: int) -> list[dict]:
    # the two implementations' blocks share Block.forward's code: room for both sets of graphs
    torch._dynamo.config.cache_size_limit = 64
    cfg = TrainConfig()
    variants = {(impl, mode): build(impl, backend if mode == "compiled" else None, cfg)
                for impl in ("ours", "torch") for mode in ("eager", "compiled")}
    tokens = corpus_tokens()
    times = {key: [] for key in variants}
    losses = {}
    for step in range(warmup + steps):
        inputs, targets = global_batch(tokens, step, cfg)
        for key, (model, opt, dp_rank) in variants.items():
            rows = cfg.batch // SIZES["dp_shard"]
            x = inputs[dp_rank * rows:(dp_rank + 1) * rows]
            y = targets[dp_rank * rows:(dp_rank + 1) * rows]
            dist.barrier()
            start = time.perf_counter()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            times[key].append(time.perf_counter() - start)
            losses[key] = float(loss.detach())
    rows = []
    for (impl, mode), t in times.items():
        timed = t[warmup:]
        median = statistics.median(timed)
        rows.append({"impl": impl, "mode": mode, "backend": backend if mode == "compiled" else None,
                     "step_ms": 1000 * median,
                     "first_steps_s": sum(t[:warmup]),
                     "compile_s_estimate": max(0.0, sum(t[:warmup]) - warmup * median),
                     "loss": losses[(impl, mode)]})
    return rows


def _run_all(args):
    return bench(args.backend, args.steps, args.warmup)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                       "compile_step.json"))
    args = parser.parse_args()
    rows = spawn_world(4, _run_all, args)
    cfg = TrainConfig()
    print(f"model: {cfg.model}\nbatch {cfg.batch} x {cfg.seq}, FSDP x TP = 2 x 2 (sequence "
          f"parallel), AdamW, gloo on CPU, rank 0; medians of {args.steps} steps\n")
    head = f"{'impl':>6} {'mode':>9} {'step ms':>9} {'first steps s':>14} {'loss':>9}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['impl']:>6} {r['mode']:>9} {r['step_ms']:>9.1f} {r['first_steps_s']:>14.1f} "
              f"{r['loss']:>9.5f}")
    write_json(args.json, {"model": vars(cfg.model), "backend": args.backend, "rows": rows})


if __name__ == "__main__":
    main()
