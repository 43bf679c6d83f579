"""One tensor-parallel training step, ours (tp + fsdp on dtensor_lite) beside PyTorch's
(``torch.distributed.tensor.parallel.parallelize_module`` + ``torch.distributed.fsdp.fully_shard``).

Same Llama-style model as benchmarks/fsdp_step.py, same seed, same data, AdamW (foreach), and the
same TP plan: ``examples.llama_parallel.llama_tp_plan`` is built once with our styles and
translated style by style (same classes, same layouts) into torch's. FSDP+TP is applied the way
examples/train_llama.py does it: the TP plan on ``mesh["tp"]``, then ``fully_shard`` per block and
on the root over ``mesh["dp_shard"]``. Cases (name: world, mesh, sequence/loss parallel):

* ``tp2``: 2 ranks, TP only, sequence parallel + loss parallel;
* ``2x2``: 4 ranks, FSDP x TP, sequence parallel + loss parallel;
* ``2x2-plain``: 4 ranks, FSDP x TP, neither.

The two implementations are built side by side in the same processes and their timed steps
alternate, so a load change on a shared machine hits both columns alike. Every step's loss (mean
over the data-parallel ranks) must agree between the two (a sanity check, not a test).

    python benchmarks/tp_step.py                          # spawns 2 and 4 processes itself
    python benchmarks/tp_step.py --cases tp2 --steps 20 --profile /tmp/prof
    torchrun --nproc-per-node 4 benchmarks/tp_step.py --cases 2x2 2x2-plain

Prints a table and writes JSON (default benchmarks/results/tp_step.json). ``--profile DIR``
writes a cProfile of our timed steps on rank 0 per case (``DIR/<case>.prof``) and prints its top
entries. Timings on a shared CPU box are noisy: compare the two columns of one run.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import inspect
import json
import os
import statistics
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fsdp_step import (BATCH, CFG, SEQ, _free_port, _report_profile,  # noqa: E402
                                   _timed, _worker)
from dtensor_lite import DTensor, Partial, init_device_mesh  # noqa: E402
from examples.llama import Llama, loss_fn  # noqa: E402
from examples.llama_parallel import llama_tp_plan  # noqa: E402

# name -> (mesh sizes, outermost first; sequence parallel; loss parallel)
CASES = {
    "tp2": ({"tp": 2}, True, True),
    "2x2": ({"dp_shard": 2, "tp": 2}, True, True),
    "2x2-plain": ({"dp_shard": 2, "tp": 2}, False, False),
}
IMPLS = ("ours", "torch")


# ----------------------------------------------------------------------------- the two stacks
class _Stack:
    """The names one implementation is used through (ours mirror torch's)."""

    def __init__(self, impl: str):
        if impl == "ours":
            import dtensor_lite as placements
            import tp as parallel
            from dtensor_lite import init_device_mesh
            from fsdp import fully_shard
        else:
            import torch.distributed.tensor as placements
            import torch.distributed.tensor.parallel as parallel
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
        self.impl, self.placements, self.parallel = impl, placements, parallel
        self.init_device_mesh, self.fully_shard = init_device_mesh, fully_shard


def _translate(value, stack: _Stack):
    """One of our placements (or a tuple of them / None) as the same placement of ``stack``."""
    if isinstance(value, tuple):
        return tuple(_translate(v, stack) for v in value)
    if value is None:
        return None
    if value.is_shard():
        return stack.placements.Shard(value.dim)
    if value.is_replicate():
        return stack.placements.Replicate()
    raise ValueError(f"no translation for placement {value!r} in a TP plan")


def _translate_plan(plan: dict, stack: _Stack) -> dict:
    """Our plan as ``stack``'s: each style rebuilt from its constructor's arguments."""
    out = {}
    for path, style in plan.items():
        cls = getattr(stack.parallel, type(style).__name__)
        kwargs = {name: getattr(style, name)
                  for name in inspect.signature(type(style).__init__).parameters
                  if name != "self" and hasattr(style, name)}
        out[path] = cls(**{k: (v if isinstance(v, (bool, int, dict)) else _translate(v, stack))
                           for k, v in kwargs.items()})
    return out


def apply_llama_tp(stack: _Stack, model, tp_mesh, sequence_parallel: bool, loss_parallel: bool):
    """examples.llama_parallel's plan, through ``stack``'s styles. (benchmarks/overlap.py and
    compile_step.py build through this.)"""
    plan = llama_tp_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    if stack.impl != "ours":
        plan = _translate_plan(plan, stack)
    stack.parallel.parallelize_module(model, tp_mesh, plan)


def build(impl: str, case: str):
    """The model of ``case`` parallelized by ``impl``, its AdamW, and whether loss parallel."""
    sizes, sp, lp = CASES[case]
    stack = _Stack(impl)
    mesh = stack.init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    torch.manual_seed(0)
    model = Llama(CFG)
    apply_llama_tp(stack, model, mesh["tp"], sp, lp)
    if "dp_shard" in sizes:
        for block in model.layers:
            stack.fully_shard(block, mesh=mesh["dp_shard"])
        stack.fully_shard(model, mesh=mesh["dp_shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    # torch's FSDP warns that the root returns a view (the flattened logits); nothing is in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    loss_ctx = stack.parallel.loss_parallel if lp else contextlib.nullcontext
    dp_rank = mesh.get_local_rank("dp_shard") if "dp_shard" in sizes else 0
    return model, opt, loss_ctx, dp_rank, sizes.get("dp_shard", 1)


# ----------------------------------------------------------------------------- timing
def bench(case: str, steps: int, warmup: int, impls, profile_dir: str | None) -> list[dict]:
    runs = {impl: build(impl, case) for impl in impls}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
               for _ in range(steps + warmup)]
    times = {impl: [] for impl in impls}
    losses = {impl: [] for impl in impls}
    prof = cProfile.Profile() if profile_dir and dist.get_rank() == 0 else None
    world_mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # for the mean loss

    def step(impl, tokens):
        model, opt, loss_ctx, dp_rank, dp = runs[impl]
        rows = BATCH // dp
        tokens = tokens[dp_rank * rows:(dp_rank + 1) * rows]
        with loss_ctx():
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.to_local() if hasattr(loss, "to_local") else loss

    for i, tokens in enumerate(batches):
        for impl in impls:  # alternate: both see the same machine load
            profiling = prof is not None and impl == "ours" and i >= warmup
            loss, elapsed = _timed(step, (impl, tokens), prof if profiling else None)
            if i >= warmup:
                times[impl].append(elapsed)
            # every rank's loss; TP ranks agree, so this is the dp mean (through dtensor_lite, so
            # nothing of it is in flight when the program ends: docs/internals.md, "Exit")
            mean = DTensor.from_local(loss.detach().reshape(1).float(), world_mesh,
                                      [Partial("avg")]).full_tensor()
            losses[impl].append(float(mean))
    if prof is not None:
        _report_profile(prof, profile_dir, case, f"case {case}, rank 0, {steps} steps")
    sizes, sp, lp = CASES[case]
    return [{"case": case, "impl": impl, "world": dist.get_world_size(),
             "mesh": sizes, "sequence_parallel": sp, "loss_parallel": lp,
             "step_ms_median": 1000 * statistics.median(times[impl]),
             "step_ms_min": 1000 * min(times[impl]), "steps": steps, "warmup": warmup,
             "losses": losses[impl]} for impl in impls]


def _run_all(cases, args) -> list[dict]:
    rows = []
    for case in cases:
        rows.extend(bench(case, args.steps, args.warmup, args.impls, args.profile))
    return rows


# ----------------------------------------------------------------------------- processes
def _world(case: str) -> int:
    world = 1
    for size in CASES[case][0].values():
        world *= size
    return world


def _loss_gap(rows, case) -> float | None:
    """Largest relative difference of the per-step losses of ours and torch's in ``case``."""
    by_impl = {r["impl"]: r["losses"] for r in rows if r["case"] == case}
    if len(by_impl) < 2:
        return None
    return max(abs(a - b) / abs(b) for a, b in zip(by_impl["ours"], by_impl["torch"]))


def _print_table(rows, load: str):
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"one training step (fwd + bwd + AdamW), gloo on CPU; load {load}",
                  caption="ms: median over the timed steps (min in brackets); loss gap: largest "
                          "relative difference of the per-step losses, ours vs torch")
    for col in ("case", "world", "mesh", "SP", "LP", "ours ms", "torch ms", "ours/torch",
                "loss gap", "loss[-1]"):
        table.add_column(col, justify="right" if "ms" in col or col in ("world", "ours/torch",
                                                                        "loss gap") else "left")
    for case in dict.fromkeys(r["case"] for r in rows):
        by_impl = {r["impl"]: r for r in rows if r["case"] == case}
        any_row = next(iter(by_impl.values()))

        def cell(impl):
            r = by_impl.get(impl)
            return "-" if r is None else f"{r['step_ms_median']:.1f} ({r['step_ms_min']:.1f})"
        ratio = (f"{by_impl['ours']['step_ms_median'] / by_impl['torch']['step_ms_median']:.2f}"
                 if len(by_impl) == 2 else "-")
        gap = _loss_gap(rows, case)
        table.add_row(case, str(any_row["world"]),
                      " x ".join(f"{k}={v}" for k, v in any_row["mesh"].items()),
                      "on" if any_row["sequence_parallel"] else "off",
                      "on" if any_row["loss_parallel"] else "off", cell("ours"), cell("torch"),
                      ratio, "-" if gap is None else f"{gap:.1e}",
                      f"{any_row['losses'][-1]:.5f}")
    Console(width=max(Console().width, 130)).print(table)


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"
    except OSError:
        return "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--profile", metavar="DIR", help="cProfile our timed steps on rank 0")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                       "tp_step.json"))
    args = parser.parse_args()
    load_before = _load()
    if "RANK" in os.environ:  # launched by torchrun: the cases of this world size
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        cases = [c for c in args.cases if _world(c) == dist.get_world_size()]
        rows = _run_all(cases, args)
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return
    else:
        rows = []
        ctx = mp.get_context("spawn")
        for world in sorted({_world(c) for c in args.cases}):
            cases = [c for c in args.cases if _world(c) == world]
            queue = ctx.Queue()
            mp.start_processes(_worker, args=(world, _free_port(), queue, _run_all, cases, args),
                               nprocs=world, start_method="spawn", join=True)
            rows.extend(queue.get())
    load = f"{load_before} (start) / {_load()} (end)"
    print(f"model: {CFG}\nglobal batch {BATCH} x {SEQ - 1} tokens, AdamW (foreach)\n")
    _print_table(rows, load)
    gaps = {case: _loss_gap(rows, case) for case in dict.fromkeys(r["case"] for r in rows)}
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"config": vars(CFG), "batch": BATCH, "seq": SEQ - 1, "load": load,
                   "loss_gaps": gaps, "rows": rows}, f, indent=1)
    print(f"\nwrote {args.json}")
    bad = {c: g for c, g in gaps.items() if g is not None and g > 1e-4}
    if bad:
        print(f"WARNING: losses of ours and torch differ: {bad}")


if __name__ == "__main__":
    main()
