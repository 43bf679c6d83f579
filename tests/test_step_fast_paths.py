"""The training step's shortcuts give what the general paths give: a tensor-parallel linear run
on local pieces under autograd (_local_linear.py) -- values, gradient values and gradient
placements equal to the composite's and to single-process torch -- and a redistribute through a
runner cached per spec pair (collectives.sync_runner) -- values equal to the general executor's,
collectives still counted by CommDebugMode, a wrong-shaped piece still the same error."""
import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtensor_lite import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.debug import CommDebugMode
from dtensor_lite import _failures, _shortcuts
from dtensor_lite.redistribute import entry
from dtensor_lite.redistribute.executor import run_plan
from dtensor_lite.redistribute.planner import plan_redistribute
from tests._spies import calls_of
from tests.harness import distributed
from tp import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module


class _Block(nn.Module):
    def __init__(self, ffn: int, bias: bool):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.w1 = nn.Linear(8, ffn, bias=bias)
        self.w2 = nn.Linear(ffn, 8, bias=bias)

    def forward(self, x):
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


def _train(base, x_global, mesh, local_linear: bool):
    from dtensor_lite import _local_linear
    _local_linear._LINEAR_PLANS.clear()  # a worker process may have run other tests before
    seq = x_global.ndim - 2  # (batch, seq, hidden) or (seq, hidden)
    with contextlib.nullcontext() if local_linear else _shortcuts.disabled():
        model = parallelize_module(copy.deepcopy(base), mesh, {
            "norm": SequenceParallel(sequence_dim=seq),
            "w1": ColwiseParallel(input_layouts=Shard(seq)),
            "w2": RowwiseParallel(output_layouts=Shard(seq), use_local_output=False)})
        x = distribute_tensor(x_global, mesh, [Shard(seq)]).requires_grad_()
        for _ in range(2):  # the second call runs the cached decisions
            out = model(x)
            out.to_local().sum().backward()
    taken = [p for p in _local_linear._LINEAR_PLANS.values() if p is not _local_linear._NOT_LOCAL]
    assert bool(taken) == local_linear, "the shortcut was not taken (or taken while disabled)"
    _local_linear._LINEAR_PLANS.clear()
    return out, x, model


@distributed(world_size=4)
@pytest.mark.parametrize("ffn,bias,x_shape", [(12, True, (2, 8, 8)), (10, True, (2, 8, 8)),
                                              (12, False, (2, 8, 8)), (10, True, (8, 8)),
                                              (12, False, (8, 8)), (3, True, (2, 8, 8))])
def test_tp_linear_on_local_pieces_matches_composite_and_torch(ffn, bias, x_shape):
    """ffn 10 on 4 ranks: uneven feature shards (3, 3, 3, 1), ffn 3: an empty one (1, 1, 1, 0);
    3-D and 2-D inputs (the
    composite's addmm and mm, whose backward kernels the shortcut runs)."""
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    base, x_global = _Block(ffn, bias), torch.randn(*x_shape)
    out_c, x_c, model_c = _train(base, x_global, mesh, local_linear=False)
    out_l, x_l, model_l = _train(base, x_global, mesh, local_linear=True)
    ref, x_ref = copy.deepcopy(base), x_global.clone().requires_grad_()
    for _ in range(2):
        out_ref = ref(x_ref)
        out_ref.sum().backward()
    assert type(out_l) is DTensor and out_l.placements == out_c.placements
    assert torch.equal(out_l.full_tensor(), out_c.full_tensor())
    torch.testing.assert_close(out_l.full_tensor(), out_ref)
    assert x_l.grad.placements == x_c.grad.placements
    assert torch.equal(x_l.grad.full_tensor(), x_c.grad.full_tensor())
    torch.testing.assert_close(x_l.grad.full_tensor(), x_ref.grad)
    for (name, p_l), (_, p_c), (_, p_ref) in zip(model_l.named_parameters(),
                                                 model_c.named_parameters(),
                                                 ref.named_parameters()):
        assert type(p_l.grad) is DTensor, name
        assert p_l.grad.placements == p_c.grad.placements, (name, p_l.grad.placements)
        assert torch.equal(p_l.grad.full_tensor(), p_c.grad.full_tensor()), name
        torch.testing.assert_close(p_l.grad.full_tensor(), p_ref.grad, msg=name)


@distributed(world_size=2)
@pytest.mark.parametrize("src,dst", [([Shard(1)], [Replicate()]), ([Partial()], [Shard(1)]),
                                     ([Partial()], [Replicate()]), ([Shard(0)], [Replicate()])])
def test_redistribute_runner_matches_the_executor(src, dst):
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(dist.get_rank())
    local = torch.randn(4, 6, 3)
    dt = DTensor.from_local(local, mesh, src)
    target = dt.redistribute(mesh, dst)._spec
    assert entry._RUNNERS.get((dt._spec, target)) not in (None, entry._NO_RUNNER)
    # its works are the group's all-gather / all-reduce (a reduce-scatter too: gloo's form),
    # which wait in slices on this thread; a hand-over to a waiter thread costs CPU per call
    with calls_of(_failures, "_wait_on_thread") as handed_over:
        out = entry.redistribute_local(local, dt._spec, target)
    assert handed_over == []
    general = run_plan(local, plan_redistribute(dt._spec, target))
    assert torch.equal(out, general)
    assert out.untyped_storage().data_ptr() != local.untyped_storage().data_ptr()
    with CommDebugMode() as comm:  # a debug mode sends the call the general, counted, way
        dt.redistribute(mesh, dst)
    assert comm.get_total_counts() == 1
    with pytest.raises(ValueError, match="local piece has shape"):
        entry.redistribute_local(local[:1], dt._spec, target)
