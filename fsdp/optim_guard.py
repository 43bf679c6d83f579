"""Refuse an optimizer step on parameters that ``fully_shard`` replaced.

``fully_shard`` swaps every managed ``nn.Parameter`` for a new sharded DTensor parameter (as
torch's does). An optimizer built *before* it still holds the old tensors: no gradient ever
reaches them, so its ``step()`` would update nothing that trains -- silently, in torch too.
Replaced parameters are marked here, and one global optimizer step pre-hook (installed by the
first ``fully_shard``) raises naming the parameter.

Cost for correct code: the hook scans an optimizer's parameters only when something changed since
its last scan -- a ``fully_shard`` call since, or a different number of parameter groups or
parameters -- so a step pays one dictionary look-up and a sum over its groups (~1 us).
"""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["mark_replaced"]

_MARK = "_fsdp_replaced_by"   # attribute on a replaced parameter: what replaced it
_generation = 0               # bumped by every fully_shard that replaces parameters
_hook = None
# optimizer -> (generation, parameter groups, parameters) of its last clean scan
_scanned: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()


def mark_replaced(old: torch.Tensor, description: str) -> None:
    """``old`` was replaced as ``description`` says; optimizers holding it must not step."""
    global _generation, _hook
    setattr(old, _MARK, description)
    _generation += 1
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_step)


def _check_step(optimizer, args, kwargs):
    groups = optimizer.param_groups
    key = (_generation, len(groups), sum(len(g["params"]) for g in groups))
    if _scanned.get(optimizer) == key:
        return None
    for g in groups:
        for p in g["params"]:
            replaced = getattr(p, _MARK, None)
            if replaced is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step(): it holds the parameter {replaced}, "
                    f"shape {tuple(p.shape)}, which fully_shard replaced by a sharded DTensor "
                    "parameter; stepping it would update a tensor no module uses any more. "
                    "Build the optimizer after fully_shard (from model.parameters()).")
    _scanned[optimizer] = key
    return None
