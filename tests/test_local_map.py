"""local_map: gradients laid out as the computation implies, global output shapes decided the same
way on every rank (4 ranks, uneven shards), compared with plain single-process torch.

fp32 throughout; the DTensor path differs from the oracle only in how per-rank partial sums are
added up (a few ulps), so rtol 1e-5 holds for the forward and for every gradient.
"""
import pytest
import torch
import torch.distributed as dist

from dtensor_lite import (DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh,
                          local_map)
from dtensor_lite.debug import CommDebugMode
from tests.harness import distributed

SEQ, DIM, HEAD = 13, 6, 5  # 13 rows over 4 ranks: pieces of 4, 4, 4, 1


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def _attention(q, k, v):
    """Plain torch, run on local pieces: this rank's queries against every key and value."""
    return torch.softmax(q @ k.T / HEAD ** 0.5, dim=-1) @ v


def _weights():
    torch.manual_seed(0)
    return [torch.randn(DIM, HEAD, requires_grad=True) for _ in range(3)]


def _oracle(x, weights, out_weights):
    x = x.clone().requires_grad_()
    wq, wk, wv = weights
    out = _attention(x @ wq, x @ wk, x @ wv)
    (out * out_weights).sum().backward()
    return out.detach(), x.grad, [w.grad for w in weights]


@distributed(world_size=4)
def test_gathered_keys_and_values_get_partial_gradients_by_default():
    """Sequence-sharded attention: K and V are gathered (Replicate) into a computation with
    Shard(0) outputs, so each rank's gradient of K and V is a partial sum. Without the derived
    default the gradients of Wk and Wv were wrong (each rank's contribution taken for the sum)."""
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(1)
    x_full, out_weights = torch.randn(SEQ, DIM), torch.randn(SEQ, HEAD)
    ref_out, ref_dx, ref_dw = _oracle(x_full, _weights(), out_weights)

    weights = [distribute_tensor(w.detach(), mesh, [Replicate()]).requires_grad_()
               for w in _weights()]
    x = distribute_tensor(x_full, mesh, [Shard(0)]).requires_grad_()
    wq, wk, wv = weights
    k = (x @ wk).redistribute(mesh, [Replicate()])
    v = (x @ wv).redistribute(mesh, [Replicate()])
    attend = local_map(_attention, out_placements=[Shard(0)],
                       in_placements=([Shard(0)], [Replicate()], [Replicate()]))
    out = attend(x @ wq, k, v)
    assert out.placements == (Shard(0),) and out.shape == (SEQ, HEAD)
    (out * distribute_tensor(out_weights, mesh, [Shard(0)])).sum().backward()
    _close(out.full_tensor(), ref_out)
    _close(x.grad.full_tensor(), ref_dx)
    for w, ref in zip(weights, ref_dw):
        _close(w.grad.full_tensor(), ref)


def _scale_rows(a, b):
    return a * b.sum(0)


@distributed(world_size=4)
def test_derived_grad_placements_per_mesh_dim():
    """On a 2x2 mesh: b is replicated on both dims, the output is sharded only on mesh dim 0, so
    b's gradient is Partial on dim 0 and Replicate on dim 1; a is Shard on dim 0 and Replicate on
    dim 1 and keeps that layout for its gradient."""
    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(2)
    a_full, b_full, w = torch.randn(7, 3), torch.randn(5, 3), torch.randn(7, 3)
    a_ref, b_ref = a_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    (_scale_rows(a_ref, b_ref) * w).sum().backward()

    a = distribute_tensor(a_full, mesh, [Shard(0), Replicate()]).requires_grad_()
    b = distribute_tensor(b_full, mesh, [Replicate(), Replicate()]).requires_grad_()
    f = local_map(_scale_rows, out_placements=[Shard(0), Replicate()])
    out = f(a, b)
    (out * distribute_tensor(w, mesh, [Shard(0), Replicate()])).sum().backward()
    _close(out.full_tensor(), _scale_rows(a_full, b_full))
    _close(a.grad.full_tensor(), a_ref.grad)
    _close(b.grad.full_tensor(), b_ref.grad)


def _double(a):
    return a * 2


@distributed(world_size=4)
def test_partial_input_gradient_is_replicated():
    """d(sum_r a_r)/d(a_r) = 1: every rank's local gradient is the whole gradient, so a Partial
    input's gradient is Replicate (taking it as Partial multiplied it by the mesh size)."""
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(3)
    pieces = torch.randn(4, 5, 3)
    local = pieces[dist.get_rank()].clone().requires_grad_()
    a = DTensor.from_local(local, mesh, [Partial()])
    w = torch.randn(5, 3)
    out = local_map(_double, out_placements=[Partial()], in_placements=([Partial()],))(a)
    (out.full_tensor() * w).sum().backward()
    _close(out.full_tensor(), pieces.sum(0) * 2)
    _close(local.grad, 2 * w)


@distributed(world_size=4)
def test_explicit_in_grad_placements_are_used():
    """in_grad_placements overrides the derived default (here the user says that this rank's
    local gradient is the whole gradient, and it is: the output is replicated)."""
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(4)
    b_full, w = torch.randn(5, 3), torch.randn(5, 3)
    b = distribute_tensor(b_full, mesh, [Replicate()]).requires_grad_()
    for grad_placements in (None, ([Replicate()],)):
        b.grad = None
        f = local_map(_double, out_placements=[Replicate()], in_grad_placements=grad_placements)
        (f(b).to_local() * w).sum().backward()
        assert b.grad.placements == (Replicate(),)
        _close(b.grad.full_tensor(), 2 * w)
    b.grad = None
    f = local_map(_double, out_placements=[Shard(0)], in_grad_placements=([Partial()],))
    f(b).sum().backward()
    assert b.grad.placements == (Partial(),)
    _close(b.grad.full_tensor(), torch.full((5, 3), 2.0 * 4))  # four ranks' rows, each 2 * b


def _row_and_total(a):
    return a * 3, a.sum()


@distributed(world_size=4)
def test_ambiguous_gradient_layout_raises_on_every_rank():
    mesh = init_device_mesh("cpu", (4,))
    a_full = torch.randn(9, 2)
    a = distribute_tensor(a_full, mesh, [Replicate()]).requires_grad_()
    f = local_map(_row_and_total, out_placements=([Shard(0)], [Replicate()]))
    with pytest.raises(ValueError, match="in_grad_placements"):
        f(a)
    with torch.no_grad():  # no gradient, nothing to derive: fine
        rows, total = f(a)
    assert rows.placements == (Shard(0),) and total.placements == (Replicate(),)
    _close(rows.full_tensor(), torch.cat([a_full * 3] * 4))  # each rank's rows, stacked


def _two_columns(a):
    return torch.ones(a.shape[0], 2)


@distributed(world_size=4)
def test_output_shape_is_decided_from_placements_on_every_rank():
    """[4, 7] Shard(1) gives pieces of 2, 2, 2, 1 columns; the output has 2 columns on every rank,
    so only rank 3's piece differs from its input's. Every rank must take the same branch: this
    used to abort gloo (only rank 3 entered the shape exchange)."""
    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.randn(4, 7), mesh, [Shard(1)])
    f = local_map(_two_columns, out_placements=[Shard(1)], in_placements=([Shard(1)],))
    # the input laid out like the output suggests (4, 7), but rank 3's piece does not fit it:
    # the ranks agree on that (one 1-element all-reduce), then exchange their local shapes and
    # every rank gets (4, 8) -- no rank keeps a (4, 7) DTensor while another raises
    with CommDebugMode() as comm:
        out = f(x)
    assert out.shape == (4, 8) and out.placements == (Shard(1),)
    _close(out.full_tensor(), torch.ones(4, 8))
    assert comm.get_comm_counts()["all_reduce"] == 1
    assert set(comm.get_comm_counts_by_op()) == {"local_map(_two_columns)"}
    # where every piece fits the input's shape, that one small all-reduce is all it costs
    g = local_map(_same_shape, out_placements=[Shard(1)], in_placements=([Shard(1)],))
    with CommDebugMode() as comm:
        same = g(x)
    assert same.shape == (4, 7) and comm.get_comm_counts() == {"all_reduce": 1}
    _close(same.full_tensor(), x.full_tensor() + 1)
    # out_shape= says it up front: no communication at all, the right shape everywhere
    f = local_map(_two_columns, out_placements=[Shard(1)], in_placements=([Shard(1)],),
                  out_shape=(4, 8))
    with CommDebugMode() as comm:
        out = f(x)
    assert comm.get_total_counts() == 0
    assert out.shape == (4, 8) and out.placements == (Shard(1),)
    _close(out.full_tensor(), torch.ones(4, 8))
    # no input laid out like the output: every rank exchanges its local shape
    xr = x.redistribute(mesh, [Replicate()])
    f = local_map(_two_columns, out_placements=[Shard(1)])
    with CommDebugMode() as comm:
        out = f(xr)
    assert out.shape == (4, 8)
    _close(out.full_tensor(), torch.ones(4, 8))
    assert set(comm.get_comm_counts_by_op(by_input=True)) == {("local_map(_two_columns)",
                                                              "out_shape")}


def _same_shape(a):
    return a + 1


@distributed(world_size=4)
def test_out_shape_per_output_and_torch_spellings():
    """torch's spellings: a tuple of placements per flattened output (None for a non-tensor), the
    decorator form (func=None), in_placements per flattened positional input."""
    mesh = init_device_mesh("cpu", (4,))
    x_full = torch.randn(13, 3)
    x = distribute_tensor(x_full, mesh, [Shard(0)])

    @local_map(out_placements=([Shard(0)], None, [Replicate()]), in_placements=([Shard(0)], None),
               out_shape=((13, 3), None, None))
    def stats(a, scale):
        return a * scale, "tag", torch.ones(2) * scale

    with CommDebugMode() as comm:
        y, tag, r = stats(x, 2.0)
    assert comm.get_total_counts() == 0 and tag == "tag"
    _close(y.full_tensor(), x_full * 2)
    _close(r.full_tensor(), torch.ones(2) * 2)
    # nested inputs are flattened as torch does
    f = local_map(lambda pair: pair[0] + pair[1], out_placements=[Shard(0)],
                  in_placements=([Shard(0)], [Shard(0)]), out_shape=(13, 3))
    _close(f((x, x)).full_tensor(), x_full * 2)
    with pytest.raises(ValueError, match="in_placements has 1 entries"):
        local_map(_same_shape, out_placements=[Shard(0)], in_placements=([Shard(0)],))(x, x)


def _rank_rows(a):
    return torch.ones(5 if dist.get_rank() == 3 else 1, a.shape[1])


@distributed(world_size=4)
def test_bad_output_pieces_raise_on_every_rank():
    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.randn(8, 3), mesh, [Shard(0)])
    # pieces 1, 1, 1, 5 are not torch.chunk pieces of 8 rows: every rank learns it together
    with pytest.raises(ValueError, match="torch.chunk"):
        local_map(_rank_rows, out_placements=[Shard(0)])(x.redistribute(mesh, [Replicate()]))
    # a wrong out_shape is caught on the ranks whose piece does not fit it
    f = local_map(_same_shape, out_placements=[Shard(0)], out_shape=(7, 3))
    if dist.get_rank() == 3:  # 7 rows are pieces of 2, 2, 2, 1; this rank holds 2
        with pytest.raises(ValueError, match="out_shape"):
            f(x)
    else:
        f(x)


@distributed(world_size=4)
def test_out_placements_of_the_wrong_length_are_named():
    mesh = init_device_mesh("cpu", (2, 2))
    a = distribute_tensor(torch.randn(4, 2), mesh, [Shard(0), Replicate()]).requires_grad_()
    with pytest.raises(ValueError, match="2-D mesh"):
        local_map(_double, out_placements=[Shard(0)])(a)
