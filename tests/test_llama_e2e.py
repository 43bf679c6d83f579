"""End to end: a Llama-style model on DTensor inputs (batch- or sequence-sharded) with replicated
parameters trains exactly like plain single-process torch: same loss, same gradients, and AdamW
keeps the parameters equal."""
import copy

import pytest
import torch

from dtensor_lite import Replicate, Shard, distribute_module, distribute_tensor, init_device_mesh
from examples.llama import Llama, LlamaConfig, loss_fn
from tests.harness import distributed

CASES = {
    "batch, 1-D": ((4,), [Shard(0)]),
    "sequence, 1-D": ((4,), [Shard(1)]),
    "batch x sequence, 2-D": ((2, 2), [Shard(0), Shard(1)]),
    "uneven batch, 1-D": ((4,), [Shard(0)]),
}


@distributed(world_size=4, timeout=300)
@pytest.mark.parametrize("case", list(CASES))
def test_llama_matches_single_process(case):
    mesh_shape, placements = CASES[case]
    mesh = init_device_mesh("cpu", mesh_shape)
    cfg = LlamaConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=16)
    torch.manual_seed(0)
    ref = Llama(cfg)
    model = distribute_module(copy.deepcopy(ref), mesh)
    batch = 6 if case.startswith("uneven") else 8  # 6 rows on 4 ranks: pieces of 2, 2, 2, 0
    tokens = torch.randint(0, cfg.vocab_size, (batch, 13))
    inputs = distribute_tensor(tokens[:, :-1], mesh, placements)
    targets = distribute_tensor(tokens[:, 1:], mesh, placements)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        ref_loss = loss_fn(ref(tokens[:, :-1]), tokens[:, 1:])
        loss = loss_fn(model(inputs), targets)
        torch.testing.assert_close(loss.full_tensor(), ref_loss, rtol=1e-5, atol=1e-6)
        ref_loss.backward()
        loss.backward()
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"step {step} grad of {name}: {m}")
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert p.placements == (Replicate(),) * mesh.ndim
        # AdamW divides by sqrt(v): last-bit gradient differences grow to ~1e-5 in 3 steps
        torch.testing.assert_close(p.full_tensor(), p_ref, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"parameter {name}: {m}")
