"""DTensor's __torch_function__ shortcut (_fast_path.py): a replayed call gives what the ordinary
path gives -- values, placements, aliasing, version counters -- and every case that needs the
ordinary path (autograd, dispatch modes, autocast, views) still takes it."""
import functools

import torch
import torch.nn.functional as F

from dtensor_lite import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from tests._spies import OpNames
from tests.harness import distributed


def _with_fast_path(fn):
    """Run the test body with the shortcut installed (the default unless DTENSOR_LITE_FAST_PATH=0),
    the previous state restored after."""
    @functools.wraps(fn)
    def body(*args, **kwargs):
        from dtensor_lite import _fast_path
        with _fast_path.enabled():
            return fn(*args, **kwargs)
    return body


def _replays(fn, *args):
    """Run ``fn`` three times (learn, then replays); all results, the last two shortcuts."""
    from dtensor_lite import _fast_path
    outs = [fn(*args) for _ in range(3)]
    assert any(v is not _fast_path._NO_SHORTCUT for v in _fast_path._SHORTCUTS.values())
    return outs


@distributed(world_size=2)
@_with_fast_path
def test_replayed_calls_match_plain_torch():
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    x, y, w, v = torch.randn(6, 4), torch.randn(6, 4), torch.randn(5, 4), torch.randn(4)
    a, b = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Shard(0)])
    dw, dv = distribute_tensor(w, mesh, [Replicate()]), distribute_tensor(v, mesh, [Replicate()])
    cases = [(lambda: a + b, lambda: x + y), (lambda: a * 2.5, lambda: x * 2.5),
             (lambda: a + dv, lambda: x + v), (lambda: torch.relu(a), lambda: torch.relu(x)),
             (lambda: F.linear(a, dw), lambda: F.linear(x, w)),
             (lambda: a.sum(1), lambda: x.sum(1)), (lambda: a @ dw.t(), lambda: x @ w.t())]
    for k, (ours, ref) in enumerate(cases):
        # elementwise ops are bit-exact; a matmul over 3 local rows may sum in another order
        # than over 6 (float32 default tolerances, a 4-term dot product)
        tol = {} if k in (4, 6) else {"rtol": 0, "atol": 0}
        for out in _replays(ours):
            assert isinstance(out, DTensor) and out.placements == (Shard(0),)
            torch.testing.assert_close(out.full_tensor(), ref(), **tol)
    # a composite whose Python kernel calls DTensor functions itself (linear on sequence shards
    # runs local_map): learned and replayed whole, or not at all
    z = torch.randn(2, 4, 4)
    s3 = distribute_tensor(z, mesh, [Shard(1)])
    for out in _replays(lambda: F.linear(s3, dw)):
        assert out.placements == (Shard(1),)
        torch.testing.assert_close(out.full_tensor(), F.linear(z, w))
    # a key learned from two distinct tensors replays ``a + a`` by position: still a + a
    _replays(lambda: a + b)
    torch.testing.assert_close((a + a).full_tensor(), x + x)
    # 0.0 and -0.0 compare equal but are different constants
    torch.testing.assert_close((a * 0.0).full_tensor(), x * 0.0)
    assert torch.equal(torch.signbit((a * -0.0).full_tensor()), torch.signbit(x * -0.0))


@distributed(world_size=2)
@_with_fast_path
def test_in_place_replay_returns_the_destination_and_bumps_its_version():
    mesh = init_device_mesh("cpu", (2,))
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    a, b = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Shard(0)])
    for k in range(3):
        version = a._version
        assert a.add_(b, alpha=0.5) is a
        assert a._version == version + 1
    torch.testing.assert_close(a.full_tensor(), x + 1.5 * y)
    # a write into a tensor autograd saved is still caught
    w = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]).requires_grad_()
    out = (w * a).sum()
    a.add_(b)
    try:
        out.backward()
        raise AssertionError("the in-place write went unnoticed by autograd")
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)


@distributed(world_size=2)
@_with_fast_path
def test_calls_that_need_the_ordinary_path_take_it():
    mesh = init_device_mesh("cpu", (2,))
    a = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    _replays(lambda: a + b)
    # autograd: an input that requires grad
    c = b.detach().requires_grad_()
    out = a + c
    assert out.grad_fn is not None
    out.sum().backward()
    assert c.grad is not None
    # a dispatch mode sees every aten op, cached or not
    with OpNames() as mode:
        a + b
    assert "aten.add.Tensor" in mode.names
    # views stay views of their input (autograd and version counters rely on it)
    for _ in range(3):
        t = a.t()
        assert t._base is a
    # autocast changes what runs: its dtype, not the replay's
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ b).dtype == torch.bfloat16
    assert (a @ b).dtype == torch.float32



def _foreach_cases(xs, ys, zs, coef, step):
    """Foreach calls as optimizers and grad clipping make them, on lists ``xs``, ``ys``, ``zs``
    (DTensors or plain tensors alike) and a one-element ``coef`` tensor; ``step`` changes the
    numbers each call (AdamW's per-parameter step sizes)."""
    sizes = [-(0.1 + step) * (k + 1) for k in range(len(xs))]
    return [
        lambda: torch._foreach_add_(xs, ys, alpha=-0.01 * (step + 1)),
        lambda: torch._foreach_mul_(xs, 0.9),
        lambda: torch._foreach_lerp_(ys, zs, 0.1),
        lambda: torch._foreach_addcmul_(zs, ys, ys, 0.001),
        # a keyword naming a positional argument; arguments equal to their defaults, which
        # torch leaves out of what it hands on (SGD's momentum, Adagrad, RMSprop call so)
        lambda: torch._foreach_addcmul_(zs, ys, ys, value=0.001),
        lambda: torch._foreach_addcmul_(zs, ys, ys, value=1),
        lambda: torch._foreach_add_(ys, zs, alpha=1),
        lambda: torch._foreach_addcdiv_(xs, ys, torch._foreach_add(torch._foreach_sqrt(zs),
                                                                   1e-8), sizes),
        lambda: torch._foreach_div_(ys, [1.0 + step + k for k in range(len(ys))]),
        lambda: torch._foreach_mul_(ys, coef),
        lambda: torch._foreach_maximum(xs, ys),
        lambda: torch._foreach_norm(ys),
    ]


@distributed(world_size=2)
@_with_fast_path
def test_foreach_calls_go_straight_to_the_dispatcher():
    """Under no_grad a foreach call of a kind seen before skips the C++ re-entry
    (_foreach_replay): same values and placements as plain torch, on every placement (uneven
    shards, Partial inputs that the op reduces), the written lists' versions bumped."""
    from dtensor_lite import Partial, _fast_path, _foreach_replay
    from tests._spies import calls_of
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    shapes = [(5, 3), (4,), (3, 7), (6, 2)]
    layouts = [Shard(0), Replicate(), Shard(1), Shard(0)]
    full = [[torch.rand(s) + 0.5 for s in shapes] for _ in range(3)]
    dts = [[distribute_tensor(t, mesh, [p]) for t, p in zip(ts, layouts)] for ts in full]
    plain = [[t.clone() for t in ts] for ts in full]
    coef = torch.tensor(0.5)
    dcoef = distribute_tensor(coef, mesh, [Replicate()])
    with torch.no_grad():
        for step in range(3):
            with calls_of(_fast_path, "_ordinary") as ordinary:
                ours = [f() for f in _foreach_cases(*dts, dcoef, step)]
            theirs = [f() for f in _foreach_cases(*plain, coef, step)]
            if step:  # learned at the first call: none of these calls takes the ordinary way
                assert not [a for a in ordinary if any(a[2][0] is ts for ts in dts)]
            for o, t in zip(ours, theirs):
                if t is None:
                    assert o is None
                    continue
                assert type(o) is type(t) and len(o) == len(t)
                for od, td in zip(o, t):
                    # elementwise: bit-exact; a norm sums shards apart (float32, a few terms)
                    torch.testing.assert_close(od.full_tensor(), td)
            for ds, ps in zip(dts, plain):
                for d, p, layout in zip(ds, ps, layouts):
                    assert d.placements == (layout,)
                    torch.testing.assert_close(d.full_tensor(), p, rtol=0, atol=0)
    assert any(v is not _foreach_replay.NO_SHORTCUT for v in _foreach_replay.LEARNED.values())
    xs = dts[0]
    # each in-place call bumps the versions of the list it writes into, once
    with torch.no_grad():
        before = [x._version for x in xs]
        torch._foreach_mul_(xs, 1.0)
        assert [x._version for x in xs] == [v + 1 for v in before]
    # ... so autograd still catches a write into a tensor it saved
    w = distribute_tensor(torch.ones(5, 3), mesh, [Shard(0)]).requires_grad_()
    out = (w * xs[0]).sum()
    with torch.no_grad():
        torch._foreach_add_(xs, dts[1], alpha=0.5)
    try:
        out.backward()
        raise AssertionError("the foreach write went unnoticed by autograd")
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
    # Partial inputs (gradients before their reduction): reduced by the op, as the ordinary way
    params = [distribute_tensor(torch.ones(4, 2), mesh, [Replicate()]) for _ in range(2)]
    rank = torch.distributed.get_rank()
    for _ in range(2):
        grads = [DTensor.from_local(torch.full((4, 2), float(rank + 1)), mesh, [Partial()])
                 for _ in range(2)]
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-0.5)
    for p in params:  # each step subtracts 0.5 * (1 + 2)
        torch.testing.assert_close(p.full_tensor(), torch.full((4, 2), 1.0 - 2 * 1.5))
    # lists of other lengths than learned: torch's own checks, as the ordinary way gives them
    with torch.no_grad():
        for call, message in [
                (lambda: torch._foreach_add_(xs, dts[1][:2], alpha=0.5), "same number of tensors"),
                (lambda: torch._foreach_div_(dts[1], [1.0, 2.0]), "same number of elements")]:
            try:
                call()
                raise AssertionError("lists of different lengths were accepted")
            except RuntimeError as e:
                assert message in str(e)
    # grad mode on, or inference mode: the ordinary way (autograd records; torch counts no
    # versions), with the same values
    ys = [distribute_tensor(torch.ones(3), mesh, [Shard(0)]) for _ in range(2)]
    for context in (torch.enable_grad, torch.inference_mode):
        with context(), calls_of(_fast_path, "_ordinary") as ordinary:
            torch._foreach_mul_(ys, 2.0)
        assert len(ordinary) == 1
    for y in ys:
        torch.testing.assert_close(y.full_tensor(), torch.full((3,), 4.0))

class _FunctionSub(torch.Tensor):
    """A plain subclass: torch's default ``__torch_function__`` keeps it through every op."""


class _Wrapper(torch.Tensor):
    """A ``__torch_dispatch__`` wrapper subclass around one inner tensor."""

    @staticmethod
    def __new__(cls, inner):
        r = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                dtype=inner.dtype, device=inner.device)
        r.inner = inner
        return r

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return _Wrapper(inner_tensors["inner"])

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(a):
            return a.inner if isinstance(a, _Wrapper) else a
        out = func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})
        return _Wrapper(out) if isinstance(out, torch.Tensor) else out


@distributed(world_size=2)
@_with_fast_path
def test_local_piece_subclasses_survive_ordinary_and_replayed_calls():
    # the ordinary path once ran under DisableTorchFunctionSubclass, which turned an FSDP
    # extension's subclass weight into a plain tensor at nn.Parameter(...)/detach
    mesh = init_device_mesh("cpu", (2,))
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    for make in (lambda t: t.as_subclass(_FunctionSub), _Wrapper):
        sub = type(make(x))
        rank = torch.distributed.get_rank()
        a = DTensor.from_local(make(x.chunk(2)[rank]), mesh, [Shard(0)])
        b = DTensor.from_local(make(y.chunk(2)[rank]), mesh, [Shard(0)])
        checks = [(torch.nn.Parameter(a, requires_grad=False), x), (a.detach(), x)]
        for _ in range(3):  # learned, then replayed
            checks += [(a + b, x + y), (a * 2.0, x * 2.0), (torch.relu(a), torch.relu(x))]
        for out, ref in checks:
            assert isinstance(out, DTensor) and type(out.to_local()) is sub, type(out.to_local())
            torch.testing.assert_close(out.to_local().as_subclass(torch.Tensor) if sub is
                                       _FunctionSub else out.to_local().inner, ref.chunk(2)[rank])


@distributed(world_size=2)
def test_metadata_reads_answer_as_without_the_hook():
    # DTensor's metadata properties/methods (installed with the shortcut) read the wrapper with
    # the hook off; uninstall() restores torch's descriptors
    from dtensor_lite import _fast_path
    mesh = init_device_mesh("cpu", (2,))
    a = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]).requires_grad_()
    a.sum().backward()

    def reads(t):
        return (t.shape, t.dtype, t.device, t.ndim, t.layout, t.requires_grad, t.grad.shape,
                t.is_leaf, t.grad_fn, t.is_cuda, t.is_sparse, t.size(), t.size(-1), t.dim(),
                t.stride(), t.numel(), t.element_size(), t.is_floating_point(),
                (t * 2).grad_fn is not None, t.view(4, 6).shape)
    with _fast_path.enabled(True):
        assert "shape" in DTensor.__dict__
        on = reads(a)
        b = a.detach()
        b.requires_grad = True
        b.grad = torch.ones_like(b)
        assert b.requires_grad and b.grad.shape == (6, 4)
        b.grad = None
        assert b.grad is None
    with _fast_path.enabled(False):
        assert "shape" not in DTensor.__dict__
        assert reads(a) == on


@distributed(world_size=2)
def test_linear_and_attention_are_intercepted_for_dtensors_only():
    # F.linear and F.scaled_dot_product_attention on DTensors run dtensor_lite's own forms
    # (a row-local linear keeps Shard(0) without a gather; attention runs in the DTensor scope)
    # with the hook installed or not; with it, plain calls keep torch's own autograd kernels
    # (no Python kernel in front of every F.linear of the process). Calls the hook cannot see
    # (C++ callers, torch function off) run the op's decomposition, as PyTorch's DTensor does.
    from dtensor_lite import _fast_path
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    rank = torch.distributed.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 6), torch.randn(4, 6), torch.randn(4)  # 5 rows: pieces of 3 and 2
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    ref = F.linear(xr, wr, br)
    ref.sum().backward()
    ref_att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for hook in (True, False):
        with _fast_path.enabled(hook):
            for op in ("aten::linear", "aten::scaled_dot_product_attention"):
                assert has_kernel(op, "AutogradCPU") is not hook, (op, hook)
            assert has_kernel("aten::one_hot", "AutogradCPU")  # rare in plain code: always
            dx = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
            dw = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
            db = distribute_tensor(b, mesh, [Replicate()]).requires_grad_()
            out = F.linear(dx, dw, db)
            assert out.placements == (Shard(0),), (hook, out.placements)
            by_name = F.linear(input=dx, weight=dw, bias=db)  # keywords reach it as they are
            assert by_name.placements == (Shard(0),) and torch.equal(by_name.to_local(),
                                                                      out.to_local())
            # a 6-term dot product per element on either side: float32 default tolerances
            torch.testing.assert_close(out.to_local(), ref.detach()[:3] if rank == 0 else
                                       ref.detach()[3:])
            out.to_local().sum().backward()
            torch.testing.assert_close(dx.grad.full_tensor(), xr.grad)
            torch.testing.assert_close(dw.grad.full_tensor(), wr.grad)
            torch.testing.assert_close(db.grad.full_tensor(), br.grad)
            dq, dk, dv = (distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k, v))
            att = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
            assert att.placements == (Shard(1),)
            torch.testing.assert_close(att.full_tensor(), ref_att)
            att = F.scaled_dot_product_attention(query=dq, key=dk, value=dv, attn_mask=None,
                                                 is_causal=True, scale=None)
            torch.testing.assert_close(att.full_tensor(), ref_att)
            with torch._C.DisableTorchFunctionSubclass():  # no hook: the decomposition
                unseen = F.linear(distribute_tensor(x, mesh, [Shard(0)]), dw.detach(),
                                  db.detach())
            torch.testing.assert_close(unseen.full_tensor(), ref.detach())


def test_a_spelled_local_call_must_see_the_same_tensors_in_its_lists():
    """The dispatcher calls ``torch.<name>`` for a cached op only where it runs exactly that op
    with the same arguments (``_quick_call.runs_exactly``, on meta tensors); for a foreach op's
    lists that means the same tensors, in order, reaching the same overload."""
    from dtensor_lite._quick_call import runs_exactly
    aten = torch.ops.aten
    xs, ys = [torch.ones(3), torch.ones(2, 2)], [torch.ones(3), torch.ones(2, 2)]
    assert runs_exactly(torch._foreach_add_, aten._foreach_add_.List, [xs, ys], {"alpha": 2.0})
    assert runs_exactly(torch._foreach_mul_, aten._foreach_mul_.Scalar, [xs, 0.5], {})
    # another overload (a list of numbers), or other tensors than given: not this call
    assert not runs_exactly(torch._foreach_mul_, aten._foreach_mul_.ScalarList, [xs, 0.5], {})
    same = [torch.ones(3), torch.ones(3)]
    assert not runs_exactly(lambda a, b: torch._foreach_add_(list(reversed(a)), b),
                            aten._foreach_add_.List, [same, same], {})
