"""Shared test setup: hypothesis profiles, markers, and the leak check run after every test."""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, settings

import easycore._exec.process.startup

sys.path.insert(0, str(Path(__file__).parent))  # `from strategies import ...`

from helpers import HAS_CUDA  # (test modules import it from helpers too)

# the local HTTP server's fixtures (`server`), for the tests of stages that wait
pytest_plugins = ["local_http"]

# A suite started in the background by a script (`pytest &`) inherits SIGINT ignored, and so
# would every script a test starts and interrupts: the Ctrl-C tests would then hang on a
# child that never hears it. A handler here is reset to the default in every child at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=20, deadline=None)
settings.register_profile("thorough", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


def _service_pids() -> set[int]:
    """Long-lived helpers: the forkservers (multiprocessing's, easycore's light one) and the
    resource tracker."""
    pids = set()
    fs = getattr(multiprocessing.forkserver, "_forkserver", None)
    if fs is not None and getattr(fs, "_forkserver_pid", None):
        pids.add(fs._forkserver_pid)
    light = (
        easycore._exec.process.startup.light_forkserver_pid()
    )  # easycore's forkserver without torch
    if light is not None:
        pids.add(light)
    rt = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    if rt is not None and getattr(rt, "_pid", None):
        pids.add(rt._pid)
    return pids


def live_workers() -> list[psutil.Process]:
    """Descendants of this process that are not multiprocessing's service processes."""
    services = _service_pids()
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid in services or child.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            continue
        out.append(child)
    return out


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:  # pragma: no cover - not Linux
        return set()


def worker_tempdirs() -> set[str]:
    """The multiprocessing temporary directories workers made (``/tmp/pymp-easycore-*``)."""
    base = tempfile.gettempdir()
    return {name for name in os.listdir(base) if name.startswith("pymp-easycore-")}


def foreign(entry: str) -> bool:
    """True when the name embeds the pid of a live process outside this test run.

    Other programs on the machine (a benchmark of loky/joblib, say) create /dev/shm entries
    named after their pid while the suite runs; those are not ours to account for.
    """
    ours = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    for run in re.findall(r"\d{3,}", entry):
        pid = int(run)
        if pid not in ours and psutil.pid_exists(pid):
            return True
    return False


@pytest.fixture(autouse=True)
def no_leaks():
    """After every test: no worker process left, no new /dev/shm entry."""
    before_shm = shm_entries()
    before_dirs = worker_tempdirs()
    before = {p.pid for p in live_workers()}
    yield
    deadline = time.monotonic() + 10
    left = [p for p in live_workers() if p.pid not in before]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in live_workers() if p.pid not in before]
    for p in left:  # do not let one leak poison the following tests
        p.kill()
    assert not left, f"worker processes left behind: {[(p.pid, p.name()) for p in left]}"
    new_shm = {e for e in shm_entries() - before_shm if not foreign(e)}
    assert not new_shm, f"shared memory leaked: {sorted(new_shm)}"
    new_dirs = {d for d in worker_tempdirs() - before_dirs if not foreign(d)}
    assert not new_dirs, f"workers' temporary directories left: {sorted(new_dirs)}"


DEVICE_KINDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICE_KINDS)
def two_devices(request: pytest.FixtureRequest) -> list[str]:
    """Two workers on the CPU, or on the GPU(s) where CUDA exists."""
    if request.param == "cpu":
        return ["cpu", "cpu"]
    import torch

    n = torch.cuda.device_count()
    return ["cuda:0", f"cuda:{min(1, n - 1)}"]
