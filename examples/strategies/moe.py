"""Expert parallelism: a mixture-of-experts layer whose experts are ``Shard(0)`` over the mesh.

Tokens are ``Shard(0)`` over the same mesh dim (data parallel); the router is ``Replicate()``
and runs as ordinary DTensor ops, so every rank routes its own tokens to their top-k experts.
Each (token, expert) pair is then sent to the rank that owns the expert and the expert's output
comes back, both with the uneven ``all_to_all_single``: as many rows as were routed, no capacity
and no padding, no token dropped. Which rank owns which experts is metadata
(``compute_local_shape_and_global_offset`` on the expert weights; uneven counts, even a rank
with none, are fine). One small all-to-all of per-expert counts first tells each rank how many
rows it will receive for each of its experts.

Per forward: 3 all-to-alls (counts, dispatch, combine); backward: 2 (the reverse of dispatch
and combine, autograd's). Bytes: the routed rows that change rank, x hidden x itemsize.

Run it: ``torchrun --standalone --nproc-per-node 4 examples/strategies/moe.py``
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtensor_lite import (DeviceMesh, Replicate, Shard, all_to_all_single,
                          compute_local_shape_and_global_offset, distribute_tensor, local_map)


class ExpertParallelMoE(torch.nn.Module):
    """``num_experts`` two-layer GELU experts (``w1: [E, hidden, ffn]``, ``w2: [E, ffn, hidden]``)
    sharded over ``mesh_dim``; a linear router picks ``top_k`` experts per token and weighs
    their outputs by the softmax of the chosen logits."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, mesh: DeviceMesh,
                 top_k: int = 2, mesh_dim: int = 0):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.mesh, self.dim, self.top_k = mesh, mesh_dim, top_k
        placements = [Replicate()] * mesh.ndim
        experts = list(placements)
        experts[mesh_dim] = Shard(0)

        def param(t, where):
            return torch.nn.Parameter(distribute_tensor(t, mesh, where))
        self.router = param(torch.randn(num_experts, hidden) / hidden ** 0.5, placements)
        self.w1 = param(torch.randn(num_experts, hidden, ffn) / hidden ** 0.5, experts)
        self.w2 = param(torch.randn(num_experts, ffn, hidden) / ffn ** 0.5, experts)
        coord = mesh.get_coordinate()
        # experts per rank along mesh_dim, in coordinate order (torch.chunk layout)
        self.experts_per_rank = [compute_local_shape_and_global_offset(
            self.w1.shape, mesh, experts, coord[:mesh_dim] + [c] + coord[mesh_dim + 1:])[0][0]
            for c in range(mesh.size(mesh_dim))]

    def forward(self, x):
        """``x``: ``[tokens, hidden]`` sharded ``Shard(0)`` on ``mesh_dim``; same layout out."""
        logits = F.linear(x, self.router)                   # DTensor ops: each rank its tokens
        top_logits, chosen = logits.topk(self.top_k, dim=-1)
        gates = torch.softmax(top_logits, dim=-1)
        p = x.placements
        run = local_map(self._local, p, (p, p, p, self.w1.placements, self.w2.placements),
                        out_shape=x.shape)  # each rank's tokens come back: x's global shape
        return run(x, gates, chosen, self.w1, self.w2)

    def _local(self, x, gates, chosen, w1, w2):
        """On this rank's tokens and experts: dispatch, run the experts, combine."""
        mesh, dim, n = self.mesh, self.dim, self.mesh.size(self.dim)
        mine = w1.shape[0]  # how many experts this rank holds
        num_experts = sum(self.experts_per_rank)
        flat = chosen.reshape(-1)                  # the expert of each (token, k) pair
        order = flat.argsort(stable=True)          # by expert = by owner rank (Shard(0) order)
        per_expert = torch.bincount(flat, minlength=num_experts)
        # how many rows each rank sends me, per expert of mine: [n, mine]
        incoming = all_to_all_single(per_expert, mesh, dim, [mine] * n, self.experts_per_rank)
        incoming = incoming.view(n, mine)
        send = [int(c.sum()) for c in per_expert.split(self.experts_per_rank)]
        recv = incoming.sum(1).tolist()
        rows = all_to_all_single(x[order // self.top_k], mesh, dim, recv, send)  # dispatch
        # rows arrive grouped by source, then expert: regroup by expert for one matmul each
        expert_of_row = torch.arange(mine, device=x.device).repeat(n).repeat_interleave(
            incoming.reshape(-1))
        by_expert = expert_of_row.argsort(stable=True)
        grouped = rows[by_expert].split(incoming.sum(0).tolist())
        if mine:
            out = torch.cat([F.gelu(r @ w1[e]) @ w2[e] for e, r in enumerate(grouped)])
        else:  # no experts here (6 over 4 ranks: 2, 2, 2, 0), so no rows: an empty product
            out = rows @ w1.sum(0) @ w2.sum(0)  # keeps w1, w2 in backward, as on every rank
        out = out[by_expert.argsort()]                       # back to arrival order
        back = all_to_all_single(out, mesh, dim, send, recv)   # combine: home again
        pairs = back[order.argsort()].view(-1, self.top_k, x.shape[-1])
        return (pairs * gates.unsqueeze(-1)).sum(1)


def reference_moe(x, router, w1, w2, top_k):
    """The same layer in one process, expert by expert (the oracle)."""
    top_logits, chosen = (x @ router.T).topk(top_k, dim=-1)
    gates = torch.softmax(top_logits, dim=-1)
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = (chosen == e).nonzero(as_tuple=True)
        y = F.gelu(x[token] @ w1[e]) @ w2[e]
        out = out.index_add(0, token, y * gates[token, slot].unsqueeze(-1))
    return out


def main() -> None:
    from dtensor_lite import init_device_mesh
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    moe = ExpertParallelMoE(hidden=16, ffn=32, num_experts=8, mesh=mesh, top_k=2)
    x = torch.randn(30, 16)
    out = moe(distribute_tensor(x, mesh, [Shard(0)]))
    ref = reference_moe(x, *(p.full_tensor() for p in (moe.router, moe.w1, moe.w2)), 2)
    err = (out.full_tensor() - ref).abs().max().item()
    if dist.get_rank() == 0:
        print(f"MoE: 8 experts over {mesh.size()} ranks, 30 tokens, max |error| {err:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
