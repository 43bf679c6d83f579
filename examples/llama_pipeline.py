"""The Llama of ``examples/llama.py`` cut into pipeline stages (torchtitan's way: one copy of the
model per stage with the parts of other stages removed).

A stage keeps layers ``[a, b)`` under their original indices (``layers.3.attention.wq``), plus the
token embedding on the first stage and the final norm and output layer on the last; so parameter
names, state dicts and checkpoints of the stages together are the whole model's (a checkpoint
saved with pp=2 loads with pp=1 and back). Its forward takes token ids on the first stage and the
residual stream elsewhere, and returns the stream, or the logits on the last stage.

Example::

    >>> model = Llama(cfg)
    >>> stage = LlamaStage(model, layer_ids=[0, 1], first=True, last=False)
    >>> h = stage(tokens)                        # [batch, seq, dim]
"""
from __future__ import annotations

import torch.nn as nn

from examples.llama import Llama
from examples.llama_parallel import llama_tp_plan

__all__ = ["LlamaStage", "split_layers", "stage_modules", "stage_tp_plan"]


class LlamaStage(nn.Module):
    def __init__(self, model: Llama, layer_ids, first: bool, last: bool):
        super().__init__()
        self.cfg = model.cfg
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, h):
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        seq = h.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def split_layers(n_layers: int, num_stages: int, layers_per_stage=None) -> list[list[int]]:
    """Layer ids per stage: ``layers_per_stage`` (a list of counts, uneven allowed) or as even as
    possible, earlier stages taking the extra layers."""
    if layers_per_stage is None:
        base, extra = divmod(n_layers, num_stages)
        layers_per_stage = [base + (s < extra) for s in range(num_stages)]
    if len(layers_per_stage) != num_stages or sum(layers_per_stage) != n_layers \
            or min(layers_per_stage) < 0:
        raise ValueError(f"layers_per_stage={layers_per_stage} must give {num_stages} "
                         f"non-negative counts summing to the model's {n_layers} layers")
    ids, start = [], 0
    for count in layers_per_stage:
        ids.append(list(range(start, start + count)))
        start += count
    return ids


def stage_modules(model: Llama, num_stages: int, stage_ids, layers_per_stage=None):
    """The ``LlamaStage`` of each stage in ``stage_ids`` (a pp rank's stages) of ``model``."""
    ids = split_layers(model.cfg.n_layers, num_stages, layers_per_stage)
    return [LlamaStage(model, ids[s], s == 0, s == num_stages - 1) for s in stage_ids]


def stage_tp_plan(stage: LlamaStage, **kwargs) -> dict:
    """``llama_tp_plan`` restricted to what ``stage`` holds."""
    plan = llama_tp_plan(stage, **kwargs)
    present = {"tok_embeddings": stage.tok_embeddings is not None, "norm": stage.norm is not None,
               "output": stage.output is not None, "layers": len(stage.layers) > 0}
    return {k: v for k, v in plan.items() if present[k.split(".")[0]]}
