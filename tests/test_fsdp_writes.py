"""In-place writes into FSDP's sharded parameters, against plain single-process torch.

The oracle: in plain torch an in-place write into a parameter that a forward saved for backward
makes that backward raise autograd's "one of the variables needed for gradient computation has
been modified by an inplace operation". FSDP's forward saves the *gathered* parameter, which a
write into the shard does not touch (or, where the gathered group holds a lent shard, touches in
this rank's rows only: fsdp/param.py ``lend_shard``), so autograd cannot see it; the group checks
the shards' version counters instead (``ParamGroup.check_unwritten``) and raises with the same
meaning, lending or not. Writes through ``.data`` are invisible to autograd in plain torch (its
backward computes with the new values); they are not refused here either.

The normal cycle -- forward, backward, optimizer step, zero_grad, repeated; gradient accumulation
with set_requires_gradient_sync(False) / set_reshard_after_backward(False) and a final synced
step; reshard_after_forward=False; state_dict / load_state_dict between steps; activation
checkpointing -- runs unchanged and bit-equal with lending on and off.
"""
import pytest
import torch

from tests.harness import distributed
from tests.test_fsdp_memory import H, Net, _lending, build

AUTOGRAD_SAYS = "modified by an inplace operation"
WE_SAY = "was modified by an in-place operation after a forward that used it"


def _write(net, opt, how: str, weight):
    """The write between forward and backward, as a user would do it; ``weight``: the parameter
    (read between steps: with a group gathered, its modules show the gathered tensors)."""
    with torch.no_grad():
        if how == "optimizer":
            opt.step()
        elif how == "load_state_dict":
            net.load_state_dict({k: v + 1 for k, v in net.state_dict().items()})
        elif how == "param":
            weight.add_(1.0)
        elif how == "to_local":  # ours only: the DTensor's local piece
            weight.to_local().add_(1.0)


def _plain_raises(how: str) -> bool:
    """Plain torch, one process: does backward refuse the write?"""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    x = torch.randn(4, H)
    net(x).square().mean().backward()   # gradients for the optimizer's step
    loss = net(x).square().mean()
    _write(net, opt, "param" if how == "to_local" else how, net.blocks[3].up.weight)
    try:
        loss.backward()
    except RuntimeError as e:
        assert AUTOGRAD_SAYS in str(e), e
        return True
    return False


@distributed(world_size=2, timeout=180)
@pytest.mark.parametrize("how", ["optimizer", "load_state_dict", "param", "to_local"])
@pytest.mark.parametrize("raf", [True, False], ids=["raf", "no-raf"])
def test_write_between_forward_and_backward_is_refused_as_plain_torch_refuses_it(how, raf):
    """Plain torch raises; so do we, with lending on and off, whether the written group stayed
    gathered (reshard_after_forward=False, or the root) or is gathered again for backward; and
    reset_iter_state() recovers: the next step runs, the written values kept."""
    assert _plain_raises(how)
    x = torch.randn(4, H)
    for on in (True, False):
        net = build("fsdp", raf)
        _lending(net, on)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        weight = net.blocks[3].up.weight
        net(x).square().mean().backward()
        loss = net(x).square().mean()
        _write(net, opt, how, weight)
        written = weight.to_local().clone()
        with pytest.raises(RuntimeError, match=WE_SAY) as err:
            loss.backward()
        assert "Linear.weight" in str(err.value) or how in ("optimizer", "load_state_dict")
        net.reset_iter_state()
        opt.zero_grad()
        assert torch.equal(weight.to_local(), written)
        net(x).square().mean().backward()   # the next step runs
        opt.step()


@distributed(world_size=2, timeout=180)
@pytest.mark.parametrize("raf", [True, False], ids=["raf", "no-raf"])
def test_write_through_data_is_not_refused_as_in_plain_torch(raf):
    """``.data`` hides a write from autograd in plain torch (backward computes with the new
    values); it is not refused here either (docs/fsdp.md says which values a group that stayed
    gathered computes with)."""
    torch.manual_seed(0)
    plain = Net()
    x = torch.randn(4, H)
    loss = plain(x).square().mean()
    plain.blocks[3].up.weight.data.add_(1.0)
    loss.backward()   # no error
    for on in (True, False):
        net = build("fsdp", raf)
        _lending(net, on)
        weight = net.blocks[3].up.weight
        loss = net(x).square().mean()
        weight.data.add_(1.0)
        loss.backward()


@distributed(world_size=2, timeout=180)
def test_write_while_kept_gathered_after_backward_is_refused_until_resharded():
    """set_reshard_after_backward(False) keeps the groups gathered after backward; an optimizer
    step then would leave the next forward computing with the values from before it (this
    rank's rows of lent shards excepted): refused, with what to do; resharding first works."""
    x = torch.randn(4, H)
    for on in (True, False):
        net = build("fsdp", True)
        _lending(net, on)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        net.set_reshard_after_backward(False)
        net(x).square().mean().backward()
        opt.step()
        with pytest.raises(RuntimeError, match="modified in place while its group was kept "
                                               "gathered.*call reshard"):
            net(x)
        net.reset_iter_state()
        net.reshard()
        opt.zero_grad()
        net(x).square().mean().backward()   # gathered anew from the stepped shards
        opt.step()


@distributed(world_size=2, timeout=180)
def test_a_forward_without_backward_then_a_step_is_refused_with_what_to_do():
    """A forward that records autograd and never gets its backward (an evaluation outside
    torch.no_grad()) leaves the root group gathered; an optimizer step then would leave the
    next forward with the values from before it: refused, saying so; the same evaluation under
    torch.no_grad() is fine."""
    x = torch.randn(4, H)
    net = build("fsdp", True)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(x).square().mean().backward()
    with torch.no_grad():
        net(x)  # evaluation without autograd: nothing kept gathered
    opt.step()
    opt.zero_grad()
    net(x).square().mean().backward()
    net(x)  # recorded, never backpropagated
    opt.step()
    with pytest.raises(RuntimeError, match="backward never came.*torch.no_grad"):
        net(x)


def _cycle(net, opt, x):
    """Per step: two accumulated micro-batches (no sync, kept gathered), a synced one, the
    optimizer step, zero_grad, a state dict round trip."""
    losses = []
    for _ in range(2):
        for micro in range(3):
            last = micro == 2
            net.set_requires_gradient_sync(last)
            net.set_reshard_after_backward(last)
            loss = net(x[micro]).square().mean()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        net.load_state_dict({k: v.detach().clone() for k, v in net.state_dict().items()})
    return losses


@distributed(world_size=4, timeout=240)
@pytest.mark.parametrize("layout,raf,ac", [("fsdp", True, False), ("fsdp", False, False),
                                           ("fsdp", True, True), ("hsdp", True, False),
                                           ("2d", False, True)],
                         ids=["fsdp", "fsdp-no-raf", "fsdp-ac", "hsdp", "2d-no-raf-ac"])
def test_normal_cycle_is_unchanged_and_bit_equal_with_lending(layout, raf, ac):
    """Gradient accumulation (no sync, kept gathered), a synced micro-batch, the optimizer step,
    zero_grad, a state dict round trip, twice, with checkpointed blocks or not: no refusal, and
    the same losses, parameters and optimizer state bit for bit with lending on and off."""
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    x = torch.randn(3, 4, H, generator=gen)
    results = []
    for on in (True, False):
        net = build(layout, raf, ac)
        _lending(net, on)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        losses = _cycle(net, opt, x)
        results.append((losses, [p.to_local().clone() for p in net.parameters()],
                        [t.to_local().clone() if hasattr(t, "to_local") else t.clone()
                         for st in opt.state.values() for t in st.values()]))
    for a, b in zip(*results):
        assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))
