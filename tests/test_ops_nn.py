"""nn op rules against plain torch, forward and backward: embedding (replicated, vocab- and
column-sharded tables), layer/RMS norm, softmax, convolution and scaled_dot_product_attention,
on 1-D (4) and 2-D (2x2) meshes with uneven and empty shards, plus the paths that must not
communicate."""
import pytest
import torch
import torch.nn.functional as F

from dtensor_lite import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.collectives import all_reduce_cost
from dtensor_lite.debug import CommDebugMode
from tests.harness import TEST_DEVICE, distributed

R = Replicate()
aten = torch.ops.aten


def _meshes():
    return [init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))]


def _rand(*shape, seed=0, **kw):
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), **kw)


def _dist(t, mesh, placements, grad=True):
    """A leaf DTensor of global value ``t`` (Partial placements allowed). Every rank holds the
    same ``t``, so each slices its own piece (no scatter)."""
    placements = list(placements)
    if any(p.is_partial() for p in placements):
        dt = distribute_tensor(t, mesh, [R] * mesh.ndim, src_data_rank=None).redistribute(
            mesh, placements)
    else:
        dt = distribute_tensor(t, mesh, placements, src_data_rank=None)
    if grad and t.is_floating_point():
        dt.requires_grad_()
    return dt


def _grad_placements(out):
    # the gradient of a Partial value arrives replicated; of a sharded one, sharded alike
    return [R if p.is_partial() else p for p in out.placements]


def check(fn, tensors, placements, mesh, grads=True, tol=None, n_outs_with_grad=1,
          no_grad=(), grad_tol=None):
    """fn on DTensors == fn on plain tensors, for the outputs and every floating input's grad
    (except the inputs whose positions are in ``no_grad``); ``grad_tol`` defaults to ``tol``."""
    tol = tol or {}
    grad_tol = grad_tol or tol
    wants = [grads and t.is_floating_point() and k not in no_grad for k, t in enumerate(tensors)]
    ref_in = [t.detach().clone().requires_grad_(w) for t, w in zip(tensors, wants)]
    ref = fn(*ref_in)
    d_in = [_dist(t, mesh, p, w) for t, p, w in zip(tensors, placements, wants)]
    out = fn(*d_in)
    refs, outs = (ref, out) if isinstance(ref, tuple) else ((ref,), (out,))
    where = f"placements {placements}"
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o.full_tensor(), r, msg=lambda m: f"{where}: {m}", **tol)
    if not grads:
        return out
    for k in range(n_outs_with_grad):
        g = _rand(*refs[k].shape, seed=100 + k, dtype=refs[k].dtype)
        refs[k].backward(g, retain_graph=True)
        outs[k].backward(_dist(g, mesh, _grad_placements(outs[k]), grad=False), retain_graph=True)
    for t, d in zip(ref_in, d_in):
        if t.requires_grad:
            want = t.grad if t.grad is not None else torch.zeros_like(t)
            torch.testing.assert_close(d.grad.full_tensor(), want,
                                       msg=lambda m: f"grad, {where}: {m}", **grad_tol)
    return out


# ----------------------------------------------------------------------------- embedding
EMB_1D = [[R], [Shard(0)], [Shard(1)], [Partial()]]
IDS_1D = [[R], [Shard(0)], [Shard(1)]]
EMB_2D = [[Shard(0), R], [Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)],
          [Partial(), Shard(0)]]
IDS_2D = [[R, R], [Shard(0), R], [Shard(0), Shard(1)]]


@distributed(world_size=4)
@pytest.mark.parametrize("vocab", [10, 5])  # 5 rows on 4 ranks: one rank has an empty vocab shard
def test_embedding_forward_backward(vocab):
    weight = _rand(vocab, 6)
    ids = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(1))
    for mesh, ws, idss in zip(_meshes(), [EMB_1D, EMB_2D], [IDS_1D, IDS_2D]):
        for pw in ws:
            for pi in idss:
                check(lambda w, i: F.embedding(i, w), [weight, ids], [pw, pi], mesh)
    mesh = init_device_mesh("cpu", (4,))
    for kwargs in [dict(padding_idx=2), dict(padding_idx=vocab - 1, scale_grad_by_freq=True)]:
        for pw in EMB_1D[:3]:
            for pi in IDS_1D[:2]:
                check(lambda w, i: F.embedding(i, w, **kwargs), [weight, ids], [pw, pi], mesh)


@distributed(world_size=4)
def test_vocab_sharded_embedding_never_gathers_the_table():
    mesh = init_device_mesh("cpu", (4,))
    weight, ids = _rand(11, 8), torch.tensor([[0, 10, 3], [7, 7, 2]])
    w = _dist(weight, mesh, [Shard(0)])
    i = _dist(ids, mesh, [R])
    grad = distribute_tensor(torch.ones(2, 3, 8), mesh, [R])
    with CommDebugMode() as comm:
        out = F.embedding(i, w)
        out.backward(grad)
    assert comm.get_total_counts() == 0
    assert out.placements == (Partial(),)
    assert w.grad.placements == (Shard(0),)  # each rank wrote only its own rows
    ref = weight.clone().requires_grad_()
    F.embedding(ids, ref).backward(torch.ones(2, 3, 8))
    torch.testing.assert_close(out.full_tensor(), F.embedding(ids, weight))
    torch.testing.assert_close(w.grad.full_tensor(), ref.grad)

    # ids sharded on the same mesh dim as the vocab: the ids move, the table does not
    i_sharded = _dist(ids, mesh, [Shard(1)])
    with CommDebugMode() as comm:
        out = F.embedding(i_sharded, w)
    assert comm.get_comm_counts() == {"all_gather": 1}
    assert comm.get_total_bytes() < weight.numel() * weight.element_size() / 4
    torch.testing.assert_close(out.full_tensor(), F.embedding(ids, weight))

    # batch-sharded ids with a replicated table (data parallel): no comm, Partial weight grad
    w_rep = _dist(weight, mesh, [R])
    i_batch = _dist(ids, mesh, [Shard(1)])
    grad = distribute_tensor(torch.ones(2, 3, 8), mesh, [Shard(1)])
    with CommDebugMode() as comm:
        out = F.embedding(i_batch, w_rep)
        out.backward(grad)
    assert comm.get_total_counts() == 0
    assert out.placements == (Shard(1),) and w_rep.grad.placements == (Partial(),)
    torch.testing.assert_close(w_rep.grad.full_tensor(), ref.grad)

    # column-sharded table: output sharded on the last dim, no comm
    w_col = _dist(weight, mesh, [Shard(1)])
    grad = distribute_tensor(torch.ones(2, 3, 8), mesh, [Shard(2)])
    with CommDebugMode() as comm:
        out = F.embedding(i, w_col)
        out.backward(grad)
    assert comm.get_total_counts() == 0
    assert out.placements == (Shard(2),) and w_col.grad.placements == (Shard(1),)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="on a GPU an out-of-range id is a device-side "
                    "assert, as in torch's own kernel: it ends the process's CUDA context")
@distributed(world_size=4)
def test_embedding_out_of_range_id_is_an_error():
    mesh = init_device_mesh("cpu", (4,))
    w = _dist(_rand(6, 4), mesh, [Shard(0)])
    with pytest.raises(IndexError, match="out of range"):
        F.embedding(_dist(torch.tensor([1, 6]), mesh, [R]), w)


@pytest.mark.skipif(not torch.backends.cuda.is_built(),
                    reason="fake CUDA tensors need a torch built with CUDA (no GPU needed)")
def test_vocab_sharded_lookup_checks_ids_on_the_device_without_a_host_sync():
    """On a GPU the lookup of a vocab-sharded table asserts the ids' range on the device (as
    torch's kernel does) and never reads them on the host (that would stall every lookup). Run
    on fake CUDA tensors, so it is checked on any machine: the device assert is issued, no
    value is read (``_local_scalar_dense``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dtensor_lite.ops.nn import _masked_lookup
    from tests._spies import OpNames

    with FakeTensorMode():
        weight = torch.empty(3, 4, device="cuda")
        ids = torch.empty(2, 5, dtype=torch.long, device="cuda")
        with OpNames() as ops:
            out = _masked_lookup(weight, ids, start=3, rows=3, num_weights=6)
    assert out.shape == (2, 5, 4)
    assert "aten._assert_async.msg" in ops.names, ops.names
    assert not any("_local_scalar_dense" in n for n in ops.names), ops.names


# ----------------------------------------------------------------------------- norms
X_1D = [[R], [Shard(0)], [Shard(1)], [Shard(2)], [Partial()]]
X_2D = [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(2)], [Shard(2), Shard(2)],
        [Partial(), Shard(0)]]


@distributed(world_size=4)
def test_layer_norm():
    x, w, b = _rand(5, 3, 8), _rand(8, seed=1), _rand(8, seed=2)
    w2, b2 = _rand(3, 8, seed=3), _rand(3, 8, seed=4)
    for mesh, xs in zip(_meshes(), [X_1D, X_2D]):
        rep = [R] * mesh.ndim
        for px in xs:
            check(lambda x, w, b: F.layer_norm(x, (8,), w, b), [x, w, b], [px, rep, rep], mesh)
            if mesh.ndim == 1:
                check(lambda x, w, b: F.layer_norm(x, (3, 8), w, b), [x, w2, b2],
                      [px, rep, rep], mesh)
                check(lambda x: F.layer_norm(x, (8,)), [x], [px], mesh)
        # sharded parameters are gathered (they are tiny)
        check(lambda x, w, b: F.layer_norm(x, (8,), w, b), [x, w, b],
              [[Shard(0)] * mesh.ndim, [Shard(0)] * mesh.ndim, rep], mesh)


@distributed(world_size=4)
def test_layer_norm_sequence_sharded_is_local_and_param_grads_are_partial():
    mesh = init_device_mesh("cpu", (2, 2))
    x = _dist(_rand(4, 6, 8), mesh, [Shard(0), Shard(1)])  # batch on dp, sequence on tp
    w, b = _dist(_rand(8, seed=1), mesh, [R, R]), _dist(_rand(8, seed=2), mesh, [R, R])
    grad = distribute_tensor(_rand(4, 6, 8, seed=3), mesh, [Shard(0), Shard(1)])
    with CommDebugMode() as comm:
        y = F.layer_norm(x, (8,), w, b)
        y.backward(grad)
    assert comm.get_total_counts() == 0
    assert y.placements == (Shard(0), Shard(1))
    assert w.grad.placements == (Partial(), Partial()) == b.grad.placements


@distributed(world_size=4)
def test_rms_norm():
    # F.rms_norm decomposes on CPU (pow, mean, add, rsqrt, mul): rows stay sharded, and a
    # sharded normalised dim goes through the mean's Partial
    x, w = _rand(5, 3, 8), _rand(8, seed=1)
    for mesh in _meshes():
        rep = [R] * mesh.ndim
        for px in ([[Shard(0)], [Shard(1)], [Shard(2)], [R]] if mesh.ndim == 1 else
                   [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(2)],
                    [Shard(2), Shard(2)]]):
            check(lambda x, w: F.rms_norm(x, (8,), w, eps=1e-6), [x, w], [px, rep], mesh)
            check(lambda x: F.rms_norm(x, (8,)), [x], [px], mesh)


_CPU_KERNELS = []


def _give_fused_rms_norm_backward_a_cpu_kernel():
    """aten._fused_rms_norm_backward has kernels for CUDA/MPS only; for this test, run torch's
    own decomposition as its CPU kernel (registered once per worker process)."""
    if _CPU_KERNELS:
        return
    from torch._decomp.decompositions import _fused_rms_norm_backward
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_fused_rms_norm_backward", _fused_rms_norm_backward, "CPU")
    _CPU_KERNELS.append(lib)


@distributed(world_size=4)
def test_fused_rms_norm_rule():
    # aten._fused_rms_norm reaches __torch_dispatch__ only on devices where it has a kernel
    # (CPU decomposes F.rms_norm above the dispatcher), so the rule is driven directly
    from dtensor_lite._dispatch import dispatch
    _give_fused_rms_norm_backward_a_cpu_kernel()
    fwd, bwd = aten._fused_rms_norm.default, aten._fused_rms_norm_backward.default
    x, w, g = _rand(5, 3, 8), _rand(8, seed=1), _rand(5, 3, 8, seed=2)
    out, rstd = fwd(x, [8], w, 1e-6)
    gx, gw = bwd(g, x, [8], rstd, w, [True, True])
    for mesh, xs in zip(_meshes(), [X_1D[:4], X_2D[:5]]):
        rep = [R] * mesh.ndim
        for px in xs:
            dx, dw = _dist(x, mesh, px, False), _dist(w, mesh, rep, False)
            dout, drstd = dispatch(fwd, (dx, [8], dw, 1e-6), {})
            torch.testing.assert_close(dout.full_tensor(), out)
            torch.testing.assert_close(drstd.full_tensor(), rstd)
            dg = _dist(g, mesh, dout.placements, False)
            dgx, dgw = dispatch(bwd, (dg, dx, [8], drstd, dw, [True, True]), {})
            torch.testing.assert_close(dgx.full_tensor(), gx)
            torch.testing.assert_close(dgw.full_tensor(), gw)


# ----------------------------------------------------------------------------- softmax
@distributed(world_size=4)
def test_softmax_and_log_softmax():
    x = _rand(5, 3, 7)
    for mesh, xs in zip(_meshes(), [X_1D, X_2D]):
        for px in xs:
            for dim in (0, -1):  # px shards every dim in turn: sharded and unsharded softmax dims
                check(lambda x: F.softmax(x, dim), [x], [px], mesh)
                check(lambda x: F.log_softmax(x, dim), [x], [px], mesh)
    # low precision accumulates in float32, like torch: both forward results are float32 values
    # a few float32 ulps apart, rounded once to bf16, so they differ by at most one bf16 ulp
    # (2**-7 relative: 8 significant bits). Backward takes those outputs p: log_softmax's
    # g - p * sum(g) then differs by one ulp of p * sum(g) (p <= 1) plus the final rounding;
    # softmax's p * (g - <p, g>) by ulps of p * |g| and p * |<p, g>| (each <= max|g|).
    xb = _rand(4, 9).bfloat16()
    g = _rand(4, 9, seed=100, dtype=torch.bfloat16).float()  # the output gradient check() uses
    ulp = 2.0 ** -7
    one_bf16_ulp = dict(atol=0, rtol=ulp)
    log_softmax_grad = dict(atol=ulp * float(g.sum(-1).abs().max()), rtol=ulp)
    softmax_grad = dict(atol=3 * ulp * float(g.abs().max()), rtol=ulp)
    mesh = init_device_mesh("cpu", (4,))
    for px in ([Shard(1)], [Shard(0)]):
        check(lambda x: F.log_softmax(x, -1), [xb], [px], mesh, tol=one_bf16_ulp,
              grad_tol=log_softmax_grad)
        check(lambda x: F.softmax(x, -1), [xb], [px], mesh, tol=one_bf16_ulp,
              grad_tol=softmax_grad)
        check(lambda x: F.softmax(x, -1, dtype=torch.float32), [xb], [px], mesh)


@distributed(world_size=4)
def test_softmax_over_sharded_dim_only_all_reduces_row_statistics():
    x = _rand(6, 10)
    for mesh, px, n_reducing_dims in [(init_device_mesh("cpu", (4,)), [Shard(1)], 1),
                                      (init_device_mesh("cpu", (2, 2)), [Shard(1), Shard(1)], 2),
                                      (init_device_mesh("cpu", (2, 2)), [Shard(0), Shard(1)], 1)]:
        for fn in (F.softmax, F.log_softmax):
            dx = _dist(x, mesh, px)
            grad = distribute_tensor(_rand(6, 10, seed=1), mesh, px)
            with CommDebugMode() as comm:
                y = fn(dx, -1)
                y.backward(grad)
            # forward: row max + sum of exp; backward: one row sum -- per reducing mesh dim
            assert comm.get_comm_counts() == {"all_reduce": 3 * n_reducing_dims}
            assert y.placements == tuple(px)
            ref = x.clone().requires_grad_()
            fn(ref, -1).backward(_rand(6, 10, seed=1))
            torch.testing.assert_close(y.full_tensor(), fn(x, -1))
            torch.testing.assert_close(dx.grad.full_tensor(), ref.grad)


# ----------------------------------------------------------------------------- convolution
@distributed(world_size=4)
def test_conv1d_conv2d():
    mesh1, mesh2 = _meshes()
    x1, w1, b1 = _rand(5, 4, 9), _rand(3, 4, 3, seed=1), _rand(3, seed=2)
    x2, w2, b2 = _rand(5, 4, 6, 7), _rand(6, 4, 3, 3, seed=1), _rand(6, seed=2)
    conv1 = lambda x, w, b: F.conv1d(x, w, b, padding=1)  # noqa: E731
    conv2 = lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1)  # noqa: E731
    for conv, (x, w, b) in ((conv1, (x1, w1, b1)), (conv2, (x2, w2, b2))):
        for pl in [([Shard(0)], [R], [R]),             # data parallel
                   ([R], [Shard(0)], [Shard(0)]),      # out-channel parallel (3 on 4: one empty)
                   ([Shard(1)], [Shard(1)], [R]),      # in-channel parallel -> Partial
                   ([Partial()], [R], [R]),
                   ([Shard(2)], [R], [R]),             # spatial: gathered
                   ([R], [R], [R])]:
            check(conv, [x, w, b], list(pl), mesh1)
        for pl in [([Shard(0), R], [R, R], [R, R]),
                   ([Shard(0), R], [R, Shard(0)], [R, Shard(0)]),
                   ([Shard(0), Shard(1)], [R, Shard(1)], [R, R]),
                   ([Shard(0), Shard(0)], [R, R], [R, R])]:
            check(conv, [x, w, b], list(pl), mesh2)
    # no bias, groups, transposed
    wg = _rand(4, 2, 3, seed=3)
    for px in ([Shard(0)], [Shard(1)]):
        check(lambda x, w: F.conv1d(x, w, groups=2), [x1, wg], [px, [Shard(0)]], mesh1)
    wt = _rand(4, 3, 3, seed=4)
    for px, pw in (([Shard(0)], [R]), ([R], [Shard(1)]), ([Shard(1)], [Shard(0)])):
        check(lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2), [x1, wt, b1],
              [px, pw, [R]], mesh1)


@distributed(world_size=4)
def test_conv_channel_sharded_with_empty_pieces():
    # 3 channels on 4 ranks: one rank holds no input channels (torch's conv gives that a wrong
    # shape; it must contribute just its share of the bias to the Partial sum) or no out-channels
    mesh1, mesh2 = _meshes()
    x, w, b = _rand(2, 3, 5, 5), _rand(3, 3, 3, 3, seed=1), _rand(3, seed=2)
    conv = lambda x, w, b: F.conv2d(x, w, b, padding=1)  # noqa: E731
    for pl in [([Shard(1)], [Shard(1)], [Shard(0)]), ([Shard(1)], [Shard(0)], [Shard(0)]),
               ([Shard(1)], [Shard(1)], [Partial()])]:
        check(conv, [x, w, b], list(pl), mesh1)
    check(conv, [x, w, b], [[Shard(1), Shard(1)], [Shard(0), Shard(0)], [Shard(0), Shard(0)]],
          mesh2)
    # unbatched input (F.conv2d unsqueezes it): its channel dim is dim 0
    check(lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=2), [x[0], w, b],
          [[Shard(0), Shard(0)], [Shard(0), Shard(0)], [Shard(0), Shard(0)]], mesh2)
    xt, wt = _rand(2, 3, 7), _rand(3, 2, 3, seed=3)  # transposed: weight is [in, out, k]
    for px, pw in (([Shard(1)], [Shard(0)]), ([R], [Shard(1)])):
        check(lambda x, w: F.conv_transpose1d(x, w, stride=2), [xt, wt], [px, pw], mesh1)


@distributed(world_size=4)
def test_grouped_conv_channel_sharded():
    mesh1, mesh2 = _meshes()
    # groups of 2 in-channels / 2 out-channels, one group per rank: group-parallel, no comm
    x, w, b = _rand(3, 8, 9), _rand(8, 2, 3, seed=1), _rand(8, seed=2)
    conv = lambda x, w, b: F.conv1d(x, w, b, padding=1, groups=4)  # noqa: E731
    dx, dw, db = _dist(x, mesh1, [Shard(1)]), _dist(w, mesh1, [Shard(0)]), _dist(b, mesh1, [Shard(0)])
    grad = distribute_tensor(_rand(3, 8, 9, seed=3), mesh1, [Shard(1)])
    with CommDebugMode() as comm:
        y = conv(dx, dw, db)
        y.backward(grad)
    assert comm.get_total_counts() == 0
    assert y.placements == (Shard(1),) and dw.grad.placements == (Shard(0),)
    for mesh, pls in ((mesh1, [([Shard(1)], [Shard(0)], [Shard(0)]),
                               ([Shard(1)], [R], [R]), ([R], [Shard(0)], [R]),
                               ([Shard(1)], [Shard(1)], [Shard(0)])]),
                      (mesh2, [([Shard(0), Shard(1)], [R, Shard(0)], [R, Shard(0)]),
                               ([Shard(1), Shard(1)], [Shard(0), Shard(0)], [R, R]),
                               ([Shard(1), R], [R, Shard(0)], [Shard(0), R])])):
        for pl in pls:
            check(conv, [x, w, b], list(pl), mesh)
    # chunks that cut through groups (6 channels in groups of 3, split 2,2,2,0): the channels are
    # replicated instead, on every rank alike
    x6, w6, b6 = _rand(3, 6, 9), _rand(6, 3, 3, seed=4), _rand(6, seed=5)
    conv6 = lambda x, w, b: F.conv1d(x, w, b, groups=2)  # noqa: E731
    for pl in (([Shard(1)], [Shard(0)], [Shard(0)]), ([Shard(1)], [Shard(1)], [R])):
        check(conv6, [x6, w6, b6], list(pl), mesh1)
    for pl in (([Shard(1), Shard(1)], [Shard(0), Shard(0)], [R, R]),
               ([Shard(1), R], [Shard(0), R], [Shard(0), R])):  # 3 and 3: whole groups
        check(conv6, [x6, w6, b6], list(pl), mesh2)
    # whole groups with an empty piece: 3 groups of 2 in / 1 out channel, split 1,1,1,0
    w3 = _rand(3, 2, 3, seed=6)
    check(lambda x, w: F.conv1d(x, w, groups=3), [x6, w3], [[Shard(1)], [Shard(0)]], mesh1)
    # transposed, grouped: weight [in, out / groups, k]; 4 in, 6 out channels in 2 groups
    xt, wt, bt = _rand(3, 4, 5), _rand(4, 3, 3, seed=7), _rand(6, seed=8)
    convt = lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2, groups=2)  # noqa: E731
    check(convt, [xt, wt, bt], [[Shard(1)], [Shard(0)], [Shard(0)]], mesh1)  # 1 per rank: cut
    check(convt, [xt, wt, bt], [[R, Shard(1)], [R, Shard(0)], [R, Shard(0)]], mesh2)  # whole
    dx, dw = _dist(xt, mesh2, [R, Shard(1)]), _dist(wt, mesh2, [R, Shard(0)])
    with CommDebugMode() as comm:
        y = convt(dx, dw, _dist(bt, mesh2, [R, Shard(0)]))
    assert comm.get_total_counts() == 0 and y.placements == (R, Shard(1))


@distributed(world_size=4)
def test_batch_sharded_conv_does_not_communicate():
    mesh = init_device_mesh("cpu", (4,))
    x = _dist(_rand(8, 3, 10), mesh, [Shard(0)])
    w, b = _dist(_rand(5, 3, 3, seed=1), mesh, [R]), _dist(_rand(5, seed=2), mesh, [R])
    grad = distribute_tensor(_rand(8, 5, 8, seed=3), mesh, [Shard(0)])
    with CommDebugMode() as comm:
        y = F.conv1d(x, w, b)
        y.backward(grad)
    assert comm.get_total_counts() == 0
    assert y.placements == (Shard(0),)
    assert w.grad.placements == (Partial(),) and b.grad.placements == (Partial(),)


# ----------------------------------------------------------------------------- attention
QKV_1D = [[R], [Shard(0)], [Shard(1)], [Shard(2)], [Shard(3)]]
QKV_2D = [[Shard(0), Shard(1)], [Shard(1), Shard(2)], [Shard(2), Shard(2)], [Shard(0), Shard(3)],
          [R, Shard(1)]]


@distributed(world_size=4)
def test_sdpa_forward_backward():
    # B=5 and H=3 leave a rank with an empty batch / head shard; L=6 rows split 2,2,2,0
    q, k, v = _rand(5, 3, 6, 8), _rand(5, 3, 6, 8, seed=1), _rand(5, 3, 6, 8, seed=2)
    mask = _rand(6, 6, seed=3)
    bmask = _rand(5, 1, 6, 6, seed=4)
    for mesh, pls in zip(_meshes(), [QKV_1D, QKV_2D]):
        rep = [R] * mesh.ndim
        for p in pls:
            for causal in (False, True):
                check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                      [q, k, v], [p, p, p], mesh)
            check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                  [q, k, v, mask], [p, p, p, rep], mesh)
            check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                                    scale=0.3),
                  [q, k, v, bmask], [p, p, p, [Shard(0)] * mesh.ndim], mesh)
    # boolean mask, cross attention (L != S) with causal masking on sharded query rows
    mesh = init_device_mesh("cpu", (4,))
    kk, vv = _rand(5, 3, 9, 8, seed=5), _rand(5, 3, 9, 8, seed=6)
    bool_mask = _rand(6, 9, seed=7) > 0
    for p in ([Shard(2)], [Shard(1)], [Shard(0)]):
        check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
              [q, kk, vv], [p, p, p], mesh)
        check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
              [q, kk, vv, bool_mask], [p, p, p, [Shard(0)]], mesh)
    # only the query rows sharded (keys/values whole): causal masking needs each rank's row offset
    mesh1, mesh2 = mesh, init_device_mesh("cpu", (2, 2))
    for kv in ((k, v), (kk, vv)):
        for mesh, pq, pkv in [(mesh1, [Shard(2)], [R]),
                              (mesh2, [Shard(0), Shard(2)], [Shard(0), R]),
                              (mesh2, [Shard(2), Shard(2)], [R, R])]:
            for causal in (True, False):
                check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                      [q, *kv], [pq, pkv, pkv], mesh)


@pytest.mark.skipif(not torch.backends.cuda.is_built(),
                    reason="fake CUDA tensors need a torch built with CUDA (no GPU needed)")
def test_cuda_attention_kernels_get_pieces_with_a_unit_last_stride():
    """The fused CUDA attention kernels refuse a query/key/value whose last dim is strided
    ("last dimension must be contiguous", on an H200); a redistributed piece may be: the local
    call makes it contiguous. On fake CUDA tensors, so it is checked on any machine."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from dtensor_lite.ops.attention import _fused_local

    op = torch.ops.aten._scaled_dot_product_efficient_attention.default

    class Strides(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is op:
                Strides.seen.append([a.stride(-1) for a in args[:3]])
            return func(*args, **(kwargs or {}))

    with FakeTensorMode():
        q = torch.empty(2, 3, 8, 6, device="cuda").transpose(-1, -2)  # strides (.., 1, 6)
        k, v = (torch.empty(2, 3, 6, 8, device="cuda") for _ in range(2))
        with Strides():
            out = _fused_local(op, q, k, v, None, True)
    assert Strides.seen == [[1, 1, 1]] and out[0].shape == (2, 3, 6, 8)


@distributed(world_size=4)
def test_sdpa_communication():
    mesh = init_device_mesh("cpu", (2, 2))
    q, k, v = (_rand(4, 4, 6, 8, seed=s) for s in range(3))
    # batch on dp, heads on tp: attention is local, forward and backward
    dq, dk, dv = (_dist(t, mesh, [Shard(0), Shard(1)]) for t in (q, k, v))
    grad = distribute_tensor(_rand(4, 4, 6, 8, seed=9), mesh, [Shard(0), Shard(1)])
    with CommDebugMode() as comm:
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
        grads = torch.autograd.grad(out, (dq, dk, dv), grad)
    assert comm.get_total_counts() == 0
    assert out.placements == (Shard(0), Shard(1))
    assert all(g.placements == (Shard(0), Shard(1)) for g in grads)
    # queries split by rows against whole keys/values (cross attention): local, keys/values get
    # Partial grads
    dq, dk, dv = _dist(q, mesh, [Shard(0), Shard(2)]), _dist(k, mesh, [Shard(0), R]), \
        _dist(v, mesh, [Shard(0), R])
    grad = distribute_tensor(_rand(4, 4, 6, 8, seed=9), mesh, [Shard(0), Shard(2)])
    with CommDebugMode() as comm:
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
        grads = torch.autograd.grad(out, (dq, dk, dv), grad)
    assert comm.get_total_counts() == 0
    assert out.placements == (Shard(0), Shard(2))
    assert [g.placements for g in grads] == [(Shard(0), Shard(2)), (Shard(0), Partial()),
                                             (Shard(0), Partial())]
    # sequence-sharded self-attention: gathering k and v (two collectives) beats re-splitting
    # q/k/v by heads (three) for small tensors under the planner's latency term ...
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    dq, dk, dv = (_dist(t, mesh, [Shard(0), Shard(2)]) for t in (q, k, v))
    with CommDebugMode() as comm:
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
    assert comm.get_comm_counts() == {"all_gather": 2}
    torch.testing.assert_close(out.full_tensor(), ref)
    # ... and for large ones it is cheaper to re-split them by heads (all-to-all, as in Ulysses:
    # 1.5 pieces' bytes against 2) once the bytes saved outweigh a collective's latency and
    # the one the head-sharded result will cost its consumer (ops/_expansion.py's
    # _resolve_later): 512 KB pieces
    bq, bk, bv = (_rand(2, 4, 1024, 64, seed=s) for s in range(3))
    dq, dk, dv = (_dist(t, mesh, [Shard(0), Shard(2)]) for t in (bq, bk, bv))
    with CommDebugMode() as comm:
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
    assert comm.get_comm_counts() == {"all_to_all": 3}
    torch.testing.assert_close(out.full_tensor(),
                               F.scaled_dot_product_attention(bq, bk, bv, is_causal=True))
    # ... unless there are no heads to split: then only k and v are gathered, queries stay split
    q1, k1, v1 = (_rand(1, 1, 8, 4, seed=s) for s in range(3))
    dq, dk, dv = (_dist(t, mesh, [Shard(2), Shard(2)]) for t in (q1, k1, v1))
    with CommDebugMode() as comm:
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
    assert comm.get_comm_counts() == {"all_gather": 4}  # k and v, over both mesh dims
    assert out.placements == (Shard(2), Shard(2))
    torch.testing.assert_close(out.full_tensor(),
                               F.scaled_dot_product_attention(q1, k1, v1, is_causal=True))


@distributed(world_size=4)
def test_sdpa_math_path():
    # a value head dim unlike the query's sends F.scaled_dot_product_attention down the math
    # path on CPU (matmuls and aten._safe_softmax), which must work on DTensors as well
    q, k, v = _rand(5, 3, 6, 8), _rand(5, 3, 7, 8, seed=1), _rand(5, 3, 7, 4, seed=2)
    mask = _rand(6, 7, seed=3) > -1
    mesh = init_device_mesh("cpu", (4,))
    for p in ([Shard(0)], [Shard(1)], [R]):
        check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [q, k, v], [p, p, p], mesh)
        check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
              [q, k, v, mask], [p, p, p, [R]], mesh)
    # is_causal: the math path builds its causal mask from scratch (a plain tensor before); it is
    # the same on every rank and becomes replicated. Batch 5 / heads 3 on 4 ranks: empty shards
    bmask = _rand(5, 1, 6, 7, seed=4)  # per batch, broadcast over heads: sharded like the scores
    for m, pls in ((mesh, [[Shard(0)], [Shard(1)], [Shard(2)], [R]]),
                   (init_device_mesh("cpu", (2, 2)), [[Shard(0), Shard(1)], [Shard(1), Shard(0)],
                                                      [Shard(1), Shard(1)], [R, Shard(0)]])):
        for p in pls:
            check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                  [q, k, v], [p, p, p], m)
            check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                  [q, k, v, bmask], [p, p, p, [Shard(0)] + [R] * (m.ndim - 1)], m)
    # 3-D inputs (no head dim) always take the math path, as OpInfo's samples do
    q3, k3, v3 = q[:, 0], k[:, 0], _rand(5, 7, 8, seed=5)
    for p in ([Shard(0)], [Shard(1)], [R]):
        for causal in (False, True):
            check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                  [q3, k3, v3], [p, p, p], mesh)
    # a plain mask (or q/k/v) beside DTensors is an error naming the argument
    dq, dk, dv = (_dist(t, mesh, [Shard(0)]) for t in (q, k, v))
    with pytest.raises(ValueError, match="attn_mask is a plain torch.Tensor"):
        F.scaled_dot_product_attention(dq, dk, dv, attn_mask=mask)
    with pytest.raises(ValueError, match="value is a plain torch.Tensor"):
        F.scaled_dot_product_attention(dq, dk, v)


@distributed(world_size=4)
def test_sdpa_inference_mode():
    # without autograd keys SDPA reaches the dispatcher whole: it decomposes to the fused kernel
    mesh = init_device_mesh("cpu", (2, 2))
    q, k, v = (_rand(5, 3, 6, 8, seed=s) for s in range(3))
    for p in ([Shard(0), Shard(1)], [Shard(1), Shard(2)]):
        d = [_dist(t, mesh, p, grad=False) for t in (q, k, v)]
        for causal in (False, True):
            with torch.inference_mode():
                out = F.scaled_dot_product_attention(*d, is_causal=causal)
            torch.testing.assert_close(out.full_tensor(),
                                       F.scaled_dot_product_attention(q, k, v, is_causal=causal))


@distributed(world_size=4)
def test_safe_softmax_over_sharded_dim():
    x = _rand(4, 8)
    x[1] = float("-inf")  # a fully masked row: 0, not NaN
    x[2, :5] = float("-inf")
    ref = aten._safe_softmax.default(x, -1)
    for mesh, px in [(init_device_mesh("cpu", (4,)), [Shard(1)]),
                     (init_device_mesh("cpu", (2, 2)), [Shard(1), Shard(1)]),
                     (init_device_mesh("cpu", (4,)), [Shard(0)])]:
        out = aten._safe_softmax.default(_dist(x, mesh, px, grad=False), -1)
        torch.testing.assert_close(out.full_tensor(), ref)


# ----------------------------------------------------------------------------- one_hot
@distributed(world_size=4)
def test_one_hot():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 6, (5, 3), generator=gen)
    ids[4, 2] = 6  # the largest id sits in the last (short) row shard
    short = torch.tensor([[2, 0], [4, 1], [0, 3]])  # 3 rows, 2 columns on 4 ranks: empty pieces
    mesh1, mesh2 = _meshes()
    cases = [(mesh1, [[R], [Shard(0)], [Shard(1)], [Partial()]]),
             (mesh2, [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)],
                      [R, Shard(0)]])]
    for mesh, pls in cases:
        for p in pls:
            for t in (ids, short):
                for n in (-1, 9):
                    out = F.one_hot(_dist(t, mesh, p), n)
                    torch.testing.assert_close(out.full_tensor(), F.one_hot(t, n))
                    # the shard of the ids stays; the new class dim is whole
                    assert out.placements == tuple(R if q.is_partial() else q for q in p)
            with torch.inference_mode():
                out = F.one_hot(_dist(ids, mesh, p, grad=False))
            torch.testing.assert_close(out.full_tensor(), F.one_hot(ids))
    # the class count and the range checks read the global data: one all-reduce of (min, max),
    # and the same answer (or error) on every rank, also where a rank's own piece is fine
    d = _dist(ids, mesh1, [Shard(0)])
    with CommDebugMode() as comm:
        out = F.one_hot(d)
    assert comm.get_comm_counts() == {"all_reduce": 1} and out.shape == (5, 3, 7)
    with pytest.raises(RuntimeError, match="smaller than num_classes=6"):
        F.one_hot(d, 6)  # only the last rank holds the 6
    bad = ids.clone()
    bad[0, 0] = -1
    with pytest.raises(RuntimeError, match="non-negative"):
        F.one_hot(_dist(bad, mesh1, [Shard(0)]))
    with pytest.raises(RuntimeError, match="can not infer"):
        F.one_hot(_dist(torch.zeros(0, 3, dtype=torch.long), mesh1, [Shard(0)]))
    empty = F.one_hot(_dist(torch.zeros(0, 3, dtype=torch.long), mesh1, [Shard(1)]), 4)
    assert empty.shape == (0, 3, 4) and empty.placements == (Shard(1),)
    # one-hot rows as a float DTensor feed differentiable ops as usual
    w = _rand(7, 4)
    check(lambda w, i: F.one_hot(i).float() @ w, [w, ids], [[R], [Shard(0)]], mesh1)


# ----------------------------------------------------------------------------- batch norm
def _bn_case(mesh, x, px, pstats, training=True, steps=1, affine=True):
    """F.batch_norm on DTensors against nn.BatchNorm on one process, ``steps`` times (running
    statistics accumulate): outputs, input / weight / bias gradients, running statistics."""
    c = x.shape[1]
    ref = (torch.nn.BatchNorm1d if x.ndim == 3 else torch.nn.BatchNorm2d)(c, affine=affine)
    ref.train(training)
    if affine:
        with torch.no_grad():
            ref.weight.copy_(_rand(c, seed=5))
            ref.bias.copy_(_rand(c, seed=6))
    if not training:  # evaluation reads running statistics: make them non-trivial
        ref.running_mean.copy_(_rand(c, seed=7))
        ref.running_var.copy_(_rand(c, seed=8).abs() + 0.5)
    rm = distribute_tensor(ref.running_mean.clone(), mesh, pstats, src_data_rank=None)
    rv = distribute_tensor(ref.running_var.clone(), mesh, pstats, src_data_rank=None)
    w = b = None
    if affine:
        w = _dist(ref.weight.detach(), mesh, [R] * mesh.ndim)
        b = _dist(ref.bias.detach(), mesh, [R] * mesh.ndim)
    where = f"x {tuple(x.shape)} {px}, stats {pstats}, training={training}"
    # float32: each statistic sums ~50 values per channel (accumulated in float64 as torch does),
    # then one division / rsqrt: the outputs agree to a few ulp; gradients sum products once more
    tol = dict(rtol=1e-5, atol=1e-5)
    for step in range(steps):
        xs = x + step
        xr = xs.clone().requires_grad_()
        yr = ref(xr)
        dx = _dist(xs, mesh, px)
        y = F.batch_norm(dx, rm, rv, w, b, training=training, momentum=0.1, eps=1e-5)
        # the input's layout stays (a second channel shard is gathered)
        kept = [p if p.is_shard() and (p.dim != 1 or p not in px[:i]) else R
                for i, p in enumerate(px)]
        assert any(p.is_partial() for p in px) or list(y.placements) == kept, where
        torch.testing.assert_close(y.full_tensor(), yr, msg=lambda m: f"{where}: {m}", **tol)
        g = _rand(*x.shape, seed=20 + step)
        yr.backward(g)
        y.backward(_dist(g, mesh, _grad_placements(y), grad=False))
        pairs = [(dx.grad, xr.grad)]
        if affine:
            pairs += [(w.grad, ref.weight.grad), (b.grad, ref.bias.grad)]
        for got, want in pairs:
            torch.testing.assert_close(got.full_tensor(), want,
                                       msg=lambda m: f"grad, {where}: {m}", **tol)
        if affine:
            w.grad = b.grad = None
            ref.weight.grad = ref.bias.grad = None
        for got, want in ((rm, ref.running_mean), (rv, ref.running_var)):
            assert got.placements == tuple(pstats)
            torch.testing.assert_close(got.full_tensor(), want,
                                       msg=lambda m: f"running stats, {where}: {m}", **tol)


BN_1D = [[Shard(0)], [Shard(1)], [Shard(2)], [Partial()]]
BN_2D = [[Shard(0), Shard(1)], [Shard(2), Shard(0)], [Shard(0), Shard(0)], [Shard(1), Shard(1)]]


@distributed(world_size=4)
@pytest.mark.parametrize("batch", [10, 3])  # 3,3,3,1 pieces; 3 on 4 ranks: one empty piece
def test_batch_norm_training_matches_one_process(batch):
    x1, x2 = _rand(batch, 5, 6, seed=1), _rand(batch, 3, 4, 5, seed=2)
    mesh1, mesh2 = _meshes()
    for px in BN_1D:
        _bn_case(mesh1, x1, px, [R], steps=2)  # the running statistics accumulate
    for px in BN_2D:
        _bn_case(mesh2, x2, px, [R, R])
    # running statistics sharded like the channels, or across a batch-sharded input
    _bn_case(mesh1, x1, [Shard(1)], [Shard(0)])
    _bn_case(mesh2, x2, [Shard(0), Shard(0)], [Shard(0), R])
    _bn_case(mesh1, x1, [Shard(0)], [R], affine=False)


@distributed(world_size=4)
def test_batch_norm_eval_matches_one_process():
    x = _rand(10, 5, 6, seed=1)
    mesh1, mesh2 = _meshes()
    for px in BN_1D:
        _bn_case(mesh1, x, px, [R], training=False)
    _bn_case(mesh2, x, [Shard(1), Shard(0)], [Shard(0), R], training=False)


@distributed(world_size=2)
def test_batch_norm_on_dtensors_takes_native_batch_norm_on_any_device():
    """F.batch_norm on DTensors runs native_batch_norm, whose rules keep a batch shard local, on
    every device: the composite would pick cuDNN's kernel on CUDA (no rule: the batch gathered).
    Taken with autograd on and off, in inference mode and in eval mode, and never for plain
    tensors; values against plain torch."""
    from dtensor_lite.ops import _registry

    calls = []
    taken = _registry.BY_FUNCTION[torch.batch_norm]
    _registry.BY_FUNCTION[torch.batch_norm] = lambda *a, **k: (calls.append(1), taken(*a, **k))[1]
    try:
        mesh = init_device_mesh("cpu", (2,))
        x, mean, var = _rand(6, 3, 4, seed=1), torch.zeros(3), torch.ones(3)
        dx = distribute_tensor(x, mesh, [Shard(0)])
        cases = [(True, torch.enable_grad), (True, torch.no_grad), (True, torch.inference_mode),
                 (False, torch.enable_grad)]
        for training, mode in cases:
            stats = [distribute_tensor(t.clone(), mesh, [R]) for t in (mean, var)]
            with mode():
                out = F.batch_norm(dx, *stats, training=training)
                want = F.batch_norm(x, mean.clone(), var.clone(), training=training)
            assert out.placements == (Shard(0),), (training, mode)
            torch.testing.assert_close(out.full_tensor(), want)
        n = len(calls)
        F.batch_norm(x, mean, var, training=True)
        assert n == len(calls) >= len(cases)
    finally:
        _registry.BY_FUNCTION[torch.batch_norm] = taken


@distributed(world_size=4)
def test_batch_norm_all_reduces_only_statistics():
    # batch-sharded input: forward all-reduces the per-channel sum, then the sum of squared
    # deviations (C float64 each); backward one all-reduce of [sum dy, sum dy * (x - mean)]
    mesh = init_device_mesh("cpu", (4,))
    n, c = 10, 5
    x = _dist(_rand(n, c, 6, seed=1), mesh, [Shard(0)])
    w, b = _dist(_rand(c, seed=2), mesh, [R]), _dist(_rand(c, seed=3), mesh, [R])
    rm = distribute_tensor(torch.zeros(c), mesh, [R])
    rv = distribute_tensor(torch.ones(c), mesh, [R])
    grad = distribute_tensor(_rand(n, c, 6, seed=4), mesh, [Shard(0)])
    with CommDebugMode() as comm:
        y = F.batch_norm(x, rm, rv, w, b, training=True)
        y.backward(grad)
    assert comm.get_comm_counts() == {"all_reduce": 3}
    # C float64 twice forward, 2C once backward: bytes of statistics, none of the input
    assert comm.get_total_bytes() == 2 * all_reduce_cost(c, 8, 4) + all_reduce_cost(2 * c, 8, 4)
    assert y.placements == x.grad.placements == (Shard(0),)
    assert w.grad.placements == b.grad.placements == (R,)
    # channel-sharded input, running statistics sharded alike: nothing moves
    xc = _dist(_rand(n, c, 6, seed=1), mesh, [Shard(1)])
    wc, bc = _dist(_rand(c, seed=2), mesh, [Shard(0)]), _dist(_rand(c, seed=3), mesh, [Shard(0)])
    rmc = distribute_tensor(torch.zeros(c), mesh, [Shard(0)])
    rvc = distribute_tensor(torch.ones(c), mesh, [Shard(0)])
    with CommDebugMode() as comm:
        y = F.batch_norm(xc, rmc, rvc, wc, bc, training=True)
        y.backward(_dist(_rand(n, c, 6, seed=4), mesh, [Shard(1)], grad=False))
        F.batch_norm(xc, rmc, rvc, wc, bc, training=False)
    assert comm.get_total_counts() == 0
    assert wc.grad.placements == (Shard(0),)
    # evaluation mode on a batch shard: pointwise; parameter gradients stay Partial
    with CommDebugMode() as comm:
        y = F.batch_norm(x, rm, rv, w, b, training=False)
        w.grad = b.grad = None
        y.backward(grad)
    assert comm.get_total_counts() == 0
    assert w.grad.placements == b.grad.placements == (Partial(),)


@distributed(world_size=4)
def test_batch_norm_rejects_partial_running_statistics():
    mesh = init_device_mesh("cpu", (4,))
    x = _dist(_rand(8, 3, 4), mesh, [Shard(0)])
    rm = distribute_tensor(torch.zeros(3), mesh, [R]).redistribute(mesh, [Partial()])
    rv = distribute_tensor(torch.ones(3), mesh, [R])
    with pytest.raises(ValueError, match="running_mean has placements"):
        F.batch_norm(x, rm, rv, training=True)


@distributed(world_size=4)
def test_per_sample_norms_on_batch_shards():
    # instance, group and layer norm have per-sample statistics: a batch shard stays local
    mesh = init_device_mesh("cpu", (4,))
    x, w, b = _rand(8, 6, 5), _rand(6, seed=1), _rand(6, seed=2)
    for batch in (8, 3):  # even; and one rank with an empty piece
        xb = x[:batch]
        check(lambda x: F.instance_norm(x), [xb], [[Shard(0)]], mesh)
        check(lambda x, w, b: F.instance_norm(x, weight=w, bias=b), [xb, w, b],
              [[Shard(0)], [R], [R]], mesh)
        check(lambda x, w, b: F.group_norm(x, 3, w, b), [xb, w, b], [[Shard(0)], [R], [R]],
              mesh)
        check(lambda x: F.layer_norm(x, (6, 5)), [xb], [[Shard(0)]], mesh)
    # a shard of a normalised dim is gathered (the gathered piece is a strided view)
    check(lambda x, w, b: F.group_norm(x, 3, w, b), [x[:3], w, b],
          [[Shard(0), Shard(2)], [R, R], [R, R]], init_device_mesh("cpu", (2, 2)))
    dx = _dist(x, mesh, [Shard(0)])
    dw, db = _dist(w, mesh, [R]), _dist(b, mesh, [R])
    grad = distribute_tensor(_rand(8, 6, 5, seed=3), mesh, [Shard(0)])
    for fn in (lambda: F.group_norm(dx, 3, dw, db), lambda: F.instance_norm(dx),
               lambda: F.layer_norm(dx, (6, 5))):
        with CommDebugMode() as comm:
            y = fn()
            y.backward(grad)
        assert comm.get_total_counts() == 0 and y.placements == (Shard(0),)


@distributed(world_size=4)
@pytest.mark.parametrize("momentum", [0.1, None])  # None: cumulative average over the batches
def test_batch_norm_module_on_a_batch_shard(momentum):
    # nn.BatchNorm2d with its parameters and buffers replicated (distribute_module), fed a
    # batch-sharded input for three steps: what SyncBatchNorm gives, without a special module
    from dtensor_lite import distribute_module
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    ref = torch.nn.BatchNorm2d(3, momentum=momentum)
    bn = distribute_module(torch.nn.BatchNorm2d(3, momentum=momentum), mesh)
    for step in range(3):
        x = _rand(10, 3, 4, 4, seed=step) * (step + 1) + step
        yr = ref(x.clone().requires_grad_())
        y = bn(_dist(x, mesh, [Shard(0)]))
        torch.testing.assert_close(y.full_tensor(), yr, rtol=1e-5, atol=1e-5)
        g = _rand(10, 3, 4, 4, seed=10 + step)
        yr.backward(g)
        y.backward(_dist(g, mesh, [Shard(0)], grad=False))
    for name, want in list(ref.named_parameters()) + list(ref.named_buffers()):
        got = dict(list(bn.named_parameters()) + list(bn.named_buffers()))[name]
        if want.is_floating_point():
            torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-5)
            if name in ("weight", "bias"):
                torch.testing.assert_close(got.grad.full_tensor(), want.grad, rtol=1e-5,
                                           atol=1e-5)
        else:
            assert got.full_tensor().item() == want.item() == 3  # num_batches_tracked
    bn.eval()
    ref.eval()
    x = _rand(10, 3, 4, 4, seed=9)
    with CommDebugMode() as comm:
        y = bn(_dist(x, mesh, [Shard(0)]))
    assert comm.get_total_counts() == 0
    torch.testing.assert_close(y.full_tensor(), ref(x), rtol=1e-5, atol=1e-5)


@distributed(world_size=4)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("seq", [12, 13])
def test_sequence_sharded_linear_communicates_nothing(batch, seq):
    """(B, S, D) Shard(1) through nn.Linear with a replicated weight: each rank's rows stay local
    (13 positions: pieces 4, 4, 4, 1). B > 1 used to gather everything at the first Linear (its
    composite flattens (B, S) into one dim, which a rank's rows are not one block of). Backward
    too: the input's gradient stays Shard(1), the weights' and bias's are Partial (reduced only
    when something needs them)."""
    import copy

    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(),
                                    torch.nn.Linear(5, 4, bias=False))
    model = copy.deepcopy(reference)
    for layer in model:
        for name, p in list(layer.named_parameters()):
            layer.register_parameter(name, torch.nn.Parameter(
                distribute_tensor(p.detach(), mesh, [R])))
    x_full, w_out = torch.randn(batch, seq, 6), torch.randn(batch, seq, 4)
    ref_x = x_full.clone().requires_grad_()
    ref_out = reference(ref_x)
    (ref_out * w_out).sum().backward()

    x = distribute_tensor(x_full, mesh, [Shard(1)]).requires_grad_()
    weight = distribute_tensor(w_out, mesh, [Shard(1)])
    with CommDebugMode() as comm:
        out = model(x)
        assert out.placements == (Shard(1),) and out.shape == (batch, seq, 4)
        (out * weight).sum().backward()
    assert comm.get_total_counts() == 0, comm.get_comm_counts_by_op(by_input=True)
    assert x.grad.placements == (Shard(1),)
    assert all(p.grad.placements == (Partial(),) for p in model.parameters())
    rel = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.full_tensor(), ref_out.detach(), **rel)
    torch.testing.assert_close(x.grad.full_tensor(), ref_x.grad, **rel)
    for p, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad, **rel)
    x = x.detach()
    with torch.inference_mode(), CommDebugMode() as comm:  # linear reaches its rule whole
        out = model(x)
    assert comm.get_total_counts() == 0 and out.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), ref_out.detach(), **rel)
