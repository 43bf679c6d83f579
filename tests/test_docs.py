"""The docs and the demo are executable: run them on a worker pool so they cannot rot.

* Every fenced ```python block of a docs page (or the README) whose first line is
  ``# runnable: world_size=N`` is a complete program (the page says how to run it with torchrun);
  here it is exec'd on every rank of the harness's ``N``-process pool, where the process group is
  already initialised. Tracebacks point at the page and its line.
* ``examples/demo_redistribute.py``'s ``main()`` runs the same way; it asserts its own results,
  and rank 0's rendered output is checked for the parts a reader relies on.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re

import pytest

from tests._narrow import WIDTH, assert_text_fits
from tests.harness import run_distributed

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_PAGES = ["README.md", "docs/placements.md", "docs/random.md", "docs/strategies.md", "docs/fsdp.md",
             "docs/tp.md", "docs/checkpoint.md", "docs/2d.md", "docs/internals.md",
             "docs/troubleshooting.md", "docs/relayout.md", "docs/pipelining.md"]
DEMO = os.path.join(REPO_ROOT, "examples", "demo_redistribute.py")

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_MARKER = re.compile(r"\A# runnable: world_size=(\d+)[ \t]*\n")


def runnable_blocks(page: str) -> list[tuple[str, int, int, str]]:
    """(page, line of the block's first code line, world_size, code) of each runnable block."""
    with open(os.path.join(REPO_ROOT, page), encoding="utf-8") as f:
        text = f.read()
    blocks = []
    for match in _FENCE.finditer(text):
        marker = _MARKER.match(match.group(1))
        if marker:
            line = text.count("\n", 0, match.start(1)) + 1
            blocks.append((page, line, int(marker.group(1)), match.group(1)))
    return blocks


_BLOCKS = [block for page in DOC_PAGES for block in runnable_blocks(page)]


# ----------------------------------------------------------------- bodies run on every rank
def _exec_snippet(code: str, page: str, line: int) -> str:
    """Run one docs snippet in a fresh namespace; return what it printed.

    The code is shifted down to its line in the page, so a traceback names the page's line."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile("\n" * (line - 1) + code, page, "exec"), {"__name__": "__docs__"})
    return out.getvalue()


def _run_demo() -> str:
    """Import the demo by path (examples/ is not a package) and run its main(); return rank 0's
    rendered output."""
    from rich.console import Console

    spec = importlib.util.spec_from_file_location("demo_redistribute", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    console = Console(file=io.StringIO(), width=WIDTH, color_system=None)  # a pipe, CI
    demo.main(console=console)
    return console.file.getvalue()


# ----------------------------------------------------------------- tests
def test_docs_have_runnable_blocks():
    # a renamed marker must not silently turn the docs test into a no-op
    pages = {page for page, *_ in _BLOCKS}
    assert pages == set(DOC_PAGES) and len(_BLOCKS) >= 4, [(p, line) for p, line, *_ in _BLOCKS]


@pytest.mark.parametrize(
    "page,line,world_size,code", _BLOCKS, ids=[f"{page}:{line}" for page, line, _, _ in _BLOCKS])
def test_runnable_doc_block(page, line, world_size, code):
    outputs = run_distributed(world_size, _exec_snippet, code, page, line)
    assert len(outputs) == world_size


def test_demo_runs_on_four_ranks():
    outputs = run_distributed(4, _run_demo)
    text = outputs[0]
    assert all(out == "" for out in outputs[1:])  # only rank 0 prints
    for expected in ("DeviceMesh", "Sharding pictures", "all_gather", "reduce_scatter",
                     "all_to_all", "full_tensor() == original ✓",
                     "output, loss and gradients match plain torch ✓",
                     "all checks passed on every rank"):
        assert expected in text, f"{expected!r} missing from the demo's output:\n{text}"
    assert_text_fits(text, "demo_redistribute's output")  # every table fits 80 columns
    lone = [line for line in text.splitlines() if line.strip() == "✓"]
    assert not lone, f"a check's ✓ wrapped onto a line of its own:\n{text}"
