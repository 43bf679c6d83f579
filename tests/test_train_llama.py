"""The main example trains to the same losses on every mesh as in one process.

``examples/train_llama.py`` with FSDP, TP, FSDP+TP and HSDP+TP (each TP case with and without
sequence parallelism and loss parallelism) against ``reference_losses``: the same model, data and
AdamW in plain single-process torch on the global batch. fp32: max relative difference <= 1e-5
at every step. Also: a checkpoint written on one mesh resumes on another with the losses of a run
that was never interrupted; and the README's first command prints only our own lines, with one
tokens/s figure.
"""
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.llama import Llama, LlamaConfig
from examples.train_llama import TrainConfig, reference_losses, train
from tests import conftest
from tests._narrow import assert_text_fits
from tests.harness import run_distributed

REPO = Path(__file__).resolve().parents[1]
TINY = LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=16)
STEPS = 10


def _cfg(mesh, sp=True, lp=True, **kw):
    return TrainConfig(mesh=mesh, steps=kw.pop("steps", STEPS), batch=8, seq=16, lr=3e-3,
                       sequence_parallel=sp, loss_parallel=lp, quiet=True, model=TINY, **kw)


def _train(cfg):
    return train(cfg)


def _max_rel(losses, ref):
    assert len(losses) == len(ref)
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref))


_REF = {}


def _reference(steps=STEPS):
    if steps not in _REF:
        # on a worker, so that the oracle runs on the device the tests run on (DTL_TEST_DEVICE)
        _REF[steps] = run_distributed(1, reference_losses, _cfg("", steps=steps), timeout=300)[0]
    return _REF[steps]


CASES = [  # (world, mesh, sequence parallel, loss parallel)
    (4, "dp_shard=4", True, True),
    (2, "tp=2", True, True),
    (4, "dp_shard=2,tp=2", True, True),
    (4, "dp_shard=2,tp=2", False, False),
    (4, "dp_shard=2,tp=2", True, False),
    (4, "dp_shard=2,tp=2", False, True),
    (8, "dp_replicate=2,dp_shard=2,tp=2", True, True),
    (8, "dp_replicate=2,dp_shard=2,tp=2", False, False),
    (8, "dp_replicate=2,dp_shard=2,tp=2", True, False),
    (8, "dp_replicate=2,dp_shard=2,tp=2", False, True),
]


@pytest.mark.parametrize("world,mesh,sp,lp", CASES,
                         ids=[f"{m}-sp{int(s)}-lp{int(l)}" for _, m, s, l in CASES])
def test_losses_match_single_process(world, mesh, sp, lp):
    per_rank = run_distributed(world, _train, _cfg(mesh, sp, lp), timeout=300)
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree on the mean loss"
    worst = _max_rel(per_rank[0], _reference())
    conftest.SUMMARY_LINES.append(f"train_llama {mesh} sp={int(sp)} lp={int(lp)}: {STEPS} AdamW "
                                  f"steps, max relative loss diff vs 1 process {worst:.1e}")
    assert worst <= 1e-5, f"{mesh} sp={sp} lp={lp}: max relative loss difference {worst:.2e}"
    assert per_rank[0][-1] < per_rank[0][0]  # and it learns


def test_resume_on_another_mesh(tmp_path):
    """4 steps on 2x2 FSDP+TP, checkpoint, 4 more on 2-way TP: the losses of 8 uninterrupted."""
    path = str(tmp_path / "ckpt")
    first = run_distributed(4, _train, _cfg("dp_shard=2,tp=2", steps=4, save=path), timeout=300)
    second = run_distributed(2, _train, _cfg("tp=2", steps=8, resume=path), timeout=300)
    worst = _max_rel(first[0] + second[0], _reference(8))
    conftest.SUMMARY_LINES.append(f"train_llama resume 2x2 FSDP+TP -> 2-way TP: max relative loss "
                                  f"diff vs uninterrupted {worst:.1e}")
    assert worst <= 1e-5, f"resumed run differs from uninterrupted training by {worst:.2e}"


def test_bad_mesh_flag_is_explained():
    with pytest.raises(SystemExit, match="multiply to 1"):
        from examples.train_llama import parse_mesh
        parse_mesh("dp_shard=2,tp=2", 1)
    with pytest.raises(SystemExit, match="NAME=SIZE"):
        parse_mesh("cp=2", 2)
    with pytest.raises(SystemExit, match="needs dp_shard"):
        parse_mesh("dp_replicate=2", 2)
    assert list(parse_mesh("tp=2,dp_shard=2", 4)) == ["dp_shard", "tp"]


def test_resume_3d_hsdp_tp_on_fsdp(tmp_path):
    """4 steps on 2x2x2 HSDP+TP, checkpoint, 4 more on 4-way FSDP: as if never interrupted."""
    path = str(tmp_path / "ckpt3d")
    first = run_distributed(8, _train, _cfg("dp_replicate=2,dp_shard=2,tp=2", steps=4, save=path),
                            timeout=300)
    second = run_distributed(4, _train, _cfg("dp_shard=4", steps=8, resume=path), timeout=300)
    worst = _max_rel(first[0] + second[0], _reference(8))
    assert worst <= 1e-5, f"resumed run differs from uninterrupted training by {worst:.2e}"


def _full_state_round_trip(mesh_text):
    """Train 3 steps on ``mesh_text``; its full state dict (model + AdamW) equals plain torch's
    after the same steps, and loads into a fresh model on the same mesh bit-exactly."""
    import torch
    import torch.distributed as dist

    from dtensor_lite import init_device_mesh
    from dtensor_lite.state_dict import get_state_dict, set_model_state_dict, set_state_dict
    from examples.llama import Llama
    from examples.train_llama import (build, corpus_tokens, dp_rows, global_batch, parse_mesh,
                                      train_step)

    cfg = _cfg(mesh_text, steps=3)
    sizes = parse_mesh(cfg.mesh, dist.get_world_size())
    mesh = init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    model, opt = build(cfg, mesh, sizes)
    torch.manual_seed(cfg.seed)
    ref = Llama(cfg.model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=cfg.lr)
    tokens = corpus_tokens()
    for step in range(cfg.steps):
        x, y = global_batch(tokens, step, cfg)
        train_step(model, opt, dp_rows(x, mesh, sizes), dp_rows(y, mesh, sizes), True)
        train_step(ref, ref_opt, x, y, False)
    model_sd, optim_sd = get_state_dict(model, opt, full_state_dict=True)
    ref_optim = {name: ref_opt.state[p] for name, p in ref.named_parameters()}
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(model_sd[name], value, rtol=1e-5, atol=1e-5)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optim_sd["state"][name][key], ref_optim[name][key],
                                       rtol=1e-4, atol=1e-6)
    fresh, fresh_opt = build(dataclasses.replace(cfg, seed=1), mesh, sizes)
    set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   full_state_dict=True)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert q.placements == p.placements and torch.equal(q.full_tensor(), p.full_tensor()), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(fresh_opt.state[q][key].full_tensor(),
                               opt.state[p][key].full_tensor()), (name, key)
    # and plain torch's own state dict loads straight into the sharded model
    set_model_state_dict(fresh, ref.state_dict(), full_state_dict=True)
    for (name, p), p_ref in zip(fresh.named_parameters(), ref.parameters()):
        assert torch.equal(p.full_tensor(), p_ref), name
    return True


@pytest.mark.parametrize("world,mesh", [(4, "dp_shard=2,tp=2"),
                                        (8, "dp_replicate=2,dp_shard=2,tp=2")])
def test_full_state_dict_round_trip(world, mesh):
    assert all(run_distributed(world, _full_state_round_trip, mesh, timeout=300))


def _train_twice_across_reinit(cfg):
    """Train, destroy the process group, make a new one, train again: the same losses (no cache
    of meshes, groups, joined meshes, specs or decisions may outlive the groups it keys on)."""
    import torch.distributed as dist

    from tests.harness import reinit_process_group

    first = train(cfg)
    dist.destroy_process_group()
    reinit_process_group()
    return first, train(cfg)


def test_training_survives_process_group_reinit():
    cfg = _cfg("dp_shard=2,tp=2", steps=3)
    for first, second in run_distributed(4, _train_twice_across_reinit, cfg, timeout=300):
        assert first == second


# ============================================================================ what it prints
_NATIVE_LOG_LINE = re.compile(r"^(\[rank\d+\]:)?\[?[IWEF]\d{4} \d\d:\d\d:\d\d")  # c10 / glog


def _run_example(*args: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 4 examples/train_llama.py ARGS`` as a user runs it, its output
    piped (so rich lays it out for 80 columns, as in CI); checked to have succeeded."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH_CPP_LOG_LEVEL", "KINETO_LOG_LEVEL")}  # see what a user sees
    # OMP_NUM_THREADS: what torchrun's own banner asks for (the example sets 1 thread anyway)
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", COLUMNS="80")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "4", "examples/train_llama.py", *args]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert_text_fits(run.stdout, f"train_llama.py {' '.join(args)}")  # every table, 80 columns
    return run


def test_readme_command_prints_only_our_lines_and_one_throughput():
    """The README's first command, 3 steps: no line from PyTorch's internals (the profiler's
    ``USDT ... profiler_start/stop``, the allocator's ``CPUAllocator`` warning, any c10 log line),
    and its tokens/s figures are one figure: the progress bar's equals the summary's, which is
    the tokens per step over rank 0's median step time as its table prints it."""
    run = _run_example("--mesh", "dp_shard=2,tp=2", "--steps", "3")
    out = run.stdout + run.stderr
    for line in out.splitlines():
        assert not any(s in line for s in ("USDT", "profiler_start", "profiler_stop",
                                           "CPUAllocator")), line
        assert not _NATIVE_LOG_LINE.match(line), line

    text = " ".join(run.stdout.split())  # rich wraps long lines at the console's width
    bar = re.search(r"training \S+ 3/3 loss [\d.]+ ([\d,]+) tokens/s", text)
    done = re.search(r"done: 3 steps in [\d.]+ s, loss [\d.]+ -> [\d.]+, ([\d,]+) tokens/s", text)
    defined = re.search(r"tokens/s = ([\d,]+) tokens per step / ([\d.]+) ms, rank 0's median "
                        r"step \(steps 2-3\)", text)
    rank0 = re.search(r"│ 0 │ ([\d.]+) │", text)   # rank 0's row: its median step ms
    assert bar and done and defined and rank0, run.stdout[-3000:]
    rate = float(done.group(1).replace(",", ""))
    assert float(bar.group(1).replace(",", "")) == rate
    tokens, ms = int(defined.group(1).replace(",", "")), float(defined.group(2))
    assert tokens == TrainConfig.batch * TrainConfig.seq
    assert float(rank0.group(1)) == ms
    # printed to 0.1 ms and to whole tokens/s: they agree up to those roundings
    assert abs(rate - tokens / (ms / 1e3)) <= 0.5 + rate * 0.05 / ms + 1e-9, (rate, tokens, ms)


def test_pipeline_screen_shows_every_stage_and_explains_its_columns():
    """With pp=2 rank 0 holds only stage 0, yet the parameter table lists every stage's
    parameters (gathered over the pp group) in the model's order, says which pp rank holds each,
    and the bubble table says what its measured idle includes."""
    run = _run_example("--mesh", "pp=2,dp_shard=2", "--steps", "3")
    text = run.stdout
    names = re.findall(r"^(tok_embeddings\.weight|layers\.\d+\.\S+|norm\.weight|output\.weight)"
                       r"\s+\(", text, re.M)
    with torch.device("meta"):
        order = [n for n, _ in Llama(TrainConfig().model).named_parameters()]
    assert names == order, text
    holders = dict(re.findall(r"^(\S+)\s+\([\d, ]+\)\s+(\d)\s", text, re.M))
    assert holders["tok_embeddings.weight"] == "0" and holders["output.weight"] == "1", holders
    flat = " ".join(text.split())
    assert "pp: the pipeline rank whose stage holds the parameter" in flat
    assert "it includes the waits for sends and receives" in flat
    assert "exposed % of step:" in flat
