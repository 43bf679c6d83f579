"""Pointwise ops against plain torch: coverage of the aten pointwise set, broadcasting, type
promotion, Scalar overloads, in-place and out= variants, and Partial kept where the op commutes
with the reduction (checked to move no data) and resolved where it does not."""
import pytest
import torch
import torch.nn.functional as F

from dtensor_lite import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.debug import CommDebugMode
from tests.harness import distributed

R = Replicate()
PLACEMENTS_2D = [[Shard(0), R], [R, Shard(1)], [Shard(0), Shard(1)], [Shard(0), Shard(0)],
                 [Shard(1), Shard(0)], [R, R]]
close = torch.testing.assert_close


def _mesh2d():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _partial(pieces, mesh, placements):
    """A DTensor whose rank at mesh coordinate c holds ``pieces[c[i]]`` for the (single) Partial
    mesh dim i, and whose other mesh dims are Replicate or Shard; its global value is the
    reduction of the pieces. Pieces differ, so a wrong rule cannot hide behind zeros."""
    i = next(k for k, p in enumerate(placements) if p.is_partial())
    coord = mesh.get_coordinate()
    local_full = pieces[coord[i]]
    base = [p if k == i else R for k, p in enumerate(placements)]
    dt = DTensor.from_local(local_full, mesh, base, shape=local_full.shape)
    return dt.redistribute(mesh, placements)


def _reduce(pieces, op):
    return {"sum": pieces.sum(0), "avg": pieces.mean(0), "max": pieces.amax(0),
            "min": pieces.amin(0)}[op]


def test_every_pointwise_aten_op_has_a_rule():
    import dtensor_lite  # noqa: F401
    from dtensor_lite.ops._registry import get_rule
    aten = torch.ops.aten
    missing = []
    for name in torch._C._dispatch_get_all_op_names():  # every aten op, loaded or not
        if not name.startswith("aten::"):
            continue
        base, _, overload = name[len("aten::"):].partition(".")
        op = getattr(getattr(aten, base), overload or "default")
        schema = op._schema
        if (torch.Tag.pointwise not in op.tags or any(a.is_out for a in schema.arguments)
                or any("[]" in str(a.type) for a in schema.arguments)
                or torch.Tag.nondeterministic_seeded in op.tags):  # random.py's
            continue
        if get_rule(op) is None:
            missing.append(str(op))
    assert not missing, missing
    for op in [aten.add.Scalar, aten.add.Tensor, aten.add_.Scalar, aten.mul.Scalar, aten.div.Scalar,
               aten.sub.Scalar, aten.rsub.Scalar, aten.rsub.Tensor, aten.pow.Tensor_Scalar,
               aten.pow.Scalar, aten.pow.Tensor_Tensor, aten.where.self, aten.where.ScalarOther,
               aten.where.ScalarSelf, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
               aten.masked_fill_.Scalar, aten.clamp.Tensor, aten.clamp_.Tensor, aten.lerp.Scalar,
               aten.lerp.Tensor, aten.lerp_.Scalar, aten.addcmul.default, aten.addcmul_.default,
               aten.addcdiv.default, aten.addcdiv_.default, aten._to_copy.default,
               aten.clone.default, aten.detach.default, aten.hardswish.default,
               aten.elu_backward.default, aten.floor_divide.default, aten.float_power.Tensor_Scalar,
               aten.native_dropout_backward.default, aten.sigmoid_backward.default,
               aten.threshold_backward.default, aten.gelu_backward.default]:
        assert get_rule(op) is not None, op
    # seeded random ops are not pointwise here (random.py makes them mesh-independent)
    assert not any(torch.Tag.nondeterministic_seeded in op.tags
                   for op in __import__("dtensor_lite.ops.pointwise",
                                        fromlist=["POINTWISE_OPS"]).POINTWISE_OPS)


UNARY = [
    torch.abs, torch.exp, torch.sin, torch.tanh, torch.sigmoid, torch.erf, torch.neg, torch.square,
    torch.atan, torch.floor, torch.sign, torch.frac, torch.trunc, torch.isnan, torch.logical_not,
    torch.nan_to_num, F.relu, F.gelu, F.silu, F.softplus, F.elu, F.leaky_relu, F.hardtanh,
    F.hardswish, F.hardsigmoid, F.mish, F.selu, F.celu, F.softshrink, F.hardshrink, F.relu6,
    lambda x: torch.sqrt(x.abs() + 0.1), lambda x: torch.log(x.abs() + 0.1),
    lambda x: torch.rsqrt(x.abs() + 0.1), lambda x: torch.reciprocal(x.abs() + 0.5),
    lambda x: x.clamp(-0.5, 0.5), lambda x: x.clamp(min=-0.2), lambda x: x ** 2,
    lambda x: 2 ** x, lambda x: torch.pow(x, 3), lambda x: x.float_power(2),
    lambda x: F.threshold(x, 0.1, -1.0), lambda x: torch.polygamma(1, x.abs() + 1),
    lambda x: torch.logit(torch.sigmoid(x)), lambda x: x.to(torch.float64),
    lambda x: x.to(torch.int32), lambda x: x.bool(), lambda x: torch.clone(x),
    lambda x: F.dropout(x, p=0.0, training=True), lambda x: x.add(1, alpha=2),
]


@distributed(world_size=4)
def test_unary_ops_forward_and_backward():
    mesh = _mesh2d()
    # uneven; (2, 7) leaves empty pieces under [S(0), S(0)]
    for shape, placements in [((5, 3), PLACEMENTS_2D), ((2, 7), PLACEMENTS_2D[3:5])]:
        x = torch.randn(shape)
        for k, fn in enumerate(UNARY):
            want = fn(x)
            for pl in placements:
                dx = distribute_tensor(x, mesh, pl)
                out = fn(dx)
                close(out.full_tensor(), want, msg=lambda m: f"op {k} {pl}: {m}")
                if want.dtype.is_floating_point:
                    assert out.placements == dx.placements, (k, pl, out.placements)
            if want.dtype.is_floating_point and k % 3 == 0:  # backward on a spread of ops
                xl = x.clone().requires_grad_()
                fn(xl).sum().backward()
                dx = distribute_tensor(x, mesh, [Shard(0), Shard(1)]).requires_grad_()
                fn(dx).sum().backward()
                close(dx.grad.full_tensor(), xl.grad, msg=lambda m: f"grad of op {k}: {m}")


BINARY = [
    torch.add, torch.sub, torch.mul, torch.div, torch.maximum, torch.minimum, torch.atan2,
    torch.fmod, torch.remainder, torch.hypot, torch.copysign, torch.fmax, torch.fmin,
    torch.logaddexp, torch.xlogy, torch.eq, torch.lt, torch.ge, torch.logical_and,
    lambda a, b: torch.pow(a.abs() + 0.5, b), lambda a, b: torch.lerp(a, b, 0.3),
    lambda a, b: a.sub(b, alpha=2.5), lambda a, b: torch.rsub(a, b, alpha=0.5),
    lambda a, b: torch.div(a, b, rounding_mode="floor"), lambda a, b: torch.where(a > b, a, b),
    lambda a, b: torch.max(a, b), lambda a, b: torch.clamp(a, min=b),
    lambda a, b: torch.clamp(a, max=b), lambda a, b: torch.clamp(a, min=b, max=b + 1),
    lambda a, b: torch.addcmul(a, a, b, value=0.5), lambda a, b: torch.addcdiv(b, a, b.abs() + 1),
    lambda a, b: torch.lerp(a, b, b.sigmoid()), lambda a, b: torch.complex(a, b).abs(),
    lambda a, b: torch.polar(a.abs(), b).angle(),
]


@distributed(world_size=4)
def test_binary_ops_with_broadcasting():
    mesh = _mesh2d()
    cases = [((5, 3), (5, 3)), ((5, 3), (3,)), ((5, 1), (1, 3)), ((3, 5, 2), (5, 1)), ((5, 3), ())]
    for sa, sb in cases:
        a, b = torch.randn(sa), torch.randn(sb)
        for k, fn in enumerate(BINARY):
            want = fn(a, b)
            for pa, pb in [(PLACEMENTS_2D[0], PLACEMENTS_2D[1]), (PLACEMENTS_2D[3], PLACEMENTS_2D[5]),
                           (PLACEMENTS_2D[4], PLACEMENTS_2D[2])]:
                pb = [p if not p.is_shard() or p.dim < len(sb) else R for p in pb] if sb else [R, R]
                pa = [p if not p.is_shard() or p.dim < len(sa) else R for p in pa]
                da, db = distribute_tensor(a, mesh, pa), distribute_tensor(b, mesh, pb)
                close(fn(da, db).full_tensor(), want, equal_nan=True,
                      msg=lambda m: f"op {k} {sa} {sb}: {m}")
    # backward through broadcasting: the broadcast operand's grad is summed over the broadcast dims
    a, b = torch.randn(5, 3), torch.randn(3)
    for fn in (torch.mul, torch.atan2, lambda a, b: torch.lerp(a, b, 0.25),
               lambda a, b: torch.where(a > 0, a * b, b), F.prelu,
               lambda a, b: F.logsigmoid(a) * b):
        al, bl = a.clone().requires_grad_(), b.clone().requires_grad_()
        fn(al, bl).sum().backward()
        da = distribute_tensor(a, mesh, [Shard(0), Shard(1)]).requires_grad_()
        db = distribute_tensor(b, mesh, [R, Shard(0)]).requires_grad_()
        fn(da, db).sum().backward()
        close(da.grad.full_tensor(), al.grad)
        close(db.grad.full_tensor(), bl.grad)


@distributed(world_size=4)
def test_scalar_overloads_and_type_promotion():
    mesh = _mesh2d()
    x = torch.randn(5, 3)
    i = torch.randint(-5, 5, (5, 3))
    m = x > 0
    for pl in PLACEMENTS_2D:
        dx, di, dm = (distribute_tensor(t, mesh, pl) for t in (x, i, m))
        for fn in (lambda x, i, m: x + 1, lambda x, i, m: 1 + x, lambda x, i, m: x - 2.5,
                   lambda x, i, m: 3 - x, lambda x, i, m: x * 2, lambda x, i, m: x / 4,
                   lambda x, i, m: 2 / (x.abs() + 1), lambda x, i, m: x ** 2,
                   lambda x, i, m: 2 ** x, lambda x, i, m: x + i, lambda x, i, m: i * 0.5,
                   lambda x, i, m: i + 1, lambda x, i, m: i // 2, lambda x, i, m: i % 3,
                   lambda x, i, m: i / 2, lambda x, i, m: x * m, lambda x, i, m: m + 1,
                   lambda x, i, m: i & 3, lambda x, i, m: i << 1, lambda x, i, m: m | (i > 0),
                   lambda x, i, m: torch.where(m, x, 0.0), lambda x, i, m: torch.where(m, 1.0, x),
                   lambda x, i, m: torch.where(m, 1.0, 0.0), lambda x, i, m: torch.where(m, i, x),
                   lambda x, i, m: x.masked_fill(m, -1), lambda x, i, m: i.masked_fill(~m, 7),
                   lambda x, i, m: x.clamp(-0.3, 0.3), lambda x, i, m: (x > 0.1) == m,
                   lambda x, i, m: x.add(i, alpha=2), lambda x, i, m: torch.true_divide(i, 3),
                   lambda x, i, m: x.to(torch.float64) * 3, lambda x, i, m: x + torch.tensor(2.0),
                   lambda x, i, m: i * torch.tensor(1.5, dtype=torch.float64)):
            want = fn(x, i, m)
            got = fn(dx, di, dm)
            close(got.full_tensor(), want)  # assert_close checks the dtype too
    # the Scalar overloads themselves (decompositions and autograd formulas call them directly)
    aten = torch.ops.aten
    dx = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    px = distribute_tensor(x, mesh, [R, R]).redistribute(mesh, [Partial(), Shard(1)])
    for op, args in ((aten.add.Scalar, (2.0, 3)), (aten.sub.Scalar, (1.5,)), (aten.mul.Scalar, (-2,)),
                     (aten.div.Scalar, (4.0,)), (aten.rsub.Scalar, (1.0, 2)),
                     (aten.pow.Tensor_Scalar, (2,)),
                     (aten.clamp_min.default, (0.0,)), (aten.fmod.Scalar, (0.3,)),
                     (aten.remainder.Scalar, (0.3,)), (aten.eq.Scalar, (0.0,)),
                     (aten.masked_fill.Scalar, (distribute_tensor(m, mesh, [R, R]), 1.0))):
        plain_args = tuple(a.full_tensor() if isinstance(a, DTensor) else a for a in args)
        for d in (dx, px):
            close(op(d, *args).full_tensor(), op(x, *plain_args), msg=lambda msg: f"{op}: {msg}")
    close(aten.pow.Scalar(2.0, dx).full_tensor(), aten.pow.Scalar(2.0, x))
    y = dx.clone()
    aten.add_.Scalar(y, 1.0)
    aten.mul_.Scalar(y, 3)
    close(y.full_tensor(), (x + 1) * 3)
    # 0-d DTensors: a 0-d mask or fill value, and a 0-d operand
    zero_d_mask = distribute_tensor(torch.tensor(True), mesh, [R, R])
    value = distribute_tensor(torch.tensor(4.0), mesh, [R, R])
    dx = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    close(dx.masked_fill(zero_d_mask, 1.0).full_tensor(), x.masked_fill(torch.tensor(True), 1.0))
    close(dx.masked_fill(distribute_tensor(m, mesh, [Shard(0), R]), value).full_tensor(),
          x.masked_fill(m, 4.0))
    close((dx * value).full_tensor(), x * 4.0)
    close(torch.where(zero_d_mask, dx, value).full_tensor(), x)
    close(dx.clamp(min=value - 4.2, max=value - 3.8).full_tensor(), x.clamp(-0.2, 0.2))


@distributed(world_size=4)
def test_inplace_and_out_variants():
    mesh = _mesh2d()
    x, y, row = torch.randn(5, 6), torch.randn(5, 6), torch.randn(6)
    for pl in PLACEMENTS_2D:
        dx = distribute_tensor(x, mesh, pl)
        dy = distribute_tensor(y, mesh, [Shard(1), R])
        drow = distribute_tensor(row, mesh, [R, Shard(0)])
        ref = x.clone()
        for fn in (lambda t, o, r: t.add_(o, alpha=0.5), lambda t, o, r: t.mul_(r),
                   lambda t, o, r: t.sub_(1), lambda t, o, r: t.clamp_(min=r),
                   lambda t, o, r: t.lerp_(o, 0.1), lambda t, o, r: t.addcmul_(o, r, value=2),
                   lambda t, o, r: t.addcdiv_(o, r.abs() + 1), lambda t, o, r: t.abs_().sqrt_(),
                   lambda t, o, r: t.masked_fill_(o > 0, 0.5), lambda t, o, r: t.div_(2.0),
                   lambda t, o, r: t.pow_(2), lambda t, o, r: t.neg_(),
                   lambda t, o, r: t.copysign_(o), lambda t, o, r: t.zero_().add_(r)):
            res = fn(dx, dy, drow)
            fn(ref, y, row)
            assert res is dx and dx.placements == tuple(pl), (pl, dx.placements)
            close(dx.full_tensor(), ref)
    # out=: the result is written at out's own placements
    da = distribute_tensor(x, mesh, [Shard(0), R])
    db = distribute_tensor(y, mesh, [R, Shard(1)])
    out = distribute_tensor(torch.zeros(5, 6), mesh, [Shard(1), Shard(0)])
    res = torch.add(da, db, alpha=2, out=out)
    assert res is out and out.placements == (Shard(1), Shard(0))
    close(out.full_tensor(), x + 2 * y)
    torch.mul(da, 3, out=out)
    close(out.full_tensor(), x * 3)
    torch.where(da > 0, da, db, out=out)
    close(out.full_tensor(), torch.where(x > 0, x, y))


@distributed(world_size=4)
def test_partial_sum_kept_where_linear_without_communication():
    mesh = _mesh2d()
    pieces, other = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
    y, mask = torch.randn(5, 3), torch.randn(5, 3) > 0
    x, o = pieces.sum(0), other.sum(0)
    for op in ("sum", "avg"):
        for pl in ([Partial(op), R], [Partial(op), Shard(0)], [Partial(op), Shard(1)]):
            px = _partial(pieces, mesh, pl)
            x = _reduce(pieces, op)
            po = _partial(other, mesh, pl)
            o = _reduce(other, op)
            ry = distribute_tensor(y, mesh, [R, pl[1]])
            dm = distribute_tensor(mask, mesh, [R, pl[1]])
            cases = [
                (lambda p, q, r, m: p + 1, lambda: x + 1),  # adds 1 once, not once per rank
                (lambda p, q, r, m: 1 + p, lambda: 1 + x),
                (lambda p, q, r, m: p - 2, lambda: x - 2),
                (lambda p, q, r, m: 3 - p, lambda: 3 - x),
                (lambda p, q, r, m: p + torch.tensor(0.5), lambda: x + 0.5),
                (lambda p, q, r, m: p.add(1, alpha=3), lambda: x + 3),
                (lambda p, q, r, m: p * 2, lambda: x * 2),
                (lambda p, q, r, m: -2.0 * p, lambda: -2.0 * x),
                (lambda p, q, r, m: p / 4, lambda: x / 4),
                (lambda p, q, r, m: -p, lambda: -x),
                (lambda p, q, r, m: p + q, lambda: x + o),
                (lambda p, q, r, m: p.sub(q, alpha=2), lambda: x - 2 * o),
                (lambda p, q, r, m: p + r, lambda: x + y),
                (lambda p, q, r, m: r - p, lambda: y - x),
                (lambda p, q, r, m: p * r, lambda: x * y),
                (lambda p, q, r, m: r * p, lambda: y * x),
                (lambda p, q, r, m: p / (r.abs() + 1), lambda: x / (y.abs() + 1)),
                (lambda p, q, r, m: torch.where(m, p, 0.0), lambda: torch.where(mask, x, 0.0)),
                (lambda p, q, r, m: torch.where(m, p, 1.5), lambda: torch.where(mask, x, 1.5)),
                (lambda p, q, r, m: torch.where(m, r, p), lambda: torch.where(mask, y, x)),
                (lambda p, q, r, m: torch.where(m, p, q), lambda: torch.where(mask, x, o)),
                (lambda p, q, r, m: p.masked_fill(m, 2.0), lambda: x.masked_fill(mask, 2.0)),
                (lambda p, q, r, m: torch.lerp(p, q, 0.3), lambda: torch.lerp(x, o, 0.3)),
                (lambda p, q, r, m: torch.lerp(p, q, r), lambda: torch.lerp(x, o, y)),
                (lambda p, q, r, m: torch.addcmul(p, q, r, value=0.5),
                 lambda: torch.addcmul(x, o, y, value=0.5)),
                (lambda p, q, r, m: torch.addcdiv(p, q, r.abs() + 1),
                 lambda: torch.addcdiv(x, o, y.abs() + 1)),
                (lambda p, q, r, m: p.clone(), lambda: x),
                (lambda p, q, r, m: p.to(torch.float64), lambda: x.double()),
            ]
            for k, (fn, want) in enumerate(cases):
                with CommDebugMode() as comm:
                    out = fn(px, po, ry, dm)
                assert comm.get_total_counts() == 0, (op, pl, k, comm.get_comm_counts())
                assert out.placements[0].is_partial(), (op, pl, k, out.placements)
                close(out.full_tensor(), want(), msg=lambda m: f"{op} {pl} case {k}: {m}")
    # not linear: resolved first, and right
    px = _partial(pieces, mesh, [Partial(), R])
    po = _partial(other, mesh, [Partial(), R])
    x, o = pieces.sum(0), other.sum(0)
    # Partial x Partial: one factor is reduced (one all-reduce; reducing both, or one by
    # reduce-scatter and the other alike, is two) and the product stays Partial, as in PyTorch
    # (and Partial / Partial reduces the divisor only)
    for fn in (lambda p, q: p * q, lambda p, q: p / q):
        with CommDebugMode() as comm:
            got = fn(px, po)
        assert comm.get_comm_counts() == {"all_reduce": 1} and got.placements[0].is_partial()
        close(got.full_tensor(), fn(x, o))
    for fn in (lambda p, q: p.exp(), lambda p, q: p ** 2,
               lambda p, q: p > 0, lambda p, q: p.abs(), lambda p, q: p.to(torch.int32),
               lambda p, q: torch.maximum(p, q), lambda p, q: p // 1,
               lambda p, q: p.bool()):
        got = fn(px, po)
        assert not any(p.is_partial() for p in got.placements)
        close(got.full_tensor(), fn(x, o))


@distributed(world_size=4)
def test_partial_max_min_through_monotone_ops():
    mesh = _mesh2d()
    pieces = torch.randn(2, 4, 3)
    ry = torch.randn(4, 3)
    for op, flip in (("max", "min"), ("min", "max")):
        px = _partial(pieces, mesh, [Partial(op), Shard(0)])
        x = _reduce(pieces, op)
        dy = distribute_tensor(ry, mesh, [R, Shard(0)])
        cases = [
            (lambda p: p + 1, lambda: x + 1, op), (lambda p: p - 3, lambda: x - 3, op),
            (lambda p: p * 2, lambda: x * 2, op), (lambda p: p * -2, lambda: x * -2, flip),
            (lambda p: p / -4, lambda: x / -4, flip), (lambda p: -p, lambda: -x, flip),
            (lambda p: 5 - p, lambda: 5 - x, flip), (torch.exp, lambda: x.exp(), op),
            (torch.relu, lambda: x.relu(), op), (torch.tanh, lambda: x.tanh(), op),
            (lambda p: p.clamp(-0.5, 0.5), lambda: x.clamp(-0.5, 0.5), op),
            (lambda p: p + dy, lambda: x + ry, op), (lambda p: dy - p, lambda: ry - x, flip),
            (lambda p: torch.maximum(p, dy), lambda: torch.maximum(x, ry), op),
            (lambda p: torch.minimum(dy, p), lambda: torch.minimum(ry, x), op),
            (lambda p: p.to(torch.int32), lambda: x.to(torch.int32), op),
            (lambda p: p.clone(), lambda: x, op), (torch.erfc, lambda: x.erfc(), flip),
            (lambda p: F.leaky_relu(p, 0.1), lambda: F.leaky_relu(x, 0.1), op),
        ]
        for k, (fn, want, kept) in enumerate(cases):
            with CommDebugMode() as comm:
                out = fn(px)
            assert comm.get_total_counts() == 0, (op, k, comm.get_comm_counts())
            assert out.placements == (Partial(kept), Shard(0)), (op, k, out.placements)
            close(out.full_tensor(), want())
        # not monotone, or a bool cast: resolved
        for fn in (lambda p: p * p, torch.sin, lambda p: p.bool(), torch.abs, F.gelu):
            got = fn(px)
            assert not any(p.is_partial() for p in got.placements)
            close(got.full_tensor(), fn(x))


@distributed(world_size=4)
def test_partial_inplace_and_multi_mesh_dim():
    mesh = _mesh2d()
    x = torch.randn(4, 3)
    # Partial(sum) on both mesh dims: the scalar is added on coordinate (0, 0) only
    px = distribute_tensor(x, mesh, [R, R]).redistribute(mesh, [Partial(), Partial()])
    dm = distribute_tensor(x > 0, mesh, [R, R])
    with CommDebugMode() as comm:
        a = px + 1
        b = torch.where(dm, px, 2.0)
        c = torch.where(dm, 2.0, px)
    assert comm.get_total_counts() == 0
    close(a.full_tensor(), x + 1)
    close(b.full_tensor(), torch.where(x > 0, x, 2.0))
    close(c.full_tensor(), torch.where(x > 0, 2.0, x))
    # in-place on a Partial destination keeps it Partial and counts scalars once
    y = torch.randn(3)
    ry = distribute_tensor(y, mesh, [R, R])
    cases = [
        ("sum", lambda t, r: t.add_(2), lambda t: t + 2),
        ("sum", lambda t, r: t.mul_(3), lambda t: t * 3),
        ("sum", lambda t, r: t.sub_(1).neg_(), lambda t: -(t - 1)),
        ("sum", lambda t, r: t.div_(2).add_(0.5, alpha=2), lambda t: t / 2 + 1),
        ("sum", lambda t, r: t.add_(r).mul_(r), lambda t: (t + y) * y),
        ("sum", lambda t, r: t.masked_fill_(r > 0, 1.0), lambda t: t.masked_fill(y > 0, 1.0)),
        ("max", lambda t, r: t.clamp_(-0.1, 0.1).add_(r), lambda t: t.clamp(-0.1, 0.1) + y),
        ("min", lambda t, r: t.mul_(2).sub_(1), lambda t: t * 2 - 1),
        ("avg", lambda t, r: t.add_(1).zero_(), lambda t: t * 0),
    ]
    for op, fn, ref in cases:
        pt = distribute_tensor(x, mesh, [R, R]).redistribute(mesh, [Partial(op), Partial(op)])
        with CommDebugMode() as comm:
            res = fn(pt, ry)
        assert comm.get_total_counts() == 0 and res is pt, (op, comm.get_comm_counts())
        assert pt.placements == (Partial(op), Partial(op))
        close(pt.full_tensor(), ref(x))
    # a result that cannot stay Partial(min) in place (x * -1 is a max): the destination itself
    # is reduced first (one collective), then written (tests/test_ops_inplace_partial.py)
    pt = distribute_tensor(x, mesh, [R, R]).redistribute(mesh, [Partial("min"), R])
    with CommDebugMode() as comm:
        assert pt.mul_(-1) is pt
    assert comm.get_total_counts() == 1 and not pt.placements[0].is_partial(), pt.placements
    close(pt.full_tensor(), -x)
    # a replicated destination with a Partial operand: the operand is reduced, dst stays
    dst = distribute_tensor(x, mesh, [R, Shard(0)])
    po = distribute_tensor(x, mesh, [R, R]).redistribute(mesh, [Partial(), R])
    dst.add_(po)
    assert dst.placements == (R, Shard(0))
    close(dst.full_tensor(), 2 * x)


@distributed(world_size=4)
def test_no_communication_on_matching_layouts_and_empty_shards():
    mesh = init_device_mesh("cpu", (4,))
    for shape in [(3, 5), (6, 2), (1, 4)]:  # 3 and 1 rows on 4 ranks: empty pieces
        a, b, row = torch.randn(shape), torch.randn(shape), torch.randn(shape[1])
        da, db = distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Shard(0)])
        drow = distribute_tensor(row, mesh, [R])
        dm = distribute_tensor(a > 0, mesh, [Shard(0)])
        with CommDebugMode() as comm:
            outs = [da + db, da * drow, torch.where(dm, da, drow), da.masked_fill(dm, 0.0),
                    torch.lerp(da, db, 0.5), torch.addcdiv(da, db, drow.abs() + 1),
                    (da > db).float(), F.gelu(da) - 1, da.clamp(min=drow)]
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        wants = [a + b, a * row, torch.where(a > 0, a, row), a.masked_fill(a > 0, 0.0),
                 torch.lerp(a, b, 0.5), torch.addcdiv(a, b, row.abs() + 1), (a > b).float(),
                 F.gelu(a) - 1, a.clamp(min=row)]
        for got, want in zip(outs, wants):
            assert got.placements == (Shard(0),)
            close(got.full_tensor(), want)


@distributed(world_size=4)
def test_adam_and_sgd_steps_match_plain_torch():
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    w0, b0 = torch.randn(5, 3), torch.randn(3)
    for opt_cls, kw in ((torch.optim.Adam, dict(lr=0.1)),
                        (torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1, amsgrad=True)),
                        (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True))):
        w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        dw = distribute_tensor(w0, mesh, [Shard(0)]).requires_grad_()
        db = distribute_tensor(b0, mesh, [R]).requires_grad_()
        opt = opt_cls([w, b], foreach=False, **kw)
        dopt = opt_cls([dw, db], foreach=False, **kw)
        for step in range(3):
            x = torch.randn(4, 5)
            dx = distribute_tensor(x, mesh, [R])
            opt.zero_grad()
            dopt.zero_grad()
            (torch.tanh(x @ w + b) ** 2).sum().backward()
            (torch.tanh(dx @ dw + db) ** 2).sum().backward()
            opt.step()
            dopt.step()
        close(dw.full_tensor(), w.detach())
        close(db.full_tensor(), b.detach())
        assert dw.placements == (Shard(0),)


def _pick(options):
    return options[int(torch.randint(len(options), ()))]


@distributed(world_size=4)
def test_random_broadcast_and_partial_mixes():
    """Seeded random cases (the same on every rank): shapes with size-1 and missing dims,
    placements mixing Shard / Replicate / Partial(sum|avg|max) per mesh dim, several ops."""
    mesh = _mesh2d()
    ops = [torch.add, torch.sub, torch.mul, lambda a, b: a / (b.abs() + 1), torch.maximum,
           lambda a, b: torch.where(b > 0, a, b), lambda a, b: torch.lerp(a, b, 0.3),
           lambda a, b: a * 2 - b + 1, lambda a, b: torch.addcmul(a, a, b),
           lambda a, b: (a - 1).clamp(min=b)]
    for case in range(40):
        ndim = int(torch.randint(1, 4, ()))
        shape = [int(s) for s in torch.randint(1, 6, (ndim,))]
        b_shape = [s if torch.rand(()) < 0.7 else 1 for s in shape][int(torch.randint(ndim, ())):]
        a, b = torch.randn(shape), torch.randn(b_shape)

        def placements(t):
            opts = [R, Partial("sum"), Partial("avg"), Partial("max")] + \
                   [Shard(d) for d in range(t.ndim)]
            pl = [_pick(opts), _pick(opts)]
            kinds = {p.reduce_op for p in pl if p.is_partial()}
            if len(kinds) > 1 and not kinds <= {"sum", "avg"}:
                pl[1] = R  # max cannot mix with sum/avg on one tensor
            return pl

        pa, pb = placements(a), placements(b)
        da = distribute_tensor(a, mesh, [R, R]).redistribute(mesh, pa)
        db = distribute_tensor(b, mesh, [R, R]).redistribute(mesh, pb)
        fn = ops[case % len(ops)]
        close(fn(da, db).full_tensor(), fn(a, b), msg=lambda m: f"case {case} {shape} {pa} "
                                                              f"{b_shape} {pb}: {m}")
