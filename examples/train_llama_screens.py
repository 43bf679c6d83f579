"""What ``train_llama.py`` prints on rank 0: the mesh, the parameter layouts, a progress bar and
the summary tables (per rank, memory, pipeline bubble).

Every table fits an 80-column terminal (a pipe, CI) without cutting a header or breaking a value:
value columns never wrap, long headers wrap at their spaces, and short column names are explained
in the caption (``tests/test_narrow_tables.py`` renders each at 80 columns).
"""
from __future__ import annotations

import statistics
import time

import torch.distributed as dist

from dtensor_lite import DTensor
from dtensor_lite._tables import compact_table
from dtensor_lite._text import counted

__all__ = ["Display", "after_warmup", "median_step", "throughput", "parameter_rows",
           "gather_parameter_rows", "mesh_table", "parameter_table", "rank_table",
           "bubble_table"]

ROLES = {"pp": "pipeline stages, micro-batches passed between them",
         "dp_replicate": "replicate parameters, all-reduce gradients (HSDP)",
         "dp_shard": "shard parameters, all-gather / reduce-scatter (FSDP)",
         "tp": "split matmuls and activations (tensor parallel)"}
# a mesh dim's name as a column header where the full name would crowd an 80-column table
SHORT_DIMS = {"dp_replicate": "dp_rep"}


# ============================================================================ step times
def after_warmup(per_step: list) -> list:
    """The steps every reported median is taken over: all but the first, which pays for warm-up
    (process groups, caches, compilation) -- or the only one."""
    return per_step[1:] or per_step


def median_step(step_seconds: list[float]) -> float:
    """The median of ``after_warmup``'s step times (on rank 0: its "step ms")."""
    return statistics.median(after_warmup(step_seconds))


def throughput(step_seconds: list[float], tokens_per_step: int) -> float:
    """The run's tokens/s, the one figure the progress bar and the summary show: the global
    batch's tokens over ``median_step``."""
    return tokens_per_step / median_step(step_seconds)


# ============================================================================ parameters
def parameter_rows(model, sizes: dict[str, int], pp_rank: int | None = None) -> list[dict]:
    """This rank's parameters as table rows: name, global and local shape, one cell per mesh dim
    (``pp``: the pp rank holding it, given as ``pp_rank``)."""
    rows = []
    for name, p in model.named_parameters():
        cells = _placement_cells(p, sizes)
        if pp_rank is not None:
            cells["pp"] = str(pp_rank)
        local = p.to_local().shape if isinstance(p, DTensor) else p.shape
        rows.append({"name": name, "global": str(tuple(p.shape)), "cells": cells,
                     "local": str(tuple(local))})
    return rows


def gather_parameter_rows(rows: list[dict], pp_group, model_order: list[str]) -> list[dict]:
    """Every stage's rows, gathered over this rank's pp group (every rank calls it), in the
    model's order (``tok_embeddings`` first, the layers by number, then ``norm``, ``output``)."""
    every = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(every, rows, group=pp_group)
    position = {name: i for i, name in enumerate(model_order)}
    merged = [row for stage in every for row in stage]
    return sorted(merged, key=lambda row: position.get(row["name"], len(position)))


def _placement_cells(p, sizes) -> dict[str, str]:
    """One short cell per mesh dim: what ``p`` does along it ("-" where it is not there)."""
    cells = {name: "-" for name in sizes}
    if isinstance(p, DTensor):
        names = p.device_mesh.mesh_dim_names or tuple(sizes)
        for name, placement in zip(names, p.placements):
            if placement.is_shard():
                strided = type(placement).__name__ == "_StridedShard"
                cells[name] = f"S({placement.dim}){'*' if strided else ''}"
            else:
                cells[name] = "R" if placement.is_replicate() else repr(placement)
    return cells


# ============================================================================ tables
def mesh_table(device_type: str, n_ranks: int, sizes: dict[str, int]):
    from rich.table import Table
    table = Table(title=f"device mesh ({device_type}, {counted(n_ranks, 'rank')})")
    table.add_column("dim", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("role")
    for name, size in sizes.items():
        table.add_row(name, str(size), ROLES[name])
    return table


def parameter_table(rows: list[dict], sizes: dict[str, int]):
    """The parameters' layouts; with a pp dim, every stage's (``gather_parameter_rows``)."""
    legend = ["S(d): shard tensor dim d, R: replicate, -: not split along that dim",
              "S(d)*: splits each piece that the dims to its right cut first (PyTorch's "
              "_StridedShard)"]
    title = "parameters: global shape, placement per mesh dim, rank 0's piece"
    if "pp" in sizes:
        title = "parameters of every stage: global shape, placement per mesh dim, local piece"
        legend.insert(0, "pp: the pipeline rank whose stage holds the parameter (its piece: "
                         "that rank's, in rank 0's pipeline group)")
    legend += [f"{short}: the {name} dim" for name, short in SHORT_DIMS.items() if name in sizes]
    table = compact_table(title=title, caption="\n".join(legend))
    table.add_column("name", overflow="fold")
    table.add_column("global", no_wrap=True)
    for name in sizes:
        table.add_column(SHORT_DIMS.get(name, name), no_wrap=True)
    table.add_column("local", no_wrap=True)
    for row in rows:
        table.add_row(row["name"], row["global"], *(row["cells"][n] for n in sizes), row["local"])
    return table


def rank_table(per_rank: list[dict], device_type: str):
    from rich.table import Table
    hint = ("on CPU processes over gloo expect most of the step: the collectives run on the "
            "cores that compute and nothing overlaps them" if device_type == "cpu" else
            "with NCCL on GPUs it should be small: FSDP prefetches overlap compute")
    table = Table(title="per rank (medians over steps after the first)",
                  caption="exposed: time the step waited on collectives; in flight: issue to "
                          "completion, summed over collectives (dtensor_lite.debug."
                          f"ExposedCommMode).\nexposed % of step: {hint}", caption_justify="left")
    # values never wrap, so the headers are broken onto two lines here (rich would cut them)
    for col in ("rank", "step\nms", "exposed\ncomm ms", "exposed %\nof step", "comm in\nflight ms",
                "peak memory\nMiB"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in per_rank:
        table.add_row(str(r["rank"]), f"{1e3 * r['step_s']:.1f}",
                      f"{1e3 * r['exposed_comm_s']:.1f}",
                      f"{100 * r['exposed_comm_s'] / r['step_s']:.0f}%",
                      f"{1e3 * r['comm_in_flight_s']:.1f}",
                      f"{r['peak_memory_bytes'] / 2**20:,.0f}")
    return table


def bubble_table(rows: list[dict], schedule: str, microbatches: int, device_type: str):
    """Measured idle fraction per rank beside the schedule's (unit-cost) analytical one."""
    from rich.table import Table
    where = "gloo on CPU" if device_type == "cpu" else "the interconnect"
    batches = counted(microbatches, "micro-batch", "micro-batches")
    table = Table(title=f"pipeline bubble: {schedule}, {batches}",
                  caption="measured: 1 - (time in this rank's forward/backward) / step time "
                          "(median over steps after the first); it includes the waits for "
                          f"sends and receives ({where}), the optimizer step and host overhead.\n"
                          "analytical: the schedule played with F = 1, B = 2, equal stages and "
                          "free communication: the least idle the schedule allows. Measured "
                          "above analytical is the cost of communication and overhead.",
                  caption_justify="left")
    for col in ("rank", "pp rank", "measured idle", "analytical idle"):
        table.add_column(col, justify="right", no_wrap=True)
    for rank, r in enumerate(rows):
        table.add_row(str(rank), str(r["pp_rank"]), f"{100 * r['measured']:.0f}%",
                      f"{100 * r['analytical']:.0f}%")
    return table


# ============================================================================ the screen
class Display:
    """rich tables of the mesh and the parameter layouts, a progress bar, a summary (rank 0)."""

    def __init__(self, cfg, mesh, sizes, param_rows: list[dict], start):
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn)

        self.console = Console()
        self.device_type = mesh.device_type
        self.memory = None  # a MemoryTracker of the last step
        self.t0 = time.perf_counter()
        self.tokens_per_step = cfg.batch * cfg.seq
        self.first_step = start                 # 0-based: the first step this run trains
        self.step_seconds: list[float] = []     # rank 0's step times, as in its "step ms"
        self.console.print(mesh_table(mesh.device_type, mesh.mesh.numel(), sizes))
        self.console.print(parameter_table(param_rows, sizes))
        extras = []
        if "tp" in sizes:
            extras.append(f"sequence parallel {'on' if cfg.sequence_parallel else 'off'}, "
                          f"loss parallel {'on' if cfg.loss_parallel else 'off'}")
        if start:
            extras.append(f"resumed from {cfg.resume} at step {start}")
        if extras:
            self.console.print("; ".join(extras))
        self.progress = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("loss {task.fields[loss]:.4f}"),
                                 TextColumn("{task.fields[rate]:,.0f} tokens/s"),
                                 TimeElapsedColumn(), console=self.console)
        self.task = self.progress.add_task("train", total=cfg.steps, completed=start,
                                           loss=float("nan"), rate=0.0)
        self.progress.start()

    def step(self, step: int, loss: float, seconds: float):
        self.step_seconds.append(seconds)
        self.progress.update(self.task, completed=step + 1, loss=loss,
                             rate=throughput(self.step_seconds, self.tokens_per_step))

    def _steps_measured(self) -> str:
        """Which steps (numbered from 1) ``throughput`` takes its median over."""
        first, last = self.first_step + 1, self.first_step + len(self.step_seconds)
        if first == last:
            return f"step {first} only, warm-up included"
        return f"steps {first + 1}-{last}" if first + 1 < last else f"step {last}"

    def finish(self, losses: list[float], saved: str | None, per_rank: list[dict] | None = None):
        self.progress.stop()
        if not losses:
            self.console.print("nothing to do: the checkpoint is already at --steps")
            return
        if per_rank:
            self.console.print(rank_table(per_rank, self.device_type))
        rate = throughput(self.step_seconds, self.tokens_per_step)
        self.console.print(
            f"[bold green]done[/]: {counted(len(losses), 'step')} in "
            f"{time.perf_counter() - self.t0:.1f} s, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"{rate:,.0f} tokens/s" + (f", checkpoint saved to {saved}" if saved else ""))
        # the definition of the figure (the progress bar shows the same one)
        self.console.print(f"[dim]tokens/s = {self.tokens_per_step:,} tokens per step / "
                           f"{1e3 * median_step(self.step_seconds):.1f} ms, rank 0's median "
                           f"step ({self._steps_measured()})[/]")
        if self.memory is not None:
            self.console.print(self.memory.table(
                per_module=False, title=f"rank 0, last step: peak "
                f"{self.memory.peak_bytes / 2**20:.2f} MiB above its start (MiB)"))
