"""DeviceMesh: shapes, coordinates, groups that really connect the right ranks, slicing,
flattening, non-sorted rank layouts and clear errors. Runs on real gloo process groups."""

import pytest
import torch
import torch.distributed as dist

from dtensor_lite import (DeviceMesh, Partial, Replicate, Shard, distribute_tensor,
                          init_device_mesh)
from tests.harness import distributed, run_distributed


def _group_sum(value, group) -> float:
    """all_reduce(SUM) of ``value`` over ``group``: proves which ranks the group connects."""
    t = torch.tensor([float(value)])
    dist.all_reduce(t, group=group)
    return t.item()


# ----------------------------------------------------------------------------- 1-D


@distributed(world_size=2)
def test_1d_mesh_basics():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    assert mesh.ndim == 1
    assert mesh.shape == (2,)
    assert mesh.size() == 2 and mesh.size(0) == 2
    assert mesh.mesh.tolist() == [0, 1]
    assert mesh.mesh_dim_names is None
    assert mesh.device_type == "cpu"
    assert mesh.get_rank() == rank
    assert mesh.get_coordinate() == [rank]
    assert mesh.get_local_rank() == rank and mesh.get_local_rank(0) == rank
    assert _group_sum(rank + 1, mesh.get_group()) == 3.0
    assert mesh.get_all_groups() == [mesh.get_group(0)]

    named = init_device_mesh("cpu", 2, mesh_dim_names=("dp",))  # an int shape is accepted too
    assert named.mesh_dim_names == ("dp",)
    assert named.size("dp") == 2
    assert named.get_local_rank("dp") == rank
    assert named["dp"] is named  # slicing a 1-D mesh by its own name is the mesh itself
    assert _group_sum(rank + 1, named.get_group("dp")) == 3.0


@distributed(world_size=2)
def test_1d_explicit_reversed_mesh():
    """Ranks listed in reverse: coordinates follow the listing, not the rank number."""
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [1, 0])
    assert mesh.get_coordinate() == [1 - rank]
    assert _group_sum(rank, mesh.get_group()) == 1.0
    x = torch.arange(10.0).reshape(5, 2)
    d = distribute_tensor(x, mesh, [Shard(0)])
    torch.testing.assert_close(d.to_local(), torch.chunk(x, 2)[1 - rank])
    torch.testing.assert_close(d.full_tensor(), x)


# ----------------------------------------------------------------------------- 2-D


@distributed(world_size=4)
def test_2d_mesh_shape_coordinates_and_groups():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = divmod(rank, 2)
    assert mesh.ndim == 2
    assert mesh.shape == (2, 2)
    assert mesh.size() == 4 and mesh.size(0) == 2 and mesh.size("tp") == 2
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
    assert mesh.mesh_dim_names == ("dp", "tp")
    assert mesh.get_coordinate() == [dp, tp]
    assert mesh.get_local_rank("dp") == dp and mesh.get_local_rank(0) == dp
    assert mesh.get_local_rank("tp") == tp and mesh.get_local_rank(1) == tp
    assert mesh.get_local_rank(-1) == tp

    # tp groups are the rows {0,1} and {2,3}; dp groups the columns {0,2} and {1,3}
    assert _group_sum(rank, mesh["tp"].get_group()) == [1.0, 5.0][dp]
    assert _group_sum(rank, mesh.get_group("tp")) == [1.0, 5.0][dp]
    assert _group_sum(rank, mesh["dp"].get_group()) == [2.0, 4.0][tp]
    assert _group_sum(rank, mesh.get_group(0)) == [2.0, 4.0][tp]
    groups = mesh.get_all_groups()
    assert len(groups) == 2
    assert groups[0] is mesh.get_group(0) and groups[1] is mesh.get_group(1)


@distributed(world_size=4)
def test_2d_mesh_get_local_rank_and_group_need_a_dim():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="mesh_dim"):
        mesh.get_local_rank()
    with pytest.raises(ValueError, match="mesh_dim"):
        mesh.get_group()
    with pytest.raises(KeyError, match="'pp'"):
        mesh.get_local_rank("pp")
    with pytest.raises(IndexError, match="out of range"):
        mesh.size(2)


@distributed(world_size=4)
def test_2d_mesh_slicing():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = divmod(rank, 2)

    tp_mesh = mesh["tp"]
    assert tp_mesh.ndim == 1 and tp_mesh.shape == (2,)
    assert tp_mesh.mesh_dim_names == ("tp",)
    assert tp_mesh.mesh.tolist() == [[0, 1], [2, 3]][dp]
    assert tp_mesh.get_coordinate() == [tp]
    assert tp_mesh.get_local_rank() == tp

    dp_mesh = mesh["dp"]
    assert dp_mesh.mesh.tolist() == [[0, 2], [1, 3]][tp]
    assert dp_mesh.get_coordinate() == [dp]

    both = mesh["dp", "tp"]
    assert both.shape == (2, 2)
    assert both.mesh.tolist() == [[0, 1], [2, 3]]
    assert both.get_coordinate() == [dp, tp]

    # a DTensor on a sliced mesh shards over that slice only
    x = torch.arange(8.0)
    d = distribute_tensor(x, tp_mesh, [Shard(0)])
    torch.testing.assert_close(d.to_local(), x.chunk(2)[tp])
    torch.testing.assert_close(d.full_tensor(), x)


@distributed(world_size=4)
def test_groups_are_shared_between_meshes_and_slices():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert mesh["tp"].get_group() is mesh.get_group(1)
    assert mesh["dp"].get_group() is mesh.get_group(0)
    assert mesh["tp"].get_group() is mesh.get_group("tp")
    # an equal mesh built again reuses the groups instead of creating new ones
    again = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert again.get_group(0) is mesh.get_group(0)
    assert again.get_group(1) is mesh.get_group(1)
    assert again == mesh and hash(again) == hash(mesh)
    # the whole world is the default group, not a copy of it
    world = init_device_mesh("cpu", (4,))
    assert world.get_group() is dist.distributed_c10d._get_default_group()


@distributed(world_size=4)
@pytest.mark.parametrize("spelling", ["_flatten", "flatten"])
def test_2d_mesh_flatten(spelling):
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    name = "dp_tp" + spelling  # a fresh name per test: names are remembered by the root mesh
    flat = getattr(mesh["dp", "tp"], spelling)(name)
    assert flat.ndim == 1
    assert flat.shape == (4,)
    assert flat.mesh_dim_names == (name,)
    assert flat.mesh.tolist() == [0, 1, 2, 3]
    assert flat.get_coordinate() == [rank]
    assert flat.get_local_rank() == rank
    assert _group_sum(rank, flat.get_group()) == 6.0
    # the root mesh now knows the flattened name
    again = mesh[name]
    assert again.mesh.tolist() == [0, 1, 2, 3]
    assert again.get_group() is flat.get_group()
    assert _group_sum(1, again.get_group()) == 4.0
    # flattening does not disturb the original dims
    assert mesh.shape == (2, 2)
    assert _group_sum(rank, mesh["tp"].get_group()) == [1.0, 5.0][rank // 2]


@distributed(world_size=4)
def test_flatten_name_clash_is_an_error():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="already names"):
        mesh["dp", "tp"]._flatten("tp")


# ----------------------------------------------------------------------------- 3-D


@distributed(world_size=8)
def test_3d_mesh():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    ref = torch.arange(8).reshape(2, 2, 2)
    pp, dp, tp = rank // 4, (rank // 2) % 2, rank % 2
    assert mesh.ndim == 3 and mesh.shape == (2, 2, 2) and mesh.size() == 8
    assert mesh.mesh.tolist() == ref.tolist()
    assert mesh.get_coordinate() == [pp, dp, tp]
    for i, (name, c) in enumerate(zip(("pp", "dp", "tp"), (pp, dp, tp))):
        assert mesh.get_local_rank(name) == c
        assert mesh.get_local_rank(i) == c
        assert mesh.size(name) == 2

    # each dim's group: the ranks that differ from this one only along that dim
    rows = {"pp": ref[:, dp, tp], "dp": ref[pp, :, tp], "tp": ref[pp, dp, :]}
    for name, row in rows.items():
        assert _group_sum(rank, mesh.get_group(name)) == float(row.sum())
        assert mesh[name].mesh.tolist() == row.tolist()

    # two-name slices
    sub = mesh["dp", "tp"]
    assert sub.shape == (2, 2)
    assert sub.mesh.tolist() == ref[pp].tolist()
    assert sub.get_coordinate() == [dp, tp]
    sub2 = mesh["pp", "tp"]
    assert sub2.mesh.tolist() == ref[:, dp, :].tolist()
    assert sub2.get_coordinate() == [pp, tp]
    assert sub2.get_group("tp") is mesh.get_group("tp")
    assert _group_sum(rank, sub2.get_group("pp")) == float(ref[:, dp, tp].sum())

    # flatten adjacent and non-adjacent dims
    flat = mesh["dp", "tp"]._flatten("dp_tp_3d")
    assert flat.mesh.tolist() == ref[pp].flatten().tolist()
    assert flat.get_coordinate() == [dp * 2 + tp]
    assert _group_sum(rank, flat.get_group()) == float(ref[pp].sum())
    assert mesh["dp_tp_3d"].get_group() is flat.get_group()
    assert mesh["pp", "dp_tp_3d"].shape == (2, 4)

    flat2 = mesh["pp", "tp"].flatten("pp_tp_3d")
    assert flat2.mesh.tolist() == ref[:, dp, :].flatten().tolist()
    assert flat2.get_coordinate() == [pp * 2 + tp]
    assert _group_sum(rank, mesh["pp_tp_3d"].get_group()) == float(ref[:, dp, :].sum())

    # a DTensor over the 3-D mesh round-trips
    x = torch.arange(60.0).reshape(6, 10)
    d = distribute_tensor(x, mesh, [Shard(0), Replicate(), Shard(1)])
    torch.testing.assert_close(d.to_local(), x.chunk(2, 0)[pp].chunk(2, 1)[tp])
    torch.testing.assert_close(d.full_tensor(), x)


# ----------------------------------------------------------------------------- non-sorted


@distributed(world_size=4)
def test_non_sorted_2d_mesh():
    rank = dist.get_rank()
    layout = [[3, 1], [2, 0]]
    mesh = DeviceMesh("cpu", layout, mesh_dim_names=("a", "b"))
    coord = {3: [0, 0], 1: [0, 1], 2: [1, 0], 0: [1, 1]}[rank]
    assert mesh.mesh.tolist() == layout
    assert mesh.get_coordinate() == coord
    assert mesh.get_local_rank("a") == coord[0] and mesh.get_local_rank("b") == coord[1]
    assert mesh["b"].mesh.tolist() == layout[coord[0]]
    assert mesh["a"].mesh.tolist() == [layout[0][coord[1]], layout[1][coord[1]]]
    # groups: rows {3,1} / {2,0} along "b", columns {3,2} / {1,0} along "a"
    assert _group_sum(rank, mesh.get_group("b")) == float(sum(layout[coord[0]]))
    assert _group_sum(rank, mesh.get_group("a")) == float(layout[0][coord[1]] + layout[1][coord[1]])

    x = torch.arange(42.0).reshape(7, 6)
    # 1-D DTensor over a non-sorted flattened view
    flat = mesh["a", "b"]._flatten("ab_nonsorted")
    assert flat.mesh.tolist() == [3, 1, 2, 0]
    d1 = distribute_tensor(x, flat, [Shard(0)])
    pieces = torch.tensor_split(x, [2, 4, 6])  # chunk(7 rows, 4): 2, 2, 2, 1
    torch.testing.assert_close(d1.to_local(), pieces[[3, 1, 2, 0].index(rank)])
    torch.testing.assert_close(d1.full_tensor(), x)

    # 2-D: every collective kind must put pieces back in mesh order, not rank order
    d = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    torch.testing.assert_close(d.to_local(), x.chunk(2, 0)[coord[0]].chunk(2, 1)[coord[1]])
    torch.testing.assert_close(d.full_tensor(), x)
    s = d.redistribute(mesh, [Shard(1), Shard(0)])  # all_to_all on both dims
    torch.testing.assert_close(s.to_local(), x.chunk(2, 1)[coord[0]].chunk(2, 0)[coord[1]])
    torch.testing.assert_close(s.full_tensor(), x)
    p = distribute_tensor(x, mesh, [Partial(), Partial()])
    rs = p.redistribute(mesh, [Shard(0), Shard(1)])  # reduce_scatter on both dims
    torch.testing.assert_close(rs.to_local(), x.chunk(2, 0)[coord[0]].chunk(2, 1)[coord[1]])
    torch.testing.assert_close(p.full_tensor(), x)


# ----------------------------------------------------------------------------- errors


@distributed(world_size=4)
def test_mesh_may_not_exceed_the_world():
    with pytest.raises(ValueError, match="world size is 4"):
        init_device_mesh("cpu", (2, 4))
    with pytest.raises(ValueError, match=r"outside the world"):
        DeviceMesh("cpu", [0, 1, 2, 3, 4])
    # part of the world is a mesh (as in torch): see tests/test_sub_world_mesh.py
    assert init_device_mesh("cpu", (3,)).mesh.tolist() == [0, 1, 2]


@distributed(world_size=4)
def test_unknown_dim_name_in_slicing():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(KeyError, match="'pp'.*available"):
        mesh["pp"]
    with pytest.raises(KeyError, match="'pp'"):
        mesh["dp", "pp"]
    with pytest.raises(ValueError, match="duplicate"):
        mesh["tp", "tp"]
    with pytest.raises(TypeError, match="by dim names"):
        mesh[0]
    unnamed = init_device_mesh("cpu", (2, 2))
    with pytest.raises(KeyError, match="'tp'"):
        unnamed["tp"]


@distributed(world_size=4)
def test_bad_mesh_dim_names():
    with pytest.raises(ValueError, match="unique"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "dp"))
    with pytest.raises(ValueError, match="unique"):
        DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("x", "x"))
    with pytest.raises(ValueError, match="3 names for a 2-D mesh"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b", "c"))
    with pytest.raises(ValueError, match="1 names for a 2-D mesh"):
        DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("a",))
    with pytest.raises(ValueError, match="2 names for a 1-D mesh"):
        init_device_mesh("cpu", (4,), mesh_dim_names=("a", "b"))


@distributed(world_size=4)
def test_bad_explicit_meshes():
    with pytest.raises(ValueError, match=r"ranks \[5\] outside the world \[0, 4\)"):
        DeviceMesh("cpu", [[0, 1], [2, 5]])
    with pytest.raises(ValueError, match=r"ranks \[-1\] outside the world"):
        DeviceMesh("cpu", [0, 1, 2, -1])
    with pytest.raises(ValueError, match="duplicate ranks"):
        DeviceMesh("cpu", [[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="integer ranks"):
        DeviceMesh("cpu", [0.0, 1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="rectangular"):
        DeviceMesh("cpu", [[0, 1, 2], [3]])
    with pytest.raises(ValueError, match="at least one"):
        DeviceMesh("cpu", [])


@distributed(world_size=4)
@pytest.mark.parametrize("shape", [(0,), (4, 0), (-2, -2), (-4,), ()])
def test_bad_mesh_shape(shape):
    with pytest.raises(ValueError, match="positive ints"):
        init_device_mesh("cpu", shape)


def _old_style_device_type():
    try:
        init_device_mesh("cpu:0", (2,))
    except ValueError as e:
        return str(e)
    return None


def test_device_type_with_index_is_rejected():
    msgs = run_distributed(2, _old_style_device_type)
    assert all(m is not None and "not a device" in m for m in msgs)


# ----------------------------------------------------------------------------- from_group


class _IssuedGroups:
    """Records the process group of every collective the collectives layer issues."""

    def __enter__(self):
        from dtensor_lite import collectives
        self._module, self._real, self.groups = collectives, collectives._issue, []

        def issue(collective, *args, group, **kwargs):
            self.groups.append(group)
            return self._real(collective, *args, group=group, **kwargs)
        collectives._issue = issue
        return self

    def __exit__(self, *exc):
        self._module._issue = self._real


@distributed(world_size=4)
def test_from_group_1d_uses_the_given_group():
    g = dist.new_group([0, 1, 2, 3])
    assert g is not dist.distributed_c10d._get_default_group()
    mesh = DeviceMesh.from_group(g, "cpu", mesh_dim_names=("dp",))
    assert mesh.shape == (4,) and mesh.mesh.tolist() == [0, 1, 2, 3]
    assert mesh.get_group() is g and mesh["dp"].get_group() is g
    x = torch.randn(7, 3)
    with _IssuedGroups() as issued:
        d = distribute_tensor(x, mesh, [Shard(0)])
        full = d.redistribute(mesh, [Replicate()]).to_local()
        p = distribute_tensor(x, mesh, [Partial()]).redistribute(mesh, [Shard(1)])
    assert torch.equal(full, x)
    assert torch.equal(p.full_tensor(), x)
    assert issued.groups and all(grp is g for grp in issued.groups)
    # the shared group cache did not adopt the user's group
    assert init_device_mesh("cpu", (4,)).get_group() is not g


@distributed(world_size=4)
def test_from_group_2d_list_of_groups():
    rank = dist.get_rank()
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp, tp = cols[rank % 2], rows[rank // 2]
    mesh = DeviceMesh.from_group([dp, tp], "cpu", mesh=[[0, 1], [2, 3]],
                                 mesh_dim_names=("dp", "tp"))
    assert mesh.shape == (2, 2) and mesh.get_coordinate() == [rank // 2, rank % 2]
    assert mesh.get_group("dp") is dp and mesh["tp"].get_group() is tp
    assert _group_sum(rank, mesh.get_group("tp")) == [1.0, 5.0][rank // 2]
    x = torch.randn(6, 5)
    # (distribute_tensor's scatter runs over all 4 ranks at once: a joined group of the cache)
    d = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    p = distribute_tensor(x, mesh, [Partial(), Shard(0)])
    with _IssuedGroups() as issued:
        assert torch.equal(d.redistribute(mesh, [Replicate(), Replicate()]).to_local(), x)
        q = p.redistribute(mesh, [Shard(1), Replicate()])
        assert torch.equal(q.redistribute(mesh, [Replicate(), Replicate()]).to_local(), x)
    assert issued.groups and all(grp is dp or grp is tp for grp in issued.groups)
    assert any(grp is dp for grp in issued.groups) and any(grp is tp for grp in issued.groups)
    # a 1-D slice of it and a plain mesh over the same ranks keep their own groups
    assert init_device_mesh("cpu", (2, 2)).get_group(1) is not tp
    # joining the two dims needs a group over all 4 ranks: made through the cache, collectively
    flat = mesh._flatten("dp_tp")
    assert torch.equal(distribute_tensor(x, flat, [Shard(0)]).full_tensor(), x)


@distributed(world_size=4)
def test_from_group_over_a_subgroup_of_the_world():
    """A group over ranks [0, 1] (and another over [2, 3]): each pair gets a 1-D mesh of 2 over
    its own ranks, as torch's from_group does, and its collectives stay within the pair."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mesh = DeviceMesh.from_group(pairs[rank // 2], "cpu")
    assert mesh.shape == (2,) and mesh.mesh.tolist() == [[0, 1], [2, 3]][rank // 2]
    assert mesh.get_local_rank() == rank % 2
    x = torch.arange(10.0).reshape(5, 2) + 100 * (rank // 2)  # each pair its own tensor
    d = distribute_tensor(x, mesh, [Shard(0)])
    assert torch.equal(d.to_local(), x.chunk(2)[rank % 2])
    assert torch.equal(d.full_tensor(), x)


@distributed(world_size=4)
def test_from_group_errors():
    rank = dist.get_rank()
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp, tp = cols[rank % 2], rows[rank // 2]
    with pytest.raises(ValueError, match="needs mesh="):
        DeviceMesh.from_group([dp, tp], "cpu")
    with pytest.raises(ValueError, match=r"group 0 holds ranks .* row along mesh dim 0"):
        DeviceMesh.from_group([tp, dp], "cpu", mesh=[[0, 1], [2, 3]])  # swapped
    with pytest.raises(ValueError, match="2 group\\(s\\) for a 1-D mesh"):
        DeviceMesh.from_group([dp, tp], "cpu", mesh=[0, 1, 2, 3])
    with pytest.raises(TypeError, match="not a ProcessGroup"):
        DeviceMesh.from_group("tp", "cpu")
    with pytest.raises(ValueError, match="non-empty list"):
        DeviceMesh.from_group([], "cpu")
    with pytest.raises(ValueError, match=f"rank {rank} is not in the mesh"):
        DeviceMesh.from_group(tp, "cpu", mesh=[r for r in range(4) if r != rank][:2])
    # a 2x1 sub-world mesh cannot make a group joining its dims (only its members would call
    # new_group): a clear error, before anything waits
    singles = [dist.new_group([r]) for r in range(4)]  # new_group: same calls on every rank
    sub = DeviceMesh.from_group([tp, singles[rank]], "cpu",
                                mesh=[[0], [1]] if rank < 2 else [[2], [3]])
    with pytest.raises(ValueError, match=r"covers 2 of 4 ranks.*mesh dims \[0, 1\] joined"):
        sub._flatten("both")


# ----------------------------------------------------------------------------- backend_override


@distributed(world_size=4)
def test_init_device_mesh_backend_override():
    """{"tp": "gloo"}: the tp dim gets groups of its own, made with backend="gloo" (the dp dim
    and plain meshes keep the cache's groups); redistribute over it gives torch's values on it."""
    rank = dist.get_rank()
    plain = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"),
                            backend_override={"tp": "gloo", 0: None})
    tp = mesh.get_group("tp")
    assert tp is not plain.get_group("tp") and dist.get_backend(tp) == "gloo"
    assert mesh.get_group("dp") is plain.get_group("dp")
    assert mesh["tp"].get_group() is tp
    assert _group_sum(rank, tp) == [1.0, 5.0][rank // 2]
    x = torch.randn(6, 5)
    d = distribute_tensor(x, mesh, [Replicate(), Shard(1)])
    with _IssuedGroups() as issued:
        full = d.redistribute(mesh, [Replicate(), Replicate()]).to_local()
    assert torch.equal(full, x) and issued.groups and all(g is tp for g in issued.groups)
    # an equal override reuses those groups; (backend, options) and options alone are accepted
    again = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"),
                             backend_override={1: ("gloo", None)})
    assert again.get_group("tp") is tp
    opts = torch._C._distributed_c10d.ProcessGroupGloo._Options()
    with_opts = init_device_mesh("cpu", (4,), backend_override={0: ("gloo", opts)})
    assert with_opts.get_group() is not dist.distributed_c10d._get_default_group()
    assert torch.equal(distribute_tensor(x, with_opts, [Shard(0)]).full_tensor(), x)


@distributed(world_size=4)
def test_backend_override_fake():
    """torch's "fake" backend (torchtitan's ParallelDims gives it to size-1 and data-loading-only
    dims): accepted as torch accepts it, the dim's group is torch's FakeProcessGroup (backend
    "fake"), coordinates and slicing work, a size-1 fake dim takes part in DTensor programs (it
    never communicates), and a collective over a fake dim of several ranks is refused by name
    instead of leaving the wrong values a FakeProcessGroup would."""
    rank = dist.get_rank()
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (1, 2, 2), ("pp", "batch", "tp"),
                            backend_override={"pp": "fake", "batch": "fake"})
    assert dist.get_backend(mesh.get_group("pp")) == "fake"
    assert dist.get_backend(mesh.get_group("batch")) == "fake"
    assert dist.get_backend(mesh.get_group("tp")) == "gloo"
    assert mesh["batch"].get_local_rank() == rank // 2 and mesh.get_coordinate() == [0, rank // 2, rank % 2]
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    sub = mesh["pp", "tp"]  # a size-1 fake dim beside a real one: a full DTensor program runs
    d = distribute_tensor(x, sub, [Replicate(), Shard(1)])
    y = (d * 2).sum(0)
    assert y.placements == (Replicate(), Shard(0))
    assert torch.allclose(y.full_tensor(), (x * 2).sum(0))
    # a flattened dim gets a real group of its own, as torchtitan's loss mesh needs
    loss = mesh["batch", "tp"]._flatten("loss")
    assert torch.equal(distribute_tensor(x, loss, [Shard(0)]).full_tensor(), x)
    # by init_device_mesh too; size-1 dims on a fake backend are free
    m2 = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"), backend_override={"dp": "fake"})
    assert torch.equal(distribute_tensor(x, m2, [Shard(0), Shard(0)]).full_tensor(), x)
    # several ranks over a fake group: refused clearly (every rank alike), never wrong values
    with pytest.raises(RuntimeError, match=r"backend 'fake'.*never communicates"):
        distribute_tensor(x, mesh["batch"], [Replicate()]).redistribute(
            mesh["batch"], [Shard(0)]).redistribute(mesh["batch"], [Replicate()])
    assert torch.equal(distribute_tensor(x, mesh["tp"], [Shard(0)]).full_tensor(), x)


@distributed(world_size=4)
def test_join_meshes_unflattened_from_one_world():
    """torchtitan's ParallelDims unflattens the world twice, into ("batch", "tp") for data and
    ("dp_replicate", "fsdp", "tp") for parameters, and fully_shard joins the fsdp dim of one
    with the tp dim of the other. The joined mesh is the 2-D mesh of their rank layouts, its
    dims talk over the two meshes' own groups, and it equals (as a mesh) the one-root 2-D mesh;
    layouts that form no mesh are refused."""
    rank = dist.get_rank()
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    data = world._unflatten(0, (2, 2), ("batch", "tp"), backend_override={"batch": "fake"})
    dense = world._unflatten(0, (1, 2, 2), ("dp_replicate", "fsdp", "tp"),
                             backend_override={"dp_replicate": "fake"})
    joined = dense["fsdp"].join(data["tp"])
    assert joined.mesh.tolist() == [[0, 1], [2, 3]] and joined.mesh_dim_names == ("fsdp", "tp")
    assert joined == init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    assert joined.get_group("fsdp") is dense.get_group("fsdp")
    assert joined.get_group("tp") is data.get_group("tp")
    assert dense["fsdp"].join(data["tp"]) is joined  # cached
    x = torch.randn(6, 5)
    d = distribute_tensor(x, joined, [Shard(0), Shard(1)])
    assert torch.equal(d.full_tensor(), x)
    assert joined.get_coordinate() == [rank // 2, rank % 2]
    with pytest.raises(ValueError, match="do not form one mesh"):
        dense["tp"].join(data["tp"])  # the same ranks twice


@distributed(world_size=4)
def test_init_device_mesh_backend_override_errors():
    names = ("dp", "tp")
    cases = [
        ({2: "gloo"}, r"key 2 is not a mesh dim of a 2-D mesh"),
        ({"pp": "gloo"}, r"names mesh dim 'pp', which is not one of the mesh_dim_names"),
        ({0: ("gloo", None, 5)}, r"has 3 entries; a tuple must be \(backend, options\)"),
        ({"tp": "nccl"}, r"asks for backend 'nccl'; on 'cpu' meshes here the backends are "
                         r"\['gloo', 'fake'\]"),
        ({0: "gloo", "dp": "gloo"}, r"gives mesh dim 'dp' twice"),
        ({1: ("gloo", 3)}, r"options must be a torch Backend.Options, got int"),
        (["gloo", "gloo"], r"backend_override must be a dict"),
    ]
    for override, message in cases:
        with pytest.raises(ValueError, match=message):
            init_device_mesh("cpu", (2, 2), mesh_dim_names=names, backend_override=override)
    with pytest.raises(ValueError, match=r"'tp', which is not one of the mesh_dim_names \[0, 1\]"):
        init_device_mesh("cpu", (2, 2), backend_override={"tp": "gloo"})
    # nothing was left half-made: a mesh still builds and works
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names, backend_override={"dp": "gloo"})
    x = torch.randn(4, 4)
    assert torch.equal(distribute_tensor(x, mesh, [Shard(0), Shard(1)]).full_tensor(), x)
