"""DeviceMesh: an N-D array of global ranks with one process group per mesh dimension.

Groups are created once per distinct "row set" (the 1-D rows of ranks along a mesh dimension) and
shared by every mesh, slice and flattened view that uses the same rows. The cache is tied to the
default process group that was live when it was filled: after ``destroy_process_group()`` and a new
``init_process_group()`` it is dropped, so no stale group is ever reused (meshes built before the
destroy raise a clear error instead of hanging on a dead group).
"""
from __future__ import annotations

import math
import types
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as _TorchDeviceMesh

from . import _caches, _failures, _mesh_abort
from ._torch_names import backend_options, c10d_world as _C10D_WORLD, private

__all__ = ["DeviceMesh", "init_device_mesh"]


class _DimGroup:
    """The process group of one mesh dimension, seen from this rank.

    ``ranks`` are the global ranks of this rank's row, in mesh-coordinate order. torch's
    ``new_group`` numbers group members in sorted global-rank order (``group_order``: the global
    rank of each group rank, for a group the user built otherwise), so when a row is not in that
    order the collectives layer reorders chunks with ``group_rank_of_coord`` /
    ``coord_of_group_rank``. ``is_sorted``: the row is in group order (no reordering).
    """

    __slots__ = ("group", "ranks", "size", "coordinate", "group_rank_of_coord",
                 "coord_of_group_rank", "is_sorted")

    def __init__(self, group, ranks: tuple[int, ...], my_rank: int, group_order=None):
        self.group = group  # None on a rank outside a sub-world mesh (it has no row)
        self.ranks = ranks
        self.size = len(ranks)
        self.coordinate = ranks.index(my_rank) if my_rank in ranks else None
        group_order = list(group_order) if group_order is not None else sorted(ranks)
        self.is_sorted = list(ranks) == group_order
        # group rank g holds the rank group_order[g]; its mesh coordinate is ranks.index(...)
        self.group_rank_of_coord = tuple(group_order.index(r) for r in ranks)
        # the inverse: the mesh coordinate of group rank g
        self.coord_of_group_rank = tuple(ranks.index(r) for r in group_order)


class _GroupCache:
    """Process groups keyed by their full row set; dropped whenever the default group changes."""

    def __init__(self):
        self._owner = None  # the default ProcessGroup the cached groups belong to (strong ref)
        self._groups: dict[tuple, object] = {}

    def _check_owner(self):
        default = dist.distributed_c10d._get_default_group()
        if default is not self._owner:
            self._owner = default
            self._groups = {}
            from .collectives import NO_COMM_GROUPS
            NO_COMM_GROUPS.clear()  # the old world's fake groups died with it
            _caches.clear_all()  # decisions cached for the old groups must not outlive them
        return default

    def owner(self):
        return self._check_owner()

    def group_for_rows(self, rows: tuple[tuple[int, ...], ...], world_size: int,
                       backend_override: tuple | None = None):
        """Return this rank's group among ``rows``; every rank must call this with the same rows.

        ``backend_override``: ``(backend, options)`` from init_device_mesh; such groups are
        made with them and cached apart from the default-backend groups of the same rows."""
        default = self._check_owner()
        key = rows if backend_override is None else (rows, backend_override)
        if key in self._groups:
            return self._groups[key]
        if backend_override is None and len(rows) == 1 and len(rows[0]) == world_size:
            group = default  # the whole world: no new group needed
        else:
            backend, options = backend_override or (None, None)
            no_comm = backend == "fake" and _register_fake_backend() != "fake"
            my_rank = dist.get_rank()
            timeout = default_group_timeout()
            group = None
            for row in rows:  # new_group is collective: every rank creates every row's group
                g = dist.new_group(sorted(row), timeout=timeout, backend=backend,
                                   pg_options=options)
                if my_rank in row:
                    group = g
            if no_comm and group is not None and len(next(r for r in rows if my_rank in r)) > 1:
                from .collectives import NO_COMM_GROUPS
                NO_COMM_GROUPS[group] = next(r for r in rows if my_rank in r)
        self._groups[key] = group
        return group

    def forget(self, is_dead) -> None:
        """Drop the cached groups ``is_dead(group)`` says are gone (``DeviceMesh.abort``)."""
        self._groups = {k: g for k, g in self._groups.items() if g is None or not is_dead(g)}


_GROUPS = _GroupCache()


def _register_fake_backend() -> str:
    """Make torch's ``"fake"`` backend known to ``new_group`` (torch registers it only when
    ``torch.testing._internal.distributed.fake_pg`` is imported; torchtitan's ``ParallelDims``
    asks for it for mesh dims it never communicates over) and return the default group's backend.

    A ``"fake"`` group is torch's ``FakeProcessGroup``: every collective on it returns at once
    without moving a byte. On a real world that silently gives wrong values, so where such a dim
    has more than one rank, ``collectives.py`` refuses to communicate over it (``NO_COMM_GROUPS``)
    instead; a dim of size 1 never communicates anyway. In a world that is itself fake (the dry
    run, plan/fake_world.py) every group is fake and nothing is refused."""
    if "FAKE" not in dist.Backend._plugins:
        private("torch.testing._internal.distributed.fake_pg")  # importing it registers "fake"
    return str(dist.get_backend()).lower()


def drop_stale_groups() -> None:
    """After ``destroy_process_group`` + ``init_process_group``: drop every cache built on the
    old default group (process groups, meshes' groups), so what is built next uses the new one."""
    _GROUPS.owner()


def default_group_timeout():
    """The timeout the user gave ``init_process_group`` (None if the backend does not say).

    ``new_group`` without ``timeout=`` takes c10d's backend default (30 minutes), not the default
    group's: a rank left alone in a mesh-dim collective would wait half an hour instead of the
    user's ``timeout=``. Every group we create passes this on.
    """
    default = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            backend = default._get_backend(torch.device(device))
        except RuntimeError:  # no backend for this device type
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if timeout is not None:
            return timeout
    return None


def _require_initialized(what: str):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs torch.distributed to be initialised: call "
            "torch.distributed.init_process_group('gloo') (CPU) or ('nccl') (CUDA) first, "
            "or launch with torchrun.")


class _MeshScopeMethod:
    """A method of DeviceMesh's context-manager protocol held as a descriptor, not a plain
    function, so Dynamo does not take the mesh for a generic context manager (see
    ``DeviceMesh.__class__``). ``with`` binds it through ``__get__`` as it would a function."""

    def __init__(self, fn):
        self._fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, mesh, owner=None):
        return self if mesh is None else types.MethodType(self._fn, mesh)


def _live_default_group():
    """The default process group now, or None (a torch that does not name its world object)."""
    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


class DeviceMesh:
    """An N-D array of global ranks, one process group per dimension.

    Example::

        >>> mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        >>> mesh["tp"].size(), mesh.get_coordinate()
        (2, [0, 1])        # on rank 1
    """

    def __init__(self, device_type: str, mesh, *, mesh_dim_names: Sequence[str] | None = None,
                 _root: "DeviceMesh | None" = None, _root_dims: tuple | None = None,
                 _given_groups: dict | None = None, _backend_overrides: dict | None = None):
        _require_initialized("DeviceMesh")
        if _root is None:
            mesh_tensor = _validate_mesh(mesh)
            self._root = self
            self._root_mesh = mesh_tensor
            self._root_dims = tuple((d,) for d in range(mesh_tensor.ndim))
            self._flat_names: dict[str, tuple[int, ...]] = {}
            # from_group: {(root dim,): (the user's group, its ranks in group-rank order)}. Held
            # by the root mesh only (its slices use them too), never by the shared cache: the
            # user's groups die with this mesh, and other meshes keep the cache's groups
            self._given_groups = dict(_given_groups or {})
            # init_device_mesh(backend_override=): {(root dim,): (backend, options)}
            self._backend_overrides = dict(_backend_overrides or {})
            # an exception that ends this process is posted, so the other ranks stop at their next
            # collective naming it (by default: torchrun / torchtitan mains let it escape)
            _failures.install_excepthook()
            # built by every rank of the world (the constructor, init_device_mesh), so the groups
            # of a mesh over part of the world can be made collectively; from_group meshes are
            # built by their members only
            self._built_by_all = not self._given_groups
            # every process group this root and its slices / flattened views talk over, and
            # whether abort() ended them (see _mesh_abort.py)
            self._used_groups: list = []
            self._aborted = False
            _mesh_abort.note_root(self)
        else:
            _root._check_alive()  # a slice of a dead mesh must not quietly get the new groups
            self._root = _root
            self._root_mesh = _root._root_mesh
            self._root_dims = _root_dims
        self.device_type = _validate_device_type(device_type)
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        self._pg_owner = _GROUPS.owner()
        root_mesh = self._root_mesh
        names = _validate_names(mesh_dim_names, len(self._root_dims))
        self.mesh_dim_names = names
        self.mesh = self._compute_mesh_tensor()
        self._shape = tuple(self.mesh.shape)
        self.ndim = len(self._shape)
        # A mesh may cover part of the world (as torch's): every rank of the world builds it, and
        # ranks outside it get no coordinate, hold empty pieces and take part in nothing
        self._coordinate = self._compute_coordinate()
        self._dim_groups = [self._make_dim_group(d) for d in range(self.ndim)]
        self._hash = hash((self.device_type, tuple(self.mesh.flatten().tolist()), self._shape, names))

    # ----------------------------------------------------------------- construction helpers
    def _root_coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate in the root mesh; a rank outside it sees the slices through
        the root's first ranks (its own coordinate in them is None)."""
        idx = (self._root_mesh == self._rank).nonzero()
        if idx.numel() == 0:
            return (0,) * self._root_mesh.ndim
        return tuple(int(i) for i in idx[0])

    def _is_member(self) -> bool:
        """Whether this rank is part of the mesh (torch: ``_is_current_rank_part_of_mesh``)."""
        return self._coordinate is not None

    def _permuted_root(self):
        """Root mesh permuted so the dims of this mesh come last, in order, then flattened."""
        mine = [d for dims in self._root_dims for d in dims]
        others = [d for d in range(self._root_mesh.ndim) if d not in mine]
        return self._root_mesh.permute(*others, *mine), others, mine

    def _compute_mesh_tensor(self) -> torch.Tensor:
        if self._root is self:
            return self._root_mesh
        permuted, others, _ = self._permuted_root()
        coord = self._root_coordinate()
        sub = permuted[tuple(coord[d] for d in others)] if others else permuted
        shape = [math.prod(self._root_mesh.shape[d] for d in dims) for dims in self._root_dims]
        return sub.reshape(shape)

    def _compute_coordinate(self) -> list[int] | None:
        idx = (self.mesh == self._rank).nonzero()
        if idx.numel() == 0:
            return None
        return [int(i) for i in idx[0]]

    def _make_dim_group(self, dim: int) -> _DimGroup:
        root_dims = self._root_dims[dim]
        others = [d for d in range(self._root_mesh.ndim) if d not in root_dims]
        rows_tensor = self._root_mesh.permute(*others, *root_dims).reshape(
            -1, math.prod(self._root_mesh.shape[d] for d in root_dims))
        rows = tuple(tuple(int(r) for r in row) for row in rows_tensor.tolist())
        # a rank outside the mesh has no row: it sees the first (and is no member of its group)
        my_row = next((row for row in rows if self._rank in row), rows[0])
        given = self._root._given_groups.get(root_dims)
        if given is not None:
            if not any(g is given[0] for g in self._root._used_groups):
                self._root._used_groups.append(given[0])
            return _DimGroup(given[0], my_row, self._rank, given[1])
        if self._root_mesh.numel() != self._world_size and not self._root._built_by_all:
            # a new group is made by every rank of the world, and ranks outside a sub-world mesh
            # never get here: they would leave the members waiting in new_group
            raise ValueError(
                f"{self._root!r} (from DeviceMesh.from_group) covers {self._root_mesh.numel()} of "
                f"{self._world_size} ranks, so it has no process group for mesh dims "
                f"{list(root_dims)} joined together; build such groups with dist.new_group on "
                "every rank and pass them to DeviceMesh.from_group")
        group = _GROUPS.group_for_rows(rows, self._world_size,
                                       self._root._backend_overrides.get(root_dims))
        if self._rank not in my_row:
            group = None  # new_group hands non-members a placeholder: never talk over it
        if group is not None and not any(g is group for g in self._root._used_groups):
            self._root._used_groups.append(group)
        return _DimGroup(group, my_row, self._rank)

    @classmethod
    def from_group(cls, group, device_type: str, mesh=None, *,
                   mesh_dim_names: Sequence[str] | None = None) -> "DeviceMesh":
        """A mesh whose dims talk over process groups the caller already has (torch's
        signature). One group: a 1-D mesh over its ranks (``mesh`` defaults to them in
        group-rank order). A list of groups: ``mesh`` (global ranks, one tensor dim per group)
        is required, and group ``d`` must hold exactly this rank's row along mesh dim ``d``.
        Not collective: only the mesh's members call it, and no group is created. The groups
        are kept by this mesh (and its slices), not shared with other meshes; like every mesh,
        it fails clearly after ``destroy_process_group``.

        Example::

            >>> g = dist.new_group([0, 1, 2, 3])           # a 4-rank world, on every rank
            >>> mesh = DeviceMesh.from_group(g, "cpu")     # 1-D; its collectives run on g
            >>> rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes all
            >>> cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            >>> mesh2d = DeviceMesh.from_group([cols[rank % 2], rows[rank // 2]], "cpu",
            ...                                mesh=[[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        """
        _require_initialized("DeviceMesh.from_group")
        groups = list(group) if isinstance(group, (list, tuple)) else [group]
        if not groups:
            raise ValueError("DeviceMesh.from_group needs a ProcessGroup or a non-empty list of "
                             "them, got an empty list")
        for d, g in enumerate(groups):
            if not isinstance(g, dist.ProcessGroup):
                raise TypeError(f"DeviceMesh.from_group: group {d} is a {type(g).__name__}, not a "
                                "ProcessGroup (this rank is not a member of a group it was not "
                                "in when dist.new_group made it: call from_group on members only)")
        group_ranks = [tuple(dist.get_process_group_ranks(g)) for g in groups]
        if mesh is None:
            if len(groups) > 1:
                raise ValueError(
                    f"DeviceMesh.from_group with {len(groups)} groups needs mesh= (the global "
                    "ranks, one tensor dim per group) to say how they form the mesh")
            mesh = list(group_ranks[0])
        mesh_tensor = _validate_mesh(mesh)
        if mesh_tensor.ndim != len(groups):
            raise ValueError(f"DeviceMesh.from_group: {len(groups)} group(s) for a "
                             f"{mesh_tensor.ndim}-D mesh {mesh_tensor.tolist()}; pass one group "
                             "per mesh dim")
        me = dist.get_rank()
        where = (mesh_tensor == me).nonzero()
        if where.numel() == 0:
            raise ValueError(f"DeviceMesh.from_group: rank {me} is not in the mesh "
                             f"{mesh_tensor.tolist()}; only the mesh's ranks may build it")
        coord = [int(i) for i in where[0]]
        for d, ranks in enumerate(group_ranks):
            index = list(coord)
            index[d] = slice(None)
            row = mesh_tensor[tuple(index)].tolist()
            if sorted(row) != sorted(ranks):
                raise ValueError(
                    f"DeviceMesh.from_group: group {d} holds ranks {list(ranks)} but rank {me}'s "
                    f"row along mesh dim {d} of {mesh_tensor.tolist()} is {row}; group d must "
                    "hold exactly the ranks that differ from this rank only in mesh dim d")
        given = {(d,): (g, ranks) for d, (g, ranks) in enumerate(zip(groups, group_ranks))}
        return cls(device_type, mesh_tensor, mesh_dim_names=mesh_dim_names,
                   _given_groups=given)

    # ----------------------------------------------------------------- public API
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def size(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None:
            return self.mesh.numel()
        return self._shape[self._dim_index(mesh_dim)]

    def get_rank(self) -> int:
        return self._rank

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        if self._coordinate is None:
            raise RuntimeError(f"get_local_rank(): rank {self._rank} is not part of {self!r} "
                               "(get_coordinate() is None); check get_coordinate() first")
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_local_rank() needs mesh_dim on a {self.ndim}-D mesh "
                                 f"(dims: {self._dim_labels()})")
            mesh_dim = 0
        return self._coordinate[self._dim_index(mesh_dim)]

    def get_coordinate(self) -> list[int] | None:
        """This rank's index along each mesh dim; None on a rank outside the mesh."""
        return None if self._coordinate is None else list(self._coordinate)

    def get_group(self, mesh_dim: int | str | None = None):
        self._check_alive()
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_group() needs mesh_dim on a {self.ndim}-D mesh "
                                 f"(dims: {self._dim_labels()})")
            mesh_dim = 0
        return self._dim_groups[self._dim_index(mesh_dim)].group

    def get_all_groups(self) -> list:
        self._check_alive()
        return [g.group for g in self._dim_groups]

    def dim_group(self, mesh_dim: int) -> _DimGroup:
        """The process group of mesh dim ``mesh_dim`` with its coordinate bookkeeping (global
        ranks in group order, this rank's position): what ``collectives.py`` issues on."""
        # compare with the *live* default group: _GROUPS._owner only moves when a mesh is built,
        # so after destroy + init it would still match this mesh's dead groups
        # (one attribute read where torch names its world object; None there when uninitialised,
        # which no mesh's owner is)
        if self._root._aborted or self._pg_owner is not (
                _C10D_WORLD.default_pg if _C10D_WORLD is not None else _live_default_group()):
            self._check_alive()
        return self._dim_groups[mesh_dim]

    def abort(self) -> None:
        """Abort every process group of this mesh (its dims, slices and flattened dims): for a
        rank whose peers left or hang, so it can stop instead of waiting. Call it on the root
        mesh (the one ``init_device_mesh`` / the constructor returned); a slice raises
        ``RuntimeError``, as in torch. Not collective; no group is created.

        Afterwards this mesh, its slices, and every other mesh over the same process groups
        raise a clear ``RuntimeError`` when used; a mesh built later gets new groups. A mesh
        whose dim is the whole world uses the default group: that is aborted too (as torch's
        ``abort``), so re-initialise with ``destroy_process_group()`` +
        ``init_process_group()`` before building another.

        Example::

            >>> mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
            >>> try:
            ...     train_step()
            ... except DistributedError:        # a peer is gone
            ...     mesh.abort()
        """
        _mesh_abort.abort(self, _GROUPS)

    def _check_alive(self):
        if self._root._aborted:
            raise RuntimeError(
                f"{self!r}: its process groups were aborted (DeviceMesh.abort()); build a new "
                "DeviceMesh (after destroy_process_group() / init_process_group() if the default "
                "group was among them)")
        if not dist.is_initialized() or self._pg_owner is not _GROUPS.owner():
            raise RuntimeError(
                f"{self!r} was built on a process group that has since been destroyed "
                "(destroy_process_group / init_process_group); build a new DeviceMesh "
                "after re-initialising torch.distributed")

    def __getitem__(self, names) -> "DeviceMesh":
        if isinstance(names, str):
            names = (names,)
        if not isinstance(names, tuple) or not names or not all(isinstance(n, str) for n in names):
            raise TypeError(f"slice a DeviceMesh by dim names, e.g. mesh['tp'] or mesh['dp', 'tp']; "
                            f"got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate mesh dim names in slice {names}")
        root_dims = tuple(self._resolve_name(n) for n in names)
        if root_dims == self._root_dims and names == self.mesh_dim_names:
            return self
        return DeviceMesh(self.device_type, None, mesh_dim_names=names, _root=self._root,
                          _root_dims=root_dims)

    def _resolve_name(self, name: str) -> tuple[int, ...]:
        if self.mesh_dim_names and name in self.mesh_dim_names:
            return self._root_dims[self.mesh_dim_names.index(name)]
        flat = self._root._flat_names.get(name)
        mine = {d for dims in self._root_dims for d in dims}
        if flat is not None and set(flat) <= mine:
            return flat
        known = list(self.mesh_dim_names or ()) + [
            n for n, dims in self._root._flat_names.items() if set(dims) <= mine]
        raise KeyError(f"mesh dim name {name!r} not found in DeviceMesh; available: {known}")

    def flat_view(self) -> "DeviceMesh":
        """A 1-D view over every rank of this mesh (mesh order), without naming a new dim."""
        if self.ndim == 1:
            return self
        dims = tuple(d for ds in self._root_dims for d in ds)
        return DeviceMesh(self.device_type, None, _root=self._root, _root_dims=(dims,))

    def _flatten(self, mesh_dim_name: str | None = None) -> "DeviceMesh":
        """Merge all dims of this mesh into one named dim; the root mesh learns the new name."""
        root_dims = tuple(d for dims in self._root_dims for d in dims)
        if mesh_dim_name is None:
            mesh_dim_name = "_".join(self.mesh_dim_names) if self.mesh_dim_names else "flat"
        if not isinstance(mesh_dim_name, str):
            raise TypeError(f"flattened mesh dim name must be a str, got {mesh_dim_name!r}")
        root = self._root
        existing = root._flat_names.get(mesh_dim_name)
        if (root.mesh_dim_names and mesh_dim_name in root.mesh_dim_names) or (
                existing is not None and existing != root_dims):
            raise ValueError(f"mesh dim name {mesh_dim_name!r} already names another dimension of "
                             f"{root!r}; pick a new name for the flattened dim")
        root._flat_names[mesh_dim_name] = root_dims
        return DeviceMesh(self.device_type, None, mesh_dim_names=(mesh_dim_name,), _root=root,
                          _root_dims=(root_dims,))

    def flatten(self, mesh_dim_name: str | None = None) -> "DeviceMesh":
        """Public spelling of ``_flatten``: one dim spanning all of this mesh's dims.

        Example::

            >>> dp = mesh["dp_replicate", "dp_shard"].flatten("dp")   # now mesh["dp"] works too
        """
        return self._flatten(mesh_dim_name)

    def _unflatten(self, dim: int | str, mesh_sizes: Sequence[int], mesh_dim_names: Sequence[str],
                   backend_override=None) -> "DeviceMesh":
        """Split dim ``dim`` into ``len(mesh_sizes)`` dims named ``mesh_dim_names`` (torch's spelling
        and signature). Collective: every rank calls it with the same arguments.

        The result is a new mesh whose other dims are this mesh's; its ranks along the split dim
        are this dim's ranks in order, reshaped (row-major) to ``mesh_sizes``. Like torch, the
        original mesh does not learn the new names: slice the returned mesh. Groups already
        built for the same rows are reused, so unflattening twice costs no new groups.
        ``backend_override``: as ``init_device_mesh``'s, keyed by the new dims (index into
        ``mesh_sizes`` or name); the other dims keep this mesh's overrides.

        Example::

            >>> world = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
            >>> mesh = world._unflatten(0, (2, 2, 2), ("dp_replicate", "dp_shard", "tp"))
            >>> mesh["dp_shard", "tp"].shape
            (2, 2)
        """
        i = self._unflatten_dim(dim)
        sizes, names = _validate_unflatten(self, i, mesh_sizes, mesh_dim_names)
        # keys name the new dims (index into mesh_sizes, or a name), as init_device_mesh's do
        new_overrides = _backend_overrides(backend_override, len(sizes), names, self.device_type)
        root = self._root
        split = self._root_dims[i]
        others = [d for d in range(root._root_mesh.ndim) if d not in split]
        # the new root keeps every other root dim and replaces the split dim's root dims (in the
        # order this mesh walks them) by the new sizes
        outer_shape = [root._root_mesh.shape[d] for d in others]
        new_root_tensor = root._root_mesh.permute(*others, *split).reshape(*outer_shape, *sizes)
        where = {d: k for k, d in enumerate(others)}
        overrides = {(where[d],): v for (d,), v in root._backend_overrides.items() if d in where}
        overrides.update({(len(others) + k,): v for (k,), v in new_overrides.items()})
        new_root = DeviceMesh(self.device_type, new_root_tensor,
                              mesh_dim_names=_unflatten_root_names(root, self, others, names),
                              _backend_overrides=overrides)
        # the mesh the world was first built as: join() relates meshes unflattened from it
        new_root._unflattened_from = root.__dict__.get("_unflattened_from", root)
        for flat_name, dims in root._flat_names.items():
            if all(d in where for d in dims):
                new_root._flat_names[flat_name] = tuple(where[d] for d in dims)
        new_dims = tuple((len(others) + k,) for k in range(len(sizes)))
        root_dims = (tuple(tuple(where[d] for d in ds) for ds in self._root_dims[:i]) + new_dims
                     + tuple(tuple(where[d] for d in ds) for ds in self._root_dims[i + 1:]))
        kept = self.mesh_dim_names or ()
        res_names = tuple(kept[:i]) + names + tuple(kept[i + 1:])
        return DeviceMesh(self.device_type, None, mesh_dim_names=res_names, _root=new_root,
                          _root_dims=root_dims)

    def unflatten(self, dim: int | str, mesh_sizes: Sequence[int],
                  mesh_dim_names: Sequence[str], backend_override=None) -> "DeviceMesh":
        """Public spelling of ``_unflatten``: split one dim into several named dims.

        Example::

            >>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
            >>> mesh2d = mesh.unflatten("world", (2, 2), ("dp", "tp"))   # [[0, 1], [2, 3]]
        """
        return self._unflatten(dim, mesh_sizes, mesh_dim_names, backend_override)

    def _unflatten_dim(self, dim) -> int:
        if isinstance(dim, str):
            if not self.mesh_dim_names or dim not in self.mesh_dim_names:
                raise ValueError(f"unflatten: dim {dim!r} is not a dim of {self!r} (dims: "
                                 f"{self._dim_labels()})")
            return self.mesh_dim_names.index(dim)
        if isinstance(dim, bool) or not isinstance(dim, int) or not -self.ndim <= dim < self.ndim:
            raise ValueError(f"unflatten: dim {dim!r} is out of range for a {self.ndim}-D mesh")
        return dim % self.ndim

    def to_torch(self):
        """This mesh as a ``torch.distributed.device_mesh.DeviceMesh`` over the *same* process
        groups (no group is created; not collective), for torch APIs that need torch's class
        itself rather than what its functional collectives read (those take our mesh, or
        ``(mesh, dim)``, as is)::

            >>> torch_mesh = mesh["tp"].to_torch()

        As with torch's own meshes, collectives order ranks by group rank (sorted global ranks).
        Unnamed N-D meshes get the names ``dim0, dim1, ...`` there. Cached per mesh.
        """
        groups = self.get_all_groups()  # raises for a mesh of a destroyed process group
        cached = self.__dict__.get("_torch_mesh")
        if cached is not None:
            return cached
        from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
        if self.ndim == 1:
            torch_mesh = TorchDeviceMesh.from_group(groups[0], self.device_type,
                                                    mesh_dim_names=self.mesh_dim_names)
        else:
            names = self.mesh_dim_names or tuple(f"dim{d}" for d in range(self.ndim))
            torch_mesh = TorchDeviceMesh.from_group(groups, self.device_type, mesh=self.mesh,
                                                    mesh_dim_names=names)
        self.__dict__["_torch_mesh"] = torch_mesh  # dies with this mesh (and its groups)
        return torch_mesh

    # ------------------------------------------------------ what torch's own code asks of a mesh
    def _enter(self) -> "DeviceMesh":
        """``with mesh:`` (torch's): inside, calls given no ``device_mesh`` use this mesh
        (``distribute_tensor``, ``DTensor.from_local``, the factories, ``distribute_module``,
        ``parallelize_module``). Nests; the innermost wins."""
        _CURRENT_MESHES.append(self)
        return self

    def _exit(self, *exc) -> None:
        _CURRENT_MESHES.pop()

    # ``with mesh:`` through descriptors rather than plain functions: see ``__class__`` below
    __enter__ = _MeshScopeMethod(_enter)
    __exit__ = _MeshScopeMethod(_exit)

    @property
    def __class__(self):
        # torch's functional collectives (torch.distributed._functional_collectives, which
        # third-party utilities such as torchtitan's dist_sum call with a mesh) accept a group
        # only if ``isinstance(group, torch's DeviceMesh)``, and torch offers no registration
        # for other mesh types. isinstance consults ``__class__`` after ``type()`` (the
        # mechanism unittest.mock's spec objects use), so reporting torch's class there makes
        # this mesh pass those checks while ``type(mesh)`` -- and every method -- stays ours;
        # what funcol then reads of it is ``ndim``, ``get_group`` and ``_dim_group_names``.
        #
        # Under torch.compile that answer must not reach Dynamo, which wraps an object as a
        # "generic context manager" when its class's ``__enter__``/``__exit__`` are plain Python
        # functions, takes that variable's type from ``obj.__class__`` and asserts it is
        # ``type(obj)`` (torch 2.15: "Expected type <...torch...DeviceMesh>, got <...our
        # DeviceMesh>"). Dynamo wraps any other object as a plain user-defined object keyed by
        # ``type(obj)`` -- the mesh's own class, whose methods are ours -- and documents that
        # a class whose ``__enter__``/``__exit__`` are not plain functions (C slots,
        # descriptors) takes that route and graph-breaks on ``with`` instead. So ``__enter__``
        # and ``__exit__`` are descriptors (``_MeshScopeMethod``): ``with mesh:`` is unchanged
        # in eager, and inside a compiled function it runs eagerly at a graph break, as it
        # already did on torch 2.13.
        #
        # Why not the alternatives: a real subclass of torch's DeviceMesh would inherit every
        # torch method and property our class does not override (each reading torch-private
        # state that this mesh does not have, and which changes per release: ``mesh``,
        # ``shape`` are read-only properties there), and torch 2.15 registers its DeviceMesh,
        # subclasses included, as an opaque object for torch.compile whose guards read those
        # private fields (``_layout``, ``_flatten_rank_map``) -- and only once
        # torch.distributed.tensor has been imported, so how Dynamo treated our mesh would
        # depend on another library's imports. Dynamo has no public registration for "treat
        # this class as a plain object of type X".
        return _TorchDeviceMesh

    @property
    def _dim_group_names(self) -> list[str]:
        """Each dim's process group name (torch's attribute, read by functional collectives)."""
        return [group.group_name for group in self.get_all_groups()]

    @property
    def root_layout(self) -> torch.Tensor:
        """The rank layout of the mesh this one was sliced from (itself for a root mesh): a
        sub-mesh's ``mesh`` lists only this rank's slice, the root layout every rank's."""
        return self._root_mesh

    @property
    def root_dims(self) -> tuple[tuple[int, ...], ...]:
        """For each dim of this mesh, the dims of :attr:`root_layout` it spans (several for a
        flattened dim)."""
        return self._root_dims

    def join(self, other: "DeviceMesh") -> "DeviceMesh":
        """This mesh's dims followed by ``other``'s, as one mesh (both sliced from one root).

        What FSDP on top of TP needs: the data-parallel sub-mesh and the TP sub-mesh become the
        2-D / 3-D mesh a parameter's DTensor lives on. Cached on the root (one object per
        joined layout, so the specs built on it share dispatch decisions); the root dies with
        its process groups, and the cache with it.
        """
        if not isinstance(other, DeviceMesh):
            raise TypeError(f"can only join a DeviceMesh, got {type(other).__name__}")
        if self._root is not other._root:
            return self._join_across_roots(other)
        mine = {d for dims in self._root_dims for d in dims}
        theirs = {d for dims in other._root_dims for d in dims}
        if mine & theirs:
            raise ValueError(f"cannot join {self!r} and {other!r}: they share mesh dims")
        if self.device_type != other.device_type:
            raise ValueError(f"cannot join a '{self.device_type}' mesh with a "
                             f"'{other.device_type}' mesh")
        root_dims = self._root_dims + other._root_dims
        names = (self.mesh_dim_names + other.mesh_dim_names
                 if self.mesh_dim_names and other.mesh_dim_names else None)
        cache = self._root.__dict__.setdefault("_joined", {})
        key = (root_dims, names)
        if key not in cache:
            if root_dims == self._root._root_dims and names == self._root.mesh_dim_names:
                cache[key] = self._root
            else:
                cache[key] = DeviceMesh(self.device_type, None, mesh_dim_names=names,
                                        _root=self._root, _root_dims=root_dims)
        return cache[key]

    def _slice_through(self, rank: int):
        """The ranks of this mesh's slice (its root's other dims fixed) holding ``rank``, shaped
        as this mesh; None where ``rank`` is not in the root."""
        permuted, others, _ = self._permuted_root()
        idx = (self._root_mesh == rank).nonzero()
        if idx.numel() == 0:
            return None
        coord = idx[0].tolist()
        sub = permuted[tuple(coord[d] for d in others)] if others else permuted
        return sub.reshape(self._shape)

    def _join_across_roots(self, other: "DeviceMesh") -> "DeviceMesh":
        """``join`` of meshes from two roots unflattened from one mesh, as torchtitan's ParallelDims
        makes them (the world unflattened once into ("pp", "batch", "cp", "tp") and once into
        ("pp", "dp_replicate", "fsdp", "tp"); torch joins them by their rank layouts). The
        joined mesh is well defined when the ranks at (a, b) -- the b-th rank of the ``other``
        slice through the a-th rank of this mesh -- have this mesh's slice at ``a`` in the
        joined mesh's column ``b``, for every (a, b): then it is a mesh over this rank's slice
        whose dims talk over the two meshes' own groups (``from_group``: no group is made, so
        ranks that build other joins, pipeline stages, do not have to take part)."""
        fail = (f"cannot join {self!r} and {other!r}: they were not sliced from one mesh and "
                "their rank layouts do not form one mesh. Build one mesh over all dims "
                "(init_device_mesh('cpu', (dp, tp), mesh_dim_names=('dp', 'tp'))) and slice "
                "both from it (mesh['dp'], mesh['tp'])")
        # as torch, only meshes of one origin join (torch: one root mesh; ours: a root and the
        # roots unflattened from it); two meshes built apart are refused even where their
        # layouts happen to fit, since nothing says the user meant them as one
        origin = lambda m: m._root.__dict__.get("_unflattened_from", m._root)  # noqa: E731
        if origin(self) is not origin(other) or not (self._is_member() and other._is_member()) \
                or self.device_type != other.device_type:
            raise ValueError(fail)
        key = ("across", other._root, other._root_dims, self._root_dims,
               self.mesh_dim_names, other.mesh_dim_names)
        cache = self._root.__dict__.setdefault("_joined", {})
        if key in cache:
            return cache[key]
        mine = self.mesh
        rows = []
        for a in range(mine.numel()):
            through = other._slice_through(int(mine.view(-1)[a]))
            if through is None:
                raise ValueError(fail)
            rows.append(through.reshape(-1))
        joined = torch.stack(rows).reshape(self._shape + other._shape)
        flat = joined.reshape(mine.numel(), -1)
        for b in range(flat.shape[1]):
            for a in range(flat.shape[0]):
                mine_b = self._slice_through(int(flat[a, b]))
                if mine_b is None or not torch.equal(mine_b.reshape(-1), flat[:, b]):
                    raise ValueError(fail)
        if joined.unique().numel() != joined.numel():
            raise ValueError(fail)
        if self.mesh_dim_names and other.mesh_dim_names:
            names = self.mesh_dim_names + other.mesh_dim_names
            if len(set(names)) != len(names):
                raise ValueError(f"cannot join {self!r} and {other!r}: they share dim names")
        else:
            names = None
        groups = [self._dim_groups[d].group for d in range(self.ndim)] + \
                 [other._dim_groups[d].group for d in range(other.ndim)]
        cache[key] = DeviceMesh.from_group(groups, self.device_type, mesh=joined,
                                           mesh_dim_names=names)
        return cache[key]

    def _dim_index(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"mesh dim name {mesh_dim!r} not found; available: "
                               f"{list(self.mesh_dim_names or ())}")
            return self.mesh_dim_names.index(mesh_dim)
        if not isinstance(mesh_dim, int) or not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"mesh dim {mesh_dim!r} out of range for a {self.ndim}-D mesh")
        return mesh_dim % self.ndim

    def _dim_labels(self):
        return list(self.mesh_dim_names) if self.mesh_dim_names else list(range(self.ndim))

    def __eq__(self, other):
        if self is other:
            return True
        return (isinstance(other, DeviceMesh) and self._hash == other._hash
                and self.device_type == other.device_type and self._shape == other._shape
                and self.mesh_dim_names == other.mesh_dim_names
                and torch.equal(self.mesh, other.mesh))

    def __hash__(self):
        return self._hash

    def __reduce__(self):
        # rebuilt from ranks and names: the group cache makes this local when the groups exist
        root = self._root
        return (_rebuild_mesh, (self.device_type, root._root_mesh.tolist(), root.mesh_dim_names,
                                dict(root._flat_names), self._root_dims, self.mesh_dim_names))

    def __repr__(self):
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh('{self.device_type}', {self.mesh.tolist()}{names})"


_CURRENT_MESHES: list[DeviceMesh] = []  # ``with mesh:`` blocks, innermost last


def current_mesh() -> DeviceMesh | None:
    """The mesh of the innermost ``with mesh:`` block, or None outside every one."""
    return _CURRENT_MESHES[-1] if _CURRENT_MESHES else None


def _rebuild_mesh(device_type, root_mesh, root_names, flat_names, root_dims, names):
    root = DeviceMesh(device_type, root_mesh, mesh_dim_names=root_names)
    root._flat_names.update(flat_names)
    if root_dims == root._root_dims and names == root_names:
        return root
    return DeviceMesh(device_type, None, mesh_dim_names=names, _root=root, _root_dims=root_dims)


def _validate_unflatten(mesh: DeviceMesh, dim: int, sizes, names):
    """Check ``_unflatten``'s sizes and names against ``mesh``; return them as tuples."""
    sizes = (sizes,) if isinstance(sizes, int) else tuple(sizes)
    names = (names,) if isinstance(names, str) else tuple(names)
    if not sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                            for s in sizes):
        raise ValueError(f"unflatten: mesh_sizes must be positive ints, got {sizes}")
    if math.prod(sizes) != mesh.shape[dim]:
        raise ValueError(f"unflatten: the product of mesh_sizes {sizes} is {math.prod(sizes)} but "
                         f"dim {dim} of {mesh!r} has size {mesh.shape[dim]}; they must be equal")
    if len(names) != len(sizes):
        raise ValueError(f"unflatten: {len(names)} mesh_dim_names {names} for {len(sizes)} "
                         f"mesh_sizes {sizes}; give one name per size")
    if mesh.mesh_dim_names is None and mesh.ndim > 1:
        raise ValueError(f"unflatten needs mesh_dim_names on a {mesh.ndim}-D mesh (the result "
                         f"names every dim): build {mesh!r} with mesh_dim_names")
    kept = [n for k, n in enumerate(mesh.mesh_dim_names or ()) if k != dim]
    _validate_names(tuple(kept) + names, len(kept) + len(names))  # non-empty, unique
    return sizes, names


def _unflatten_root_names(root: DeviceMesh, mesh: DeviceMesh, others: list[int], new_names):
    """Names for the dims of an unflattened mesh's new root: the new names for the split dims;
    for each kept root dim the name ``mesh`` or the old root gives it, unless that name is taken
    (then a private one -- the caller only ever sees slices, which carry their own names)."""
    taken = set(new_names)
    names = []
    for d in others:
        candidates = [n for n, ds in zip(mesh.mesh_dim_names or (), mesh._root_dims) if ds == (d,)]
        if root.mesh_dim_names:
            candidates.append(root.mesh_dim_names[d])
        name = next((n for n in candidates if n not in taken), f"_outer{d}")
        while name in taken:
            name = "_" + name
        taken.add(name)
        names.append(name)
    return tuple(names) + tuple(new_names)


def _validate_mesh(mesh) -> torch.Tensor:
    if isinstance(mesh, torch.Tensor):
        t = mesh.detach().cpu()
    else:
        try:
            t = torch.tensor(mesh, device="cpu")  # host, whatever the default
        except Exception as e:  # ragged lists and the like
            raise ValueError(f"DeviceMesh mesh must be a rectangular array of ranks, got {mesh!r}") from e
    if t.ndim == 0 or t.numel() == 0:  # before the dtype check: torch.tensor([]) is float
        raise ValueError(f"DeviceMesh mesh must have at least one dim and one rank, got shape "
                         f"{tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"DeviceMesh mesh must hold integer ranks, got dtype {t.dtype}")
    t = t.to(torch.int64)
    world = dist.get_world_size()
    flat = t.flatten().tolist()
    if len(set(flat)) != len(flat):
        raise ValueError(f"DeviceMesh mesh has duplicate ranks: {t.tolist()}")
    bad = [r for r in flat if not 0 <= r < world]
    if bad:
        raise ValueError(f"DeviceMesh mesh has ranks {bad} outside the world [0, {world}): "
                         f"{t.tolist()}")
    return t


def _validate_names(names, ndim: int):
    if names is None:
        return None
    if isinstance(names, str):
        names = (names,)
    names = tuple(names)
    if len(names) != ndim:
        raise ValueError(f"mesh_dim_names {names} has {len(names)} names for a {ndim}-D mesh")
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"mesh_dim_names must be non-empty strings, got {names}")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh_dim_names must be unique, got {names}")
    return names


def _validate_device_type(device_type: str) -> str:
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a string such as 'cpu' or 'cuda', got {device_type!r}")
    dev = torch.device(device_type)
    if dev.index is not None:
        raise ValueError(f"device_type is a type ('cpu', 'cuda'), not a device: got {device_type!r}")
    return dev.type


def _backend_overrides(override, ndim: int, names, device_type: str) -> dict:
    """init_device_mesh's ``backend_override`` checked and normalised to
    ``{(mesh dim,): (backend or None, options or None)}`` (entries that override nothing
    dropped). Keys: a mesh dim's index or name; values: a backend name, a ``Backend.Options``,
    or a ``(backend, options)`` pair, as torch's."""
    if override is None:
        return {}
    if not isinstance(override, dict):
        raise ValueError(f"init_device_mesh: backend_override must be a dict {{mesh dim index or "
                         f"name: backend}}, got {type(override).__name__}")
    options_type = backend_options
    # "fake" (torch's FakeProcessGroup): a dim whose group never communicates, as torchtitan's
    # ParallelDims asks for size-1 and data-loading-only dims; see _register_fake_backend
    allowed = ("gloo", "nccl", "fake") if device_type == "cuda" else ("gloo", "fake")
    dims = list(names) if names else list(range(ndim))
    out: dict = {}
    for key, value in override.items():
        if isinstance(key, str):
            if not names or key not in names:
                raise ValueError(f"init_device_mesh: backend_override names mesh dim {key!r}, "
                                 f"which is not one of the mesh_dim_names {dims}")
            dim = names.index(key)
        elif isinstance(key, int) and not isinstance(key, bool) and -ndim <= key < ndim:
            dim = key % ndim
        else:
            raise ValueError(f"init_device_mesh: backend_override key {key!r} is not a mesh dim "
                             f"of a {ndim}-D mesh (use an index in [0, {ndim}) or one of {dims})")
        if (dim,) in out:
            raise ValueError(f"init_device_mesh: backend_override gives mesh dim {dims[dim]!r} "
                             "twice (by index and by name); give it once")
        if isinstance(value, (tuple, list)):
            if len(value) != 2:
                raise ValueError(
                    f"init_device_mesh: backend_override[{key!r}] = {value!r} has {len(value)} "
                    "entries; a tuple must be (backend, options)")
            backend, options = value
        elif isinstance(value, options_type):
            backend, options = None, value
        else:
            backend, options = value, None
        if backend is not None and (not isinstance(backend, str) or
                                    backend.lower() not in allowed):
            raise ValueError(
                f"init_device_mesh: backend_override[{key!r}] asks for backend {backend!r}; on "
                f"'{device_type}' meshes here the backends are {list(allowed)} (or None for the "
                "default group's)")
        if options is not None and not isinstance(options, options_type):
            raise ValueError(f"init_device_mesh: backend_override[{key!r}] options must be a "
                             f"torch Backend.Options, got {type(options).__name__}")
        out[(dim,)] = (backend.lower() if backend is not None else None, options)
    return {d: v for d, v in out.items() if v != (None, None)}


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Sequence[str] | None = None,
                     backend_override: dict | None = None) -> DeviceMesh:
    """Build a DeviceMesh of ``mesh_shape`` over ranks ``0 .. prod(mesh_shape) - 1``, in rank
    order (all ranks of the world, or the first of them: every rank calls it; the others get
    ``get_coordinate() is None``).

    ``backend_override`` (torch's): ``{mesh dim index or name: backend | options | (backend,
    options)}`` -- that dim's groups are made with ``dist.new_group(backend=, pg_options=)``,
    apart from the default-backend groups of the same ranks. On CPU gloo is the only backend.

    Example::

        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"),
        ...                         backend_override={"tp": "gloo"})
    """
    _require_initialized("init_device_mesh")
    if isinstance(mesh_shape, int):
        mesh_shape = (mesh_shape,)
    mesh_shape = tuple(mesh_shape)
    if not mesh_shape or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                                 for s in mesh_shape):
        raise ValueError(f"mesh_shape must be a non-empty tuple of positive ints, got {mesh_shape}")
    world = dist.get_world_size()
    if math.prod(mesh_shape) > world:
        raise ValueError(f"mesh_shape {mesh_shape} holds {math.prod(mesh_shape)} ranks but the world "
                         f"size is {world}; the product of the mesh shape must not exceed the "
                         "world size")
    if mesh_dim_names is not None:
        mesh_dim_names = _validate_names(mesh_dim_names, len(mesh_shape))
    device_type = _validate_device_type(device_type)
    overrides = _backend_overrides(backend_override, len(mesh_shape), mesh_dim_names, device_type)
    if device_type == "cuda" and torch.cuda.is_available():
        # one GPU per local rank unless the user already picked one
        local = int(__import__("os").environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local)
    # as torch's: ranks 0 .. prod(mesh_shape)-1; the others (if any) are outside the mesh
    mesh = torch.arange(math.prod(mesh_shape), dtype=torch.int64, device="cpu").reshape(mesh_shape)
    return DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names,
                      _backend_overrides=overrides)
