"""Train a small Llama-style model with FSDP, TP, HSDP, pipeline stages or a mix (``--mesh``).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/train_llama.py \\
        --mesh dp_shard=2,tp=2
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 8 examples/train_llama.py \\
        --mesh dp_replicate=2,dp_shard=2,tp=2
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/train_llama.py \\
        --mesh tp=4 --no-sp
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/train_llama.py \\
        --mesh pp=2,dp_shard=2
    python examples/train_llama.py --mesh dp_replicate=8,dp_shard=16,tp=8 --dry-run

Mesh dims, outermost first (give any subset; their sizes multiply to the number of processes):

* ``pp``: pipeline stages, micro-batches passed between them (``--pp-schedule``,
  ``--microbatches``; ``examples/train_llama_pp.py``, docs/pipelining.md);
* ``dp_replicate``: HSDP's replica groups (parameters replicated, gradients all-reduced);
* ``dp_shard``: FSDP (parameters sharded, gathered per block, gradients reduce-scattered);
* ``tp``: tensor parallelism (Megatron-style plan of ``examples/llama_parallel.py``), with
  sequence parallelism and loss parallelism unless ``--no-sp`` / ``--no-loss-parallel``.

The data is the bytes of ``examples/data/corpus.txt`` (public-domain text shipped with the repo):
every step draws the same global batch of windows on every rank from the step number, each
data-parallel rank trains on its rows, and TP ranks of one data-parallel group share theirs. So a
run's losses do not depend on the mesh; ``reference_losses`` is the same training in one process.

``--ac full|selective`` checkpoints every block's activations; ``--compile [BACKEND]`` compiles
every block with ``torch.compile`` (inductor unless a backend is named). The summary at the end
shows, per rank, the step time, the communication the step waited for (exposed) against the time
collectives were in flight, and peak memory.

Checkpoints use ``torch.distributed.checkpoint`` on the sharded state dicts: ``--save DIR``
writes one at the end (aside, then renamed into place once every rank has written, so a killed
save leaves the previous checkpoint intact), ``--resume DIR`` continues from one, on any mesh.
Runs on CPU processes (gloo) by default, on GPUs (nccl) when CUDA is available.
``--dry-run`` trains nothing: in one plain process it builds the model on the meta device,
parallelises it on the whole ``--mesh`` (any size) over a fake process group and reports one
step's memory, communication and time per rank (``dtensor_lite.plan``, docs/scale.md).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dtensor_lite.checkpoint as dcp  # noqa: E402  (DCP, published only once complete)
from dtensor_lite import DTensor, Partial, Shard, init_device_mesh  # noqa: E402
from dtensor_lite.debug import ExposedCommMode, MemoryTracker  # noqa: E402
from dtensor_lite.plan import dry_run  # noqa: E402
from dtensor_lite.plan.cli import add_cost_args, cost_models, print_report  # noqa: E402
from dtensor_lite.plan.presets import EXAMPLE  # noqa: E402
from dtensor_lite.state_dict import get_state_dict, set_state_dict  # noqa: E402
from examples.llama import Llama, LlamaConfig, loss_fn  # noqa: E402
from examples.llama_parallel import (AC_MODES, apply_activation_checkpointing,  # noqa: E402
                                     parallelize_llama)
from examples.train_llama_pp import (PP_SCHEDULES, bubble_row, build_pipelined,  # noqa: E402
                                     reshard_kwargs)
from examples.train_llama_screens import (Display, after_warmup, bubble_table,  # noqa: E402
                                          gather_parameter_rows, parameter_rows)
from fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from tp import loss_parallel  # noqa: E402

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


@dataclasses.dataclass
class TrainConfig:
    mesh: str = "dp_shard=2,tp=2"
    steps: int = 150
    batch: int = 8              # global batch (rows); divides by the data-parallel size
    seq: int = 64
    lr: float = 3e-3
    seed: int = 0
    sequence_parallel: bool = True
    loss_parallel: bool = True
    save: str | None = None
    resume: str | None = None
    quiet: bool = False
    ac: str = "none"            # activation checkpointing per block: none | full | selective
    compile: str | None = None  # torch.compile each block with this backend (e.g. "inductor")
    losses: str | None = None   # write every step's mean loss here as JSON (rank 0)
    param_dtype: str = "fp32"   # FSDP mixed precision: "bf16" gathers and computes in bf16
    pp_schedule: str = "1f1b"   # with a pp mesh dim: gpipe | 1f1b | interleaved | zero-bubble
    microbatches: int = 4       # micro-batches per step with a pp mesh dim
    reshard_after_forward: bool | None = None   # fully_shard's, for the blocks (None: default)
    model: LlamaConfig = dataclasses.field(default_factory=lambda: LlamaConfig(**EXAMPLE))


# ============================================================================ mesh
def parse_mesh(text: str, world_size: int | None) -> dict[str, int]:
    """``"dp_shard=2,tp=2"`` -> ``{"dp_shard": 2, "tp": 2}`` in canonical order, checked
    (``world_size=None``: any size, as the dry run has no processes to match)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in MESH_DIMS or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--mesh: bad entry {part!r}; use NAME=SIZE with NAME one of "
                             f"{', '.join(MESH_DIMS)}, e.g. --mesh dp_shard=2,tp=2")
        if name in sizes:
            raise SystemExit(f"--mesh: {name} given twice in {text!r}")
        sizes[name] = int(value)
    if not sizes:
        if world_size is None:
            raise SystemExit("--mesh: give the mesh to plan for, e.g. --mesh dp_shard=8,tp=8")
        sizes = {"dp_shard": world_size}
    if "dp_replicate" in sizes and "dp_shard" not in sizes:
        raise SystemExit("--mesh: dp_replicate (HSDP) needs dp_shard too, e.g. "
                         "dp_replicate=2,dp_shard=2")
    if world_size is not None and math.prod(sizes.values()) != world_size:
        raise SystemExit(f"--mesh {text!r} holds {math.prod(sizes.values())} ranks but "
                         f"{world_size} processes are running; make the sizes multiply to "
                         f"{world_size} (torchrun --nproc-per-node N)")
    return {name: sizes[name] for name in MESH_DIMS if name in sizes}


def dp_names(sizes: dict[str, int]) -> tuple[str, ...]:
    return tuple(n for n in ("dp_replicate", "dp_shard") if n in sizes)


def dp_size(sizes: dict[str, int]) -> int:
    """How many data-parallel ranks (batch slices) there are: 1 for TP alone."""
    return math.prod(sizes[n] for n in dp_names(sizes))


def dp_rows(x: torch.Tensor, mesh, sizes: dict[str, int]) -> torch.Tensor:
    """This rank's rows of the global batch ``x`` (its data-parallel slice)."""
    rank = 0  # this rank's index among the data-parallel ranks (dp_replicate major)
    for name in dp_names(sizes):
        rank = rank * sizes[name] + mesh.get_local_rank(name)
    rows = x.shape[0] // dp_size(sizes)
    return x[rank * rows:(rank + 1) * rows]


# ============================================================================ data
def corpus_tokens() -> torch.Tensor:
    return torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long)


def global_batch(tokens: torch.Tensor, step: int, cfg: TrainConfig):
    """The same ``(inputs, targets)`` on every rank: windows drawn from the step number."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - cfg.seq - 1, (cfg.batch,), generator=g)
    windows = torch.stack([tokens[s:s + cfg.seq + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


# ============================================================================ model
def build(cfg: TrainConfig, mesh, sizes: dict[str, int]):
    """The model with TP then FSDP applied as the mesh says, and its AdamW optimizer."""
    torch.manual_seed(cfg.seed)
    model = Llama(cfg.model)
    if mesh.device_type == "cuda":
        model = model.cuda()
    if "tp" in sizes:
        parallelize_llama(model, mesh["tp"], sequence_parallel=cfg.sequence_parallel,
                          loss_parallel=cfg.loss_parallel)
    apply_activation_checkpointing(model, cfg.ac)
    dp_mesh = mesh[dp_names(sizes)] if dp_names(sizes) else None
    # bf16: torchtitan's policy (parameters gathered and used in bf16, gradients reduced in fp32,
    # fp32 sharded parameters and optimizer state)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.param_dtype == "bf16" else MixedPrecisionPolicy()
    for block in model.layers:
        if dp_mesh is not None:
            fully_shard(block, mesh=dp_mesh, mp_policy=mp, **reshard_kwargs(cfg))
        if cfg.compile:
            # in place (Module.compile): parameter names and checkpoints stay as they are; the
            # FSDP hooks run eagerly around the compiled forward (see fsdp/hooks.py)
            # static shapes: DTensor's sharding decisions are made per (op, shapes) at trace time
            block.compile(backend=cfg.compile, dynamic=False)
    if dp_mesh is not None:
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    return model, opt


def uses_loss_parallel(cfg: TrainConfig, sizes) -> bool:
    return "tp" in sizes and cfg.loss_parallel


def train_step(model, opt, inputs, targets, loss_parallel_on: bool) -> torch.Tensor:
    """One AdamW step; returns this rank's loss (a plain 0-d tensor, detached)."""
    logits = model(inputs)
    if loss_parallel_on:
        # only the loss needs the context (a torch-function mode: every call inside it pays)
        with loss_parallel():
            loss = loss_fn(logits, targets)
        local = loss.to_local()
    else:
        loss = local = loss_fn(logits, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return local.detach()


# ============================================================================ checkpoints
def save_checkpoint(path: str, model, opt, step: int):
    """Write a DCP checkpoint of ``model`` / ``opt`` at ``step`` to ``path``: written aside and
    renamed into place once every rank is done, so a save killed part-way leaves the previous
    checkpoint at ``path`` untouched (see dtensor_lite/checkpoint.py)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)},
             checkpoint_id=path)


def load_checkpoint(path: str, model, opt) -> int:
    """Load ``path`` (written on any mesh) into ``model`` / ``opt``; returns the step to run.
    An incomplete or truncated checkpoint raises ``CheckpointError`` on every rank."""
    model_sd, optim_sd = get_state_dict(model, opt)   # templates with this mesh's layouts
    state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
    names = [list(g["params"]) for g in optim_sd["param_groups"]]
    dcp.load(state, checkpoint_id=path)
    # DCP restores a non-tensor entry as one rank saved it; with pp the ranks hold different
    # parameters, so each keeps its own names (the hyperparameters are the same everywhere)
    for group, mine in zip(state["optim"]["param_groups"], names):
        group["params"] = mine
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


# ============================================================================ training
def train(cfg: TrainConfig) -> list[float]:
    """Train as ``cfg`` says (torch.distributed must be initialised); returns the mean loss of
    every step run (the same on every rank)."""
    world = dist.get_world_size()
    sizes = parse_mesh(cfg.mesh, world)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    check_shapes(cfg, sizes)
    schedule = None
    if "pp" in sizes:  # pipeline parallel: this rank's stages (examples/train_llama_pp.py)
        model, opt, pp_step, schedule = build_pipelined(cfg, mesh, sizes, dp_names(sizes))
    else:
        model, opt = build(cfg, mesh, sizes)
    start = load_checkpoint(cfg.resume, model, opt) if cfg.resume else 0
    show = None
    if not cfg.quiet:
        pp_rank = mesh.get_local_rank("pp") if schedule is not None else None
        rows = parameter_rows(model, sizes, pp_rank)
        if schedule is not None:  # each pp rank holds its stages' parameters: gather them all
            rows = gather_parameter_rows(rows, mesh.get_group("pp"), model_order(cfg))
        if dist.get_rank() == 0:
            show = Display(cfg, mesh, sizes, rows, start)

    world_mesh = init_device_mesh(device_type, (world,))
    tokens = corpus_tokens()
    lp = uses_loss_parallel(cfg, sizes)
    losses, timings, pp_idle = [], [], []
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        inputs, targets = global_batch(tokens, step, cfg)
        inputs, targets = (dp_rows(x, mesh, sizes).to(device_type) for x in (inputs, targets))
        # the summary shows the last step's memory, per phase and category (rank 0)
        tracked = show is not None and step == cfg.steps - 1
        with ExposedCommMode() as comm, \
                MemoryTracker(model, opt) if tracked else contextlib.nullcontext() as memory:
            local = pp_step(inputs, targets) if schedule else train_step(model, opt, inputs,
                                                                           targets, lp)
        if schedule is not None:
            pp_idle.append(schedule.last_step_timing["idle"])
        timings.append((time.perf_counter() - t0, comm))
        if tracked:
            show.memory = memory
        # every rank's loss as the pieces of a Partial("avg") DTensor: full_tensor() averages
        mean = DTensor.from_local(local.reshape(1).float(), world_mesh,
                                  [Partial("avg")]).full_tensor()
        losses.append(float(mean))
        if show:
            show.step(step, losses[-1], timings[-1][0])
    if cfg.losses and dist.get_rank() == 0:
        Path(cfg.losses).write_text(json.dumps(losses))
    if cfg.save:
        save_checkpoint(cfg.save, model, opt, cfg.steps)
    per_rank = None
    if not cfg.quiet and timings:  # every rank's numbers, for rank 0's summary
        per_rank = gather_summaries(rank_summary(timings, device_type), world_mesh)
    if show:
        show.finish(losses, cfg.save, per_rank)
    if schedule is not None and not cfg.quiet and pp_idle:
        bubbles = [None] * world
        dist.all_gather_object(bubbles, bubble_row(schedule, pp_idle))
        if show:
            show.console.print(bubble_table(bubbles, cfg.pp_schedule, cfg.microbatches,
                                            device_type))
    return losses


def model_order(cfg: TrainConfig) -> list[str]:
    """The whole model's parameter names in its own order (built on the meta device: no memory)."""
    with torch.device("meta"):
        return [name for name, _ in Llama(cfg.model).named_parameters()]


def rank_summary(timings, device_type: str) -> dict:
    """This rank's median step time, exposed (waited-for) and in-flight communication per step,
    and peak memory (CUDA: allocated by tensors; CPU: the process's peak resident set)."""
    steady = after_warmup(timings)
    if device_type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"rank": dist.get_rank(),
            "step_s": statistics.median(t for t, _ in steady),
            "exposed_comm_s": statistics.median(c.exposed_s for _, c in steady),
            "comm_in_flight_s": statistics.median(c.total_s for _, c in steady),
            "peak_memory_bytes": peak}


def gather_summaries(summary: dict, world_mesh) -> list[dict]:
    """Every rank's ``rank_summary``: its numbers as one row each of a Shard(0) DTensor, gathered
    (through dtensor_lite like every collective of the job, so the program ends with nothing of
    it in flight; see docs/internals.md, "Exit")."""
    keys = list(summary)
    row = torch.tensor([[float(summary[k]) for k in keys]], dtype=torch.float64,
                       device=world_mesh.device_type)
    rows = DTensor.from_local(row, world_mesh, [Shard(0)]).full_tensor().tolist()
    return [{k: (int(v) if k in ("rank", "peak_memory_bytes") else v) for k, v in zip(keys, r)}
            for r in rows]


def check_shapes(cfg: TrainConfig, sizes: dict[str, int]):
    n_dp = dp_size(sizes)
    if cfg.batch % n_dp:
        raise SystemExit(f"--batch {cfg.batch} does not divide by the data-parallel size "
                         f"{n_dp}; every data-parallel rank trains on batch/{n_dp} rows")
    if "pp" in sizes and (cfg.batch // n_dp) % cfg.microbatches:
        raise SystemExit(f"--microbatches {cfg.microbatches} does not divide the "
                         f"{cfg.batch // n_dp} rows of each data-parallel rank (--batch "
                         f"{cfg.batch} over {n_dp}); equal micro-batches train like one process")


def dry_run_setup(cfg: TrainConfig):
    """``setup(mesh)`` for ``dtensor_lite.plan.dry_run``: this script's model, parallelisation
    and training step, unchanged, on the (meta) mesh it is given.

    Example::

        >>> from dtensor_lite.plan import dry_run
        >>> report = dry_run(dry_run_setup(cfg), {"dp_shard": 2, "tp": 2})
    """
    def setup(mesh):
        sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
        check_shapes(cfg, sizes)
        windows = torch.zeros(cfg.batch // dp_size(sizes), cfg.seq + 1, dtype=torch.long)
        if "pp" in sizes:   # the real schedule's step on the meta mesh (dtensor_lite.plan)
            model, opt, pp_step, schedule = build_pipelined(cfg, mesh, sizes, dp_names(sizes))
            return model, opt, lambda: pp_step(windows[:, :-1], windows[:, 1:]), schedule
        model, opt = build(cfg, mesh, sizes)
        # this rank's rows laid out as global_batch lays them out (inputs and targets are two
        # overlapping views of one window tensor: the loss copies the strided targets, and that
        # copy is memory too); token values never matter to the sizes
        inputs, targets = windows[:, :-1], windows[:, 1:]
        lp = uses_loss_parallel(cfg, sizes)
        return model, opt, lambda: train_step(model, opt, inputs, targets, lp)
    return setup


def plan_setup(model: dict, **options):
    """``python -m dtensor_lite.plan --setup examples.train_llama:plan_setup``: the dry run's
    ``setup(mesh)`` of this script for the Llama of ``model`` (``dtensor_lite.plan.presets``
    fields) and the CLI's ``options`` (TrainConfig fields: mesh, batch, seq, ac, ...)."""
    return dry_run_setup(TrainConfig(model=LlamaConfig(**model), quiet=True, **options))


def reference_losses(cfg: TrainConfig) -> list[float]:
    """The same training in one process on the whole batch: what every mesh must reproduce."""
    torch.manual_seed(cfg.seed)
    model = Llama(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    tokens = corpus_tokens()
    return [float(train_step(model, opt, *global_batch(tokens, step, cfg), False))
            for step in range(cfg.steps)]


# ============================================================================ command line
def parse_args(argv=None) -> TrainConfig:
    args = build_parser().parse_args(argv)
    if args.batch is None:
        # a dry run of a large mesh: one sequence per data-parallel rank unless told otherwise
        args.batch = dp_size(parse_mesh(args.mesh, None)) if args.dry_run else TrainConfig.batch
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                         if f.name != "model"})
    if cfg.seq > cfg.model.max_seq_len:
        cfg.model = dataclasses.replace(cfg.model, max_seq_len=cfg.seq)
    if args.layers is not None:  # e.g. 4 for two stages per rank on pp=2
        cfg.model = dataclasses.replace(cfg.model, n_layers=args.layers)
    return cfg


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))
    ap.add_argument("--mesh", default=d.mesh,
                    help=f"mesh dims and sizes, outermost first: {', '.join(MESH_DIMS)} (pp: "
                         "pipeline stages), e.g. dp_shard=4 | tp=2 | dp_shard=2,tp=2 | "
                         "dp_replicate=2,dp_shard=2,tp=2 | pp=2,dp_shard=2 (default %(default)s)")
    ap.add_argument("--steps", type=int, default=d.steps, help="total steps (default %(default)s)")
    ap.add_argument("--batch", type=int, default=None,
                    help=f"global batch in sequences (default {d.batch}; with --dry-run one per "
                         "data-parallel rank)")
    ap.add_argument("--seq", type=int, default=d.seq)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--no-sp", dest="sequence_parallel", action="store_false",
                    help="tensor parallelism without sequence parallelism")
    ap.add_argument("--no-loss-parallel", dest="loss_parallel", action="store_false",
                    help="gather the logits instead of a vocab-parallel loss")
    ap.add_argument("--save", metavar="DIR", help="write a checkpoint (DCP) at the end")
    ap.add_argument("--resume", metavar="DIR", help="continue from a checkpoint (any mesh)")
    ap.add_argument("--quiet", action="store_true", help="no tables or progress bar")
    ap.add_argument("--losses", metavar="FILE",
                    help="write every step's mean loss to FILE as a JSON list (rank 0)")
    ap.add_argument("--ac", choices=AC_MODES, default=d.ac,
                    help="activation checkpointing per block: recompute the whole block "
                         "(full) or all but its matmuls (selective) in backward")
    ap.add_argument("--compile", nargs="?", const="inductor", default=d.compile,
                    metavar="BACKEND", help="torch.compile each block (default backend "
                                            "inductor; aot_eager compiles much faster)")
    ap.add_argument("--param-dtype", choices=("fp32", "bf16"), default=d.param_dtype,
                    help="bf16: FSDP gathers parameters and computes in bf16, reduces gradients "
                         "in fp32 (needs a data-parallel dim; default %(default)s)")
    ap.add_argument("--pp-schedule", choices=tuple(PP_SCHEDULES), default=d.pp_schedule,
                    help="pipeline schedule with a pp mesh dim (default %(default)s)")
    ap.add_argument("--microbatches", type=int, default=d.microbatches,
                    help="micro-batches per step with a pp mesh dim (default %(default)s)")
    ap.add_argument("--reshard-after-forward", choices=(True, False), default=None,
                    type=lambda v: {"true": True, "false": False}.get(v.lower(), v),
                    help="fully_shard's reshard_after_forward for the blocks (default: "
                         "fully_shard's; under a pp schedule that keeps them gathered through "
                         "the step, docs/pipelining.md)")
    ap.add_argument("--layers", type=int, default=None,
                    help=f"transformer blocks (default {d.model.n_layers}; a pp schedule needs "
                         "one per stage at least)")
    ap.add_argument("--dry-run", action="store_true",
                    help="train nothing: print what one step on --mesh (any size, e.g. "
                         "dp_replicate=8,dp_shard=16,tp=8) holds, sends and costs per rank, "
                         "from one plain process (dtensor_lite.plan; docs/scale.md)")
    add_cost_args(ap)
    return ap


def dry_run_main(argv=None):
    """``--dry-run``: the report of ``python -m dtensor_lite.plan`` for this script's model."""
    cfg = parse_args(argv)
    args = build_parser().parse_args(argv)
    link, compute = cost_models(args)
    report = dry_run(dry_run_setup(cfg), parse_mesh(cfg.mesh, None), rank=args.rank,
                     link_model=link, compute_model=compute)
    print_report(report, args.json, title=f"dry run of train_llama.py: batch {cfg.batch} x seq "
                                          f"{cfg.seq}, activation checkpointing {cfg.ac}")


def main(argv=None):
    if build_parser().parse_args(argv).dry_run:
        return dry_run_main(argv)
    cfg = parse_args(argv)
    if "RANK" not in os.environ:  # plain `python train_llama.py`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(1)  # several processes share the cores
    dist.init_process_group(backend)
    try:
        train(cfg)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
