"""A small Llama-style language model in plain PyTorch (no parallelism inside; its Llama 3 shapes
come from dtensor_lite/plan/presets.py, which the plan CLIs read).

Token embedding, RMSNorm, rotary position embedding, causal attention through
``F.scaled_dot_product_attention``, a SwiGLU MLP and a cross-entropy loss: the op mix of a real
decoder, small enough to train on CPU processes. Parallelism is applied from outside (by
placements on its parameters and inputs), never written into the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtensor_lite.plan.presets import LLAMA3


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention: k/v heads (None: n_heads)
    ffn_dim: int = 128
    max_seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def reset_parameters(self):
        nn.init.ones_(self.weight)


def rotary_tables(cfg: LlamaConfig):
    """cos/sin of shape [max_seq_len, 1, head_dim]: broadcast over [batch, seq, heads, head_dim]."""
    head_dim = cfg.dim // cfg.n_heads
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(cfg.max_seq_len).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def apply_rotary(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def repeat_kv(x, n_rep: int):
    """[batch, seq, kv_heads, head_dim] -> [batch, seq, kv_heads * n_rep, head_dim]: query head
    h reads k/v head h // n_rep (so a TP rank's block of query heads finds its k/v heads in its
    own block of k/v heads)."""
    if n_rep == 1:
        return x
    bsz, seq, kv_heads, head_dim = x.shape
    return x.unsqueeze(3).expand(bsz, seq, kv_heads, n_rep, head_dim).reshape(
        bsz, seq, kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        if cfg.n_heads % n_kv_heads:
            raise ValueError(f"n_heads={cfg.n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        self.n_rep = cfg.n_heads // n_kv_heads  # query heads per k/v head
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        bsz, seq, _ = x.shape
        # -1 for the head count: under tensor parallelism each rank holds a slice of the heads
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens):
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


# Llama 3 shapes (Meta's published configs: params.json of the 8B, 70B and 405B models)
# the Llama 3 shapes (dtensor_lite/plan/presets.py holds them for the plan CLIs)
LLAMA3_CONFIGS = {name: LlamaConfig(**fields) for name, fields in LLAMA3.items()}


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
