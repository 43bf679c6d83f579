"""``_fast_path``'s replay of a call that is one aten view op (``x.t()``, ``x.view(...)``, ...).

A view's result must be an autograd view of its input: ``_base``, one version counter shared
with the input, the creation mode autograd checks before an in-place write. Only C++ makes that
(``ADInplaceOrView``'s ``as_view``), so until now a view always ran the ordinary way, entering
``__torch_dispatch__`` from C++ (2.5x the cost of a replayed add).

The replay here lets C++ make the view, without Python: the view op runs on the DTensor *wrapper*
with the Python dispatch key excluded for that one call, so autograd's view tracking runs as in
the ordinary way and the wrapper's own kernel (a view kernel reads metadata only; the wrapper's
storage holds no data) computes the global sizes and strides. That result is a ``torch.Tensor``
over the view, without the Python dispatch key; ``as_subclass`` makes it a DTensor (an alias of
it, which autograd also tracks as a view of the input) and the DTensor gets its local piece (the
decision's local view) and spec.

Taken only for a call that dispatched exactly one view op, a cached decision of the plain kind
(nothing to move, so the local result is a real view, not a copy), and only after the replay's
result was compared once with the ordinary one: the same global sizes, strides and storage offset
on the wrapper, and a local piece with the same metadata over the same memory. The key (function,
input spec, every other argument) fixes all of these, so one comparison proves them for every
later call with that key. While a view that copied is alive (``COPIED_VIEWS``) the ordinary path
runs: views of such copies must be marked.
"""
from __future__ import annotations

import torch

from . import _torch_names as N
from ._aliasing import COPIED_VIEWS
from ._dispatch import _Decision
from ._quick_call import const, quick_callable
from .dtensor import DTensor

__all__ = ["view_runner"]

_no_python_dispatch = N.private("torch._C._DisableTorchDispatch", None)
_disabled = N.disabled_torch_function_impl
_INPLACE_VIEW = torch.Tag.inplace_view


class CopiedViewsAlive(Exception):
    """Raised by a view replay while a copied view lives: the call runs the ordinary way."""


def view_runner(record, dts, out):
    """A function ``run(dts)`` that makes the view ``record`` dispatched, or None where this call
    cannot be replayed so (the caller then runs it the ordinary way every time)."""
    op, args, kwargs, d, result = record
    if (_no_python_dispatch is None or type(d) is not _Decision or not d.fast or d.copies_view
            or d.view_src != 0 or d.mutated is not None or _INPLACE_VIEW in op.tags
            or result is not out or type(out) is not DTensor or len(dts) != 1
            or tuple(d.flat_positions) != (0,) or args[0] is not dts[0]
            or any(const(a) is None for a in args[1:])
            or any(const(v) is None for v in kwargs.values())):
        return None
    rest, kw = tuple(args[1:]), dict(kwargs)
    spec = d.out_specs
    # C spellings (``Tensor.view``) where they run exactly this op, checked on meta tensors:
    # one on the global shapes for the wrapper, one on the local shapes for the piece
    on_wrapper = quick_callable(op, list(args), kwargs, op._op)
    on_piece = quick_callable(op, [dts[0]._local_tensor, *rest], kwargs, d.local_fn)
    guard = _no_python_dispatch

    def run_view(dts):
        if COPIED_VIEWS:
            raise CopiedViewsAlive
        src = dts[0]
        local = on_piece(src._local_tensor, *rest, **kw)
        with guard():
            view = _disabled(on_wrapper, (), (src, *rest), kw)
        # a torch.Tensor over the view, without the Python key (C++ copies it into no view):
        # ``as_subclass`` aliases it once more (the same view of ``src``) into a new DTensor
        # object, which is what gives a tensor its Python key
        view = view.as_subclass(DTensor)
        view._local_tensor = local
        view._spec = spec
        return view

    try:  # (a local piece of a subclass without storage cannot even be compared: no replay)
        same = _same_view(run_view(dts), out)
    except Exception:  # noqa: BLE001 - whatever the reason, the ordinary way is the answer
        return None
    return run_view if same else None


def _same_view(mine: DTensor, theirs: DTensor) -> bool:
    """Whether the replay's view matches the ordinary one in everything a caller can read."""
    a, b = mine._local_tensor, theirs._local_tensor
    return (mine._spec is theirs._spec and _layout(mine) == _layout(theirs)
            and mine._base is theirs._base and _layout(a) == _layout(b)
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.dtype == b.dtype and type(a) is type(b))


def _layout(t: torch.Tensor):
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device
