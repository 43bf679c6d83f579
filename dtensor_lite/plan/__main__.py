"""``python -m dtensor_lite.plan``: dry-run a Llama (a Llama 3 shape, the example's model or a JSON
config) on a mesh of any size, with the model and parallelisation of the code ``--setup`` names.

For this repository's example the setup is ``examples.train_llama:plan_setup`` (run from a
checkout, so that ``examples`` is importable)::

    python -m dtensor_lite.plan --setup examples.train_llama:plan_setup --model llama3-70b \\
        --mesh dp_replicate=8,dp_shard=16,tp=8 --batch 128 --seq 8192 --ac full
    python -m dtensor_lite.plan --setup examples.train_llama:plan_setup --model llama3-405b \\
        --mesh pp=16,dp_shard=16,tp=8 --pp-schedule 1f1b --microbatches 32 --batch 512 --seq 8192

``--model``: a name of ``presets.py`` (``example``, ``llama3-8b``, ``llama3-70b``, ``llama3-405b``)
or a JSON file with Llama fields or Hugging Face names (``hidden_size``, ``num_hidden_layers``,
...). ``--setup MODULE:FUNCTION``: ``FUNCTION(model_fields, **options)`` returns the dry run's
``setup(mesh)`` (``options``: mesh, batch, seq, ac, param_dtype, sequence_parallel,
loss_parallel, pp_schedule, microbatches); the library itself imports no model code.

Subcommands (``SUBCOMMANDS``): ``python -m dtensor_lite.plan relayout ...`` sizes a whole-model
relayout instead (see ``relayout_cli.py``).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .cli import add_cost_args, cost_models, print_report, terminal_text
from .dry_run import dry_run
from .presets import model_fields, preset_names
from .relayout_cli import SUMMARY as RELAYOUT_SUMMARY
from .relayout_cli import build_parser as relayout_parser
from .relayout_cli import main as relayout_main

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
PROG = "python -m dtensor_lite.plan"
# name -> (its parser, its main, one line for the help); the first argument picks one
SUBCOMMANDS = {"relayout": (relayout_parser, relayout_main, RELAYOUT_SUMMARY)}


def parse_mesh(text: str) -> dict[str, int]:
    """``"pp=16,dp_shard=16,tp=8"`` -> ``{"pp": 16, "dp_shard": 16, "tp": 8}`` (canonical order)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in MESH_DIMS or not value.isdigit() or int(value) < 1 or name in sizes:
            raise SystemExit(f"--mesh: bad entry {part!r}; use NAME=SIZE once each, NAME one of "
                             f"{', '.join(MESH_DIMS)}")
        sizes[name] = int(value)
    if not sizes:
        raise SystemExit("--mesh: give the mesh to plan for, e.g. --mesh dp_shard=8,tp=8")
    return {n: sizes[n] for n in MESH_DIMS if n in sizes}


def load_setup(spec: str | None):
    """The function ``MODULE:FUNCTION`` names (imported as any module on ``sys.path``)."""
    if not spec or ":" not in spec:
        raise SystemExit("--setup MODULE:FUNCTION is required: the code that builds and "
                         "parallelises the model, e.g. --setup examples.train_llama:plan_setup "
                         "from a checkout of this repository")
    module, _, name = spec.partition(":")
    if "" not in sys.path:   # `python -m` puts the working directory first; keep it so
        sys.path.insert(0, "")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"--setup {spec}: {e}")


def build_parser() -> argparse.ArgumentParser:
    """The dry run's parser (a subcommand's is ``SUBCOMMANDS[name][0]()``)."""
    summary, _, examples = __doc__.split("\n\n")[:3]
    subcommands = "\n".join(f"  {PROG} {name} --help\n      {line}"
                            for name, (_, _, line) in SUBCOMMANDS.items())
    ap = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"{terminal_text(summary)}\n\n{terminal_text(examples)}",
        epilog=f"subcommands:\n{subcommands}")
    ap.add_argument("--setup", required=True, metavar="MODULE:FUNCTION",
                    help="the code that builds and parallelises the model, e.g. "
                         "examples.train_llama:plan_setup (from a checkout)")
    ap.add_argument("--model", required=True, metavar="NAME|FILE.json",
                    help=f"a preset ({', '.join(preset_names())}) or a JSON config file")
    ap.add_argument("--mesh", required=True,
                    help="mesh dims and sizes, outermost first: pp, dp_replicate, dp_shard, tp "
                         "(e.g. dp_replicate=8,dp_shard=16,tp=8 or pp=16,dp_shard=16,tp=8)")
    ap.add_argument("--batch", type=int, required=True,
                    help="global batch in sequences (divides by the data-parallel size)")
    ap.add_argument("--seq", type=int, required=True, help="sequence length in tokens")
    ap.add_argument("--ac", choices=("none", "full", "selective"), default="none",
                    help="activation checkpointing per block")
    ap.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: FSDP mixed precision (bf16 gather and compute, fp32 reduce, fp32 "
                         "sharded parameters and AdamW state), as torchtitan trains")
    ap.add_argument("--no-sp", dest="sequence_parallel", action="store_false",
                    help="tensor parallelism without sequence parallelism")
    ap.add_argument("--no-loss-parallel", dest="loss_parallel", action="store_false",
                    help="gather the logits instead of a vocab-parallel loss")
    ap.add_argument("--pp-schedule", default="1f1b",
                    help="with a pp dim, a schedule the setup knows; the example's: gpipe | "
                         "1f1b | interleaved | zero-bubble | zbv | looped-bfs "
                         "(default %(default)s)")
    ap.add_argument("--microbatches", type=int, default=8,
                    help="micro-batches per step with a pp dim (default %(default)s)")
    add_cost_args(ap)
    return ap


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]][1](argv[1:])
    args = parse_args(argv)
    factory = load_setup(args.setup)
    fields = model_fields(args.model)
    fields["max_seq_len"] = max(fields["max_seq_len"], args.seq)
    sizes = parse_mesh(args.mesh)
    setup = factory(fields, mesh=args.mesh, batch=args.batch, seq=args.seq, ac=args.ac,
                    param_dtype=args.param_dtype, sequence_parallel=args.sequence_parallel,
                    loss_parallel=args.loss_parallel, pp_schedule=args.pp_schedule,
                    microbatches=args.microbatches)
    link, compute = cost_models(args)
    report = dry_run(setup, sizes, rank=args.rank, link_model=link, compute_model=compute)
    pp = (f", pp schedule {args.pp_schedule} with {args.microbatches} micro-batches"
          if "pp" in sizes else "")
    print_report(report, args.json, title=f"dry run: {args.model}, batch {args.batch} x seq "
                                          f"{args.seq}, activation checkpointing {args.ac}, "
                                          f"parameters {args.param_dtype}{pp}")


if __name__ == "__main__":
    main()
