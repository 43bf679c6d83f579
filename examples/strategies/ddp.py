"""Data parallelism (DDP) written with placements only.

Parameters are ``Replicate()`` over a 1-D data-parallel mesh and the batch is ``Shard(0)``. A
loss reduced over the batch is then ``Partial("sum")`` and so is every parameter gradient that
backward produces: each rank holds its batch rows' share of the global gradient. Turning those
gradients ``Replicate()`` is one all-reduce, batched here into buckets so that a model with many
small parameters pays a few collectives, not one per parameter. Nothing divides by the world
size: the loss is already the global mean, so the summed gradient is exactly plain torch's.

Gradient accumulation needs no code at all: inside ``no_sync()`` gradients stay ``Partial`` and
add up locally (Partial + Partial is Partial, no communication); the last micro-batch outside it
reduces the accumulated sum once.

Run it: ``torchrun --standalone --nproc-per-node 4 examples/strategies/ddp.py``
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from dtensor_lite import DTensor, DeviceMesh, Partial, Replicate, distribute_tensor


class DataParallel(torch.nn.Module):
    """Wrap ``module``: replicate its parameters on ``mesh`` and all-reduce gradients in buckets
    of about ``bucket_mb`` MiB once backward has produced every gradient of the bucket."""

    def __init__(self, module: torch.nn.Module, mesh: DeviceMesh, bucket_mb: float = 25.0):
        super().__init__()
        if mesh.ndim != 1:
            raise ValueError(f"DataParallel takes a 1-D data-parallel mesh, got {mesh.ndim}-D "
                             f"{mesh}; slice the dp dim out of a larger mesh with mesh['dp']")
        self.module, self.mesh, self._sync = module, mesh, True
        for sub in module.modules():
            for name, p in list(sub.named_parameters(recurse=False)):
                sub.register_parameter(name, torch.nn.Parameter(
                    distribute_tensor(p.detach(), mesh, [Replicate()]), p.requires_grad))
        self.buckets = _buckets([p for p in module.parameters() if p.requires_grad],
                                int(bucket_mb * 2**20))
        for bucket in self.buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(lambda p, b=bucket: self._ready(b))
        self._pending: dict[int, int] = {}

    def forward(self, *args, **kwargs):
        self._pending = {id(b): len(b) for b in self.buckets}
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside keep their gradients Partial and local (accumulation)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _ready(self, bucket: list[torch.nn.Parameter]) -> None:
        left = self._pending[id(bucket)] = self._pending.get(id(bucket), len(bucket)) - 1
        if left == 0 and self._sync:
            _all_reduce_bucket(bucket, self.mesh)


def _buckets(params, bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Group parameters in reverse registration order (roughly the order backward produces
    their gradients) into buckets of one dtype and at most ``bucket_bytes`` each."""
    buckets, size = [[]], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        current = buckets[-1]
        if current and (size + nbytes > bucket_bytes or current[0].dtype != p.dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return [b for b in buckets if b]


def _all_reduce_bucket(bucket: list[torch.nn.Parameter], mesh: DeviceMesh) -> None:
    """One all-reduce for the whole bucket: its Partial gradients concatenated into one flat
    Partial DTensor, redistributed to Replicate, and split back into the gradients."""
    for p in bucket:
        if p.grad.placements != (Partial(),):
            raise RuntimeError(
                f"DataParallel expects Partial('sum') gradients, got {p.grad.placements} for a "
                f"parameter of shape {tuple(p.shape)}: shard the batch (Shard(0)) and call "
                f"zero_grad() after each optimizer step")
    flat = torch.cat([p.grad.to_local().reshape(-1) for p in bucket])
    summed = DTensor.from_local(flat, mesh, [Partial()]).redistribute(mesh, [Replicate()])
    pieces = summed.to_local().split([p.numel() for p in bucket])
    for p, piece in zip(bucket, pieces):
        p.grad = DTensor.from_local(piece.view(p.shape), mesh, [Replicate()])


def main() -> None:
    from dtensor_lite import Shard, init_device_mesh
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = DataParallel(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                             torch.nn.Linear(64, 16)), mesh, bucket_mb=0.002)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(5):
        for micro in range(2):  # two micro-batches, one gradient all-reduce per bucket
            x = distribute_tensor(torch.randn(30, 16), mesh, [Shard(0)])
            ctx = model.no_sync() if micro == 0 else contextlib.nullcontext()
            with ctx:
                loss = (model(x) - x).pow(2).mean() / 2
                loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.full_tensor().item()  # a collective: every rank calls it
        if dist.get_rank() == 0:
            print(f"step {step}: loss {value:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
