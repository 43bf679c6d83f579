"""What one FSDP step communicates and holds, checked against the formulas of docs/fsdp.md.

Per parameter group g on a shard dim of S ranks, C_g = sum over its parameters of
ceil(rows / S) * row_numel (the padded per-rank chunk, in elements):

* forward:  one all-gather per group, (S - 1) * C_g * itemsize bytes sent per rank
* backward: one all-gather per non-root group (the root keeps its parameters), same bytes;
            with reshard_after_forward=N it runs within N ranks: (N - 1) * (S * C_g / N) * itemsize
* backward: one reduce-scatter per group, (S - 1) * C_g(trainable) * itemsize
* HSDP:     plus one all-reduce per group across the R replicas,
            2 * (R - 1) * ceil(C_g(trainable) / R) * itemsize
"""
import gc
import math
import weakref

import pytest
import torch
import torch.distributed as dist

from dtensor_lite.debug import CommDebugMode
from dtensor_lite.spec import chunk_range
from examples.llama import Llama, loss_fn
from tests.harness import distributed
from tests.test_fsdp import CFG, batches, make_mesh, my_rows, shard_llama

F32 = 4


def chunk_elems(params, shard):
    return sum(math.ceil(p.shape[0] / shard) * (p.numel() // p.shape[0]) for p in params)


def groups_of(model):
    """[root params, block 0 params, ...] with global shapes (DTensor parameters)."""
    blocks = [list(b.parameters()) for b in model.layers]
    in_blocks = {id(p) for ps in blocks for p in ps}
    return [[p for p in model.parameters() if id(p) not in in_blocks]] + blocks


def one_step_comm(model, tokens):
    mine = my_rows(tokens)
    with CommDebugMode() as fwd:
        loss = loss_fn(model(mine[:, :-1]), mine[:, 1:])
    with CommDebugMode() as bwd:
        loss.backward()
    return fwd, bwd


def calls(mode, kind):
    return [c for c in mode.calls if c[0] == kind]


@distributed(world_size=4)
@pytest.mark.parametrize("raf", [True, False, 2], ids=lambda v: f"raf={v}")
def test_one_step_collectives_and_bytes(raf):
    torch.manual_seed(0)
    S = 4
    model = shard_llama(Llama(CFG), make_mesh((S,)), reshard_after_forward=raf)
    groups = groups_of(model)
    n_blocks = len(groups) - 1
    for step in range(2):  # the second step runs with the implicit prefetch order in place
        fwd, bwd = one_step_comm(model, batches(1)[0])
        model.zero_grad()
    chunks = [chunk_elems(g, S) for g in groups]

    # forward: exactly one all-gather per group, nothing else
    assert fwd.get_comm_counts() == {"all_gather": 1 + n_blocks}
    assert fwd.get_comm_bytes()["all_gather"] == sum((S - 1) * c * F32 for c in chunks)
    # backward: one reduce-scatter per group; all-gathers only for resharded blocks
    bwd_ag = calls(bwd, "all_gather")
    if raf is False:
        assert bwd_ag == []
    elif raf is True:
        assert sorted(c[1] for c in bwd_ag) == sorted((S - 1) * c * F32 for c in chunks[1:])
        assert all(c[2] == S for c in bwd_ag)
    else:  # within groups of 2 ranks, from the 1/2 piece each kept after forward
        assert sorted(c[1] for c in bwd_ag) == sorted((raf - 1) * (S * c // raf) * F32
                                                      for c in chunks[1:])
        assert all(c[2] == raf for c in bwd_ag)
    assert bwd.get_comm_counts()["reduce_scatter"] == 1 + n_blocks
    assert bwd.get_comm_bytes()["reduce_scatter"] == sum((S - 1) * c * F32 for c in chunks)
    assert set(bwd.get_comm_counts()) <= {"all_gather", "reduce_scatter"}


@distributed(world_size=4)
def test_hsdp_one_step_collectives_and_bytes():
    torch.manual_seed(0)
    R, S = 2, 2
    model = shard_llama(Llama(CFG), make_mesh((R, S)))
    chunks = [chunk_elems(g, S) for g in groups_of(model)]
    fwd, bwd = one_step_comm(model, batches(1)[0])
    assert fwd.get_comm_counts() == {"all_gather": len(chunks)}
    assert fwd.get_comm_bytes()["all_gather"] == sum((S - 1) * c * F32 for c in chunks)
    assert bwd.get_comm_counts() == {"all_gather": len(chunks) - 1,
                                     "reduce_scatter": len(chunks), "all_reduce": len(chunks)}
    assert bwd.get_comm_bytes()["reduce_scatter"] == sum((S - 1) * c * F32 for c in chunks)
    assert bwd.get_comm_bytes()["all_reduce"] == sum(
        2 * (R - 1) * math.ceil(c / R) * F32 for c in chunks)
    assert all(c[2] == S for c in bwd.calls if c[0] != "all_reduce")
    assert all(c[2] == R for c in bwd.calls if c[0] == "all_reduce")


@distributed(world_size=4)
def test_frozen_params_send_no_gradient_bytes():
    torch.manual_seed(0)
    S = 4
    model = Llama(CFG)
    frozen = [model.layers[0].attention.wq.weight, model.layers[0].attention_norm.weight]
    for p in frozen:
        p.requires_grad_(False)
    shard_llama(model, make_mesh((S,)))
    groups = groups_of(model)
    _, bwd = one_step_comm(model, batches(1)[0])
    trainable = [[p for p in g if p.requires_grad] for g in groups]
    assert bwd.get_comm_bytes()["reduce_scatter"] == sum(
        (S - 1) * chunk_elems(g, S) * F32 for g in trainable)
    assert all(p.grad is None for p in model.layers[0].parameters() if not p.requires_grad)


@distributed(world_size=4)
def test_gradient_accumulation_without_sync_communicates_nothing_in_backward():
    torch.manual_seed(0)
    model = shard_llama(Llama(CFG), make_mesh((4,)), reshard_after_forward=False)
    model.set_requires_gradient_sync(False)
    fwd, bwd = one_step_comm(model, batches(1)[0])
    assert bwd.get_comm_counts() == {}
    assert all(p.grad is None for p in model.parameters())
    model.set_requires_gradient_sync(True)
    fwd, bwd = one_step_comm(model, batches(1)[0])
    assert bwd.get_comm_counts() == {"reduce_scatter": 1 + len(model.layers)}


@distributed(world_size=4)
def test_sharded_storage_and_no_unsharded_param_left_after_step():
    torch.manual_seed(0)
    S = 4
    model = Llama(CFG)
    full_bytes = sum(p.numel() * F32 for p in model.parameters())
    shard_llama(model, make_mesh((S,)))
    rank = dist.get_rank()
    # per-rank storage: exactly this rank's torch.chunk piece of every parameter
    expected = sum(chunk_range(p.shape[0], S, rank)[1] * (p.numel() // p.shape[0]) * F32
                   for p in model.parameters())
    held = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
    assert held == expected < full_bytes / (S - 1)
    # catch every unsharded tensor that a forward publishes
    seen, unsharded_seen = [], []
    for m in model.modules():
        def grab(mod, args, out):
            for p in mod._parameters.values():
                if p is None:
                    continue
                seen.append(weakref.ref(p))
                unsharded_seen.append(not hasattr(p, "_spec"))
        m.register_forward_hook(grab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for tokens in batches(2):
        mine = my_rows(tokens)
        loss_fn(model(mine[:, :-1]), mine[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    gc.collect()
    assert sum(unsharded_seen) >= len(list(model.parameters()))  # the check below is not vacuous
    alive = [r() for r in seen if r() is not None]
    assert all(isinstance(t, torch.nn.Parameter) and t.is_leaf and hasattr(t, "_spec")
               for t in alive), "an unsharded parameter outlived the step"
    for m in model.modules():
        state = m.__dict__.get("_fsdp_state")
        if state is not None and state.group is not None:
            assert state.group.unsharded_nbytes() == 0


def _peak_allocated_while(fn) -> int:
    """The highest net bytes the CPU allocator handed out (on any thread) while ``fn`` ran."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.memory import allocation_timeline, peaks
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return peaks(allocation_timeline(prof))["step"]


@distributed(world_size=4)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("in_place", [True, False], ids=["slot", "separate-input"])
def test_flat_collectives_values_and_nothing_held_in_flight(dtype, in_place):
    """FSDP's flat all-gather / reduce-scatter: exact values on every rank, issued asynchronously
    with the output waited for later; on gloo nothing but the caller's buffers is allocated
    while they are in flight (gloo's own all-gather / reduce-scatter copy the whole buffer)."""
    from dtensor_lite import collectives as C
    mesh = make_mesh((4,))
    rank, n, chunk = dist.get_rank(), 4, 3 * 1024 + 5  # an odd chunk: no alignment assumed
    mine = (torch.arange(chunk) * (rank + 1)).to(dtype)
    out = torch.empty(n * chunk, dtype=dtype)
    inp = out.narrow(0, rank * chunk, chunk) if in_place else torch.empty(chunk, dtype=dtype)
    inp.copy_(mine)
    grads = (torch.arange(n * chunk) % 7 + rank).to(dtype)
    reduced = torch.empty(chunk, dtype=dtype)

    def issue_and_wait():
        gathering = C.flat_all_gather(out, inp, mesh, 0, async_op=True)
        reducing = C.flat_reduce_scatter(reduced, grads, mesh, 0, async_op=True)
        gathering.wait()
        reducing.wait()
    held = _peak_allocated_while(issue_and_wait)
    want_gather = torch.cat([(torch.arange(chunk) * (r + 1)).to(dtype) for r in range(n)])
    assert torch.equal(out, want_gather)
    want_reduce = sum((torch.arange(n * chunk) % 7 + r).to(dtype) for r in range(n))
    assert torch.equal(reduced, want_reduce[rank * chunk:(rank + 1) * chunk])
    if out.device.type == "cpu":
        assert held == 0, f"{held} bytes allocated while the collectives were in flight"
