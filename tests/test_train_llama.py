"""The main example trains to the same losses on every mesh as in one process.

``examples/train_llama.py`` with FSDP, TP, FSDP+TP and HSDP+TP (each TP case with and without
sequence parallelism and loss parallelism) against ``reference_losses``: the same model, data and
AdamW in plain single-process torch on the global batch. fp32: max relative difference <= 1e-5
at every step. Also: a checkpoint written on one mesh resumes on another with the losses of a run
that was never interrupted.
"""
import dataclasses

import pytest

from examples.llama import LlamaConfig
from examples.train_llama import TrainConfig, reference_losses, train
from tests import conftest
from tests.harness import run_distributed

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
        _REF[steps] = reference_losses(_cfg("", steps=steps))
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
        parse_mesh("pp=2", 2)
    with pytest.raises(SystemExit, match="needs dp_shard"):
        parse_mesh("dp_replicate=2", 2)
    assert list(parse_mesh("tp=2,dp_shard=2", 4)) == ["dp_shard", "tp"]
