"""Pipeline parallelism (dtensor_lite.pipelining) trains exactly like one process.

Every rank trains its stages of a tiny Llama (examples/llama_pipeline.py) under a schedule and,
beside it, the whole model on the whole batch in plain torch (the oracle). fp32 throughout: the
pipeline sums the micro-batches' gradients and divides by their count where one process averages
over the batch once (and TP splits the matmuls' sums), a few ulps per step. Losses agree to 1e-5
relative; gradients to rtol 1e-4 / atol 1e-6 as in test_llama_e2e: AdamW divides by sqrt(v), so
last-bit differences in near-zero gradients grow over the steps (with SGD they stay at 1e-5).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtensor_lite import DTensor, init_device_mesh
from dtensor_lite.debug import CommDebugMode
from dtensor_lite.pipelining import PipelineScheduleSingle, PipelineStage, get_schedule_class
from examples.llama import Llama, LlamaConfig
from examples.llama_pipeline import stage_modules, stage_tp_plan
from fsdp import fully_shard
from tests.harness import distributed, run_distributed
from tp import parallelize_module

SEQ, LR = 8, 1e-2


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _mesh(pp, dp, tp):
    sizes = [(n, name) for n, name in ((pp, "pp"), (dp, "dp_shard"), (tp, "tp"))
             if n > 1 or name == "pp"]
    return init_device_mesh("cpu", tuple(n for n, _ in sizes),
                            mesh_dim_names=tuple(name for _, name in sizes))


def build(schedule, pp, v, m, dp=1, tp=1, layers=None, sp=False, reshard=None):
    """(mesh, schedule, local stage modules, oracle model)."""
    mesh = _mesh(pp, dp, tp)
    num_stages = pp * v
    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=sum(layers) if layers else num_stages,
                      n_heads=2, ffn_dim=24, max_seq_len=SEQ)
    torch.manual_seed(0)
    oracle = Llama(cfg)
    model = copy.deepcopy(oracle)
    rank = mesh["pp"].get_local_rank()
    ids = [rank + k * pp for k in range(v)]
    mods = stage_modules(model, num_stages, ids, layers)
    for mod in mods:
        if tp > 1:
            parallelize_module(mod, mesh["tp"], stage_tp_plan(mod, sequence_parallel=sp))
        if dp > 1:
            kw = {} if reshard is None else {"reshard_after_forward": reshard}
            for layer in mod.layers.values():
                fully_shard(layer, mesh=mesh["dp_shard"], **kw)
            fully_shard(mod, mesh=mesh["dp_shard"], **kw)
    stages = [PipelineStage(mod, s, num_stages, "cpu", group=mesh["pp"])
              for s, mod in zip(ids, mods)]
    cls = get_schedule_class(schedule)
    single = issubclass(cls, PipelineScheduleSingle)
    sched = cls(stages[0] if single else stages, m, loss_fn=_loss)
    return mesh, sched, mods, oracle


def _batch(step, rows):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 32, (rows, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def parity(schedule, pp, v, m, dp=1, tp=1, layers=None, sp=False, steps=5, optim="adamw"):
    mesh, sched, mods, oracle = build(schedule, pp, v, m, dp, tp, layers, sp)
    params = [p for mod in mods for p in mod.parameters()]
    make = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optim]
    opt = make(params, lr=LR) if params else None   # a stage may hold no layer
    ref_opt = make(oracle.parameters(), lr=LR)
    ref_params = dict(oracle.named_parameters())
    dp_rank = mesh["dp_shard"].get_local_rank() if dp > 1 else 0
    worst = 0.0
    for step in range(steps):
        tokens, targets = _batch(step, 2 * m * dp)
        mine = slice(dp_rank * 2 * m, (dp_rank + 1) * 2 * m)
        losses = []
        sched.step(tokens[mine], target=targets[mine], losses=losses)
        ref_loss = _loss(oracle(tokens), targets)
        ref_loss.backward()
        if losses:
            loss = torch.stack([_full(x) for x in losses]).mean()
            if dp > 1:
                dist.all_reduce(loss, group=mesh["dp_shard"].get_group())
                loss /= dp
            rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
            assert rel <= 1e-5, (step, loss.item(), ref_loss.item())
            worst = max(worst, rel)
        for mod in mods:
            for name, p in mod.named_parameters():
                ref = ref_params[name].grad
                torch.testing.assert_close(_full(p.grad), ref, rtol=1e-4, atol=1e-6,
                                           msg=lambda e: f"step {step} {name}: {e}")
        if opt is not None:
            opt.step()
            opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return worst


SCHEDULES = ["gpipe", "1f1b", "loopedbfs", "interleaved1f1b", "interleavedzerobubble"]
MULTI = {"loopedbfs", "interleaved1f1b", "interleavedzerobubble"}


@pytest.mark.parametrize("schedule", SCHEDULES)
@distributed(world_size=2)
def test_parity_pp2(schedule):
    # 2 pp ranks; the multi-stage schedules run 2 local stages each; uneven layers per stage
    v = 2 if schedule in MULTI else 1
    layers = [2, 1, 0, 2][:2 * v] if v == 2 else [2, 1]
    parity(schedule, 2, v, 4, layers=layers)


@pytest.mark.parametrize("schedule", SCHEDULES)
@distributed(world_size=4)
def test_parity_pp4(schedule):
    v = 2 if schedule in MULTI else 1
    layers = [1, 2, 0, 1, 1, 0, 2, 1][:4 * v]
    parity(schedule, 4, v, 4, layers=layers)


@pytest.mark.parametrize("schedule", SCHEDULES)
@distributed(world_size=4)
def test_parity_pp_fsdp(schedule):
    v = 2 if schedule in MULTI else 1
    parity(schedule, 2, v, 2, dp=2)


@pytest.mark.parametrize("schedule", SCHEDULES)
@distributed(world_size=4)
def test_parity_pp_tp(schedule):
    # sequence parallel: the residual stream crosses stages as a Shard(1) DTensor
    v = 2 if schedule in MULTI else 1
    parity(schedule, 2, v, 2, tp=2, sp=True)


@pytest.mark.parametrize("schedule", SCHEDULES)
@distributed(world_size=8, timeout=300)
def test_parity_pp_fsdp_tp(schedule):
    v = 2 if schedule in MULTI else 1
    parity(schedule, 2, v, 2, dp=2, tp=2, sp=True)
