"""Relayout between two separately launched jobs (``dtensor_lite.jobs``): a trainer job of 4
processes and an engine job of 2, each launched by its own ``torchrun`` subprocess
(examples/rl_weight_sync.py ``--trainer-job`` / ``--engine-job``), joined through a rendezvous
address. After each of 3 training steps the engine's fused buffers ([q_r; k_r; v_r],
[gate_r; up_r] per TP rank) equal the trained weights' pieces bit for bit (bf16), and in fp32
its greedy tokens equal one process's with the trained weights. The engine job killed from
outside (SIGKILL, every process) mid-sync makes the trainer raise within the bound, naming the
engine job, and leaves no process; two jobs built for different
models both raise a clear error; a trainer whose engine never comes raises naming it."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "rl_weight_sync.py"
sys.path.insert(0, str(REPO))

from examples.llama import Llama, LlamaConfig  # noqa: E402
from examples.rl_two_jobs import PROMPT  # noqa: E402

BOUND = 30.0  # --timeout given to both jobs: the most either waits for the other


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(flag: str, n: int, address: str, out: Path, *extra) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", str(EXAMPLE), flag, address, "--out", str(out),
           "--timeout", str(BOUND), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, limit: float) -> tuple[int, str, float]:
    """(exit code, output, seconds it took from now); killed (and failed) past ``limit``."""
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"a job did not end within {limit} s:\n{out[-4000:]}")
    return proc.returncode, out, time.monotonic() - start


def _engine_pieces(trained: dict, rank: int, tp: int, layers: int) -> dict:
    """What engine TP rank ``rank`` must hold: the trained weights' pieces in its layout."""
    out = {}
    for name in ("tok_embeddings.weight", "norm.weight", "output.weight"):
        out[name] = trained[name]
    for i in range(layers):
        p = f"layers.{i}."
        a, f = p + "attention.", p + "feed_forward."
        out[a + "qkv.weight"] = torch.cat([trained[a + w].chunk(tp)[rank]
                                           for w in ("wq.weight", "wk.weight", "wv.weight")])
        out[a + "wo.weight"] = trained[a + "wo.weight"].chunk(tp, dim=1)[rank]
        out[f + "gate_up.weight"] = torch.cat([trained[f + w].chunk(tp)[rank]
                                               for w in ("w1.weight", "w3.weight")])
        out[f + "w2.weight"] = trained[f + "w2.weight"].chunk(tp, dim=1)[rank]
        for norm in ("attention_norm.weight", "ffn_norm.weight"):
            out[p + norm] = trained[p + norm]
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_trainer_job_4_syncs_engine_job_2_after_each_of_3_steps(tmp_path, dtype):
    address = f"127.0.0.1:{_free_port()}"
    trainer = _launch("--trainer-job", 4, address, tmp_path, "--dtype", dtype)
    engine = _launch("--engine-job", 2, address, tmp_path, "--dtype", dtype)
    rc_e, out_e, _ = _finish(engine, 600)
    rc_t, out_t, _ = _finish(trainer, 120)
    assert rc_t == 0 and rc_e == 0, f"trainer:\n{out_t[-3000:]}\nengine:\n{out_e[-3000:]}"
    assert "busiest sender" in out_t  # the plan's dry run, printed by the trainer
    cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                      max_seq_len=64)
    torch_dtype = getattr(torch, dtype)
    for step in range(3):
        trained = torch.load(tmp_path / f"trained_{step}.pt")
        for rank in range(2):
            held = torch.load(tmp_path / f"engine_{step}_rank{rank}.pt")
            want = _engine_pieces(trained, rank, 2, cfg.n_layers)
            assert held.keys() == want.keys()
            for name, w in want.items():
                assert torch.equal(held[name], w.to(torch_dtype)), (step, rank, name)
        if dtype == "float32":  # one process with the trained weights generates the same
            oracle = Llama(cfg)
            oracle.load_state_dict(trained)
            tokens = PROMPT.clone()
            with torch.no_grad():
                for _ in range(8):
                    nxt = oracle(tokens)[:, -1].argmax(-1, keepdim=True)
                    tokens = torch.cat([tokens, nxt], dim=1)
            got = json.loads((tmp_path / f"tokens_{step}.json").read_text())
            assert got == tokens[:, PROMPT.shape[1]:].tolist(), step


def _job_processes(pid: int) -> list[int]:
    """``pid`` (a torchrun) and every process under it (its workers), from /proc."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return tree


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_engine_job_killed_mid_sync_makes_the_trainer_raise_within_the_bound(tmp_path):
    """The engine job (2 processes, its own torchrun and session) pauses in its second sync
    after one bucket (a 16 KiB bucket: the sync takes several) and says so in a file per rank;
    the test then SIGKILLs every process of that job from outside. The trainer job (2
    processes: what this shows needs no more) raises JobLinkError naming the engine job within
    the bound, and no process of either job is left."""
    address = f"127.0.0.1:{_free_port()}"
    trainer = _launch("--trainer-job", 2, address, tmp_path)
    engine = _launch("--engine-job", 2, address, tmp_path, "--pause-mid-sync", "1",
                     "--bucket-kb", "16")
    markers = [tmp_path / f"engine_mid_sync_rank{r}.pid" for r in range(2)]
    deadline = time.monotonic() + 600
    while not all(m.exists() for m in markers):  # both engine ranks are mid-sync
        for name, job in (("trainer", trainer), ("engine", engine)):
            if job.poll() is not None:
                pytest.fail(f"the {name} job ended before the engine was mid-sync:\n"
                            f"{job.communicate()[0][-3000:]}")
        if time.monotonic() > deadline:
            for job in (trainer, engine):
                for pid in _job_processes(job.pid):
                    os.kill(pid, signal.SIGKILL)
            pytest.fail("the engine was not mid-sync within 600 s")
        time.sleep(0.05)  # polling a file: how often, not how long, it waits
    assert (tmp_path / "trained_0.pt").exists() and not (tmp_path / "trained_1.pt").exists()
    engine_job = _job_processes(engine.pid)
    assert {int(m.read_text()) for m in markers} <= set(engine_job)
    trainer_job = _job_processes(trainer.pid)
    killed_at = time.monotonic()
    for pid in engine_job:
        os.kill(pid, signal.SIGKILL)
    rc_t, out_t, _ = _finish(trainer, BOUND + 60)
    after = time.monotonic() - killed_at
    engine.wait()
    print(f"the trainer job ended {after:.1f} s after the engine job was killed:\n"
          + "\n".join(line for line in out_t.splitlines() if "JobLinkError" in line)[:1500])
    assert rc_t != 0
    assert "JobLinkError" in out_t and "the engine job (joint ranks 2-3) died" in out_t, \
        out_t[-3000:]
    assert after < BOUND + 60
    left = [pid for pid in engine_job + trainer_job if _alive(pid)]
    assert not left, f"processes left: {left}"


def test_jobs_built_for_different_models_both_raise(tmp_path):
    address = f"127.0.0.1:{_free_port()}"
    # the smallest jobs that show it (2 + 1 processes: each start costs seconds on a small box)
    trainer = _launch("--trainer-job", 2, address, tmp_path)
    engine = _launch("--engine-job", 1, address, tmp_path, "--ffn", "96")
    rc_e, out_e, _ = _finish(engine, 600)
    rc_t, out_t, _ = _finish(trainer, 120)
    assert rc_t != 0 and rc_e != 0
    for side, out in (("trainer", out_t), ("engine", out_e)):
        assert f"relayout across jobs ({side} side;" in out, out[-3000:]
        assert "gate_up.weight' has 192 rows" in out and "the sizes must add up" in out, \
            out[-3000:]


def test_a_trainer_whose_engine_never_comes_raises_naming_it(tmp_path):
    address = f"127.0.0.1:{_free_port()}"
    trainer = _launch("--trainer-job", 1, address, tmp_path, "--timeout", "5")
    rc, out, _ = _finish(trainer, 180)
    assert rc != 0
    assert "JobLinkError" in out and "the engine job did not connect within 5 s" in out, out[-3000:]
