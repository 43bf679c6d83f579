"""Pipeline parallelism (dtensor_lite.pipelining) trains exactly like one process.

Every rank trains its stages of a tiny Llama (examples/llama_pipeline.py) under a schedule and,
beside it, the whole model on the whole batch in plain torch (the oracle), 5 AdamW steps (the
example's tests below run 4). fp32 throughout: the
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

from dtensor_lite import (DTensor, Replicate, Shard, compute_local_shape_and_global_offset,
                          init_device_mesh)
from dtensor_lite.debug import CommDebugMode
from dtensor_lite.pipelining import PipelineScheduleSingle, PipelineStage, get_schedule_class
from examples.llama import Llama, LlamaConfig
from examples.llama_pipeline import stage_modules, stage_tp_plan
from fsdp import fully_shard
from tests.harness import TEST_DEVICE, distributed, run_distributed
from tp import parallelize_module

SEQ, LR = 8, 1e-2


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _mesh(pp, dp, tp, dpr=1):
    sizes = [(n, name) for n, name in ((pp, "pp"), (dpr, "dp_replicate"), (dp, "dp_shard"),
                                       (tp, "tp"))
             if n > 1 or name == "pp"]
    return init_device_mesh("cpu", tuple(n for n, _ in sizes),
                            mesh_dim_names=tuple(name for _, name in sizes))


def build(schedule, pp, v, m, dp=1, tp=1, layers=None, sp=False, reshard=None, dpr=1,
          by_group=False):
    """(mesh, schedule, local stage modules, oracle model); ``dpr``: HSDP's replicas;
    ``by_group``: stages built as torchtitan 0.3 builds them, on the pp dim's ProcessGroup with
    torch 2.15's ``get_mesh`` callback (dim names -> mesh) for the DTensors they receive."""
    mesh = _mesh(pp, dp, tp, dpr)
    dp_dims = ("dp_replicate", "dp_shard") if dpr > 1 else "dp_shard"
    num_stages = pp * v
    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=sum(layers) if layers else num_stages,
                      n_heads=2, ffn_dim=24, max_seq_len=SEQ)
    torch.manual_seed(0)
    oracle = Llama(cfg)
    model = copy.deepcopy(oracle)
    rank = mesh["pp"].get_local_rank()
    cls = get_schedule_class(schedule)
    ids = cls.stages_of(rank, pp, v)
    mods = stage_modules(model, num_stages, ids, layers)
    for mod in mods:
        if tp > 1:
            parallelize_module(mod, mesh["tp"], stage_tp_plan(mod, sequence_parallel=sp))
        if dp > 1:
            kw = {} if reshard is None else {"reshard_after_forward": reshard}
            for layer in mod.layers.values():
                fully_shard(layer, mesh=mesh[dp_dims], **kw)
            fully_shard(mod, mesh=mesh[dp_dims], **kw)
    if by_group:
        asked = []

        def get_mesh(names, layout):
            asked.append((names, layout))
            return mesh[names]
        stages = [PipelineStage(mod, s, num_stages, torch.device(TEST_DEVICE),
                                group=mesh.get_group("pp"), get_mesh=get_mesh)
                  for s, mod in zip(ids, mods)]
        mesh.asked = asked
    else:
        stages = [PipelineStage(mod, s, num_stages, TEST_DEVICE, group=mesh["pp"])
                  for s, mod in zip(ids, mods)]
    single = issubclass(cls, PipelineScheduleSingle)
    sched = cls(stages[0] if single else stages, m, loss_fn=_loss)
    return mesh, sched, mods, oracle


def _batch(step, rows):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 32, (rows, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _mine_and_expected(grad, ref):
    """``grad``'s local piece and the same piece of the oracle's ``ref``: no collective where the
    layout is plain Shard / Replicate (the piece is a block of ``ref``), else both whole."""
    if not isinstance(grad, DTensor):
        return grad, ref
    if not all(type(p) in (Shard, Replicate) for p in grad.placements):
        return grad.full_tensor(), ref
    shape, offset = compute_local_shape_and_global_offset(ref.shape, grad.device_mesh,
                                                          grad.placements)
    return grad.to_local(), ref[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def parity(schedule, pp, v, m, dp=1, tp=1, layers=None, sp=False, steps=5, optim="adamw",
           by_group=False):
    mesh, sched, mods, oracle = build(schedule, pp, v, m, dp, tp, layers, sp, by_group=by_group)
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
        # every gradient at the first and the last step (the losses of the steps between
        # follow from the gradients before them: AdamW, lr 1e-2)
        for mod in mods if step in (0, steps - 1) else ():
            for name, p in mod.named_parameters():
                mine, ref = _mine_and_expected(p.grad, ref_params[name].grad)
                torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-6,
                                           msg=lambda e: f"step {step} {name}: {e}")
        if opt is not None:
            opt.step()
            opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    if by_group:
        mesh_asked = mesh.asked
        assert mesh_asked and all(a == (("tp",), None) for a in mesh_asked), mesh_asked
    return worst


SCHEDULES = ["gpipe", "1f1b", "loopedbfs", "interleaved1f1b", "interleavedzerobubble",
             "zbvzerobubble"]
MULTI = {"loopedbfs", "interleaved1f1b", "interleavedzerobubble", "zbvzerobubble"}


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


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved1f1b"])
@distributed(world_size=4)
def test_parity_pp_tp_stage_on_process_group_with_get_mesh(schedule):
    """torch 2.15's PipelineStage(group=<ProcessGroup>, get_mesh=callback), as torchtitan's
    pipeline_llm builds stages: the Shard(1) residual stream crosses stages and is rebuilt on
    the mesh the callback gives for its dim names (asked once per names, layout None); the
    losses and gradients are one process's."""
    v = 2 if schedule in MULTI else 1
    parity(schedule, 2, v, 2, tp=2, sp=True, steps=2, by_group=True)


@pytest.mark.parametrize("schedule", SCHEDULES)
@distributed(world_size=8, timeout=300)
def test_parity_pp_fsdp_tp(schedule):
    v = 2 if schedule in MULTI else 1
    parity(schedule, 2, v, 2, dp=2, tp=2, sp=True)


# ============================================================================ communication
def _fsdp_groups(mods) -> int:
    return sum(1 for mod in mods for m in mod.modules()
               if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state().group is not None)


def step_comm(schedule, v, m, reshard=None, dpr=1):
    """This rank's collectives in one (second) step of pp=2 x [dp_replicate=dpr x] dp_shard=2:
    {(mesh dim, kind): n}."""
    mesh, sched, mods, _ = build(schedule, 2, v, m, dp=2, reshard=reshard, dpr=dpr)
    tokens, targets = _batch(0, 2 * m)
    sched.step(tokens, target=targets)       # the first step also agrees shapes (pp_meta)
    with CommDebugMode() as comm:
        sched.step(tokens, target=targets)
    counts: dict = {}
    for kind, _, _, _, dim in comm.calls:
        counts[(dim, kind)] = counts.get((dim, kind), 0) + 1
    return counts, _fsdp_groups(mods), sched.comm_counts()


@pytest.mark.parametrize("schedule", ["1f1b", "interleavedzerobubble"])
@distributed(world_size=4)
def test_fsdp_gathers_and_reduces_once_per_step(schedule):
    """m = 4 micro-batches: each fsdp group all-gathers once and reduce-scatters once per step
    (default reshard_after_forward), and the pp sends / receives are the schedule's count."""
    v = 2 if schedule in MULTI else 1
    counts, groups, expected = step_comm(schedule, v, 4)
    assert groups >= v
    assert counts.get(("dp_shard", "all_gather"), 0) == groups, counts
    assert counts.get(("dp_shard", "reduce_scatter"), 0) == groups, counts
    assert counts.get(("pp", "send"), 0) == expected["send"] > 0, (counts, expected)
    assert counts.get(("pp", "recv"), 0) == expected["recv"] > 0, (counts, expected)
    assert ("pp", "pp_meta") not in counts   # shapes were agreed once, at the first step
    # reshard_after_forward=True given explicitly is honoured: gathers again per micro-batch
    counts, groups, _ = step_comm(schedule, v, 4, reshard=True)
    assert counts[("dp_shard", "all_gather")] > groups, counts
    assert counts[("dp_shard", "reduce_scatter")] == groups, counts


@distributed(world_size=8, timeout=300)
def test_hsdp_all_reduces_once_per_step():
    """pp=2 x dp_replicate=2 x dp_shard=2 under 1F1B with 4 micro-batches: each fsdp group
    all-gathers, reduce-scatters and all-reduces (across replicas) once per step."""
    counts, groups, expected = step_comm("1f1b", 1, 4, dpr=2)
    assert groups >= 2
    assert counts.get(("dp_replicate", "all_reduce"), 0) == groups, counts
    assert counts.get(("dp_shard", "all_gather"), 0) == groups, counts
    assert counts.get(("dp_shard", "reduce_scatter"), 0) == groups, counts
    assert counts.get(("pp", "send"), 0) == expected["send"] > 0, (counts, expected)


# ============================================================================ errors
def _outcome(fn):
    try:
        fn()
        return "ok", ""
    except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
        return type(e).__name__, str(e)


def _stage_and_mesh(num_stages=2, **kw):
    mesh = _mesh(2, 1, 1)
    rank = mesh["pp"].get_local_rank()
    return mesh, PipelineStage(torch.nn.Linear(4, 4), rank, num_stages, TEST_DEVICE, group=mesh["pp"],
                               **kw)


@distributed(world_size=2)
def test_errors_from_global_metadata_are_raised_on_every_rank():
    from dtensor_lite.pipelining import (Schedule1F1B, ScheduleInterleaved1F1B,
                                         ScheduleZBVZeroBubble)
    kind, msg = _outcome(lambda: _stage_and_mesh(num_stages=3))
    assert kind == "ValueError" and "3 stages do not divide over the 2 pp ranks" in msg, msg
    mesh, stage = _stage_and_mesh()
    kind, msg = _outcome(lambda: Schedule1F1B(stage, 1, loss_fn=_loss))
    assert kind == "ValueError" and "fewer than the 2 pp ranks" in msg, msg
    kind, msg = _outcome(lambda: ScheduleZBVZeroBubble([stage], 2, loss_fn=_loss))
    assert kind == "ValueError" and "runs two stages per pp rank" in msg, msg
    kind, msg = _outcome(lambda: ScheduleInterleaved1F1B([stage], 1, loss_fn=_loss))
    assert kind == "ValueError" and "needs n_microbatches >= 2" in msg, msg
    kind, msg = _outcome(lambda: PipelineStage(torch.nn.Linear(4, 4), 1 - stage.stage_index, 2,
                                               TEST_DEVICE, group=mesh["pp"]))
    assert kind == "ValueError" and "belongs on pp rank" in msg, msg
    # the loss function missing on the last stage: found by the first step's agreement, on both
    loss_fn = _loss if dist.get_rank() == 0 else None
    sched = Schedule1F1B(stage, 2, loss_fn=loss_fn)
    kind, msg = _outcome(lambda: sched.step(torch.randn(4, 4), target=torch.randn(4, 4)))
    assert kind == "ValueError" and "last stage has no loss_fn" in msg, msg


def _raising_body(mode):
    """pp=2 over a Linear; stage 1 is wrong in ``mode``; returns this rank's outcome."""
    mesh = _mesh(2, 1, 1)
    rank = mesh["pp"].get_local_rank()

    class Fails(torch.nn.Linear):
        def forward(self, x):
            if mode == "raise" and rank == 1 and getattr(self, "calls", 0) == 1:
                raise RuntimeError("stage 1 broke on its second micro-batch")
            self.calls = getattr(self, "calls", 0) + 1
            return super().forward(x)

    declared = {"input_args": torch.empty(2, 5)} if mode == "shapes" and rank == 1 else {}
    stage = PipelineStage(Fails(4, 4), rank, 2, TEST_DEVICE, group=mesh["pp"], **declared)
    sched = get_schedule_class("gpipe")(stage, 2, loss_fn=lambda y, t: (y - t).pow(2).mean())
    return _outcome(lambda: sched.step(torch.randn(4, 4), target=torch.randn(4, 4)))


def _in_fresh_group(mode):
    from tests.harness import reinit_process_group
    reinit_process_group()
    try:
        return _raising_body(mode)
    finally:
        reinit_process_group()


@pytest.mark.parametrize("mode", ["shapes", "raise"])
def test_a_failing_stage_stops_every_rank(mode):
    """Stage 1 declares input_args the previous stage does not send (or raises in its forward):
    it raises, and stage 0, waiting for its gradients, stops with that error instead of hanging."""
    outcomes = run_distributed(2, _in_fresh_group, mode)
    (kind0, msg0), (kind1, msg1) = outcomes
    if mode == "shapes":
        assert kind1 == "ValueError" and "the stages' shapes do not match" in msg1, outcomes
        assert "tensor[2, 5]" in msg1 and "tensor[2, 4]" in msg1, outcomes
    else:
        assert kind1 == "RuntimeError" and "broke" in msg1, outcomes
    assert kind0 == "RankFailedError" and "rank 1" in msg0 and msg1[:40] in msg0, outcomes


# ============================================================================ the main example
def _example_cfg(mesh, schedule="1f1b", steps=4, **kw):
    import dataclasses

    from tests.test_train_llama import TINY, _cfg
    return dataclasses.replace(_cfg(mesh, pp_schedule=schedule, microbatches=2, steps=steps, **kw),
                               model=dataclasses.replace(TINY, n_layers=4))


_EXAMPLE_REF: dict = {}


def _example_reference(steps):
    from examples.train_llama import reference_losses
    if steps not in _EXAMPLE_REF:
        _EXAMPLE_REF[steps] = run_distributed(1, reference_losses, _example_cfg("", steps=steps),
                                              timeout=300)[0]
    return _EXAMPLE_REF[steps]


def _train_example(cfg):
    from examples.train_llama import train
    return train(cfg)


@pytest.mark.parametrize("world,mesh,schedule,ac", [
    (4, "pp=2,dp_shard=2", "zero-bubble", "full"), (4, "pp=2,tp=2", "interleaved", "none"),
    (8, "pp=2,dp_shard=2,tp=2", "zbv", "none")])
def test_train_llama_pp_matches_one_process(world, mesh, schedule, ac):
    """examples/train_llama.py with a pp dim (tp with sequence and loss parallelism; --ac full
    under zero bubble's split backward) trains to the losses of one process (max relative
    difference <= 1e-5 at every step, 4 steps). (--ac selective under 1F1B and --compile compose
    the same way, checked by hand: 8.7e-8 each, compile with aot_eager under zero bubble; too
    slow to compile here.)"""
    per_rank = run_distributed(world, _train_example, _example_cfg(mesh, schedule, ac=ac),
                               timeout=300)
    assert all(r == per_rank[0] for r in per_rank)
    ref = _example_reference(4)
    worst = max(abs(a - b) / abs(b) for a, b in zip(per_rank[0], ref))
    assert worst <= 1e-5, (mesh, schedule, worst)


def test_checkpoint_resumes_across_pp_sizes(tmp_path):
    """2 steps on pp=2 x dp_shard=2, checkpoint, 1 on dp_shard=2 (pp=1), checkpoint, 1 on
    pp=2 x tp=2: the losses of 4 uninterrupted steps."""
    a, b = str(tmp_path / "pp2"), str(tmp_path / "pp1")
    first = run_distributed(4, _train_example, _example_cfg("pp=2,dp_shard=2", steps=2, save=a),
                            timeout=300)
    second = run_distributed(2, _train_example, _example_cfg("dp_shard=2", steps=3, resume=a,
                                                             save=b), timeout=300)
    third = run_distributed(4, _train_example, _example_cfg("pp=2,tp=2", "gpipe", steps=4,
                                                            resume=b), timeout=300)
    losses = first[0] + second[0] + third[0]
    ref = _example_reference(4)
    worst = max(abs(x - y) / abs(y) for x, y in zip(losses, ref))
    assert len(losses) == 4 and worst <= 1e-5, (losses, ref, worst)


def _eval_body():
    """eval(): forward only, the merged output on the last stage equals the plain forward."""
    mesh = _mesh(2, 1, 1)
    rank = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    whole = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    stage = PipelineStage([whole[:2], whole[2:]][rank], rank, 2, TEST_DEVICE, group=mesh["pp"])
    sched = get_schedule_class("1f1b")(stage, 4, loss_fn=lambda y, t: (y - t).pow(2).mean())
    x, t = torch.randn(8, 4), torch.randn(8, 3)
    losses = []
    out = sched.eval(x, target=t, losses=losses)
    assert all(p.grad is None for p in whole.parameters())
    if rank == 1:
        torch.testing.assert_close(out, whole(x))
        assert len(losses) == 4
    else:
        assert out is None and not losses


def test_eval_runs_forward_only():
    run_distributed(2, _eval_body)
