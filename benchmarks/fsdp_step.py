"""One FSDP training step, ours (fsdp.fully_shard on dtensor_lite) beside PyTorch's fully_shard.

Same Llama-style model, same seed, same data, AdamW; per world size it reports the median step
time (forward + backward + optimizer; the two implementations alternate step by step, so both
see the same machine load; the step that counts bytes and the warmup steps, where our peak is
sampled, are not timed), the parameter bytes a rank holds between steps, the peak
unsharded parameter bytes during a step (ours), and the bytes each rank sends per step (our
CommDebugMode for ours; the c10d calls of torch's FSDP counted with the same cost model).

    python benchmarks/fsdp_step.py                       # spawns world sizes 2 and 4 itself
    python benchmarks/fsdp_step.py --worlds 2 --steps 20 --json out.json
    torchrun --nproc-per-node 4 benchmarks/fsdp_step.py  # one world size, from the launcher

Prints a table and writes JSON (default benchmarks/results/fsdp_step.json). Timings on a shared
CPU box are noisy: compare the two columns of one run, not runs with each other.
"""
from __future__ import annotations

import argparse
import cProfile
import inspect
import json
import os
import pstats
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.llama import Llama, LlamaConfig, loss_fn  # noqa: E402

CFG = LlamaConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, ffn_dim=352, max_seq_len=64)
BATCH, SEQ = 8, 33  # global batch; each rank trains on BATCH // world rows


# ----------------------------------------------------------------------------- comm accounting
class _TorchCommCounter:
    """Counts the c10d collectives that torch's FSDP issues, in bytes sent per rank under the
    cost model of dtensor_lite.collectives (ring: (n-1) chunks; all-reduce 2(n-1)/n)."""

    NAMES = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
             "all_reduce": "all_reduce"}

    def __init__(self):
        self.bytes: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        self._saved = {}

    def __enter__(self):
        for name, kind in self.NAMES.items():
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn
            setattr(dist, name, self._wrap(fn, kind))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def _wrap(self, fn, kind):
        signature = inspect.signature(fn)

        def wrapped(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            n = dist.get_world_size(bound.get("group"))
            tensors = [v for v in bound.values() if isinstance(v, torch.Tensor)]
            if kind == "all_gather":  # (output, input): the input is one chunk
                nbytes = (n - 1) * tensors[1].numel() * tensors[1].element_size()
            elif kind == "reduce_scatter":  # (output, input): the output is one chunk
                nbytes = (n - 1) * tensors[0].numel() * tensors[0].element_size()
            else:
                t = tensors[0]
                nbytes = 2 * (n - 1) * -(-t.numel() // n) * t.element_size()
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
            return fn(*args, **kwargs)
        return wrapped


# ----------------------------------------------------------------------------- one implementation
def _shard(impl: str, model, world: int):
    if impl.startswith("ours"):
        from dtensor_lite import init_device_mesh
        from fsdp import fully_shard
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _held_param_bytes(model) -> int:
    """Bytes of parameter storage this rank owns between steps (padding included if stored)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.untyped_storage().nbytes()
    return total


def _our_unsharded_bytes(model) -> int:
    return sum(m.__dict__["_fsdp_state"].group.unsharded_nbytes()
               for m in model.modules()
               if "_fsdp_state" in m.__dict__ and m.__dict__["_fsdp_state"].group is not None)


def _build(impl: str, world: int):
    torch.manual_seed(0)
    model = _shard(impl, Llama(CFG), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return model, opt


def _sample_peak(model, peak: list) -> list:
    """Hooks that sample our unsharded bytes at every module boundary, both directions: after
    each module's forward, and in backward when the gradient of its output arrives (a hook on
    that tensor: a full backward hook would make torch warn for every module whose inputs need
    no gradient, as the embedding's token ids). They cost time, so they run in untimed steps
    only."""
    def sample(*_):
        peak[0] = max(peak[0], _our_unsharded_bytes(model))

    def after_forward(_module, _inputs, output):
        sample()
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(sample)   # returns None: the gradient passes unchanged
    return [m.register_forward_hook(after_forward) for m in model.modules()]


def _timed(step, args, prof: cProfile.Profile | None = None):
    """``(step(*args), seconds)`` after a barrier, under ``prof`` if given.
    (benchmarks/tp_step.py times through this too.)"""
    dist.barrier()
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    out = step(*args)
    if prof is not None:
        prof.disable()
    return out, time.perf_counter() - t0


def _report_profile(prof: cProfile.Profile, profile_dir: str, name: str, what: str):
    os.makedirs(profile_dir, exist_ok=True)
    path = os.path.join(profile_dir, f"{name}.prof")
    prof.dump_stats(path)
    print(f"\n=== cProfile of ours, {what}: {path}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def _recording(on: bool) -> bool:
    """Turn dtensor_lite's desync recorder on or off; whether it was on."""
    from dtensor_lite import _desync
    was, _desync.RECORDING = _desync.RECORDING, on
    return was


def bench(impls, world: int, steps: int, warmup: int, profile_dir: str | None = None) -> list:
    """Both implementations step by step, alternating, so both see the same machine load."""
    rank = dist.get_rank()
    runs = {impl: _build(impl, world) for impl in impls}
    g = torch.Generator().manual_seed(1)
    rows = BATCH // world
    batches = [torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
               for _ in range(steps + warmup + 1)]
    data = [b[rank * rows:(rank + 1) * rows] for b in batches]
    peak = [0]
    prof = cProfile.Profile() if profile_dir and rank == 0 else None

    def step(impl, tokens):
        model, opt = runs[impl]
        # "ours-norec": the same, with the desync recorder off (dtensor_lite/_desync.py), to
        # measure what the on-by-default recorder costs in the same run
        recording = _recording(impl != "ours-norec")
        try:
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
        finally:
            _recording(recording)
        return loss.detach()

    times = {impl: [] for impl in impls}
    losses = {impl: [] for impl in impls}
    comm = {}
    for i, tokens in enumerate(data):
        for impl in impls:
            # warmup and counted steps are untimed: sample the peak there (steady state from
            # the second step on)
            handles = _sample_peak(runs[impl][0], peak) if impl == "ours" and i <= warmup else []
            if i == warmup:  # count one steady-state step (untimed: the counters cost time)
                if impl.startswith("ours"):
                    from dtensor_lite.debug import CommDebugMode
                    with CommDebugMode() as mode:
                        loss = step(impl, tokens)
                    comm[impl] = (mode.get_comm_bytes(), mode.get_comm_counts())
                else:
                    with _TorchCommCounter() as counter:
                        loss = step(impl, tokens)
                    comm[impl] = (counter.bytes, counter.counts)
                losses[impl].append(float(loss))
                for h in handles:
                    h.remove()
                continue
            profiling = prof is not None and impl == "ours" and i > warmup
            loss, elapsed = _timed(step, (impl, tokens), prof if profiling else None)
            for h in handles:
                h.remove()
            if i > warmup:
                times[impl].append(elapsed)
            losses[impl].append(float(loss))
    if prof is not None:
        _report_profile(prof, profile_dir, f"fsdp_world{world}",
                        f"world {world}, rank 0, {steps} steps")
    out = []
    for impl in impls:
        comm_bytes, comm_counts = comm[impl]
        out.append({
            "impl": impl, "world": world, "step_ms_median": 1000 * statistics.median(times[impl]),
            "step_ms_min": 1000 * min(times[impl]),
            "param_bytes_held": _held_param_bytes(runs[impl][0]),
            "peak_unsharded_param_bytes": peak[0] if impl == "ours" else None,
            "comm_bytes_per_rank": dict(comm_bytes), "comm_counts": dict(comm_counts),
            "comm_bytes_total": sum(comm_bytes.values()), "losses": losses[impl],
        })
    return out


# ----------------------------------------------------------------------------- processes
def _worker(rank, world, port, queue, fn, *fn_args):
    """One spawned rank of a gloo world: runs ``fn(*fn_args)``; rank 0 puts its result on
    ``queue``. (benchmarks/tp_step.py spawns through this too.)"""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        results = fn(*fn_args)
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def spawn_world(world: int, fn, *fn_args):
    """Run ``fn(*fn_args)`` on ``world`` spawned gloo ranks; rank 0's result.
    (benchmarks/overlap.py and compile_step.py spawn through this.)"""
    queue = mp.get_context("spawn").Queue()
    mp.start_processes(_worker, args=(world, _free_port(), queue, fn, *fn_args), nprocs=world,
                       start_method="spawn", join=True)
    return queue.get()


def write_json(path: str, payload: dict):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"\nwrote {path}")


def _run_all(world, args):
    return bench(args.impls, world, args.steps, args.warmup, args.profile)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _table(rows):
    head = (f"{'world':>5} {'impl':>10} {'step ms':>9} {'param B held':>13} {'peak unsharded B':>17}"
            f" {'sent B/rank':>12} {'collectives':>32} {'loss[-1]':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(r["comm_counts"].items()))
        peak = r["peak_unsharded_param_bytes"]
        peak = "n/a" if peak is None else f"{peak:,}"
        lines.append(f"{r['world']:>5} {r['impl']:>10} {r['step_ms_median']:>9.1f} "
                     f"{r['param_bytes_held']:>13,} {peak:>17} {r['comm_bytes_total']:>12,} "
                     f"{counts:>32} {r['losses'][-1]:>9.5f}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--impls", nargs="+", default=["ours", "torch"],
                        choices=["ours", "ours-norec", "torch"],
                        help="ours-norec: ours with the desync recorder off (its cost)")
    parser.add_argument("--profile", metavar="DIR", help="cProfile our timed steps on rank 0")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                       "fsdp_step.json"))
    args = parser.parse_args()
    rows = []
    if "RANK" in os.environ:  # launched by torchrun: one world size
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rows = _run_all(dist.get_world_size(), args)
        if dist.get_rank() != 0:
            dist.destroy_process_group()
            return
        dist.destroy_process_group()
    else:
        ctx = mp.get_context("spawn")
        for world in args.worlds:
            queue = ctx.Queue()
            mp.start_processes(_worker, args=(world, _free_port(), queue, _run_all, world, args),
                               nprocs=world, start_method="spawn", join=True)
            rows.extend(queue.get())
    print(f"model: {CFG}\nglobal batch {BATCH} x {SEQ - 1} tokens, AdamW, gloo on CPU\n")
    print(_table(rows))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"config": vars(CFG), "batch": BATCH, "seq": SEQ - 1, "rows": rows}, f, indent=1)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
