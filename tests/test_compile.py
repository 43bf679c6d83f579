"""torch.compile over DTensors: a TP MLP with ``fullgraph=True`` (collectives in the graph as
functional collectives) and Llama blocks compiled one by one after FSDP + TP (the torchtitan
way), against eager / one-process oracles in fp32. ``aot_eager`` keeps compile time low on a
2-core box; benchmarks/compile_step.py measures inductor."""

import torch
import torch.nn as nn

from examples.llama import LlamaConfig
from examples.train_llama import TrainConfig, reference_losses, train
from tests.harness import distributed, run_distributed


def _graph_recorder():
    """An aot_eager-like backend that keeps the code of every forward / backward graph."""
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm.code)
        return gm.forward
    return aot_autograd(fw_compiler=keep, bw_compiler=keep), graphs


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(16, 40), nn.Linear(40, 16)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


@distributed(world_size=2)
def test_tp_mlp_compiles_fullgraph_with_functional_collectives():
    from dtensor_lite import init_device_mesh
    from tp import ColwiseParallel, RowwiseParallel, parallelize_module
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    ref = _MLP()
    model = _MLP()
    model.load_state_dict(ref.state_dict())
    mesh = init_device_mesh("cpu", (2,))
    parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    backend, graphs = _graph_recorder()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 16)  # same seed on every rank: the replicated input
        x, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, ref_out = compiled(x), ref(ref_x)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        for loss, o in ((out.square().sum(), opt), (ref_out.square().sum(), ref_opt)):
            loss.backward()
            o.step()
            o.zero_grad()
        torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6)
    assert _graph_breaks() == 0
    forward, backward = graphs[0], graphs[1]
    # RowwiseParallel's output all-reduce and ColwiseParallel's input-gradient all-reduce
    assert "_c10d_functional.all_reduce" in forward and "wait_tensor" in forward
    assert "_c10d_functional.all_reduce" in backward and "wait_tensor" in backward


@distributed(world_size=2)
def test_our_mesh_inside_compiled_code_keeps_its_own_class():
    """Dynamo wraps our mesh by ``type(mesh)`` (ours), not by the ``__class__`` it reports for
    torch's functional collectives: it crosses into compiled code as a closure (from_local),
    ``with mesh:`` there runs (eagerly, at a graph break) and funcol still takes it."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    from dtensor_lite import DTensor, Replicate, init_device_mesh
    from dtensor_lite.device_mesh import current_mesh
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2,))
    assert isinstance(mesh, TorchDeviceMesh) and type(mesh).__module__ == "dtensor_lite.device_mesh"
    placements = [Replicate()]

    def from_local(x):
        return (DTensor.from_local(x, mesh, placements) * 2).to_local()

    def scoped(x):
        with mesh:
            inside = current_mesh() is mesh
        return x + (1 if inside else 100)

    x = torch.ones(3)
    torch.testing.assert_close(torch.compile(from_local, backend="aot_eager", fullgraph=True)(x),
                               x * 2)
    torch.testing.assert_close(torch.compile(scoped, backend="aot_eager")(x), x + 1)
    assert current_mesh() is None
    with mesh as entered:  # eager, unchanged
        assert entered is mesh and current_mesh() is mesh
    torch.testing.assert_close(funcol.all_reduce(x, "sum", group=mesh).wait(), x * 2)


TINY = LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=16)


def _train_compiled(cfg):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    losses = train(cfg)
    return losses, _graph_breaks()


def test_fsdp_tp_blocks_compiled_with_selective_checkpointing_match_one_process():
    """FSDP + TP (sequence and loss parallel) on 2x2, each block checkpointed (selective) and
    compiled: losses of 6 AdamW steps within 1e-5 of one process, no graph break in a block
    (FSDP's hooks run eagerly around it)."""
    cfg = TrainConfig(mesh="dp_shard=2,tp=2", steps=6, batch=8, seq=16, lr=3e-3, quiet=True,
                      model=TINY, ac="selective", compile="aot_eager")
    results = run_distributed(4, _train_compiled, cfg)
    losses, breaks = results[0]
    assert all(r == results[0] for r in results)
    ref = reference_losses(TrainConfig(**{**cfg.__dict__, "ac": "none", "compile": None}))
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) <= 1e-5
    assert breaks == 0
