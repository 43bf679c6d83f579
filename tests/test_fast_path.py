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
