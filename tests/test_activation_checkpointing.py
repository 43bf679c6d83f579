"""Activation checkpointing (full and selective) with FSDP, TP, FSDP+TP and HSDP+TP.

Oracle: the same training in one process (``examples.train_llama.reference_losses``); fp32, so
the max relative loss difference over 10 AdamW steps must stay within 1e-5 (reduction order
only). Checkpointing must not change which FSDP collectives run (the recomputation happens while
the block's parameters are gathered for its backward), and it must shrink what a block keeps for
backward (measured).
"""
import copy
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtensor_lite import Replicate, Shard
from examples.llama import LlamaConfig
from examples.train_llama import (TrainConfig, build, corpus_tokens, dp_rows, global_batch,
                                  parse_mesh, reference_losses, train, train_step,
                                  uses_loss_parallel)
from tests.harness import run_distributed

TINY = LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=16)
STEPS = 10


def _cfg(mesh, ac, steps=STEPS, **kw):
    return TrainConfig(mesh=mesh, steps=steps, batch=8, seq=16, lr=3e-3, quiet=True, model=TINY,
                       ac=ac, **kw)


def _train(cfg):
    return train(cfg)


_REF = {}


def _max_rel(losses, steps=STEPS):
    if steps not in _REF:
        # on a worker: the same device as the runs it checks (DTL_TEST_DEVICE=cuda), so the
        # same initial weights
        _REF[steps] = run_distributed(1, reference_losses, _cfg("", "none", steps=steps))[0]
    ref = _REF[steps]
    assert len(losses) == len(ref)
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref))


MESHES = [(2, "dp_shard=2"), (2, "tp=2"), (4, "dp_shard=2,tp=2"),
          (8, "dp_replicate=2,dp_shard=2,tp=2")]


@pytest.mark.parametrize("ac", ["full", "selective"])
@pytest.mark.parametrize("world,mesh", MESHES, ids=[m for _, m in MESHES])
def test_training_matches_one_process(world, mesh, ac):
    losses = run_distributed(world, _train, _cfg(mesh, ac))
    assert all(l == losses[0] for l in losses)
    assert _max_rel(losses[0]) <= 1e-5


# ---------------------------------------------------------------- every way of checkpointing
def _checkpointed(kind):
    """Wrap a block for checkpointing as ``kind`` says (module -> module)."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             checkpoint_wrapper)
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from examples.llama_parallel import matmul_saving_policy

    if kind == "reentrant":
        return functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)
    if kind == "every-other-matmul":
        return functools.partial(checkpoint_wrapper, context_fn=lambda: (
            create_selective_checkpoint_contexts(matmul_saving_policy(every=2))))
    if kind == "utils.checkpoint":  # torch.utils.checkpoint called in the parent's forward
        class Checkpointed(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, *args):
                return checkpoint(self.inner, *args, use_reentrant=False)
        return Checkpointed
    return checkpoint_wrapper


def _train_checkpointed(kind, order, steps):
    """FSDP over all ranks with blocks checkpointed before (``ac_first``) or after
    ``fully_shard``; the mean loss of every step."""
    from dtensor_lite import init_device_mesh
    from examples.llama import Llama
    from fsdp import fully_shard

    cfg = _cfg("", "none", steps=steps)
    torch.manual_seed(cfg.seed)
    model = Llama(cfg.model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    wrap = _checkpointed(kind)
    for i, block in enumerate(model.layers):
        if order == "ac_first":
            model.layers[i] = block = wrap(block)
            fully_shard(block, mesh=mesh)
        else:
            fully_shard(block, mesh=mesh)
            model.layers[i] = wrap(block)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    tokens, sizes, losses = corpus_tokens(), {"dp_shard": dist.get_world_size()}, []
    for step in range(steps):
        x, y = (dp_rows(t, mesh, sizes) for t in global_batch(tokens, step, cfg))
        loss = train_step(model, opt, x, y, False)
        dist.all_reduce(loss)
        losses.append(float(loss) / dist.get_world_size())
    return losses


KINDS = [("non-reentrant", "ac_first"), ("non-reentrant", "fsdp_first"),
         ("reentrant", "ac_first"), ("reentrant", "fsdp_first"),
         ("utils.checkpoint", "fsdp_first"), ("every-other-matmul", "ac_first")]


@pytest.mark.parametrize("kind,order", KINDS, ids=[f"{k}-{o}" for k, o in KINDS])
def test_every_checkpoint_flavour_with_fsdp(kind, order):
    """checkpoint_wrapper (non-reentrant, reentrant, selective) around a block before or after
    fully_shard, and torch.utils.checkpoint in the parent's forward: one-process losses."""
    losses = run_distributed(2, _train_checkpointed, kind, order, 3)
    assert _max_rel(losses[0], steps=3) <= 1e-5


# ---------------------------------------------------------------- no extra communication
def _step_comm(mesh_text, ac, sequence_parallel):
    """One training step (the second: prefetching knows the order by then): FSDP's flat
    collectives as (kind, bytes) in issue order, and CommDebugMode's counts of everything."""
    from dtensor_lite import collectives as C
    from dtensor_lite import init_device_mesh
    from dtensor_lite.debug import CommDebugMode

    cfg = _cfg(mesh_text, ac, steps=2, sequence_parallel=sequence_parallel)
    sizes = parse_mesh(cfg.mesh, dist.get_world_size())
    mesh = init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    model, opt = build(cfg, mesh, sizes)
    tokens, fsdp_calls = corpus_tokens(), []

    def recording(kind, fn):
        def call(out, inp, *args, **kwargs):
            fsdp_calls.append((kind, inp.numel() * inp.element_size()))
            return fn(out, inp, *args, **kwargs)
        return call
    saved = C.flat_all_gather, C.flat_reduce_scatter
    try:
        for step in range(2):
            fsdp_calls.clear()
            x, y = (dp_rows(t, mesh, sizes) for t in global_batch(tokens, step, cfg))
            C.flat_all_gather = recording("all_gather", saved[0])
            C.flat_reduce_scatter = recording("reduce_scatter", saved[1])
            with CommDebugMode() as comm:
                train_step(model, opt, x, y, uses_loss_parallel(cfg, sizes))
    finally:
        C.flat_all_gather, C.flat_reduce_scatter = saved
    return fsdp_calls, comm.get_comm_counts()


@pytest.mark.parametrize("world,mesh,sp", [(2, "dp_shard=2", False),
                                           (4, "dp_shard=2,tp=2", False),
                                           (4, "dp_shard=2,tp=2", True)],
                         ids=["fsdp", "fsdp+tp", "fsdp+tp-sp"])
def test_checkpointing_adds_no_fsdp_collective(world, mesh, sp):
    """The same all-gathers and reduce-scatters of FSDP, in the same order and sizes, with and
    without checkpointing: the recomputation runs while its block is gathered for backward.
    FSDP alone: not one collective more. With TP, the recomputed forward re-runs the block's TP
    collectives, as torch's checkpointing does (they act on activations, which were not kept)."""
    fsdp_none, counts_none = run_distributed(world, _step_comm, mesh, "none", sp)[0]
    assert fsdp_none
    for ac in ("full", "selective"):
        fsdp_calls, counts = run_distributed(world, _step_comm, mesh, ac, sp)[0]
        assert fsdp_calls == fsdp_none, ac
        if "tp" not in mesh:
            assert counts == counts_none, ac


# ---------------------------------------------------------------- the memory it saves
class _KeptBytes(TorchDispatchMode):
    """Bytes of the tensors created inside each block's forward that are still alive after the
    whole forward: what the block keeps for backward (saved tensors, selective checkpointing's
    cache), plus its output. DTensors count their local piece."""

    def __init__(self):
        super().__init__()
        self.block: int | None = None
        self.created: dict[int, list] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.block is not None:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    local = getattr(t, "_local_tensor", t)
                    self.created[self.block].append(weakref.ref(local.untyped_storage()))
        return out

    def kept(self, block: int, exclude=()) -> int:
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        live = {s.data_ptr(): s.nbytes() for r in self.created[block]
                if (s := r()) is not None and s.data_ptr() not in skip}
        return sum(live.values())


def _kept_bytes_per_block(ac):
    """Rank 0's bytes kept for backward by each block of FSDP-sharded Llama."""
    from dtensor_lite import init_device_mesh

    cfg = _cfg("dp_shard=2", ac, steps=1)
    sizes = parse_mesh(cfg.mesh, dist.get_world_size())
    mesh = init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    model, _ = build(cfg, mesh, sizes)
    x, _ = (dp_rows(t, mesh, sizes) for t in global_batch(corpus_tokens(), 0, cfg))
    tracker, outputs = _KeptBytes(), {}
    def enter(i):
        def hook(module, args):
            tracker.block = i
            tracker.created.setdefault(i, [])
        return hook

    def leave(i):
        def hook(module, args, out):
            tracker.block, outputs[i] = None, out
        return hook
    for i, block in enumerate(model.layers):
        # registered after FSDP's hooks: its all-gathers and resharding fall outside the window
        block.register_forward_pre_hook(enter(i))
        block.register_forward_hook(leave(i))
    with tracker:
        logits = model(x)
    # nor the block's shards: resharding after its forward gives each lent shard a storage of
    # its own again (fsdp.param.FSDPParam.take_back_shard), inside the measured window
    with torch.no_grad():
        kept = [tracker.kept(i, exclude=[outputs[i]] + [p.to_local() for p in block.parameters()])
                for i, block in enumerate(model.layers)]
    logits.sum().backward()
    return kept


def test_checkpointing_shrinks_what_a_block_keeps():
    """Per block, bytes kept from forward to backward: full < selective < none."""
    kept = {ac: run_distributed(2, _kept_bytes_per_block, ac)[0]
            for ac in ("none", "full", "selective")}
    print("bytes kept per block (rank 0, FSDP over 2, batch 4x16, dim 32):", kept)
    for block in range(TINY.n_layers):
        assert kept["full"][block] < kept["selective"][block] < kept["none"][block], kept
    assert kept["full"] == [0] * TINY.n_layers, kept


# ---------------------------------------------------------------- the recompute repeats the forward
# The rule: under checkpointing (full, selective, op-level policies, preserve_rng_state), the
# recompute issues the forward's aten op sequence, whatever the library warmed in between (fast
# path replays, cached decisions and plans, first-call shape exchanges, local TP linears):
# selective checkpointing replays the forward's ops by position. The library's own Python-level
# work is unseen by the user's dispatch modes (dtensor_lite/_unseen.py).
def _titan_like_policy():
    """torchtitan's default selective policy (``activation_checkpoint.mode = "selective"``, op
    mode): keep mm / attention kernels / reduce-scatter / max, every second mm recomputed,
    counted apart in the forward and the recompute."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_attention_math.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default, aten.max.default}
    meta = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == aten.mm.default:
            meta[key] += 1
        keep = func in save and not (func == aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def _titan_like_plan(model):
    """examples' sequence-parallel plan with torchtitan's residual stream: a plain local tensor
    between blocks (use_local_output=True), so every SequenceParallel / PrepareModuleInput hook
    learns its global sequence length from local pieces (a first-call exchange, then a header)."""
    from examples.llama_parallel import llama_tp_plan
    from tp import RowwiseParallel
    plan = llama_tp_plan(model, sequence_parallel=True)
    plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    for key in ("layers.*.attention.wo", "layers.*.feed_forward.w2"):
        plan[key] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def _two_d_sp_checkpointed(ac: str):
    """dp=2 x tp=2, sequence parallel (torchtitan's plan shape), every block checkpointed
    (``ac``: "full" or "selective" with the torchtitan-like policy) then fully_shard: loss and
    every gradient of two steps against one process's."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from dtensor_lite import init_device_mesh
    from examples.llama import Llama, loss_fn
    from fsdp import fully_shard
    from tp import parallelize_module

    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=16)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = Llama(cfg)
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh["tp"], _titan_like_plan(model))
    kw = {"context_fn": _titan_like_policy} if ac == "selective" else {}
    for i, block in enumerate(model.layers):
        model.layers[i] = block = checkpoint_wrapper(block, preserve_rng_state=True, **kw)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp = mesh["dp"].get_local_rank()
    worst = 0.0
    for step in range(2):
        g = torch.Generator().manual_seed(7 + step)
        tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        loss = loss_fn(model(x[2 * dp:2 * dp + 2]), y[2 * dp:2 * dp + 2])
        loss.backward()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())
        worst = max(worst, abs(mean.item() / 2 - ref_loss.item()) / abs(ref_loss.item()))
        ref_grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad
                     for n, p in ref.named_parameters()}
        for name, p in model.named_parameters():
            name = name.replace("_checkpoint_wrapped_module.", "")
            # fully_shard averages over dp: the mean of the two halves' losses, as ref's
            torch.testing.assert_close(p.grad.full_tensor(), ref_grads[name], rtol=1e-4,
                                       atol=1e-6, msg=lambda e: f"step {step} {name}: {e}")
        model.zero_grad()
        ref.zero_grad()
    return worst


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_2d_sequence_parallel_checkpointing_matches_one_process(ac):
    worst = run_distributed(4, _two_d_sp_checkpointed, ac)
    assert max(worst) <= 1e-5, worst


class _Recorder(TorchDispatchMode):
    """The aten ops a pass issues (those selective checkpointing replays by position)."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.checkpoint import SAC_IGNORED_OPS
        if func not in SAC_IGNORED_OPS:  # detach / metadata ops: selective ignores them too
            self.log.append(str(func))
        return func(*args, **(kwargs or {}))


def _recompute_repeats_forward(kind: str):
    """A sequence-parallel block on uneven local pieces (7 positions over 2 ranks), run for the
    first time under checkpointing: its hooks learn the global length from the pieces (a shape
    exchange now, a header riding the data once warm, and the recompute is warm). The op
    sequences the forward and the recompute issue, and the input gradient against one process."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    from dtensor_lite import DTensor, init_device_mesh
    from tp import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 12), torch.nn.GELU(),
                              torch.nn.Linear(12, 8))
    blk = parallelize_module(copy.deepcopy(ref), mesh, {
        "0": SequenceParallel(), "1": ColwiseParallel(input_layouts=Shard(1)),
        "3": RowwiseParallel(output_layouts=Shard(1))})
    whole = torch.randn(2, 7, 8)
    rank = dist.get_rank()
    x = whole[:, :4].clone() if rank == 0 else whole[:, 4:].clone()
    x.requires_grad_(True)
    fwd, rec = [], []
    with set_checkpoint_early_stop(False):  # the whole recompute, to compare whole sequences
        y = checkpoint(blk, x, use_reentrant=False, preserve_rng_state=True,
                       context_fn=lambda: (_Recorder(fwd), _Recorder(rec)))
        y = y.to_local() if isinstance(y, DTensor) else y
        (y * y).sum().backward()
    wx = whole.clone().requires_grad_(True)
    (ref(wx) ** 2).sum().backward()
    mine = wx.grad[:, :4] if rank == 0 else wx.grad[:, 4:]
    torch.testing.assert_close(x.grad, mine, rtol=1e-4, atol=1e-6)
    return fwd, rec


def test_recompute_issues_the_forwards_ops_on_first_call():
    for fwd, rec in run_distributed(2, _recompute_repeats_forward, "record"):
        assert fwd and fwd == rec, (fwd, rec)
