"""Workers fork from the caller when that is safe, and come from the forkserver when not.

Each case runs a fresh caller script (pytest itself keeps a watchdog thread, which rules a
fork out): the script reports whether every worker's parent is the caller (forked) and
whether the results are right. A fork where it is unsafe would hang the worker (an OpenMP
pool that ran in the caller) or inherit a lock; the forkserver is then taken.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import running

pytestmark = pytest.mark.timeout(120)

PKG = str(Path(__file__).resolve().parents[2] / "pkg")

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, threading
    case = sys.argv[1]
    # the caller's own handler, which its workers must not run (a forked one would inherit it)
    signal.signal(signal.SIGTERM, lambda *_: print("the caller's handler ran"))
    if case != "bare":
        import numpy, torch
    from easycore import producer

    @producer
    def parent(x):
        if case == "omp":  # a parallel op in a worker whose caller ran one (2 threads here)
            a = torch.ones(300, 300)
            x = x + int((a @ a)[0, 0].item()) * 0
        return (x * 2, os.getppid(), signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)

    @producer
    def inc(x):
        return x + 1

    opts = {}
    run = parent
    devices = 2
    if case == "thread":  # a thread of the caller's own, running
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
    elif case == "omp":  # torch's OpenMP pool has run in the caller
        a = torch.ones(500, 500)
        (a @ a).sum()
        devices = 1
    elif case == "asked":
        opts = {"start_method": "forkserver"}
    elif case == "pools":  # several pools: their workers pass chunks over their own pipes
        run = inc.on(1) >> parent.on(1)
    elif case == "recycle":  # replaced workers fork too, and nothing is lost or doubled
        opts = {"max_items_per_worker": 3}
    elif case == "cuda":
        torch.cuda.init()
        devices = ["cuda:0"]
    items = list(range(20))
    if case == "pools":
        out = run.map(items)
    else:
        out = run.map(items, devices=devices, **opts)
    base = 1 if case == "pools" else 0
    ok = [y for y, _, _ in out] == [(x + base) * 2 for x in items] and all(d for *_, d in out)
    print(json.dumps({"forked": all(p == os.getpid() for _, p, _ in out), "ok": ok}))
    """
)


def run_case(case: str) -> dict[str, bool]:
    env = {**os.environ, "PYTHONPATH": PKG + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, case], capture_output=True, text=True, timeout=90, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Warning" not in out.stderr, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["bare", "torch", "recycle"])
def test_a_caller_with_no_other_thread_forks_its_workers(case):
    """No thread but the caller's (numpy's and torch's idle OpenBLAS pool aside): a fork,
    whose worker does not keep the caller's signal handlers (as a forkserver's would not)."""
    assert run_case(case) == {"forked": True, "ok": True}


@pytest.mark.parametrize("case", ["thread", "omp", "asked", "pools"])
def test_where_a_fork_is_unsafe_or_not_asked_for_the_forkserver_starts_them(case):
    """A running thread, torch's OpenMP pool after a parallel op (whose worker would hang
    on its first parallel op after a fork), a start method asked for, several pools."""
    assert run_case(case) == {"forked": False, "ok": True}


@pytest.mark.gpu
def test_gpu_workers_do_not_fork():
    """GPU workers come from the forkserver: here the caller even initialised CUDA."""
    assert run_case("cuda") == {"forked": False, "ok": True}


KILLED = textwrap.dedent(
    """
    import os, sys, time
    from easycore import producer
    pids = sys.argv[1]

    def init(worker):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()} {os.getppid()}\\n")

    @producer(init=init)
    def slow(x):
        time.sleep(100)
        return x

    with slow.open(devices=2):  # another runner's workers, started before
        slow.map(range(4), devices=2)  # this run's workers fork while those live
    """
)


def test_forked_workers_of_two_runners_all_end_when_the_caller_is_killed(tmp_path):
    """A forked worker lets go of the caller's ends of every worker's pipe (its own and the
    other runner's): when the caller is SIGKILLed each worker sees its pipe close, and no
    worker is left behind."""
    pids = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": PKG + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(pids)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if pids.exists() and len(pids.read_text().split("\n")) > 4:
                break
            time.sleep(0.05)
        rows = [line.split() for line in pids.read_text().splitlines()]
        assert len(rows) == 4, rows
        assert all(int(ppid) == proc.pid for _, ppid in rows), "expected forked workers"
        workers = [int(pid) for pid, _ in rows]
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(running(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in workers if running(p)]
        assert not left, f"workers outlived their killed caller: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
