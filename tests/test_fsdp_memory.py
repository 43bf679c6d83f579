"""FSDP frees at the earliest safe moment: every group is followed through a training step.

At every FSDP hook (``fsdp.observers.observe``) the test checks which groups hold unsharded
parameters (gathered tensors or an all-gather in flight) and unsharded gradient buffers: only the
current group and the one prefetched next to it, plus the groups that keep their parameters from
forward to backward by configuration (the root; every block under
``reshard_after_forward=False``), and only between their forward and their backward. After the
step nothing is alive but the sharded parameters, their sharded gradients and optimizer state.
"""
import gc

import pytest
import torch
import torch.nn as nn

from dtensor_lite import DTensor, init_device_mesh
from fsdp import fully_shard
from fsdp.observers import observe
from fsdp.param_group import ShardState
from tests.harness import distributed

BLOCKS, H = 10, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.up = nn.Linear(H, 2 * H)
        self.down = nn.Linear(2 * H, H)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(H, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build(layout: str, reshard_after_forward: bool, ac: bool = False):
    """``Net`` under fully_shard (each block, then the root) on ``layout``; ``ac``: every block
    checkpointed (non-reentrant ``checkpoint_wrapper``, applied before fully_shard)."""
    import tp
    torch.manual_seed(0)
    net = Net()
    if ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, b in enumerate(net.blocks):
            net.blocks[i] = checkpoint_wrapper(b, preserve_rng_state=False)
    world = torch.distributed.get_world_size()
    if layout == "hsdp":
        dp_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    elif layout == "2d":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for b in net.blocks:
            tp.parallelize_module(b, mesh["tp"], {"up": tp.ColwiseParallel(),
                                                  "down": tp.RowwiseParallel()})
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = init_device_mesh("cpu", (world,))
    for b in net.blocks:
        fully_shard(b, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(net, mesh=dp_mesh)
    return net


class Follower:
    """Checks, after every FSDP hook, which groups hold unsharded buffers."""

    def __init__(self, net, accumulating: bool = False, accumulated: bool = False):
        self.accumulating = accumulating  # set_requires_gradient_sync(False): grads kept
        self.accumulated = accumulated    # the synced backward after it: each group's reduced
        self.states = [net._get_fsdp_state()] + [b._get_fsdp_state() for b in net.blocks]
        self.order = [s.group for s in self.states]          # pre-forward order: root, blocks
        # post-forward order (blocks, then root): backward prefetches the group before in it
        self.post_order = self.order[1:] + self.order[:1]
        self.forwarded: set = set()
        self.backwarded: set = set()
        self.events = 0
        self.max_unsharded = 0

    @staticmethod
    def holds_params(g) -> bool:
        return g.unsharded_nbytes() > 0 or g.pending_ag is not None

    @staticmethod
    def neighbour(order, g, step):
        i = order.index(g) + step
        return {order[i]} if 0 <= i < len(order) else set()

    def __call__(self, event, state):
        self.events += 1
        g = state.group
        ctx = state.ctx
        if event == "pre_forward":
            self.forwarded.add(g)
        elif event == "post_backward":
            self.backwarded.add(g)
        # groups that keep parameters between forward and backward by configuration
        kept = {x for x in self.order if not x.reshards_after_forward()
                and x in self.forwarded and x not in self.backwarded}
        following = self.neighbour(self.order, g, 1)        # prefetched in forward
        preceding = self.neighbour(self.post_order, g, -1)  # prefetched in backward
        # on CPU backward prefetches from the post-backward (fsdp.streams): nothing but the
        # group itself is gathered while its backward computes
        allowed = {"pre_forward": {g} | following, "post_forward": following,
                   "pre_backward": {g}, "post_backward": preceding,
                   "end_of_backward": set()}[event]
        holders = {x for x in self.order if self.holds_params(x)}
        extra = holders - allowed - kept
        assert not extra, (f"after {event} of group {self.order.index(g)}: groups "
                           f"{sorted(self.order.index(x) for x in extra)} hold unsharded "
                           f"parameters (allowed: current + prefetched + kept)")
        self.max_unsharded = max(self.max_unsharded, len(holders - kept))
        if event == "post_backward":
            assert g not in holders, "a group still holds its parameters after its backward"
        # unsharded gradients: handed to the reduce-scatter in the group's post-backward; its
        # input lives only while the collective runs
        grad_holders = [x for x in self.order if any(t is not None for t in x.grads)]
        if self.accumulating:  # by design: every group that ran backward keeps its gradients
            assert set(grad_holders) == self.backwarded and ctx.pending_reduce is None
            return
        if self.accumulated:  # ... until its post-backward in the synced backward
            assert set(grad_holders) == set(self.order) - self.backwarded
            grad_holders = []
        pending = ctx.pending_reduce
        rs_inputs = 0 if pending is None else sum(b[3] is not None for b in pending.buckets)
        if event in ("pre_backward", "end_of_backward"):
            # the previous group's reduce-scatter is finished before this group computes
            assert pending is None, f"a reduce-scatter is still pending after {event}"
        assert len(grad_holders) + rs_inputs <= 1, (
            f"after {event}: {len(grad_holders)} groups hold unsharded gradients and "
            f"{rs_inputs} reduce-scatter inputs are alive")


def _alive_storages() -> dict[int, int]:
    """``{data_ptr: nbytes}`` of every non-empty storage a live Python tensor refers to."""
    gc.collect()
    out = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter, DTensor):
            local = obj.to_local() if isinstance(obj, DTensor) else obj
            if type(local) not in (torch.Tensor, torch.nn.Parameter):
                continue  # a DTensor traced by an earlier test's torch.compile holds a fake local
            if local.device.type != "meta" and local.untyped_storage().nbytes():
                s = local.untyped_storage()
                out[s.data_ptr()] = s.nbytes()
    return out


def _storages_of(tensors) -> set[int]:
    return {(t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()
            for t in tensors}


def _follow_step(layout, reshard_after_forward):
    net = build(layout, reshard_after_forward)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))

    def step():
        net(x).square().mean().backward()
        opt.step()

    step()                       # creates the optimizer state
    opt.zero_grad()
    before = _alive_storages()
    follower = Follower(net)
    with observe(follower):
        step()
    # every hook of every group was seen: 11 groups x (pre/post forward, pre/post backward), + 1
    assert follower.events == 4 * (BLOCKS + 1) + 1
    assert 1 <= follower.max_unsharded <= 2  # the current group and the prefetched one at most
    for g in follower.order:
        assert g.state is ShardState.SHARDED and g.unsharded_nbytes() == 0
        assert g.pending_ag is None and all(t is None for t in g.grads)
    assert follower.states[0].ctx.pending_reduce is None
    # every tensor the step left alive is a sharded gradient (or optimizer state)
    params = list(net.parameters())
    expected = _storages_of(params + [p.grad for p in params if p.grad is not None]
                            + [t for st in opt.state.values() for t in st.values()
                               if isinstance(t, torch.Tensor)] + [x])
    new = {ptr: n for ptr, n in _alive_storages().items() if ptr not in before}
    left = {ptr: n for ptr, n in new.items() if ptr not in expected}
    assert not left, f"{len(left)} storages ({sum(left.values())} bytes) outlive the step"


@distributed(world_size=4, timeout=120)
def test_gradient_accumulation_keeps_unsharded_grads_until_the_synced_backward():
    """set_requires_gradient_sync(False) keeps every group's unsharded gradients by design (they
    are what is accumulated); parameters still follow the bound; the synced backward reduces and
    frees them like any other (HSDP mesh)."""
    net = build("hsdp", True)
    x = torch.randn(4, H)
    net.set_requires_gradient_sync(False)
    with observe(Follower(net, accumulating=True)):
        net(x).sum().backward()
    net.set_requires_gradient_sync(True)
    follower = Follower(net, accumulated=True)
    with observe(follower):
        net(x).sum().backward()
    for g in follower.order:
        assert g.state is ShardState.SHARDED and all(t is None for t in g.grads)


@distributed(world_size=2, timeout=120)
@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["raf", "no-raf"])
def test_groups_followed_through_a_step_world2(reshard_after_forward):
    _follow_step("fsdp", reshard_after_forward)


@distributed(world_size=4, timeout=120)
@pytest.mark.parametrize("layout,reshard_after_forward",
                         [("fsdp", True), ("hsdp", True), ("2d", True), ("2d", False)],
                         ids=["fsdp-raf", "hsdp-raf", "2d-raf", "2d-no-raf"])
def test_groups_followed_through_a_step_world4(layout, reshard_after_forward):
    _follow_step(layout, reshard_after_forward)


@distributed(world_size=2, timeout=120)
def test_all_gather_pieces_are_freed_by_the_copy_out():
    """On CPU a group whose shards need no padding gathers into one buffer per rank; the wait
    (copy-out) frees every piece -- the one this rank sent before the parameters are allocated --
    and the gathered parameters are exactly the global ones."""
    net = build("fsdp", True)
    group = net.blocks[0]._get_fsdp_state().group
    group.start_unshard()
    pending = group.pending_ag
    assert pending.out is None and len(pending.pieces) == 2
    assert all(piece.untyped_storage().nbytes() for piece in pending.pieces)
    group.wait_unshard()
    assert all(piece.untyped_storage().nbytes() == 0 for piece in pending.pieces)
    for p in group.params:
        assert torch.equal(p.raw, p.sharded.full_tensor())
    group.reshard()
    assert group.unsharded_nbytes() == 0


# ----------------------------------------------------------------------------- lent shards
# While a group is unsharded, a parameter whose shard is exactly its rows of the gathered tensor
# (dim 0, no padding, no cast) holds those bytes once: the shard's local tensor is a view of them
# (fsdp.param.FSDPParam.lend_shard). Checked against the same model with lending off.

def _lending(net, on: bool):
    for m in net.modules():
        state = getattr(m, "_get_fsdp_state", None)
        if state is not None and state().group is not None:
            for p in state().group.params:
                p.lends_shard = on


def _lent(p) -> bool:
    local = p.sharded._local_tensor
    return p.raw is not None and local.numel() > 0 and p.raw.untyped_storage().nbytes() > 0 \
        and local.untyped_storage().data_ptr() == p.raw.untyped_storage().data_ptr()


@distributed(world_size=4, timeout=180)
@pytest.mark.parametrize("layout,raf", [("fsdp", True), ("fsdp", False), ("fsdp", 2),
                                        ("hsdp", True), ("2d", False)],
                         ids=["fsdp-raf", "fsdp-no-raf", "fsdp-raf2", "hsdp", "2d-no-raf"])
def test_lent_shards_train_bit_equal_to_kept_shards(layout, raf):
    """Three AdamW steps with lending on and off give bit-equal parameters and gradients; between
    forward and backward the groups that stay gathered hold their even shards only inside the
    gathered tensors (uneven ones keep their own); an alias of a shard taken before (a state
    dict's value) still aliases it after every step."""
    nets = [build(layout, raf), build(layout, raf)]
    _lending(nets[1], False)
    opts = [torch.optim.AdamW(n.parameters(), lr=1e-2) for n in nets]
    alias = nets[0].state_dict()["blocks.0.up.weight"]     # a detach() of the sharded parameter
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(3):
        x = torch.randn(4, H, generator=gen)
        for net, opt, on in zip(nets, opts, (True, False)):
            loss = net(x).square().mean()
            kept = [g for g in [net._get_fsdp_state().group] +
                    [b._get_fsdp_state().group for b in net.blocks]
                    if g.state is ShardState.UNSHARDED]
            assert kept  # the root at least
            for g in kept:
                for p in g.params:
                    assert _lent(p) == (on and p.rows_even), p.fqn
            loss.backward()
            assert not any(_lent(p) for g in kept for p in g.params)
            opt.step()
            opt.zero_grad(set_to_none=False)
        for p, q in zip(nets[0].parameters(), nets[1].parameters()):
            assert torch.equal(p.to_local(), q.to_local())
            assert torch.equal(p.grad.to_local(), q.grad.to_local())
        weight = nets[0].blocks[0].up.weight
        assert alias.to_local().data_ptr() == weight.to_local().data_ptr()
        assert torch.equal(alias.to_local(), weight.to_local())


def _lent_in_forward_and_backward(raf):
    """Whether each block's even shards are lent while the block computes its forward, its
    backward, and a forward without grad (read inside ``up``: a forward hook, and a hook on its
    output's gradient, which runs in the block's backward)."""
    net = build("fsdp", raf)
    seen, phase = {}, ["forward"]

    def lent_now(block, when):
        lent = {_lent(p) for p in block._get_fsdp_state().group.params if p.rows_even}
        seen.setdefault(when, set()).add(lent.pop() if len(lent) == 1 else "mixed")

    for b in net.blocks:
        def hook(module, args, out, b=b):
            lent_now(b, phase[0])
            if out.requires_grad:
                out.register_hook(lambda grad: lent_now(b, "backward"))
        b.up.register_forward_hook(hook)
    for _ in range(2):  # the second step as well: nothing left lent from the first
        seen.clear()
        net(torch.randn(4, H)).square().mean().backward()
    phase[0] = "no_grad forward"
    with torch.no_grad():  # no backward follows: the forward is the peak
        net(torch.randn(4, H))
    return seen


@distributed(world_size=4, timeout=180)
@pytest.mark.parametrize("raf", [True, False, 2], ids=lambda v: f"raf={v}")
def test_shards_are_lent_where_the_group_stays_gathered_into_backward(raf):
    """A block's backward gather lends its shards; its forward gather lends them only if the
    block stays gathered into backward (reshard_after_forward=False) or no backward follows (a
    forward without grad): resharded after forward, its forward gather is short and over before
    the step's peak, and lending there cost a copy per shard for nothing."""
    got = _lent_in_forward_and_backward(raf)
    assert got == {"forward": {raf is False}, "backward": {True},
                   "no_grad forward": {True}}, got


@distributed(world_size=2, timeout=120)
def test_lent_shards_free_their_bytes_while_gathered():
    """reshard_after_forward=False keeps every block gathered until its backward: the end of
    forward holds exactly one shard less of every even parameter than with lending off (the
    profiler's allocator events, same model and input); mixed precision gathers another dtype,
    so nothing is lent there."""
    from benchmarks.memory import allocation_timeline, peaks
    from dtensor_lite.quiet_profiler import memory_profile
    from fsdp import MixedPrecisionPolicy

    x = torch.randn(4, H)
    net = build("fsdp", False)
    totals, lent_bytes = [], 0
    for on in (True, False):
        _lending(net, on)
        # warm caches; under the profiler, as benchmarks/memory.py does: it sizes a free only
        # of a block allocated while it ran (here the shards given back at reshard)
        with memory_profile():
            net(x).square().mean().backward()
        with memory_profile() as prof:
            loss = net(x).square().mean()
        totals.append(peaks(allocation_timeline(prof))["end"])
        if on:
            lent_bytes = sum(p.sharded._local_tensor.nbytes for b in net.blocks
                             for p in b._get_fsdp_state().group.params if _lent(p))
        loss.backward()
        del loss  # not freed inside the next profile
    block_shard = sum(p.to_local().nbytes for p in net.blocks[0].parameters())
    assert lent_bytes == BLOCKS * block_shard  # every block parameter is even on 2 ranks
    assert totals[1] - totals[0] == lent_bytes + sum(
        p.to_local().nbytes for p in [net.inp.weight, net.inp.bias])  # + the root's even ones

    torch.manual_seed(0)
    net = Net()
    fully_shard(net, mesh=init_device_mesh("cpu", (2,)),
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    net.unshard()
    group = net._get_fsdp_state().group
    assert group.state is ShardState.UNSHARDED and not any(_lent(p) for p in group.params)
    net.reshard()
