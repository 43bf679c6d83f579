"""``python -m dtensor_lite.plan``: dry-run the Llama of ``examples/`` (or a Llama 3 shape) on a
mesh of any size, from a checkout of this repository (the model and its parallelisation are the
example's own: ``examples/train_llama.py``)::

    python -m dtensor_lite.plan --model llama3-70b --mesh dp_replicate=8,dp_shard=16,tp=8 \\
        --batch 128 --seq 8192 --ac full

``--model``: ``llama3-8b``, ``llama3-70b``, ``llama3-405b``, ``example`` (train_llama's small
model) or a JSON file with ``LlamaConfig`` fields (or Hugging Face names: ``hidden_size``,
``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``,
``vocab_size``, ``rope_theta``, ``rms_norm_eps``).

``python -m dtensor_lite.plan relayout ...`` sizes a whole-model relayout instead (see
``relayout_cli.py``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .cli import add_cost_args, cost_models, print_report
from .dry_run import dry_run

_REPO = Path(__file__).resolve().parents[2]
_HF_NAMES = {"hidden_size": "dim", "num_hidden_layers": "n_layers",
             "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
             "intermediate_size": "ffn_dim", "rms_norm_eps": "norm_eps",
             "max_position_embeddings": "max_seq_len"}


def _examples():
    if not (_REPO / "examples" / "train_llama.py").exists():
        raise SystemExit("python -m dtensor_lite.plan builds the Llama of examples/: run it from "
                         "a checkout of the dtensor_lite repository")
    if str(_REPO) not in sys.path:
        sys.path.insert(0, str(_REPO))
    from examples import llama, train_llama
    return llama, train_llama


def model_config(spec: str):
    """``LlamaConfig`` for a preset name or a JSON file."""
    llama, train_llama = _examples()
    if spec == "example":
        return train_llama.TrainConfig().model
    if spec in llama.LLAMA3_CONFIGS:
        return llama.LLAMA3_CONFIGS[spec]
    path = Path(spec)
    if not path.is_file():
        raise SystemExit(f"--model {spec!r}: not one of example, "
                         f"{', '.join(llama.LLAMA3_CONFIGS)} and not a JSON file")
    raw = json.loads(path.read_text())
    fields = {f.name for f in dataclasses.fields(llama.LlamaConfig)}
    values = {}
    for key, value in raw.items():
        key = _HF_NAMES.get(key, key)
        if key in fields:
            values[key] = value
    unknown = sorted(k for k in raw if _HF_NAMES.get(k, k) not in fields)
    try:
        cfg = llama.LlamaConfig(**values)
    except TypeError as e:
        raise SystemExit(f"--model {spec}: {e}")
    if unknown:
        print(f"--model {spec}: ignoring {', '.join(unknown)}", file=sys.stderr)
    return cfg


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dtensor_lite.plan",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True,
                    help="llama3-8b | llama3-70b | llama3-405b | example | path/to/config.json")
    ap.add_argument("--mesh", required=True,
                    help="mesh dims and sizes, outermost first: dp_replicate, dp_shard, tp "
                         "(e.g. dp_replicate=8,dp_shard=16,tp=8)")
    ap.add_argument("--batch", type=int, required=True,
                    help="global batch in sequences (divides by the data-parallel size)")
    ap.add_argument("--seq", type=int, required=True, help="sequence length in tokens")
    ap.add_argument("--ac", choices=("none", "full", "selective"), default="none",
                    help="activation checkpointing per block")
    ap.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: FSDP mixed precision (bf16 gather and compute, fp32 reduce, fp32 "
                         "sharded parameters and AdamW state), as torchtitan trains")
    ap.add_argument("--no-sp", dest="sequence_parallel", action="store_false")
    ap.add_argument("--no-loss-parallel", dest="loss_parallel", action="store_false")
    add_cost_args(ap)
    return ap.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["relayout"]:  # sizing a whole-model relayout (relayout_cli.py)
        from .relayout_cli import main as relayout_main
        return relayout_main(argv[1:])
    args = parse_args(argv)
    _, train_llama = _examples()
    model = model_config(args.model)
    if args.seq > model.max_seq_len:
        model = dataclasses.replace(model, max_seq_len=args.seq)
    sizes = train_llama.parse_mesh(args.mesh, None)
    cfg = train_llama.TrainConfig(mesh=args.mesh, batch=args.batch, seq=args.seq, ac=args.ac,
                                  sequence_parallel=args.sequence_parallel,
                                  loss_parallel=args.loss_parallel,
                                  param_dtype=args.param_dtype, model=model)
    link, compute = cost_models(args)
    report = dry_run(train_llama.dry_run_setup(cfg), sizes, rank=args.rank, link_model=link,
                     compute_model=compute)
    print_report(report, args.json, title=f"dry run: {args.model}, batch {args.batch} x seq "
                                          f"{args.seq}, activation checkpointing {args.ac}, "
                                          f"parameters {args.param_dtype}")


if __name__ == "__main__":
    main()
