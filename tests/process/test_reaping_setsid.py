"""What a producer starts in a session of its own (``setsid``) or as a daemon ends with its
worker, whatever ``start_method`` and however the worker ends (contract section 8; issue
#40, point 15): with ``spawn`` and ``fork`` the caller is the workers' parent, and ends
what a dead worker left it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from easycore import ItemTimeout, WorkerDied, producer
from helpers import running, wait_for

METHODS = [None, "spawn", "fork"]

DAEMON = (  # forks a child in a session of its own, says its pid and leaves it orphaned
    "import os, time\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    print(os.getpid(), flush=True)\n"
    "    os.close(1)\n"
    "    time.sleep(600)\n"
)


def start_and_end(path: str, how: str):
    """A producer that starts a program in a session of its own and a daemon, writes their
    pids to ``path``, then ends its worker ``how``: os._exit, SIGKILL, or hanging."""

    @producer
    def work(x):
        import time

        session = subprocess.Popen(["sleep", "600"], start_new_session=True)
        daemon = subprocess.run(
            [sys.executable, "-c", DAEMON], stdout=subprocess.PIPE, text=True, check=True
        ).stdout
        with open(path + ".tmp", "w") as f:
            f.write(f"{session.pid} {int(daemon)}")
        os.rename(path + ".tmp", path)
        if how == "exit":
            os._exit(1)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)

    return work


def left_here(pids) -> list[int]:
    """Those of ``pids`` that are zombies this process adopted and did not reap."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).ppid() == os.getpid():
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("how", ["exit", "kill"])
@pytest.mark.parametrize("start_method", METHODS)
def test_a_session_child_ends_with_a_worker_that_dies(tmp_path, start_method, how):
    """A worker that dies on its own (os._exit, SIGKILL) takes its setsid child and its
    daemon with it, also when it was spawned or forked (then the caller reaps them)."""
    path = str(tmp_path / "pids")
    with pytest.raises(WorkerDied):
        start_and_end(path, how).map([0], devices=1, start_method=start_method)
    pids = [int(p) for p in Path(path).read_text().split()]
    try:
        assert wait_for(lambda: not any(running(p) for p in pids), 5), "a session child lives"
        assert wait_for(lambda: not left_here(pids), 5), "zombies left in the caller"
    finally:
        for pid in pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_session_child_ends_with_a_forked_worker_killed_for_a_timeout(tmp_path):
    """The caller kills a worker whose item ran past its timeout: its setsid child and
    daemon go too, reaped by the caller that adopts them."""
    path = str(tmp_path / "pids")
    with pytest.raises(ItemTimeout):
        start_and_end(path, "hang").map([0], devices=1, start_method="fork", timeout=2)
    pids = [int(p) for p in Path(path).read_text().split()]
    assert wait_for(lambda: not any(running(p) for p in pids), 5), "a session child lives"
    assert wait_for(lambda: not left_here(pids), 5), "zombies left in the caller"


def test_the_callers_own_session_child_is_left_alone(tmp_path):
    """A process the caller started itself, in a session of its own, outlives a spawned
    worker's death: only what the worker started is ended."""
    own = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        with pytest.raises(WorkerDied):
            start_and_end(str(tmp_path / "pids"), "exit").map([0], devices=1, start_method="fork")
        assert own.poll() is None, "the caller's own process was killed"
    finally:
        own.kill()
        own.wait()
