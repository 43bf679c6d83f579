"""A ~1B-parameter Llama training step on one GPU: ours, torch's ``fully_shard``, plain torch.

One process, a 1-rank NCCL mesh (so FSDP's all-gather / reduce-scatter really run through NCCL,
its side streams and events), bf16 compute with fp32 master weights and fp32 gradient reduction
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), AdamW. Plain torch with
``torch.autocast(bf16)`` and no FSDP is the limit both FSDPs are measured against.

Per variant: median step time, tokens/s, MFU and peak allocated memory. MFU is
6 * N * tokens / step time / peak bf16 FLOP/s, with N every parameter (the embedding included,
as the 6N rule of thumb counts it; attention's own FLOPs are left out, so MFU is a lower bound).
The variants run one after the other (each on a fresh model, the allocator's peak reset), not
interleaved: on one GPU, each needs the whole memory picture to itself.

    python benchmarks/gpu_step.py [--variants ours torch plain] [--ac none full] [--compile off|on|both]
                                  [--layers 16] [--steps 10] [--json PATH]

Needs CUDA; ``--device cpu`` with a tiny ``--layers 1 --dim 64`` model only checks the script.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.llama import Llama, LlamaConfig, loss_fn  # noqa: E402

# dense bf16 peak FLOP/s by device name (the datasheets' numbers without sparsity)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def _peak_flops(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _apply_ac(model, ac: str):
    if ac == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)


def _build(variant: str, cfg: LlamaConfig, device: str, ac: str, compile_blocks: bool):
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    _apply_ac(model, ac)
    if compile_blocks:
        for block in model.layers:
            block.compile()
    if variant in ("ours", "torch"):
        if variant == "ours":
            from dtensor_lite import init_device_mesh
            from fsdp import MixedPrecisionPolicy, fully_shard
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    # foreach AdamW: the default on CUDA, and the path both FSDPs' DTensor params take
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, opt


def run_variant(variant: str, cfg: LlamaConfig, args, ac: str, compile_blocks: bool) -> dict:
    device = args.device
    # the previous variant's model sits in reference cycles (FSDP hooks): collect it now, or a
    # collection during this variant's build would lower the baseline under its feet
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    model, opt = _build(variant, cfg, device, ac, compile_blocks)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)
    autocast = (torch.autocast(device, dtype=torch.bfloat16) if variant == "plain"
                else contextlib.nullcontext())

    def step():
        with autocast:
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    losses, times, step_peaks = [], [], []
    for i in range(args.warmup + args.steps):
        _sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            if device == "cuda":  # FSDP's stream/event path must allocate the same every step
                step_peaks.append(torch.cuda.max_memory_allocated())
        losses.append(float(loss))
    n_params = sum(p.numel() for p in model.parameters())
    step_s = statistics.median(times)
    tokens_per_step = args.batch * args.seq
    peak = _peak_flops(device)
    row = {
        "variant": variant, "ac": ac, "compiled": compile_blocks, "params": n_params,
        "step_ms": 1000 * step_s, "tokens_per_s": tokens_per_step / step_s,
        "mfu": 6 * n_params * tokens_per_step / step_s / peak if peak else None,
        "peak_alloc_GiB": (max(step_peaks, default=base) - base) / 2**30 if step_peaks else None,
        "step_peaks_bytes": step_peaks,
        "peak_same_every_step": len(set(step_peaks)) <= 1 if step_peaks else None,
        "losses": losses,
    }
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--variants", nargs="+", default=["ours", "torch", "plain"],
                        choices=["ours", "torch", "plain"])
    parser.add_argument("--ac", nargs="+", default=["none"], choices=["none", "full"])
    parser.add_argument("--compile", choices=["off", "on", "both"], default="off",
                        help="run each block eager (off), compiled (on) or both")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                       "gpu_step.json"))
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29733")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    heads = max(1, args.dim // 128)
    cfg = LlamaConfig(vocab_size=32000, dim=args.dim, n_layers=args.layers, n_heads=heads,
                      ffn_dim=int(2.75 * args.dim) // 64 * 64, max_seq_len=args.seq)
    rows = []
    for compiled in {"off": [False], "on": [True], "both": [False, True]}[args.compile]:
        for ac in args.ac:
            for variant in args.variants:
                try:
                    rows.append(run_variant(variant, cfg, args, ac, compiled))
                except Exception as exc:  # report and go on: one broken variant must not hide the rest
                    rows.append({"variant": variant, "ac": ac, "compiled": compiled,
                                 "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                print(rows[-1] if "error" in rows[-1] else
                      {k: v for k, v in rows[-1].items() if k != "losses"}, flush=True)

    from rich.console import Console
    from rich.table import Table
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    table = Table(title=f"one training step on {where}: Llama {cfg.n_layers}x{cfg.dim} "
                        f"(ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}), batch {args.batch} x "
                        f"{args.seq} tokens, bf16 compute / fp32 master, AdamW, torch "
                        f"{torch.__version__}")
    for col in ("variant", "AC", "compiled", "step ms", "tokens/s", "MFU", "peak GiB",
                "same peak each step", "loss first→last"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["variant"], r["ac"], str(r["compiled"]), "error", r["error"][:60],
                          "", "", "", "")
            continue
        table.add_row(r["variant"], r["ac"], str(r["compiled"]), f"{r['step_ms']:.1f}",
                      f"{r['tokens_per_s']:,.0f}",
                      f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a",
                      f"{r['peak_alloc_GiB']:.2f}" if r["peak_alloc_GiB"] is not None else "n/a",
                      str(r["peak_same_every_step"]),
                      f"{r['losses'][0]:.4f}→{r['losses'][-1]:.4f}")
    Console(width=160).print(table)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"device": where, "torch": torch.__version__, "config": vars(cfg),
                   "batch": args.batch, "seq": args.seq, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
