"""Faults and bad inputs: nothing silently wrong, nothing hangs, no process aborts.

Each test provokes one fault (a NaN on one shard, a backward run twice or retried after an
exception, an optimizer holding replaced parameters, ranks' generators diverging) in real gloo
processes and checks the result against plain single-process torch, or a clear error on every rank.

Tests that leave a rank alone in a collective rebuild the default group with a timeout of a few
seconds (``_short_timeout_group``, restored afterwards); the ranks that did not block wait for the
blocked one on the store, not in a collective, so only its timeout can release it (a peer tearing
its group down early would release it with "connection closed" and hide a missing timeout). They
assert what every rank raised and how long it waited.
"""
import contextlib
import datetime
import functools
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dtensor_lite import (DTensor, Partial, Replicate, Shard, checkpoint, distribute_tensor,
                          init_device_mesh)
from dtensor_lite import collectives as C
from tests.harness import distributed, launch_processes, reinit_process_group, run_distributed

R = Replicate()
NAN = float("nan")


# ------------------------------------------------------------------ NaN through max / min

def _nan_reductions(t):
    """Every NaN-propagating reduction (and NaN-aware relative) the Partial(max|min) path serves."""
    vals, idx = t.max(0)
    mins, _ = t.min(1)
    lo, hi = torch.aminmax(t, dim=0)
    inf_norm = torch.linalg.vector_norm(t, float("inf"), dim=0)
    return (t.max(), t.min(), t.amax(0), t.amin(1), vals, idx, mins, lo, hi, t.argmax(),
            t.argmin(0), inf_norm, torch.linalg.vector_norm(t, -float("inf")),
            torch.logsumexp(t, 0), torch.maximum(t.amax(0), t.amin(0)),
            # NaN-mapping ops on a Partial(max|min): torch's sign/nan_to_num/fmax turn NaN into numbers
            t.amax(0).sign(), torch.nan_to_num(t.amin(0)), torch.fmax(t.amax(0), t.amin(0) * 0),
            torch.nansum(t, 0), torch.nanmean(t))


@distributed(world_size=2, timeout=60)
def test_nan_on_one_shard_propagates_through_max_and_min():
    mesh = init_device_mesh("cpu", (2,))
    x = torch.arange(24.0).reshape(8, 3) - 10
    x[6, 2] = NAN  # on rank 1's piece whether rows or columns are sharded (gloo kept rank 0's)
    x[5, 1] = float("inf")
    refs = _nan_reductions(x)
    for pl in ([Shard(0)], [Shard(1)]):
        outs = _nan_reductions(distribute_tensor(x, mesh, pl))
        for k, (o, r) in enumerate(zip(outs, refs)):
            torch.testing.assert_close(o.full_tensor(), r, equal_nan=True,
                                       msg=lambda s: f"output {k}, {pl}: {s}")
    # Partial(max|min) resolved by redistribute: all-reduce and reduce-scatter alike
    rank = torch.distributed.get_rank()
    local = torch.arange(8.0) * (rank + 1)
    local[rank * 2 + 1] = NAN  # a NaN in a different place on every rank
    full = torch.stack([torch.arange(8.0) * (r + 1) for r in range(2)])
    for r in range(2):
        full[r, r * 2 + 1] = NAN
    for op, ref in (("max", full.amax(0)), ("min", full.amin(0))):
        p = DTensor.from_local(local, mesh, [Partial(op)])
        torch.testing.assert_close(p.redistribute(mesh, [R]).to_local(), ref, equal_nan=True)
        torch.testing.assert_close(p.redistribute(mesh, [Shard(0)]).full_tensor(), ref,
                                   equal_nan=True)
    # half precision and float64 travel through the same NaN-safe path
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        p = DTensor.from_local(local.to(dtype), mesh, [Partial("max")])
        torch.testing.assert_close(p.full_tensor(), full.amax(0).to(dtype), equal_nan=True)


# ------------------------------------------------------------------ fsdp: backward twice, retried

def _mlp_pair(mesh, n_layers=3, dim=6):
    """A plain reference MLP and a fully_shard'ed copy (each layer its own group, then the root)."""
    import copy

    from fsdp import fully_shard
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.Tanh())
                                for _ in range(n_layers)], torch.nn.Linear(dim, 1))
    model = copy.deepcopy(ref)
    for layer in model[:n_layers]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return ref, model


def _batch(rows=4, dim=6):
    """The global batch (same on every rank) and this rank's rows of it."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    x = torch.randn(rows * world, dim, generator=torch.Generator().manual_seed(7))
    return x, x[rank * rows:(rank + 1) * rows]


def _assert_grads_match(ref, model):
    for (name, r), p in zip(ref.named_parameters(), model.parameters()):
        assert p.grad is not None, f"{name}: no gradient"
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, msg=lambda m: f"{name}: {m}")


def _assert_params_match(ref, model):
    for (name, r), p in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.full_tensor(), r.detach(), msg=lambda m: f"{name}: {m}")


@distributed(world_size=2, timeout=60)
def test_fsdp_backward_twice_with_retain_graph_accumulates():
    mesh = init_device_mesh("cpu", (2,))
    ref, model = _mlp_pair(mesh)
    x, mine = _batch()
    ref_loss = ref(x).square().mean()
    loss = model(mine).square().mean()
    for _ in range(2):  # torch: the second backward adds the same gradients again (2x)
        ref_loss.backward(retain_graph=True)
        loss.backward(retain_graph=True)
    _assert_grads_match(ref, model)
    # and the next iteration starts clean: one ordinary backward after zero_grad
    ref.zero_grad()
    model.zero_grad()
    ref(x).square().mean().backward()
    model(mine).square().mean().backward()
    _assert_grads_match(ref, model)


class _RaiseOnce:
    """A tensor hook that raises the first time a backward reaches it."""

    def __init__(self):
        self.armed = True

    def __call__(self, grad):
        if self.armed:
            self.armed = False
            raise RuntimeError("injected backward failure")
        return grad


def _forward_with_fault(net, x):
    """The loss, with a backward fault between the second and the third layer."""
    hook = _RaiseOnce()

    def arm(module, args, out):
        out.register_hook(hook)
    handle = net[1].register_forward_hook(arm)
    try:
        return net(x).square().mean()
    finally:
        handle.remove()


@distributed(world_size=2, timeout=60)
def test_fsdp_backward_retried_after_an_exception():
    mesh = init_device_mesh("cpu", (2,))
    ref, model = _mlp_pair(mesh)
    x, mine = _batch()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for net, inp in ((ref, x), (model, mine)):
        with pytest.raises(RuntimeError, match="injected backward failure"):
            _forward_with_fault(net, inp).backward()
    # the retry: gradients of the failed backward dropped, a fresh forward / backward, a step
    for net, inp, o in ((ref, x, ref_opt), (model, mine, opt)):
        o.zero_grad()
        net(inp).square().mean().backward()
    _assert_grads_match(ref, model)
    ref_opt.step()
    opt.step()
    _assert_params_match(ref, model)
    # a backward retried on the same retained graph, after an explicit reset
    for net, inp, o in ((ref, x, ref_opt), (model, mine, opt)):
        loss = _forward_with_fault(net, inp)
        with pytest.raises(RuntimeError, match="injected backward failure"):
            loss.backward(retain_graph=True)
        if net is model:
            model.reset_iter_state()
        o.zero_grad()
        loss.backward()
    _assert_grads_match(ref, model)
    # a forward that raises half-way (in the third layer), recovered explicitly as in torch
    for net in (ref, model):
        handle = net[2].register_forward_pre_hook(_raise_in_forward)
        with pytest.raises(RuntimeError, match="injected forward failure"):
            net(mine)
        handle.remove()
    model.reset_iter_state()
    # two more ordinary steps stay in step with torch
    for _ in range(2):
        for net, inp, o in ((ref, x, ref_opt), (model, mine, opt)):
            o.zero_grad()
            net(inp).square().mean().backward()
            o.step()
        _assert_params_match(ref, model)


def _raise_in_forward(module, args):
    raise RuntimeError("injected forward failure")


# ------------------------------------------------------------------ fsdp: a stale optimizer

@distributed(world_size=2, timeout=60)
def test_optimizer_built_before_fully_shard_is_refused():
    import copy

    from fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    stale = torch.optim.AdamW(model.parameters(), lr=0.1)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"'weight' of Linear, shape \(4, 4\).*"
                                           r"Build the optimizer after fully_shard"):
        stale.step()
    # built after fully_shard: steps, and matches torch (the check is cached after one scan)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    x = torch.randn(3 * 2, 4, generator=torch.Generator().manual_seed(3))
    rank = torch.distributed.get_rank()
    for _ in range(2):
        for net, inp, o in ((ref, x, ref_opt), (model, x[rank * 3:rank * 3 + 3], opt)):
            o.zero_grad()
            net(inp).square().mean().backward()
            o.step()
        _assert_params_match(ref, model)
    # an optimizer over another module's (unreplaced) parameters is untouched by the check
    other = torch.nn.Linear(2, 2)
    torch.optim.SGD(other.parameters(), lr=0.1).step()


# ============================================================================ timeouts, checkpoints
PG_TIMEOUT = 5.0  # seconds: the process-group timeout of the fault tests
# how much later than the timeout a blocked rank may raise: gloo notices at its next poll, and the
# machine running the tests may be busy
MARGIN = 10.0


@contextlib.contextmanager
def _short_timeout_group(seconds: float = PG_TIMEOUT):
    reinit_process_group(timeout=datetime.timedelta(seconds=seconds))
    try:
        yield
    finally:
        reinit_process_group()


def _outcome(fn, *args):
    """(exception type name or None, message, seconds) of calling ``fn``."""
    start = time.monotonic()
    try:
        fn(*args)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, "", time.monotonic() - start


def _release_after(blocked_ranks, key: str):
    """The blocked ranks announce that they are out; everyone waits for that on the store."""
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() in blocked_ranks:
        store.set(f"{key}/{dist.get_rank()}", "out")
    store.wait([f"{key}/{r}" for r in blocked_ranks], datetime.timedelta(seconds=60))


# ----------------------------------------------------------------------------- timeouts of groups
@distributed(world_size=4, timeout=120)
def test_mesh_dim_groups_take_the_default_timeout():
    """Mesh dims are new process groups: a rank left alone in one must raise after the user's
    ``timeout=``, not c10d's 30-minute default for new groups. Rank 3 skips its collectives;
    rank 2 waits for it in the "tp" dim of a 2x2 mesh, rank 1 in the "dp" dim of a mesh unflattened
    from a 1-D one (both at once, so the test waits for one timeout)."""
    with _short_timeout_group():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        unflattened = init_device_mesh("cpu", (4,), mesh_dim_names=("world",)).unflatten(
            0, (2, 2), ("dp", "tp"))
        rank = dist.get_rank()
        got = None, "", 0.0
        if rank == 2:  # tp row [2, 3]
            got = _outcome(C.all_reduce, torch.ones(3), mesh["tp"], 0, "sum")
        elif rank == 1:  # dp row [1, 3]
            got = _outcome(C.all_reduce, torch.ones(3), unflattened["dp"], 0, "sum")
        _release_after([1, 2], "lonely")
        kind, message, waited = got
        if rank in (1, 2):
            # the first to time out says so (CollectiveFailedError) and posts it; the other, still
            # waiting, stops naming it (RankFailedError, see tests/test_no_hang.py)
            assert kind in ("CollectiveFailedError", "RankFailedError"), got
            assert "imed out" in message, got
            assert PG_TIMEOUT - 1 <= waited <= PG_TIMEOUT + MARGIN, got


# ----------------------------------------------------------------------------- checkpoints
ROWS = 5  # over 2 ranks: rank 0 saves rows 0-2, rank 1 rows 3-4


def _rows(value: float) -> dict:
    mesh = init_device_mesh("cpu", (2,))
    return {"w": distribute_tensor(torch.full((ROWS, 2), float(value)), mesh, [Shard(0)])}


def _loaded_rows(path: str) -> list:
    state = _rows(0)
    checkpoint.load(state, checkpoint_id=path)
    return state["w"].full_tensor()[:, 0].tolist()


@contextlib.contextmanager
def _killed_before_writing(rank: int):
    """Rank ``rank`` dies before its checkpoint file reaches the disk while the others write
    theirs (what the others see of a killed rank, minus the wait for the timeout)."""
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def dying(self, plan, planner):
        raise RuntimeError(f"simulated kill of rank {rank} before it wrote its checkpoint file")

    if dist.get_rank() == rank:
        FileSystemWriter.write_data = dying
    try:
        yield
    finally:
        FileSystemWriter.write_data = write_data


def test_checkpoint_killed_save_keeps_the_previous_one(tmp_path):
    run_distributed(2, _killed_save, str(tmp_path / "ckpt"), timeout=120)


def _killed_save(path):
    """A save over checkpoint A (all ones) that dies on rank 1 must raise on every rank and leave
    A loadable as it was; plain dcp.save loads such a directory as rows [2, 2, 2, 1, 1]."""
    with _short_timeout_group():
        checkpoint.save(_rows(1), checkpoint_id=path)
        with _killed_before_writing(1):
            kind, message, waited = _outcome(
                functools.partial(checkpoint.save, checkpoint_id=path), _rows(2))
        assert kind == "CheckpointError", (kind, message)
        assert f"saving checkpoint {path} failed" in message and "simulated kill" in message
        assert f"{path} is as it was before this save" in message
        assert waited < PG_TIMEOUT  # the failure travels with DCP's own gather: no timeout wait
        assert _loaded_rows(path) == [1.0] * ROWS
        checkpoint.save(_rows(2), checkpoint_id=path)  # the next save cleans up and publishes
        assert _loaded_rows(path) == [2.0] * ROWS
        dist.barrier()
        assert not os.path.exists(path + ".saving") and not os.path.exists(path + ".old")


def _train_llama_model(value: float):
    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Linear(2, ROWS, bias=False)
    model.weight = torch.nn.Parameter(distribute_tensor(torch.full((ROWS, 2), value), mesh,
                                                        [Shard(0)]))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_train_llama_killed_save_keeps_the_previous_checkpoint(tmp_path):
    run_distributed(2, _train_llama_killed_save, str(tmp_path / "ckpt"), timeout=120)


def _train_llama_killed_save(path):
    """examples/train_llama.py --save / --resume: the same through its checkpoint functions."""
    from examples.train_llama import load_checkpoint, save_checkpoint

    with _short_timeout_group():
        save_checkpoint(path, *_train_llama_model(1.0), step=7)
        with _killed_before_writing(1):
            kind, message, _ = _outcome(save_checkpoint, path, *_train_llama_model(2.0), 9)
        assert kind is not None and "simulated kill" in message, (kind, message)
        model, opt = _train_llama_model(0.0)
        assert load_checkpoint(path, model, opt) == 7
        assert model.weight.full_tensor()[:, 0].tolist() == [1.0] * ROWS


def _damage(path: str, how: str) -> None:
    if how == "truncate data":
        file = os.path.join(path, "__1_0.distcp")
        os.truncate(file, os.path.getsize(file) - 3)
    elif how == "truncate metadata":
        os.truncate(os.path.join(path, ".metadata"), 10)
    elif how == "no metadata":
        os.remove(os.path.join(path, ".metadata"))
        os.remove(os.path.join(path, ".complete"))
    elif how == "removed":
        os.rename(path, path + ".saving")


# (how, written by plain dcp.save) -> what every rank's error must say; ours are checked against
# the sizes in the .complete marker, plain ones against the byte ranges .metadata points into
DAMAGES = {
    ("truncate data", False): ["damaged checkpoint", "__1_0.distcp has",
                               "bytes but was saved with"],
    ("truncate data", True): ["damaged checkpoint", "__1_0.distcp has",
                              "bytes but .metadata needs"],
    ("truncate metadata", False): ["damaged checkpoint", ".metadata has 10 bytes but was saved"],
    ("truncate metadata", True): ["damaged checkpoint", ".metadata cannot be read", "truncated"],
    ("no metadata", False): ["incomplete checkpoint", "neither .metadata nor the .complete marker"],
    ("removed", False): ["no checkpoint at", "does not exist", ".saving holds the files of a save"],
}


def test_checkpoint_incomplete_or_truncated_raises_on_every_rank(tmp_path):
    run_distributed(2, _damaged_loads, str(tmp_path), timeout=120)


def _damaged_loads(path):
    """Loading a damaged checkpoint raises CheckpointError naming the directory and the file on
    every rank, before any data is read (plain dcp.load: a bare EOFError / UnpicklingError)."""
    import torch.distributed.checkpoint as dcp

    with _short_timeout_group():
        for i, ((how, plain), phrases) in enumerate(DAMAGES.items()):
            where = f"{path}/{i}"
            if plain:
                dcp.save(_rows(1), checkpoint_id=where)
            else:
                checkpoint.save(_rows(1), checkpoint_id=where)
            if dist.get_rank() == 0:
                _damage(where, how)
            dist.barrier()
            kind, message, waited = _outcome(_loaded_rows, where)
            assert kind == "CheckpointError", (how, plain, kind, message)
            assert where in message and all(p in message for p in phrases), (how, message)
            assert waited < PG_TIMEOUT


# ------------------------------------------------------------------ random: generators diverging

def _replicas_agree(d, mesh):
    """Every rank's piece of a Replicate DTensor is the same (what Replicate() claims)."""
    from dtensor_lite import collectives as C
    local = d.to_local()
    pieces = C.all_gather(local.unsqueeze(0), mesh, 0)
    return all(torch.equal(p, local) for p in pieces)


def _dropout_with_warnings(x):
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = torch.nn.functional.dropout(x, 0.5)
    return y, [str(w.message) for w in caught if "differed across the ranks" in str(w.message)]


@distributed(world_size=2, timeout=60)
def test_generators_reseeded_differently_after_the_first_random_op_are_caught():
    rank = torch.distributed.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    full = torch.randn(6, 5)
    x = distribute_tensor(full, mesh, [R])

    def plain_dropout(seed):
        torch.manual_seed(seed)
        return torch.nn.functional.dropout(full, 0.5)

    torch.manual_seed(0)
    y, warned = _dropout_with_warnings(x)  # the first op: ranks agree
    assert not warned and _replicas_agree(y, mesh)
    # every rank re-seeds, differently: caught at the next op, every rank gets rank 0's stream
    torch.manual_seed(100 + rank)
    y, warned = _dropout_with_warnings(x)
    assert warned and _replicas_agree(y, mesh)
    assert torch.equal(y.full_tensor(), plain_dropout(100))
    # only rank 0 draws plain random numbers: its generator alone moved; caught, no hang
    torch.manual_seed(5)
    if rank == 0:
        torch.rand(3)
    y, warned = _dropout_with_warnings(x)
    assert warned and _replicas_agree(y, mesh)
    torch.manual_seed(5)
    torch.rand(3)
    assert torch.equal(y.full_tensor(), torch.nn.functional.dropout(full, 0.5))
    # re-seeding alike keeps working: no warning, plain torch's values
    torch.manual_seed(7)
    y, warned = _dropout_with_warnings(x)
    assert not warned and torch.equal(y.full_tensor(), plain_dropout(7))


# ----------------------------------------------------------------------------- from_local
def _from_local_checked(local, placements, **kwargs):
    mesh = init_device_mesh("cpu", (2,))
    return DTensor.from_local(local, mesh, placements, run_check=True, **kwargs)


# what each rank passes -> what every rank's error must say (PyTorch 2.13: run_check=True raises
# "Inconsistent tensor metadata (including shape and stride) across ranks" for all of these, and
# rejects uneven pieces too; run_check=False + full_tensor() aborts both processes in gloo)
BAD_PIECES = {
    "dtype": (lambda r: torch.ones(2, 3, dtype=(torch.float32, torch.float64)[r]), [Shard(0)], {},
              ["different dtypes", "rank 0: (2, 3) torch.float32", "rank 1: (2, 3) torch.float64"]),
    "dtype replicated": (lambda r: torch.ones(2, 3, dtype=(torch.float32, torch.float64)[r]),
                         [Replicate()], {}, ["different dtypes"]),
    "ndim": (lambda r: torch.ones((2, 3) if r == 0 else (2, 3, 1)), [Shard(0)], {},
             ["different numbers of dims", "rank 0: (2, 3)", "rank 1: (2, 3, 1)"]),
    "not chunks": (lambda r: torch.ones(1 + r, 3), [Shard(0)], {},
                   ["do not form one global tensor", "add up to (3, 3)",
                    "rank 0 should hold (2, 3)", "rank 0: (1, 3) torch.float32"]),
    "unsplit dim": (lambda r: torch.ones(2, 3 + r), [Shard(0)], {},
                    ["do not form one global tensor", "rank 1 should hold (2, 3)"]),
    "replicas' shapes": (lambda r: torch.ones(2 + r), [Replicate()], {},
                         ["do not form one global tensor"]),
    "shape=": (lambda r: torch.ones(2, 3), [Shard(0)], {"shape": (4, 3)}, []),  # fine: control
    "different shape=": (lambda r: torch.ones(2, 3), [Shard(0)], {"shape": ((4, 3), (5, 3))},
                         ["the ranks passed different shape=", "rank 0: (4, 3), rank 1: (5, 3)"]),
}


@distributed(world_size=2, timeout=120)
def test_from_local_run_check_bad_pieces_raise_on_every_rank():
    """from_local(run_check=True) with pieces that are not one global tensor raises ValueError on
    every rank, naming each rank's shape and dtype (the check used to pass different dtypes, and
    abort the process in gloo for different dims or replicated dtypes)."""
    rank = dist.get_rank()
    with _short_timeout_group():
        for name, (make, placements, kwargs, phrases) in BAD_PIECES.items():
            kwargs = {k: (v[rank] if isinstance(v[0], tuple) else v) for k, v in kwargs.items()}
            kind, message, waited = _outcome(
                functools.partial(_from_local_checked, **kwargs), make(rank), placements)
            if not phrases:
                assert kind is None, (name, message)
                continue
            assert kind == "ValueError", (name, kind, message)
            assert message.startswith("from_local(run_check=True): "), message
            assert all(p in message for p in phrases), (name, message)
            assert waited < PG_TIMEOUT, (name, waited)
        # pieces that do form one tensor still pass, uneven ones included (7 and 6 rows)
        dt = _from_local_checked(torch.ones(7 - rank, 3), [Shard(0)])
        assert dt.shape == (13, 3) and torch.equal(dt.full_tensor(), torch.ones(13, 3))


def _inconsistent_pieces(make):
    """from_local(run_check=False) of ``make(rank)``, gathered: what every rank raises, and when."""
    mesh = init_device_mesh("cpu", (2,))
    dt = DTensor.from_local(make(dist.get_rank()), mesh, [Shard(0)])
    return _outcome(dt.full_tensor)


@distributed(world_size=2, timeout=120)
def test_from_local_no_check_bad_pieces_raise_instead_of_aborting():
    """run_check=False trusts the pieces (no communication at the wrap, as in PyTorch), and pieces
    of different global shapes or dtypes would hand gloo buffers of different sizes (PyTorch's
    process aborts). Here every rank raises a ValueError naming each rank's piece instead (by
    default: see test_piece_disagreement.py; under debug.check_collectives() too); a piece resized behind its spec's back is refused before any
    collective (that rank raises at once, its peer at the process-group timeout)."""
    from dtensor_lite.debug import check_collectives

    rank = dist.get_rank()
    with _short_timeout_group(), check_collectives():
        kind, message, waited = _inconsistent_pieces(lambda r: torch.ones(3 - r, 4))
        assert kind == "ValueError" and waited < PG_TIMEOUT, (kind, message)
        assert "pieces (3, 4) torch.float32 on rank 0 vs (2, 4) torch.float32 on rank 1" \
            in message and "Pass shape=" in message, message
        kind, message, _ = _inconsistent_pieces(
            lambda r: torch.ones(2, 4, dtype=(torch.float32, torch.float64)[r]))
        assert kind == "ValueError" and "(2, 4) torch.float64 on rank 1" in message, message
        # with the right pieces the check passes (and one check per collective is all it costs)
        dt = DTensor.from_local(torch.full((2, 4), float(rank)), init_device_mesh("cpu", (2,)),
                                [Shard(0)])
        assert dt.full_tensor()[:, 0].tolist() == [0.0, 0.0, 1.0, 1.0]
    with _short_timeout_group():
        mesh = init_device_mesh("cpu", (2,))
        dt = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])
        if rank == 1:
            with torch.no_grad():  # to_local() is then the piece itself, not a view of it
                dt.to_local().resize_(1, 4)
        kind, message, waited = _outcome(dt.full_tensor)
        _release_after([0], "resized")
        if rank == 1:
            assert kind == "ValueError" and "local piece has shape (1, 4)" in message, message
            assert "says it holds (2, 4)" in message and waited < PG_TIMEOUT
        else:  # left alone in the all_gather: stopped by rank 1's posted error, not an abort
            assert kind == "RankFailedError" and waited < PG_TIMEOUT, (kind, message, waited)
            assert "rank 1: ValueError: redistribute: this rank's local piece" in message, message


# ----------------------------------------------------------------------------- a killed save
_KILLED_SAVE_MAIN = '''
import datetime, os, sys, time
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from dtensor_lite import Shard, checkpoint, distribute_tensor, init_device_mesh

path = sys.argv[1]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(sys.argv[2])))
mesh = init_device_mesh("cpu", (2,))
rows = lambda v: {"w": distribute_tensor(torch.full((5, 2), v), mesh, [Shard(0)])}
checkpoint.save(rows(1.0), checkpoint_id=path)          # checkpoint A
if dist.get_rank() == 1:
    def killed(self, plan, planner):
        print(f"KILLED_AT {time.time()}", flush=True)
        os._exit(9)                                      # no exception, no goodbye
    FileSystemWriter.write_data = killed
try:
    checkpoint.save(rows(2.0), checkpoint_id=path)      # B, over A
except checkpoint.CheckpointError as e:
    print(f"SAVE_FAILED_AT {time.time()} {e}", flush=True)
dist.destroy_process_group()
state = {"w": torch.zeros(5, 2)}                         # one process, plain tensors
checkpoint.load(state, checkpoint_id=path)
print("LOADED", state["w"][:, 0].tolist(), flush=True)
'''


def test_checkpoint_save_with_a_rank_killed_keeps_the_previous_one(tmp_path):
    """Two launched processes; rank 1 is killed (os._exit) while the save of B over A writes.
    Rank 0 raises CheckpointError at the process-group timeout and A still loads whole."""
    script = tmp_path / "main.py"
    script.write_text(_KILLED_SAVE_MAIN)
    codes, outs = launch_processes(script, 2, tmp_path / "ckpt", PG_TIMEOUT)
    assert codes[1] == 9 and "KILLED_AT" in outs[1], outs[1]
    killed_at = float(outs[1].split("KILLED_AT ")[1].split()[0])
    assert codes[0] == 0, outs[0]
    failed = outs[0].split("SAVE_FAILED_AT ")[1]
    waited = float(failed.split()[0]) - killed_at
    assert f"saving checkpoint {tmp_path / 'ckpt'} failed" in failed, failed
    assert "is as it was before this save" in failed, failed
    assert waited <= PG_TIMEOUT + MARGIN, waited
    assert "LOADED [1.0, 1.0, 1.0, 1.0, 1.0]" in outs[0], outs[0]
    print(f"killed save: rank 0 raised {waited:.2f}s after rank 1 died: {failed[:300]}")
