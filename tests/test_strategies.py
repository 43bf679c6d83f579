"""The strategies of examples/strategies/ train exactly like one process, with the communication
their docstrings promise (world 4; a batch of 30 rows is sharded 8, 8, 8, 6).

Every rank trains the strategy on its rows and, beside it, a plain-torch copy of the same model on
the whole batch (the oracle). fp32 throughout: the only difference is the order in which the
per-rank partial gradients are summed, a few ulps per step, so losses and parameters agree to
rtol 1e-5 after 5 AdamW steps.
"""
import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

from dtensor_lite import Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.debug import CommDebugMode
from examples.strategies.ddp import DataParallel
from examples.strategies.zero import ZeroOptimizer
from tests.harness import distributed

STEPS, ROWS, DIM, HIDDEN, LR = 5, 30, 6, 11, 1e-2


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.GELU(),
                               torch.nn.Linear(HIDDEN, DIM))


def _batches(n):
    torch.manual_seed(1)
    return [torch.randn(ROWS, DIM) for _ in range(n)]


def _loss(model, x):
    return (model(x) - x).pow(2).mean()


def _replicate_params(model, mesh):
    for sub in model.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            sub.register_parameter(name, torch.nn.Parameter(
                distribute_tensor(p.detach(), mesh, [Replicate()])))
    return model


def _assert_params_equal(model, reference):
    for p, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), ref.detach(), rtol=1e-5, atol=1e-6)


@distributed(world_size=4)
def test_ddp_with_accumulation_matches_one_process():
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    reference = _model()
    model = DataParallel(copy.deepcopy(reference), mesh, bucket_mb=80 * 4 / 2**20)
    assert len(model.buckets) > 1  # several buckets, so bucketing itself is exercised
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    batches = _batches(2 * STEPS)
    for step in range(STEPS):
        micro = batches[2 * step: 2 * step + 2]
        sharded = [distribute_tensor(x, mesh, [Shard(0)]) for x in micro]
        with CommDebugMode() as comm:
            for i, x in enumerate(sharded):
                with model.no_sync() if i == 0 else contextlib.nullcontext():
                    loss = _loss(model, x) / 2
                    loss.backward()
        # accumulation costs nothing: one all-reduce per bucket, after the last micro-batch
        assert comm.get_comm_counts() == {"all_reduce": len(model.buckets)}, comm.get_comm_counts()
        assert all(p.grad.placements == (Replicate(),) for p in model.parameters())
        opt.step()
        opt.zero_grad()
        ref_loss = sum(_loss(reference, x) / 2 for x in micro)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _assert_params_equal(model.module, reference)


def _train_zero(stage):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    reference = _model()
    model = _replicate_params(copy.deepcopy(reference), mesh)
    opt = ZeroOptimizer(model.parameters(), mesh, torch.optim.AdamW, stage=stage, lr=LR)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    numel = sum(p.numel() for p in reference.parameters())  # 149: uneven over 4 ranks
    counts = []
    for x in _batches(STEPS):
        sharded = distribute_tensor(x, mesh, [Shard(0)])
        with CommDebugMode() as comm:
            loss = _loss(model, sharded)
            loss.backward()
            opt.step()
            opt.zero_grad()
        counts.append(comm.get_comm_counts())
        ref_loss = _loss(reference, x)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), rtol=1e-5, atol=0)
    _assert_params_equal(model, reference)
    # optimizer state is sharded: each rank keeps moments for its slice only
    state = opt.optimizer.state[opt.shard]
    assert state["exp_avg"].placements == (Shard(0),)
    assert state["exp_avg"].to_local().numel() < numel
    return counts


@distributed(world_size=4)
def test_zero2_reduce_scatters_gradients_and_gathers_params_once():
    counts = _train_zero(stage=2)
    assert counts == [{"reduce_scatter": 1, "all_gather": 1}] * STEPS, counts


@distributed(world_size=4)
def test_zero1_all_reduces_gradients_and_gathers_params_once():
    counts = _train_zero(stage=1)
    assert counts == [{"all_reduce": 1, "all_gather": 1}] * STEPS, counts


def _mlp3():
    # the last weight is (2, 8): 2 rows over 4 ranks are pieces 1, 1, 0, 0 (padded to 1 each)
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.GELU(),
                               torch.nn.Linear(HIDDEN, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))


@distributed(world_size=4)
def test_zero_per_parameter_moves_each_parameter_with_one_collective_each_way():
    """ZeRO written per parameter: optimizer state Shard(0) per parameter, each Partial gradient
    redistributed to Shard(0) (a reduce-scatter), AdamW on the pieces, each parameter gathered
    back to Replicate() (an all-gather). 6 parameters: exactly 6 + 6 collectives. The (2, 8)
    weight used to take two collectives each way (a reduce-scatter on dim 1 plus an all-to-all,
    an all-to-all plus an all-gather on dim 1): fewer padded bytes, one more collective's
    latency; the planner now charges each collective for it."""
    mesh = init_device_mesh("cpu", (4,))
    reference = _mlp3()
    model = _replicate_params(copy.deepcopy(reference), mesh)
    params = list(model.parameters())
    pieces = [torch.nn.Parameter(p.detach().redistribute(mesh, [Shard(0)])) for p in params]
    opt = torch.optim.AdamW(pieces, lr=LR)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    torch.manual_seed(1)
    for _ in range(STEPS):
        x, target = torch.randn(ROWS, DIM), torch.randn(ROWS, 2)
        loss = (model(distribute_tensor(x, mesh, [Shard(0)])) -
                distribute_tensor(target, mesh, [Shard(0)])).pow(2).mean()
        loss.backward()
        with CommDebugMode() as comm:
            for p, piece in zip(params, pieces):
                piece.grad = p.grad.redistribute(mesh, [Shard(0)])
            opt.step()
            with torch.no_grad():
                for p, piece in zip(params, pieces):
                    p.to_local().copy_(piece.detach().redistribute(mesh, [Replicate()]).to_local())
        assert comm.get_comm_counts() == {"reduce_scatter": 6, "all_gather": 6}, \
            comm.get_comm_counts_by_op()
        assert set(comm.get_comm_counts_by_op()) == {"redistribute"}
        for p in params:
            p.grad = None
        ref_loss = (reference(x) - target).pow(2).mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), rtol=1e-5, atol=0)
    _assert_params_equal(model, reference)
    assert all(opt.state[piece]["exp_avg"].placements == (Shard(0),) for piece in pieces)

# ------------------------------------------------------------------ CommDebugMode by op
@distributed(world_size=4)
def test_comm_debug_mode_names_the_op_and_input_behind_each_collective():
    """Each collective is attributed to what caused it: an aten op and the input its rule moved,
    an op without a rule gathering an input, an explicit redistribute (and its backward), FSDP's
    hooks. ``table()`` has a column for it."""
    import io
    import warnings

    import rich.console

    from dtensor_lite.debug import FallbackRedistributeWarning
    from fsdp import fully_shard

    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    a, b = torch.randn(7, 6), torch.randn(6, 5)
    x = distribute_tensor(a, mesh, [Shard(0)]).requires_grad_()
    w = distribute_tensor(b, mesh, [Shard(0)]).requires_grad_()
    with CommDebugMode() as comm, warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackRedistributeWarning)
        y = torch.mm(x, w)              # x's rows -> columns (all_to_all): y is Partial
        whole = y.redistribute(mesh, [Replicate()])              # explicit: all_reduce
        whole.sum().backward()                                   # nothing moves
        torch.trace(x.detach()[:6])                              # no rule: input 0 gathered
    torch.testing.assert_close(whole.to_local(), a @ b)
    assert comm.get_comm_counts_by_op(by_input=True) == {
        ("aten.mm.default", 0): {"all_to_all": 1},
        ("redistribute", None): {"all_reduce": 1},
        ("aten.trace.default", 0): {"all_gather": 1}}
    ops = comm.get_comm_counts_by_op()
    assert ops["aten.mm.default"] == {"all_to_all": 1}
    assert [r.op for r in comm.records] == ["aten.mm.default", "redistribute", "aten.trace.default"]
    assert comm.records[0].input == 0 and comm.records[0].kind == "all_to_all"
    out = io.StringIO()
    rich.console.Console(file=out, width=120).print(comm.table())
    assert "caused by" in out.getvalue() and "aten.mm.default" in out.getvalue()

    model = torch.nn.Linear(6, 4)
    fully_shard(model, mesh=mesh)
    with CommDebugMode() as comm:
        model(torch.randn(3, 6)).sum().backward()
    assert comm.get_comm_counts_by_op() == {"fsdp.all_gather": {"all_gather": 1},
                                            "fsdp.reduce_scatter": {"reduce_scatter": 1}}


# ----------------------------------------------------------------------------- ring attention
def _track_received(module, name):
    """Wrap ``module.name`` (a ring_shift) to count the received tensors alive at any time."""
    import weakref
    real, state = getattr(module, name), {"live": 0, "peak": 0, "numels": []}

    def freed():
        state["live"] -= 1

    def note(t):
        state["live"] += 1
        state["peak"] = max(state["peak"], state["live"])
        state["numels"].append(t.numel())
        weakref.finalize(t, freed)
        return t

    def tracked(*args, async_op=False, **kwargs):
        got = real(*args, async_op=async_op, **kwargs)
        return got.then(note) if async_op else note(got)
    setattr(module, name, tracked)
    return state, lambda: setattr(module, name, real)


@distributed(world_size=4)
@pytest.mark.parametrize("seq, causal", [(13, True), (3, True), (13, False)])
def test_ring_attention_matches_sdpa_with_only_ring_shifts(seq, causal):
    """13 positions over 4 ranks: 4, 4, 4, 1 (3: one rank holds none). fp32; the merge by
    log-sum-exp reorders sums, a few ulps: rtol 1e-5."""
    import examples.strategies.ring_attention as ra
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    batch, heads, head_dim = 2, 3, 8
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, requires_grad=True) for _ in range(3))
    dout = torch.randn(batch, heads, seq, head_dim)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ref.backward(dout)
    qd, kd, vd = (distribute_tensor(t.detach(), mesh, [Shard(2)]).requires_grad_()
                  for t in (q, k, v))
    dout_d = distribute_tensor(dout, mesh, [Shard(2)])
    state, restore = _track_received(ra, "ring_shift")
    try:
        with CommDebugMode() as comm:
            out = ra.ring_attention(qd, kd, vd, "cp", causal=causal)
            held_after_forward = state["live"]
            forward_peak = state["peak"]
            out.backward(dout_d)
    finally:
        restore()
    for got, want in ((out, ref), (qd.grad, q.grad), (kd.grad, k.grad), (vd.grad, v.grad)):
        assert got.placements == (Shard(2),)
        torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=1e-5, atol=1e-6)
    # only ring shifts: n-1 k/v shifts forward; backward n-1 k/v shifts + n gradient shifts
    assert comm.get_comm_counts() == {"ring_shift": 3 + 3 + 4}, comm.get_comm_counts()
    block = 2 * batch * heads * -(-seq // 4) * head_dim  # one stacked k/v block, the largest
    assert max(state["numels"]) <= block and max(c[1] for c in comm.calls) <= block * 4
    # nothing received is kept for backward; at most the current and incoming block (forward),
    # plus one gradient block (backward) are alive at once
    assert held_after_forward == 0 and forward_peak <= 2 and state["peak"] <= 3, state


@distributed(world_size=4)
def test_ring_attention_rejects_unsharded_or_mismatched_inputs():
    from examples.strategies.ring_attention import ring_attention
    mesh = init_device_mesh("cpu", (4,))
    x = torch.randn(1, 2, 8, 4)
    s, r = distribute_tensor(x, mesh, [Shard(2)]), distribute_tensor(x, mesh, [Replicate()])
    with pytest.raises(ValueError, match=r"sharded along the sequence \(Shard\(2\)\)"):
        ring_attention(r, r, r)
    with pytest.raises(ValueError, match="laid out alike"):
        ring_attention(s, s, distribute_tensor(x, mesh, [Shard(1)]))


# ----------------------------------------------------------------------------- expert parallelism
@distributed(world_size=4)
@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (7, 1), (6, 2)])
def test_moe_matches_one_process_and_sends_exactly_the_routed_tokens(num_experts, top_k):
    """30 tokens (8, 8, 8, 6 per rank) routed to experts sharded 2/2/2/2, 2/2/2/1 or 2/2/2/0
    per rank; fp32, the experts' matmuls see their rows grouped differently: rtol 1e-5."""
    from examples.strategies.moe import ExpertParallelMoE, reference_moe
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    hidden, me = 8, dist.get_rank()
    torch.manual_seed(0)
    moe = ExpertParallelMoE(hidden, 12, num_experts, mesh, top_k=top_k)
    x, dout = torch.randn(ROWS, hidden), torch.randn(ROWS, hidden)
    params = [moe.router, moe.w1, moe.w2]
    refs = [p.full_tensor().detach().requires_grad_() for p in params]
    x_ref = x.clone().requires_grad_()
    xd = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    dout_d = distribute_tensor(dout, mesh, [Shard(0)])
    with CommDebugMode() as comm:
        out = moe(xd)
        out.backward(dout_d)
    ref = reference_moe(x_ref, *refs, top_k)
    ref.backward(dout)
    torch.testing.assert_close(out.full_tensor(), ref.detach(), rtol=1e-5, atol=1e-6)
    for got, want in zip([xd] + params, [x_ref] + refs):
        torch.testing.assert_close(got.grad.full_tensor(), want.grad, rtol=1e-5, atol=1e-6)
    # exactly the routed (token, expert) rows that change rank travel, each way, unpadded
    owner = torch.arange(4).repeat_interleave(torch.tensor(moe.experts_per_rank))
    chosen = (x @ refs[0].detach().T).topk(top_k, dim=-1).indices
    token_rank = torch.arange(4).repeat_interleave(torch.tensor([8, 8, 8, 6]))
    assert len(set(torch.bincount(chosen.reshape(-1)).tolist())) > 1  # uneven load per expert
    dest = owner[chosen]                                   # [tokens, top_k]
    home = token_rank.unsqueeze(-1).expand_as(dest)
    sent = int(((home == me) & (dest != me)).sum())
    received = int(((dest == me) & (home != me)).sum())
    row, counts = hidden * 4, (num_experts - moe.experts_per_rank[me]) * 8
    assert comm.get_comm_counts() == {"all_to_all": 5}, comm.get_comm_counts()
    # forward: per-expert counts, dispatch, combine; backward: combine's, then dispatch's reverse
    assert [c[1] for c in comm.calls] == [counts, sent * row, received * row, sent * row,
                                          received * row]


@distributed(world_size=4)
def test_moe_rejects_a_bad_top_k():
    from examples.strategies.moe import ExpertParallelMoE
    mesh = init_device_mesh("cpu", (4,))
    with pytest.raises(ValueError, match="top_k=5 must be between 1 and num_experts=4"):
        ExpertParallelMoE(8, 12, 4, mesh, top_k=5)


def test_set_rule_refuses_a_second_rule_unless_override():
    """A later registration for an op that has a rule raises instead of silently replacing it
    (import order would decide which rule runs); override=True replaces it on purpose."""
    from dtensor_lite.ops import _registry
    op = torch.ops.aten.mv.default
    library_rule = _registry.get_rule(op)

    def other(call):
        return library_rule(call)
    with pytest.raises(ValueError, match=r"aten\.mv\.default already has the rule .*override=True"):
        _registry.register_rule(op)(other)
    assert _registry.get_rule(op) is library_rule
    _registry.set_rule(op, library_rule)  # the same rule again is no change: accepted
    try:
        _registry.set_rule(op, other, override=True)
        assert _registry.get_rule(op) is other
    finally:
        _registry.set_rule(op, library_rule, override=True)
