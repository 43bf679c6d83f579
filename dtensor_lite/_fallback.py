"""Running an op on whole tensors: the fallback for ops without a sharding rule.

An op whose DTensor inputs are all ``Replicate()`` needs no rule: every rank holds the whole
tensors, so the op runs on the local tensors as they are -- no communication, results are
``Replicate()``, a view aliases its input, an in-place write lands in the DTensor itself.

With sharded or Partial inputs, the inputs are first redistributed to ``Replicate()`` (Partial
ones reduced), then the same happens. That is always correct and often expensive, so it warns
once per (op, input placements) with a :class:`~dtensor_lite.debug.FallbackRedistributeWarning`
naming the bytes moved, and an active
:class:`~dtensor_lite.debug.ExplicitRedistributionContext` refuses it. A write into an input
that had to be gathered lands in the gathered copy; it is written back by re-sharding the new
whole value into the DTensor's own placements (free: each rank slices its piece), so no write
is lost. Rules whose answer is "gather, then run whole" (data-dependent output shapes) use
:func:`run_on_whole` the same way, without the warning.
"""
from __future__ import annotations

import torch

from . import debug, debug_state
from .dtensor import DTensor
from .placements import Replicate
from .redistribute import plan_redistribute, redistribute_local, run_plan
from .spec import DTensorSpec, TensorMeta

R = Replicate()

__all__ = ["replicated_targets", "gather_whole", "write_back", "wrap_whole", "wrap_replicated",
           "run_on_whole",
           "replicated_local", "replicated_run"]

def replicated_targets(dts) -> tuple:
    """Per DTensor input: None if it is already whole on every rank, else its Replicate spec."""
    out = []
    for dt in dts:
        spec = dt._spec
        if all(p.is_replicate() for p in spec.placements):
            out.append(None)
        else:
            out.append(spec.with_placements((Replicate(),) * spec.mesh.ndim))
    return tuple(out)


def gather_whole(op, dts, targets, warn: bool) -> list:
    """The whole tensor of each DTensor input (its own local tensor where ``targets[j]`` is
    None). Checks strict mode and warns (once per op and placements) before moving anything."""
    if all(t is None for t in targets):
        return [dt._local_tensor for dt in dts]
    plans = [None if t is None else plan_redistribute(dt._spec, t) for dt, t in zip(dts, targets)]
    if debug_state.EXPLICIT or warn:
        moves = [(j, dt._spec, t, plan.cost) for j, (dt, t, plan) in
                 enumerate(zip(dts, targets, plans)) if plan is not None]
        why = "no sharding rule: inputs gathered to Replicate()" if warn else \
            "inputs gathered to Replicate()"
        if debug_state.EXPLICIT:
            debug.observe_implicit_redistribute(op, moves, why)
        if warn:
            debug.warn_fallback_once((op, tuple(dt._spec.placements for dt in dts)), (
                f"dtensor_lite has no sharding rule for {op}: its DTensor inputs were "
                f"redistributed to Replicate() and the op ran on the whole tensors on every rank "
                f"({sum(m[3] for m in moves)} bytes/rank moved: {debug.describe_moves(moves)}). "
                "Correct, but neither memory nor compute is shared; register a rule with "
                "dtensor_lite.register_sharding to avoid it (warned once per op and placements)"))
    wholes = []
    for j, (dt, plan) in enumerate(zip(dts, plans)):
        if plan is None:
            wholes.append(dt._local_tensor)
            continue
        with debug_state.comm_cause(op, j):  # CommDebugMode: which input the fallback gathered
            wholes.append(_with_strides(run_plan(dt._local_tensor, plan), dt._spec.stride))
    return wholes


def _with_strides(whole: torch.Tensor, stride) -> torch.Tensor:
    """The gathered tensor laid out with the global tensor's strides, which ops that read
    strides (as_strided, as_strided_scatter) address, as they do on one process."""
    if tuple(whole.stride()) == tuple(stride) or whole.numel() <= 1:
        return whole
    try:
        out = torch.empty_strided(whole.shape, stride, dtype=whole.dtype, device=whole.device)
    except RuntimeError:  # not a layout one storage can have: keep the gathered one
        return whole
    return out.copy_(whole)


def write_back(op, dt: DTensor, whole: torch.Tensor) -> None:
    """``dt`` was gathered and the op wrote into the gathered copy ``whole``: put each rank's
    piece of the new value back into ``dt`` at its own placements (no communication)."""
    spec = dt._spec
    if tuple(whole.shape) != tuple(spec.shape) or whole.dtype != spec.dtype:
        raise RuntimeError(
            f"{op} changed the shape or dtype of a DTensor with placements "
            f"{list(spec.placements)} in place ({tuple(spec.shape)} -> {tuple(whole.shape)}); "
            "that cannot be reflected into its pieces. Redistribute it to Replicate() first, "
            "or use the out-of-place op")
    whole_spec = spec.with_placements((Replicate(),) * spec.mesh.ndim)
    dt._local_tensor.copy_(run_plan(whole, plan_redistribute(whole_spec, spec)))


def wrap_whole(out, mesh, dts=(), locals_=()):
    """Wrap the op's results on whole tensors as Replicate DTensors; a result that *is* the local
    tensor of an input (in-place / out= ops return their destination) is that input DTensor."""
    def wrap(o):
        if not isinstance(o, torch.Tensor):
            return o
        for dt, loc in zip(dts, locals_):
            if o is loc:
                return dt
        return wrap_replicated(o, mesh)
    if isinstance(out, (tuple, list)):
        return type(out)(wrap(o) for o in out)
    return wrap(out)


def _swap_all(a, it):
    if isinstance(a, DTensor):
        return next(it)
    if isinstance(a, (list, tuple)):
        return type(a)(_swap_all(x, it) for x in a)
    return a


def _collect(a, dts):
    if isinstance(a, DTensor):
        dts.append(a)
    elif isinstance(a, (list, tuple)):
        for x in a:
            _collect(x, dts)


def run_on_whole(op, args, kwargs):
    """Gather every DTensor argument, run ``op`` on the whole tensors, return Replicate results:
    for rules whose ops' output shapes depend on the data (nonzero, masked_select, unique)."""
    dts: list = []
    for a in (*args, *kwargs.values()):
        _collect(a, dts)
    locals_ = gather_whole(op, dts, replicated_targets(dts), warn=False)
    it = iter(locals_)
    largs = [_swap_all(a, it) for a in args]
    lkwargs = {k: _swap_all(v, it) for k, v in kwargs.items()}
    return wrap_whole(op(*largs, **lkwargs), dts[0]._spec.mesh)


def replicated_local(dt) -> torch.Tensor:
    """The whole global tensor of DTensor ``dt`` on this rank, as a plain tensor (no autograd:
    for use inside Decompose functions, which run below autograd)."""
    spec = dt._spec
    return redistribute_local(dt._local_tensor, dt._spec, spec.with_placements((R,) * spec.mesh.ndim))


def wrap_replicated(local: torch.Tensor, mesh):
    """A replicated DTensor whose every rank holds ``local`` (the same values everywhere)."""
    meta = TensorMeta(local.shape, tuple(local.stride()), local.dtype)
    return DTensor(local, DTensorSpec(mesh, (R,) * mesh.ndim, meta))


def replicated_run(op):
    """Gather every DTensor argument, run ``op`` on the whole tensors and return replicated
    results: for ops whose output shape depends on the data (nonzero, masked_select, unique),
    which no shard layout can describe before the data is seen."""
    def run(*args, **kwargs):
        return run_on_whole(op, args, kwargs)
    return run
