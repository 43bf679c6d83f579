"""Start-up cost: ``import dtensor_lite``'s time next to ``import torch.distributed.tensor``'s.

Every rank of every launch pays the import, so it is the first thing a user waits for. Each sample
is a fresh ``python`` process that first imports torch (which both libraries need, and whose cost
is not ours) and then times only the import being measured; the best of ``--samples`` is kept (the
best is the cost without interference from a loaded machine). Rows:

* ``torch.distributed.tensor``: torch's DTensor, the reference;
* ``dtensor_lite``: the core library;
* ``dtensor_lite + fsdp + tp + pipelining``: everything the examples import.

Each row also says whether the import left ``torch._dynamo`` (seconds of start-up by itself)
imported; none of ours should (compile support loads it only when torch.compile is used).

    python benchmarks/import_time.py [--samples 5] [--checkout DIR] [--json FILE]

Prints a table and writes JSON (default benchmarks/results/import_time.json). ``--checkout``
(default: this one) is the tree whose packages are imported, so two trees compare on one machine;
the probe runs from a scratch directory, so the working directory cannot shadow it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fsdp_step import write_json  # noqa: E402

ROWS = {
    "torch.distributed.tensor": ["torch.distributed.tensor"],
    "dtensor_lite": ["dtensor_lite"],
    "dtensor_lite + fsdp + tp + pipelining": ["dtensor_lite", "fsdp", "tp",
                                               "dtensor_lite.pipelining"],
}

# runs in the fresh process: torch first (not timed), then the modules, timed together
_PROBE = """
import importlib, json, sys, time
import torch
start = time.perf_counter()
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps({"seconds": time.perf_counter() - start,
                  "dynamo": "torch._dynamo" in sys.modules}))
"""


def sample(modules: list[str], checkout: str) -> dict:
    """One fresh process's import time of ``modules`` from ``checkout`` (after ``import torch``)."""
    path = os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as scratch:
        out = subprocess.run([sys.executable, "-c", _PROBE, *modules], check=True, cwd=scratch,
                             capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(samples: int, checkout: str) -> list[dict]:
    runs: dict[str, list[dict]] = {label: [] for label in ROWS}
    for _ in range(samples):  # rows interleaved: a spell of load hits every row alike
        for label, modules in ROWS.items():
            runs[label].append(sample(modules, checkout))
    return [{"row": label, "modules": ROWS[label],
             "best_s": min(r["seconds"] for r in got), "all_s": [r["seconds"] for r in got],
             "imports_dynamo": any(r["dynamo"] for r in got)} for label, got in runs.items()]


def table(rows: list[dict]) -> str:
    reference = rows[0]["best_s"]
    head = f"{'import (after import torch)':<38} {'best s':>7} {'x torch':>8} {'dynamo':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['row']:<38} {r['best_s']:>7.2f} {r['best_s'] / reference:>8.2f} "
                     f"{'yes' if r['imports_dynamo'] else 'no':>7}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=5,
                        help="fresh processes per row; the best is reported (default 5)")
    parser.add_argument("--checkout", default=os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), help="the tree to import dtensor_lite, fsdp and tp from (default: this one)")
    parser.add_argument("--json", default="benchmarks/results/import_time.json",
                        help="where to write the results (default %(default)s)")
    args = parser.parse_args()
    if args.samples < 1:
        parser.error(f"--samples must be at least 1, got {args.samples}")
    if not os.path.isdir(os.path.join(args.checkout, "dtensor_lite")):
        parser.error(f"--checkout {args.checkout}: no dtensor_lite package in it")
    rows = measure(args.samples, os.path.abspath(args.checkout))
    import torch
    print(f"torch {torch.__version__}, {args.checkout}, best of {args.samples} fresh processes\n")
    print(table(rows))
    write_json(args.json, {"torch": torch.__version__, "checkout": args.checkout,
                           "samples": args.samples, "rows": rows})


if __name__ == "__main__":
    main()
