"""Property (API.md section 10): a job writing Parquet with resume= and errors="skip", its
caller SIGKILLed at a random moment and the same call run again, leaves committed files that
together hold every item that succeeded exactly once, no poisoned item, and no ``.``-file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import ledger_rows

N = 60

JOB = textwrap.dedent(
    """
    import json, os, sys, time
    from easycore import producer, write

    poison = set(json.loads(sys.argv[1]))
    db, out, N = sys.argv[2], sys.argv[3], int(sys.argv[4])

    @producer
    def work(x):
        time.sleep(0.004)
        if x in poison:
            raise ValueError(f"poison {x}")
        return {"x": x, "y": x * 3 + 1}

    sink = write.parquet(out, rows_per_file=5)
    failed = []
    w = (work >> sink).map(range(N), devices=2, errors="skip", on_error=failed.append,
                           resume=db)
    print("RESULT", json.dumps({"files": list(w.files), "rows": w.rows,
                                "failed": [f.index for f in failed]}), flush=True)
    """
)


@pytest.mark.timeout(300)
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    poison=st.sets(st.integers(0, N - 1), max_size=3),
    kill_after=st.integers(0, N - 5),
    extra=st.floats(0, 0.05),
)
def test_caller_killed_anywhere_then_resumed(tmp_path_factory, poison, kill_after, extra):
    tmp = tmp_path_factory.mktemp("write")
    script, db, out = tmp / "job.py", tmp / "run.db", tmp / "out"
    script.write_text(JOB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, str(script), json.dumps(sorted(poison)), str(db), str(out), str(N)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while proc.poll() is None and ledger_rows(db) < kill_after and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(extra)  # (anywhere between two commits, or during one)
    proc.kill()
    proc.communicate(timeout=30)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[7:])
    want = [x for x in range(N) if x not in poison]
    assert sorted(got["failed"]) == sorted(poison)
    on_disk = sorted(os.listdir(out))
    assert not [n for n in on_disk if n.startswith(".")]  # no temporary file left
    assert [os.path.basename(f) for f in got["files"]] == on_disk  # every file is committed
    rows = [r for f in got["files"] for r in pq.read_table(f).to_pylist()]
    assert sorted(r["x"] for r in rows) == want  # each item that succeeded exactly once
    assert all(r["y"] == r["x"] * 3 + 1 for r in rows)
    assert got["rows"] == len(want)
