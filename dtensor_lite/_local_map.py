"""``local_map``: run plain torch code on each rank's local pieces of DTensors.

Two things are derived here rather than assumed, because getting them wrong is silent (wrong
gradients) or fatal (ranks entering different collectives):

* the layout of each input's *gradient* (see ``derive_grad_placements``), and
* the global shape of each Shard output, the same on every rank: ``out_shape=`` (no
  communication), else an input laid out like the output if every rank's piece fits it (the
  ranks agree on that with one 1-element all-reduce per mesh dim), else an exchange of the
  local shapes that every rank makes.

Signature and spellings follow ``torch.distributed.tensor.experimental.local_map``.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from ._torch_names import tree_flatten, tree_map, tree_unflatten
from .debug_state import comm_cause
from .device_mesh import DeviceMesh
from .dtensor import DTensor
from .gather_pieces import pieces_global_shape
from .placements import Partial, Placement, Replicate, torch_placements_to_ours

__all__ = ["local_map", "derive_grad_placements"]


def local_map(func: Callable | None = None, out_placements=None, in_placements=None,
              in_grad_placements=None, device_mesh=None, *, redistribute_inputs: bool = False,
              out_shape=None, spmd_types: bool = False):
    """Run ``func`` on local pieces: DTensor args become local tensors, outputs become DTensors.

    * ``out_placements``: the placements of the output (one list), or a tuple with one entry per
      flattened output (``None`` for a non-tensor output). A single list given for several
      outputs applies to each.
    * ``in_placements``: one entry per *flattened* positional input (``None`` for a non-DTensor
      or to skip the check). A DTensor whose placements differ raises, or with
      ``redistribute_inputs=True`` is redistributed first.
    * ``in_grad_placements``: the layout of each input's *local gradient*, one entry per
      flattened positional input. ``None`` (or a ``None`` entry) derives it, per mesh dim:

      - ``Shard(d)`` input: ``Shard(d)`` (each rank owns the gradient of its own piece);
      - ``Replicate()`` input, outputs not all replicated on that dim (Shard or Partial): its
        local gradient is this rank's share of a sum, ``Partial("sum")`` (e.g. keys and values
        gathered into sequence-sharded attention); all outputs replicated: ``Replicate()``;
      - ``Partial`` input: ``Replicate()`` (each term of a sum has the sum's gradient).

      A replicated input feeding outputs that are replicated on a dim and outputs that are not
      has no single layout: give its entry explicitly (an error says so).
    * ``out_shape``: the global shape of the output (or a tuple, one per flattened output, None
      where not needed). Outputs without Shard need none (global = local). Without it, a Shard
      output takes the global shape of the first input with the same placements if every
      rank's piece fits it (one 1-element all-reduce per mesh dim decides that together), and
      otherwise every rank exchanges its local shape (a few small collectives, uneven pieces
      welcome): the right global shape on every rank, or the same error on every rank. Pass
      ``out_shape`` to communicate nothing.
    * ``device_mesh``: defaults to the first DTensor argument's mesh.
    * ``spmd_types``: torch 2.15's runtime SPMD type checking of ``func`` (the ``spmd_types``
      package's checker) is not provided: ``True`` raises ``NotImplementedError`` once ``func``
      is called with DTensors (without any it runs as is, as torch's does). Gradient layouts
      are derived instead (above), or given with ``in_grad_placements``.

    Placements may be dtensor_lite's or torch's own (``torch.distributed.tensor.Shard(0)``).

    Keyword arguments are passed through, their DTensors as local tensors (gradient layout
    derived). Without any DTensor argument, ``func`` runs as is. Differentiable.

    Example::

        >>> def attention(q, k, v):             # plain torch on this rank's queries
        ...     return torch.softmax(q @ k.T, -1) @ v
        >>> attend = local_map(attention, out_placements=[Shard(0)],
        ...                    in_placements=([Shard(0)], [Replicate()], [Replicate()]))
        >>> out = attend(q, k_gathered, v_gathered)   # k, v get Partial gradients
    """
    if not isinstance(spmd_types, bool):
        raise TypeError(f"local_map: spmd_types must be a bool, got {spmd_types!r}")
    if func is None:  # used as a decorator with arguments, as torch allows
        return functools.partial(local_map, out_placements=out_placements,
                                 in_placements=in_placements,
                                 in_grad_placements=in_grad_placements, device_mesh=device_mesh,
                                 redistribute_inputs=redistribute_inputs, out_shape=out_shape,
                                 spmd_types=spmd_types)
    # torch's own placement objects (torch.distributed.tensor.Shard(0)) are taken by value
    out_placements, in_placements, in_grad_placements = torch_placements_to_ours(
        (out_placements, in_placements, in_grad_placements))

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        flat_args, args_tree = tree_flatten(args, is_leaf=_is_mesh_or_placement)
        if not any(isinstance(a, DTensor) for a in tree_flatten((flat_args, kwargs))[0]):
            return func(*args, **kwargs)
        if spmd_types:
            _refuse_spmd_types(func)
        _check_lengths("in_placements", in_placements, flat_args)
        _check_lengths("in_grad_placements", in_grad_placements, flat_args)
        mesh = device_mesh if device_mesh is not None else next(
            a for a in tree_flatten((flat_args, kwargs))[0] if isinstance(a, DTensor)).device_mesh
        declared_outs = _declared_output_placements(out_placements)
        track = torch.is_grad_enabled()
        seen: list = []  # (index or name, DTensor as func saw it): what may imply output shapes

        def localize(k, arg, want=None, grad=None):
            if want is not None and tuple(arg.placements) != tuple(want):
                if not redistribute_inputs:
                    raise ValueError(
                        f"local_map({_name(func)}): input {k} has placements "
                        f"{list(arg.placements)} but in_placements says {list(want)}; "
                        "redistribute it first or pass redistribute_inputs=True")
                arg = arg.redistribute(mesh, want)
            if grad is None and track and arg.requires_grad:
                grad = derive_grad_placements(arg.placements, declared_outs, f"input {k}")
            seen.append((k, arg))
            return arg.to_local(grad_placements=grad)

        local_args = [localize(k, a, _entry(in_placements, k), _entry(in_grad_placements, k))
                      if isinstance(a, DTensor) else a for k, a in enumerate(flat_args)]
        local_kwargs = {name: tree_map(lambda a: localize(name, a) if isinstance(a, DTensor)
                                       else a, value) for name, value in kwargs.items()}
        out = func(*tree_unflatten(local_args, args_tree), **local_kwargs)
        return _wrap_outputs(out, out_placements, out_shape, mesh, _name(func), seen)

    return wrapped


def derive_grad_placements(placements, out_placements, what: str = "the input") -> tuple:
    """The layout of a local_map input's local gradient, per mesh dim (see ``local_map``).

    ``placements``: the input's; ``out_placements``: one placement list per tensor output.

    Example::

        >>> derive_grad_placements([Replicate()], [[Shard(0)]])
        (Partial(sum),)
    """
    for outs in out_placements:
        if len(outs) != len(placements):
            raise ValueError(f"local_map: out_placements {list(outs)} has {len(outs)} placements "
                             f"for a {len(placements)}-D mesh; give one per mesh dim")
    grads = []
    for i, p in enumerate(placements):
        if p.is_shard():
            grads.append(p)
        elif p.is_partial():
            grads.append(Replicate())
        else:
            spread = [not outs[i].is_replicate() for outs in out_placements]
            if any(spread) and not all(spread):
                raise ValueError(
                    f"local_map: {what} is Replicate on mesh dim {i} and feeds outputs that are "
                    f"replicated on that dim and outputs that are not (out_placements "
                    f"{[list(o) for o in out_placements]}), so the layout of its gradient "
                    "cannot be derived (Replicate for the first, Partial('sum') for the others): "
                    "give its entry in in_grad_placements")
            grads.append(Partial("sum") if any(spread) else Replicate())
    return tuple(grads)


def _is_mesh_or_placement(a) -> bool:
    """A DeviceMesh or Placement argument is one flattened input (``None`` in in_placements), as
    in torch: ours are pytree constants for torch.compile, which would otherwise flatten to
    nothing and shift every later input's entry (``local_map(f, in_placements=(None, ...))(mesh,
    x)``, torch's test_local_map)."""
    return isinstance(a, (DeviceMesh, Placement))


def _name(func) -> str:
    return getattr(func, "__name__", type(func).__name__)


def _entry(per_input, k):
    return None if per_input is None else per_input[k]


def _refuse_spmd_types(func) -> None:
    # torch's spmd_types=True runs func under the spmd_types package's strict checker, which
    # types every local tensor op and collective against its process groups; none of that
    # exists here, and silently running unchecked would hide the errors the user asked for
    raise NotImplementedError(
        f"local_map({_name(func)}, spmd_types=True): runtime SPMD type checking (torch 2.15's "
        "spmd_types checker of func's local ops and collectives) is not supported by "
        "dtensor_lite. Call local_map without spmd_types (default False): the gradient layout "
        "of each input is derived from the placements (see local_map's docstring), or give it "
        "explicitly with in_grad_placements=")


def _check_lengths(name: str, per_input, flat_args) -> None:
    if per_input is not None and len(per_input) != len(flat_args):
        raise ValueError(
            f"local_map: {name} has {len(per_input)} entries but the call has {len(flat_args)} "
            "flattened positional inputs; give one entry per input (None for a non-DTensor)")


def _is_placement_list(p) -> bool:
    return isinstance(p, (list, tuple)) and len(p) > 0 and all(isinstance(q, Placement) for q in p)


def _declared_output_placements(out_placements) -> list[tuple]:
    """Every placement list that out_placements declares for a tensor output."""
    if out_placements is None:
        return []
    if isinstance(out_placements, Placement):
        return [(out_placements,)]
    if _is_placement_list(out_placements):
        return [tuple(out_placements)]
    return [tuple(p) for p in out_placements if p is not None]


def _per_output(spec, n: int, name: str, is_single) -> list:
    """``spec`` (out_placements or out_shape) as one entry per flattened output."""
    if spec is None or is_single(spec):
        return [spec] * n
    if len(spec) != n:
        raise ValueError(f"local_map: {name} has {len(spec)} entries for {n} outputs; give one "
                         "per flattened output (None for a non-tensor output)")
    return list(spec)


def _wrap_outputs(out, out_placements, out_shape, mesh, fname: str, inputs):
    flat, tree = tree_flatten(out)
    if _is_placement_list(out_placements) and len(out_placements) != mesh.ndim \
            and len(out_placements) == len(flat):
        # torch's spelling: a tuple of one Placement per output (each output's placements)
        out_placements = tuple((p,) for p in out_placements)
    placements = _per_output(out_placements, len(flat), "out_placements",
                             lambda s: isinstance(s, Placement) or _is_placement_list(s))
    shapes = _per_output(out_shape, len(flat), "out_shape",
                         lambda s: len(s) == 0 or isinstance(s[0], int))
    wrapped = [_wrap_one(o, p, s, mesh, f"local_map({fname})", j, inputs)
               for j, (o, p, s) in enumerate(zip(flat, placements, shapes))]
    return tree_unflatten(wrapped, tree)


def _everywhere(ok: bool, mesh) -> bool:
    """``ok`` on every rank of ``mesh`` (the same answer on every rank)."""
    from .collectives import all_reduce
    flag = torch.tensor([int(ok)], device=mesh.device_type)
    for i in range(mesh.ndim):
        flag = all_reduce(flag, mesh, i, "min")
    return bool(flag.item())


def _wrap_one(o, placements, shape, mesh, fname: str, j: int, inputs):
    what = f"{fname} output {j}"
    if isinstance(o, DTensor):
        raise TypeError(f"{what} is a DTensor; func must return plain local tensors, which "
                        "local_map wraps with out_placements")
    if placements is None or not isinstance(o, torch.Tensor):
        return o
    placements = (placements,) if isinstance(placements, Placement) else tuple(placements)
    source = "out_shape="
    if shape is None and any(p.is_shard() for p in placements):
        # Decided from global metadata only, so every rank takes the same branch (a rank whose
        # piece happened to match an input's used to skip the exchange the others entered):
        # an input laid out like the output implies its global shape; otherwise every rank
        # exchanges its local shape.
        like = next(((k, dt) for k, dt in inputs
                     if dt.placements == placements and dt.ndim == o.ndim), None)
        with comm_cause(fname, "out_shape"):
            if like is not None:
                # the likely shape, but whether each rank's piece fits it is each rank's own
                # knowledge: the ranks agree on it (one 1-element all-reduce per mesh dim) so
                # that none keeps a DTensor of the wrong global shape while another raises
                try:
                    out = DTensor.from_local(o, mesh, placements, shape=like[1].shape)
                except ValueError:
                    out = None
                if _everywhere(out is not None, mesh):
                    return out
            # the ranks exchange their local shapes: the right global shape on every rank, or
            # the same error on every rank where the pieces form none
            return DTensor.from_local(o, mesh, placements, shape=pieces_global_shape(
                o, mesh, placements, who=f"local_map: {fname}: {what}",
                what=f"local_map: {what}"))
    if shape is None:
        return DTensor.from_local(o, mesh, placements)  # no Shard: global = local
    try:
        return DTensor.from_local(o, mesh, placements, shape=shape)
    except ValueError:
        raise ValueError(
            f"{what}: this rank's piece {tuple(o.shape)} does not fit global shape "
            f"{tuple(shape)} (from {source}) under placements {list(placements)}; pass the "
            "output's global shape as out_shape=") from None
