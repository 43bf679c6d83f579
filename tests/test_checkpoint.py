"""State dicts and distributed checkpoints (DCP) of DTensor models: any layout in, any layout out.

* full state dicts round-trip between plain single-process torch and FSDP / HSDP models, model and
  AdamW state, and training continues with the losses of training that was never interrupted;
* ``torch.distributed.checkpoint`` saves our DTensors as ordinary DCP checkpoints and loads them
  into other meshes and placements (uneven and empty shards, non-default shard orders, plain
  tensors in a single process), bit-exact;
* bad inputs raise errors that name the key and the shapes.

Checkpoint directories come from pytest's ``tmp_path`` (the harness ships it to the ranks).
Saving on one world size and loading on another are two harness runs driven from the test.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dtensor_lite import (DTensor, Partial, Replicate, Shard, StateDictOptions, _StridedShard,
                          distribute_tensor, get_model_state_dict, get_optimizer_state_dict,
                          get_state_dict, init_device_mesh, set_model_state_dict,
                          set_optimizer_state_dict, set_state_dict)
from examples.llama import Llama, LlamaConfig, loss_fn
from tests.harness import distributed, run_distributed
from tests.test_fsdp import CFG, LR, batches, global_mean, make_mesh, my_rows, rel, shard_llama

# a single process loading a checkpoint without a process group is what we mean to test
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TOL = 1e-5  # fp32 relative loss difference to the uninterrupted single-process reference


# ----------------------------------------------------------------------------- helpers
def _plain(seed=0, cfg=CFG):
    torch.manual_seed(seed)
    return Llama(cfg)


def _sharded(shape, seed=1):
    """An FSDP (1-D) or HSDP (2-D) Llama whose init differs from ``_plain()``'s."""
    return shard_llama(_plain(seed), make_mesh(shape))


def _train(model, opt, data, rows=None):
    """One optimizer step per global batch; the global batch's loss at each step. ``rows`` picks
    this rank's rows (the loss is then averaged over ranks); None: one process, whole batch."""
    losses = []
    for tokens in data:
        mine = tokens if rows is None else rows(tokens)
        loss = loss_fn(model(mine[:, :-1]), mine[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss if rows is None else global_mean(loss)).item())
    return losses


def _reference_losses(steps):
    model = _plain()
    return _train(model, torch.optim.AdamW(model.parameters(), lr=LR), batches(steps))


def _load_into(model, opt, path):
    """DCP-load model + optimizer state: templates in the model's own layout, then set."""
    msd, osd = get_state_dict(model, opt)  # the optimizer's state is created if it has none
    dcp.load({"model": msd, "optim": osd}, storage_reader=dcp.FileSystemReader(path))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


def _full(sd):
    """Plain tensors of a (possibly nested) state dict, gathered where they are DTensors."""
    if isinstance(sd, dict):
        return {k: _full(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return [_full(v) for v in sd]
    return sd.full_tensor() if isinstance(sd, DTensor) else sd


def _assert_equal(got, want, where=""):
    """Bit-exact equality of nested state dicts (tensors compared as full tensors)."""
    got, want = _full(got), _full(want)
    if isinstance(want, dict):
        assert set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            _assert_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_equal(g, w, f"{where}[{i}]")
    elif torch.is_tensor(want):
        # values, wherever they live (cpu_offload's are on the host, a CUDA run's on the GPU)
        assert torch.equal(got.cpu(), want.cpu()), f"{where}: values differ"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _assert_losses(losses, ref, what):
    worst = max(rel(a, b) for a, b in zip(losses, ref))
    assert worst <= TOL, f"{what}: losses {losses} vs uninterrupted reference {ref}"


# ----------------------------------------------------------------------------- full state dicts
@distributed(world_size=4)
@pytest.mark.parametrize("shape", [(4,), (2, 2)], ids=["fsdp4", "hsdp2x2"])
def test_full_model_state_dict_round_trip(shape):
    plain = _plain()
    full = plain.state_dict()
    model = _sharded(shape)
    assert all(isinstance(v, DTensor) for v in model.state_dict().values())
    assert set(model.state_dict()) == set(full)  # fully_shard adds no FQN prefixes
    set_model_state_dict(model, full, full_state_dict=True)
    tokens = my_rows(batches(1)[0])
    with torch.no_grad():
        assert torch.equal(model(tokens), plain(tokens))

    # sharded -> full -> plain torch
    out = get_model_state_dict(model, full_state_dict=True)
    assert not any(isinstance(v, DTensor) for v in out.values())
    _assert_equal(out, full)
    fresh = _plain(seed=2)
    fresh.load_state_dict(out)
    _assert_equal(fresh.state_dict(), full)

    # cpu_offload: as in PyTorch, only rank 0 keeps the full values
    offloaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
    if dist.get_rank() == 0:
        _assert_equal(offloaded, full)
    else:
        assert offloaded == {}

    # broadcast_from_rank0: the other ranks pass nothing
    other = _sharded(shape, seed=3)
    given = full if dist.get_rank() == 0 else {}
    set_model_state_dict(other, given, full_state_dict=True, broadcast_from_rank0=True)
    _assert_equal(other.state_dict(), full)


@distributed(world_size=4, timeout=180)
def test_full_optimizer_state_dict_resume():
    """FSDP(4) trains 3 steps -> full state -> plain torch continues; plain torch trains 3 steps
    -> full state -> HSDP(2x2) continues (through broadcast_from_rank0). Both match training that
    was never interrupted."""
    steps, data = 6, batches(6)
    ref = _reference_losses(steps)

    model = _sharded((4,))
    set_model_state_dict(model, _plain().state_dict(), full_state_dict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    first = _train(model, opt, data[:3], my_rows)
    msd, osd = get_state_dict(model, opt, full_state_dict=True)
    assert set(osd["state"]) == set(msd) and osd["param_groups"][0]["params"] == list(msd)
    assert not isinstance(osd["state"]["norm.weight"]["exp_avg"], DTensor)
    plain = _plain(seed=5)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    set_state_dict(plain, plain_opt, model_state_dict=msd, optim_state_dict=osd)
    _assert_losses(first + _train(plain, plain_opt, data[3:]), ref,
                   "fsdp(4) -> plain")

    plain = _plain()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    _train(plain, plain_opt, data[:3])
    msd, osd = get_state_dict(plain, plain_opt, full_state_dict=True)
    model = _sharded((2, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    mine = (msd, osd) if dist.get_rank() == 0 else ({}, {})
    set_state_dict(model, opt, model_state_dict=mine[0], optim_state_dict=mine[1],
                   full_state_dict=True, broadcast_from_rank0=True)
    exp_avg = opt.state[model.norm.weight]["exp_avg"]
    assert isinstance(exp_avg, DTensor) and exp_avg.placements == model.norm.weight.placements
    _assert_equal(get_optimizer_state_dict(model, opt), osd)
    _assert_losses(_train(model, opt, data[3:], my_rows), ref[3:], "plain -> hsdp(2x2)")

    # the optimizer's own integer-keyed state dict (plain torch) loads too
    model = _sharded((4,))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    set_optimizer_state_dict(model, opt, plain_opt.state_dict(), full_state_dict=True)
    _assert_equal(get_optimizer_state_dict(model, opt), get_optimizer_state_dict(plain, plain_opt))


def _two_optimizers(model):
    """AdamW for the blocks, SGD with momentum for the rest: two optimizers, one state dict."""
    blocks = [p for n, p in model.named_parameters() if n.startswith("layers.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("layers.")]
    return [torch.optim.AdamW(blocks, lr=LR), torch.optim.SGD(rest, lr=LR, momentum=0.9)]


@distributed(world_size=2)
def test_several_optimizers_and_frozen_params():
    model = _sharded((2,))
    opts = _two_optimizers(model)
    for tokens in batches(2):
        mine = my_rows(tokens)
        loss_fn(model(mine[:, :-1]), mine[:, 1:]).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    msd, osd = get_state_dict(model, opts, full_state_dict=True)
    assert len(osd["param_groups"]) == 2 and "momentum_buffer" in osd["state"]["norm.weight"]
    other = _sharded((2,), seed=3)
    other_opts = _two_optimizers(other)
    set_state_dict(other, other_opts, model_state_dict=msd, optim_state_dict=osd,
                   full_state_dict=True)
    _assert_equal(get_state_dict(other, other_opts), get_state_dict(model, opts))

    plain = _plain()
    plain.norm.weight.requires_grad_(False)
    kept = get_model_state_dict(plain, options=StateDictOptions(ignore_frozen_params=True))
    assert set(kept) == set(plain.state_dict()) - {"norm.weight"}


# ----------------------------------------------------------------------------- DCP: DTensors
# (global shape, saved placements, loaded placements) on a 2x2 mesh: uneven, empty shards (3 rows
# over 4 ranks), both shard orders of one dim over two mesh dims, replicas, a 0-element tensor
LAYOUTS = [
    ((5, 3), [Shard(0), Shard(1)], [Replicate(), Shard(0)]),
    ((3, 5), [Shard(0), Shard(0)], [_StridedShard(0, split_factor=2), Shard(0)]),
    ((8, 6), [_StridedShard(0, split_factor=2), Shard(0)], [Shard(1), Shard(0)]),
    ((4, 7), [Replicate(), Shard(1)], [Shard(0), Shard(0)]),
    ((7,), [Shard(0), Replicate()], [Replicate(), Replicate()]),
    ((2, 3), [Replicate(), Replicate()], [Shard(1), Shard(0)]),
    ((0, 4), [Shard(0), Shard(1)], [Shard(1), Replicate()]),
]


def _layout_values():
    g = torch.Generator().manual_seed(7)
    values = {f"t{i}": torch.randn(shape, generator=g) for i, (shape, *_) in enumerate(LAYOUTS)}
    values["scalar"] = torch.tensor(3.5)
    values["meta"] = {"epoch": 2, "names": ["a", "b"]}
    return values


def _dtensors(which: int):
    """The LAYOUTS values as DTensors with the saved (1) or loaded (2) placements; on a 1-D
    mesh (world 2) every tensor is sharded on its last dim instead."""
    values = _layout_values()
    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2) if n == 4 else (n,))
    for i, layout in enumerate(LAYOUTS):
        placements = layout[which] if n == 4 else [Shard(layout[0].__len__() - 1)]
        value = values[f"t{i}"] if which == 1 else torch.zeros(layout[0])
        values[f"t{i}"] = distribute_tensor(value, mesh, placements)
    if which == 2:
        values["scalar"] = torch.zeros(())
        values["meta"] = {"epoch": 0, "names": []}
    return values


def _save_dtensors(path):
    dcp.save(_dtensors(1), storage_writer=dcp.FileSystemWriter(path))


def _load_dtensors(path):
    state = _dtensors(2)
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    for i, (shape, _, placements) in enumerate(LAYOUTS):
        if dist.get_world_size() == 4:
            assert state[f"t{i}"].placements == tuple(placements)
    _assert_equal(state, _layout_values(), "loaded")


def test_dcp_dtensor_layouts(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(4, _save_dtensors, path)
    run_distributed(4, _load_dtensors, path)  # other placements, same mesh
    run_distributed(2, _load_dtensors, path)  # another mesh
    state = {k: torch.zeros_like(v) if torch.is_tensor(v) else v
             for k, v in _layout_values().items()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))  # one plain process, no group
    _assert_equal(state, _layout_values(), "plain")


@distributed(world_size=2)
def test_dcp_partial_is_refused():
    mesh = init_device_mesh("cpu", (2,))
    dt = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    with pytest.raises(ValueError, match=r"Partial placements .* Redistribute it to Replicate"):
        dt.__create_chunk_list__()
    with pytest.raises(ValueError, match="Partial"):
        dt.__create_write_items__("x", dt)


# ----------------------------------------------------------------------------- DCP: training
def _fsdp_train_and_save(path, steps):
    model = _sharded((4,))
    set_model_state_dict(model, _plain().state_dict(), full_state_dict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = _train(model, opt, batches(steps), my_rows)
    msd, osd = get_state_dict(model, opt)
    assert isinstance(osd["state"]["output.weight"]["exp_avg_sq"], DTensor)
    dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(path))
    return losses, _full(msd), _full(osd)


def _fsdp_load_and_resume(path, shape, saved, steps, total):
    """Load into a fresh FSDP/HSDP model + optimizer on ``shape``; check the state bit-exact and
    continue training: the losses of the remaining steps must match the reference."""
    model = _sharded(shape, seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _load_into(model, opt, path)
    _assert_equal(get_model_state_dict(model), saved[0], "model")
    _assert_equal(get_optimizer_state_dict(model, opt), saved[1], "optim")
    losses = _train(model, opt, batches(total)[steps:], my_rows)
    _assert_losses(losses, _reference_losses(total)[steps:], f"resumed on {shape}")


def test_dcp_fsdp_resume_on_other_meshes(tmp_path):
    """FSDP on 4 ranks trains and saves; FSDP on 2 ranks and HSDP 2x2 resume; one plain process
    loads it too. Every continuation matches training that was never interrupted."""
    path, steps, total = str(tmp_path / "ckpt"), 3, 5
    first, msd, osd = run_distributed(4, _fsdp_train_and_save, path, steps)[0]
    _assert_losses(first, _reference_losses(steps), "before saving")
    run_distributed(2, _fsdp_load_and_resume, path, (2,), (msd, osd), steps, total)
    run_distributed(4, _fsdp_load_and_resume, path, (2, 2), (msd, osd), steps, total)

    # one plain process, no process group: plain tensors as the DCP targets
    plain = _plain(seed=6)
    opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    _load_into(plain, opt, path)
    _assert_equal(plain.state_dict(), msd, "plain model")
    _assert_equal(get_optimizer_state_dict(plain, opt), osd, "plain optim")


# ----------------------------------------------------------------------------- bad inputs
@distributed(world_size=2)
def test_bad_inputs_name_the_key():
    model = _sharded((2,))
    full = _plain().state_dict()

    missing = {k: v for k, v in full.items() if k != "norm.weight"}
    with pytest.raises(RuntimeError, match=r"missing keys \['norm.weight'\].*strict=False"):
        set_model_state_dict(model, missing, full_state_dict=True)
    set_model_state_dict(model, missing, full_state_dict=True, strict=False)  # loads the rest
    _assert_equal(get_model_state_dict(model, full_state_dict=True)["output.weight"],
                  full["output.weight"])
    with pytest.raises(RuntimeError, match=r"unexpected keys \['extra'\]"):
        set_model_state_dict(model, {**full, "extra": torch.ones(1)}, full_state_dict=True)

    wrong = {**full, "layers.1.attention.wq.weight": torch.zeros(18, 17)}
    with pytest.raises(ValueError, match=r"layers\.1\.attention\.wq\.weight: the state dict "
                                         r"holds shape \(18, 17\) but the target has global "
                                         r"shape \(18, 18\)"):
        set_model_state_dict(model, wrong, full_state_dict=True)
    given = wrong if dist.get_rank() == 0 else {}  # every rank raises, none waits for data
    with pytest.raises(ValueError, match=r"wq\.weight.*\(18, 17\)"):
        set_model_state_dict(model, given, full_state_dict=True, broadcast_from_rank0=True)

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    osd = get_optimizer_state_dict(model, opt, full_state_dict=True)
    osd["state"]["norm.weight"]["exp_avg"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"optimizer state 'exp_avg' of norm\.weight: .*\(5,\).*"
                                         r"\(18,\)"):
        set_optimizer_state_dict(model, opt, osd, full_state_dict=True)
    osd["state"]["nope.weight"] = osd["state"].pop("norm.weight")
    params = osd["param_groups"][0]["params"]
    params[params.index("norm.weight")] = "nope.weight"
    with pytest.raises(ValueError, match=r"'nope.weight' is not a parameter of FSDPLlama"):
        set_optimizer_state_dict(model, opt, osd, full_state_dict=True)
    with pytest.raises(ValueError, match="pass one or the other"):
        get_model_state_dict(model, full_state_dict=True, options=StateDictOptions())


# ----------------------------------------------------------------------------- with TP
# whole heads per TP rank; uneven hidden and vocab pieces (30 -> 15 -> 8/7, 66 -> 33 -> 17/16)
TP_CFG = LlamaConfig(vocab_size=CFG.vocab_size, dim=16, n_layers=2, n_heads=2, ffn_dim=30,
                     max_seq_len=16)
TP_STEPS, TP_TOTAL = 2, 4


def _tp_missing():
    try:
        import tp  # noqa: F401
        from examples.llama_parallel import parallelize_llama  # noqa: F401
    except Exception as exc:  # tp/ is still being written: a broken import is "not ready"
        return f"tp.parallelize_module and examples.llama_parallel.parallelize_llama ({exc})"
    return None


def _tp_model(kind):
    """A TP_CFG Llama laid out as ``kind`` ("fsdp+tp" 2x2, "fsdp" 4-way, "tp" 2-way) and the
    function that picks this rank's rows of a global batch."""
    from examples.llama_parallel import parallelize_llama
    model = _plain(seed=4, cfg=TP_CFG)
    if kind == "fsdp":
        return shard_llama(model, make_mesh((dist.get_world_size(),))), my_rows
    if kind == "tp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        return parallelize_llama(model, mesh), lambda tokens: tokens
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_llama(model, mesh["tp"])
    dp = mesh.get_coordinate()[0]
    shard_llama(model, mesh["dp"])
    # the TP split of w1's rows is split again by dp: a non-default shard order
    assert model.layers[0].feed_forward.w1.weight.placements == (_StridedShard(0, 2), Shard(0))
    return model, lambda tokens: tokens.chunk(2)[dp]


def _tp_reference(total):
    model = _plain(cfg=TP_CFG)
    return _train(model, torch.optim.AdamW(model.parameters(), lr=LR), batches(total))


def _tp_save(path, kind):
    """Train TP_STEPS steps from the reference init in layout ``kind`` and save."""
    model, rows = _tp_model(kind)
    set_model_state_dict(model, _plain(cfg=TP_CFG).state_dict(), full_state_dict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = _train(model, opt, batches(TP_STEPS), rows)
    _assert_losses(losses, _tp_reference(TP_STEPS), f"{kind} before saving")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(path))
    return _full(msd), _full(osd)


def _tp_load(path, kind, saved, save_to=None, resume=False):
    """Load into layout ``kind``: bit-exact state; optionally save again or resume training."""
    model, rows = _tp_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _load_into(model, opt, path)
    _assert_equal(get_model_state_dict(model), saved[0], f"{kind} model")
    _assert_equal(get_optimizer_state_dict(model, opt), saved[1], f"{kind} optim")
    if save_to is not None:
        dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))),
                 storage_writer=dcp.FileSystemWriter(save_to))
    if resume:
        losses = _train(model, opt, batches(TP_TOTAL)[TP_STEPS:], rows)
        _assert_losses(losses, _tp_reference(TP_TOTAL)[TP_STEPS:], f"resumed on {kind}")


@pytest.mark.skipif(_tp_missing() is not None, reason=f"needs {_tp_missing()}")
def test_dcp_tp_layouts_round_trip(tmp_path):
    """2x2 FSDP+TP -> 4-way FSDP -> 2-way TP -> 2x2 FSDP+TP (resumes training) and one plain
    process: every hop bit-exact, the resumed losses those of uninterrupted training."""
    a, b, c = (str(tmp_path / x) for x in "abc")
    saved = run_distributed(4, _tp_save, a, "fsdp+tp")[0]
    run_distributed(4, _tp_load, a, "fsdp", saved, b)
    run_distributed(2, _tp_load, b, "tp", saved, c)
    run_distributed(4, _tp_load, c, "fsdp+tp", saved, None, True)
    plain = _plain(seed=6, cfg=TP_CFG)
    opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    _load_into(plain, opt, a)
    _assert_equal(plain.state_dict(), saved[0], "plain model")
    _assert_equal(get_optimizer_state_dict(plain, opt), saved[1], "plain optim")
