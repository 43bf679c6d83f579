"""Memory of one FSDP training step: ours (fsdp.fully_shard) beside PyTorch's fully_shard.

Model: the Transformer of torch's DTensor test utilities
(``torch.testing._internal.distributed._tensor.common_dtensor``), dim 256, vocab 1024, seq 128,
``fully_shard`` on every block and on the root, AdamW, gloo on CPU. Configs: world 2 and 4,
4 and 16 layers, ``reshard_after_forward`` True / False, 2-D (dp2 x tp2: tensor parallel inside
``fully_shard``) and HSDP (2 replicas x 2 shards).

What is measured, the same way for both implementations: the bytes a training step (forward,
backward, optimizer step, zero_grad) allocates above what was live when it began, i.e. the
highest running total of the CPU allocator's allocations minus frees during the step, from the
memory events of ``torch.profiler`` (``profile_memory=True``), rank 0, median of ``--steps``
steps; "fwd" is the same figure up to the end of the forward. Every step (warm-up ones too) runs
under the profiler, so frees of buffers that an earlier step allocated are seen as well. Step
time is measured in separate, unprofiled steps; the two implementations alternate step by step,
so both see the same machine load (a shared CPU box: compare the columns of one run only).

    python benchmarks/memory.py                      # every config
    python benchmarks/memory.py --configs w2_l4 hsdp --steps 5 --json out.json

Prints a table and writes JSON (default benchmarks/results/memory.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fsdp_step import _free_port, _worker  # noqa: E402

DIM, VOCAB, SEQ, BATCH_PER_DP_RANK = 256, 1024, 128, 2
MiB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    world: int
    layers: int = 4
    reshard_after_forward: bool = True
    layout: str = "fsdp"     # "fsdp" | "2d" (dp x tp) | "hsdp" (replicate x shard)

    def describe(self) -> str:
        what = {"fsdp": f"fsdp {self.world}", "2d": "dp2 x tp2", "hsdp": "hsdp 2x2"}[self.layout]
        raf = "" if self.reshard_after_forward else ", raf=False"
        return f"{what}, {self.layers} layers{raf}"


CONFIGS = [
    Config("w2_l4", 2),
    Config("w2_l16", 2, layers=16),
    Config("w4_l4", 4),
    Config("w2_l4_noraf", 2, reshard_after_forward=False),
    Config("2d", 4, layout="2d"),
    Config("hsdp", 4, layout="hsdp"),
]


# ----------------------------------------------------------------------------- the model
def build_model(layers: int, n_heads: int = 4):
    """The test Transformer (same seed on every rank, so every rank builds the same weights)."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer
    torch.manual_seed(0)
    args = ModelArgs(n_layers=layers, vocab_size=VOCAB, max_seq_len=SEQ, dim=DIM,
                     n_heads=n_heads)
    return Transformer(args)


def _api(impl: str):
    """(init_device_mesh, fully_shard, tp styles module, parallelize_module) of one implementation."""
    if impl.startswith("ours"):
        import tp as styles
        from dtensor_lite import init_device_mesh
        from fsdp import fully_shard
        return init_device_mesh, fully_shard, styles, styles.parallelize_module
    import torch.distributed.tensor.parallel as styles
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    return init_device_mesh, fully_shard, styles, styles.parallelize_module


def _tensor_parallel(model, tp_mesh, styles, parallelize_module):
    """Transformer.parallelize's plan (no sequence parallelism, local attention outputs),
    written once for both implementations' styles."""
    from torch.distributed.tensor import Replicate as TorchReplicate
    replicate = TorchReplicate() if styles.__name__.startswith("torch") else _our_replicate()
    embed = styles.RowwiseParallel(input_layouts=replicate, output_layouts=replicate)
    parallelize_module(model, tp_mesh, {"tok_embeddings": embed, "pos_embeddings": embed})
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {
            "attention.wq": styles.ColwiseParallel(), "attention.wk": styles.ColwiseParallel(),
            "attention.wv": styles.ColwiseParallel(), "attention.wo": styles.RowwiseParallel(),
            "feed_forward.w1": styles.ColwiseParallel(),
            "feed_forward.w2": styles.RowwiseParallel()})
        layer.attention.n_heads //= tp_mesh.size()
    parallelize_module(model.output, tp_mesh, styles.ColwiseParallel(output_layouts=replicate))
    model.output.weight = model.tok_embeddings.weight  # tie again, as Transformer.parallelize does


def _our_replicate():
    from dtensor_lite import Replicate
    return Replicate()


def build(impl: str, cfg: Config):
    """``(model, optimizer, rows of data per step, dp rank)`` for one implementation."""
    init_device_mesh, fully_shard, styles, parallelize_module = _api(impl)
    tp_size = 2 if cfg.layout == "2d" else 1
    model = build_model(cfg.layers)
    if cfg.layout == "2d":
        mesh = init_device_mesh("cpu", (cfg.world // 2, 2), mesh_dim_names=("dp", "tp"))
        _tensor_parallel(model, mesh["tp"], styles, parallelize_module)
        dp_mesh = mesh["dp"]
    elif cfg.layout == "hsdp":
        dp_mesh = init_device_mesh("cpu", (2, cfg.world // 2),
                                   mesh_dim_names=("replicate", "shard"))
    else:
        dp_mesh = init_device_mesh("cpu", (cfg.world,))
    raf = cfg.reshard_after_forward
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=raf)
    # the root with each one's default (both keep its parameters from forward to backward; an
    # explicit True would make torch's reshard them) unless the config says False
    fully_shard(model, mesh=dp_mesh, **({} if raf else {"reshard_after_forward": False}))
    if impl == "ours_kept":
        _keep_shards(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return model, opt, dist.get_rank() // tp_size


def _keep_shards(model):
    """"ours_kept": ours with every shard kept beside its gathered parameter (no
    ``FSDPParam.lend_shard``), the figure before lending, measured in the same run."""
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", None)
        if state is not None and state().group is not None:
            for p in state().group.params:
                p.lends_shard = False


def train_step(model, opt, tokens, marks=None):
    """Forward, backward, optimizer step, zero_grad; ``marks(name)`` is called between phases."""
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    if marks:
        marks("forward_end")
    loss.backward()
    if marks:
        marks("backward_end")
    opt.step()
    opt.zero_grad()
    return loss.detach()


# ----------------------------------------------------------------------------- measuring
def allocation_timeline(prof) -> list[tuple[int, int, str]]:
    """``(time ns, bytes (+alloc / -free), marker)`` of the CPU allocator's events and of the
    ``record_function`` markers named ``mark::...`` in one profile, in time order."""
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.name == "[memory]":
            fields = e.extra_fields
            if fields.device.type == "cpu":
                events.append((e.start_time_ns, fields.alloc_size, ""))
        elif e.name.startswith("mark::"):
            events.append((e.start_time_ns, 0, e.name[len("mark::"):]))
    events.sort(key=lambda x: x[0])
    return events


def peaks(timeline) -> dict[str, int]:
    """Highest running total over the whole step ("step") and up to each marker."""
    total = peak = 0
    out = {}
    for _t, nbytes, mark in timeline:
        total += nbytes
        peak = max(peak, total)
        if mark:
            out[mark] = peak
    out["step"] = peak
    out["end"] = total
    return out


def live_at_peak(prof) -> dict[str, int]:
    """What was live at the step's peak, in bytes by allocation site: the outermost and the
    innermost aten op that allocated it (``"aten::linear > aten::mm"``) and the phase it was
    allocated in ("fwd": before the forward's end, else "bwd+"); frees of blocks allocated
    before the step count negative, as "(freed: from before the step)"."""
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.name == "[memory]" and e.extra_fields.device.type == "cpu":
            chain, p = [], e.parent
            while p is not None:
                chain.append(p.name)
                p = p.parent
            ends = [n.replace("autograd::engine::evaluate_function: ", "")
                    for n in (chain[-1], chain[0])] if chain else ["(no op)"]
            site = " > ".join(dict.fromkeys(ends))
            events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr, site))
        elif e.name == "mark::forward_end":
            events.append((e.start_time_ns, 0, None, "forward_end"))
    events.sort(key=lambda x: x[0])
    total = peak = 0
    peak_at = -1
    for i, (_t, nbytes, _ptr, _site) in enumerate(events):
        total += nbytes
        if total > peak:
            peak, peak_at = total, i
    live: dict[int, tuple[int, str]] = {}
    phase, freed_before = "fwd", 0
    for _t, nbytes, ptr, site in events[:peak_at + 1]:
        if ptr is None:
            phase = "bwd+"
        elif nbytes > 0:
            live[ptr] = (nbytes, f"{phase} {site}")
        elif ptr in live:
            del live[ptr]
        else:  # sized only if an earlier profiled step allocated it (the benchmark's warm-up)
            freed_before += nbytes
    out: dict[str, int] = {"(freed: from before the step)": freed_before}
    for nbytes, site in live.values():
        out[site] = out.get(site, 0) + nbytes
    return out


def profiled_step(model, opt, tokens, sites: bool = False) -> dict:
    from torch.profiler import record_function

    from dtensor_lite.quiet_profiler import memory_profile

    def marks(name):
        with record_function(f"mark::{name}"):
            pass
    with memory_profile() as prof:   # the profiler without its log lines
        train_step(model, opt, tokens, marks)
    out = peaks(allocation_timeline(prof))
    if sites:
        out["live_at_peak"] = live_at_peak(prof)
    return out


def bench_config(cfg: Config, impls, steps: int, warmup: int, sites: bool = False) -> list[dict]:
    runs = {impl: build(impl, cfg) for impl in impls}
    dp_rank = runs[impls[0]][2]
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (BATCH_PER_DP_RANK * 4, SEQ + 1), generator=g)
               for _ in range(warmup + 2 * steps)]
    data = [b[dp_rank * BATCH_PER_DP_RANK:(dp_rank + 1) * BATCH_PER_DP_RANK] for b in batches]
    mem = {impl: [] for impl in impls}
    times = {impl: [] for impl in impls}
    losses = {impl: [] for impl in impls}
    for i, tokens in enumerate(data):
        for impl in impls:
            model, opt, _ = runs[impl]
            dist.barrier()
            if i < warmup + steps:  # warm-up and memory steps: all under the profiler
                figures = profiled_step(model, opt, tokens, sites and i == warmup + steps - 1)
                if i >= warmup:
                    mem[impl].append(figures)
                continue
            t0 = time.perf_counter()
            loss = train_step(model, opt, tokens)
            times[impl].append(time.perf_counter() - t0)
            losses[impl].append(float(loss))
    rows = []
    for impl in impls:
        def median(key):
            return statistics.median(m[key] for m in mem[impl])
        rows.append({"config": cfg.name, "describe": cfg.describe(), "impl": impl,
                     "world": cfg.world, "layers": cfg.layers,
                     "reshard_after_forward": cfg.reshard_after_forward, "layout": cfg.layout,
                     "peak_bytes": median("step"), "forward_peak_bytes": median("forward_end"),
                     "peak_bytes_per_step": [m["step"] for m in mem[impl]],
                     "step_ms_median": 1000 * statistics.median(times[impl]),
                     "live_at_peak": mem[impl][-1].get("live_at_peak"),
                     "losses": losses[impl]})
    return rows


def _run_world(world, configs, impls, steps, warmup, sites=False):
    torch.set_num_threads(1)
    # torch's fully_shard warns that the test model's root returns a view (the .float() of
    # float logits); it is not modified in place here
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    rows = []
    for cfg in configs:
        if cfg.world == world:
            rows.extend(bench_config(cfg, impls, steps, warmup, sites))
    return rows


# ----------------------------------------------------------------------------- report
def table(rows) -> str:
    by_cfg: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_cfg.setdefault(r["config"], {})[r["impl"]] = r
    kept = any(r["impl"] == "ours_kept" for r in rows)  # the before-lending column, if run
    head = (f"{'config':<28} {'torch MiB':>10} {'ours MiB':>9} {'ratio':>6} "
            + (f"{'kept MiB':>9} {'ratio':>6} " if kept else "")
            + f"{'fwd torch':>10} {'fwd ours':>9} {'torch ms':>9} {'ours ms':>8}")
    lines = [head, "-" * len(head)]
    for cfg in by_cfg.values():
        t, o, k = cfg.get("torch"), cfg.get("ours"), cfg.get("ours_kept")
        any_row = t or o or k

        def mib(r, key):
            return f"{r[key] / MiB:.1f}" if r else "-"

        def ms(r):
            return f"{r['step_ms_median']:.0f}" if r else "-"

        def ratio(r):
            return f"{r['peak_bytes'] / t['peak_bytes']:.2f}x" if t and r else "-"
        extra = f"{mib(k, 'peak_bytes'):>9} {ratio(k):>6} " if kept else ""
        lines.append(f"{any_row['describe']:<28} {mib(t, 'peak_bytes'):>10} "
                     f"{mib(o, 'peak_bytes'):>9} {ratio(o):>6} {extra}"
                     f"{mib(t, 'forward_peak_bytes'):>10} "
                     f"{mib(o, 'forward_peak_bytes'):>9} {ms(t):>9} {ms(o):>8}")
    return "\n".join(lines)


def sites_table(rows, top: int = 14) -> str:
    """Per config: the allocation sites live at the peak, MiB per implementation, largest first."""
    lines = []
    by_cfg: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_cfg.setdefault(r["describe"], {})[r["impl"]] = r["live_at_peak"] or {}
    for describe, per_impl in by_cfg.items():
        impls = list(per_impl)
        keys = sorted({k for v in per_impl.values() for k in v},
                      key=lambda k: -max(v.get(k, 0) for v in per_impl.values()))
        lines.append(f"\nlive at the peak: {describe} (MiB)")
        lines.append(f"{'site':<64}" + "".join(f"{i:>11}" for i in impls))
        for k in keys[:top]:
            lines.append(f"{k[:64]:<64}" + "".join(
                f"{per_impl[i].get(k, 0) / MiB:>11.2f}" for i in impls))
        rest = keys[top:]
        lines.append(f"{f'{len(rest)} other sites':<64}" + "".join(
            f"{sum(per_impl[i].get(k, 0) for k in rest) / MiB:>11.2f}" for i in impls))
        lines.append(f"{'total':<64}" + "".join(
            f"{sum(per_impl[i].values()) / MiB:>11.2f}" for i in impls))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=[c.name for c in CONFIGS],
                        choices=[c.name for c in CONFIGS])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--impls", nargs="+", default=["ours", "torch"],
                        choices=["ours", "ours_kept", "torch"],
                        help="ours_kept: ours without lending shards to gathered parameters")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                       "memory.json"))
    parser.add_argument("--live-at-peak", action="store_true",
                        help="also print what was live at the peak, by allocation site (last "
                             "measured step)")
    args = parser.parse_args()
    configs = [c for c in CONFIGS if c.name in args.configs]
    rows = []
    ctx = mp.get_context("spawn")
    for world in sorted({c.world for c in configs}):
        queue = ctx.Queue()
        mp.start_processes(_worker, args=(world, _free_port(), queue, _run_world, world, configs,
                                          args.impls, args.steps, args.warmup,
                                          args.live_at_peak),
                           nprocs=world, start_method="spawn", join=True)
        rows.extend(queue.get())
    rows.sort(key=lambda r: [c.name for c in CONFIGS].index(r["config"]))
    print(f"Transformer (torch's DTensor test model), dim {DIM}, vocab {VOCAB}, seq {SEQ}, "
          f"{BATCH_PER_DP_RANK} sequences per data-parallel rank, AdamW, gloo on CPU; rank 0.\n"
          f"peak: bytes allocated above the step's start (profiler memory events), median of "
          f"{args.steps} steps; ms: median step time (unprofiled steps, implementations "
          f"alternating)\n")
    print(table(rows))
    if args.live_at_peak:
        print(sites_table(rows))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"dim": DIM, "vocab": VOCAB, "seq": SEQ, "batch_per_dp_rank": BATCH_PER_DP_RANK,
                   "rows": rows}, f, indent=1)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
