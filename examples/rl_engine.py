"""A vLLM-style tensor-parallel inference engine for the example Llama, in the engine's own
layout: plain local tensors per TP rank, attention's q, k, v fused as ``[q_r; k_r; v_r]``
(vLLM's ``QKVParallelLinear``, GQA's unequal sizes) and the MLP's gate and up as ``[gate_r;
up_r]`` (``MergedColumnParallelLinear``), the output projections split by columns and summed by
an all-reduce. ``weights()`` wraps the buffers as DTensors (same storage) so
``plan_relayout(..., fused=engine.fused())`` fills them in place from a trainer's model.

    >>> engine = EngineLlama(cfg, tp_mesh, torch.bfloat16)
    >>> plan = plan_relayout(trainer_model, engine.weights(), dtype=torch.bfloat16,
    ...                      fused=engine.fused())
    >>> plan.run(trainer_model, engine.weights()); tokens = engine.generate(prompt, 8)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtensor_lite import DTensor, Replicate, Shard  # noqa: E402
from dtensor_lite import collectives as C  # noqa: E402
from dtensor_lite.relayout import Concat  # noqa: E402
from dtensor_lite.spec import DTensorSpec, TensorMeta, contiguous_stride  # noqa: E402
from examples.llama import LlamaConfig, apply_rotary, repeat_kv, rotary_tables  # noqa: E402

ROW, COL, WHOLE = [Shard(0)], [Shard(1)], [Replicate()]


class EngineLlama:
    """The engine: ``local[name]`` are this TP rank's buffers, ``layout[name]`` (global shape,
    placements) says what they are pieces of."""

    def __init__(self, cfg: LlamaConfig, mesh, dtype: torch.dtype):
        tp = mesh.size()
        kv_heads = cfg.n_kv_heads or cfg.n_heads
        if cfg.n_heads % tp or kv_heads % tp or cfg.ffn_dim % tp:
            raise ValueError(f"EngineLlama: heads ({cfg.n_heads}, kv {kv_heads}) and ffn_dim "
                             f"({cfg.ffn_dim}) must divide by the TP size {tp}")
        self.cfg, self.mesh, self.dtype = cfg, mesh, dtype
        self.head_dim = cfg.dim // cfg.n_heads
        self.q_rows = cfg.n_heads // tp * self.head_dim
        self.kv_rows = kv_heads // tp * self.head_dim
        self.ffn_rows = cfg.ffn_dim // tp
        self.n_rep = cfg.n_heads // kv_heads
        d, qkv = cfg.dim, (cfg.n_heads + 2 * kv_heads) * self.head_dim
        self.layout = {"tok_embeddings.weight": ((cfg.vocab_size, d), WHOLE),
                       "norm.weight": ((d,), WHOLE), "output.weight": ((cfg.vocab_size, d), WHOLE)}
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            self.layout.update({
                p + "attention_norm.weight": ((d,), WHOLE),
                p + "attention.qkv.weight": ((qkv, d), ROW),
                p + "attention.wo.weight": ((d, d), COL),
                p + "ffn_norm.weight": ((d,), WHOLE),
                p + "feed_forward.gate_up.weight": ((2 * cfg.ffn_dim, d), ROW),
                p + "feed_forward.w2.weight": ((d, cfg.ffn_dim), COL)})
        self.local = {n: torch.zeros(self._spec(n).local_shape(), dtype=dtype)
                      for n in self.layout}
        self.cos, self.sin = (t.to(dtype) for t in rotary_tables(cfg))

    def _spec(self, name: str) -> DTensorSpec:
        shape, placements = self.layout[name]
        meta = TensorMeta(torch.Size(shape), contiguous_stride(shape), self.dtype)
        return DTensorSpec(self.mesh, placements, meta)

    def weights(self) -> dict:
        """{name: DTensor} over the engine's own buffers (no copy: a relayout into them writes
        the engine's memory)."""
        return {n: DTensor(self.local[n], self._spec(n)) for n in self.layout}

    def fused(self) -> dict:
        """The engine's fused tensors as ``plan_relayout``'s ``fused=``, named after the example
        Llama's separate weights."""
        out = {}
        for i in range(self.cfg.n_layers):
            a, f = f"layers.{i}.attention.", f"layers.{i}.feed_forward."
            out[a + "qkv.weight"] = Concat([a + "wq.weight", a + "wk.weight", a + "wv.weight"],
                                           dim=0, per_rank=True)
            out[f + "gate_up.weight"] = Concat([f + "w1.weight", f + "w3.weight"], dim=0,
                                               per_rank=True)
        return out

    @torch.no_grad()
    def load_weight(self, name: str, whole: torch.Tensor) -> None:
        """Write this TP rank's part of the example Llama's weight ``name``, given whole, into
        the engine's buffer (what vLLM's ``weight_loader`` does: q / k / v into their rows of
        ``qkv``, gate / up into theirs of ``gate_up``, a row- or column-sharded weight's own
        rows or columns, a replicated one whole). The hand-written syncs use it; a rank outside
        the engine does nothing."""
        coord = self.mesh.get_coordinate()
        if coord is None:
            return
        r = coord[0]
        fused = {"wq": ("attention.qkv", 0, self.q_rows), "wk": ("attention.qkv", self.q_rows,
                                                               self.kv_rows),
                 "wv": ("attention.qkv", self.q_rows + self.kv_rows, self.kv_rows),
                 "w1": ("feed_forward.gate_up", 0, self.ffn_rows),
                 "w3": ("feed_forward.gate_up", self.ffn_rows, self.ffn_rows)}
        where = fused.get(name.split(".")[-2]) if name.startswith("layers.") else None
        if where is not None:  # layers.<i>.<attention|feed_forward>.<w>.weight
            prefix = name.rsplit(".", 3)[0]
            target, start, rows = where
            self.local[f"{prefix}.{target}.weight"][start:start + rows].copy_(
                whole[r * rows:(r + 1) * rows])
            return
        piece = self.local[name]
        placement = self.layout[name][1]
        if placement == COL:
            cols = piece.shape[1]
            piece.copy_(whole[:, r * cols:(r + 1) * cols])
        elif placement == ROW:
            rows = piece.shape[0]
            piece.copy_(whole[r * rows:(r + 1) * rows])
        else:
            piece.copy_(whole)

    # ------------------------------------------------------------------ inference
    def _norm(self, x, name):  # the example Llama's RMSNorm, op for op
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps) * \
            self.local[name]

    def _summed(self, partial):
        """The row-parallel output: every TP rank's partial product, summed."""
        return C.all_reduce(partial, self.mesh, 0, "sum")

    @torch.no_grad()
    def forward(self, tokens):
        bsz, seq = tokens.shape
        cos, sin = self.cos[:seq], self.sin[:seq]
        h = F.embedding(tokens, self.local["tok_embeddings.weight"])
        for i in range(self.cfg.n_layers):
            p = f"layers.{i}."
            x = self._norm(h, p + "attention_norm.weight")
            q, k, v = (x @ self.local[p + "attention.qkv.weight"].T).split(
                [self.q_rows, self.kv_rows, self.kv_rows], dim=-1)
            q, k, v = (t.reshape(bsz, seq, -1, self.head_dim) for t in (q, k, v))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=True)
            out = out.transpose(1, 2).reshape(bsz, seq, -1)
            h = h + self._summed(out @ self.local[p + "attention.wo.weight"].T)
            x = self._norm(h, p + "ffn_norm.weight")
            gate, up = (x @ self.local[p + "feed_forward.gate_up.weight"].T).split(
                [self.ffn_rows, self.ffn_rows], dim=-1)
            h = h + self._summed((F.silu(gate) * up) @ self.local[p + "feed_forward.w2.weight"].T)
        return self._norm(h, "norm.weight") @ self.local["output.weight"].T

    @torch.no_grad()
    def generate(self, prompt, n: int):
        tokens = prompt.clone()
        for _ in range(n):
            logits = self.forward(tokens)
            tokens = torch.cat([tokens, logits[:, -1].float().argmax(-1, keepdim=True)], dim=1)
        return tokens[:, prompt.shape[1]:]
