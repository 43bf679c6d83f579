"""Start-up cost: importing the library leaves ``torch._dynamo`` unimported.

Dynamo costs seconds of every rank's start-up (torch's own DTensor does not import it), so compile
support registers what it needs only once ``torch.compile`` has imported Dynamo
(``dtensor_lite/_after_import.py``). Each check runs in a fresh interpreter, as a user's does;
``benchmarks/import_time.py`` measures the time itself.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, cwd: Path = ROOT) -> str:
    """Run ``code`` in a fresh interpreter with this checkout first on the path; its stdout."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, text=True,
                         capture_output=True, timeout=600,
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                              "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("modules", [
    ["dtensor_lite"],
    ["fsdp"], ["tp"], ["dtensor_lite.pipelining"],   # the public modules of the layers above
    ["examples.train_llama"],                         # everything the main example imports
])
def test_importing_the_public_modules_leaves_dynamo_unimported(modules):
    out = _run(f"""
        import importlib, sys
        import torch
        assert "torch._dynamo" not in sys.modules, "torch itself imported Dynamo"
        for name in {modules!r}:
            importlib.import_module(name)
        print("torch._dynamo" in sys.modules)
        """)
    assert out.split() == ["False"], f"importing {modules} imported torch._dynamo"


def test_no_module_of_the_library_imports_dynamo():
    """Every module of dtensor_lite, fsdp and tp, imported together (as test_torch_names does)."""
    out = _run("""
        import importlib, pkgutil, sys
        import torch
        for pkg in ("dtensor_lite", "fsdp", "tp"):
            module = importlib.import_module(pkg)
            for info in pkgutil.walk_packages(module.__path__, pkg + "."):
                if not info.name.endswith("__main__"):
                    importlib.import_module(info.name)
                    if "torch._dynamo" in sys.modules:
                        print(info.name)
                        break
        print("torch._dynamo" in sys.modules)
        """)
    assert out.split() == ["False"], f"this module imported torch._dynamo: {out.split()[0]}"


def test_compile_support_registers_its_boundaries_once_dynamo_is_imported():
    """The lazy registration still happens: before Dynamo, nothing; once torch.compile's import
    of it has run, every boundary holds its nonstrict_trace form (tests/test_compile.py runs
    them compiled)."""
    out = _run("""
        import sys
        import torch
        from dtensor_lite import DTensor
        def traced_of(boundary):
            cells = dict(zip(boundary.__code__.co_freevars, boundary.__closure__))
            return cells["traced"].cell_contents
        print(traced_of(DTensor.from_local) is None)
        import torch._dynamo
        traced = traced_of(DTensor.from_local)
        from torch._dynamo import trace_rules
        print(id(traced) in trace_rules._nonstrict_trace_callable_ids)
        """)
    assert out.split() == ["True", "True"]


def test_after_import_runs_the_callback_after_the_module_and_once(tmp_path):
    (tmp_path / "slow_module.py").write_text("VALUE = 7\n")
    out = _run(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from dtensor_lite._after_import import after_import
        seen = []
        after_import("slow_module", lambda m: seen.append(m.VALUE))
        print(seen == [])                       # not imported by us
        import importlib.util
        importlib.util.find_spec("slow_module")  # asked about, not imported: still waiting
        print(seen == [])
        import slow_module
        print(seen == [7])                      # run once the module has executed
        import importlib; importlib.reload(slow_module)
        print(seen == [7])                      # and only once
        print(type(slow_module.__loader__).__name__ != "_ThenRun")   # the module's own loader
        after_import("slow_module", lambda m: seen.append("now"))
        print(seen == [7, "now"])               # already imported: at once
        """)
    assert out.split() == ["True"] * 6
