"""The dry run: one training step of a real model with its real parallelisation on a mesh of any
size, in one process, on meta tensors, measured by :class:`~dtensor_lite.plan.measure.StepMeter`.

``setup(mesh)`` is the user's own code: it builds the model (under ``torch.device("meta")``,
which the dry run sets), applies ``parallelize_module`` / ``fully_shard`` on ``mesh`` and returns
``(model, optimizer, step)`` where ``step()`` runs one training step. Nothing in it needs to know
it is a dry run: the mesh is a ``"meta"`` mesh over a fake process group of the full world size,
so every decision (shard sizes, FSDP groups, redistribute plans) is the one a real run makes,
while no tensor holds data and no collective moves any.

Memory is counted by storage, so a category holds the same bytes in a real run on any device.
The peak above the start is a CUDA run's: a CPU run lends each even shard to its gathered FSDP
group (``fsdp/param.py``, ``lend_shard``: the shard's own storage is freed while the group is
gathered), so its peak is lower by the shards of the groups gathered at that moment; the dry run
does not model that, the layouts it plans being for accelerators.

The figures are those of one rank (``rank``, default 0). Ranks differ only through uneven shards,
and ``torch.chunk``'s layout gives every mesh coordinate 0 the largest piece of each tensor dim,
so rank 0's bytes are the maximum over ranks; pass another ``rank`` to see its own.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..device_mesh import init_device_mesh
from .._torch_names import aten
from ..dtensor import DTensor
from ..memory_categories import CATEGORIES
from .cost import ComputeModel, LinkModel, comm_seconds, overlap
from .fake_world import fake_world
from .measure import StepMeter
from .pipeline import pipeline_section, watch_stages

__all__ = ["dry_run", "measure_step", "DryRunReport", "DATA_PARALLEL_DIMS"]

DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard", "dp")  # their comm can hide behind compute


@dataclass
class DryRunReport:
    """What one rank holds, sends and computes in one step, and the time estimates."""
    mesh: dict[str, int]
    rank: int
    bytes: dict[str, int]                  # memory category -> bytes (peaks for the gathered)
    comm: list[dict]                       # per (mesh dim, kind): count, bytes, seconds, link
    flops: int
    compute_s: float
    comm_s_by_dim: dict[str, float]
    hidden_s: float
    exposed_s: float
    step_s: float
    peak_bytes_above_start: int = 0        # most bytes created in the step alive at once
    pipeline: dict | None = None           # with a pipeline schedule: see plan/pipeline.py
    link_model: dict = field(default_factory=dict)
    compute_model: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def peak_bytes(self) -> int:
        """All categories at once: an upper bound of the step's peak (activations and gathered
        parameters, gradients and buffers rarely all peak together)."""
        return sum(self.bytes.values())

    def comm_bytes_by_dim(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for row in self.comm:
            out.setdefault(row["mesh_dim"], {})[row["kind"]] = row["bytes"]
        return out

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(world_size=self.world_size, peak_bytes=self.peak_bytes)
        return d

    def tables(self):
        """rich Tables: memory per rank, communication per mesh dim, time."""
        from .report import tables
        return tables(self)


@contextlib.contextmanager
def _fused_attention_on_meta():
    """``F.scaled_dot_product_attention`` on plain meta tensors picks torch's math fallback,
    which keeps the whole attention matrix for backward; real CPU and CUDA runs pick a fused
    kernel that keeps q, k, v, the output and a logsumexp. Route meta calls to the fused CPU
    kernel (the same saved tensors as CUDA's flash attention) so the dry run counts what a run
    keeps. The function itself is replaced for the dry run's duration, not a TorchFunctionMode:
    activation checkpointing recomputes on autograd's thread, where no such mode is active.
    """
    original = F.scaled_dot_product_attention

    @functools.wraps(original)
    def sdpa(*args, **kwargs):
        if _fusable(*args, **kwargs):
            q, k, v = args[:3]
            return aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
                attn_mask=kwargs.get("attn_mask"), scale=kwargs.get("scale"))[0]
        return original(*args, **kwargs)
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _fusable(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
    return (not enable_gqa and attn_mask is None and all(
        isinstance(t, torch.Tensor) and t.device.type == "meta" and not isinstance(t, DTensor)
        and t.dim() == 4 for t in (q, k, v)))


def measure_step(model, optimizer, step) -> StepMeter:
    """Run ``step()`` under a :class:`StepMeter` of ``model`` / ``optimizer``; returns the meter.
    The same call measures a real run (the agreement tests compare the two)."""
    with StepMeter(model, optimizer) as meter:
        step()
    return meter


def dry_run(setup, mesh: dict[str, int], *, rank: int = 0, link_model: LinkModel | None = None,
            compute_model: ComputeModel | None = None,
            overlapped_dims=DATA_PARALLEL_DIMS) -> DryRunReport:
    """One fake training step on ``mesh`` (``{dim name: size}``, outermost first); see the
    module docstring for ``setup``. A pipeline-parallel ``setup`` returns its schedule too,
    ``(model, optimizer, step, schedule)``: the report then has a ``pipeline`` entry
    (micro-batches in flight per schedule, bytes per send / receive, bubble; plan/pipeline.py).

    Example::

        >>> def setup(mesh):
        ...     model = MyModel()                       # on the meta device
        ...     fully_shard(model, mesh=mesh["dp"])
        ...     opt = torch.optim.AdamW(model.parameters())
        ...     x = torch.empty(8, 1024, device="meta")
        ...     return model, opt, lambda: (model(x).sum().backward(), opt.step())
        >>> report = dry_run(setup, {"dp": 1024})
        >>> report.bytes["optimizer_state"]
    """
    _check_mesh(mesh)
    link_model = link_model or LinkModel()
    compute_model = compute_model or ComputeModel()
    world = math.prod(mesh.values())
    with fake_world(world, rank):
        device_mesh = init_device_mesh("meta", tuple(mesh.values()),
                                       mesh_dim_names=tuple(mesh))
        with torch.device("meta"), _fused_attention_on_meta():
            model, optimizer, step, *schedule = setup(device_mesh)
            meter = StepMeter(model, optimizer)
            added = watch_stages(schedule[0], meter._mode) if schedule else None
            with meter:
                step()
    report = _report(meter, mesh, rank, link_model, compute_model, overlapped_dims)
    if schedule:
        report.pipeline = pipeline_section(schedule[0], added)
    return report


def _check_mesh(mesh):
    if not isinstance(mesh, dict) or not mesh or not all(
            isinstance(k, str) and isinstance(v, int) and v >= 1 for k, v in mesh.items()):
        raise ValueError(f"dry_run: mesh must be a non-empty {{dim name: size >= 1}} dict, got "
                         f"{mesh!r}")


def _report(meter: StepMeter, mesh, rank, link_model, compute_model,
            overlapped_dims) -> DryRunReport:
    rows: dict[tuple[str, str], dict] = {}
    for kind, nbytes, n, _, dim in meter.comm.calls:
        link, where = link_model.link(dim, meter.comm.mesh_dim_ranks[dim])
        row = rows.setdefault((dim, kind), {
            "mesh_dim": dim, "group_size": n, "link": where, "kind": kind, "count": 0,
            "bytes": 0, "seconds": 0.0})
        row["count"] += 1
        row["bytes"] += nbytes
        row["seconds"] += comm_seconds(kind, nbytes, n, link)
    comm = sorted(rows.values(), key=lambda r: (list(mesh).index(r["mesh_dim"])
                                                if r["mesh_dim"] in mesh else len(mesh),
                                                r["mesh_dim"], r["kind"]))
    by_dim: dict[str, float] = {}
    for row in comm:
        by_dim[row["mesh_dim"]] = by_dim.get(row["mesh_dim"], 0.0) + row["seconds"]
    compute_s = compute_model.seconds(meter.flops)
    times = overlap(compute_s, by_dim, set(overlapped_dims))
    notes = [f"figures of rank {rank}" + (" (the largest pieces: torch.chunk gives mesh "
                                          "coordinate 0 the biggest shard, so this is the "
                                          "maximum over ranks)" if rank == 0 else ""),
             "categories are those of a run on any device; the peak is a CUDA run's: on CPU, "
             "FSDP lends each even shard to its gathered group (fsdp/param.py lend_shard), so "
             "a CPU run's peak is lower by the shards of the groups gathered at it"]
    return DryRunReport(mesh=dict(mesh), rank=rank,
                        bytes={c: meter.bytes.get(c, 0) for c in CATEGORIES}, comm=comm,
                        flops=meter.flops, compute_s=compute_s, comm_s_by_dim=by_dim, **times,
                        peak_bytes_above_start=meter.peak_bytes,
                        link_model=link_model.as_dict(),
                        compute_model=dataclasses.asdict(compute_model), notes=notes)
