"""Ring attention: context parallelism, with no rank ever holding the whole sequence.

q, k and v are ``Shard(seq)`` over a context-parallel mesh dim (uneven lengths fine: 13 positions
over 4 ranks are 4, 4, 4, 1). Each rank keeps its query block; key/value blocks travel around the
ring with ``ring_shift``, the next block's transfer overlapping the current block's attention.
Block results are merged by their log-sum-exp (online softmax), so the result is exactly
softmax attention over the whole sequence. Causal: a key block after the query block is skipped
(it still travels), the diagonal block is masked by global positions, which
``compute_local_shape_and_global_offset`` gives from metadata for every rank's block.

The backward is a second ring, hand-written so that no received block is kept for it (autograd
through the forward ring would save every block: the whole sequence). It recomputes each block's
probabilities from the saved log-sum-exp; the key/value gradients travel with their blocks and
arrive home after a full turn. A rank holds at most its own k/v, the current and the incoming
block (and one gradient block in flight): a constant, whatever the sequence length.

Run it: ``torchrun --standalone --nproc-per-node 4 examples/strategies/ring_attention.py``
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dtensor_lite import (DTensor, Shard, compute_local_shape_and_global_offset, local_map,
                          ring_shift)


def ring_attention(q: DTensor, k: DTensor, v: DTensor, mesh_dim: int | str = 0,
                   causal: bool = True) -> DTensor:
    """Softmax attention of ``[..., seq, head_dim]`` DTensors sharded along ``seq`` over
    ``mesh_dim``; the result is laid out as ``q``."""
    mesh, seq = q.device_mesh, q.ndim - 2
    dim = mesh.mesh_dim_names.index(mesh_dim) if isinstance(mesh_dim, str) else mesh_dim
    if q.placements[dim] != Shard(seq) or not q.placements == k.placements == v.placements:
        raise ValueError(f"ring_attention needs q, k, v sharded along the sequence (Shard({seq})) "
                         f"on mesh dim {mesh_dim} and laid out alike; got {list(q.placements)}, "
                         f"{list(k.placements)}, {list(v.placements)}: redistribute them first")
    if q.shape[seq] != k.shape[seq]:
        raise ValueError(f"ring_attention: q has {q.shape[seq]} positions, k {k.shape[seq]}; "
                         "self-attention blocks must line up")
    coord = mesh.get_coordinate()
    blocks = [compute_local_shape_and_global_offset(k.shape, mesh, k.placements,
                                                    coord[:dim] + [c] + coord[dim + 1:])
              for c in range(mesh.size(dim))]
    starts = [offset[seq] for _, offset in blocks]  # where each rank's positions begin
    shapes = [shape for shape, _ in blocks]

    def attend(ql, kl, vl):
        return _RingAttention.apply(ql, kl, vl, mesh, dim, starts, shapes, causal)
    return local_map(attend, q.placements, (q.placements,) * 3, out_shape=q.shape)(q, k, v)


def _scores(q, k, q_start, k_start, causal):
    """Scaled scores of a query block against a key block, later positions masked (causal)."""
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        qi = torch.arange(q_start, q_start + q.shape[-2], device=q.device).unsqueeze(-1)
        ki = torch.arange(k_start, k_start + k.shape[-2], device=q.device)
        s = s.masked_fill(ki > qi, float("-inf"))
    return s


def _visible(q_start, q_len, k_start, k_len, causal):
    # with torch.chunk blocks every query row sees >= 1 key of a visible block (the diagonal
    # block its own position), so no row of a computed block is all -inf
    return q_len > 0 and k_len > 0 and (not causal or k_start < q_start + q_len)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mesh, dim, starts, shapes, causal):
        n, me = len(starts), mesh.get_local_rank(dim)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v])
        for step in range(n):
            src = (me - step) % n  # whose block this rank holds now
            incoming = ring_shift(kv, mesh, dim, recv_shape=(2, *shapes[(src - 1) % n]),
                                  async_op=True) if step < n - 1 else None
            if _visible(starts[me], q.shape[-2], starts[src], kv.shape[-2], causal):
                s = _scores(q, kv[0], starts[me], starts[src], causal)
                block_lse = s.logsumexp(-1)
                block_out = torch.softmax(s, -1) @ kv[1]
                merged = torch.logaddexp(lse, block_lse)
                out = out * (lse - merged).exp().unsqueeze(-1) + \
                    block_out * (block_lse - merged).exp().unsqueeze(-1)
                lse = merged
            if incoming is not None:
                kv = incoming.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = (mesh, dim, starts, shapes, causal)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mesh, dim, starts, shapes, causal = ctx.ring
        n, me = len(starts), mesh.get_local_rank(dim)
        delta = (dout * out).sum(-1, keepdim=True)  # rowwise sum of dP * P, the softmax backward
        dq = torch.zeros_like(q)
        kv, dkv_in_flight = torch.stack([k, v]), None
        for step in range(n):
            src = (me - step) % n
            incoming = ring_shift(kv, mesh, dim, recv_shape=(2, *shapes[(src - 1) % n]),
                                  async_op=True) if step < n - 1 else None
            # the gradient of block src so far (it travelled with the block); zero on its start
            dkv = dkv_in_flight.wait() if dkv_in_flight is not None else torch.zeros_like(kv)
            if _visible(starts[me], q.shape[-2], starts[src], kv.shape[-2], causal):
                p = (_scores(q, kv[0], starts[me], starts[src], causal) - lse.unsqueeze(-1)).exp()
                ds = p * (dout @ kv[1].transpose(-1, -2) - delta) * q.shape[-1] ** -0.5
                dq += ds @ kv[0]
                dkv = dkv + torch.stack([ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ dout])
            dkv_in_flight = ring_shift(dkv, mesh, dim, recv_shape=(2, *shapes[(src - 1) % n]),
                                       async_op=True)
            if incoming is not None:
                kv = incoming.wait()
        dkv = dkv_in_flight.wait()  # after a full turn: this rank's own block's gradient
        return dq, dkv[0], dkv[1], None, None, None, None, None


def main() -> None:
    from dtensor_lite import distribute_tensor, init_device_mesh
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 13, 16, requires_grad=True) for _ in range(3))
    qd, kd, vd = (distribute_tensor(t.detach(), mesh, [Shard(2)]).requires_grad_()
                  for t in (q, k, v))
    out = ring_attention(qd, kd, vd, "cp")
    out.sum().backward()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref.sum().backward()
    err = max((a.full_tensor() - b).abs().max().item()
              for a, b in ((out, ref), (qd.grad, q.grad), (kd.grad, k.grad), (vd.grad, v.grad)))
    if dist.get_rank() == 0:
        print(f"ring attention over {mesh.size()} ranks, 13 positions: max |error| {err:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
