"""Command-line pieces shared by ``python -m dtensor_lite.plan`` and ``train_llama --dry-run``:
the link / compute model options and printing a report (rich tables or JSON)."""
from __future__ import annotations

import argparse
import json
import sys

from .cost import INTER_NODE, INTRA_NODE, ComputeModel, Link, LinkModel

__all__ = ["add_cost_args", "cost_models", "print_report", "terminal_text"]


def terminal_text(rst: str) -> str:
    """A docstring paragraph as ``--help`` shows it: no ``literal`` quotes, and a single ``:``
    where reST introduces an example block with ``::``."""
    return rst.replace("``", "").replace("::", ":")


def add_cost_args(ap: argparse.ArgumentParser):
    g = ap.add_argument_group("link and compute models (defaults: H100 SXM nodes, see "
                              "dtensor_lite/plan/cost.py)")
    g.add_argument("--gpus-per-node", type=int, default=8,
                   help="ranks per node; a group inside one node uses the intra-node link")
    g.add_argument("--intra-gbps", type=float, default=INTRA_NODE.bandwidth / 1e9,
                   help="intra-node bandwidth, GB/s per rank and direction (%(default)s)")
    g.add_argument("--intra-latency-us", type=float, default=INTRA_NODE.latency * 1e6)
    g.add_argument("--inter-gbps", type=float, default=INTER_NODE.bandwidth / 1e9,
                   help="inter-node bandwidth, GB/s per rank and direction (%(default)s)")
    g.add_argument("--inter-latency-us", type=float, default=INTER_NODE.latency * 1e6)
    g.add_argument("--peak-tflops", type=float, default=989.0,
                   help="peak FLOP/s of one device, in TFLOP/s (%(default)s: H100 dense BF16)")
    g.add_argument("--efficiency", type=float, default=0.4,
                   help="share of the peak the step's compute achieves (%(default)s)")
    g.add_argument("--rank", type=int, default=0,
                   help="whose figures (default 0: the largest shards, the max over ranks)")
    g.add_argument("--json", action="store_true", help="print the report as JSON")


def cost_models(args) -> tuple[LinkModel, ComputeModel]:
    try:
        link = LinkModel(gpus_per_node=args.gpus_per_node,
                         intra=Link(args.intra_gbps * 1e9, args.intra_latency_us * 1e-6),
                         inter=Link(args.inter_gbps * 1e9, args.inter_latency_us * 1e-6))
        compute = ComputeModel(peak_flops=args.peak_tflops * 1e12, efficiency=args.efficiency)
    except ValueError as e:
        raise SystemExit(str(e))
    return link, compute


def print_report(report, as_json: bool, title: str = ""):
    if as_json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        print()
        return
    from rich.console import Console
    console = Console()
    if title:
        console.print(f"[bold]{title}[/]")
    for table in report.tables():
        console.print(table)
    for note in report.notes:
        console.print(note)
