"""A step that is mostly overhead: a sequence-parallel TP MLP block at small shapes.

At the sizes where TP runs on small micro-batches, the step time is mostly the CPU cost of
issuing ops (Python, dispatch, hooks), not the ops themselves: this is where a DTensor library's
per-op cost shows. Block (pre-norm, residual, sequence parallel):

    y = x + w2(gelu(w1(norm(x))))       x: (batch, seq, hidden) laid out Shard(1) (sequence)

with ``SequenceParallel`` on ``norm``, ``ColwiseParallel(input_layouts=Shard(1))`` on ``w1`` (one
all-gather of the sequence) and ``RowwiseParallel(output_layouts=Shard(1))`` on ``w2`` (one
reduce-scatter). One step: forward, backward, SGD (foreach) step, zero_grad.

Rows, per world size (2 and 4 gloo ranks, one thread each), timed in the same processes with the
steps alternating so that load changes hit every row alike:

* ``plain``: single-process torch on this rank's local shapes (norm on seq/n, the two linears
  with ffn/n on the whole sequence), no communication: what the arithmetic alone costs;
* ``c10d`` (eager only): the block as hand-written sequence-parallel TP on ``torch.distributed``
  (the collectives inside autograd Functions, the replicated parameters' gradients summed in one
  flat all-reduce), no DTensor: the arithmetic plus the same five collectives, the floor once
  communication is counted;
* ``torch``: torch.distributed.tensor + its parallel styles;
* ``ours``: dtensor_lite + tp;
* the same two compiled (``torch.compile`` with ``aot_eager`` and ``inductor``), to show what
  remains once dispatch is traced away.

Also, on 2 ranks: a 64x64 ``F.dropout`` on a ``Shard(0)`` DTensor (the random-op path), ours vs
torch vs plain.

    python benchmarks/overhead.py [--worlds 2 4] [--steps 60] [--backends aot_eager inductor]

Prints a table and writes JSON (default benchmarks/results/overhead.json). Cells are medians of
the timed steps: CPU time of rank 0's main thread (the host cost, robust on a loaded machine; it
leaves out waits in collectives, which both libraries issue alike) and wall time. On a shared
machine compare the rows of one run (ratios), not absolute times.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fsdp_step import spawn_world, write_json  # noqa: E402

BATCH, SEQ, HIDDEN, FFN = 2, 16, 32, 128


class Block(nn.Module):
    def __init__(self, ffn: int = FFN):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.w1 = nn.Linear(HIDDEN, ffn)
        self.w2 = nn.Linear(ffn, HIDDEN)

    def forward(self, x):
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class _PlainLocal(nn.Module):
    """This rank's arithmetic with no communication: norm on its sequence piece, the linears
    (ffn/n wide) on the whole sequence."""

    def __init__(self, world: int):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.w1 = nn.Linear(HIDDEN, FFN // world)
        self.w2 = nn.Linear(FFN // world, HIDDEN)
        self.world = world

    def forward(self, x):  # x: (batch, seq/n, hidden)
        h = self.norm(x).repeat(1, self.world, 1)  # stands in for the all-gather
        out = self.w2(F.gelu(self.w1(h)))
        return x + out[:, :x.shape[1]]  # stands in for the reduce-scatter


def _gather_seq(x):
    pieces = x.movedim(1, 0).contiguous()
    out = pieces.new_empty((dist.get_world_size() * pieces.shape[0],) + pieces.shape[1:])
    dist.all_gather_into_tensor(out, pieces)
    return out.movedim(0, 1)


def _reduce_scatter_seq(x):
    whole = x.movedim(1, 0).contiguous()
    dist.all_reduce(whole)
    n = whole.shape[0] // dist.get_world_size()
    return whole.narrow(0, dist.get_rank() * n, n).clone().movedim(0, 1)


def _collective_node(name, forward, backward):
    """An autograd Function running ``forward`` on its input, its transpose ``backward`` on the
    gradient."""
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(lambda ctx, x: forward(x)),
        "backward": staticmethod(lambda ctx, grad: backward(grad))})


# all-gather of the sequence (dim 1), whose backward sums the gradient over the ranks and keeps
# this rank's piece (gloo's reduce-scatter form: an in-place all-reduce, then the slot); and the
# reduce-scatter, whose backward is the all-gather
_Gather = _collective_node("_Gather", _gather_seq, _reduce_scatter_seq)
_ReduceScatter = _collective_node("_ReduceScatter", _reduce_scatter_seq, _gather_seq)


class _C10dLocal(nn.Module):
    """The block as hand-written sequence-parallel TP on torch.distributed, no DTensor: this
    rank's norm on its sequence piece, an all-gather, the linears (ffn/n wide), a reduce-scatter,
    the row bias after it; the replicated parameters' gradients (norm, row bias) are summed over
    the ranks in one flat all-reduce before the optimizer step. What the same block costs with
    its communication but without any distributed-tensor library: the floor a DTensor
    library's CPU time is measured against once communication is counted."""

    def __init__(self, world: int):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.w1 = nn.Linear(HIDDEN, FFN // world)
        self.w2 = nn.Linear(FFN // world, HIDDEN, bias=False)
        self.b2 = nn.Parameter(torch.zeros(HIDDEN))

    def forward(self, x):  # x: (batch, seq/n, hidden)
        h = _Gather.apply(self.norm(x))
        return x + _ReduceScatter.apply(self.w2(F.gelu(self.w1(h)))) + self.b2

    def sum_replicated_grads(self):
        params = [self.norm.weight, self.norm.bias, self.b2]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        for p, g in zip(params, flat.split_with_sizes([p.numel() for p in params])):
            p.grad = g.view_as(p)


def _stack(impl):
    if impl == "ours":
        import dtensor_lite as pl
        import tp as par
        from dtensor_lite import init_device_mesh
    else:
        import torch.distributed.tensor as pl
        import torch.distributed.tensor.parallel as par
        from torch.distributed.device_mesh import init_device_mesh
    return pl, par, init_device_mesh


def _build(impl: str, world: int, backend: str | None):
    torch.manual_seed(0)
    if impl in ("plain", "c10d"):
        model = _PlainLocal(world) if impl == "plain" else _C10dLocal(world)
        x = torch.randn(BATCH, SEQ // world, HIDDEN, requires_grad=True)
    else:
        pl, par, init_mesh = _stack(impl)
        mesh = init_mesh("cpu", (world,))
        model = Block()
        par.parallelize_module(model, mesh, {
            "norm": par.SequenceParallel(),
            "w1": par.ColwiseParallel(input_layouts=pl.Shard(1)),
            "w2": par.RowwiseParallel(output_layouts=pl.Shard(1), use_local_output=False)})
        x = pl.distribute_tensor(torch.randn(BATCH, SEQ, HIDDEN), mesh, [pl.Shard(1)])
        x.requires_grad_()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
    fwd = model if backend is None else torch.compile(model, backend=backend)

    def step():
        out = fwd(x)
        out.to_local().sum().backward() if impl in ("torch", "ours") else out.sum().backward()
        if impl == "c10d":
            model.sum_replicated_grads()
        opt.step()
        opt.zero_grad()
    return step


def _time_rows(world: int, steps: int, warmup: int, backends) -> list[dict]:
    variants = [(impl, None) for impl in ("plain", "c10d", "torch", "ours")]
    variants += [(impl, b) for b in backends for impl in ("plain", "torch", "ours")]
    runs, errors = {}, {}
    for impl, backend in variants:
        try:
            step = _build(impl, world, backend)
            for _ in range(warmup):  # compiles here
                step()
            runs[(impl, backend)] = step
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
            errors[(impl, backend)] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            if dist.get_rank() == 0:
                traceback.print_exc()
    times = {v: [] for v in runs}
    cpu = {v: [] for v in runs}
    for _ in range(steps):
        for v, step in runs.items():  # alternate: every variant sees the same machine load
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            step()
            cpu[v].append(time.thread_time() - c0)
            times[v].append(time.perf_counter() - t0)
    rows = []
    for impl, backend in variants:
        t, c = times.get((impl, backend)), cpu.get((impl, backend))
        rows.append({"world": world, "impl": impl, "compiled": backend or "eager",
                     "cpu_ms_median": None if not c else 1000 * statistics.median(c),
                     "step_ms_median": None if not t else 1000 * statistics.median(t),
                     "step_ms_min": None if not t else 1000 * min(t),
                     "error": errors.get((impl, backend))})
    return rows


def _dropout_rows(iters: int) -> list[dict]:
    """A 64x64 F.dropout on a Shard(0) DTensor: µs per call (median of interleaved rounds)."""
    x = torch.randn(64, 64)
    fns = {"plain": lambda: F.dropout(x, 0.1)}
    for impl in ("torch", "ours"):
        pl, _, init_mesh = _stack(impl)
        mesh = init_mesh("cpu", (dist.get_world_size(),))
        dx = pl.distribute_tensor(x, mesh, [pl.Shard(0)])
        fns[impl] = (lambda d: lambda: F.dropout(d, 0.1))(dx)
    samples = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(20):
            fn()
    for _ in range(30):
        for name, fn in fns.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(iters):
                fn()
            cpu[name].append((time.thread_time() - c0) / iters * 1e6)
            samples[name].append((time.perf_counter() - t0) / iters * 1e6)
    return [{"op": "dropout 64x64 Shard(0)", "impl": k, "world": dist.get_world_size(),
             "cpu_us_median": statistics.median(cpu[k]), "us_median": statistics.median(v),
             "us_min": min(v)} for k, v in samples.items()]


def _run(world, args):
    warnings.filterwarnings("ignore")
    rows = _time_rows(world, args.steps, args.warmup, args.backends)
    drop = _dropout_rows(args.dropout_iters) if world == 2 else []
    return rows, drop


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"
    except OSError:
        return "unknown"


def _print(rows, drop, load):
    print(f"block: batch {BATCH}, seq {SEQ}, hidden {HIDDEN}, ffn {FFN}; step = fwd + bwd + "
          f"SGD(foreach) + zero_grad; load {load}\ncells: median CPU ms of rank 0's main thread "
          "(what a step costs the host, without time the machine gave to other processes) / "
          "median wall ms; ratios of the CPU medians")
    head = f"{'world':>5} {'compiled':>10} {'plain':>16} {'c10d':>16} {'torch':>16} " \
           f"{'ours':>16} {'ours/torch':>10} {'ours/plain':>10} {'ours/c10d':>9}"
    print(head + "\n" + "-" * len(head))
    for world in dict.fromkeys(r["world"] for r in rows):
        for mode in dict.fromkeys(r["compiled"] for r in rows):
            by = {r["impl"]: r for r in rows if r["world"] == world and r["compiled"] == mode}

            def cell(impl):
                r = by.get(impl)
                if r is None:
                    return "-"
                if r["step_ms_median"] is None:
                    return "failed"
                return f"{r['cpu_ms_median']:.2f} / {r['step_ms_median']:.2f}"

            def ratio(a, b):
                if a not in by or b not in by or by[a]["step_ms_median"] is None or \
                        by[b]["step_ms_median"] is None:
                    return "-"
                return f"{by[a]['cpu_ms_median'] / by[b]['cpu_ms_median']:.2f}"
            print(f"{world:>5} {mode:>10} {cell('plain'):>16} {cell('c10d'):>16} "
                  f"{cell('torch'):>16} {cell('ours'):>16} {ratio('ours', 'torch'):>10} "
                  f"{ratio('ours', 'plain'):>10} {ratio('ours', 'c10d'):>9}")
    for r in rows:
        if r["error"]:
            print(f"  {r['world']} ranks, {r['impl']} {r['compiled']}: {r['error']}")
    if drop:
        by = {r["impl"]: r for r in drop}
        print(f"\n{drop[0]['op']}, {drop[0]['world']} ranks, µs per call, median CPU / median "
              "wall (min wall): " + ", ".join(
                  f"{k} {r['cpu_us_median']:.1f} / {r['us_median']:.1f} ({r['us_min']:.1f})"
                  for k, r in by.items())
              + f"; ours/torch CPU {by['ours']['cpu_us_median'] / by['torch']['cpu_us_median']:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--backends", nargs="*", default=["aot_eager", "inductor"])
    parser.add_argument("--dropout-iters", type=int, default=50)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                       "overhead.json"))
    args = parser.parse_args()
    load_before = _load()
    rows, drop = [], []
    for world in args.worlds:
        r, d = spawn_world(world, _run, world, args)
        rows += r
        drop += d
    load = f"{load_before} (start) / {_load()} (end)"
    _print(rows, drop, load)
    write_json(args.json, {"batch": BATCH, "seq": SEQ, "hidden": HIDDEN, "ffn": FFN,
                           "load": load, "rows": rows, "dropout": drop})


if __name__ == "__main__":
    main()
