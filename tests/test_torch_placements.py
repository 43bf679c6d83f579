"""torch's own placement objects (``torch.distributed.tensor.Shard(0)`` ...) are taken by value
wherever a placement is taken: code written for torch (torchtitan) hands them to us as they are.

On torch 2.13 and 2.15 alike they are torch's C++-backed classes of
``torch.distributed.tensor.placement_types``, unrelated to ours; ``placements.as_placement`` is
the one conversion, called by every entry point. Oracles: the same call with our placements, and
plain torch.
"""
import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt
import torch.nn as nn
from torch.distributed.tensor.placement_types import _StridedShard as TorchStridedShard

import dtensor_lite as dl
import tp
from dtensor_lite import DTensor, Partial, Replicate, Shard, _StridedShard, init_device_mesh
from dtensor_lite.placements import as_placement, torch_placements_to_ours
from fsdp import fully_shard
from tests.harness import distributed


def test_as_placement_converts_by_value():
    assert as_placement(tdt.Shard(1)) == Shard(1)
    assert as_placement(tdt.Shard(-1)) == Shard(-1)
    assert as_placement(tdt.Replicate()) == Replicate()
    for op in ("sum", "avg", "max", "min"):
        assert as_placement(tdt.Partial(op)) == Partial(op)
    assert as_placement(TorchStridedShard(0, split_factor=2)) == _StridedShard(0, 2)
    ours = Shard(0)
    assert as_placement(ours) is ours  # ours pass through untouched
    with pytest.raises(TypeError, match="placement.*got 3"):
        as_placement(3)


TORCH_AND_OURS = [
    (tdt.Shard(0), Shard(0)), (tdt.Shard(1), Shard(1)), (tdt.Shard(-1), Shard(-1)),
    (tdt.Replicate(), Replicate()),
    *[(tdt.Partial(op), Partial(op)) for op in ("sum", "avg", "max", "min")],
    (TorchStridedShard(0, split_factor=2), _StridedShard(0, 2)),
]


@pytest.mark.parametrize("theirs,ours", TORCH_AND_OURS, ids=repr)
def test_torch_placements_equal_ours_by_value_in_both_orders(theirs, ours):
    # torchtitan 0.3 compares the placements it builds through torch (spmd_types) with a
    # DTensor's: `value.placements != expected`, and `isinstance(p, Shard)` before normalising
    assert ours == theirs and not ours != theirs
    assert (ours,) == (theirs,) and [ours] == [theirs]
    assert hash(ours) == hash(theirs) and {ours: 1}[theirs] == 1  # one dict key
    assert isinstance(theirs, type(ours)) and isinstance(theirs, dl.Placement)
    if type(theirs) is not TorchStridedShard:  # torch's _StridedShard.__eq__ answers False
        assert theirs == ours and not theirs != ours  # itself instead of NotImplemented


def test_torch_placements_differ_from_other_placements_of_ours():
    for theirs, ours in TORCH_AND_OURS:
        for _, other in TORCH_AND_OURS:
            if other is not ours:
                assert (other == theirs) is (other == ours)
    assert not isinstance(tdt.Replicate(), Shard) and not isinstance(tdt.Shard(0), Partial)
    assert not isinstance(tdt.Shard(0), _StridedShard)
    assert isinstance(TorchStridedShard(0, split_factor=2), Shard)  # a Shard, as ours is
    from torch.distributed.tensor.placement_types import _MaskPartial
    assert not isinstance(_MaskPartial(), Partial) and Partial() != _MaskPartial()
    assert Shard(0) != 0 and Replicate() != "Replicate" and not isinstance(0, Shard)


def test_torch_internal_placements_without_an_equivalent_are_refused():
    from torch.distributed.tensor.placement_types import _MaskPartial
    with pytest.raises(TypeError, match="_MaskPartial.*no dtensor_lite equivalent"):
        as_placement(_MaskPartial())


def test_nested_conversion_keeps_structure():
    got = torch_placements_to_ours(([tdt.Shard(0)], None, (tdt.Replicate(), Partial())))
    assert got == ([Shard(0)], None, (Replicate(), Partial()))
    assert type(got[0]) is list and type(got[2]) is tuple
    same = ([Shard(0)], None)
    assert torch_placements_to_ours(same) is same


@distributed(world_size=2)
def test_distribute_tensor_from_local_redistribute_take_torch_placements():
    mesh = init_device_mesh("cpu", (2,))
    x = torch.arange(10.0).reshape(5, 2)
    d = dl.distribute_tensor(x, mesh, [tdt.Shard(0)])  # raised TypeError before
    assert d.placements == (Shard(0),)
    assert torch.equal(d.to_local(), x.chunk(2)[dist.get_rank()])
    r = d.redistribute(mesh, [tdt.Replicate()])
    assert r.placements == (Replicate(),) and torch.equal(r.to_local(), x)
    p = DTensor.from_local(torch.ones(3), mesh, [tdt.Partial("sum")])
    assert p.placements == (Partial("sum"),)
    assert torch.equal(p.full_tensor(), torch.full((3,), 2.0))
    # a single torch placement (not in a list), as ours allows
    s = dl.distribute_tensor(x, mesh, tdt.Shard(1))
    assert s.placements == (Shard(1),)
    # gradient placements too
    dd = dl.distribute_tensor(x.clone().requires_grad_(), mesh, [Replicate()])
    dd.to_local(grad_placements=[tdt.Partial()]).sum().backward()
    assert dd.grad.placements == (Partial("sum"),)  # the layout given, as torch keeps it
    assert torch.equal(dd.grad.full_tensor(), torch.full_like(x, 2.0))  # the ranks' ones, summed


@distributed(world_size=4)
def test_strided_shard_and_factories_take_torch_placements():
    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.arange(24.0).reshape(8, 3)
    theirs = dl.distribute_tensor(x, mesh, [TorchStridedShard(0, split_factor=2), tdt.Shard(0)])
    ours = dl.distribute_tensor(x, mesh, [_StridedShard(0, 2), Shard(0)])
    assert torch.equal(theirs.to_local(), ours.to_local())
    assert torch.equal(theirs.full_tensor(), x)
    z = dl.zeros(6, 2, device_mesh=mesh, placements=[tdt.Shard(0), tdt.Replicate()])
    assert z.placements == (Shard(0), Replicate())
    shape, offset = dl.compute_local_shape_and_global_offset((7, 2), mesh,
                                                             [tdt.Shard(0), tdt.Replicate()])
    assert shape == dl.compute_local_shape_and_global_offset((7, 2), mesh,
                                                             [Shard(0), Replicate()])[0]


@distributed(world_size=2)
def test_local_map_takes_torch_placements():
    mesh = init_device_mesh("cpu", (2,))
    x = torch.arange(8.0).reshape(4, 2)
    d = dl.distribute_tensor(x, mesh, [Shard(0)])
    f = dl.local_map(lambda t: t * 2, out_placements=[tdt.Shard(0)],
                     in_placements=([tdt.Shard(0)],), device_mesh=mesh)
    out = f(d)
    assert out.placements == (Shard(0),) and torch.equal(out.full_tensor(), x * 2)


@distributed(world_size=2)
def test_tp_styles_take_torch_layouts():
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    model.load_state_dict(ref.state_dict())
    tp.parallelize_module(model, mesh, {
        "0": tp.ColwiseParallel(input_layouts=tdt.Replicate(), output_layouts=tdt.Shard(-1)),
        "1": tp.RowwiseParallel(input_layouts=tdt.Shard(-1), output_layouts=(tdt.Replicate(),)),
    })
    x = torch.randn(5, 4)
    assert torch.allclose(model(x), ref(x), atol=1e-6)
    prep = tp.PrepareModuleInput(input_layouts=(tdt.Shard(0),),
                                 desired_input_layouts=(tdt.Replicate(),),
                                 input_kwarg_layouts={"y": tdt.Shard(0)},
                                 desired_input_kwarg_layouts={"y": tdt.Replicate()})
    assert prep.input_layouts == (Shard(0),) and prep.desired_input_kwarg_layouts == {
        "y": Replicate()}


@distributed(world_size=2)
def test_fully_shard_placement_fn_may_return_torch_shard():
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: tdt.Shard(p.ndim - 1))
    assert model.weight.placements == (Shard(1),)
    assert model.bias.placements == (Shard(0),)


@distributed(world_size=2)
def test_register_sharding_rule_may_answer_with_torch_placements():
    from dtensor_lite import _caches, register_sharding
    from dtensor_lite.ops import _registry
    mesh = init_device_mesh("cpu", (2,))
    op = torch.ops.aten._softmax.default
    library_rule = _registry.RULES.get(op)

    @register_sharding(op)
    def rule(x, dim, half_to_float):
        # softmax over dim 1 is local for rows sharded on dim 0
        return [([tdt.Shard(0)], [tdt.Shard(0), None, None])]

    try:
        x = torch.randn(4, 3)
        d = dl.distribute_tensor(x, mesh, [Shard(0)])
        out = torch.softmax(d, dim=1)
        assert out.placements == (Shard(0),)
        assert torch.allclose(out.full_tensor(), torch.softmax(x, dim=1))
    finally:
        _registry.set_rule(op, library_rule, override=True)  # the library's rule for later tests
        _caches.clear_decisions()
