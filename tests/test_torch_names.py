"""Every torch name the library depends on, walked on the installed torch (docs/compatibility.md).

dtensor_lite looks up aten ops and private torch names in one place, ``dtensor_lite._torch_names``,
which tolerates their absence. Here every module of ours is imported and every name it looked up
is checked: it resolves on this torch, or ``KNOWN_ABSENT`` says which release dropped it. A row of
``KNOWN_ABSENT`` that this torch contradicts is reported too, so the table stays true.
No process group is needed: this is metadata only.
"""
from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest
import torch

from dtensor_lite import _torch_names

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dtensor_lite", "fsdp", "tp")


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _import_everything():
    for pkg in PACKAGES:
        module = importlib.import_module(pkg)
        for info in pkgutil.walk_packages(module.__path__, pkg + "."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)


def test_every_name_the_library_looked_up_resolves_or_is_known_absent():
    _import_everything()
    for name in _torch_names.DEFERRED:  # looked up once Dynamo is imported: look them up now
        _torch_names.private(name, None)
    looked_up = dict(_torch_names.LOOKED_UP)
    assert len(looked_up) > 500, "the rule files look up their aten ops through _torch_names"
    surprises = sorted(name for name, found in looked_up.items()
                       if not found and name not in _torch_names.KNOWN_ABSENT)
    assert not surprises, (
        f"torch {torch.__version__} lacks names dtensor_lite uses: {surprises}. Add a row to "
        "_torch_names.KNOWN_ABSENT (the release that dropped it, what to use instead) and make "
        "the code that used it do without (docs/compatibility.md, 'A new release')")


def test_known_absent_rows_match_this_torch():
    installed = _release(torch.__version__)
    for name, (since, _) in _torch_names.KNOWN_ABSENT.items():
        op = name.split(".", 1)[1]
        present = hasattr(torch.ops.aten, op) if name.startswith("aten.") else \
            not isinstance(_torch_names.private(name, None), type(None))
        expect_present = installed < _release(since)
        assert present == expect_present, (
            f"KNOWN_ABSENT[{name!r}] says torch {since} dropped it, but torch "
            f"{torch.__version__} {'has' if present else 'lacks'} it")


def test_a_missing_op_registers_no_rule_and_raises_clearly_when_called():
    from dtensor_lite.ops._registry import overloads_of
    missing = _torch_names.aten.no_such_op_in_any_release
    assert _torch_names.is_missing(missing) and _torch_names.is_missing(missing.default)
    assert overloads_of(missing) == [] and overloads_of(missing.default) == []
    assert missing.default != torch.ops.aten.add.Tensor
    with pytest.raises(NotImplementedError, match="no_such_op_in_any_release.*does not exist"):
        missing.default(torch.ones(1))
    assert _torch_names.LOOKED_UP.pop("aten.no_such_op_in_any_release") is False
    # a present op is torch's own object (so `op is aten.add.Tensor` tests keep working)
    assert _torch_names.aten.add is torch.ops.aten.add
    assert _torch_names.aten.add.Tensor is torch.ops.aten.add.Tensor


def test_a_missing_private_name_fails_only_where_it_is_used():
    stand_in = _torch_names.private("torch._C._no_such_private_name")
    with pytest.raises(NotImplementedError, match="_no_such_private_name does not exist in torch"):
        stand_in()
    assert _torch_names.private("torch._C._no_such_private_name", default=3) == 3
    assert _torch_names.private("torch.no_such_module._x", None) is None
    for name in ("torch._C._no_such_private_name", "torch.no_such_module._x"):
        _torch_names.LOOKED_UP.pop(name)


def test_no_module_names_torch_ops_aten_directly():
    """A direct ``torch.ops.aten.<op>`` raises at import on a release without the op; every
    module reads ops through ``_torch_names.aten`` instead."""
    offenders = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name == "_torch_names.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and node.attr == "aten" and \
                        ast.unparse(node.value) == "torch.ops":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


# private torch modules imported by name, each for a reason the table cannot serve: a module whose
# import registers something (ops, a backend), or the pytree module whose registration functions
# are used whole. Inside a function an import fails only where it is used, so those are allowed.
ALLOWED_PRIVATE_MODULE_IMPORTS = {
    "torch.utils._pytree",  # register_pytree_node & co, used as a module
    "torch.distributed._functional_collectives",  # importing it registers the _c10d_functional ops
}


def _is_private_path(dotted: str) -> bool:
    return dotted.startswith("torch.") and any(
        part.startswith("_") and not (part.startswith("__") and part.endswith("__"))
        for part in dotted.split(".")[1:])


def test_private_torch_names_are_looked_up_in_one_place():
    """Outside ``_torch_names``, no module reads a private torch attribute (``torch._C.x``,
    ``torch._ops.OpOverload``) or imports a private torch module at import time: a release that
    drops one would stop ``import dtensor_lite``. They come from ``_torch_names`` instead."""
    offenders = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name == "_torch_names.py":
                continue
            tree = ast.parse(path.read_text(), str(path))
            lazy = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
            for node in ast.walk(tree):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    dotted = ast.unparse(node)
                    if _is_private_path(dotted) and dotted.count(".") == \
                            len([p for p in dotted.split(".") if p.isidentifier()]) - 1:
                        offenders.append(f"{where} {dotted}")
                elif isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in lazy:
                    modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                        [node.module or ""] if node.level == 0 else []
                    for m in modules:
                        if _is_private_path(m) and m not in ALLOWED_PRIVATE_MODULE_IMPORTS:
                            offenders.append(f"{where} import {m}")
                    if isinstance(node, ast.ImportFrom) and node.level == 0 and \
                            (node.module or "").startswith("torch"):
                        offenders += [f"{where} from {node.module} import {a.name}"
                                      for a in node.names if a.name.startswith("_")]
    # an attribute chain is reported once, at its longest (torch._C._x, not torch._C too)
    longest = [o for o in offenders if not any(p != o and p.startswith(o.split(" ")[0]) and
                                                p.split(" ", 1)[1].startswith(o.split(" ", 1)[1] + ".")
                                                for p in offenders)]
    assert not longest, "\n".join(longest)
