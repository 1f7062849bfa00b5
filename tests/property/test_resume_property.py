"""Property: with errors="skip" and resume=, a caller killed at any point and run again
delivers exactly the items that did not fail, each once, equal to the fault-free results,
and the ledger's failures are exactly the injected ones."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import ledger_rows

N = 60

JOB = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from easycore import producer

    faults = {int(k): v for k, v in json.loads(sys.argv[1]).items()}
    db, N = sys.argv[2], int(sys.argv[3])

    @producer
    def work(x):
        time.sleep(0.003)
        how = faults.get(x)                  # poison: fails every time it runs
        if how == "raise":
            raise ValueError(f"poison {x}")
        if how == "exit":
            os._exit(5)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        return x * 3 + 1

    failed = []
    out = work.map(range(N), devices=2, retries=1, errors="skip", on_error=failed.append,
                   resume=db)
    print("RESULT", json.dumps({"out": out, "failed": [f.index for f in failed]}), flush=True)
    """
)


@pytest.mark.timeout(300)
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    faults=st.dictionaries(
        st.integers(0, N - 1), st.sampled_from(["raise", "exit", "sigkill"]), max_size=4
    ),
    kill_after=st.integers(0, N - 5),
)
def test_killed_anywhere_then_resumed(tmp_path_factory, faults, kill_after):
    """Run, SIGKILL the caller once the ledger holds `kill_after` units, run again."""
    tmp = tmp_path_factory.mktemp("resume")
    script, db = tmp / "job.py", tmp / "run.db"
    script.write_text(JOB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, str(script), json.dumps(faults), str(db), str(N)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while proc.poll() is None and ledger_rows(db) < kill_after and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.kill()
    proc.communicate(timeout=30)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    got = json.loads(line.split(" ", 1)[1])
    assert got["out"] == [x * 3 + 1 for x in range(N) if x not in faults]
    assert sorted(got["failed"]) == sorted(faults)
    with contextlib.closing(sqlite3.connect(db)) as con:
        recorded = {k for (k,) in con.execute("SELECT key FROM units WHERE error IS NOT NULL")}
        assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert recorded == {f"i:{x}" for x in faults}
