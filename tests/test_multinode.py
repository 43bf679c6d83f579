"""The main example launched as two torchrun "nodes" on this machine (2 processes each, c10d
rendezvous on a free local port): data parallelism across the nodes, tensor parallelism within
each, training to the losses of one process (the parity every single-node mesh is held to)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from examples.train_llama import TrainConfig, reference_losses

REPO = Path(__file__).resolve().parents[1]
STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(rank: int, port: int, losses: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
           str(rank), "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"localhost:{port}", "--rdzv-conf", f"is_host={int(rank == 0)}",
           "--rdzv-id", f"dtl-{port}", "examples/train_llama.py", "--mesh", "dp_shard=2,tp=2",
           "--steps", str(STEPS), "--batch", "8", "--seq", "16", "--quiet", "--losses",
           str(losses)]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               TORCH_CPP_LOG_LEVEL="ERROR", CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_two_node_launch_trains_at_parity(tmp_path):
    port = _free_port()
    losses = tmp_path / "losses.json"
    nodes = [_node(rank, port, losses) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:  # never leave a node waiting at the rendezvous
            if node.poll() is None:
                node.kill()
                node.communicate()
    for rank, (node, out) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node {rank} failed:\n{out[-4000:]}"
    got = json.loads(losses.read_text())
    cfg = TrainConfig(steps=STEPS, batch=8, seq=16)
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, cfg.seq)
    want = reference_losses(cfg)
    assert len(got) == STEPS
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5, (got, want)
