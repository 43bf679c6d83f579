"""ZeRO-1 and ZeRO-2 (fairscale's OSS / ShardedDDP) as an optimizer wrapper written with placements.

The model is data parallel as in ``ddp.py``: parameters ``Replicate()``, batch ``Shard(0)``, so
backward leaves ``Partial("sum")`` gradients and no communication has happened yet. The wrapper
keeps the optimizer's view of the parameters as **one flat ``Shard(0)`` DTensor** (uneven chunks
are fine), so the inner optimizer's state (AdamW's two moments) is sharded too and its step is
purely local. One step is then three redistributions of flat DTensors:

* gradients: ``Partial -> Shard(0)``, a reduce-scatter (ZeRO-2: no rank ever holds the summed
  full gradient), or ``Partial -> Replicate -> Shard(0)``, an all-reduce and a free local slice
  (ZeRO-1: every rank holds the full gradient, only optimizer state is sharded);
* the inner optimizer steps the flat ``Shard(0)`` parameter (pointwise, no communication);
* parameters: ``Shard(0) -> Replicate``, one all-gather, copied back into the replicated params.

Run it: ``torchrun --standalone --nproc-per-node 4 examples/strategies/zero.py``
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dtensor_lite import DTensor, DeviceMesh, Partial, Replicate, Shard


class ZeroOptimizer:
    """``ZeroOptimizer(model.parameters(), mesh, torch.optim.AdamW, stage=2, lr=...)``: steps
    ``optimizer_class`` on this rank's slice of all parameters (stage 1 or 2, see the module)."""

    def __init__(self, params, mesh: DeviceMesh, optimizer_class, stage: int = 2, **defaults):
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 or 2, got {stage} (stage 3 is fsdp.fully_shard)")
        self.params = [p for p in params if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"ZeroOptimizer flattens parameters into one buffer and needs one "
                             f"dtype; got {sorted(map(str, dtypes))}: make one optimizer per dtype")
        for p in self.params:
            if not isinstance(p, DTensor) or p.placements != (Replicate(),) * mesh.ndim:
                raise ValueError("ZeroOptimizer takes Replicate() DTensor parameters (data "
                                 "parallel, as in ddp.py); got "
                                 f"{getattr(p, 'placements', 'a plain tensor')}")
        self.mesh, self.stage = mesh, stage
        flat = DTensor.from_local(self._flat_local(lambda p: p.detach()), mesh, [Replicate()])
        # Replicate -> Shard(0) takes this rank's slice: no communication.
        self.shard = torch.nn.Parameter(flat.redistribute(mesh, [Shard(0)]))
        self.optimizer = optimizer_class([self.shard], **defaults)

    def _flat_local(self, get) -> torch.Tensor:
        return torch.cat([get(p).to_local().reshape(-1) for p in self.params])

    @torch.no_grad()
    def step(self) -> None:
        missing = [tuple(p.shape) for p in self.params if p.grad is None]
        if missing:
            raise RuntimeError(f"parameters of shapes {missing} have no gradient: every rank "
                               f"must run backward through every parameter before step()")
        grads = DTensor.from_local(self._flat_local(lambda p: p.grad), self.mesh, [Partial()])
        if self.stage == 2:
            self.shard.grad = grads.redistribute(self.mesh, [Shard(0)])  # reduce-scatter
        else:
            summed = grads.redistribute(self.mesh, [Replicate()])        # all-reduce
            self.shard.grad = summed.redistribute(self.mesh, [Shard(0)])  # local slice
        self.optimizer.step()
        full = self.shard.detach().redistribute(self.mesh, [Replicate()]).to_local()  # all-gather
        for p, piece in zip(self.params, full.split([p.numel() for p in self.params])):
            p.to_local().copy_(piece.view(p.shape))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state) -> None:
        self.optimizer.load_state_dict(state)


def main() -> None:
    from dtensor_lite import distribute_tensor, init_device_mesh
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    for sub in model.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            sub.register_parameter(name, torch.nn.Parameter(
                distribute_tensor(p.detach(), mesh, [Replicate()])))
    opt = ZeroOptimizer(model.parameters(), mesh, torch.optim.AdamW, stage=2, lr=1e-2)
    for step in range(5):
        x = distribute_tensor(torch.randn(30, 16), mesh, [Shard(0)])
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.full_tensor().item()  # a collective: every rank calls it
        if dist.get_rank() == 0:
            print(f"step {step}: loss {value:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
