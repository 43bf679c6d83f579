"""The one place where dtensor_lite looks up names that a torch release may add, rename or remove.

A new torch release must cost a table row, not an import error (torch 2.15 removed the aten ops
``cholesky`` and ``qr``; importing a rule file that named them stopped the whole library). So:

- ``aten``: stands for ``torch.ops.aten`` in every module of ours. An op this torch has resolves
  to torch's own ``OpOverloadPacket`` / ``OpOverload`` (and is cached on the namespace, so the
  second lookup costs what ``torch.ops.aten``'s does). An op it lacks resolves to a ``Missing``
  placeholder: it equals no real op, ``register_rule`` skips it (an op torch removed simply has
  no rule), and calling it raises an error that names the op and the torch version.
- ``private("torch._C._storage_Use_Count")``: a private torch attribute, or None where this
  release has none; the caller says what it does without it.

Every lookup is recorded in ``LOOKED_UP``, so a test can walk what the library asked for on the
installed torch: each name either resolves or is listed in ``KNOWN_ABSENT`` for this release.
"""
from __future__ import annotations

import importlib

import torch

# What a supported release is known to lack, with the release that dropped (or has not yet
# added) it. A name missing from the installed torch and not listed here is a surprise the
# compatibility test reports (tests/test_torch_names.py).
KNOWN_ABSENT: dict[str, str] = {
    "aten.cholesky": "removed in torch 2.15 (use linalg_cholesky_ex)",
    "aten.qr": "removed in torch 2.15 (use linalg_qr)",
}

# every name looked up through this module: "aten.<op>[.<overload>]" or a dotted private path,
# mapped to whether the installed torch has it
LOOKED_UP: dict[str, bool] = {}


class Missing:
    """An aten op (or overload) this torch does not have. Equal to nothing real; any overload of
    it is Missing too; calling it raises."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, overload: str) -> "Missing":
        if overload.startswith("__"):
            raise AttributeError(overload)
        return Missing(f"{self.name}.{overload}")

    def overloads(self) -> list:
        return []

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"aten.{self.name} does not exist in torch {torch.__version__}; "
            f"{KNOWN_ABSENT.get('aten.' + self.name.split('.')[0], 'it was removed or renamed')}")

    def __repr__(self) -> str:
        return f"Missing(aten.{self.name})"


class _TolerantAten:
    """``torch.ops.aten`` that answers a missing op with ``Missing`` instead of raising."""

    def __getattr__(self, name: str):
        try:
            packet = getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):
            if name.startswith("__") and name.endswith("__"):  # a Python protocol probe
                raise AttributeError(name) from None
            LOOKED_UP[f"aten.{name}"] = False
            return Missing(name)
        LOOKED_UP[f"aten.{name}"] = True
        setattr(self, name, packet)  # cached: the next lookup is a plain attribute read
        return packet


aten = _TolerantAten()


def is_missing(op) -> bool:
    return isinstance(op, Missing)


def find_op(name: str):
    """The aten packet ``name`` where this torch has it, else None: for code that asks *whether*
    an op exists (a ``_copy`` twin, an optional fused kernel), not recorded as a requirement."""
    return getattr(torch.ops.aten, name, None) if hasattr(torch.ops.aten, name) else None


def private(path: str):
    """The attribute at dotted ``path`` (``"torch._C._foo"``, ``"torch.utils._pytree.tree_map"``),
    or None where this torch has no such module or attribute."""
    parts = path.split(".")
    obj = None
    for i in range(len(parts), 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        break
    for attr in parts[i:] if obj is not None else ():
        obj = getattr(obj, attr, None)
        if obj is None:
            break
    LOOKED_UP[path] = obj is not None
    return obj
