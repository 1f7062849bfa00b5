"""Small helpers shared by the process tests (importable in workers: conftest puts this
directory on sys.path, and workers receive the caller's sys.path)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def _cuda_available() -> bool:
    if not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidia0")):
        return False
    import torch

    return bool(torch.cuda.is_available())


HAS_CUDA = _cuda_available()  # (test modules import it from here: every conftest is "conftest")


def first_time(marker: Path) -> bool:
    """True the first time it is called for `marker` (across processes)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def ledger_rows(db: Path) -> int:
    """How many units a run ledger (``resume=``) holds; 0 before it exists."""
    import contextlib
    import sqlite3

    if not db.exists():
        return 0
    with contextlib.closing(sqlite3.connect(db)) as con:
        try:
            return int(con.execute("SELECT count(*) FROM units").fetchone()[0])
        except sqlite3.OperationalError:  # the table is not created yet
            return 0


def our_actors() -> list:
    """Live processes of easycore's Ray actors (Ray titles them ``ray::StageActor...``)."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if (p.info["cmdline"] or [""])[0].startswith("ray::StageActor"):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def running(pid: int) -> bool:
    """Whether process ``pid`` is alive and not a zombie (one that exits while asked: not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(condition, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def rebuild_away_from(pid: int, x: object) -> object:
    """Unpickles anywhere but in process ``pid`` (there it raises)."""
    if os.getpid() == pid:
        msg = f"{x!r} cannot be rebuilt in this process"
        raise RuntimeError(msg)
    return x


class HomeSick:
    """A result that unpickles in a worker but not in the calling process ``caller``."""

    rebuild = staticmethod(rebuild_away_from)

    def __init__(self, caller: int, x: object) -> None:
        self.caller, self.x = caller, x

    def __reduce__(self) -> tuple:
        return (self.rebuild, (self.caller, self.x))


def _refuse_to_load():
    raise RuntimeError("this object cannot be rebuilt here")


def die_away_from(pid: int, x: object) -> object:
    """Unpickles in process ``pid``; anywhere else it ends the process (exit code 5)."""
    if os.getpid() != pid:
        os._exit(5)
    return x


class KillsWhenUnpickled(HomeSick):
    """An item whose unpickling ends any process but the calling one (``caller``)."""

    rebuild = staticmethod(die_away_from)


class KillsWhenPickled:
    """A result whose pickling ends the process (exit code 6): made in a worker, it kills it
    as the worker sends it on."""

    def __reduce__(self):
        os._exit(6)


class Unloadable:
    """Pickles fine, fails when unpickled (anywhere)."""

    def __reduce__(self):
        return (_refuse_to_load, ())


def one_unloadable(n: int, at: int) -> list:
    """``range(n)`` with item ``at`` an :class:`Unloadable`: far enough in that its chunk
    holds other items (chunks grow as a run goes on)."""
    data: list = list(range(n))
    data[at] = Unloadable()
    return data


def load_slowly(value, seconds, marker):
    if marker is None or first_time(Path(marker)):
        time.sleep(seconds)
    return value


class SlowToLoad:
    """Pickles at once; unpickled (in the worker) it takes `seconds` (every time, or only the
    first time with `marker`), then is `value`."""

    def __init__(self, value, seconds, marker=None):
        self.value, self.seconds, self.marker = value, seconds, marker

    def __reduce__(self):
        return (load_slowly, (self.value, self.seconds, self.marker))


def running_ray(num_cpus: int):
    """A local Ray for a test module (the user's own: easycore leaves it running), as a
    generator for a module-scoped fixture: ``yield from running_ray(2)``."""
    import ray

    if ray.is_initialized():  # pragma: no cover - a previous module's
        ray.shutdown()
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def no_actors_left():
    """A leak check for Ray tests (Ray's own processes stay for the module): no easycore
    actor alive after the test, as a generator for a fixture."""
    yield
    assert wait_for(lambda: not our_actors()), f"actors left behind: {our_actors()}"


def first_held(started: Path, release: Path, then: float = 0.0) -> dict[str, object]:
    """An async and a plain producer whose items touch ``started/<item>`` as they begin;
    item 0 then waits until ``release`` exists, the others return at once (after ``then``
    seconds, each)."""
    import asyncio

    from easycore import producer

    @producer
    async def ahold(x):
        (started / str(x)).touch()
        while x == 0 and not release.exists():
            await asyncio.sleep(0.01)
        await asyncio.sleep(then)
        return x

    @producer
    def thold(x):
        (started / str(x)).touch()
        while x == 0 and not release.exists():
            time.sleep(0.01)
        time.sleep(then)
        return x

    return {"async": ahold, "threads": thold}


def started_while_held(folder: Path, at_least: int) -> int:
    """How many items :func:`first_held` has started (files in ``folder``) once at least
    ``at_least`` did and no more start (60 s at most for the first)."""
    deadline = time.monotonic() + 60
    while (n := len(list(folder.iterdir()))) < at_least:
        assert time.monotonic() < deadline, f"{n} items started while item 0 waits"
        time.sleep(0.02)
    n = -1
    while n != (n := len(list(folder.iterdir()))):
        time.sleep(0.3)
    return n


# An uncaught run error, on each engine and entry point (test_first_hour_more.py and, on Ray,
# tests/on_ray/test_ray_first_hour.py): the user's error is on line 10.
ERROR_SCRIPT = """\
import asyncio
import sys

from easycore import producer


@producer
def predict(x):
    if x == 3:
        raise ValueError("bad item")  # the user's line
    return x


@producer
async def waits(x):
    await asyncio.sleep(5 if x == 1 else 0)
    return x


if __name__ == "__main__":
    how, where = sys.argv[1], sys.argv[2]
    options = {"engine": "ray"} if where == "ray" else {}
    if where == "ray":  # the tests' running Ray (tests/on_ray/test_ray_first_hour.py)
        import os

        import ray

        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    devices = "inline" if where == "inline" else 2
    if how == "timeout":
        waits.map(range(3), devices=devices, timeout=0.5, **options)
    elif how == "map":
        predict.map(range(6), devices=devices, **options)
    elif how == "imap":
        list(predict.imap(range(6), devices=devices, **options))
    elif how == "runner":
        with predict.open(devices, **options) as runner:
            runner.map(range(6))
    else:
        with predict.open(devices, **options) as runner:
            list(runner.imap(range(6)))
"""


def run_error_script(tmp_path, how, where, env=None):
    """Run ERROR_SCRIPT (``how``: the entry point, ``where``: 2 workers, inline or ray), which
    must fail; its path and stderr."""
    script = tmp_path / "predict.py"
    script.write_text(ERROR_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), how, where],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        env=env,
    )
    assert run.returncode == 1, run.stderr
    return script, run.stderr
