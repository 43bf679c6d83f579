"""The import graph of dtensor_lite, fsdp and tp has no cycles (docs/internals.md, "Layers").

Read from the source (no import runs): every ``import`` / ``from ... import`` of a module of the
three packages, including the lazy ones inside functions, is an edge; ``from pkg import name``
is an edge to the submodule ``pkg.name`` where there is one, else to ``pkg`` itself. A cycle is
a strongly connected component of more than one module (or a module importing itself).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dtensor_lite", "fsdp", "tp")
# Cycles known and owned elsewhere, each with its reason (none today); remove an entry with its cycle.
KNOWN: dict[frozenset, str] = {}


def modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def import_edges(mods) -> dict[str, set[str]]:
    edges = {}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        out = edges[name] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    parts = parts[:len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for a in node.names:
                    if f"{base}.{a.name}" in mods:
                        out.add(f"{base}.{a.name}")
                    elif base in mods:
                        out.add(base)
    return edges


def cycles(edges) -> list[frozenset]:
    """Strongly connected components with a cycle (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in edges.get(v, ()):
                    found.append(frozenset(comp))
    return found


def test_no_import_cycles():
    mods = modules()
    assert {"dtensor_lite", "fsdp", "tp", "dtensor_lite._dispatch", "fsdp.hooks"} <= set(mods)
    bad = [sorted(c) for c in cycles(import_edges(mods)) if c not in KNOWN]
    assert not bad, f"import cycles (lazy in-function imports count too): {bad}"


def test_cycle_finder_sees_lazy_imports(tmp_path):
    # the finder itself: a circle closed by a lazy import inside a function is found
    (tmp_path / "a.py").write_text("from .b import g\n")
    (tmp_path / "b.py").write_text("def g():\n    from . import a\n")
    (tmp_path / "c.py").write_text("from pkg import a\n")
    mods = {f"pkg.{n}": (tmp_path / f"{n}.py", False) for n in "abc"}
    assert cycles(import_edges(mods)) == [frozenset({"pkg.a", "pkg.b"})]
    assert cycles({"a": {"b"}, "b": set()}) == []
