"""Tensor parallelism (tp/): styles on lone modules, the Llama plan trained against plain torch,
the collectives TP issues per layer, loss_parallel, and the errors of parallelize_module."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dtensor_lite import (DTensor, Partial, Replicate, Shard, distribute_tensor,
                          init_device_mesh)
from dtensor_lite.debug import CommDebugMode
from examples.llama import Llama, LlamaConfig, loss_fn
from examples.llama_parallel import llama_tp_plan, parallelize_llama
from tests.harness import distributed, run_distributed
from tp import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                PrepareModuleOutput, RowwiseParallel, SequenceParallel, loss_parallel,
                parallelize_module)

CFG = LlamaConfig(vocab_size=64, dim=16, n_layers=2, n_heads=4, ffn_dim=32, max_seq_len=16)


def _tokens(batch=4, seq=8, vocab=CFG.vocab_size):
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    return tokens[:, :-1], tokens[:, 1:]


# ----------------------------------------------------------------------------- Llama parity
def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train_llama(world, sp, lp, steps=10, cfg=CFG, seq=8):
    """Train the TP model and the plain one side by side; return per-step relative loss diffs and
    the largest relative gradient error after the first backward."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = Llama(cfg)
    model = parallelize_llama(copy.deepcopy(ref), mesh, sequence_parallel=sp, loss_parallel=lp)
    for name, p in model.named_parameters():
        # as in PyTorch, only the modules of the plan get DTensor parameters: the norms without
        # sequence parallelism stay plain (and replicated by construction)
        assert isinstance(p, nn.Parameter) and isinstance(p.data, DTensor) == (
            sp or "norm" not in name), name
        torch.testing.assert_close(_full(p), ref.get_parameter(name))
    assert model.output.weight.placements == (Shard(0),)
    assert model.tok_embeddings.weight.placements == (Shard(0),)
    assert model.layers[0].attention.wo.weight.placements == (Shard(1),)
    if sp:
        assert model.layers[0].ffn_norm.weight.placements == (Replicate(),)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rel_diffs, grad_err = [], None
    for step in range(steps):
        inputs, targets = _tokens(seq=seq, vocab=cfg.vocab_size)
        ref_loss = loss_fn(ref(inputs), targets)
        logits = model(inputs)
        if lp:
            assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
            with loss_parallel():
                loss = loss_fn(logits, targets)
            assert isinstance(loss, DTensor) and loss.placements == (Replicate(),)
            value = loss.to_local()
        else:
            assert not isinstance(logits, DTensor) and logits.shape == (4, seq, cfg.vocab_size)
            loss = value = loss_fn(logits, targets)
        rel_diffs.append(abs(value.item() - ref_loss.item()) / abs(ref_loss.item()))
        ref_loss.backward()
        loss.backward()
        if step == 0:
            grad_err = 0.0
            for name, p in model.named_parameters():
                ref_grad = ref.get_parameter(name).grad
                got = _full(p.grad)
                torch.testing.assert_close(got, ref_grad, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"grad of {name}: {m}")
                grad_err = max(grad_err, ((got - ref_grad).abs().max() /
                                          ref_grad.abs().max().clamp_min(1e-12)).item())
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    assert max(rel_diffs) <= 1e-5, rel_diffs
    return max(rel_diffs), grad_err


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
@pytest.mark.parametrize("lp", [False, True], ids=["no-lp", "lp"])
def test_llama_tp_matches_single_process(world, sp, lp):
    results = run_distributed(world, _train_llama, world, sp, lp, timeout=120)
    rel, grad_err = results[0]
    print(f"world={world} sp={sp} lp={lp}: max loss rel diff {rel:.2e}, "
          f"max grad rel err {grad_err:.2e}")


def test_llama_tp_uneven_hidden_and_vocab():
    # 4 ranks: ffn 30 -> pieces 8, 8, 8, 6 (the row-parallel w2 knows its in_features, so the
    # local pieces need not be even); vocab 62 -> 16, 16, 16, 14 in the embedding and the output
    cfg = LlamaConfig(vocab_size=62, dim=16, n_layers=1, n_heads=4, ffn_dim=30, max_seq_len=16)
    rel, _ = run_distributed(4, _train_llama, 4, True, True, steps=3, cfg=cfg, timeout=120)[0]
    print(f"uneven ffn/vocab on 4 ranks: max loss rel diff {rel:.2e}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("lp", [False, True], ids=["no-lp", "lp"])
def test_llama_tp_sequence_parallel_uneven_sequence(world, lp):
    # 13 positions: pieces 7, 6 on 2 ranks and 4, 3, 3, 3 on 4 (torch.chunk); PyTorch's
    # SequenceParallel assumes even pieces and aborts inside gloo here
    rel, grad_err = run_distributed(world, _train_llama, world, True, lp, steps=3, seq=13,
                                    timeout=120)[0]
    print(f"uneven sequence 13 on {world} ranks lp={lp}: max loss rel diff {rel:.2e}, "
          f"max grad rel err {grad_err:.2e}")


# ----------------------------------------------------------------------------- collectives
@distributed(world_size=2, timeout=60)
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_llama_tp_collectives_per_layer(sp):
    mesh = init_device_mesh("cpu", (2,))
    model = parallelize_llama(Llama(CFG), mesh, sequence_parallel=sp, loss_parallel=False)
    inputs, _ = _tokens()
    with CommDebugMode() as comm:
        model(inputs)
    per_module = comm.get_per_module_comm_counts()
    n = CFG.n_layers
    # a collective issued by a module's output hook (the row-wise reduction) counts for that
    # module: CommDebugMode closes a module after its own forward hooks
    if not sp:  # one all-reduce per row-wise output, nothing else inside the blocks
        assert comm.get_comm_counts() == {"all_reduce": 2 * n + 1, "all_gather": 1}
        for i in range(n):
            assert per_module[f"Llama.layers.{i}"] == {"all_reduce": 2}
            assert per_module[f"Llama.layers.{i}.attention"] == {"all_reduce": 1}
            assert per_module[f"Llama.layers.{i}.attention.wo"] == {"all_reduce": 1}
            assert per_module[f"Llama.layers.{i}.feed_forward"] == {"all_reduce": 1}
            assert per_module[f"Llama.layers.{i}.feed_forward.w2"] == {"all_reduce": 1}
        assert per_module["Llama.tok_embeddings"] == {"all_reduce": 1}  # vocab-parallel sum
        assert per_module["Llama.output"] == {"all_gather": 1}          # the logits
    else:  # per attention / MLP: all-gather the sequence in, reduce-scatter the sum out
        assert comm.get_comm_counts() == {"reduce_scatter": 2 * n + 1, "all_gather": 2 * n + 2}
        for i in range(n):
            pair = {"all_gather": 1, "reduce_scatter": 1}
            assert per_module[f"Llama.layers.{i}"] == {"all_gather": 2, "reduce_scatter": 2}
            assert per_module[f"Llama.layers.{i}.attention"] == pair
            assert per_module[f"Llama.layers.{i}.attention.wo"] == {"reduce_scatter": 1}
            assert per_module[f"Llama.layers.{i}.feed_forward"] == pair
            assert per_module[f"Llama.layers.{i}.feed_forward.w2"] == {"reduce_scatter": 1}
            assert f"Llama.layers.{i}.attention_norm" not in per_module
        assert per_module["Llama.tok_embeddings"] == {"reduce_scatter": 1}
        assert per_module["Llama.output"] == {"all_gather": 2}  # the sequence in, the logits out
    for i in range(n):
        for name in ("wq", "wk", "wv"):  # column-parallel stages never communicate forward
            assert f"Llama.layers.{i}.attention.{name}" not in per_module


# ----------------------------------------------------------------------------- lone modules
def _check_module(style, module, x, make_input, read_output):
    """Forward + backward of ``module`` parallelized with ``style`` equal plain torch."""
    mesh = init_device_mesh("cpu", (2,))
    ref = copy.deepcopy(module)
    parallelize_module(module, mesh, style)
    out = read_output(module(make_input(x, mesh)))
    ref_out = ref(x)
    torch.testing.assert_close(out, ref_out)
    grad_out = torch.randn_like(ref_out)
    out.backward(grad_out)
    ref_out.backward(grad_out)
    for name, p in module.named_parameters():
        assert isinstance(p.data, DTensor)
        torch.testing.assert_close(p.grad.full_tensor(), ref.get_parameter(name).grad)
    return module


def _local_shard(x, mesh, dim=-1):
    return distribute_tensor(x, mesh, [Shard(dim % x.ndim)]).to_local()


def _gather_last(out):
    return out.full_tensor() if isinstance(out, DTensor) else out


@distributed(world_size=2, timeout=60)
@pytest.mark.parametrize("out_features", [6, 7])
def test_colwise_linear(out_features):
    x = torch.randn(3, 5)
    # default: local Shard(-1) output -> gather it to compare
    m = _check_module(ColwiseParallel(use_local_output=False), nn.Linear(5, out_features), x,
                      lambda x, mesh: x, _gather_last)
    assert m.weight.placements == (Shard(0),) and m.bias.placements == (Shard(0),)
    # Replicate output: a plain local tensor that is the full result; the input grad is exact
    xr = x.clone().requires_grad_()
    xr_ref = x.clone().requires_grad_()
    mesh = init_device_mesh("cpu", (2,))
    lin = nn.Linear(5, out_features)
    ref = copy.deepcopy(lin)
    parallelize_module(lin, mesh, ColwiseParallel(output_layouts=Replicate()))
    out = lin(xr)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, ref(xr_ref))
    out.pow(2).sum().backward()
    ref(xr_ref).pow(2).sum().backward()
    torch.testing.assert_close(xr.grad, xr_ref.grad)
    # no mesh: all ranks, 1-D; src_data_rank=None slices each rank's own (equal) copy
    lin2 = parallelize_module(nn.Linear(5, 6), parallelize_plan=ColwiseParallel(),
                              src_data_rank=None)
    assert lin2.weight.device_mesh.shape == (2,) and lin2.weight.to_local().shape == (3, 5)


@distributed(world_size=2, timeout=60)
@pytest.mark.parametrize("in_features", [6, 7])
def test_rowwise_linear(in_features):
    x = torch.randn(3, in_features, requires_grad=True)
    m = _check_module(RowwiseParallel(), nn.Linear(in_features, 4), x,
                      lambda x, mesh: _local_shard(x, mesh), lambda out: out)
    assert m.weight.placements == (Shard(1),) and m.bias.placements == (Replicate(),)
    # the local input's gradient is this rank's slice of the full input gradient
    assert x.grad is not None


@distributed(world_size=2, timeout=60)
@pytest.mark.parametrize("num_embeddings", [8, 7])
@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_embedding(style, num_embeddings):
    ids = torch.randint(0, num_embeddings, (3, 5))
    if style == "colwise":
        m = _check_module(ColwiseParallel(output_layouts=Replicate()),
                          nn.Embedding(num_embeddings, 6), ids, lambda x, mesh: x, lambda o: o)
        assert m.weight.placements == (Shard(1),)
    else:  # vocab-parallel: 7 rows on 2 ranks are pieces of 4 and 3
        m = _check_module(RowwiseParallel(), nn.Embedding(num_embeddings, 6), ids,
                          lambda x, mesh: x, lambda o: o)
        assert m.weight.placements == (Shard(0),)
        assert m.weight.to_local().shape[0] == (4 if torch.distributed.get_rank() == 0 else
                                                num_embeddings - 4)


def _sequence_parallel_norm(mesh):
    """A LayerNorm(4) under SequenceParallel and an unsharded copy of it as the reference."""
    norm = nn.LayerNorm(4)
    norm.weight.data.uniform_()
    ref = copy.deepcopy(norm)
    parallelize_module(norm, mesh, SequenceParallel())
    return norm, ref


def _assert_norm_matches(out, x, norm, ref):
    """``out`` (norm's output on ``x``) and the weight gradient equal the reference's."""
    torch.testing.assert_close(out.full_tensor(), ref(x))
    out.full_tensor().sum().backward()  # the weight gradient is summed over the sequence shards
    ref(x).sum().backward()
    torch.testing.assert_close(norm.weight.grad.full_tensor(), ref.weight.grad)


@distributed(world_size=2, timeout=60)
def test_sequence_parallel_and_prepare_styles():
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(2, 6, 4)
    norm, ref = _sequence_parallel_norm(mesh)
    assert norm.weight.placements == (Replicate(),)
    out = norm(_local_shard(x, mesh, 1))
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    _assert_norm_matches(out, x, norm, ref)

    class Two(nn.Module):
        def forward(self, a, scale, *, b):
            return a * scale + b, a

    two = parallelize_module(Two(), mesh, PrepareModuleInput(
        input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={"b": Replicate()}, desired_input_kwarg_layouts={"b": Replicate()}))
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    out, a_seen = two(_local_shard(a, mesh, 0), 2.0, b=b)
    assert a_seen.placements == (Replicate(),)
    torch.testing.assert_close(out.to_local(), a * 2.0 + b)

    class Identity(nn.Module):
        def forward(self, a):
            return a
    ident = parallelize_module(Identity(), mesh, PrepareModuleOutput(
        output_layouts=Shard(0), desired_output_layouts=Replicate()))
    torch.testing.assert_close(ident(_local_shard(a, mesh, 0)), a)


@distributed(world_size=4, timeout=60)
@pytest.mark.parametrize("seq", [8, 7, 3], ids=["even", "uneven", "empty-rank"])
def test_prepare_module_input_output_moe_layout(seq):
    """torchtitan's MoE layout: a sequence-sharded stream gathered for a body that sees local
    tensors, whose per-rank outputs are partial sums scattered back along the sequence. Values
    equal one process's on even, uneven and empty sequence pieces. Backward, as in torch, the
    body's local input gradient is taken as replicated (``to_local()``'s default): each rank
    keeps its own body's gradient for its piece -- a body whose ranks' input gradients differ
    (as here) must reduce them itself."""
    mesh = init_device_mesh("cpu", (4,))
    rank = mesh.get_rank()
    weights = torch.tensor([0.5, 1.5, -2.0, 3.0])  # each rank's share of the layer

    class Experts(nn.Module):  # this rank's part of the layer: a plain tensor in and out
        def forward(self, x):
            assert not isinstance(x, DTensor) and x.shape[1] == seq
            return torch.tanh(x) * weights[rank]

    layer = parallelize_module(Experts(), mesh, PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Partial(),), desired_output_layouts=(Shard(1),)))
    x, g = torch.randn(2, seq, 5), torch.randn(2, seq, 5)
    local_x = _local_shard(x, mesh, 1).clone().requires_grad_()
    out = layer(local_x)
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, _local_shard(torch.tanh(x) * weights.sum(), mesh, 1))
    (out * _local_shard(g, mesh, 1)).sum().backward()
    # this rank's body, differentiated (distribute_tensor chunks rank 0's tensor: scale after)
    own = _local_shard((1 - torch.tanh(x) ** 2) * g, mesh, 1) * weights[rank]
    torch.testing.assert_close(local_x.grad, own)


@distributed(world_size=2, timeout=60)
def test_sequence_parallel_uneven_local_pieces():
    """5 positions on 2 ranks: local pieces of 3 and 2. The hook learns the global length from
    one exchange of the pieces' sizes (PyTorch assumes 2 x local and aborts inside gloo)."""
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(2, 5, 4)
    norm, ref = _sequence_parallel_norm(mesh)
    local = _local_shard(x, mesh, 1)
    assert local.shape[1] == (3, 2)[mesh.get_rank()]
    with CommDebugMode() as comm:
        out = norm(local)
    assert comm.get_comm_counts() == {"all_gather": 1}  # the pieces' sizes, once
    assert out.shape == x.shape and out.placements == (Shard(1),)
    _assert_norm_matches(out, x, norm, ref)
    with CommDebugMode() as comm:  # a DTensor input carries its global shape: no exchange
        norm(out.detach())
    assert comm.get_total_counts() == 0
    # PrepareModuleInput gathers uneven local pieces the same way
    gather = parallelize_module(nn.Identity(), mesh, PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)))
    torch.testing.assert_close(gather(local).to_local(), x)


@distributed(world_size=2, timeout=60)
def test_local_output_of_a_style_keeps_its_global_shape():
    """A local tensor that a style's use_local_output made (a Shard(1) embedding output, 5
    positions: pieces 3 and 2) carries its DTensor's global shape: SequenceParallel and a
    gather of it need no exchange of sizes (PyTorch's test_layer_norm_bwd_req_grad counts); a
    piece resized in place since is an error on every rank, not a wrong shape."""
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    emb, norm, lin = nn.Embedding(11, 4), nn.LayerNorm(4), nn.Linear(4, 6)
    ref = lin(norm(emb(ids := torch.randint(11, (2, 5)))))
    emb_tp = parallelize_module(copy.deepcopy(emb), mesh, RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1)))
    norm_tp = parallelize_module(copy.deepcopy(norm), mesh, SequenceParallel(use_local_output=True))
    lin_tp = parallelize_module(copy.deepcopy(lin), mesh, ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Replicate()))
    with CommDebugMode() as comm:
        h = emb_tp(ids)
        assert not isinstance(h, DTensor) and h.shape[1] == (3, 2)[mesh.get_rank()]
        out = lin_tp(norm_tp(h))
    # the reduce-scatter, the gather of the normed pieces, the gather of the output features
    assert comm.get_comm_counts() == {"reduce_scatter": 1, "all_gather": 2}
    torch.testing.assert_close(out, ref)
    with torch.no_grad():
        h = emb_tp(ids)
    h.resize_(2, 1, 4)
    with pytest.raises(ValueError, match="resized in place"):
        norm_tp(h)


@distributed(world_size=2, timeout=60)
def test_colwise_shard_input_carries_its_size_in_the_gather():
    """ColwiseParallel(input_layouts=Shard(0)) on local batch pieces: the first call learns the
    pieces' sizes (metadata exchange), later ones gather once with the size in an 8-byte header
    -- exact on an uneven last batch, a batch larger than any before (a second, exact round),
    and an empty piece; pieces that form no torch.chunk split, or a rank with another dtype,
    raise the same ValueError on every rank (nothing sized by a piece crossed ranks)."""
    mesh = init_device_mesh("cpu", (2,))
    rank = mesh.get_rank()
    lin = nn.Linear(5, 6)
    model = parallelize_module(copy.deepcopy(lin), mesh, ColwiseParallel(input_layouts=Shard(0)))
    # global batch rows, collectives of forward + backward (the first: the exchange, then the
    # gather; 9 > the agreed pad of 4: headers, exchange, gather)
    for batch, collectives in ((8, 3), (8, 2), (7, 2), (9, 4), (1, 2), (8, 2)):
        x = torch.randn(batch, 5, generator=torch.Generator().manual_seed(batch))
        local = _local_shard(x, mesh, 0).clone().requires_grad_()
        with CommDebugMode() as comm:
            out = model(local)
            out.pow(2).sum().backward()
        assert comm.get_total_counts() == collectives, (batch, comm.get_comm_counts())
        whole = x.clone().requires_grad_()
        ref = lin(whole)
        torch.testing.assert_close(out, ref.chunk(2, 1)[rank])
        ref.pow(2).sum().backward()  # each rank's columns add to the input's gradient
        torch.testing.assert_close(local.grad, _local_shard(whole.grad, mesh, 0))
    with pytest.raises(ValueError, match="do not form one global tensor"):
        model(torch.randn((3, 1)[rank], 5))  # 3 + 1: no torch.chunk split
    with pytest.raises(ValueError, match="different dtypes"):
        model(torch.randn(4, 5, dtype=(torch.float32, torch.float64)[rank]))
    torch.testing.assert_close(model(torch.ones(4, 5)), lin(torch.ones(8, 5)).chunk(2, 1)[rank])


# ----------------------------------------------------------------------------- loss_parallel
@distributed(world_size=2, timeout=60)
def test_loss_parallel_cross_entropy_and_nll():
    mesh = init_device_mesh("cpu", (2,))
    logits = torch.randn(6, 7, requires_grad=True)  # 7 classes: uneven class shards
    targets = torch.randint(0, 7, (6,))
    weight = torch.rand(7)
    for fn, kwargs in [(F.cross_entropy, {}), (F.cross_entropy, {"weight": weight}),
                       (lambda x, t, **kw: F.nll_loss(F.log_softmax(x, -1), t, **kw),
                        {"ignore_index": int(targets[0])})]:
        logits.grad = None
        ref = fn(logits, targets, **kwargs)
        ref.backward()
        dlogits = distribute_tensor(logits.detach(), mesh, [Shard(1)]).requires_grad_()
        with CommDebugMode() as comm, loss_parallel():
            loss = fn(dlogits, targets, **kwargs)
        assert "all_gather" not in comm.get_comm_counts()  # the logits are never gathered
        assert isinstance(loss, DTensor) and loss.placements == (Replicate(),)
        torch.testing.assert_close(loss.to_local(), ref)
        loss.backward()  # outside the context
        assert dlogits.grad.placements == (Shard(1),)
        torch.testing.assert_close(dlogits.grad.full_tensor(), logits.grad)
    # backward inside the context, too
    dlogits = distribute_tensor(logits.detach(), mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        F.cross_entropy(dlogits, targets).backward()
    logits.grad = None
    F.cross_entropy(logits, targets).backward()
    torch.testing.assert_close(dlogits.grad.full_tensor(), logits.grad)
    # outside the context: plain targets are an error, DTensor targets give the right value
    with pytest.raises(ValueError, match="plain torch.Tensor"):
        F.cross_entropy(dlogits, targets)
    loss = F.cross_entropy(dlogits, distribute_tensor(targets, mesh, [Replicate()]))
    torch.testing.assert_close(loss.full_tensor(), F.cross_entropy(logits, targets))


# ----------------------------------------------------------------------------- errors
@distributed(world_size=2, timeout=60)
def test_plan_key_matching_nothing_warns_as_torch():
    """A plan key naming a module the model lacks (a pipeline stage deleted it: torchtitan keeps
    one plan for every stage) is skipped with torch's warning, word for word, and the other
    entries are applied; one warning per module where the path stops."""
    import warnings
    from torch.distributed.tensor.parallel import (ColwiseParallel as TorchColwise,
                                                   parallelize_module as torch_parallelize)
    mesh = init_device_mesh("cpu", (2,))
    stage = Llama(CFG)
    del stage.norm  # what a pipeline stage that does not end the model looks like
    stage.layers = nn.ModuleList([stage.layers[0]])
    plan = {"norm": SequenceParallel(), "layers.*.attention.wq": ColwiseParallel(),
            "layers.*.attention.nope": ColwiseParallel()}
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        parallelize_module(stage, mesh, plan)
    assert isinstance(stage.layers[0].attention.wq.weight, DTensor)  # the rest was applied
    twin = Llama(CFG)
    del twin.norm
    twin.layers = nn.ModuleList([twin.layers[0]])
    with warnings.catch_warnings(record=True) as theirs:
        warnings.simplefilter("always")
        # every key misses, so torch's never touches the mesh (ours stands in for one)
        torch_parallelize(twin, mesh, {"norm": TorchColwise(), "layers.*.attention.nope": TorchColwise()})
    texts = [str(w.message) for w in ours if "Parallelize plan key" in str(w.message)]
    assert texts == [str(w.message) for w in theirs if "Parallelize plan key" in str(w.message)]
    assert len(texts) == 2 and "token 'norm'" in texts[0] and "token 'nope'" in texts[1]


@distributed(world_size=4, timeout=60)
def test_parallelize_module_errors():
    mesh = init_device_mesh("cpu", (4,))
    model = Llama(CFG)
    with pytest.warns(UserWarning, match=r"(?s)Parallelize plan key 'attn\.wq' could not be resolved: "
                                         r"no submodule matching token 'attn' in module .*"
                                         r"skipping this plan entry"):
        parallelize_module(model, mesh, {"layers.*.attn.wq": ColwiseParallel()})
    assert not any(isinstance(p.data, DTensor) for p in model.parameters())  # untouched
    with pytest.raises(ValueError, match="ColwiseParallel supports Linear and Embedding modules, "
                                         "not Conv2d"):
        parallelize_module(nn.Conv2d(3, 4, 3), mesh, ColwiseParallel())
    conv_net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with pytest.raises(ValueError, match=r"submodule '1' \(plan key '1'\): RowwiseParallel "
                                         "supports .* not LayerNorm"):
        parallelize_module(conv_net, mesh, {"1": RowwiseParallel()})
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r'1-D device mesh.*2-D mesh of shape \(2, 2\).*mesh\["tp"\]'):
        parallelize_module(nn.Linear(4, 4), mesh2d, ColwiseParallel())
    for bad in [[ColwiseParallel()], "colwise"]:  # None: a warning (test_torch_compat)
        with pytest.raises(ValueError, match="parallelize_plan must be a ParallelStyle or a dict"):
            parallelize_module(nn.Linear(4, 4), mesh, bad)
    with pytest.raises(ValueError, match="plan entries map a module path"):
        parallelize_module(nn.Linear(4, 4), mesh, {"": "colwise"})
    lin = parallelize_module(nn.Linear(4, 4), mesh2d["tp"], ColwiseParallel())
    with pytest.raises(ValueError, match="already a DTensor"):
        parallelize_module(lin, mesh2d["tp"], RowwiseParallel())
    with pytest.raises(ValueError, match="n_heads=4 does not divide by the TP size 3"):
        parallelize_llama(Llama(CFG), _FakeMesh(3))


class _FakeMesh:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def test_llama_tp_plan_contents():
    model = Llama(CFG)
    plan = llama_tp_plan(model, sequence_parallel=False, loss_parallel=False)
    assert "layers.*.attention_norm" not in plan
    assert plan["tok_embeddings"].output_layouts == Replicate()
    sp_plan = llama_tp_plan(model, sequence_parallel=True, loss_parallel=True)
    assert isinstance(sp_plan["layers.*.attention_norm"], SequenceParallel)
    assert sp_plan["layers.*.attention.wo"].output_layouts == Shard(1)
    assert sp_plan["output"].output_layouts == Shard(-1) and not sp_plan["output"].use_local_output
