"""Moving activations between local tensors and DTensors at module boundaries.

Every style's input/output hook does the same three things to one tensor: wrap a local tensor as
a DTensor of a declared layout (``from_local``), redistribute it to the layout the module needs,
and hand back either the DTensor or its local piece. All three are differentiable in
dtensor_lite, so the backward of a hook is its exact transpose (the gradient of a Replicate input
to a column-parallel Linear arrives Partial and is all-reduced by ``from_local``'s backward).

Global shapes: a local tensor declared ``Shard(d)`` need not be an even piece. Unless the caller
knows the global size (a row-parallel Linear knows its input's last dim is ``in_features``), the
ranks exchange their pieces' metadata (one small all_gather of a fixed-size row) to learn it:
PyTorch assumes even pieces (global = local x mesh size) and aborts in gloo on a sequence length
the mesh size does not divide. A piece that is gathered whole anyway (Shard -> Replicate, e.g.
``ColwiseParallel(input_layouts=Shard(0))``) carries its size in the gather itself
(``dtensor_lite/gather_pieces.py``): one collective per call once warm, as PyTorch's. A DTensor
input knows its shape and needs no exchange, which is why the example Llama keeps its
sequence-parallel residual stream as DTensors. Nor does a local tensor that a style's own
``use_local_output`` made from a DTensor (``local_piece``): it carries that DTensor's mesh,
placement and global shape, so the next style reads them instead of exchanging (PyTorch's
``RowwiseParallel(output_layouts=Shard(1))`` then ``SequenceParallel()`` costs the same
collectives on both libraries).
"""
from __future__ import annotations

import torch

from dtensor_lite import DeviceMesh, DTensor, Placement, Replicate, Shard
from dtensor_lite.compile_support import boundary
from dtensor_lite.placements import as_placement
from dtensor_lite.gather_pieces import agreement_applies, gather_local_pieces, pieces_global_shape
from dtensor_lite.debug_state import comm_cause

__all__ = ["one_layout", "to_dtensor", "convert", "local_piece", "tagged_piece"]

# attribute on a local piece handed out by local_piece: (mesh, placement, local shape,
# global shape) of the DTensor it came from
_KNOWN = "_dtl_tp_piece_of"


def one_layout(layout, what: str) -> Placement | None:
    """A single placement from ``layout`` (a Placement or a 1-tuple of one), else ValueError."""
    if isinstance(layout, (tuple, list)):
        if len(layout) != 1:
            raise ValueError(f"{what} must be one placement (tensor parallelism uses a 1-D mesh), "
                             f"got {layout!r}")
        layout = layout[0]
    if layout is None:
        return None
    try:  # torch's own placements (torch.distributed.tensor.Shard(-1)) are taken by value
        return as_placement(layout, what)
    except TypeError:
        raise ValueError(f"{what} must be a placement such as Shard(-1) or Replicate(), got "
                         f"{layout!r}") from None


def _normalized(layout: Placement, ndim: int) -> Placement:
    if layout.is_shard() and layout.dim < 0:
        return Shard(layout.dim + ndim)
    return layout


def local_piece(dt):
    """``dt.to_local()`` for a 1-D Shard DTensor, remembering (on the returned tensor) the mesh,
    placement and global shape, so that a style declaring the same layout for it on the same mesh
    needs no exchange of the pieces' sizes; anything else is returned as ``to_local`` does."""
    local = dt.to_local() if isinstance(dt, DTensor) else dt
    if isinstance(dt, DTensor) and len(dt.placements) == 1 and dt.placements[0].is_shard():
        tagged_piece(local, dt.device_mesh, dt.placements[0], dt.shape)
    return local


def tagged_piece(local, mesh, placement, global_shape):
    """``local`` (the ``placement`` piece of a ``global_shape`` DTensor on ``mesh``) remembering
    them, as :func:`local_piece` leaves its result."""
    try:
        setattr(local, _KNOWN, (mesh, placement, local.shape, torch.Size(global_shape)))
    except (AttributeError, RuntimeError):  # a tensor subclass without a __dict__
        pass
    return local


def _known_shape(x, mesh, placement, who):
    """The global shape ``local_piece`` recorded on ``x`` for this mesh and placement, or None.
    Same program on every rank, same answer on every rank: the record exists or not by the code
    path, and its shape check fails only for a piece resized in place (an error, not a guess)."""
    known = getattr(x, _KNOWN, None)
    if known is None or known[0] != mesh or known[1] != placement:
        return None
    if x.shape != known[2]:
        raise ValueError(f"{who}: a local input made by a style's use_local_output as the "
                         f"{placement} piece of a {tuple(known[3])} tensor was resized in place "
                         f"from {tuple(known[2])} to {tuple(x.shape)}; pass a DTensor or a new "
                         "tensor instead")
    return known[3]


def to_dtensor(x, mesh: DeviceMesh, layout: Placement, shape=None, *, who: str = "") -> DTensor:
    """``x`` as a DTensor: DTensors pass as they are, local tensors are declared ``layout``."""
    if isinstance(x, DTensor):
        return x
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{who}: expected a tensor input to lay out as {layout}, got "
                         f"{type(x).__name__}")
    placements = [_normalized(layout, x.ndim)]
    if shape is None and layout.is_shard():
        shape = _known_shape(x, mesh, placements[0], who)
    if shape is None and layout.is_shard():
        with comm_cause(who or "tp layout", "global shape"):
            shape = pieces_global_shape(x, mesh, placements, who=who,
                                        what=f"{who or 'tp'}: local input")
    return DTensor.from_local(x, mesh, placements, shape=shape)


@boundary  # torch.compile: one opaque call, its Python traced by AOTAutograd (compile_support.py)
def convert(x, mesh: DeviceMesh, layout: Placement | None, desired: Placement | None,
            use_local: bool, shape=None, *, who: str = ""):
    """Declare ``x`` as ``layout``, redistribute to ``desired``, return a DTensor or its piece.

    ``layout=None`` means "not a tensor we manage": ``x`` is returned untouched.
    """
    if layout is None:
        return x
    if shape is None and layout.is_shard() and isinstance(x, torch.Tensor) and \
            not isinstance(x, DTensor):
        shape = _known_shape(x, mesh, _normalized(layout, x.ndim), who)
    if (shape is None and layout.is_shard() and desired is not None and desired.is_replicate()
            and isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            and agreement_applies(mesh)):
        # a local piece gathered whole: its size rides with the data (one collective once warm)
        with comm_cause(who or "tp layout", "gather pieces"):
            dt = gather_local_pieces(x, mesh, _normalized(layout, x.ndim).dim, who=who)
        return local_piece(dt) if use_local else dt
    dt = to_dtensor(x, mesh, layout, shape, who=who)
    if desired is not None:
        want = _normalized(desired, dt.ndim)
        if dt.placements != (want,):
            dt = dt.redistribute(mesh, [want])
    return local_piece(dt) if use_local else dt
