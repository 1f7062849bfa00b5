"""Soak: many items with ~1% random faults (raise, os._exit, SIGKILL), retries=3, on one pool
of 2 workers and on three pools (faults in every pool).

Short in CI; `EASYCORE_SOAK=20000 just soak` for a long run. Prints its figures.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from easycore import consumer, producer
from helpers import ledger_rows

ITEMS = int(os.environ.get("EASYCORE_SOAK", "2000"))


def faulty(tmp_path: Path, faults: dict[int, str], tag: str, fn):
    """`fn`, with the fault planned for an item injected the first time that item comes."""

    def work(x):
        how = faults.get(x)
        if how is not None:
            try:
                fd = os.open(tmp_path / f"{tag}-{x}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                how = None
            else:
                os.close(fd)
        if how == "raise":
            raise RuntimeError(f"fault at {x}")
        if how == "exit":
            os._exit(7)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(x)

    work.__name__ = f"work_{tag}"
    return producer(work)


def plan(seed: int) -> dict[int, str]:
    rng = random.Random(seed)
    return {
        i: rng.choice(["raise", "exit", "sigkill"]) for i in range(ITEMS) if rng.random() < 0.01
    }


def report(capsys, what: str, faults: dict[str, dict[int, str]], tmp_path: Path, wall: float):
    """Print what was injected (read back from the marker files) and how long it took."""
    done = [p.name.split("-") for p in tmp_path.iterdir()]
    kinds = {k: 0 for k in ("raise", "exit", "sigkill")}
    for tag, x in done:
        kinds[faults[tag][int(x)]] += 1
    with capsys.disabled():
        print(
            f"\nsoak ({what}): {ITEMS} items, {len(done)} faults injected {kinds}, "
            f"{len(done)} retries used, {wall:.2f} s wall"
        )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ordered", [True, False])
def test_soak_random_faults(tmp_path: Path, capsys, ordered):
    """With ~1% of items failing once, retries=3 gives exactly the fault-free result."""
    faults = plan(1234)
    collect = consumer(init=list)(lambda acc, y: acc.append(y))
    t0 = time.perf_counter()
    work = faulty(tmp_path, faults, "a", lambda x: x * x)
    out = (work >> collect).map(range(ITEMS), devices=2, retries=3, ordered=ordered)
    wall = time.perf_counter() - t0
    assert (out if ordered else sorted(out)) == [x * x for x in range(ITEMS)]
    injected = len(list(tmp_path.iterdir()))
    assert injected == len(faults)
    report(capsys, f"1 pool x 2 workers, ordered={ordered}", {"a": faults}, tmp_path, wall)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ordered", [True, False])
def test_soak_random_faults_in_every_pool(tmp_path: Path, capsys, ordered):
    """Three pools, ~1% faults in each: still exactly the fault-free result."""
    faults = [plan(1), plan(2), plan(3)]
    a = faulty(tmp_path, faults[0], "a", lambda x: x + 1)
    b = faulty(tmp_path, faults[1], "b", lambda x: x)
    c = faulty(tmp_path, faults[2], "c", lambda x: 2 * x)
    collect = consumer(init=list)(lambda acc, y: acc.append(y))
    t0 = time.perf_counter()
    pipeline = a.on(1) >> b.on(2) >> c.on(1) >> collect
    out = pipeline.map(range(ITEMS), retries=3, ordered=ordered)
    wall = time.perf_counter() - t0
    expected = [2 * (x + 1) for x in range(ITEMS)]
    assert (out if ordered else sorted(out)) == expected
    injected = len(list(tmp_path.iterdir()))
    # b and c see x + 1: a fault planned for ITEMS never comes, one for 0 neither
    expected = sum(1 for x in faults[0]) + sum(1 for f in faults[1:] for x in f if 1 <= x <= ITEMS)
    assert injected == expected
    tags = dict(zip("abc", faults, strict=True))
    what = f"3 pools: 1 + 2 + 1 workers, ordered={ordered}"
    report(capsys, what, tags, tmp_path, wall)


RESUMED_SOAK = """
import os, random, signal, sys, time
from easycore import consumer, producer

n, db, marks = int(sys.argv[1]), sys.argv[2], sys.argv[3]
rng = random.Random(77)
plan = {i: rng.choice(["raise", "exit", "sigkill"]) for i in range(n) if rng.random() < 0.01}
poison = set(sorted(plan)[::3])  # a third of the faults fail every time: set aside

def work(x):
    time.sleep(0.001)
    how = plan.get(x)
    if how is not None and x not in poison:  # the others fail once (a marker file each)
        try:
            os.close(os.open(os.path.join(marks, str(x)), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            how = None
    if how == "raise":
        raise RuntimeError(f"fault at {x}")
    if how == "exit":
        os._exit(7)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    return x * x

total = consumer(init=0)(lambda acc, y: acc + y)
failed = []
out = (producer(work) >> total).map(
    range(n), devices=2, retries=2, errors="skip", on_error=failed.append, resume=db
)
print("RESULT", out, ",".join(str(f.index) for f in failed), ",".join(map(str, sorted(poison))))
"""


@pytest.mark.timeout(900)
def test_soak_killed_and_resumed(tmp_path: Path, capsys):
    """~1% faults (a third of them poison: set aside), the caller killed three times and
    resumed each time: the fault-free sum over the items that are not poison."""
    import sqlite3
    import subprocess
    import sys

    script = tmp_path / "soak.py"
    script.write_text(RESUMED_SOAK)
    marks = tmp_path / "marks"
    marks.mkdir()
    db = tmp_path / "run.db"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, str(script), str(ITEMS), str(db), str(marks)]
    t0 = time.perf_counter()
    kills = 0
    while True:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        if kills < 3:
            # kill once the ledger holds more than it did: mid-run, after real progress
            before = ledger_rows(db)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                if ledger_rows(db) >= before + max(1, ITEMS // 8):
                    break
                time.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
                kills += 1
                proc.communicate(timeout=30)
                with sqlite3.connect(db) as con:
                    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
                continue
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0
        break
    wall = time.perf_counter() - t0
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    _, total, failed, poison = line.split(" ")
    poison_set = {int(x) for x in poison.split(",") if x}
    assert {int(x) for x in failed.split(",") if x} == poison_set
    assert int(total) == sum(x * x for x in range(ITEMS) if x not in poison_set)
    assert kills == 3
    with capsys.disabled():
        print(
            f"\nsoak (killed {kills} times, resumed): {ITEMS} items, {len(poison_set)} set "
            f"aside, {wall:.2f} s wall"
        )
