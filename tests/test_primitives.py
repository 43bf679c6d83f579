"""dtensor_lite.primitives on 4 ranks: ring shifts, point-to-point pairs, the uneven all-to-all
and shard offsets -- values and gradients against plain torch in one process, communication as
CommDebugMode counts it.

Every primitive only moves values (no arithmetic), so values and gradients must be bit-exact.
Uneven throughout: a 13-row tensor sharded over 4 ranks holds 4, 4, 4, 1 rows.
"""
import pytest
import torch
import torch.distributed as dist

from dtensor_lite import (DeviceMesh, Replicate, Shard, _StridedShard, all_to_all_single,
                          compute_local_shape_and_global_offset, distribute_tensor,
                          init_device_mesh, local_map, ring_shift, send_recv)
from dtensor_lite.collectives import Pending
from dtensor_lite.debug import CommDebugMode
from tests.harness import distributed

ROWS, COLS = 13, 3  # torch.chunk over 4 ranks: 4, 4, 4, 1


def _pieces(t, n=4):
    return list(torch.chunk(t, n))


@distributed(world_size=4)
@pytest.mark.parametrize("shift", [1, -1, 2, 5])
@pytest.mark.parametrize("async_op", [False, True])
def test_ring_shift_uneven_values_gradients_and_counts(shift, async_op):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    me = dist.get_rank()
    torch.manual_seed(0)
    whole, weight = torch.randn(ROWS, COLS), torch.randn(ROWS, COLS)
    xs, ws = _pieces(whole), _pieces(weight)
    src = (me - shift) % 4
    x = xs[me].clone().requires_grad_()
    with CommDebugMode() as comm:
        got = ring_shift(x, mesh, "cp", shift, recv_shape=xs[src].shape, async_op=async_op)
        if async_op:
            assert isinstance(got, Pending)
            got = got.wait()
        (got * ws[me]).sum().backward()
    assert torch.equal(got, xs[src])
    # the oracle: the same shift of the pieces in one process, differentiated by torch
    ref = [p.clone().requires_grad_() for p in xs]
    sum((ref[(k - shift) % 4] * ws[k]).sum() for k in range(4)).backward()
    assert torch.equal(x.grad, ref[me].grad)
    # one shift forward (this rank's piece), the opposite shift backward (the received piece)
    assert comm.get_comm_counts() == {"ring_shift": 2}
    assert [c[1] for c in comm.calls] == [x.numel() * 4, got.numel() * 4]
    assert {c[4] for c in comm.calls} == {"cp"}


@distributed(world_size=4)
def test_ring_shift_along_one_dim_of_a_2d_mesh_inside_local_map():
    """Inside local_map on the "cp" dim of a 2x2 mesh: the DTensor's gradient comes back."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    torch.manual_seed(0)
    whole, weight = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6)
    x = distribute_tensor(whole.detach(), mesh, [Replicate(), Shard(1)]).requires_grad_()
    cp = mesh.get_local_rank("cp")
    swap_halves = local_map(lambda local: ring_shift(local, mesh, "cp"),
                            [Replicate(), Shard(1)], ([Replicate(), Shard(1)],),
                            out_shape=whole.shape)  # known: local_map need not exchange shapes
    with CommDebugMode() as comm:
        y = swap_halves(x)
        (y.to_local() * weight[:, 3 * cp:3 * cp + 3]).sum().backward()
    ref = torch.cat([whole[:, 3:], whole[:, :3]], dim=1)
    assert torch.equal(y.full_tensor(), ref.detach())
    (ref * weight).sum().backward()
    assert x.grad.placements == (Replicate(), Shard(1))
    assert torch.equal(x.grad.full_tensor(), whole.grad)
    assert comm.get_comm_counts() == {"ring_shift": 2}
    assert set(comm.get_comm_bytes_by_mesh_dim()) == {"cp"}


@distributed(world_size=4)
def test_send_recv_pair_is_a_two_stage_pipeline():
    """Coordinates 0 -> 1 and 2 -> 3: stage 0's activation crosses, stage 1's gradient comes
    back; parameters of both stages get one-process gradients."""
    mesh = init_device_mesh("cpu", (4,))
    me = dist.get_rank()
    torch.manual_seed(0)
    x, w0, w1 = torch.randn(5, 3), torch.randn(3, 4), torch.randn(4, 2)
    ref0, ref1 = w0.clone().requires_grad_(), w1.clone().requires_grad_()
    (x @ ref0 @ ref1).tanh().sum().backward()
    with CommDebugMode() as comm:
        if me % 2 == 0:
            w = w0.clone().requires_grad_()
            handle = send_recv(x @ w, mesh, 0, dst=me + 1)
            assert handle.numel() == 0 and handle.requires_grad
            handle.sum().backward()           # receives the activation's gradient
            torch.testing.assert_close(w.grad, ref0.grad, rtol=0, atol=0)
        else:
            w = w1.clone().requires_grad_()
            h = send_recv(None, mesh, 0, src=me - 1, recv_shape=(5, 4), recv_dtype=torch.float32,
                          requires_grad=True)
            (h @ w).tanh().sum().backward()   # sends h's gradient to the previous stage
            torch.testing.assert_close(w.grad, ref1.grad, rtol=0, atol=0)
    assert comm.get_comm_counts() == {"send_recv": 2}
    sent = 5 * 4 * 4  # the activation forward / its gradient backward: one 5x4 fp32 each way
    assert [c[1] for c in comm.calls] == ([sent, 0] if me % 2 == 0 else [0, sent])


def _a2a_splits(n=4):
    """Rows rank c sends to rank k: uneven, zeros included."""
    return [[(c + 2 * k) % 3 for k in range(n)] for c in range(n)]


@distributed(world_size=4)
@pytest.mark.parametrize("order", [[0, 1, 2, 3], [2, 0, 3, 1]])
def test_all_to_all_single_uneven_values_gradients_and_bytes(order):
    """Also on a mesh whose coordinates are not in rank order (the group reorders)."""
    mesh = DeviceMesh("cpu", order)
    me = mesh.get_local_rank()
    splits = _a2a_splits()
    torch.manual_seed(0)
    inputs = [torch.randn(sum(splits[c]), COLS) for c in range(4)]
    weights = [torch.randn(sum(splits[k][c] for k in range(4)), COLS) for c in range(4)]
    x = inputs[me].clone().requires_grad_()
    recv = [splits[k][me] for k in range(4)]
    with CommDebugMode() as comm:
        out = all_to_all_single(x, mesh, 0, recv, splits[me])
        (out * weights[me]).sum().backward()
    # the oracle: every rank's pieces split and regrouped in one process
    ref = [t.clone().requires_grad_() for t in inputs]
    parts = [r.split(splits[c]) for c, r in enumerate(ref)]
    outs = [torch.cat([parts[k][c] for k in range(4)]) for c in range(4)]
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()
    assert torch.equal(out, outs[me].detach())
    assert torch.equal(x.grad, ref[me].grad)
    row = COLS * 4
    sent_fwd = (sum(splits[me]) - splits[me][me]) * row   # rows to other ranks, no padding
    sent_bwd = (sum(recv) - recv[me]) * row                # the gradient rows going back
    assert comm.get_comm_counts() == {"all_to_all": 2}
    assert [c[1] for c in comm.calls] == [sent_fwd, sent_bwd]


@distributed(world_size=4)
def test_all_to_all_single_equal_splits_and_async_under_exposed_comm_mode():
    """Async primitives report to ExposedCommMode like any collective (a send/receive pair has
    no single completion future: its flight ends at the wait)."""
    from dtensor_lite.debug import ExposedCommMode
    mesh = init_device_mesh("cpu", (4,))
    me = dist.get_rank()
    x = torch.arange(8.).view(4, 2) + 10 * me
    with ExposedCommMode() as timing:
        pending = all_to_all_single(x, mesh, 0, async_op=True)
        shifted = ring_shift(x, mesh, 0, async_op=True)
        assert isinstance(pending, Pending) and isinstance(shifted, Pending)
        out, got = pending.wait(), shifted.wait()
    assert torch.equal(out, torch.stack([torch.arange(8.).view(4, 2)[me] + 10 * k
                                         for k in range(4)]))
    assert torch.equal(got, torch.arange(8.).view(4, 2) + 10 * ((me - 1) % 4))
    assert set(timing.by_kind()) == {"all_to_all", "ring_shift"}
    assert 0 <= timing.exposed_s <= timing.total_s


@distributed(world_size=4)
@pytest.mark.parametrize("shape, placements", [
    ((13, 6), [Shard(0), Replicate()]),
    ((13, 6), [Shard(0), Shard(0)]),               # nested: chunk of a chunk
    ((13, 6), [Shard(1), Shard(0)]),
    ((13, 6), [_StridedShard(0, split_factor=2), Shard(0)]),
    ((3, 2), [Shard(0), Shard(0)]),                # empty pieces
])
def test_local_offset_matches_the_local_pieces(shape, placements):
    mesh = init_device_mesh("cpu", (2, 2))
    whole = torch.arange(shape[0] * shape[1], dtype=torch.float32).view(shape)
    dt = distribute_tensor(whole, mesh, placements)
    offset = dt.local_offset()
    local = dt.to_local()
    assert compute_local_shape_and_global_offset(shape, mesh, placements) == \
        (tuple(local.shape), offset)
    piece = whole[offset[0]:offset[0] + local.shape[0], offset[1]:offset[1] + local.shape[1]]
    assert torch.equal(local, piece)
    # every coordinate's piece, from metadata alone: together they cover each element once
    cover = torch.zeros(shape)
    for c in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        (r, k), (o0, o1) = compute_local_shape_and_global_offset(shape, mesh, placements, c)
        cover[o0:o0 + r, o1:o1 + k] += 1
    replicas = 2 if any(p == Replicate() for p in placements) else 1
    assert torch.equal(cover, torch.full(shape, float(replicas)))


def test_local_offset_of_uneven_rows():
    """torch.chunk layout (not tensor_split): 13 rows over 4 -> 4, 4, 4, 1."""
    from tests.harness import run_distributed
    assert run_distributed(4, _offsets_13) == [((4, 2), (0, 0)), ((4, 2), (4, 0)),
                                               ((4, 2), (8, 0)), ((1, 2), (12, 0))]


def _offsets_13():
    mesh = init_device_mesh("cpu", (4,))
    dt = distribute_tensor(torch.zeros(13, 2), mesh, [Shard(0)])
    return tuple(dt.to_local().shape), dt.local_offset()


@distributed(world_size=4)
def test_primitives_reject_bad_inputs_with_clear_messages():
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    x = torch.randn(4, 2)
    dt = distribute_tensor(x, mesh, [Shard(0)])
    with pytest.raises(TypeError, match="local tensors.*local_map"):
        ring_shift(dt, mesh, "cp")
    with pytest.raises(TypeError, match="shift must be an int"):
        ring_shift(x, mesh, 0, 1.5)
    with pytest.raises(KeyError, match="mesh dim name .tp. not found"):
        ring_shift(x, mesh, "tp")
    with pytest.raises(ValueError, match="dst=4 is not a coordinate"):
        send_recv(x, mesh, 0, dst=4)
    with pytest.raises(ValueError, match="recv_shape and recv_dtype"):
        send_recv(None, mesh, 0, src=1)
    with pytest.raises(ValueError, match="give dst, src or both"):
        send_recv(x, mesh, 0)
    with pytest.raises(ValueError, match=r"input_split_sizes=\[1, 1, 1, 0\] sums to 3"):
        all_to_all_single(x, mesh, 0, [1, 1, 1, 1], [1, 1, 1, 0])
    with pytest.raises(ValueError, match="one non-negative row count per rank"):
        all_to_all_single(x, mesh, 0, [1, 1, 1, 1], [2, 2])
    with pytest.raises(ValueError, match="do not split evenly"):
        all_to_all_single(torch.randn(5, 2), mesh, 0)
    with pytest.raises(ValueError, match=r"coordinate \[4\] is not a coordinate"):
        compute_local_shape_and_global_offset((13,), mesh, [Shard(0)], [4])
