"""FFTs: every ``torch.fft`` function reaches the dispatcher as ``_fft_r2c``, ``_fft_c2r`` or
``_fft_c2c`` over a list of dims (with pads, slices and conjugations around it, which have rules
of their own).

A transform mixes only the dims it is taken over; every other dim indexes independent
transforms. So a shard of an untouched dim stays where it is (no communication), while a shard of
a transformed dim has to leave that dim: gathered, or moved to an untouched dim when the
dispatcher finds the all-to-all cheaper. Every transform is linear over the reals, so a
``Partial`` sum (or average) passes through untransformed.

MKL's FFT refuses an empty input, which an uneven shard of an untouched dim gives a rank: that
rank returns its empty result without calling it (the others may be on their way to a
collective). A global input that is empty still reaches the kernel, so every rank raises the
error plain torch raises.
"""
from __future__ import annotations

import torch

from .. import _torch_names as torch_names
from ..placements import LINEAR_REDUCE_OPS, Replicate, Shard
from ._registry import register_rule
from .kit import arg, choose, empty_piece_safe

aten = torch_names.aten
R = Replicate()


@register_rule(aten._fft_r2c.default, aten._fft_c2r.default, aten._fft_c2c.default)
def _fft(call):
    x = call.inputs[0]
    mixed = {d % x.ndim for d in arg(call, "dim")} if x.ndim else set()
    strategies = [((R,), (R,))]
    strategies += [((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d not in mixed]
    local = empty_piece_safe(call.op) if x.shape.numel() else None
    full = choose(call, strategies, local_fn=local)
    # A Partial input passes through, but only where it already is Partial: offered as a
    # strategy, it would also win for a shard of a transformed dim (Shard -> Partial moves
    # nothing), and every rank would transform a whole zero-padded tensor
    partial = [i for i, p in enumerate(x.placements)
               if p.is_partial() and p.reduce_op in LINEAR_REDUCE_OPS]
    if partial:
        ins, outs = list(full.ins[0]), list(full.outs[0])
        for i in partial:
            ins[i] = outs[i] = x.placements[i]
        full.ins, full.outs = [tuple(ins)], [tuple(outs)]
        full.in_orders = full.out_orders = None  # (orders named the mesh dims replaced here)
    return full
