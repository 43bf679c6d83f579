"""Faults and bad inputs: nothing silently wrong, nothing hangs, no process aborts.

Each test provokes one fault (a NaN on one shard, a backward run twice or retried after an
exception, an optimizer holding replaced parameters, ranks' generators diverging) in real gloo
processes and checks the result against plain single-process torch, or a clear error on every rank.
"""
import torch

from dtensor_lite import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from tests.harness import distributed

R = Replicate()
NAN = float("nan")


# ------------------------------------------------------------------ NaN through max / min

def _nan_reductions(t):
    """Every NaN-propagating reduction (and NaN-aware relative) the Partial(max|min) path serves."""
    vals, idx = t.max(0)
    mins, _ = t.min(1)
    lo, hi = torch.aminmax(t, dim=0)
    inf_norm = torch.linalg.vector_norm(t, float("inf"), dim=0)
    return (t.max(), t.min(), t.amax(0), t.amin(1), vals, idx, mins, lo, hi, t.argmax(),
            t.argmin(0), inf_norm, torch.linalg.vector_norm(t, -float("inf")),
            torch.logsumexp(t, 0), torch.maximum(t.amax(0), t.amin(0)),
            # NaN-mapping ops on a Partial(max|min): torch's sign/nan_to_num/fmax turn NaN into numbers
            t.amax(0).sign(), torch.nan_to_num(t.amin(0)), torch.fmax(t.amax(0), t.amin(0) * 0),
            torch.nansum(t, 0), torch.nanmean(t))


@distributed(world_size=4, timeout=60)
def test_nan_on_one_shard_propagates_through_max_and_min():
    mesh = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    for nan_row in (3, 6):  # on a middle and the last rank's shard (gloo kept rank 0's NaN)
        x = torch.arange(24.0).reshape(8, 3) - 10
        x[nan_row, 1] = NAN
        x[5, 2] = float("inf")
        refs = _nan_reductions(x)
        for m, pl in ((mesh, [Shard(0)]), (mesh2, [Shard(1), Shard(0)])):
            outs = _nan_reductions(distribute_tensor(x, m, pl))
            for k, (o, r) in enumerate(zip(outs, refs)):
                torch.testing.assert_close(o.full_tensor(), r, equal_nan=True,
                                           msg=lambda s: f"output {k}, {pl}, NaN row {nan_row}: {s}")
    # Partial(max|min) resolved by redistribute: all-reduce and reduce-scatter alike
    rank = torch.distributed.get_rank()
    local = torch.arange(8.0) * (rank + 1)
    local[rank * 2] = NAN  # a NaN in a different place on every rank
    full = torch.stack([torch.arange(8.0) * (r + 1) for r in range(4)])
    for r in range(4):
        full[r, r * 2] = NAN
    for op, ref in (("max", full.amax(0)), ("min", full.amin(0))):
        p = DTensor.from_local(local, mesh, [Partial(op)])
        torch.testing.assert_close(p.redistribute(mesh, [R]).to_local(), ref, equal_nan=True)
        torch.testing.assert_close(p.redistribute(mesh, [Shard(0)]).full_tensor(), ref,
                                   equal_nan=True)
    # half precision and float64 travel through the same NaN-safe path
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        p = DTensor.from_local(local.to(dtype), mesh, [Partial("max")])
        torch.testing.assert_close(p.full_tensor(), full.amax(0).to(dtype), equal_nan=True)
