"""Model and optimizer state dicts of DTensor-parallel models, sharded or full.

Names and semantics mirror ``torch.distributed.checkpoint.state_dict`` so a training script can
switch by changing imports:

* **sharded** (default): ``model.state_dict()`` as it is -- DTensors for distributed parameters,
  no communication -- and optimizer state keyed by parameter FQN instead of the optimizer's
  integer ids, so it does not depend on the mesh or on how parameters were grouped. This is what
  ``torch.distributed.checkpoint`` (DCP) saves and loads (resharding on load).
* **full** (``full_state_dict=True``): every DTensor becomes its ``full_tensor()``; the result
  loads into plain single-process torch. With ``cpu_offload=True`` as well, only rank 0 keeps the
  values (other ranks get ``{}``), as in PyTorch, so a large model does not land N times in host
  memory.

Loading a full state dict slices each rank's piece out of the full tensor locally (every rank has
it, so no communication); with ``broadcast_from_rank0=True`` only rank 0 needs it and the tensors
are broadcast one by one. Values are copied into the existing parameters in place, so an optimizer
and FSDP hooks that hold them keep working.

Example::

    >>> sd = get_model_state_dict(model, full_state_dict=True)      # plain tensors
    >>> set_model_state_dict(other_model, sd, full_state_dict=True) # any mesh, any placements
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from . import collectives as C
from .dtensor import DTensor, default_mesh
from .spec import local_piece

__all__ = ["StateDictOptions", "get_model_state_dict", "set_model_state_dict",
           "get_optimizer_state_dict", "set_optimizer_state_dict", "get_state_dict",
           "set_state_dict"]


@dataclasses.dataclass
class StateDictOptions:
    """How the state dict functions work (the subset of PyTorch's options that applies here).

    * ``full_state_dict``: gather DTensors into plain full tensors (get), or expect full tensors
      (set).
    * ``cpu_offload``: move tensors to the CPU; with ``full_state_dict`` only rank 0 keeps them.
    * ``ignore_frozen_params``: leave out parameters with ``requires_grad=False`` (get).
    * ``strict``: as in ``nn.Module.load_state_dict`` (set).
    * ``broadcast_from_rank0``: only rank 0 passes a (full) state dict; it is broadcast (set).

    Example::

        >>> opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        >>> sd = get_model_state_dict(model, options=opts)   # {} on ranks other than 0
    """
    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    strict: bool = True
    broadcast_from_rank0: bool = False


def _options(options: StateDictOptions | None, **given) -> StateDictOptions:
    if options is None:
        return StateDictOptions(**given)
    if not isinstance(options, StateDictOptions):
        raise TypeError(f"options must be a StateDictOptions, got {type(options).__name__}")
    default = StateDictOptions()
    clash = [k for k, v in given.items() if v != getattr(default, k) and v != getattr(options, k)]
    if clash:
        raise ValueError(f"got both options={options} and keyword arguments {clash} that "
                         "disagree with it; pass one or the other")
    return options


# ----------------------------------------------------------------------------- model
def get_model_state_dict(model: nn.Module, *, full_state_dict: bool = False,
                         cpu_offload: bool = False,
                         options: StateDictOptions | None = None) -> dict[str, Any]:
    """``model``'s state dict: DTensors as they are (sharded) or gathered (full).

    Full state dicts are collective (every rank must call); with ``cpu_offload`` only rank 0
    gets the values and the other ranks get ``{}``.

    Example::

        >>> sd = get_model_state_dict(fsdp_model)                       # DTensors, for DCP
        >>> full = get_model_state_dict(fsdp_model, full_state_dict=True)
        >>> plain_model.load_state_dict(full)                           # single-process torch
    """
    opts = _options(options, full_state_dict=full_state_dict, cpu_offload=cpu_offload)
    sd = model.state_dict()
    if opts.ignore_frozen_params:
        frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
        sd = {k: v for k, v in sd.items() if k not in frozen}
    return _export(sd, opts)


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], *,
                         full_state_dict: bool = False, broadcast_from_rank0: bool = False,
                         strict: bool = True, options: StateDictOptions | None = None):
    """Load ``model_state_dict`` into ``model``'s parameters and buffers, in place.

    Each value is brought to its target's layout: a full (plain) tensor is sliced to this rank's
    piece of a DTensor target (any placements and shard order), a DTensor on the target's mesh
    is redistributed if its placements differ, and a DTensor into a plain target is gathered.
    A plain tensor is always taken as the full value, whatever ``full_state_dict`` says. With
    ``broadcast_from_rank0`` only rank 0's state dict is read (others may pass ``{}``).

    Keys and shapes are checked first (``RuntimeError`` naming missing / unexpected keys when
    ``strict``, ``ValueError`` naming the key and both shapes), so nothing is half-loaded.
    Returns ``nn.Module.load_state_dict``'s ``(missing_keys, unexpected_keys)``.

    Example::

        >>> full = torch.load("plain_model.pt")                      # from single-process torch
        >>> set_model_state_dict(fsdp_model, full, full_state_dict=True)
    """
    opts = _options(options, full_state_dict=full_state_dict,
                    broadcast_from_rank0=broadcast_from_rank0, strict=strict)
    targets = model.state_dict(keep_vars=True)
    if opts.broadcast_from_rank0:
        model_state_dict = _skeleton_from_rank0(model_state_dict, _any_tensor(targets))
    _check_model_keys(model, targets, model_state_dict, opts.strict)
    converted = {}
    for key, value in model_state_dict.items():
        target = targets.get(key)
        converted[key] = value if target is None else _to_target(key, value, target)
    return model.load_state_dict(converted, strict=opts.strict)


def _check_model_keys(model, targets: dict, state_dict: dict, strict: bool) -> None:
    if not isinstance(state_dict, dict):
        raise TypeError(f"set_model_state_dict: expected a dict of tensors, got "
                        f"{type(state_dict).__name__}")
    missing = [k for k in targets if k not in state_dict]
    unexpected = [k for k in state_dict if k not in targets]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"set_model_state_dict into {type(model).__name__}: missing keys {missing}, "
            f"unexpected keys {unexpected} (strict=True). Check that the state dict comes from the "
            "same model architecture, or pass strict=False to load the matching keys only")
    for key, value in state_dict.items():
        if key in targets:
            _check_shape(key, value, targets[key])


def _check_shape(what: str, value, target) -> None:
    if torch.is_tensor(target) and hasattr(value, "shape") and \
            tuple(value.shape) != tuple(target.shape):
        raise ValueError(
            f"{what}: the state dict holds shape {tuple(value.shape)} but the target has global "
            f"shape {tuple(target.shape)}; a state dict of another model configuration cannot "
            "be loaded")


# ----------------------------------------------------------------------------- optimizer
def get_optimizer_state_dict(model: nn.Module, optimizers, *, full_state_dict: bool = False,
                             cpu_offload: bool = False,
                             options: StateDictOptions | None = None) -> dict[str, Any]:
    """The optimizer's state dict keyed by parameter FQN (as PyTorch's helper does)::

        {"state": {"layers.0.w.weight": {"step": tensor(3.), "exp_avg": DTensor, ...}, ...},
         "param_groups": [{"lr": 0.01, ..., "params": ["layers.0.w.weight", ...]}]}

    An optimizer that has not stepped yet gets its state created first (one step with zero
    gradients and lr 0, as PyTorch does), so the result can be the target of a DCP load.
    ``optimizers`` may be one optimizer or several (their states are merged).

    Example::

        >>> osd = get_optimizer_state_dict(model, opt)                   # DTensor moments
        >>> full = get_optimizer_state_dict(model, opt, full_state_dict=True)
    """
    opts = _options(options, full_state_dict=full_state_dict, cpu_offload=cpu_offload)
    fqn_of = _fqns(model)
    out: dict[str, Any] = {"state": {}, "param_groups": []}
    for opt in _as_list(optimizers):
        _init_optim_state(opt)
        osd = opt.state_dict()
        params = _params_in_order(opt)
        for i, p in enumerate(params):
            if id(p) not in fqn_of:
                raise ValueError(f"get_optimizer_state_dict: optimizer parameter #{i} of shape "
                                 f"{tuple(p.shape)} is not a parameter of {type(model).__name__}")
        out["state"].update({fqn_of[id(params[i])]: st for i, st in osd["state"].items()})
        out["param_groups"] += [{**g, "params": [fqn_of[id(params[i])] for i in g["params"]]}
                                for g in osd["param_groups"]]
    return _export(out, opts)


def set_optimizer_state_dict(model: nn.Module, optimizers, optim_state_dict: dict[str, Any], *,
                             full_state_dict: bool = False, broadcast_from_rank0: bool = False,
                             options: StateDictOptions | None = None) -> None:
    """Load an FQN-keyed (or the optimizer's own id-keyed) state dict into ``optimizers``.

    Every tensor of the state is brought to the layout of the optimizer's own state for that
    parameter (for Adam: ``exp_avg`` / ``exp_avg_sq`` like the parameter, ``step`` plain), full
    tensors sliced locally, so state saved on any mesh -- or by plain single-process torch --
    loads on any other. With ``broadcast_from_rank0`` only rank 0's state dict is read.

    Example::

        >>> set_optimizer_state_dict(model, opt, full_osd, full_state_dict=True)
    """
    opts = _options(options, full_state_dict=full_state_dict,
                    broadcast_from_rank0=broadcast_from_rank0)
    optimizers = _as_list(optimizers)
    for opt in optimizers:
        _init_optim_state(opt)
    if opts.broadcast_from_rank0:
        like = next((p for opt in optimizers for p in _params_in_order(opt)), None)
        optim_state_dict = _skeleton_from_rank0(optim_state_dict, like)
    if not isinstance(optim_state_dict, dict) or "state" not in optim_state_dict or \
            "param_groups" not in optim_state_dict:
        got = list(optim_state_dict) if isinstance(optim_state_dict, dict) else optim_state_dict
        raise ValueError("set_optimizer_state_dict: expected {'state': ..., 'param_groups': ...} "
                         f"(from get_optimizer_state_dict), got {got!r}")
    groups = list(optim_state_dict["param_groups"])
    by_fqn = _by_fqn(model)
    for opt in optimizers:  # each takes as many groups as it has, in order
        n_groups = len(opt.param_groups)
        mine, groups = groups[:n_groups], groups[n_groups:]
        if len(mine) != n_groups:
            raise ValueError(f"set_optimizer_state_dict: the optimizer has {n_groups} param "
                             f"groups but the state dict has only {len(mine)} left for it")
        _load_optimizer(opt, mine, optim_state_dict["state"], by_fqn, type(model).__name__)


def _load_optimizer(opt, groups: list, state: dict, by_fqn: dict, model_name: str) -> None:
    """Translate FQNs (or integer ids) to this optimizer's ids, lay every state tensor out like
    the optimizer's own, and load."""
    params = _params_in_order(opt)
    index_of = {id(p): i for i, p in enumerate(params)}

    def resolve(ref):
        """(index in this optimizer, parameter, name) of an FQN or an integer id."""
        if isinstance(ref, int):
            if not 0 <= ref < len(params):
                raise ValueError(f"set_optimizer_state_dict: parameter id {ref} is out of range "
                                 f"for an optimizer of {len(params)} parameters")
            return ref, params[ref], f"parameter #{ref}"
        p = by_fqn.get(ref)
        if p is None or id(p) not in index_of:
            raise ValueError(f"set_optimizer_state_dict: {ref!r} is not a parameter of "
                             f"{model_name} handled by this optimizer")
        return index_of[id(p)], p, ref

    new_state = {}
    for ref in [r for g in groups for r in g["params"]]:
        if ref not in state:
            continue
        i, p, name = resolve(ref)
        current = opt.state.get(p, {})
        new_state[i] = {k: _to_target(f"optimizer state {k!r} of {name}", v,
                                      _state_target(current.get(k), v, p))
                        for k, v in state[ref].items()}
    new_groups = [{**g, "params": [resolve(r)[0] for r in g["params"]]} for g in groups]
    opt.load_state_dict({"state": new_state, "param_groups": new_groups})


def _state_target(current, value, param):
    """What a state value should look like: the optimizer's own value for it if it has one, else
    the parameter's layout for parameter-shaped values, else as it comes."""
    if torch.is_tensor(current):
        return current
    if hasattr(value, "shape") and tuple(value.shape) == tuple(param.shape) and value.ndim:
        return param
    return None


def _init_optim_state(opt: torch.optim.Optimizer) -> None:
    """Create the optimizer's state by one step with zero gradients and lr 0 (PyTorch's trick):
    the state tensors then exist with the parameters' layouts, ready to be loaded into."""
    if opt.state or any(p.grad is not None for g in opt.param_groups for p in g["params"]):
        return
    for g in opt.param_groups:
        for p in g["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    lrs = []
    for g in opt.param_groups:
        if "lr" in g:
            lrs.append(g["lr"])
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    opt.step()
    for g in opt.param_groups:
        if "lr" in g:
            g["lr"] = lrs.pop(0)
    opt.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------- both
def get_state_dict(model: nn.Module, optimizers, *, full_state_dict: bool = False,
                   cpu_offload: bool = False, options: StateDictOptions | None = None):
    """``(get_model_state_dict(model), get_optimizer_state_dict(model, optimizers))``.

    Example::

        >>> model_sd, optim_sd = get_state_dict(model, opt)
        >>> dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    """
    opts = _options(options, full_state_dict=full_state_dict, cpu_offload=cpu_offload)
    return (get_model_state_dict(model, options=opts),
            get_optimizer_state_dict(model, optimizers, options=opts))


def set_state_dict(model: nn.Module, optimizers, *, model_state_dict: dict[str, Any],
                   optim_state_dict: dict[str, Any], full_state_dict: bool = False,
                   broadcast_from_rank0: bool = False, strict: bool = True,
                   options: StateDictOptions | None = None):
    """``set_model_state_dict`` then ``set_optimizer_state_dict``; returns the former's result.

    Example::

        >>> model_sd, optim_sd = get_state_dict(model, opt)     # templates on the new mesh
        >>> dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        >>> set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    """
    opts = _options(options, full_state_dict=full_state_dict,
                    broadcast_from_rank0=broadcast_from_rank0, strict=strict)
    result = set_model_state_dict(model, model_state_dict, options=opts)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=opts)
    return result


# ----------------------------------------------------------------------------- helpers
def _as_list(optimizers) -> list:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    return list(optimizers)


def _fqns(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _by_fqn(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False))


def _params_in_order(opt) -> list:
    """The parameters in the order of the optimizer's own integer ids."""
    return [p for g in opt.param_groups for p in g["params"]]


def _map(tree, fn):
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(v, fn) for v in tree)
    return fn(tree)


def _export(tree, opts: StateDictOptions):
    """Gather (full) and/or move to the CPU every tensor of a state dict tree."""
    def convert(v):
        if isinstance(v, DTensor):
            if opts.full_state_dict:
                with torch.no_grad():
                    v = v.full_tensor()
            elif opts.cpu_offload and v._local_tensor.device.type != "cpu":
                return DTensor(v._local_tensor.cpu(), v._spec)
        if opts.cpu_offload and torch.is_tensor(v):
            v = v.cpu()
        return v

    out = _map(tree, convert)
    if opts.full_state_dict and opts.cpu_offload and dist.is_initialized() and \
            dist.get_rank() != 0:
        return {}  # everyone took part in the gathers; only rank 0 keeps the values
    return out


def _to_target(what: str, value, target):
    """``value`` in ``target``'s layout (a DTensor with its spec, or a plain full tensor)."""
    if isinstance(value, _Stub):
        _check_shape(what, value, target)
        value = value.receive()
    if not torch.is_tensor(value) or target is None:
        return value
    _check_shape(what, value, target)
    if isinstance(target, DTensor):
        if isinstance(value, DTensor):
            if value._spec == target._spec:
                return value
            if value.device_mesh == target.device_mesh:
                with torch.no_grad():
                    return value.redistribute(target.device_mesh, target.placements)
            with torch.no_grad():
                value = value.full_tensor()
        return _shard_like(value, target)
    if isinstance(value, DTensor):
        with torch.no_grad():
            return value.full_tensor()
    return value


def _shard_like(full: torch.Tensor, target: DTensor) -> DTensor:
    """This rank's piece of ``full`` under ``target``'s spec (shard order included); local."""
    from .factories import partialize
    spec = target._spec
    full = full.detach().to(dtype=spec.dtype, device=target._local_tensor.device)
    local = partialize(local_piece(full, spec).contiguous(), spec)
    return DTensor(local, spec)


# ----------------------------------------------------------------------------- broadcast
class _Stub:
    """Placeholder for a tensor that rank 0 will broadcast: knows its shape and dtype (so keys and
    shapes are checked on every rank before any data moves) and receives it on demand. Every rank
    walks the same skeleton in the same order, so the broadcasts pair up."""

    def __init__(self, shape, dtype, value, mesh):
        self.shape, self.dtype, self._value, self._mesh = torch.Size(shape), dtype, value, mesh
        self.ndim = len(shape)

    def receive(self) -> torch.Tensor:
        if self._value is not None:
            t = self._value.detach().clone()
        else:
            t = torch.empty(self.shape, dtype=self.dtype, device=self._mesh.device_type)
        return C.broadcast(t, self._mesh, 0, 0)


@dataclasses.dataclass(frozen=True)
class _Meta:
    shape: tuple
    dtype: torch.dtype


def _skeleton_from_rank0(tree, like: torch.Tensor | None):
    """Rank 0's state dict everywhere, tensors replaced by stubs that broadcast on demand. The
    structure (keys, shapes, dtypes) travels first, in one object broadcast."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tree
    mesh = default_mesh(like if like is not None else torch.empty(0))
    rank0 = dist.get_rank() == 0
    if rank0:
        def meta(v):
            if isinstance(v, DTensor):
                raise ValueError("broadcast_from_rank0 expects rank 0 to pass a full state dict "
                                 f"(plain tensors); got a DTensor of shape {tuple(v.shape)}")
            return _Meta(tuple(v.shape), v.dtype) if torch.is_tensor(v) else v
        skeleton = _map(tree, meta)
    else:
        skeleton = None
    skeleton = C.broadcast_object(skeleton, mesh, 0, 0)
    values = iter(_leaves(tree) if rank0 else ())

    def stub(v):
        if isinstance(v, _Meta):
            return _Stub(v.shape, v.dtype, next(values) if rank0 else None, mesh)
        return v
    return _map(skeleton, stub)


def _leaves(tree) -> Iterable:
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    elif torch.is_tensor(tree):
        yield tree


def _any_tensor(targets: dict):
    return next((v for v in targets.values() if torch.is_tensor(v)), None)
