"""A caller that never imported torch gets workers from the light forkserver (no torch):
the forkserver asked for (by default, workers fork from a caller where that is safe).

Each case runs in a fresh interpreter (this test process has torch loaded, which always
selects the torch forkserver). What must hold: the work runs without torch until it imports
it; torch imported by the work gets the worker's thread budget and seed, so a seeded run
equals the inline one; after that every later pool forks with torch preloaded; failures and
shutdown behave as with the torch forkserver, and nothing outlives the caller.
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
    import json, os, sys
    import psutil
    from easycore import WorkerDied, producer
    import easycore._exec.process.startup as ex
    from easycore._devices import cpu_count

    out = {}

    def probe(x):
        import os, sys
        return ("torch" in sys.modules, os.getpid())

    def lazy(x):
        import torch
        return (torch.get_num_threads(), torch.rand(3).tolist())

    def dies(x):
        if x == 3:
            os._exit(7)
        return x

    def first_draw(x, *, worker):
        import torch
        return (worker, torch.rand(1).item())

    out["torch_in_caller"] = "torch" in sys.modules
    out["probe"] = producer(probe).map(range(4), devices=2, start_method="forkserver")
    out["light_server"] = ex._LIGHT_SERVER is not None
    try:
        producer(dies).map(range(8), devices=2, start_method="forkserver")
    except WorkerDied as exc:
        out["died"] = str(exc)
    out["budget"] = max(1, cpu_count() // 2)
    light = {"start_method": "forkserver"}
    out["seeded"] = producer(lazy).map(range(6), devices=2, seed=5, **light)  # light workers
    out["torch_seen"] = ex._TORCH_SEEN
    out["after"] = producer(probe).map(range(4), devices=2, start_method="forkserver")
    out["torch_in_caller_after"] = "torch" in sys.modules
    ex._TORCH_SEEN = False  # light workers again, importing torch by themselves
    with producer(first_draw).open(devices=2, start_method="forkserver") as runner:
        out["unseeded"] = runner.map(range(8))
    out["inline"] = producer(lazy).map(range(6), devices="inline", seed=5)
    services = {ex._LIGHT_SERVER._forkserver_pid}
    import multiprocessing.forkserver as fs, multiprocessing.resource_tracker as rt
    services.add(fs._forkserver._forkserver_pid)
    services.add(rt._resource_tracker._pid)
    def running(p):
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:  # gone between the listing and the look
            return False
    out["left"] = [p.pid for p in psutil.Process().children(recursive=True)
                   if p.pid not in services and running(p)]
    print(json.dumps(out))
    """
)


def run_script(script: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": PKG + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def light() -> dict:
    return run_script(SCRIPT)


class TestLightForkserver:
    def test_work_runs_without_torch(self, light):
        assert not light["torch_in_caller"]
        assert light["light_server"]
        assert [has for has, _ in light["probe"]] == [False] * 4

    def test_torch_imported_by_the_work_gets_the_thread_budget(self, light):
        assert {threads for threads, _ in light["seeded"]} == {light["budget"]}

    def test_seeded_run_equals_inline(self, light):
        """torch first imported by an item is seeded for that item, in workers and inline."""
        assert [draws for _, draws in light["seeded"]] == [draws for _, draws in light["inline"]]

    def test_unseeded_workers_draw_different_streams(self, light):
        """Lazily imported torch is seeded from each worker's entropy, not torch's constant."""
        first: dict[int, float] = {}
        for worker, draw in light["unseeded"]:
            first.setdefault(worker, draw)
        assert len(first) == 2, light["unseeded"]
        a, b = first.values()
        assert a != b

    def test_later_pools_fork_with_torch(self, light):
        """Once a worker loaded torch, later pools start with torch preloaded."""
        assert light["torch_seen"]
        assert not light["torch_in_caller_after"]
        assert [has for has, _ in light["after"]] == [True] * 4

    def test_death_is_reported(self, light):
        assert "code 7" in light["died"], light["died"]

    def test_nothing_left_but_the_services(self, light):
        assert light["left"] == []


KILLED = textwrap.dedent(
    """
    import os, sys, time
    from easycore import producer
    import easycore._exec.process.startup as ex

    def slow(x):
        os.write(1, b"busy\\n")  # one write: the two workers' lines never interleave
        time.sleep(100)

    runner = producer(slow).open(devices=2, start_method="forkserver")
    pids = [w.proc.pid for w in runner._engine.workers.workers]
    print(ex._LIGHT_SERVER._forkserver_pid, *pids, flush=True)
    print(ex._LIGHT_SERVER._forkserver_address, flush=True)
    runner.map(range(4))
    """
)


def test_killed_caller_leaves_no_light_forkserver():
    """SIGKILL of the caller: its workers and the light forkserver exit by themselves, and
    the forkserver's listening socket and its /tmp/pymp-* directory go with them."""
    env = {**os.environ, "PYTHONPATH": PKG + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 3  # printed once every worker is ready
    listener = proc.stdout.readline().strip()
    assert os.path.exists(listener)
    # both workers inside `slow` (they share the caller's stdout): busy, not idle, when killed
    assert [proc.stdout.readline(), proc.stdout.readline()] == ["busy\n", "busy\n"]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    proc.stdout.close()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if running(p)]
        time.sleep(0.05)
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    assert alive == [], "outlived the caller"
    assert not os.path.exists(listener)
    assert not os.path.exists(os.path.dirname(listener))


CONCURRENT = textwrap.dedent(
    """
    import json, sys, threading
    import multiprocessing.forkserver as fs, multiprocessing.spawn as sp
    from easycore import producer

    connect, prepare = fs.connect_to_new_process, sp.get_preparation_data

    def probe(x):
        import sys
        return "torch" in sys.modules

    def loop():
        for _ in range(4):
            producer(probe).map(range(4), devices=2)

    threads = [threading.Thread(target=loop) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {"restored": fs.connect_to_new_process == connect
           and sp.get_preparation_data == prepare}
    it = producer(lambda x: x).open(devices="inline").imap(range(5), seed=1)
    next(it)  # a seeded inline run, left half-consumed
    out["hooks_left"] = [type(f).__name__ for f in sys.meta_path
                         if type(f).__name__ == "_AfterImport"]
    import torch
    out["after_torch"] = producer(probe).map(range(4), devices=2)
    print(json.dumps(out))
    """
)


def test_concurrent_starts_leave_multiprocessing_as_it_was():
    """Pools started from several threads at once: multiprocessing's own functions are put
    back (else every later process, ours with torch or the user's, would come from the light
    forkserver); a half-consumed seeded inline run leaves no import hook behind."""
    out = run_script(CONCURRENT)
    assert out["restored"]
    assert out["hooks_left"] == []
    assert out["after_torch"] == [True] * 4
