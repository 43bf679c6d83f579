"""Exposed communication per training step: how much of FSDP's (and FSDP+TP's) communication a
rank waits for, with prefetching off, at each implementation's defaults, and explicit; ours
(fsdp + tp on dtensor_lite) beside torch's fully_shard / parallelize_module in the same run.

Per step and rank it reports the step time, the *exposed* communication (seconds the training
thread was blocked waiting on a collective) and the *total* communication (seconds from each
collective's issue to its completion, summed), medians over the timed steps (rank 0's view).

* ours: ``dtensor_lite.debug.ExposedCommMode`` (every collective goes through
  ``dtensor_lite.collectives``, which times waits and notes completions);
* torch: the same clock (``debug_state.CommFlight``) put around torch.distributed for torch's steps
  only: its collective calls are issued asynchronously (a synchronous call waits at once) and
  ``Work.wait`` is timed.

torch's TP collectives are functional collectives (``_c10d_functional`` ops), which this clock
does not see: for FSDP+TP its columns cover FSDP's collectives only, ours cover FSDP's and TP's.

Exposed = the issue calls plus the waits; in flight = issue to completion (the backend's
completion callback if it fired before the wait began, else the end of the wait; gloo's
reduce-scatter has no callback, so torch's reduce-scatter flights are an upper bound -- ours, an
in-place all-reduce on gloo, has one).

Prefetch modes: ``off`` (both: ``set_modules_to_forward_prefetch([])`` and
``set_modules_to_backward_prefetch([])`` on every block), ``default`` (ours: implicit forward and
backward prefetch; torch: implicit backward prefetch only), ``explicit`` (both: block i
prefetches block i+1 in forward and block i-1 in backward).

    python benchmarks/overlap.py                      # spawns 4 ranks itself
    python benchmarks/overlap.py --steps 6 --cases fsdp4 --json out.json

Timings on a shared 2-core box are noisy and gloo's threads compete with compute for the same
cores: the implementations and modes alternate step by step so all see the same load; compare
rows of one run, not runs with each other.
"""
from __future__ import annotations

import argparse
import inspect
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
from dtensor_lite.debug import ExposedCommMode  # noqa: E402
from dtensor_lite.debug_state import CommFlight  # noqa: E402
from examples.llama import Llama, LlamaConfig, loss_fn  # noqa: E402

CFG = LlamaConfig(vocab_size=1024, dim=256, n_layers=4, n_heads=8, ffn_dim=704, max_seq_len=128)
BATCH, SEQ = 8, 65
CASES = {"fsdp4": {"dp_shard": 4}, "fsdp2xtp2": {"dp_shard": 2, "tp": 2}}
MODES = ("off", "default", "explicit")
IMPLS = ("ours", "torch")


# ----------------------------------------------------------------------------- torch's clocks
class _TorchCommTimer:
    """Exposed / in-flight communication seconds of the torch.distributed collectives called
    inside, on the same clock as ours (``dtensor_lite.debug_state.CommFlight``)."""

    NAMES = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
             "reduce_scatter_single", "all_reduce", "all_to_all_single")

    def __init__(self):
        self.exposed_s = 0.0
        self.total_s = 0.0
        self._saved = {}
        self._flights = {}  # id(work) -> CommFlight, until its wait

    def add_wait(self, _kind, seconds):
        self.exposed_s += seconds

    def add_flight(self, _kind, seconds):
        self.total_s += seconds

    def __enter__(self):
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(fn, name))
        work_cls = dist.distributed_c10d.Work
        self._saved_wait = wait = work_cls.wait
        flights = self._flights

        def timed_wait(work, *args, **kwargs):
            flight = flights.pop(id(work), None)
            start = time.perf_counter()
            try:
                return wait(work, *args, **kwargs)
            finally:
                if flight is not None:
                    flight.waited(start, time.perf_counter())
        work_cls.wait = timed_wait
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        dist.distributed_c10d.Work.wait = self._saved_wait

    def _wrap(self, fn, name):
        signature = inspect.signature(fn)

        def wrapped(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            async_op = bound.arguments.get("async_op", False)
            bound.arguments["async_op"] = True
            started = time.perf_counter()
            work = fn(*bound.args, **bound.kwargs)
            if work is None:
                return None
            self._flights[id(work)] = CommFlight(name, started, work, [self])
            if async_op:
                return work
            work.wait()  # the caller wanted it synchronous: all of it is exposed
            return None
        return wrapped


# ----------------------------------------------------------------------------- the models
def build(impl: str, case: str, mode: str):
    sizes = CASES[case]
    stack = _Stack("torch" if impl == "torch" else "ours")
    mesh = stack.init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    torch.manual_seed(0)
    model = Llama(CFG)
    if "tp" in sizes:
        apply_llama_tp(stack, model, mesh["tp"], sequence_parallel=False, loss_parallel=False)
    for block in model.layers:
        stack.fully_shard(block, mesh=mesh["dp_shard"])
    stack.fully_shard(model, mesh=mesh["dp_shard"])
    blocks = list(model.layers)
    for i, block in enumerate(blocks):
        if mode == "off":
            block.set_modules_to_forward_prefetch([])
            block.set_modules_to_backward_prefetch([])
        elif mode == "explicit":
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
            block.set_modules_to_backward_prefetch(blocks[i - 1:i] if i else [])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    return model, opt, mesh.get_local_rank("dp_shard"), sizes["dp_shard"]


def bench(cases, modes, impls, steps: int, warmup: int) -> list[dict]:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
               for _ in range(steps + warmup)]
    rows = []
    for case in cases:
        runs = {(impl, mode): build(impl, case, mode) for impl in impls for mode in modes}
        samples = {key: [] for key in runs}
        losses = {key: [] for key in runs}
        for i, tokens in enumerate(batches):
            for key, (model, opt, dp_rank, dp) in runs.items():
                per = BATCH // dp
                mine = tokens[dp_rank * per:(dp_rank + 1) * per]
                clock = _TorchCommTimer() if key[0] == "torch" else ExposedCommMode()
                dist.barrier()
                start = time.perf_counter()
                with clock:
                    loss = loss_fn(model(mine[:, :-1]), mine[:, 1:])
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                elapsed = time.perf_counter() - start
                dist.barrier()  # every collective of the step has completed: totals are in
                loss = loss.detach()
                losses[key].append(float(loss.full_tensor() if hasattr(loss, "full_tensor")
                                         else loss))
                if i >= warmup:
                    samples[key].append((elapsed, clock.exposed_s, clock.total_s))
        for (impl, mode), s in samples.items():
            step_ms = 1000 * statistics.median(x[0] for x in s)
            exposed = 1000 * statistics.median(x[1] for x in s)
            total = 1000 * statistics.median(x[2] for x in s)
            rows.append({"case": case, "impl": impl, "prefetch": mode, "rank": rank,
                         "step_ms": step_ms, "exposed_comm_ms": exposed, "total_comm_ms": total,
                         "exposed_share": exposed / total if total else 0.0,
                         "losses": losses[(impl, mode)]})
    return rows


def _run_all(args):
    return bench(args.cases, args.modes, args.impls, args.steps, args.warmup)


def _table(rows):
    head = (f"{'case':>10} {'impl':>6} {'prefetch':>9} {'step ms':>8} {'exposed ms':>11} "
            f"{'total comm ms':>14} {'exposed %':>10} {'loss[-1]':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['case']:>10} {r['impl']:>6} {r['prefetch']:>9} {r['step_ms']:>8.1f} "
                     f"{r['exposed_comm_ms']:>11.1f} {r['total_comm_ms']:>14.1f} "
                     f"{100 * r['exposed_share']:>9.0f}% {r['losses'][-1]:>9.5f}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                       "overlap.json"))
    args = parser.parse_args()
    rows = spawn_world(4, _run_all, args)
    print(f"model: {CFG}\nglobal batch {BATCH} x {SEQ - 1} tokens, AdamW, gloo on CPU, 4 ranks "
          f"(rank 0 shown; medians of {args.steps} steps)\n")
    print(_table(rows))
    write_json(args.json, {"config": vars(CFG), "batch": BATCH, "seq": SEQ - 1, "rows": rows})


if __name__ == "__main__":
    main()
