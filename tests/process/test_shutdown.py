"""Ctrl-C and a killed caller, each in a fresh interpreter: workers never outlive the caller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from helpers import running

pytestmark = pytest.mark.timeout(90)

PKG = str(Path(__file__).resolve().parents[2] / "pkg")

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from easycore import producer

    pids, mode = sys.argv[1], sys.argv[2]

    def init(worker):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\\n")
        if mode == "init":  # Ctrl-C comes while every worker is still in its init
            time.sleep(100)
        if mode == "deaf":  # the work ignores the signals a stop could send
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def end():
        with open(pids + ".end", "a") as f:
            f.write(f"{os.getpid()}\\n")

    @producer(init=init, end=end)
    def slow(x):
        time.sleep(0.05 if x % 2 else 100)
        return x

    @producer(init=init, end=end)
    def first(x):
        return x

    if mode == "pools":  # 1 + 2 workers: items go worker to worker
        print((first.on(1) >> slow.on(2)).map(range(1000)))
    elif mode == "idle":  # worker 0 on a long item, worker 1 with nothing to do
        print(slow.map([0], devices=2))
    elif mode in ("init", "deaf"):
        print(slow.map(range(0, 1000, 2), devices=3))  # long items only
    else:
        print(slow.map(range(1000), devices=2))
    """
)
MODES = {"one": 2, "pools": 3}  # mode -> workers it starts
STUCK = {"init": 3, "deaf": 3, "idle": 2}  # modes of TestCtrlCPromptly -> workers


def wait_for(cond, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], Path]:
    pids = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": PKG + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(pids), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # our own process group, like a terminal's foreground job
    )
    n = {**MODES, **STUCK}[mode]
    assert wait_for(lambda: pids.exists() and len(pids.read_text().split()) == n, 60), (
        "workers never started"
    )
    time.sleep(0.3)  # let them get into their long items
    return proc, pids


def worker_pids(pids: Path) -> list[int]:
    return [int(p) for p in pids.read_text().split()]


def all_gone(pids: list[int]) -> bool:
    return not any(running(p) for p in pids)


@pytest.mark.parametrize("mode", list(MODES))
class TestCtrlC:
    def test_keyboard_interrupt_stops_everything(self, tmp_path, mode):
        """Ctrl-C (SIGINT to the group): KeyboardInterrupt in the caller, workers gone in 5 s."""
        proc, pids = start(tmp_path, mode)
        workers = worker_pids(pids)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=15)
        finally:
            proc.kill()
        assert "KeyboardInterrupt" in err
        assert proc.returncode != 0
        assert wait_for(lambda: all_gone(workers), 5), "workers outlived Ctrl-C"
        # workers that were between items ran `end` (the sleeping ones are killed after a grace)
        assert "Traceback" in err and "WorkerError" not in err


@pytest.mark.parametrize("mode", list(MODES))
class TestKilledCaller:
    def test_workers_exit_when_caller_is_killed(self, tmp_path, mode):
        """SIGKILL of the caller: its workers notice and exit on their own (no orphans)."""
        proc, pids = start(tmp_path, mode)
        workers = worker_pids(pids)
        proc.kill()
        proc.communicate(timeout=10)
        assert wait_for(lambda: all_gone(workers), 10), "orphaned workers"
        for p in workers:
            if psutil.pid_exists(p):
                os.kill(p, signal.SIGKILL)


class TestCtrlCPromptly:
    @pytest.mark.parametrize("mode", ["init", "deaf"])
    def test_workers_that_cannot_end_are_not_waited_for(self, tmp_path, mode):
        """Ctrl-C while every worker is in `init`, or in a long item of work that ignores
        SIGINT and SIGTERM: none of them could run `end` soon, so none is waited for; the
        caller is out well within the grace `end` gets (2 s), and every worker is gone."""
        proc, pids = start(tmp_path, mode)
        workers = worker_pids(pids)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=15)
        finally:
            proc.kill()
        took = time.monotonic() - t0
        assert "KeyboardInterrupt" in err
        assert wait_for(lambda: all_gone(workers), 5), "workers outlived Ctrl-C"
        assert not (tmp_path / "pids.end").exists()  # killed: no `end` ran
        # (before, the grace and then half a second per worker: 3.5 s for these three)
        assert took < 2.0, f"the caller took {took:.1f} s to stop after Ctrl-C"

    def test_an_idle_worker_still_runs_end(self, tmp_path):
        """Ctrl-C: a worker with nothing in hand still runs `end`; the busy one is killed."""
        proc, pids = start(tmp_path, "idle")
        workers = worker_pids(pids)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=15)
        finally:
            proc.kill()
        assert "KeyboardInterrupt" in err
        assert wait_for(lambda: all_gone(workers), 5), "workers outlived Ctrl-C"
        ended = [int(p) for p in (tmp_path / "pids.end").read_text().split()]
        assert len(ended) == 1 and ended[0] in workers


class TestFreshScript:
    @pytest.mark.parametrize("imported_torch", [False, True])
    def test_a_script_runs_one_shot_maps_one_after_another(self, imported_torch):
        """A fresh script's one-shot maps, one after another, each on new workers: a worker
        tidying its own temporary files never touches the caller's (once it removed the
        directory of the caller's forkserver socket, and the next map could not start)."""
        code = textwrap.dedent(
            f"""
            {"import torch" if imported_torch else ""}
            from easycore import producer
            square = producer(lambda x: x * x)
            for _ in range(4):
                assert square.map(range(10), devices=2) == [x * x for x in range(10)]
            print("ok")
            """
        )
        env = {**os.environ, "PYTHONPATH": PKG + os.pathsep + os.environ.get("PYTHONPATH", "")}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == "ok"
