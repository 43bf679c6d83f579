"""Eager dispatch overhead: microseconds per op, dtensor_lite beside torch.distributed.tensor.

Runs in one process (a 1-rank world: gloo on CPU, nccl with ``--device cuda``), so it measures
pure dispatch cost: cache hits, no communication. On CUDA the kernels are queued asynchronously
and each timed loop ends with a synchronize, so a row is the host-side cost per op unless the GPU
itself is slower (for these 64x64 ops it is not). Each row times the same op on plain tensors, on our DTensor, and on PyTorch's
DTensor in the same run, and prints a rich table; ``--json PATH`` also saves the numbers.

    python benchmarks/dispatch.py [--device cpu|cuda] [--iters 20000] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import torch.distributed as dist


def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


ROUNDS = 15


def _bench_interleaved(fns, iters: int, device: str) -> list[float]:
    """Microseconds per call of each of ``fns``, timed in interleaved rounds (plain, ours, torch,
    plain, ...) so that a change in machine load hits all alike; the best round of each counts.
    On CPU the clock is the benchmarking thread's CPU time, which leaves out the time the
    machine gave to other processes; on CUDA it is wall time (the loop ends with a sync)."""
    clock = time.perf_counter if device == "cuda" else time.thread_time
    per_round = max(iters // ROUNDS, 1)
    for fn in fns:
        for _ in range(max(iters // 20, 50)):
            fn()
    _sync(device)
    best = [float("inf")] * len(fns)
    for _ in range(ROUNDS):
        for i, fn in enumerate(fns):
            t0 = clock()
            for _ in range(per_round):
                fn()
            _sync(device)
            best[i] = min(best[i], (clock() - t0) / per_round)
    return [b * 1e6 for b in best]


def _cases(lib, mesh, shard, replicate, device):
    """(name, placements description, callable factory) for one library."""
    dt = lib.distribute_tensor
    a = dt(torch.randn(64, 64, device=device), mesh, [shard(0)])
    b = dt(torch.randn(64, 64, device=device), mesh, [shard(0)])
    r = dt(torch.randn(64, 64, device=device), mesh, [replicate()])
    w = dt(torch.randn(64, 64, device=device), mesh, [replicate()])
    v = dt(torch.randn(64, device=device), mesh, [replicate()])
    return [
        ("add", "S(0) + S(0)", lambda: a + b),
        ("mul scalar", "S(0) * 2.0", lambda: a * 2.0),
        ("add_ (in-place)", "S(0) += S(0)", lambda: a.add_(b, alpha=0.0)),
        ("relu", "S(0)", lambda: torch.relu(a)),
        ("broadcast add", "S(0) + R[64]", lambda: a + v),
        ("mm", "S(0) @ R", lambda: a @ w),
        ("linear", "S(0), R weight", lambda: torch.nn.functional.linear(a, w)),
        ("sum(dim=1)", "S(0)", lambda: a.sum(1)),
        ("t", "S(0)", lambda: a.t()),
        ("view", "S(0)", lambda: a.view(64, 8, 8)),
        ("add (replicated)", "R + R", lambda: r + w),
    ]


def _add_stages(ours, mesh, device, iters: int) -> list[dict]:
    """Where the microseconds of one cached ``a + b`` (S(0) + S(0), 64x64) go: each stage timed
    alone in the same interleaved rounds, then the differences ("= checks+key+lookup+call" is
    direct - plain - wrapper, "= C++ parse + hook entry" before - direct, "= Python method
    entry" now - direct). "before" is the call entering
    through ``__torch_function__`` (as every call did until Tensor methods were defined on
    DTensor in Python, _fast_methods.py: measured with them removed), "after" the call as it
    runs now."""
    from dtensor_lite import _fast_path
    from dtensor_lite import _torch_names as N
    a = ours.distribute_tensor(torch.randn(64, 64, device=device), mesh, [ours.Shard(0)])
    b = ours.distribute_tensor(torch.randn(64, 64, device=device), mesh, [ours.Shard(0)])
    x, y = a._local_tensor, b._local_tensor
    out = x + y
    shape, dtype, make = a.shape, a.dtype, N.make_wrapper_subclass
    cls, base = type(a), N.TensorBase.add

    def through_hook():  # what a + b was before: the C++ entry into __torch_function__
        return base(a, b)
    fns = {
        "plain x + y": lambda: x + y,
        "output wrapper alone": lambda: make(cls, shape, None, None, None, dtype, out.layout,
                                                 out.device),
        "our Python, called direct": lambda: _fast_path.torch_function(cls, base, (cls,),
                                                                         (a, b)),
        "before: via __torch_function__": through_hook,
        "now: DTensor.__add__": lambda: a + b,
    }
    for f in fns.values():  # learned before timing
        f()
    assert "__add__" in cls.__dict__  # the methods are installed (_fast_methods.py)
    us = dict(zip(fns, _bench_interleaved(list(fns.values()), iters, device)))
    plain, wrap, direct = (us["plain x + y"], us["output wrapper alone"],
                           us["our Python, called direct"])
    rows = [{"stage": k, "us": v} for k, v in us.items()]
    rows += [{"stage": "= checks+key+lookup+call",
              "us": direct - plain - wrap},
             {"stage": "= C++ parse + hook entry",
              "us": us["before: via __torch_function__"] - direct},
             {"stage": "= Python method entry",
              "us": us["now: DTensor.__add__"] - direct}]
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    torch.set_num_threads(1)

    import dtensor_lite as ours
    import torch.distributed.tensor as theirs
    from torch.distributed.device_mesh import init_device_mesh as torch_init_mesh

    our_cases = _cases(ours, ours.init_device_mesh(device, (1,)), ours.Shard, ours.Replicate,
                       device)
    their_cases = _cases(theirs, torch_init_mesh(device, (1,)), theirs.Shard, theirs.Replicate,
                         device)
    x, y, w = (torch.randn(64, 64, device=device) for _ in range(3))
    plain = {"add": lambda: x + y, "mul scalar": lambda: x * 2.0,
             "add_ (in-place)": lambda: x.add_(y, alpha=0.0), "relu": lambda: torch.relu(x),
             "broadcast add": lambda: x + y[0], "mm": lambda: x @ w,
             "linear": lambda: torch.nn.functional.linear(x, w), "sum(dim=1)": lambda: x.sum(1),
             "t": lambda: x.t(), "view": lambda: x.view(64, 8, 8),
             "add (replicated)": lambda: x + y}

    rows = []
    for (name, placements, ours_fn), (_, _, theirs_fn) in zip(our_cases, their_cases):
        p, o, t = _bench_interleaved([plain[name], ours_fn, theirs_fn], args.iters, device)
        rows.append({"op": name, "placements": placements, "plain_us": p, "dtensor_lite_us": o,
                     "torch_dtensor_us": t,
                     # what each library adds above the plain op
                     "overhead_ratio": (o - p) / max(t - p, 1e-9)})

    from rich.console import Console
    from rich.table import Table
    where = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    table = Table(title=f"eager dispatch on {where}, µs per op (torch {torch.__version__}, 1 rank, "
                        f"{args.iters} iters, best of {ROUNDS} interleaved rounds)")
    for col in ("op", "placements", "plain", "dtensor_lite", "torch DTensor", "ours / torch",
                "overhead ours / torch"):
        table.add_column(col, justify="right" if col not in ("op", "placements") else "left")
    for r in rows:
        table.add_row(r["op"], r["placements"], f"{r['plain_us']:.2f}",
                      f"{r['dtensor_lite_us']:.2f}", f"{r['torch_dtensor_us']:.2f}",
                      f"{r['dtensor_lite_us'] / r['torch_dtensor_us']:.2f}x",
                      f"{r['overhead_ratio']:.2f}x")
    Console().print(table)
    from dtensor_lite import _fast_path
    # the stages time the dispatch shortcut's pieces: none to time on a torch it is off for
    stages = (_add_stages(ours, ours.init_device_mesh(device, (1,)), device, args.iters)
              if _fast_path.installed() else [])
    table = Table(title="one cached a + b (S(0) + S(0), 64x64), µs: where the time goes")
    table.add_column("stage", justify="left")
    table.add_column("µs", justify="right")
    for r in stages:
        table.add_row(r["stage"], f"{r['us']:.2f}")
    Console().print(table)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "machine": platform.machine(), "device": where,
                       "iters": args.iters, "rows": rows, "add_stages": stages}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
