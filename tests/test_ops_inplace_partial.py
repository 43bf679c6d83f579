"""In-place ops on a Partial destination. A linear op (mul_ by a scalar, neg_, add_ of another
Partial) keeps the Partial and moves nothing. A non-linear one (sqrt_, clamp_, exp_, a Partial(min)
times -1, ...) cannot: plain torch's values need the sum first, so the destination DTensor itself is
reduced -- its piece and spec become the reduced placement, with one reduction -- and the op then
writes into it. Where the destination's memory is shared (a view of another DTensor, a DTensor
with views, a to_local() alias) that move would leave the aliases wrong: there the op runs out of
place and the result is copied in at the destination's own placements.
Found by the whole-op_db run: cosine_embedding_loss on "S0,S-1" (sqrt_ on a Partial sum)."""
import gc

import pytest
import torch
import torch.distributed as dist

from dtensor_lite import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor_lite.debug import CommDebugMode
from tests.harness import distributed

P, R = Partial(), Replicate()


def _layouts():
    """(mesh, placements with at least one Partial) on a 1-D mesh of 4 and a 2x2 mesh."""
    m1 = init_device_mesh("cpu", (4,))
    m2 = init_device_mesh("cpu", (2, 2))
    return [(m1, [P]), (m2, [Shard(0), P]), (m2, [P, Shard(1)]), (m2, [P, P]), (m2, [P, R])]


def _partial(mesh, placements, shape=(4, 6)):
    """A DTensor of ``placements`` whose pieces differ on every rank (each piece > 0, so that
    summing before or after a non-linear op gives different values)."""
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    local_shape = list(shape)
    for i, p in enumerate(placements):
        if p.is_shard():
            local_shape[p.dim] //= mesh.shape[i]
    return DTensor.from_local(torch.rand(local_shape, generator=g) + 0.1, mesh, placements)


NONLINEAR = {
    "sqrt_": lambda t, o: t.sqrt_(),
    "clamp_": lambda t, o: t.clamp_(min=0.3, max=1.5),
    "exp_": lambda t, o: t.exp_(),
    "pow_": lambda t, o: t.pow_(2),
    "relu_ of shifted": lambda t, o: t.sub_(1.0).relu_(),
    "div_ by Replicate": lambda t, o: t.div_(o).sigmoid_(),
}

LINEAR = {
    "mul_ scalar": lambda t, o, p: t.mul_(2.5),
    "div_ scalar": lambda t, o, p: t.div_(4.0),
    "neg_": lambda t, o, p: t.neg_(),
    "add_ Partial": lambda t, o, p: t.add_(p),
    "sub_ Partial alpha": lambda t, o, p: t.sub_(p, alpha=0.5),
    "mul_ Replicate": lambda t, o, p: t.mul_(o),
    "add_ Replicate": lambda t, o, p: t.add_(o),  # the Replicate joins as a Partial (free)
}


@distributed(world_size=4)
def test_mul_by_itself_reduces_only_the_other_operand():
    # x.mul_(x) of a Partial x: linear in the destination once the other operand is reduced,
    # so the destination stays Partial (one reduction, of the operand)
    for mesh, pl in _layouts():
        x = _partial(mesh, pl)
        want = x.full_tensor() ** 2
        with CommDebugMode() as comm:
            assert x.mul_(x) is x
        assert x.placements == tuple(pl), x.placements
        assert comm.get_total_counts() <= sum(p.is_partial() for p in pl)
        torch.testing.assert_close(x.full_tensor(), want)


def _replicate(x):
    g = torch.Generator().manual_seed(7)
    return distribute_tensor(torch.rand(x.shape, generator=g), x.device_mesh,
                             [R] * x.device_mesh.ndim)


@distributed(world_size=4)
@pytest.mark.parametrize("name", list(NONLINEAR))
def test_nonlinear_inplace_reduces_the_partial_destination(name):
    fn = NONLINEAR[name]
    for mesh, pl in _layouts():
        x = _partial(mesh, pl)
        other = _replicate(x)
        want = fn(x.full_tensor(), other.full_tensor())
        n_partial = sum(p.is_partial() for p in pl)
        for attempt in range(2):  # the second call runs the cached decision
            if attempt:
                x = _partial(mesh, pl)
            with CommDebugMode() as comm:
                out = fn(x, other)
            msg = f"{name}, {pl} on {mesh.shape}, call {attempt}"
            assert out is x, msg  # the user's tensor object, with its new placement
            assert not any(p.is_partial() for p in x.placements), (msg, x.placements)
            for p, q in zip(pl, x.placements):  # only the Partial mesh dims moved
                assert p.is_partial() or p == q, (msg, x.placements)
            assert tuple(x._local_tensor.shape) == x._spec.local_shape(), msg
            # one reduction per Partial mesh dim at most, nothing else
            assert 1 <= comm.get_total_counts() <= n_partial, (msg, dict(comm.get_comm_counts()))
            torch.testing.assert_close(x.full_tensor(), want, msg=msg)


@distributed(world_size=4)
@pytest.mark.parametrize("name", list(LINEAR))
def test_linear_inplace_keeps_partial_without_communication(name):
    fn = LINEAR[name]
    for mesh, pl in _layouts():
        x, p = _partial(mesh, pl), _partial(mesh, pl)
        other = _replicate(x)
        want = fn(x.full_tensor(), other.full_tensor(), p.full_tensor())
        local = x._local_tensor
        with CommDebugMode() as comm:
            out = fn(x, other, p)
        msg = f"{name}, {pl} on {mesh.shape}"
        assert out is x and x.placements == tuple(pl), (msg, x.placements)
        assert comm.get_total_counts() == 0, (msg, dict(comm.get_comm_counts()))
        assert x._local_tensor is local, msg  # written where it was
        torch.testing.assert_close(x.full_tensor(), want, msg=msg)


@distributed(world_size=4)
def test_shared_destination_is_written_through_at_its_placement():
    # where the destination's memory is shared, moving it would leave the aliases with the old
    # placement over changed memory: the op runs out of place and is copied into the destination
    # at its own placements (still one reduction), and every alias sees the new values
    for mesh, pl in _layouts():
        n_partial = sum(p.is_partial() for p in pl)
        x = _partial(mesh, pl) * 1.0
        before = x.full_tensor()
        v = x.t()  # a view that moves no data on every layout here
        with CommDebugMode() as comm:
            assert v.sqrt_() is v  # a view of another DTensor
        assert v.placements == x.t().placements and x.placements == tuple(pl)
        assert comm.get_total_counts() <= n_partial, dict(comm.get_comm_counts())
        torch.testing.assert_close(x.full_tensor(), before.sqrt())
        torch.testing.assert_close(v.full_tensor(), before.sqrt().t())
        with CommDebugMode() as comm:
            assert x.exp_() is x  # a DTensor with a live view
        assert x.placements == tuple(pl) and comm.get_total_counts() <= n_partial
        torch.testing.assert_close(v.full_tensor(), before.sqrt().exp().t())
        del v
        with torch.no_grad():
            piece = x.to_local()  # the local piece held by the caller
        x.clamp_(max=2.0)
        assert x.placements == tuple(pl) and x._local_tensor is piece  # written where it is
        torch.testing.assert_close(x.full_tensor(), before.sqrt().exp().clamp(max=2.0))
        piece_id = id(piece)  # not a reference: the caller lets go of it below
        del piece
        gc.collect()  # the view may sit in a reference cycle (e.g. of a caught error)
        # a piece to_local() handed out stays handed out: only a reference count could tell
        # that the caller let go, and reference counts are not ours to read (_aliasing)
        x.sqrt_()
        assert x.placements == tuple(pl) and id(x._local_tensor) == piece_id, x.placements
        torch.testing.assert_close(x.full_tensor(), before.sqrt().exp().clamp(max=2.0).sqrt())
        x = x * 1.0  # a piece of its own that nothing aliases: the DTensor itself is reduced
        x.sqrt_()
        assert not any(p.is_partial() for p in x.placements), x.placements
        torch.testing.assert_close(x.full_tensor(),
                                   before.sqrt().exp().clamp(max=2.0).sqrt().sqrt())


@distributed(world_size=4)
def test_written_through_view_backward():
    # autograd over both paths: a view of a non-leaf written through, and the non-leaf reduced
    for mesh, pl in _layouts():
        leaf = _partial(mesh, pl).requires_grad_()
        whole = leaf.full_tensor().detach().requires_grad_()
        w = torch.arange(24.0).view(4, 6)
        dw = distribute_tensor(w, mesh, [R] * mesh.ndim)
        for t, weights in ((leaf, dw), (whole, w)):
            y, z = t * 1.0, t * 0.5
            y.t().sqrt_()  # a view of y: written through at y's placements
            z.exp_()  # nothing aliases z: z itself is reduced
            ((y + z) * weights).sum().backward()
        torch.testing.assert_close(leaf.grad.full_tensor(), whole.grad, msg=str(pl))


@distributed(world_size=4)
def test_foreach_inplace_reduces_each_partial_destination():
    for mesh, pl in _layouts():
        xs = [_partial(mesh, pl), _partial(mesh, pl, (8, 2))]
        want = [x.full_tensor().sqrt() for x in xs]
        torch._foreach_sqrt_(xs)
        for x, w in zip(xs, want):
            assert not any(p.is_partial() for p in x.placements), (pl, x.placements)
            torch.testing.assert_close(x.full_tensor(), w)
        ys = [_partial(mesh, pl), _partial(mesh, pl, (8, 2))]
        want = [y.full_tensor() * 3 for y in ys]
        with CommDebugMode() as comm:
            torch._foreach_mul_(ys, 3.0)  # linear: stays Partial, nothing moves
        assert comm.get_total_counts() == 0 and all(y.placements == tuple(pl) for y in ys)
        for y, w in zip(ys, want):
            torch.testing.assert_close(y.full_tensor(), w)


@distributed(world_size=4)
def test_cosine_embedding_loss_forward_backward():
    # the op_db case: a sum over the sharded last dim is Partial, then torch's composite sqrt_'s it
    torch.manual_seed(0)
    a, b = torch.randn(6, 8), torch.randn(6, 8)
    target = torch.tensor([1, -1, 1, 1, -1, -1])
    for mesh, pl in [(init_device_mesh("cpu", (4,)), [Shard(1)]),
                     (init_device_mesh("cpu", (2, 2)), [Shard(0), Shard(1)])]:
        pa, pb = a.clone().requires_grad_(), b.clone().requires_grad_()
        want = torch.nn.functional.cosine_embedding_loss(pa, pb, target, margin=0.1)
        want.backward()
        for _ in range(2):  # again from the cached decisions
            da = distribute_tensor(a, mesh, pl).requires_grad_()
            db = distribute_tensor(b, mesh, pl).requires_grad_()
            dt = distribute_tensor(target, mesh, [R] * mesh.ndim)
            got = torch.nn.functional.cosine_embedding_loss(da, db, dt, margin=0.1)
            torch.testing.assert_close(got.full_tensor(), want.detach())
            got.backward()
            torch.testing.assert_close(da.grad.full_tensor(), pa.grad)
            torch.testing.assert_close(db.grad.full_tensor(), pb.grad)


def _failed_compiles(x):
    """Compiles over ``x`` that fail in three ways (a graph break under fullgraph, a backend
    that raises, an error while Dynamo traces); their exceptions are returned, so that whatever
    they hold stays alive."""
    def breaks(t):
        torch._dynamo.graph_break()
        return t.sqrt_()

    def backend(gm, example_inputs):
        raise RuntimeError("this backend always fails")

    def raises(t):
        raise ValueError("the traced function itself fails")

    errors = []
    for fn, kw in ((breaks, {"fullgraph": True, "backend": "eager"}), (lambda t: t.exp_(),
                   {"backend": backend}), (raises, {"backend": "eager"})):
        torch._dynamo.reset()
        try:
            torch.compile(fn, **kw)(x)
        except Exception as e:  # noqa: BLE001 -- failing is the point
            errors.append(e)
    assert len(errors) == 3, errors
    return errors


class _FrameLocalsReader:
    """What a debugger does: read every frame's locals (which keeps references to them)."""

    def __init__(self):
        self.seen = []

    def __call__(self, frame, event, arg):
        if len(self.seen) < 100_000:
            self.seen.append(frame.f_locals)
        return self


@distributed(world_size=4)
def test_placements_do_not_depend_on_what_other_libraries_hold():
    """Whether an in-place op reduces its Partial destination or writes through it is decided
    from what this library did (views, to_local), never from reference counts: a failed
    torch.compile in the same process, extra references to the DTensor and its piece, a profiler
    running or a debugger reading frame locals change neither a placement nor a value."""
    import sys

    mesh = init_device_mesh("cpu", (2, 2))
    pl = [Shard(0), P]
    held, reduced, holding = [], {}, []

    def nothing():
        return None

    def failed_compile():
        held.extend(_failed_compiles(_partial(mesh, pl)))

    def references():
        holding.append(True)
        return holding.clear

    def profiler():
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
        return lambda: prof.__exit__(None, None, None)

    def debugger():
        reader = _FrameLocalsReader()
        sys.settrace(reader)
        held.append(reader)
        return lambda: sys.settrace(None)

    setups = {"nothing": nothing, "a failed torch.compile": failed_compile,
              "extra references": references, "a profiler": profiler, "a debugger": debugger}
    for what, setup in setups.items():
        undo = setup()
        try:
            for name, fn in NONLINEAR.items():
                x = _partial(mesh, pl)
                other = _replicate(x)
                want = fn(x.full_tensor(), other.full_tensor())
                if holding:  # what a library keeps of a tensor it saw: held, not aliased
                    held.extend([x, x._local_tensor, x._spec] * 3)
                assert fn(x, other) is x
                assert not any(p.is_partial() for p in x.placements), (what, name, x.placements)
                # whatever else runs, the placement the rule chose without it
                assert reduced.setdefault(name, x.placements) == x.placements, (what, name)
                torch.testing.assert_close(x.full_tensor(), want, msg=f"{what}: {name}")
            x = _partial(mesh, pl)
            if holding:
                held.extend([x, x._local_tensor] * 3)
            v = x.t()  # an alias: written through, still Partial, whatever else holds x
            want = x.full_tensor().sqrt()
            x.sqrt_()
            assert x.placements == tuple(pl), (what, x.placements)
            torch.testing.assert_close(v.full_tensor(), want.t(), msg=what)
            y = _partial(mesh, pl)
            want = y.full_tensor() * -2
            y.mul_(-2.0)  # linear: stays Partial, nothing moves
            assert y.placements == tuple(pl), (what, y.placements)
            torch.testing.assert_close(y.full_tensor(), want, msg=what)
        finally:
            if undo is not None:
                undo()
        held.clear()
    torch._dynamo.reset()


@distributed(world_size=4)
def test_ranks_outside_the_mesh_agree_on_the_destinations_placement():
    # a mesh over ranks 0 and 1: ranks 2 and 3 hold empty pieces and run no kernel, yet must
    # record the placement the members chose -- written through (kept) for a piece to_local()
    # handed out, reduced for a piece of its own
    mesh = init_device_mesh("cpu", (2,))
    x = DTensor.from_local(torch.rand(4, 6) + 0.1, mesh, [P])
    seen = []
    for lend in (True, False):
        y = x * 1.0
        if lend:
            with torch.no_grad():
                y.to_local()
        y.sqrt_()
        seen.append(tuple(y.placements))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    assert all(s == everyone[0] for s in everyone), everyone
    assert seen[0] == (P,) and not seen[1][0].is_partial(), seen
