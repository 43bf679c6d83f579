"""Pieces that disagree across ranks end in one clear error on every rank, never a gloo abort.

``DTensor.from_local(run_check=False)`` (torch's default) trusts that every rank's piece belongs
to one global tensor. When rank 3's piece is one column wider, or of another dtype, the ranks hold
different global shapes, and gloo would abort the process (``terminate called ...
EnforceNotMet``) at their first collective. Such DTensors are marked (``_unchecked.py``) and their
collectives compare one fixed-size row per rank first: every rank raises the same ValueError,
naming each rank's piece and the shape it believes; the group stays usable.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dtensor_lite import DTensor, Replicate, Shard, init_device_mesh
from dtensor_lite import collectives as C
from dtensor_lite.debug import CommDebugMode
from tests.harness import launch_processes, run_distributed


def _outcome(fn):
    try:
        out = fn()
        return "ok", out.tolist() if isinstance(out, torch.Tensor) else out
    except ValueError as e:
        return "ValueError", str(e)


def _disagreeing_pieces():
    """The issue's cases on 4 ranks, each followed by a collective that must still work."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    wide = DTensor.from_local(torch.ones(2, 5 if rank == 3 else 4), mesh, [Shard(0)])
    out = {"widths": _outcome(wide.full_tensor),
           # an op on the wrong piece first: its result is checked alike (Partial -> Replicate)
           "widths_after_ops": _outcome(lambda: (wide * 2).sum(0).full_tensor()),
           # the fault catalogue's two former aborts
           "from_local_uneven_no_check": _outcome(
               DTensor.from_local(torch.ones(3 if rank < 3 else 2, 4), mesh,
                                  [Shard(0)]).full_tensor),
           "from_local_dtype_differs_across_ranks": _outcome(lambda: (DTensor.from_local(
               torch.ones(2, 4, dtype=torch.float64 if rank == 1 else torch.float32), mesh,
               [Shard(0)]) + 1).full_tensor()),
           # a given shape= that only rank 2 got wrong: its piece fits either, the buffers are of
           # one size, only the global shapes differ (a silently wrong result without the row)
           "given_shape": _outcome(lambda: DTensor.from_local(
               torch.ones(2, 4), mesh, [Shard(0)],
               shape=(7, 4) if rank == 2 else (8, 4)).redistribute(mesh, [Replicate()]).to_local())}
    fine = DTensor.from_local(torch.full((2, 4), float(rank)), mesh, [Shard(0)])
    out["agreeing"] = ("ok", fine.full_tensor().sum().item(),
                       (fine * 2).sum(0).full_tensor().tolist())
    return out


def test_disagreeing_pieces_raise_the_same_clear_error_on_every_rank():
    outcomes = run_distributed(4, _disagreeing_pieces, timeout=120)
    assert all(o == outcomes[0] for o in outcomes), outcomes
    out = outcomes[0]
    kind, msg = out["widths"]
    assert kind == "ValueError", out["widths"]
    assert "(2, 4) torch.float32 on ranks 0-2 vs (2, 5) torch.float32 on rank 3" in msg, msg
    assert "global shape is (8, 4) on ranks 0-2 vs (8, 5) on rank 3" in msg, msg
    assert "from_local(run_check=False)" in msg and "run_check=True" in msg, msg
    kind, msg = out["widths_after_ops"]
    assert kind == "ValueError" and "(4,) torch.float32 on ranks 0-2 vs (5,) torch.float32 " \
        "on rank 3" in msg, msg
    kind, msg = out["from_local_uneven_no_check"]
    assert kind == "ValueError" and "(3, 4) torch.float32 on ranks 0-2 vs (2, 4) " \
        "torch.float32 on rank 3" in msg and "(12, 4) on ranks 0-2 vs (8, 4) on rank 3" in msg, msg
    kind, msg = out["from_local_dtype_differs_across_ranks"]
    assert kind == "ValueError" and "(2, 4) torch.float32 on ranks 0, 2-3 vs (2, 4) " \
        "torch.float64 on rank 1" in msg, msg
    kind, msg = out["given_shape"]
    assert kind == "ValueError" and "(8, 4) on ranks 0-1, 3 vs (7, 4) on rank 2" in msg, msg
    assert out["agreeing"] == ("ok", 48.0, [24.0] * 4), out["agreeing"]


def _known_layouts_pay_nothing():
    """distribute_tensor and from_local(run_check=True) layouts are known to agree: their
    collectives carry no header; an unchecked one pays one row per collective until a checked
    redistribute on a 1-D mesh has proven it (its source and its result)."""
    from dtensor_lite import distribute_tensor
    mesh = init_device_mesh("cpu", (4,))
    counts, headers = {}, {}
    for name, make in (
            ("distribute_tensor", lambda: distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])),
            ("run_check", lambda: DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)],
                                                     run_check=True)),
            ("unchecked", lambda: DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)]))):
        x = make()
        before = C.HEADER_ROWS[0]
        with CommDebugMode() as comm:
            y = (x * 2).full_tensor()  # x * 2: checked (unchecked only), then known
            z = (x + 1).redistribute(mesh, [Replicate()])  # x + 1 likewise
            (z * 3).redistribute(mesh, [Shard(0)]).full_tensor()  # z is known: no header
            (x * 2).full_tensor()  # x itself is still unchecked: one more
        counts[name] = sum(comm.get_comm_counts().values())
        headers[name] = C.HEADER_ROWS[0] - before
        assert torch.equal(y, torch.full((8, 4), 2.0))
    return counts, headers


def test_known_layouts_pay_no_header():
    counts, headers = run_distributed(4, _known_layouts_pay_nothing, timeout=120)[0]
    # the same collectives for all three; the header is an all_gather of its own, not reported
    # to CommDebugMode
    assert counts == {"distribute_tensor": 4, "run_check": 4, "unchecked": 4}, counts
    assert headers == {"distribute_tensor": 0, "run_check": 0, "unchecked": 3}, headers


_SCRIPT = '''
import torch, torch.distributed as dist
from dtensor_lite import DTensor, Shard, init_device_mesh
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (4,))
x = DTensor.from_local(torch.ones(2, 5 if rank == 3 else 4), mesh, [Shard(0)])
try:
    x.full_tensor()
except ValueError as e:
    print("RAISED", e, flush=True)
dist.destroy_process_group()
'''


def test_mismatched_widths_end_with_an_error_not_an_abort(tmp_path):
    """The user's script as the issue ran it (4 processes, default settings): every rank prints
    the error and exits 0; no 'terminate called'."""
    script = tmp_path / "widths.py"
    script.write_text(_SCRIPT)
    codes, outs = launch_processes(script, 4, timeout=180)
    for rank, (code, out) in enumerate(zip(codes, outs)):
        assert "terminate called" not in out and "EnforceNotMet" not in out, out
        assert code == 0, (rank, code, out)
        assert "RAISED" in out and "(2, 4) torch.float32 on ranks 0-2 vs (2, 5) torch.float32 " \
            "on rank 3" in out, out
