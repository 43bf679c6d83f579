"""rich tables of a :class:`~dtensor_lite.plan.dry_run.DryRunReport`."""
from __future__ import annotations

from .._tables import compact_table
from .._text import counted

__all__ = ["tables", "pipeline_tables", "human_bytes", "human_seconds"]


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"


def human_seconds(s: float) -> str:
    return f"{s * 1e3:,.2f} ms" if s < 10 else f"{s:,.1f} s"


def tables(report) -> list:
    from rich.table import Table
    mesh = " x ".join(f"{k}={v}" for k, v in report.mesh.items())
    memory = Table(title=f"memory of rank {report.rank} ({mesh}, {report.world_size:,} ranks)",
                   caption="unsharded_params and comm_buffers: peaks during the step; total: "
                           "every category at once (an upper bound of the peak)")
    memory.add_column("category", no_wrap=True)
    memory.add_column("bytes", justify="right", no_wrap=True)
    memory.add_column("", justify="right", no_wrap=True)
    for category, nbytes in report.bytes.items():
        memory.add_row(category, f"{nbytes:,}", human_bytes(nbytes))
    memory.add_row("total", f"{report.peak_bytes:,}", human_bytes(report.peak_bytes),
                   style="bold")

    comm = compact_table(title="communication per step (bytes sent by this rank)")
    for col in ("mesh dim", "group", "link", "collective", "count", "bytes", "est. time"):
        comm.add_column(col, no_wrap=True, justify="right" if col in (
            "group", "count", "bytes", "est. time") else "left")
    for row in report.comm:
        comm.add_row(row["mesh_dim"], str(row["group_size"]), row["link"], row["kind"],
                     str(row["count"]), human_bytes(row["bytes"]),
                     human_seconds(row["seconds"]))

    cm = report.compute_model
    time = Table(title="time per step (estimates: link and compute models)")
    time.add_column("what")
    time.add_column("time", justify="right", no_wrap=True)
    time.add_row(f"compute: {report.flops:.3e} FLOPs at {cm['peak_flops']:.3g} FLOP/s x "
                 f"{cm['efficiency']:.0%}", human_seconds(report.compute_s))
    for dim, s in report.comm_s_by_dim.items():
        time.add_row(f"communication over {dim}", human_seconds(s))
    time.add_row("communication hidden behind compute", human_seconds(report.hidden_s))
    time.add_row("communication exposed", human_seconds(report.exposed_s))
    time.add_row("step", human_seconds(report.step_s), style="bold")
    out = [memory, comm, time]
    if report.pipeline:
        out += pipeline_tables(report)
    return out


def pipeline_tables(report) -> list:
    """The pipeline entry: this rank's stages, messages and, per schedule, what is in flight."""
    from rich.table import Table
    pl = report.pipeline
    stages = Table(title=f"pipeline: {pl['schedule']}, pp={pl['pp']} x "
                         f"{counted(pl['stages_per_rank'], 'stage')} per rank, "
                         f"{counted(pl['n_microbatches'], 'micro-batch', 'micro-batches')}; pp "
                         f"rank {pl['pp_rank']} holds stages {pl['local_stages']}",
                   caption=f"peak of the step (micro-batches in flight, fsdp's gathered "
                           f"parameters, gradients, buffers): "
                           f"{human_bytes(report.peak_bytes_above_start)} above its start")
    for col in ("what", "bytes", ""):
        stages.add_column(col, justify="left" if col == "what" else "right",
                          no_wrap=col != "what")
    for s, n in pl["activations_per_microbatch"].items():
        stages.add_row(f"activations of one micro-batch, stage {s}", f"{n:,}", human_bytes(n))
    for kind, table in (("send", pl["send_bytes"]), ("receive", pl["recv_bytes"])):
        for what, n in table.items():
            stages.add_row(f"{kind} per micro-batch: {what}", f"{n:,}", human_bytes(n))
    counts = pl["comm_counts"]
    stages.add_row("messages per step (sends / receives)", f"{counts['send']} / "
                                                           f"{counts['recv']}", "")
    per = Table(title="per schedule (this rank's stages): activations in flight and bubble",
                caption="bubble: the schedule played in unit time (F = I = W = 1, B = 2, free "
                        "communication), idle fraction; GPipe and 1F1B: (p-1)/(m+p-1)")
    # values never wrap, so the headers are broken onto two lines here (rich would cut them)
    for col in ("schedule", "micro-batches\nin flight", "activations\nin flight",
                "idle,\nthis rank", "bubble\n(mean)"):
        per.add_column(col, justify="left" if col == "schedule" else "right", no_wrap=True)
    for row in pl["schedules"]:
        per.add_row(row["schedule"].removeprefix("Schedule"),
                    str(row["microbatches_in_flight"]),
                    human_bytes(row["activation_bytes_in_flight"]),
                    f"{100 * row['idle_this_rank']:.1f}%", f"{100 * row['bubble']:.1f}%",
                    style="bold" if row["schedule"] == pl["schedule"] else None)
    return [stages, per]
