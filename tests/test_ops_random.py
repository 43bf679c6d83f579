"""Random ops on DTensors give the same global values as plain torch under the same seed, on
every mesh and placement, and leave every rank's generator exactly where plain torch leaves it."""
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtensor_lite import (DTensor, Partial, Replicate, Shard, _StridedShard, distribute_tensor,
                          init_device_mesh)
from dtensor_lite.debug import CommDebugMode
from dtensor_lite.random import manual_seed, set_rng_sync_mode, sync_rng_state
from tests.harness import distributed, run_distributed

aten = torch.ops.aten

# shapes: even, uneven (5 rows on 4 ranks -> 2,2,1,0), and a dim smaller than the mesh (empties)
SHAPES = [(5, 3), (4, 6), (3, 1)]
PLACEMENTS_1D = [[Shard(0)], [Shard(1)], [Replicate()], [Partial()], [Partial("avg")]]
PLACEMENTS_2D = [
    [Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)], [Shard(1), Shard(1)],
    [Replicate(), Shard(1)], [Shard(0), Replicate()], [Replicate(), Replicate()],
    [Partial(), Shard(0)], [Shard(1), Partial()], [Partial(), Partial("avg")],
]


def _meshes():
    return [(init_device_mesh("cpu", (4,)), PLACEMENTS_1D),
            (init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), PLACEMENTS_2D)]


def _test_device_generator():
    """The default generator of the device plain factories use (cuda:0 under DTL_TEST_DEVICE)."""
    return torch.cuda.default_generators[0] if torch.empty(0).is_cuda else torch.default_generator


def _same_as_plain(fn_dt, fn_plain, seed):
    """Run both under the same seed; return both results and assert the generator ended up in
    the same state (the DTensor op consumed exactly what the plain op consumed)."""
    # the generator's own methods: torch.manual_seed / get_rng_state go through dynamo's
    # disable wrapper, which costs ~20 ms a call on this machine once dynamo is imported
    gen = _test_device_generator()
    gen.manual_seed(seed)
    a = fn_dt()
    state_dt = gen.get_state()
    gen.manual_seed(seed)
    b = fn_plain()
    assert torch.equal(state_dt, gen.get_state()), "generator advanced differently"
    return a, b


def _moves(comm):
    """Collectives other than the generator check every random op makes (rng_check)."""
    return sum(n for op, kinds in comm.get_comm_counts_by_op().items() if op != "rng_check"
               for n in kinds.values())


def _check(a, b):
    if isinstance(a, DTensor):
        a = a.full_tensor()
    torch.testing.assert_close(a, b, rtol=0, atol=0)


INPLACE = [
    ("uniform_", lambda t: t.uniform_(-2.0, 3.0)),
    ("normal_", lambda t: t.normal_(1.0, 0.5)),
    ("bernoulli_", lambda t: t.bernoulli_(0.3)),
    ("exponential_", lambda t: t.exponential_(2.0)),
    ("random_from_to", lambda t: t.random_(-3, 10)),
    ("random_to", lambda t: t.random_(7)),
    ("cauchy_", lambda t: t.cauchy_()),
    ("log_normal_", lambda t: t.log_normal_()),
    ("geometric_", lambda t: t.geometric_(0.4)),
]


def _expected_piece(d, full):
    """The local tensor this rank must hold when ``d``'s global value is ``full``: its piece,
    or zeros where a Partial(sum) mesh dim gives the value to coordinate 0 only."""
    shape, offset = d._spec.local_shape_and_offset()
    piece = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
    coord = d.device_mesh.get_coordinate()
    if any(p.is_partial("sum") and coord[i] != 0 for i, p in enumerate(d.placements)):
        return torch.zeros_like(piece)
    return piece


@distributed(world_size=4)
def test_inplace_random_ops_match_plain_torch():
    for mesh, placements in _meshes():
        sync_rng_state(mesh)
        for j, pl in enumerate(placements):
            for shape in (SHAPES[j % 3], SHAPES[(j + 1) % 3]):
                d = distribute_tensor(torch.zeros(shape), mesh, pl)
                for k, (name, fn) in enumerate(INPLACE):
                    ref = torch.zeros(shape)
                    with CommDebugMode() as comm:
                        a, b = _same_as_plain(lambda: fn(d), lambda: fn(ref), k)
                    assert _moves(comm) == 0, (name, pl)
                    assert a is d and d.placements == tuple(pl), (name, pl)
                    _check(d.to_local(), _expected_piece(d, b))
                _check(d, b)  # the last one once more through a real gather
                # random_() without bounds on an integer tensor (huge values: an avg of them
                # would overflow while summing, so no Partial("avg") here)
                if not any(q.is_partial("avg") for q in pl):
                    d = distribute_tensor(torch.zeros(shape, dtype=torch.int64), mesh, pl)
                    ref = torch.zeros(shape, dtype=torch.int64)
                    a, b = _same_as_plain(lambda: d.random_(), lambda: ref.random_(), 9)
                    _check(d.to_local(), _expected_piece(d, b))


@distributed(world_size=4)
def test_partial_destination_holds_the_value_once():
    mesh = init_device_mesh("cpu", (2, 2))
    d = distribute_tensor(torch.zeros(4, 3), mesh, [Partial(), Partial("avg")])
    torch.manual_seed(3)
    d.uniform_()
    torch.manual_seed(3)
    expected = torch.rand(4, 3)
    # sum over dim 0: coordinate 0 holds the value, coordinate 1 zeros; avg: everyone holds it
    coord = mesh.get_coordinate()
    local = d.to_local()
    _check(local, expected if coord[0] == 0 else torch.zeros(4, 3))
    _check(d, expected)


FUNCTIONAL = [
    ("rand_like", lambda t: torch.rand_like(t)),
    ("randn_like", lambda t: torch.randn_like(t, dtype=torch.float64)),
    ("randint_like", lambda t: torch.randint_like(t, 10)),
    ("randint_like_low", lambda t: torch.randint_like(t, -5, 5, dtype=torch.int32)),
    ("bernoulli_p", lambda t: torch.bernoulli(t, 0.25)),
    ("uniform", lambda t: aten.uniform.default(t, 1.0, 2.0)),
    ("exponential", lambda t: aten.exponential.default(t)),
]


@distributed(world_size=4)
def test_functional_random_ops_match_plain_torch():
    for mesh, placements in _meshes():
        sync_rng_state(mesh)
        for j, pl in enumerate(placements):
            for shape in (SHAPES[j % 3], SHAPES[(j + 1) % 3]):
                x = torch.randn(shape)
                d = distribute_tensor(x, mesh, pl)
                for k, (name, fn) in enumerate(FUNCTIONAL):
                    with CommDebugMode() as comm:
                        a, b = _same_as_plain(lambda: fn(d), lambda: fn(x), k)
                    # the input's values are not read: not even a Partial input is reduced
                    assert _moves(comm) == 0, (name, pl)
                    want = tuple(Replicate() if p.is_partial() else p for p in pl)
                    assert a.placements == want, (name, pl, a.placements)
                    _check(a, b)


@distributed(world_size=4)
def test_random_ops_with_tensor_parameters():
    """bernoulli(p), bernoulli_(p), normal(mean, std): the parameters' values matter and are
    used where they are, without being gathered."""
    for mesh, placements in _meshes():
        sync_rng_state(mesh)
        for j, pl in enumerate(placements):
            shape = SHAPES[j % 3]
            p = torch.rand(shape)
            mean, std = torch.randn(shape), torch.rand(shape) + 0.1
            row = torch.rand(shape[-1])
            dp, dmean, dstd = (distribute_tensor(t, mesh, pl) for t in (p, mean, std))
            partial = any(q.is_partial() for q in pl)
            with CommDebugMode() as comm:
                results = [
                    _same_as_plain(lambda: torch.bernoulli(dp), lambda: torch.bernoulli(p), 1),
                    _same_as_plain(lambda: torch.normal(dmean, 0.5),
                                   lambda: torch.normal(mean, 0.5), 2),
                    _same_as_plain(lambda: torch.normal(0.5, dstd),
                                   lambda: torch.normal(0.5, std), 3),
                    _same_as_plain(lambda: torch.normal(dmean, dstd),
                                   lambda: torch.normal(mean, std), 4)]
            for a, b in results:
                _check(a, b)
            # a Partial parameter must be reduced (its values matter); nothing else moves
            assert (_moves(comm) == 0) == (not partial), (pl, comm.get_comm_counts())
            # in place, with p of another placement and broadcast
            for ppl in (pl, placements[(j + 1) % len(placements)],
                        placements[(j + 3) % len(placements)]):
                d = distribute_tensor(torch.zeros(shape), mesh, pl)
                dp2 = distribute_tensor(p, mesh, ppl)
                _check(*_same_as_plain(lambda: d.bernoulli_(dp2),
                                       lambda: torch.zeros(shape).bernoulli_(p), 5))
                assert d.placements == tuple(pl)
            # both parameters broadcast: the output is drawn replicated
            col = torch.randn(shape[0], 1)
            dcol = distribute_tensor(col, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
            drow_s = distribute_tensor(row + 0.1, mesh, [Replicate()] * (mesh.ndim - 1) + [Shard(0)])
            out, ref = _same_as_plain(lambda: torch.normal(dcol, drow_s),
                                      lambda: torch.normal(col, row + 0.1), 7)
            if shape[-1] > 1:  # else col has the output's shape and leads the sharding
                assert out.placements == (Replicate(),) * mesh.ndim
            _check(out, ref)
            drow = distribute_tensor(row, mesh, [Replicate()] * mesh.ndim)
            d = distribute_tensor(torch.zeros(shape), mesh, pl)
            _check(*_same_as_plain(lambda: d.bernoulli_(drow),
                                   lambda: torch.zeros(shape).bernoulli_(row), 6))


@distributed(world_size=4)
def test_dropout_forward_backward_match_plain_torch():
    for mesh, placements in _meshes():
        sync_rng_state(mesh)
        for shape in SHAPES:
            x = torch.randn(shape)
            g = torch.randn(shape)
            for pl in placements:
                dx = distribute_tensor(x, mesh, pl).requires_grad_()
                xx = x.clone().requires_grad_()
                a, b = _same_as_plain(lambda: F.dropout(dx, 0.4), lambda: F.dropout(xx, 0.4), 7)
                _check(a, b)
                grad_pl = [Replicate() if q.is_partial() else q for q in pl]
                a.backward(distribute_tensor(g, mesh, grad_pl))
                b.backward(g)
                torch.testing.assert_close(dx.grad.full_tensor(), xx.grad)


@distributed(world_size=4)
def test_native_dropout_keeps_partial_and_matches_plain_torch():
    for mesh, placements in _meshes():
        sync_rng_state(mesh)
        for shape in SHAPES:
            x = torch.randn(shape)
            for pl in placements:
                dx = distribute_tensor(x, mesh, pl)
                for train in (True, False):
                    with CommDebugMode() as comm:
                        (out, mask), (out_p, mask_p) = _same_as_plain(
                            lambda: aten.native_dropout.default(dx, 0.3, train),
                            lambda: aten.native_dropout.default(x, 0.3, train), 8)
                    assert _moves(comm) == 0
                    assert out.placements == tuple(pl)  # linear in x for a fixed mask
                    assert mask.placements == tuple(Replicate() if q.is_partial() else q
                                                    for q in pl)
                    torch.testing.assert_close(out.full_tensor(), out_p)
                    _check(mask, mask_p)


INITS = [
    ("uniform_", lambda w: nn.init.uniform_(w, -0.3, 0.7)),
    ("normal_", lambda w: nn.init.normal_(w, 0.1, 2.0)),
    ("trunc_normal_", lambda w: nn.init.trunc_normal_(w, std=0.7, a=-1.0, b=1.0)),
    ("kaiming_uniform_", lambda w: nn.init.kaiming_uniform_(w, a=5 ** 0.5)),
    ("kaiming_normal_", lambda w: nn.init.kaiming_normal_(w, mode="fan_out")),
    ("xavier_uniform_", lambda w: nn.init.xavier_uniform_(w, gain=2.0)),
    ("xavier_normal_", lambda w: nn.init.xavier_normal_(w)),
]


@distributed(world_size=4)
def test_nn_init_on_dtensor_parameters_matches_plain_init():
    for mesh, placements in _meshes():
        sync_rng_state(mesh)
        for shape in [(5, 3), (4, 6), (6, 2, 3)]:
            for pl in placements:
                if any(q.is_partial() for q in pl) or any(q.is_shard(2) for q in pl):
                    continue  # parameters are Shard/Replicate
                for k, (name, init) in enumerate(INITS):
                    w = nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, pl))
                    ref = nn.Parameter(torch.zeros(shape))
                    a, b = _same_as_plain(lambda: init(w), lambda: init(ref), k)
                    assert w.placements == tuple(pl), name
                    torch.testing.assert_close(w.full_tensor(), ref.detach(),
                                               msg=lambda m: f"{name} {pl} {shape}: {m}")


@distributed(world_size=4)
def test_module_reset_parameters_on_sharded_linear():
    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    ref = nn.Linear(6, 5)
    lin = nn.Linear(6, 5)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0), Shard(1)]))
    lin.bias = nn.Parameter(distribute_tensor(lin.bias.detach(), mesh, [Shard(0), Replicate()]))
    _same_as_plain(lin.reset_parameters, ref.reset_parameters, 11)
    torch.testing.assert_close(lin.weight.full_tensor(), ref.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(lin.bias.full_tensor(), ref.bias.detach(), rtol=0, atol=0)


@distributed(world_size=4)
def test_non_contiguous_global_layout():
    """The stand-in has the global strides, so draws land where plain torch puts them."""
    mesh = init_device_mesh("cpu", (2, 2))
    base = torch.zeros(6, 4)
    d = distribute_tensor(base, mesh, [Shard(0), Shard(1)]).t()
    a, b = _same_as_plain(lambda: d.uniform_(), lambda: base.clone().t().uniform_(), 1)
    _check(a, b)


@distributed(world_size=4)
def test_three_dim_mesh_and_strided_shard():
    """Any number of mesh dims, and a non-default shard order (FSDP over TP)."""
    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("a", "b", "c"))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cases = [(mesh3, [Shard(0), Shard(1), Shard(0)]), (mesh3, [Partial(), Replicate(), Shard(1)]),
             (mesh3, [Shard(1), Partial("avg"), Partial()]),
             (mesh2, [_StridedShard(0, split_factor=2), Shard(0)]),
             (mesh2, [_StridedShard(1, split_factor=2), Shard(1)])]
    for mesh, pl in cases:
        sync_rng_state(mesh)
        for shape in [(5, 3), (7, 6)]:
            d = distribute_tensor(torch.zeros(shape), mesh, pl)
            a, b = _same_as_plain(lambda: d.normal_(), lambda: torch.zeros(shape).normal_(), 2)
            _check(d.to_local(), _expected_piece(d, b))
            _check(d, b)
            x = torch.randn(shape)
            dx = distribute_tensor(x, mesh, pl)
            (o, m), (o_p, m_p) = _same_as_plain(
                lambda: aten.native_dropout.default(dx, 0.5, True),
                lambda: aten.native_dropout.default(x, 0.5, True), 3)
            assert o.placements == dx.placements
            torch.testing.assert_close(o.full_tensor(), o_p)
            _check(m, m_p)


@distributed(world_size=4)
def test_explicit_generator():
    mesh = init_device_mesh("cpu", (2, 2))
    d = distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0), Shard(1)])
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    d.normal_(generator=g1)
    expected = torch.zeros(5, 3).normal_(generator=g2)
    _check(d, expected)
    assert torch.equal(g1.get_state(), g2.get_state())
    r = torch.rand_like(d, generator=g1)
    _check(r, torch.rand_like(expected, generator=g2))


@distributed(world_size=4)
def test_rng_states_that_differ_are_synced_once_with_a_warning():
    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(100 + dist.get_rank())  # a user mistake: per-rank seeds
    d = distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0), Shard(1)])
    with warnings.catch_warnings(record=True) as caught, CommDebugMode() as comm:
        warnings.simplefilter("always")
        assert sync_rng_state(mesh) is True
    assert any("differed across the ranks" in str(w.message) for w in caught)
    # one tiny all-reduce per mesh dim to compare, one broadcast per mesh dim to fix
    assert comm.get_comm_counts() == {"all_reduce": 2, "broadcast": 2}
    d.uniform_()
    torch.manual_seed(100)  # rank 0's stream
    _check(d, torch.rand(4, 4))
    # agreeing states: compare only, no broadcast, no warning
    with warnings.catch_warnings(record=True) as caught, CommDebugMode() as comm:
        warnings.simplefilter("always")
        assert sync_rng_state(mesh) is False
    assert not caught and comm.get_comm_counts() == {"all_reduce": 2}


@distributed(world_size=4)
def test_default_mode_checks_only_results_held_by_several_ranks():
    mesh = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(7)
    d = distribute_tensor(torch.zeros(8), mesh, [Shard(0)])
    r = distribute_tensor(torch.zeros(8), mesh, [Replicate()])
    d2 = distribute_tensor(torch.zeros(8, 4), mesh2, [Shard(0), Replicate()])
    with CommDebugMode() as comm:  # sharded on every mesh dim: each rank draws its own piece
        d.uniform_()
        torch.rand_like(d)
    assert comm.get_total_counts() == 0
    with CommDebugMode() as comm:  # replicated: one all-reduce of two int64 per op
        r.uniform_()
        torch.rand_like(r)
    assert comm.get_comm_counts_by_op() == {"rng_check": {"all_reduce": 2}}
    with CommDebugMode() as comm:  # only over the mesh dim that replicates
        d2.normal_()
    assert comm.get_comm_counts_by_op() == {"rng_check": {"all_reduce": 1}}
    set_rng_sync_mode("always")
    try:
        with CommDebugMode() as comm:  # every op, every mesh dim
            d.uniform_()
            d.normal_()
        assert comm.get_comm_counts_by_op() == {"rng_check": {"all_reduce": 2}}
        set_rng_sync_mode("once")
        manual_seed(7, mesh)  # trusted: marks the mesh as agreeing, no communication
        with CommDebugMode() as comm:
            r.uniform_()
            r.normal_()
        assert comm.get_total_counts() == 0
        sub = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))["b"]
        e = distribute_tensor(torch.zeros(8), sub, [Shard(0)])
        torch.manual_seed(1)  # same on every rank; the sub-mesh has not been checked yet
        with CommDebugMode() as comm:
            e.uniform_()
            e.uniform_()
        assert comm.get_comm_counts() == {"all_reduce": 1}
    finally:
        set_rng_sync_mode("replicated")
    with pytest.raises(ValueError, match="set_rng_sync_mode"):
        set_rng_sync_mode("sometimes")


@distributed(world_size=2)
def test_sharded_dropout_issues_no_collective_and_matches_plain_torch():
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(64, 64)
    dx = distribute_tensor(x, mesh, [Shard(0)])
    for _ in range(2):  # the first call decides, the second is a cache hit
        torch.manual_seed(5)
        with CommDebugMode() as comm:
            out = F.dropout(dx, 0.5)
        assert comm.get_total_counts() == 0
        torch.manual_seed(5)
        _check(out, F.dropout(x, 0.5))


@distributed(world_size=4)
def test_divergent_seeds_never_give_different_replicated_values():
    """Ranks seeded differently: a sharded draw is each rank's own piece (no value is claimed by
    two ranks, no communication); the next replicated draw finds the divergence, warns, and
    every rank ends up with the same values -- those of coordinate 0's generator."""
    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(100 + dist.get_rank())
    d = distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0), Shard(1)])
    with CommDebugMode() as comm:
        d.uniform_()
    assert comm.get_total_counts() == 0
    r = distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0), Replicate()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r.normal_()
    assert any("differed across the ranks" in str(w.message) for w in caught)
    pieces = [torch.empty_like(r.to_local()) for _ in range(4)]
    dist.all_gather(pieces, r.to_local().contiguous())
    coord = mesh.get_coordinate()
    partner = pieces[dist.get_rank() ^ 1]  # the other rank of this row: the same piece
    assert torch.equal(partner, r.to_local()), coord
    # the rows now agree within themselves, not with each other: a result replicated over the
    # whole mesh finds that and repairs it; after that every rank agrees (no warning)
    full = distribute_tensor(torch.zeros(3), mesh, [Replicate(), Replicate()])
    for expect_warning in (True, False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = torch.rand_like(full)
        assert bool(caught) == expect_warning
        values = [torch.empty(3) for _ in range(4)]
        dist.all_gather(values, out.to_local())
        assert all(torch.equal(v, values[0]) for v in values)


def test_orthogonal_init_on_dtensor_parameters():
    # orthogonal_ transposes in place (aten.t_) when rows < cols, which changes the DTensor's
    # own shape and placements; the values must still be plain torch's under the same seed
    run_distributed(4, _orthogonal_body)


def _orthogonal_body():
    mesh = init_device_mesh("cpu", (2, 2))
    sync_rng_state(mesh)
    # tall and wide (the wide ones go through t_), uneven shards, a 3-D weight (whose view_as
    # to rows x cols must keep its shards: a view that gathers would be a copy)
    for shape, pl in [((5, 3), [Shard(0), Shard(1)]), ((3, 6), [Replicate(), Shard(0)]),
                      ((3, 7), [Shard(1), Shard(0)]), ((2, 3, 5), [Shard(0), Replicate()])]:
        w = nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, pl))
        ref = nn.Parameter(torch.zeros(shape))
        out, _ = _same_as_plain(lambda: nn.init.orthogonal_(w), lambda: nn.init.orthogonal_(ref),
                                1)
        assert out is w and w.shape == shape and w.placements == tuple(pl), (shape, pl)
        torch.testing.assert_close(w.full_tensor(), ref.detach(), rtol=0, atol=0)


def _shortcut(func):
    """The replay ``_fast_path`` learned for calls of ``func`` (None if none)."""
    from dtensor_lite import _fast_path
    return next((v for k, v in _fast_path._SHORTCUTS.items()
                 if k[0] is func and v is not _fast_path._NO_SHORTCUT), None)


@distributed(world_size=2)
def test_replayed_random_calls_draw_as_plain_torch_and_still_check():
    """Random calls the ``__torch_function__`` shortcut replays (learned on the first call):
    plain torch's values and generator state on every call, no collective for a sharded
    result, and for a replicated one the generator check on every replay, which finds ranks
    seeded differently and repairs them with a warning."""
    from dtensor_lite import _caches, _fast_path
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(8, 6)
    dx = distribute_tensor(x, mesh, [Shard(0)])
    rx = distribute_tensor(x, mesh, [Replicate()])
    z = distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)])
    cases = [(dx, lambda: F.dropout(dx, 0.3), lambda: F.dropout(x, 0.3)),
             (dx, lambda: torch.rand_like(dx), lambda: torch.rand_like(x)),
             (z, lambda: z.normal_(), lambda: torch.zeros(8, 6).normal_()),
             (rx, lambda: F.dropout(rx, 0.3), lambda: F.dropout(x, 0.3))]
    _caches.clear_decisions()  # nothing learned by earlier tests in this worker
    with _fast_path.enabled():
        # dropout in eval returns its input (no op to replay): that rules out this key only
        assert F.dropout(dx, 0.3, training=False) is dx
        for d, ours, ref in cases:
            for seed in range(3):  # learn, then replays
                with CommDebugMode() as comm:
                    a, b = _same_as_plain(ours, ref, seed)
                _check(a, b)
                checks = 0 if d.placements[0].is_shard() else 1
                assert comm.get_comm_counts_by_op() == (
                    {"rng_check": {"all_reduce": checks}} if checks else {})
        # learned under CommDebugMode too (it counts collectives; a replay issues the same)
        assert _shortcut(F.dropout) is not None and _shortcut(torch.Tensor.normal_) is not None
        torch.manual_seed(100 + dist.get_rank())  # a user mistake: per-rank seeds
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = F.dropout(rx, 0.3)
        assert any("differed across the ranks" in str(w.message) for w in caught)
        pieces = [torch.empty(8, 6) for _ in range(2)]
        dist.all_gather(pieces, out.to_local())
        assert torch.equal(pieces[0], pieces[1])
