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

pytestmark = pytest.mark.timeout(90)

PKG = str(Path(__file__).resolve().parents[2] / "pkg")

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from easycore import producer

    pids, mode = sys.argv[1], sys.argv[2]

    def init(worker):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\\n")

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
    else:
        print(slow.map(range(1000), devices=2))
    """
)
MODES = {"one": 2, "pools": 3}  # mode -> workers it starts


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
    assert wait_for(lambda: pids.exists() and len(pids.read_text().split()) == MODES[mode], 60), (
        "workers never started"
    )
    time.sleep(0.3)  # let them get into their long items
    return proc, pids


def worker_pids(pids: Path) -> list[int]:
    return [int(p) for p in pids.read_text().split()]


def all_gone(pids: list[int]) -> bool:
    return not any(
        psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids
    )


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
