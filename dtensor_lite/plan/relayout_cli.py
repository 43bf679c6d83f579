"""``python -m dtensor_lite.plan relayout``: size a whole-model relayout at scale on one CPU --
bytes per rank pair and per link kind, buckets, peak extra memory, a time estimate::

    python -m dtensor_lite.plan relayout --model llama3-70b --src dp_shard=256 \\
        --dst rep=32,tp=8 --dtype bf16                      # FSDP-256 -> 32 TP-8 replicas
    python -m dtensor_lite.plan relayout --model llama3-8b --src dp_shard=64 \\
        --dst tp=8 --dst-first-rank 64 --dtype bf16         # 64 FSDP ranks -> 8 other ranks

Meshes: ``--src`` over ranks ``0 ..``, ``--dst`` over ranks ``--dst-first-rank ..`` (default 0:
colocated). Dims: ``dp_shard`` (FSDP: Shard(0), nested outside TP's shards as fully_shard does),
``tp`` (the example Llama's TP plan: column-parallel weights Shard(0), row-parallel Shard(1),
embedding Shard(0), norms replicated), ``rep`` (replicas: each holds the whole layout). Only
metadata is built (a "fake" process group, no tensor data).
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from .cli import add_cost_args, cost_models, terminal_text
from .fake_world import fake_world
from .presets import llama_param_shapes, model_fields, preset_names

SUMMARY = "size a whole-model relayout at scale: bytes per rank pair and link kind, time"

_COLWISE = ("wq", "wk", "wv", "w1", "w3", "output", "qkv", "gate_up")
# --fused: the engine's fused tensors (vLLM / SGLang), per rank: [q_r; k_r; v_r], [gate_r; up_r]
_FUSED = {"qkv": ("wq", "wk", "wv"), "gate_up": ("w1", "w3")}
_ROWWISE = ("wo", "w2")


def _dims(text: str) -> dict:
    out = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if name not in ("dp_shard", "tp", "rep") or not size.isdigit() or int(size) < 1:
            raise SystemExit(f"mesh {text!r}: expected dims dp_shard=N, tp=N, rep=N")
        out[name] = int(size)
    return out


def _tp_dim(name: str):
    leaf = name.split(".")[-2] if "." in name else name
    if name.startswith("tok_embeddings"):
        return 0
    if leaf in _COLWISE:
        return 0
    if leaf in _ROWWISE:
        return 1
    return None  # norms: replicated


def _fused_shapes(shapes: dict) -> tuple[dict, dict]:
    """The destination's shapes with each layer's q, k, v and gate, up fused (rows added), and
    the ``fused=`` argument of plan_relayout that fills them per rank."""
    from dtensor_lite.relayout import Concat
    out, fused = {}, {}
    for name, shape in shapes.items():
        prefix, _, rest = name.rpartition(".")[0].rpartition(".")
        leaf = name.split(".")[-2] if "." in name else name
        group = next((g for g, parts in _FUSED.items() if leaf in parts), None)
        if group is None:
            out[name] = shape
            continue
        fused_name = f"{prefix}.{group}.weight"
        parts = [f"{prefix}.{p}.weight" for p in _FUSED[group]]
        if fused_name not in out:
            out[fused_name] = (sum(shapes[p][0] for p in parts), *shape[1:])
            fused[fused_name] = Concat(parts, dim=0, per_rank=True)
    return out, fused


def _specs(shapes: dict, dims: dict, first_rank: int, dtype):
    """{name: DTensorSpec} of the example Llama laid out on a mesh of ``dims``."""
    from dtensor_lite import DeviceMesh, Replicate, Shard, _StridedShard
    from dtensor_lite.spec import DTensorSpec, TensorMeta, contiguous_stride
    names = [n for n in ("rep", "dp_shard", "tp") if n in dims]
    sizes = [dims[n] for n in names]
    ranks = torch.arange(first_rank, first_rank + math.prod(sizes)).reshape(sizes)
    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=tuple(names))
    out = {}
    for name, shape in shapes.items():
        tp_dim = _tp_dim(name)
        placements = []
        for n in names:
            if n == "tp" and tp_dim is not None:
                placements.append(Shard(tp_dim))
            elif n == "dp_shard":
                nested = "tp" in dims and tp_dim == 0
                placements.append(_StridedShard(0, split_factor=dims["tp"]) if nested
                                  else Shard(0))
            else:
                placements.append(Replicate())
        meta = TensorMeta(torch.Size(shape), contiguous_stride(shape), dtype)
        out[name] = DTensorSpec(mesh, placements, meta)
    return out


def build_parser() -> argparse.ArgumentParser:
    summary, examples, dims = (terminal_text(p) for p in __doc__.split("\n\n")[:3])
    ap = argparse.ArgumentParser(prog="python -m dtensor_lite.plan relayout",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description=f"{summary}\n\n{examples}\n\n{dims}")
    ap.add_argument("--model", required=True, metavar="NAME|FILE.json",
                    help=f"a preset ({', '.join(preset_names())}) or a JSON config file")
    ap.add_argument("--src", required=True,
                    help="source mesh dims dp_shard=N, tp=N, rep=N, e.g. dp_shard=256")
    ap.add_argument("--dst", required=True, help="destination mesh dims, e.g. rep=32,tp=8")
    ap.add_argument("--dst-first-rank", type=int, default=0,
                    help="the destination mesh's first rank (default 0: colocated)")
    ap.add_argument("--src-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="the source parameters' dtype (default %(default)s)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16", help="wire and "
                    "destination dtype (default %(default)s)")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="bucket per rank in MiB (default: the relayout's own rule)")
    ap.add_argument("--fused", action="store_true", help="the destination fuses q, k, v and "
                    "gate, up per rank, as vLLM / SGLang hold them")
    add_cost_args(ap)
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    shapes = llama_param_shapes(model_fields(args.model))
    src_dims, dst_dims = _dims(args.src), _dims(args.dst)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    world = max(math.prod(src_dims.values()), args.dst_first_rank + math.prod(dst_dims.values()))
    from dtensor_lite.relayout import plan_relayout
    link, _ = cost_models(args)
    with fake_world(world):
        src = _specs(shapes, src_dims, 0, dtypes[args.src_dtype])
        dst_shapes, fused = _fused_shapes(shapes) if args.fused else (shapes, {})
        dst = _specs(dst_shapes, dst_dims, args.dst_first_rank, dtypes[args.dtype])
        plan = plan_relayout(src, dst, dtype=dtypes[args.dtype], fused=fused,
                             bucket_bytes=None if args.bucket_mb is None
                             else int(args.bucket_mb * 2**20))
        links = plan.link_bytes(args.gpus_per_node)
        seconds = plan.estimate_seconds(link)
        if args.json:
            print(json.dumps({"world": world, "link_bytes": links,
                              "total_bytes": sum(plan.pair_bytes().values()), "estimate_seconds": seconds,
                              "buckets": len(plan.buckets),
                              "busiest_sender_bytes": max(plan.bytes_sent().values()),
                              "peak_extra_bytes": max(plan.peak_extra_bytes().values())},
                             indent=2))
            return
        print(f"relayout of {args.model} ({sum(math.prod(s) for s in shapes.values()) / 1e9:.2f}"
              f"B parameters): {args.src} ({args.src_dtype}) -> {args.dst} ({args.dtype}) from "
              f"rank {args.dst_first_rank}; world {world}")
        print(plan.report())
        print("bytes per link kind: " + ", ".join(f"{k} {v / 2**30:.2f} GiB"
                                                  for k, v in links.items()))
        print(f"time estimate (busiest rank, link model of plan/cost.py): {seconds:.3f} s")
