"""Model shapes the plan CLIs know by name: the Llama 3 family, or a JSON config file.

A preset is a plain dict of Llama hyper-parameters (the fields of ``examples/llama.py``'s
``LlamaConfig``: ``vocab_size``, ``dim``, ``n_layers``, ``n_heads``, ``n_kv_heads``, ``ffn_dim``,
``max_seq_len``, ``norm_eps``, ``rope_theta``); a JSON file may use those names or Hugging Face's
(``hidden_size``, ``num_hidden_layers``, ...). The dry run builds the model from such a dict with
the code its ``--setup`` names; the relayout CLI needs only :func:`llama_param_shapes`.

Example::

    >>> fields = model_fields("llama3-405b")
    >>> fields["n_layers"], sum(math.prod(s) for s in llama_param_shapes(fields).values())
    (126, 405853388800)
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

__all__ = ["EXAMPLE", "LLAMA3", "LLAMA_FIELDS", "model_fields", "preset_names",
           "llama_param_shapes", "n_params"]

LLAMA_FIELDS = {"vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": None,
                "ffn_dim": 128, "max_seq_len": 64, "norm_eps": 1e-5, "rope_theta": 10000.0}

# the main example's small model (examples/train_llama.py's default)
EXAMPLE = dict(vocab_size=256, dim=64, n_layers=2, n_heads=8, ffn_dim=160, max_seq_len=64)

LLAMA3 = {
    "llama3-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_dim=14336, max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       ffn_dim=28672, max_seq_len=8192, rope_theta=500000.0),
    "llama3-405b": dict(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                        ffn_dim=53248, max_seq_len=8192, rope_theta=500000.0),
}

_HF_NAMES = {"hidden_size": "dim", "num_hidden_layers": "n_layers",
             "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
             "intermediate_size": "ffn_dim", "rms_norm_eps": "norm_eps",
             "max_position_embeddings": "max_seq_len"}


def _known(presets: dict | None = None) -> dict:
    return {"example": EXAMPLE, **LLAMA3, **(presets or {})}


def preset_names() -> list[str]:
    """The names ``--model`` accepts besides a JSON file (what the CLIs' help lists)."""
    return list(_known())


def model_fields(spec: str, *, presets: dict | None = None) -> dict:
    """The Llama fields of a preset name (``example``, ``llama3-8b`` / ``70b`` / ``405b``, or a
    name of ``presets``) or of a JSON file; unknown JSON keys are ignored with a note on stderr."""
    known = _known(presets)
    if spec in known:
        return {**LLAMA_FIELDS, **known[spec]}
    path = Path(spec)
    if not path.is_file():
        raise SystemExit(f"--model {spec!r}: not one of {', '.join(known)} and not a JSON file")
    raw = json.loads(path.read_text())
    values = {_HF_NAMES.get(k, k): v for k, v in raw.items()
              if _HF_NAMES.get(k, k) in LLAMA_FIELDS}
    unknown = sorted(k for k in raw if _HF_NAMES.get(k, k) not in LLAMA_FIELDS)
    if unknown:
        print(f"--model {spec}: ignoring {', '.join(unknown)}", file=sys.stderr)
    return {**LLAMA_FIELDS, **values}


def llama_param_shapes(fields: dict) -> dict[str, tuple]:
    """``{parameter name: shape}`` of the Llama of ``fields`` (the names of examples/llama.py's
    ``Llama.named_parameters()``), without building it."""
    dim, heads = fields["dim"], fields["n_heads"]
    kv = (fields["n_kv_heads"] or heads) * (dim // heads)
    shapes = {"tok_embeddings.weight": (fields["vocab_size"], dim)}
    for i in range(fields["n_layers"]):
        p = f"layers.{i}."
        shapes.update({
            p + "attention_norm.weight": (dim,), p + "attention.wq.weight": (dim, dim),
            p + "attention.wk.weight": (kv, dim), p + "attention.wv.weight": (kv, dim),
            p + "attention.wo.weight": (dim, dim), p + "ffn_norm.weight": (dim,),
            p + "feed_forward.w1.weight": (fields["ffn_dim"], dim),
            p + "feed_forward.w2.weight": (dim, fields["ffn_dim"]),
            p + "feed_forward.w3.weight": (fields["ffn_dim"], dim)})
    shapes["norm.weight"] = (dim,)
    shapes["output.weight"] = (fields["vocab_size"], dim)
    return shapes


def n_params(fields: dict) -> int:
    return sum(math.prod(s) for s in llama_param_shapes(fields).values())
