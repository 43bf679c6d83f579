"""``DeviceMesh.abort`` (torch 2.15): end a mesh's process groups without a collective.

A rank whose peers died or hang calls it to stop instead of waiting. What it must do, and why:

* abort each distinct group that the root mesh, its slices and its flattened views were built
  on (the root records them as they are made: nothing is created here, since creating a group
  is a collective the absent peers would never join) -- the default group only where one of
  the mesh's own dims is the whole world, as in torch;
* forget those groups in the shared group cache, so a mesh built later gets new ones instead of
  a dead one;
* mark every root mesh that talks over one of them (ours share groups by row set), so using any
  of them raises a clear error instead of entering a collective on an aborted group.
"""
from __future__ import annotations

import weakref

import torch.distributed as dist

from . import _caches
from ._torch_names import private

__all__ = ["note_root", "abort"]

_ROOTS: list[weakref.ref] = []  # every root mesh built, for marking the ones sharing a group


def note_root(root) -> None:
    _ROOTS[:] = [r for r in _ROOTS if r() is not None]
    _ROOTS.append(weakref.ref(root))


def _names_default(root, default) -> bool:
    """Whether one of the root's own dims, or a dim flattened by name, is the default group (a
    whole-world dim): torch aborts it then. The whole-world view our redistributions use
    internally (``flat_view``) is no dim the user made, and aborting the default group for it
    would end every later use of torch.distributed in the process."""
    if any(dg.group is default for dg in root._dim_groups):
        return True
    everything = set(range(root._root_mesh.ndim))
    return root._root_mesh.numel() == dist.get_world_size() and any(
        set(dims) == everything for dims in root._flat_names.values())


def abort(mesh, group_cache) -> None:
    if mesh._root is not mesh:
        raise RuntimeError(f"abort() is not supported on a submesh ({mesh!r}); call abort() on "
                           f"the root mesh instead ({mesh._root!r}), as in torch")
    default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    groups = [g for g in mesh._used_groups if g is not default or _names_default(mesh, default)]
    # torch's own cleanup drops a group from c10d's registries; absent in a release: skipped
    cleanup = private("torch.distributed.distributed_c10d._cleanup_process_group_global_state")
    for group in groups:
        group.abort()
        if cleanup is not None and group is not default:
            # the default group stays registered, so destroy_process_group() still works
            cleanup(group)
    dead = {id(g) for g in groups}
    group_cache.forget(lambda g: id(g) in dead)
    for ref in _ROOTS:
        root = ref()
        if root is not None and (root is mesh or any(id(g) in dead for g in root._used_groups)):
            root._aborted = True
    _caches.clear_all()  # decisions cached for the aborted meshes must not outlive them
