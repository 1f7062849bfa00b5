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

from easycore import producer
from helpers import running

pytestmark = pytest.mark.timeout(120)

PKG = str(Path(__file__).resolve().parents[2] / "pkg")

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, threading
    # the caller's own handler, which its workers must not run (a forked one would inherit it)
    signal.signal(signal.SIGTERM, lambda *_: print("the caller's handler ran"))
    from easycore import producer

    case = None

    @producer
    def parent(x):
        if case == "omp":  # a parallel op in a worker whose caller ran one (2 threads here)
            a = torch.ones(300, 300)
            x = x + int((a @ a)[0, 0].item()) * 0
        if case == "nested":  # easycore inside a worker (nothing held locked by the fork)
            x = inc.map([x], devices=1)[0] - 1
        same = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        same = same and os.environ.get("EC_CASE") == case  # the caller's environment, now
        return (x * 2, os.getppid(), same)

    @producer
    def inc(x):
        return x + 1

    # cases in one caller, in this order: what each does to the caller stays done
    kept = []
    for case in sys.argv[1:]:
        os.environ["EC_CASE"] = case
        opts = {}
        run = parent
        devices = 2
        if case == "torch":
            import numpy, torch
        elif case == "thread":  # a thread of the caller's own, running
            stop = threading.Event()
            threading.Thread(target=stop.wait, daemon=True).start()
        elif case == "omp":  # torch's OpenMP pool has run in the caller
            a = torch.ones(500, 500)
            (a @ a).sum()
            devices = 1
        elif case == "file":  # a file the caller keeps open (one offset for every fork)
            kept.append(open(sys.executable, "rb"))
        elif case == "asked":
            opts = {"start_method": "forkserver"}
        elif case == "pools":  # several pools: their workers pass chunks over their own pipes
            run = inc.on(1) >> parent.on(1)
        elif case == "recycle":  # replaced workers fork too, and nothing is lost or doubled
            opts = {"max_items_per_worker": 3}
        elif case == "closed":  # a closed runner the caller keeps: its pipes are closed
            closed = inc.open(devices=1)
            closed.map([1])
            closed.close()
            kept.append(closed)
        elif case == "cuda":
            torch.cuda.init()
            devices = ["cuda:0"]
        items = [1, 2] if case == "nested" else list(range(20))
        if case == "pools":
            out = run.map(items)
        else:
            out = run.map(items, devices=devices, **opts)
        base = 1 if case == "pools" else 0
        ok = [y for y, _, _ in out] == [(x + base) * 2 for x in items] and all(d for *_, d in out)
        forked = {p == os.getpid() for _, p, _ in out}
        forked = "mixed" if len(forked) > 1 else forked.pop()
        print(json.dumps([case, {"forked": forked, "ok": ok}]), flush=True)
    """
)


def run_cases(*cases: str) -> dict[str, dict[str, bool]]:
    """Each case's outcome: whether its workers were forks of the caller, and right."""
    env = {**os.environ, "PYTHONPATH": PKG + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, *cases], capture_output=True, text=True, timeout=90, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Warning" not in out.stderr, out.stderr[-3000:]
    return dict(json.loads(line) for line in out.stdout.split("\n") if line.startswith("["))


def test_a_fork_where_it_is_safe_and_the_forkserver_where_not():
    """No thread but the caller's (numpy's and torch's idle OpenBLAS pool aside) and no
    descriptor but its standard streams: a fork, whose worker keeps neither the caller's
    signal handlers nor any lock it held (easycore runs inside it), and sees the caller's
    environment as a forkserver's worker does; so does a worker that replaces one (the
    others' pipes are easycore's own), and a worker started after a run (its worker set
    gone with its runner, or kept closed by the caller: its pipes, closed, no longer count
    as easycore's). The forkserver for: a start
    method asked for, several pools, torch's OpenMP pool after a parallel op (a worker
    forked then would hang on its first parallel op, here after earlier forks stopped
    OpenBLAS's pool), a file the caller keeps open, a running thread."""
    got = run_cases("bare", "torch", "nested", "recycle", "closed", "asked", "pools", "omp")
    fork, server = {"forked": True, "ok": True}, {"forked": False, "ok": True}
    assert got == {
        "bare": fork,
        "torch": fork,
        "nested": fork,
        "recycle": fork,
        "closed": fork,
        "asked": server,
        "pools": server,
        "omp": server,
    }
    got = run_cases("torch", "file", "thread")
    assert got == {"torch": fork, "file": server, "thread": server}


@pytest.mark.gpu
def test_gpu_workers_do_not_fork():
    """GPU workers come from the forkserver: here the caller even initialised CUDA."""
    assert run_cases("torch", "cuda")["cuda"] == {"forked": False, "ok": True}


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


_HELD: list = []  # the caller's memory (a module's global: not pickled, inherited)


def _pid(x):
    return os.getpid() + int(_HELD[0][x]) * 0


def test_a_forked_worker_is_not_over_the_memory_bound_by_the_callers_memory():
    """A worker forked from a caller that holds 300 MB maps all of it; the bound counts the
    worker's own memory, so it is not replaced after every chunk (it was: 20 processes)."""
    import numpy as np

    _HELD.append(np.ones(300 * 2**20 // 8))  # touched: resident in the caller
    try:
        out = producer(_pid).map(
            range(40), devices=2, start_method="fork", max_worker_memory="200MiB"
        )
    finally:
        _HELD.clear()
    assert len(set(out)) == 2


def test_an_openblas_that_hides_its_shutdown_is_paused_by_its_own_fork_handler():
    """numpy's OpenBLAS since 2.3 exports no blas_thread_shutdown_: its idle pool is then
    stopped by a fork that exits at once (OpenBLAS's fork handler), so a caller that used
    numpy still forks its workers."""
    code = textwrap.dedent(
        """
        import ctypes, os, sys
        import numpy as np
        a = np.ones((300, 300)); (a @ a).sum()  # OpenBLAS's pool is up
        real = ctypes.CDLL
        class Hiding(real):  # a build that does not export the shutdown
            def __getattr__(self, name):
                if name == "blas_thread_shutdown_":
                    raise AttributeError(name)
                return super().__getattr__(name)
        ctypes.CDLL = Hiding
        from easycore._exec.process.startup import fork_is_safe
        before = len(os.listdir("/proc/self/task"))
        print(before, fork_is_safe(), len(os.listdir("/proc/self/task")))
        """
    )
    env = {**os.environ, "PYTHONPATH": PKG + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    before, safe, after = out.stdout.split()
    assert int(before) > 1 and safe == "True" and after == "1"
