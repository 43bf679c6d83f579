"""parallelize_module: apply parallel styles to the submodules a plan names."""
from __future__ import annotations

import fnmatch
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from dtensor_lite import DeviceMesh, init_device_mesh
from dtensor_lite.device_mesh import current_mesh

from .style import ParallelStyle

__all__ = ["parallelize_module"]


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh | None = None,
                       parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
                       *, src_data_rank: int | None = 0) -> nn.Module:
    """Apply tensor-parallel styles to ``module`` (in place) and return it.

    ``parallelize_plan`` is either one style for ``module`` itself, or a dict mapping submodule
    paths to styles. A path's ``.``-separated parts are matched against child names with
    ``fnmatch`` wildcards, each part matching one level: ``"layers.*.attention.wq"`` names
    ``wq`` in every block. Entries apply in dict order. Every entry is resolved before anything
    is changed, so a path that matches nothing leaves the module untouched.

    ``device_mesh`` must be 1-D: the TP mesh (slice it out of a bigger mesh, ``mesh["tp"]``).
    Default: the mesh of the innermost ``with mesh:`` block, else all ranks in a 1-D mesh on
    the device of the module's parameters. Without a plan (``None``), nothing is changed and a
    ``UserWarning`` says so, as torch's.
    ``src_data_rank``: the rank whose full weights are scattered (``None``: every rank slices
    its own copy, no communication); the module's weights should be equal on every rank.

    Example::

        >>> tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
        >>> parallelize_module(model, tp_mesh, {
        ...     "layers.*.feed_forward.w1": ColwiseParallel(),
        ...     "layers.*.feed_forward.w2": RowwiseParallel(),
        ... })
    """
    mesh = _tp_mesh(module, device_mesh)
    if parallelize_plan is None:  # torch's answer: nothing to do (no auto-parallel), say so
        warnings.warn("No parallelize_plan is provided and auto-parallel is not supported at the "
                      "moment, so this parallelize_module call will do nothing.", stacklevel=2)
        return module
    if isinstance(parallelize_plan, ParallelStyle):
        targets = [("", "", module, parallelize_plan)]
    elif isinstance(parallelize_plan, dict):
        targets = []
        for pattern, style in parallelize_plan.items():
            if not isinstance(pattern, str) or not isinstance(style, ParallelStyle):
                raise ValueError(
                    f"parallelize_module: plan entries map a module path (str) to a style such "
                    f"as ColwiseParallel(); got {pattern!r}: {style!r}")
            matches = _match(module, pattern)
            targets += [(pattern, fqn, sub, style) for fqn, sub in matches]
    else:
        raise ValueError(
            f"parallelize_module: parallelize_plan must be a ParallelStyle or a dict of "
            f"{{module path: ParallelStyle}}, got {type(parallelize_plan).__name__}; e.g. "
            "{'layers.*.attention.wq': ColwiseParallel()}")
    for pattern, fqn, sub, style in targets:
        style.src_data_rank = src_data_rank
        try:
            style._apply(sub, mesh)
        except ValueError as e:
            where = f"submodule {fqn!r} (plan key {pattern!r})" if pattern else "the module"
            raise ValueError(f"parallelize_module: {where}: {e}") from e
    return module


def _tp_mesh(module: nn.Module, device_mesh) -> DeviceMesh:
    if device_mesh is None and current_mesh() is not None:
        device_mesh = current_mesh()
    if device_mesh is None:
        if not dist.is_initialized():
            raise ValueError("parallelize_module: no device_mesh given and torch.distributed is "
                             "not initialised; call init_process_group or pass a mesh")
        param = next(module.parameters(), None)
        device = "cuda" if param is not None and param.is_cuda else "cpu"
        return init_device_mesh(device, (dist.get_world_size(),))
    if not isinstance(device_mesh, DeviceMesh):
        raise ValueError(f"parallelize_module: device_mesh must be a DeviceMesh, got "
                         f"{type(device_mesh).__name__}")
    if device_mesh.ndim != 1:
        names = getattr(device_mesh, "mesh_dim_names", None)
        hint = f'mesh["{names[-1]}"]' if names else "a 1-D mesh over the TP ranks"
        raise ValueError(
            f"parallelize_module needs a 1-D device mesh (the tensor-parallel dimension), got a "
            f"{device_mesh.ndim}-D mesh of shape {tuple(device_mesh.shape)}; pass {hint}")
    return device_mesh


def _match(root: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """(fqn, submodule) for every submodule whose path matches ``pattern``.

    As torch's: where a module on the way has no child matching the next atom, that branch of
    the entry is skipped with torch's ``UserWarning`` (its text, naming the rest of the key, the
    atom and the module). torchtitan relies on it: one plan serves every pipeline stage, and a
    stage has deleted the modules (``norm``, ``output``, layers) other stages hold."""
    frontier = [("", root)]
    atoms = pattern.split(".")
    for i, atom in enumerate(atoms):
        nxt = []
        for fqn, mod in frontier:
            found = [(f"{fqn}.{name}" if fqn else name, child)
                     for name, child in mod.named_children() if fnmatch.fnmatchcase(name, atom)]
            if not found:
                warnings.warn(
                    f"Parallelize plan key '{'.'.join(atoms[i:])}' could not be resolved: "
                    f"no submodule matching token '{atom}' in module {mod}, "
                    f"skipping this plan entry.", stacklevel=3)
            nxt += found
        frontier = nxt
    return frontier
