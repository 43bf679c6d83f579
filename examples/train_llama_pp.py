"""The pipeline-parallel branch of ``train_llama.py`` (``--mesh pp=2,...``).

``pp`` is the outermost mesh dim: each pp rank holds some stages of the model
(``examples/llama_pipeline.py``), and TP / FSDP apply inside each stage on the stage's sub-mesh of
the other dims (``mesh["tp"]``, ``mesh["dp_shard"]``), exactly as without pp. A schedule of
``dtensor_lite.pipelining`` runs ``--microbatches`` micro-batches through the stages per step:

* ``gpipe``, ``1f1b``: one stage per pp rank;
* ``interleaved`` (interleaved 1F1B), ``zero-bubble`` (interleaved, backward split into input
  and weight halves), ``looped-bfs``, ``zbv`` (zero bubble on a V: pp rank r holds stages r and
  2 pp - 1 - r): two stages per pp rank.

The rank's stages are held by one module, :class:`LocalStages`, under the whole model's parameter
names; so the optimizer, ``get_state_dict`` and DCP checkpoints see the model as usual and a
checkpoint saved with pp=2 resumes with pp=1 and back. Each step reports this rank's measured
idle fraction (the bubble) beside the schedule's analytical one.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from dtensor_lite import DTensor
from dtensor_lite.pipelining import PipelineScheduleSingle, PipelineStage, get_schedule_class
from examples.llama import Llama, loss_fn
from examples.llama_parallel import apply_activation_checkpointing
from examples.llama_pipeline import stage_modules, stage_tp_plan
from fsdp import MixedPrecisionPolicy, fully_shard
from tp import loss_parallel, parallelize_module

__all__ = ["PP_SCHEDULES", "LocalStages", "build_pipelined", "reshard_kwargs"]

# --pp-schedule: (torch's schedule name, stages per pp rank)
PP_SCHEDULES = {"gpipe": ("GPipe", 1), "1f1b": ("1F1B", 1),
                "interleaved": ("Interleaved1F1B", 2), "zero-bubble": ("InterleavedZeroBubble", 2),
                "looped-bfs": ("LoopedBFS", 2), "zbv": ("ZBVZeroBubble", 2)}


class LocalStages(nn.Module):
    """This rank's stage modules under the full model's names (``layers.3...``,
    ``tok_embeddings`` on the rank of stage 0, ``norm`` / ``output`` on the last stage's)."""

    def __init__(self, stages: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict()
        for stage in stages:
            for part in ("tok_embeddings", "norm", "output"):
                if getattr(stage, part) is not None:
                    setattr(self, part, getattr(stage, part))
            self.layers.update(stage.layers)


def reshard_kwargs(cfg) -> dict:
    """``fully_shard``'s ``reshard_after_forward`` for the blocks, when the config sets it."""
    return {} if cfg.reshard_after_forward is None else {
        "reshard_after_forward": cfg.reshard_after_forward}


def build_pipelined(cfg, mesh, sizes: dict[str, int], dp_names: tuple[str, ...]):
    """``(model, opt, step_fn, schedule)``: ``model`` a :class:`LocalStages`; ``step_fn(inputs,
    targets)`` runs one pipelined AdamW step on this rank's data-parallel rows and returns
    ``pp x`` this rank's loss on the last stage, 0 elsewhere (so the world's average is the loss)."""
    if cfg.pp_schedule not in PP_SCHEDULES:
        raise SystemExit(f"--pp-schedule {cfg.pp_schedule!r}: use one of {', '.join(PP_SCHEDULES)}")
    name, per_rank = PP_SCHEDULES[cfg.pp_schedule]
    pp = sizes["pp"]
    num_stages = pp * per_rank
    if cfg.model.n_layers < num_stages:
        raise SystemExit(f"--pp-schedule {cfg.pp_schedule} on pp={pp} makes {num_stages} stages "
                         f"but the model has {cfg.model.n_layers} layers; pass --layers "
                         f"{num_stages} (or more)")
    torch.manual_seed(cfg.seed)
    model = Llama(cfg.model)
    if mesh.device_type == "cuda":
        model = model.cuda()
    rank = mesh["pp"].get_local_rank()
    cls = get_schedule_class(name)
    ids = cls.stages_of(rank, pp, per_rank)
    dry = mesh.device_type == "meta"   # the dry run (dtensor_lite.plan): see input_args below
    built = list(range(num_stages if dry else 0))
    mods = stage_modules(model, num_stages, ids + [s for s in built if s not in ids])
    lp = "tp" in sizes and cfg.loss_parallel
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.param_dtype == "bf16" else MixedPrecisionPolicy()
    for mod in mods:
        if "tp" in sizes:
            parallelize_module(mod, mesh["tp"], stage_tp_plan(
                mod, sequence_parallel=cfg.sequence_parallel, loss_parallel=lp))
        apply_activation_checkpointing(mod, cfg.ac)
        if dp_names:
            for layer in mod.layers.values():
                fully_shard(layer, mesh=mesh[dp_names], mp_policy=mp,
                            **reshard_kwargs(cfg))
                if cfg.compile:   # as train_llama.build: in place, after fully_shard
                    layer.compile(backend=cfg.compile, dynamic=False)
            fully_shard(mod, mesh=mesh[dp_names], mp_policy=mp)
    device = torch.device(mesh.device_type)
    inputs = {}
    if dry:
        # no neighbour sends shapes in a dry run: every stage's input for one micro-batch is
        # the previous stages' output, found by running them (on meta) once
        order = {s: mod for s, mod in zip(ids + [s for s in built if s not in ids], mods)}
        rows = cfg.batch // math.prod(sizes[n] for n in dp_names) // cfg.microbatches
        h = torch.zeros(rows, cfg.seq, dtype=torch.long, device=device)
        with torch.no_grad():
            for s in range(max(ids)):
                h = order[s](h)
                # as the previous stage sends it: its output, which needs a gradient
                inputs[s + 1] = h.detach().requires_grad_(h.is_floating_point())
        mods = mods[:len(ids)]
    stages = [PipelineStage(mod, s, num_stages, device, group=mesh["pp"],
                            input_args=inputs.get(s))
              for s, mod in zip(ids, mods)]

    def stage_loss(logits, targets):
        if lp:
            with loss_parallel():
                return loss_fn(logits, targets)
        return loss_fn(logits, targets)

    if cfg.ac == "selective" and cls._split_backward:
        raise SystemExit(f"--ac selective with --pp-schedule {cfg.pp_schedule}: the zero-bubble "
                         "schedules run each backward in two passes, which selective "
                         "checkpointing refuses; use --ac full (or a 1F1B schedule)")
    single = issubclass(cls, PipelineScheduleSingle)
    schedule = cls(stages[0] if single else stages, cfg.microbatches, loss_fn=stage_loss)
    holder = LocalStages(mods)
    opt = torch.optim.AdamW(holder.parameters(), lr=cfg.lr)

    def step_fn(inputs, targets) -> torch.Tensor:
        losses: list = []
        schedule.step(inputs, target=targets, losses=losses)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not losses:
            return torch.zeros((), device=device)
        local = [x.to_local() if isinstance(x, DTensor) else x for x in losses]
        return torch.stack(local).mean().detach() * pp
    return holder, opt, step_fn, schedule


def bubble_row(schedule, idle_per_step: list[float]) -> dict:
    """This rank's measured idle fraction (median over steps after the first) and the
    schedule's analytical one."""
    later = sorted(idle_per_step[1:] or idle_per_step)
    rank = schedule._rank
    return {"pp_rank": rank, "measured": later[len(later) // 2],
            "analytical": schedule.analytical_bubble()["idle"][rank]}
