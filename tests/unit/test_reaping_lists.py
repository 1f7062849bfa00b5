"""The processes below a process, from the kernel's per-thread lists of children, agree with
a full scan of /proc (the fallback where a kernel has no such lists)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from easycore import _reaping

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc")


def test_children_and_descendants_agree_with_a_scan_of_proc(monkeypatch):
    # a child that has a child of its own, and a child that has exited (a zombie, unreaped)
    tree = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '30'])"],
    )
    done = subprocess.Popen(["true"])
    below: list[int] = []
    ours = {tree.pid, done.pid}  # (this process may have other children: a forkserver...)
    try:
        os.waitid(os.P_PID, done.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        deadline = time.monotonic() + 30
        while not below and time.monotonic() < deadline:  # (its own child starts)
            time.sleep(0.01)
            below = _reaping.descendants([tree.pid])
        listed = (ours & set(_reaping.children(os.getpid())), sorted(below))
        monkeypatch.setattr(_reaping, "_listed", lambda pid: None)  # the scan
        scanned = (ours & set(_reaping.children(os.getpid())), _reaping.descendants([tree.pid]))
        assert listed[0] == scanned[0] == ours
        assert listed[1] == sorted(scanned[1])
        assert len(below) == 1  # the sleep below the child
    finally:
        _reaping.end_processes(below)
        for p in (tree, done):
            p.kill()
            p.wait()


def test_ticks_now_is_no_later_than_a_process_started_after_it():
    before = _reaping.ticks_now()
    p = subprocess.Popen(["sleep", "1"])
    try:
        started = _reaping.start_time(p.pid)
        assert before is not None and started is not None
        assert 0 <= started - before <= 100  # (ticks: a second at most, on a slow machine)
    finally:
        p.kill()
        p.wait()
