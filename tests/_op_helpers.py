"""Helpers shared by the op-rule tests: leaf DTensors to differentiate, and weights laid out
like an op's outputs so gradients arrive at the placements the outputs have."""
from dtensor_lite import Replicate, distribute_tensor

R = Replicate()


def leaf_and_input(x, mesh, placements):
    """A leaf DTensor (Partial replaced by Replicate) and the DTensor fed to the op."""
    base = [R if p.is_partial() else p for p in placements]
    leaf = distribute_tensor(x, mesh, base)
    if x.is_floating_point():
        leaf.requires_grad_()
    return leaf, leaf.redistribute(mesh, placements) if base != list(placements) else leaf


def like(w, out):
    """``w`` laid out like ``out`` (Partial read as Replicate), so that gradients arrive sharded
    wherever the outputs are."""
    return distribute_tensor(w, out.device_mesh,
                             [R if p.is_partial() else p for p in out.placements])


def as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)
