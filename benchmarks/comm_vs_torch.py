"""Communication of ours vs PyTorch's DTensor over the WHOLE op_db, forward and backward.

The suite's ``tests/test_comm_vs_torch.py::test_op_db_costs_no_more_than_torch`` compares a
stratified sample (a few ops per layout, chosen by a hash of the seed); this script runs the same
comparison (``_run_op_db_comm_batch``: the same layouts test_opinfo runs, the first sample plain
torch runs per op, each rank's busiest cost in the planner's unit, bytes + a latency term per
collective) on every (op, layout) pair, and sorts each into cheaper / same / dearer, a dearer
pair being "listed" when the test's exceptions table (or the random-generator check rule) gives
its reason.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/comm_vs_torch.py \
        [--passes S0 R ...] [--ops REGEX] [--batch 16] [--out benchmarks/results/comm_vs_torch.json]

Resumable: rows already in ``--out`` are kept (``--fresh`` starts over), so a run that was
stopped continues where it left off. Several processes may share the work with ``--shard k/n``
(each writes its own file; ``--merge a.json b.json ...`` tallies them). Prints the tally and every
unlisted dearer pair; writes the rows and the tally as JSON.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(path):
    try:
        with open(path) as f:
            return json.load(f).get("rows", {})
    except (OSError, ValueError):
        return {}


def _save(path, rows, tally=None):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"tally": tally, "rows": rows}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def tally(rows):
    """{"less", "same", "more", "listed", "skip"} counts and the unlisted dearer rows."""
    from tests._comm_compare import Comm
    from tests.test_comm_vs_torch import row_verdict
    counts = {"less": 0, "same": 0, "more": 0, "listed": 0, "skip": 0}
    unlisted = []
    for name, row in sorted(rows.items()):
        pass_name, key = name.split("|", 1)
        verdict, why = row_verdict(pass_name, key, row)
        counts[verdict] += 1
        if verdict == "more" and why:
            counts["listed"] += 1
        elif verdict == "more":
            of, tf, ob, tb = (Comm(*c) for c in row[1:5])
            unlisted.append(f"{pass_name} {key}: ours fwd {of} bwd {ob} > torch fwd {tf} bwd {tb}")
    return counts, unlisted


def main(argv=None):
    from tests.test_opinfo import OP_DB_PASSES, _op_db_entries
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--passes", nargs="*", default=list(OP_DB_PASSES))
    p.add_argument("--ops", default="", help="regex on op keys")
    p.add_argument("--batch", type=int, default=16, help="ops per call into the pool")
    p.add_argument("--shard", default="0/1", help="k/n: this process takes every n-th op")
    p.add_argument("--out", default="benchmarks/results/comm_vs_torch.json")
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--merge", nargs="*", help="only tally these JSON files together")
    a = p.parse_args(argv)
    if a.merge:
        rows = {}
        for path in a.merge:
            rows.update(_load(path))
        _report(rows, a.out)
        return
    from tests.harness import DistributedTestFailure, run_distributed, shutdown_pools
    from tests.test_comm_vs_torch import _run_op_db_comm_batch
    k, n = (int(x) for x in a.shard.split("/"))
    keys = [key for key, _ in _op_db_entries() if re.search(a.ops, key)][k::n]
    rows = {} if a.fresh else _load(a.out)
    progress = os.environ["DTL_COMM_PROGRESS"] = os.path.abspath(a.out) + ".progress"
    start = time.perf_counter()
    try:
        for pass_name in a.passes:
            # an op whose run killed a batch in one layout is not run again in another (each
            # such run costs a restart of the worker pool)
            killed = {name.split("|", 1)[1]: name.split("|", 1)[0] for name, row in rows.items()
                      if row[0] == "skip" and row[1].startswith("run failed")}
            for key in keys:
                if key in killed and f"{pass_name}|{key}" not in rows:
                    rows[f"{pass_name}|{key}"] = ["skip", f"run failed on {killed[key]}: not run"]
            todo = [key for key in keys if f"{pass_name}|{key}" not in rows]
            for i in range(0, len(todo), a.batch):
                batch = todo[i:i + a.batch]
                out = _run_batch(run_distributed, DistributedTestFailure,
                                 _run_op_db_comm_batch, pass_name, batch, progress)
                rows.update({f"{pass_name}|{key}": list(r) for key, r in out.items()})
                _save(a.out, rows)
                print(f"{pass_name}: {min(i + a.batch, len(todo))}/{len(todo)} "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)
    finally:
        shutdown_pools()
    _report(rows, a.out)


def _run_batch(run_distributed, failure, body, pass_name, batch, progress):
    """{op key: row} of one batch. A batch that fails (a library's ranks disagreed and gloo
    aborted one, or they hung) is resumed after the op it died in (each rank writes the op it
    starts to ``progress``.<rank>), which is skipped."""
    out = {}
    while batch:
        for path in glob.glob(progress + ".*"):
            os.remove(path)
        try:
            out.update(run_distributed(4, body, pass_name, batch,
                                       timeout=60 + 30 * len(batch))[0])
            return out
        except failure as e:
            started = []
            for path in glob.glob(progress + ".*"):
                with open(path) as f:
                    started.append(f.read())
            at = min((batch.index(k) for k in started if k in batch), default=0)
            out[batch[at]] = ("skip", f"run failed: {str(e)[-300:]}")
            done = {k for k in batch[:at]}
            batch = [k for k in batch[at + 1:]] + sorted(done)  # ops before it: again
    return out


def _report(rows, out):
    counts, unlisted = tally(rows)
    passes = sorted({name.split("|", 1)[0] for name in rows})
    print(f"{'layout':8} {'cheaper':>8} {'same':>6} {'dearer':>7} {'listed':>7} {'skipped':>8}")
    for p in passes:
        c, _ = tally({n: r for n, r in rows.items() if n.startswith(p + "|")})
        print(f"{p:8} {c['less']:8} {c['same']:6} {c['more']:7} {c['listed']:7} {c['skip']:8}")
    line = (f"op_db comm vs torch: {counts['less']} (op, layout) cheaper, {counts['same']} same, "
            f"{counts['more']} dearer ({counts['listed']} listed with a reason), "
            f"{counts['skip']} not compared")
    print(line)
    for u in unlisted:
        print("  UNLISTED", u)
    _save(out, rows, dict(counts, unlisted=unlisted))


if __name__ == "__main__":
    main()
