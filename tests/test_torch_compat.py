"""Code written against torch.distributed.tensor / fully_shard / parallelize_module, imports
switched, nothing else changed: the calls user code and user tests make beyond training loops
(issue 24). Each test states torch's behaviour (checked against torch 2.13) and asserts ours."""

import copy
import io
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from dtensor_lite import (DTensor, Partial, Replicate, Shard, distribute_module,
                          distribute_tensor, get_model_state_dict, init_device_mesh)
from dtensor_lite.debug import CommDebugMode
from tests.harness import distributed


# ----------------------------------------------------------------------------- mesh
@distributed(world_size=4)
def test_mesh_as_context_manager_is_the_default_mesh():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.arange(16.0).reshape(4, 4)
    with mesh as entered:
        assert entered is mesh
        d = distribute_tensor(x, placements=[Shard(0), Shard(1)])
        with mesh["tp"]:  # nests: the innermost wins
            r = DTensor.from_local(torch.ones(2), placements=[Shard(0)])
        assert r.device_mesh == mesh["tp"] and r.shape == (4,)
    assert d.device_mesh is mesh and torch.equal(d.full_tensor(), x)
    assert distribute_tensor(x, placements=[Shard(0)]).device_mesh.shape == (4,)  # world again


@distributed(world_size=4)
def test_functional_collectives_take_our_mesh_and_mesh_dim():
    """torchtitan's dist_sum / dist_max: funcol.all_reduce(x, op, group=mesh)."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.tensor([float(rank), -float(rank)])
    tp_ranks, dp_ranks = mesh["tp"].mesh.tolist(), mesh["dp"].mesh.tolist()
    torch.testing.assert_close(funcol.all_reduce(x, "sum", group=mesh["tp"]).wait(),
                               torch.tensor([1.0, -1.0]) * sum(tp_ranks))
    torch.testing.assert_close(funcol.all_reduce(x, "max", group=(mesh, 0)).wait(),
                               torch.tensor([max(dp_ranks), -min(dp_ranks)], dtype=x.dtype))
    world = init_device_mesh("cpu", (4,))
    torch.testing.assert_close(funcol.all_reduce(x, "sum", group=world).wait(),
                               torch.tensor([6.0, -6.0]))
    gathered = funcol.all_gather_tensor(x, 0, (mesh, 1)).wait()
    torch.testing.assert_close(gathered, torch.cat([torch.tensor([float(r), -float(r)])
                                                    for r in tp_ranks]))
    # what funcol reads of it; type() and every method stay ours
    assert type(mesh).__module__ == "dtensor_lite.device_mesh"
    assert mesh._dim_group_names == [g.group_name for g in mesh.get_all_groups()]
    with pytest.raises(AssertionError, match="Only 1D mesh"):  # torch's own check for N-D
        funcol.all_reduce(x, "sum", group=mesh)


@distributed(world_size=4)
def test_unflatten_with_backend_override():
    """torchtitan's parallelize_llama: world._unflatten(0, sizes, names, backend_override=)."""
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    plain = world._unflatten(0, (2, 2), ("dp", "tp"))
    mesh = world._unflatten(0, (2, 2), ("dp", "tp"), backend_override={"tp": "gloo"})
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
    tp = mesh.get_group("tp")
    assert tp is not plain.get_group("tp") and dist.get_backend(tp) == "gloo"
    assert mesh.get_group("dp") is plain.get_group("dp")
    again = world.unflatten(0, (2, 2), ("dp", "tp"), backend_override={1: ("gloo", None)})
    assert again.get_group("tp") is tp
    x = torch.randn(4, 6)
    assert torch.equal(distribute_tensor(x, mesh, [Shard(0), Shard(1)]).full_tensor(), x)
    with pytest.raises(ValueError, match="'pp'"):
        world._unflatten(0, (2, 2), ("dp", "tp"), backend_override={"pp": "gloo"})


# ----------------------------------------------------------------------------- placements, ops
@distributed(world_size=4)
def test_partial_product():
    assert Partial("prod") == Partial("product") and Partial("prod").reduce_op == "product"
    mesh = init_device_mesh("cpu", (2, 2))
    rank = dist.get_rank()
    local = torch.tensor([1.0 + rank, 2.0, -1.0, 0.5 * (rank + 1)])
    pieces = [torch.tensor([1.0 + r, 2.0, -1.0, 0.5 * (r + 1)]) for r in range(4)]
    expect = torch.stack(pieces).prod(0)
    d = DTensor.from_local(local.clone().requires_grad_(), mesh, [Partial("product")] * 2)
    with CommDebugMode() as comm:
        full = d.full_tensor()
    torch.testing.assert_close(full, expect)
    assert comm.get_comm_counts() == {"all_reduce": 2}
    s = d.redistribute(mesh, [Shard(0), Partial("prod")]).redistribute(mesh, [Shard(0), Shard(0)])
    torch.testing.assert_close(s.full_tensor(), expect)
    # Replicate -> Partial(product) keeps the value (coordinate 0 holds it, the others ones)
    r = distribute_tensor(expect, mesh, [Replicate(), Replicate()])
    torch.testing.assert_close(r.redistribute(mesh, [Partial("product"), Replicate()])
                               .full_tensor(), expect)
    # gradient: d(prod)/d(piece) = product of the other pieces, exact with a zero among them
    leaf = local.clone().requires_grad_()
    DTensor.from_local(leaf, mesh, [Partial("product")] * 2).full_tensor().sum().backward()
    others = torch.stack([p for k, p in enumerate(pieces) if k != rank]).prod(0)
    torch.testing.assert_close(leaf.grad, others)
    with pytest.raises(ValueError, match="reduce_op must be one of"):
        Partial("mean")


@distributed(world_size=4)
def test_stride_of_non_contiguous_pieces():
    """torch: from_local(piece.t()).stride() is the transposed global tensor's."""
    mesh = init_device_mesh("cpu", (4,))
    piece = torch.randn(6, 2).t()                     # (2, 6), stride (1, 2)
    assert DTensor.from_local(piece, mesh, [Shard(0)]).stride() == (1, 8)   # global (8, 6)
    assert DTensor.from_local(piece, mesh, [Shard(1)]).stride() == (1, 2)   # global (2, 24)
    assert DTensor.from_local(piece.contiguous(), mesh, [Shard(0)]).stride() == (6, 1)
    d = DTensor.from_local(piece, mesh, [Shard(0)])   # every rank: the same piece (seed 0)
    torch.testing.assert_close((d * 2).full_tensor(), torch.cat([piece] * 4) * 2)
    assert d.t().stride() == (8, 1) and d.t().is_contiguous()


@distributed(world_size=4)
def test_is_same_size_with_a_plain_tensor_and_equal_refuses_it():
    """torch: aten.is_same_size(dtensor, tensor) compares the global shape; torch.equal of a
    DTensor and a plain tensor raises (ours too, with its own message)."""
    mesh = init_device_mesh("cpu", (4,))
    x = torch.randn(8, 6)
    d = distribute_tensor(x, mesh, [Shard(0)])
    with CommDebugMode() as comm:
        assert torch.ops.aten.is_same_size(d, torch.empty(8, 6))
        assert not torch.ops.aten.is_same_size(d, torch.empty(8, 5))
        assert not torch.ops.aten.is_same_size(torch.empty(2, 6), d)
    assert comm.get_total_counts() == 0
    assert torch.equal(d, distribute_tensor(x, mesh, [Replicate()]))
    with pytest.raises(ValueError, match="aten.equal.default: got a mix of DTensor and plain"):
        torch.equal(d, x)


@distributed(world_size=4)
def test_to_empty_keeps_partial_buffers():
    mesh = init_device_mesh("cpu", (4,))
    m = nn.Linear(4, 4)
    m.register_buffer("acc", DTensor.from_local(torch.ones(4), mesh, [Partial()]))
    m.register_buffer("rows", distribute_tensor(torch.ones(8, 2), mesh, [Shard(0)]))
    m.to_empty(device="cpu")
    assert m.acc.placements == (Partial(),) and m.rows.placements == (Shard(0),)
    assert m.acc.to_local().shape == (4,) and m.rows.to_local().shape == (2, 2)
    # the like-factories with values still make Partial inputs Replicate (torch's rule)
    assert torch.zeros_like(m.acc).placements == (Replicate(),)


@distributed(world_size=4)
def test_distribute_module_two_argument_input_and_output_fn():
    mesh = init_device_mesh("cpu", (4,))
    seen = []

    def input_fn(inputs, device_mesh):         # torch's older form: (inputs, device_mesh)
        seen.append(device_mesh)
        return tuple(distribute_tensor(t, device_mesh, [Replicate()]) for t in inputs)

    def output_fn(outputs, device_mesh):
        return outputs.full_tensor()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = distribute_module(nn.Linear(3, 2), mesh, input_fn=input_fn, output_fn=output_fn)
    messages = [str(w.message) for w in caught if w.category is FutureWarning]
    assert len(messages) == 2 and "Deprecating input_fn that takes two arguments" in messages[0]
    assert "Deprecating output_fn" in messages[1]
    x = torch.randn(5, 3)
    out = m(x)
    assert seen == [mesh] and type(out) is torch.Tensor
    torch.testing.assert_close(out, x @ m.weight.full_tensor().t() + m.bias.full_tensor())
    with pytest.raises(ValueError, match=r"input_fn should take in 3 arguments \(module, inputs, device_mesh\), but got 1"):
        distribute_module(nn.Linear(3, 2), mesh, input_fn=lambda inputs: inputs)


# ----------------------------------------------------------------------------- save / load
@distributed(world_size=4)
def test_torch_save_load_default_weights_only():
    """torch.load's default is weights_only=True: our DTensor, and a sharded state dict, load
    without the caller allow-listing anything."""
    from fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.randn(5, 6)
    d = distribute_tensor(x, mesh, [Shard(0), Partial("avg")]).redistribute(
        mesh, [Shard(0), Shard(1)])
    buf = io.BytesIO()
    torch.save({"d": d, "step": 3}, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded["step"] == 3 and isinstance(loaded["d"], DTensor)
    assert loaded["d"].placements == (Shard(0), Shard(1)) and loaded["d"].device_mesh == mesh
    torch.testing.assert_close(loaded["d"].full_tensor(), x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    fully_shard(model, mesh=mesh["dp"])
    sd = get_model_state_dict(model)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf)
    assert set(back) == set(ref)
    for k, v in back.items():
        assert isinstance(v, DTensor) and v.placements == sd[k].placements
        torch.testing.assert_close(v.full_tensor(), ref[k])


# ----------------------------------------------------------------------------- fsdp
@distributed(world_size=2)
def test_fully_shard_state_deepcopy_containers_and_slices():
    from fsdp import FSDPModule, fully_shard
    mesh = init_device_mesh("cpu", (2,))
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert fully_shard.state(seq) is None
    fully_shard(seq[0], mesh=mesh)
    fully_shard(seq, mesh=mesh)
    assert fully_shard.state(seq) is seq._fsdp_state and fully_shard.state(seq[0]) is not None
    assert fully_shard.state(seq[1]) is None
    # a slice of a sharded Sequential is a plain Sequential over the same (sharded) modules
    head = seq[0:2]
    assert type(head) is nn.Sequential and not isinstance(head, FSDPModule)
    assert head[0] is seq[0] and isinstance(head[0], FSDPModule)
    assert list(seq[1:]) == [seq[1], seq[2]] and type(seq[1:]) is nn.Sequential
    with pytest.raises(AssertionError, match="FSDP does not support deepcopy"):
        copy.deepcopy(seq)
    with pytest.raises(AssertionError, match="FSDP does not support deepcopy"):
        copy.deepcopy(nn.Sequential(seq[0]))  # a sharded module inside an unsharded one
    for container in (nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleDict({"a": nn.Linear(2, 2)})):
        with pytest.raises(ValueError, match="does not support containers that do not implement "
                                             "forward"):
            fully_shard(container, mesh=mesh)

    class Looping(nn.ModuleList):  # a container with a forward of its own is fine
        def forward(self, x):
            for m in self:
                x = m(x)
            return x
    looping = fully_shard(Looping([nn.Linear(2, 2)]), mesh=mesh)
    assert isinstance(looping, FSDPModule)


# ----------------------------------------------------------------------------- tp
@distributed(world_size=2)
def test_parallelize_module_without_a_plan_warns_and_does_nothing():
    from tp import ColwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2,))
    m = nn.Linear(4, 4)
    w = m.weight.detach().clone()
    for args in ((mesh, None), (mesh,)):
        with pytest.warns(UserWarning, match="No parallelize_plan is provided"):
            assert parallelize_module(m, *args) is m
    assert type(m.weight) is nn.Parameter and torch.equal(m.weight, w)
    with mesh:  # the mesh of a ``with mesh:`` block is parallelize_module's default
        parallelize_module(m, parallelize_plan=ColwiseParallel())
    assert m.weight.device_mesh is mesh and m.weight.placements == (Shard(0),)


# ----------------------------------------------------------------------------- CommDebugMode
class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp, self.out = _MLP(), nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.mlp(x))


def _module_counts(mode):
    return {fqn: {phase: dict(c) for phase, c in phases.items()}
            for fqn, phases in mode.comm_module_counts.items()}


@distributed(world_size=4)
def test_comm_debug_mode_keys_and_module_counts_match_torchs():
    """The same TP model and the same redistributes under torch's CommDebugMode and ours: equal
    counts under torch's keys (funcol ops) and equal per-module forward/backward counts; a
    second entry of one mode object counts from zero."""
    import torch.distributed.tensor as tdt
    import torch.distributed.tensor.parallel as ttp
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode
    import tp
    funcol_ops = torch.ops.c10d_functional

    ref = _Net()
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    mesh, tmesh = init_device_mesh("cpu", (4,)), torch_init_device_mesh("cpu", (4,))
    plan = {"mlp.w1": "ColwiseParallel", "mlp.w2": "RowwiseParallel"}
    tp.parallelize_module(ours, mesh, {k: getattr(tp, v)() for k, v in plan.items()})
    ttp.parallelize_module(theirs, tmesh, {k: getattr(ttp, v)() for k, v in plan.items()})
    x = torch.randn(3, 8, requires_grad=True)
    modes = {}
    for name, model, mode in (("ours", ours, CommDebugMode()),
                              ("torch", theirs, TorchCommDebugMode())):
        for _ in range(2):  # entered twice: the second run alone is counted
            with mode:
                model(x).sum().backward()
        modes[name] = mode
    mine, torchs = modes["ours"], modes["torch"]
    assert mine.get_comm_counts() == {"all_reduce": 2}          # our keys
    assert mine.get_comm_counts() == dict(torchs.get_comm_counts())  # torch's keys
    assert mine.get_comm_counts()[funcol_ops.all_reduce] == 2
    assert mine.get_comm_counts()[torch.ops._c10d_functional.all_reduce.default] == 2
    assert mine.get_comm_counts()[funcol_ops.all_gather_into_tensor] == 0
    assert funcol_ops.all_reduce in mine.get_comm_counts()
    assert mine.get_total_counts() == torchs.get_total_counts() == 2
    ours_by_module = _module_counts(mine)
    theirs_by_module = _module_counts(torchs)
    assert set(ours_by_module) == set(theirs_by_module) == {
        "Global", "_Net", "_Net.mlp", "_Net.mlp.w1", "_Net.mlp.w2"}
    for fqn, phases in theirs_by_module.items():
        for phase, counts in phases.items():
            assert mine.comm_module_counts[fqn][phase] == counts, (fqn, phase)
    assert ours_by_module["_Net.mlp.w2"] == {"forward": {"all_reduce": 1}, "backward": {}}
    assert ours_by_module["_Net.mlp.w1"] == {"forward": {}, "backward": {"all_reduce": 1}}
    assert {k: str(v) for k, v in mine.get_sharding_info().items()} == {
        k: str(v) for k, v in torchs.get_sharding_info().items()}

    # redistributes: the same keys and counts as torch's DTensor
    mesh2, tmesh2 = init_device_mesh("cpu", (2, 2)), torch_init_device_mesh("cpu", (2, 2))
    g = torch.randn(16, 12)
    cases = [([Shard(0), Shard(1)], [Replicate(), Replicate()]),
             ([Partial(), Replicate()], [Replicate(), Replicate()]),
             ([Partial(), Shard(1)], [Shard(0), Shard(1)]),
             ([Replicate(), Replicate()], [Shard(0), Shard(1)]),
             ([Shard(0), Replicate()], [Replicate(), Replicate()]),
             ([Partial(), Replicate()], [Shard(0), Replicate()])]
    # (not compared: Shard(0) -> Shard(1), where torch's gloo path all-gathers and ours sends
    # only the pieces with one all_to_all, counted as torch's all_to_all_single and its
    # _dtensor.shard_dim_alltoall)
    to_torch = {Shard: lambda p: tdt.Shard(p.dim), Replicate: lambda p: tdt.Replicate(),
                Partial: lambda p: tdt.Partial(p.reduce_op)}
    for src, dst in cases:
        d = distribute_tensor(g, mesh2, [Replicate(), Replicate()]).redistribute(mesh2, src)
        t = tdt.DTensor.from_local(d.to_local(), tmesh2, [to_torch[type(p)](p) for p in src],
                                   shape=g.shape, stride=g.stride())
        with CommDebugMode() as c:  # apart: torch's mode would see our c10d calls too
            d.redistribute(mesh2, dst)
        with TorchCommDebugMode() as tc:
            t.redistribute(tmesh2, [to_torch[type(p)](p) for p in dst])
        assert c.get_comm_counts() == dict(tc.get_comm_counts()), (src, dst)
        assert c.get_total_counts() == tc.get_total_counts()
    with CommDebugMode() as c:
        distribute_tensor(g, mesh2, [Shard(0), Replicate()]).redistribute(
            mesh2, [Shard(1), Replicate()])
    assert c.get_comm_counts()[torch.ops._dtensor.shard_dim_alltoall] == \
        c.get_comm_counts()[funcol_ops.all_to_all_single] == c.get_comm_counts()["all_to_all"] > 0
    assert repr(mine) == "CommDebugMode(get_total_counts()=2)"


@distributed(world_size=2)
def test_comm_debug_mode_fsdp_counts_under_torchs_c10d_keys():
    """torch's FSDP issues c10d collectives: its tests count c10d._allgather_base_ and
    c10d._reduce_scatter_base_; our FSDP's collectives answer those keys (not funcol's)."""
    from fsdp import fully_shard
    c10d = torch.ops.c10d
    mesh = init_device_mesh("cpu", (2,))
    model = _Net()
    fully_shard(model.mlp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with CommDebugMode() as comm:
        model(torch.randn(3, 8)).sum().backward()
    counts = comm.get_comm_counts()
    # the root keeps its parameters after forward; mlp's are gathered again for backward
    assert counts == {"all_gather": 3, "reduce_scatter": 2}
    assert counts[c10d._allgather_base_] == 3 and counts[c10d._reduce_scatter_base_] == 2
    assert counts[torch.ops.c10d_functional.all_gather_into_tensor] == 0
    by_module = _module_counts(comm)
    assert by_module["Global"] == {"forward": {"all_gather": 2},
                                   "backward": {"all_gather": 1, "reduce_scatter": 2}}
    # names as torch's: the root's class name after fully_shard's class swap
    assert by_module["FSDP_Net"] == by_module["Global"]
    # mlp's backward all-gather is its own: on CPU backward prefetches from a post-backward
    # (fsdp.streams), and the root's comes last (torch's root prefetches it from its
    # pre-backward, so torch counts it under FSDP_Net only)
    assert by_module["FSDP_Net.mlp"] == {"forward": {"all_gather": 1},
                                         "backward": {"all_gather": 1, "reduce_scatter": 2}}


# ----------------------------------------------------------------------------- norms
@distributed(world_size=2)
def test_sequence_parallel_norm_backward_every_requires_grad_combination():
    """Embedding (rowwise, output Shard(1)) -> LayerNorm / RMSNorm (SequenceParallel) -> Linear
    (colwise, input Shard(1)), with and without affine, normalising the last dim (and for
    affine LayerNorm the last two, the sharded sequence dim among them), for every
    requires_grad pattern of the three modules: outputs and every gradient equal one
    process's."""
    import itertools
    from tp import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2,))
    batch, seq, emb, vocab = 4, 6, 5, 16

    class Block(nn.Module):
        def __init__(self, norm, shape, affine):
            super().__init__()
            self.emb = nn.Embedding(vocab, emb)
            self.norm = norm(shape, elementwise_affine=affine)
            self.lin = nn.Linear(emb, emb)

        def forward(self, tokens):
            return self.lin(self.norm(self.emb(tokens)))

    plan = {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "lin": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    checked = 0
    for norm, multidim, affine, *grads in itertools.product(
            (nn.LayerNorm, nn.RMSNorm), (False, True), (False, True), *[(False, True)] * 3):
        wants = dict(zip(("emb", "norm", "lin"), grads))
        if (wants["norm"] and not affine) or not any(grads):
            continue
        if multidim and (norm is nn.RMSNorm or not affine):  # time: one multidim family
            continue
        torch.manual_seed(checked)
        ref = Block(norm, (seq, emb) if multidim else (emb,), affine)
        model = parallelize_module(copy.deepcopy(ref), mesh, plan)
        for m in (ref, model):
            for name, p in m.named_parameters():
                p.requires_grad_(wants[name.split(".")[0]])
        tokens = torch.randint(vocab, (batch, seq))
        out, expect = model(tokens), ref(tokens)
        torch.testing.assert_close(out, expect)
        out.sum().backward()
        expect.sum().backward()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=lambda m: (
                    f"{norm.__name__} multidim={multidim} affine={affine} {wants} {name}: {m}"))
        checked += 1
    assert checked == 27


# ----------------------------------------------------------------------------- torch.compile
def _gelu_sum(x, w):       # Partial(sum) scalar: x Shard(0) @ w, summed over the sharded rows
    return torch.nn.functional.gelu(x @ w).sum()


def _gelu_rows(x, w):      # Shard(0)
    return torch.nn.functional.gelu(x @ w)


def _gram(x, w):           # Partial(sum) matrix: the sharded dim contracted
    return x.t() @ torch.nn.functional.gelu(x @ w)


def _replicated(x, w):     # Replicate (inputs replicated)
    return torch.tanh(x @ w) * 2


@distributed(world_size=2)
def test_fullgraph_compiled_partial_shard_replicate_outputs_match_eager():
    """torch.compile(fullgraph=True) of DTensor functions whose outputs are Partial, Shard and
    Replicate: forward placements and values, and backward gradients, equal eager's. (The
    backward of a Partial output needs __coerce_same_metadata_as_tangent__: the compiled
    backward guessed the gradient's layout, and a Replicate gradient arrives.)"""
    mesh = init_device_mesh("cpu", (2,))
    x0, w0 = torch.randn(8, 6), torch.randn(6, 4)
    cases = [(_gelu_sum, Shard(0), (Partial(),)), (_gelu_rows, Shard(0), (Shard(0),)),
             (_gram, Shard(0), (Partial(),)), (_replicated, Replicate(), (Replicate(),))]
    for fn, x_placement, out_placements in cases:
        results = []
        for compiled in (False, True):
            torch._dynamo.reset()
            x = distribute_tensor(x0, mesh, [x_placement]).requires_grad_()
            w = distribute_tensor(w0, mesh, [Replicate()]).requires_grad_()
            f = torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn
            y = f(x, w)
            assert y.placements == out_placements, (fn.__name__, compiled, y.placements)
            (y if y.ndim == 0 else (y * y).sum()).backward()
            results.append([y.full_tensor(), x.grad.full_tensor(), w.grad.full_tensor()])
        xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        ref = fn(xr, wr)
        (ref if ref.ndim == 0 else (ref * ref).sum()).backward()
        for eager, comp, plain in zip(*results, [ref, xr.grad, wr.grad]):
            torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(eager, plain, rtol=1e-5, atol=1e-6)
