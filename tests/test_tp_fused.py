"""A sequence-parallel Linear or LayerNorm as one autograd node (dtensor_lite/_tp_linear.py,
_tp_norm.py, tp/_fused.py) gives what the general path gives -- the style's hooks around the local
linear shortcut, the dispatcher's layer_norm and its backward: output,
input and parameter gradients equal to the bit, with the same placements -- and what single-process
torch gives; on uneven sequence pieces, without bias, on 2-D and 3-D inputs, with any input not
requiring grad; and it is taken where it should be and not where a hook or debug mode could tell."""
import copy

import pytest
import torch

from dtensor_lite import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.debug import CommDebugMode
from tests.harness import distributed
from tests.test_step_fast_paths import _Block  # the sequence-parallel block both files test
from tp import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
import tp._fused as fused

_FUSED_NODES = {"_GatherColumnBackward", "_RowReduceBackward", "_SequenceLayerNormBackward"}


def _nodes(t) -> set:
    """The names of the autograd nodes behind ``t``."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names


def _train(base, x_global, mesh, *, fuse: bool, x_grad=True, frozen=(), local_out=False,
           steps=2):
    seq = x_global.ndim - 2  # (batch, seq, hidden) or (seq, hidden)
    model = parallelize_module(copy.deepcopy(base), mesh, {
        "norm": SequenceParallel(sequence_dim=seq),
        "w1": ColwiseParallel(input_layouts=Shard(seq)),
        "w2": RowwiseParallel(output_layouts=Shard(seq), use_local_output=local_out)})
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    x = distribute_tensor(x_global, mesh, [Shard(seq)]).requires_grad_(x_grad)
    real = fused.eligible
    fused.eligible = real if fuse else (lambda *args: False)
    try:
        for _ in range(steps):  # the second call runs the cached decisions
            out = model(x)
            y = out if isinstance(out, DTensor) else DTensor.from_local(
                out, mesh, [Shard(seq)], shape=x_global.shape)
            assert (_FUSED_NODES <= _nodes(y)) == fuse, _nodes(y)
            y.to_local().sum().backward()
    finally:
        fused.eligible = real
    return y, x, model


def _assert_same(a, b, ref=None):
    """DTensors ``a`` and ``b`` equal to the bit with the same placements; close to ``ref``."""
    assert type(a) is DTensor and a.placements == b.placements, (a.placements, b.placements)
    assert torch.equal(a.full_tensor(), b.full_tensor())
    if ref is not None:
        torch.testing.assert_close(a.full_tensor(), ref)


def _compare(world, ffn, bias, x_shape, **kw):
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base, x_global = _Block(ffn, bias), torch.randn(*x_shape)
    out_f, x_f, model_f = _train(base, x_global, mesh, fuse=True, **kw)
    out_g, x_g, model_g = _train(base, x_global, mesh, fuse=False, **kw)
    ref, x_ref = copy.deepcopy(base), x_global.clone().requires_grad_(kw.get("x_grad", True))
    for name in kw.get("frozen", ()):
        ref.get_parameter(name).requires_grad_(False)
    for _ in range(2):
        out_ref = ref(x_ref)
        out_ref.sum().backward()
    _assert_same(out_f, out_g, out_ref)
    if x_ref.requires_grad:
        _assert_same(x_f.grad, x_g.grad, x_ref.grad)
    else:
        assert x_f.grad is None and x_g.grad is None
    for (name, p_f), (_, p_g), (_, p_ref) in zip(model_f.named_parameters(),
                                                 model_g.named_parameters(),
                                                 ref.named_parameters()):
        if not p_ref.requires_grad:
            assert p_f.grad is None and p_g.grad is None, name
            continue
        _assert_same(p_f.grad, p_g.grad, p_ref.grad)


@distributed(world_size=4)
@pytest.mark.parametrize("ffn,bias,x_shape", [
    (12, True, (2, 8, 8)),    # even pieces
    (10, True, (2, 13, 8)),   # uneven features (3, 3, 3, 1) and sequence (4, 3, 3, 3)
    (12, False, (2, 7, 8)),   # no bias; uneven sequence (2, 2, 2, 1)
    (10, True, (13, 8)),      # 2-D input, uneven sequence
    (12, False, (6, 8)),      # 2-D, no bias, a rank with an empty sequence piece (2, 2, 2, 0)
    (3, True, (2, 8, 8)),     # a rank with no features (1, 1, 1, 0)
])
def test_fused_tp_linear_matches_general_path_and_torch(ffn, bias, x_shape):
    _compare(4, ffn, bias, x_shape)


@distributed(world_size=2)
@pytest.mark.parametrize("kw", [
    {"x_grad": False},
    {"frozen": ("w1.weight", "w2.bias")},
    {"frozen": ("w1.weight", "w1.bias", "w2.weight", "w2.bias", "norm.weight", "norm.bias")},
])
def test_fused_tp_linear_requires_grad_combinations(kw):
    """Inputs that need no gradient: x, some weights, all weights."""
    _compare(2, 10, True, (2, 7, 8), **kw)


@distributed(world_size=2)
def test_fused_tp_linear_declines_where_it_could_be_seen():
    """A user hook on the Linear, a debug mode counting collectives, and no_grad: the general
    path runs (the hook sees the input the style's input hook made), with the same results."""
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    base, x_global = _Block(12, True), torch.randn(2, 7, 8)
    model = parallelize_module(copy.deepcopy(base), mesh, {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    x = distribute_tensor(x_global, mesh, [Shard(1)]).requires_grad_()
    fused_out = model(x)
    assert _FUSED_NODES <= _nodes(fused_out)
    seen = []
    handle = model.w1.register_forward_pre_hook(lambda mod, args: seen.append(args[0].placements))
    out = model(x)
    assert seen == [(Replicate(),)]  # what the style's input hook made
    assert "_GatherColumnBackward" not in _nodes(out) and "_RowReduceBackward" in _nodes(out)
    assert torch.equal(out.full_tensor(), fused_out.full_tensor())
    handle.remove()
    with CommDebugMode() as comm:
        out = model(x)
        out.to_local().sum().backward()
    assert _FUSED_NODES.isdisjoint(_nodes(out))
    assert comm.get_comm_counts() == {"all_gather": 2, "reduce_scatter": 2}
    with torch.no_grad():
        out = model(x)
    assert torch.equal(out.full_tensor(), fused_out.full_tensor())
    torch.testing.assert_close(out.full_tensor(), base(x_global))


@distributed(world_size=2)
def test_a_torch_function_mode_sees_no_local_kernel_of_the_shortcuts():
    """The one-node Linear / LayerNorm run their local kernels through torch's bindings only
    where no TorchFunctionMode is active: a user's mode sees the calls the program makes, never
    a ``linear`` / ``native_layer_norm`` on our plain local pieces; values are those without
    the mode."""
    from torch.overrides import TorchFunctionMode

    class _Plain(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.internal = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", str(func))
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if name in ("linear", "native_layer_norm") and tensors and \
                    all(type(t) is torch.Tensor for t in tensors):
                self.internal.append(name)
            return func(*args, **(kwargs or {}))

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    base, x_global = _Block(12, True), torch.randn(2, 8, 8)
    out_ref, _, _ = _train(base, x_global, mesh, fuse=True, steps=1)
    mode = _Plain()
    with mode:
        out, _, _ = _train(base, x_global, mesh, fuse=True, steps=1)
    assert mode.internal == [], mode.internal
    _assert_same(out, out_ref)
