"""Desync diagnosis by default (``_desync.py``): a collective called on some ranks only ends on
every rank within the bound, and the message names which rank is in which collective at which
line; slow but healthy collectives never trip it.

Each body runs on a fresh default group (``_fresh_group``: a desync leaves the group out of step)
with a short bound; lines are found by the marker comments at the ends of the calls.
"""
from __future__ import annotations

import contextlib
import datetime
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dtensor_lite import Shard, distribute_tensor, init_device_mesh
from tests.harness import COLLECTIVE_TIMEOUT, launch_processes, reinit_process_group, run_distributed

BOUND = 2.0  # seconds: the desync bound in these tests
# seconds on top of it that a loaded machine may need to exchange states. What the bound checks is
# that the desync report ended the wait, not the group's timeout (120 s in these bodies), so the
# margin sits well between: a 2-core machine running two suites side by side took over 10 s
MARGIN = 50.0
SOURCE = Path(__file__).read_text().splitlines()


def _line_of(marker: str) -> str:
    """``test_desync.py:<line>`` of the line ending with ``# <marker>``."""
    (n,) = [k + 1 for k, line in enumerate(SOURCE) if line.endswith(f"# {marker}")]
    return f"test_desync.py:{n}"


@contextlib.contextmanager
def _fresh_group(bound: float = BOUND, timeout: float = 120.0):
    from dtensor_lite import _desync
    from dtensor_lite._failures import forget_posted_failure
    reinit_process_group()
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout))
    saved, _desync.BOUND = _desync.BOUND, bound
    try:
        yield
    finally:
        _desync.BOUND = saved
        # the ranks leave a desync at different moments (the one that saw it first, the others
        # once told): the rendezvous waits as long as a loaded machine needs, then collectives
        # get the pool's usual timeout back
        reinit_process_group(datetime.timedelta(seconds=600))
        dist.distributed_c10d._set_pg_timeout(COLLECTIVE_TIMEOUT)
        forget_posted_failure()


def _one_rank_full_tensor():
    """The issue's program: rank 0 gathers once more than the others, then all go on."""
    with _fresh_group():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)])
        started = time.time()
        try:
            if dist.get_rank() == 0:
                x.full_tensor()  # extra gather
            (x * 2).sum(0).full_tensor()  # every rank
            return "ok", "", time.time() - started
        except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
            return type(e).__name__, str(e), time.time() - started


def test_collective_on_one_rank_only_stops_every_rank_naming_lines():
    outcomes = run_distributed(4, _one_rank_full_tensor, timeout=180)
    extra, every = _line_of("extra gather"), _line_of("every rank")
    for rank, (kind, message, waited) in enumerate(outcomes):
        assert kind in ("DesyncError", "RankFailedError"), (rank, kind, message)
        assert "DesyncError" in kind + message, (rank, message)
        assert f"rank 0: in all_gather #" in message and extra in message, (rank, message)
        assert "ranks 1-3: in all_reduce #" in message and every in message, (rank, message)
        assert waited < BOUND + MARGIN, (rank, waited)


def _slow_but_healthy():
    """Rank 3 joins an all-reduce only after ranks 0-2 have waited past the bound and posted
    their states (an event: their keys in the store), so ranks 0-2 see it as not responding,
    then joined: nobody may raise, the values are right."""
    from dtensor_lite import _desync
    from dtensor_lite._failures import _store
    with _fresh_group(bound=0.5):
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
        if dist.get_rank() == 3:
            _store().wait([f"{_desync._KEY}{r}" for r in range(3)], datetime.timedelta(seconds=60))
        total = (x * 2).sum(0).full_tensor()
        return total.tolist()


def test_slow_but_healthy_collective_does_not_trip():
    assert run_distributed(4, _slow_but_healthy, timeout=180) == [[16.0] * 4] * 4


_EXITING = '''
import datetime, os, sys, time, torch, torch.distributed as dist
from dtensor_lite import _desync, distribute_tensor, Shard, init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
_desync.BOUND = 2.0
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (4,))
x = distribute_tensor(torch.arange(32.).reshape(8, 4), mesh, [Shard(0)])
(x * 2).sum(0).full_tensor()
if rank == 0:
    started = time.time()
    try:
        x.full_tensor()
    except Exception as e:
        print("RAISED", round(time.time() - started, 1), type(e).__name__, e, flush=True)
        os._exit(0)
print("DONE", flush=True)
'''


def test_ranks_that_exited_are_named(tmp_path):
    """Rank 0 gathers once more and the others' programs end: rank 0 raises within the bound,
    naming them as exited and their last collective, instead of waiting for the group timeout
    (the "did not join" message names them alike when gloo notices the closed connections first)."""
    script = tmp_path / "exiting.py"
    script.write_text(_EXITING)
    codes, outs = launch_processes(script, 4, timeout=240)
    assert codes == [0] * 4, (codes, outs)
    line = [out for out in outs[0].splitlines() if out.startswith("RAISED")]
    assert line, outs[0]
    _, waited, kind, message = line[0].split(" ", 3)
    # whichever comes first: the exchange (DesyncError), or gloo noticing the closed connection
    assert kind in ("DesyncError", "CollectiveFailedError"), line
    assert float(waited) < BOUND + MARGIN, line
    assert "rank 0: in all_gather #3" in message and "exiting.py:13" in message, message
    assert "ranks 1-3: exited (last collective: all_reduce #2" in message, message


def _check_mode_names_collectives_not_from_local():
    """Under check_collectives, ranks in different collectives are told so (with their lines),
    not that from_local was misused: the program never called it."""
    from dtensor_lite.debug import check_collectives
    with _fresh_group(), check_collectives():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)])
        try:
            if dist.get_rank() == 0:
                x.full_tensor()  # checked extra
            (x * 2).sum(0).full_tensor()  # checked every
        except ValueError as e:
            return str(e)


def test_check_mode_hint_names_the_collectives():
    messages = run_distributed(4, _check_mode_names_collectives_not_from_local, timeout=180)
    for m in messages:
        assert "all_reduce on ranks 1-3 vs all_gather on rank 0" in m, m
        assert _line_of("checked extra") in m and _line_of("checked every") in m, m
        assert "from_local" not in m, m


def test_ranks_are_named_as_runs():
    from dtensor_lite._rank_text import grouped_by, ranks_text
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([2, 0, 1, 5, 7, 6]) == "ranks 0-2, 5-7"
    assert ranks_text([0, 2]) == "ranks 0, 2"
    assert grouped_by({0: "a", 1: "b", 2: "b", 3: "b"}) == "b on ranks 1-3 vs a on rank 0"


def test_a_bound_that_is_no_number_is_refused():
    import subprocess
    import sys

    from tests.harness import REPO_ROOT
    out = subprocess.run([sys.executable, "-c", "import dtensor_lite"], capture_output=True,
                         text=True, env={"PYTHONPATH": REPO_ROOT, "DTL_DESYNC_SECONDS": "soon",
                                         "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0
    assert "DTL_DESYNC_SECONDS='soon': expected a number of seconds (0 turns it off)" in \
        out.stderr, out.stderr


def test_every_issued_collective_has_the_name_a_user_knows():
    """Every function collectives.py hands to ``_issue`` reads, in a desync report and the
    agreement check, as the collective a user knows (``all_gather``, not a private helper):
    the general case, read from the source, not a list kept beside it."""
    import re

    from dtensor_lite import _desync, collectives
    source = Path(collectives.__file__).read_text()
    issued = set(re.findall(r"_issue\(\s*(?:dist\.)?([A-Za-z_]\w*)", source)) - {"collective"}
    assert {"_broadcast_pieces", "_all_reduce_in_place", "all_to_all_single"} <= issued
    for name in issued:
        fn = getattr(collectives, name, None) or getattr(dist, name)
        plain = _desync.plain_name(collectives.name_of(fn))
        assert not plain.startswith("_"), (name, plain)
        assert collectives.name_of(fn) in _desync.ISSUED_AS, name  # reports and row codes
