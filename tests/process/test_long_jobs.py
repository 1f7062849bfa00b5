"""Long jobs (contract section 8): failures set aside, runs resumed after a crash, workers
replaced, and processes started by workers gone with them."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from easycore import (
    Failure,
    ItemTimeout,
    SerializationError,
    SkippedItemsWarning,
    WorkerDied,
    WorkerError,
    consumer,
    producer,
)
from helpers import first_time, running

pytestmark = pytest.mark.timeout(120)

N = 12
BAD = 5


def poison(how: str):
    """A stage whose item BAD fails every time, the way `how` says."""

    def work(x):
        if x == BAD:
            if how == "raise":
                raise ValueError("poison")
            if how == "exit":
                os._exit(3)
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "unpicklable":
                return threading.Lock()
            if how == "timeout":
                time.sleep(30)
        return x * 10

    return producer(work)


def wait_for(cond, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


class TestSkip:
    @pytest.mark.parametrize(
        ("how", "error"),
        [
            ("raise", WorkerError),
            ("exit", WorkerDied),
            ("sigkill", WorkerDied),
            ("unpicklable", SerializationError),
            ("timeout", ItemTimeout),
        ],
    )
    def test_a_failing_item_is_set_aside_and_the_run_goes_on(self, how, error):
        """After its retries, the poison item is left out and reported; every other item
        comes once, in order."""
        seen: list[Failure] = []
        timeout = 1.0 if how == "timeout" else None
        out = poison(how).map(
            range(N), devices=2, retries=1, timeout=timeout, errors="skip", on_error=seen.append
        )
        assert out == [x * 10 for x in range(N) if x != BAD]
        assert len(seen) == 1
        failure = seen[0]
        assert (failure.index, failure.item, failure.stage) == (BAD, BAD, "work")
        assert isinstance(failure.error, error)

    def test_an_item_that_does_not_pickle_is_set_aside(self):
        """An item that cannot reach a worker is a failure like any other."""
        seen: list[Failure] = []
        items = [1, 2, threading.Lock(), 4]
        out = poison("raise").map(items, devices=2, errors="skip", on_error=seen.append)
        assert out == [10, 20, 40]
        assert [f.index for f in seen] == [2]
        assert isinstance(seen[0].error, SerializationError)

    def test_the_consumer_never_sees_a_failure(self):
        """The consumer folds the other items only."""

        @consumer(init=0)
        def total(acc, y):
            return acc + y

        out = (poison("raise") >> total).map(range(N), devices=2, errors="skip", on_error=print)
        assert out == sum(x * 10 for x in range(N) if x != BAD)

    def test_one_warning_per_run_without_on_error(self):
        """Without on_error, one warning counts the failures and shows the first."""
        with pytest.warns(SkippedItemsWarning, match=r"^1 item\(s\) failed.*index=5") as rec:
            out = poison("raise").map(range(N), devices=2, errors="skip")
        assert len(rec) == 1
        assert len(out) == N - 1

    def test_pools_unordered_and_inline(self):
        """Per pool, unordered, and inline: the same items are set aside."""
        seen: list[Failure] = []

        @producer
        def inc(x):
            return x + 1

        pipeline = inc.on(1) >> poison("sigkill").on(1)
        out = pipeline.map(range(N), errors="skip", on_error=seen.append, ordered=False)
        assert sorted(out) == [(x + 1) * 10 for x in range(N) if x + 1 != BAD]
        assert [(f.index, f.item) for f in seen] == [(BAD - 1, BAD - 1)]
        seen.clear()
        pipeline = inc >> poison("raise")
        out = pipeline.map(range(N), devices="inline", errors="skip", on_error=seen.append)
        assert out == [(x + 1) * 10 for x in range(N) if x + 1 != BAD]
        assert [f.index for f in seen] == [BAD - 1]

    def test_a_batching_pool_sets_aside_the_whole_batch(self):
        """A failure in a pool before a batching one fails the batch it would be part of."""
        seen: list[Failure] = []

        @producer
        def total(batch):
            return sum(batch)

        pipeline = poison("raise").on(1) >> total.on(1, batch_size=3)
        out = pipeline.map(range(N), errors="skip", on_error=seen.append)
        batches = [list(range(k, min(k + 3, N))) for k in range(0, N, 3)]
        assert out == [sum(10 * x for x in b) for b in batches if BAD not in b]
        assert [(f.index, f.item) for f in seen] == [(1, [3, 4, 5])]

    def test_raise_stays_the_default(self):
        """errors='raise' (the default) raises as ever."""
        with pytest.raises(WorkerError, match="poison"):
            poison("raise").map(range(N), devices=2)

    def test_bad_arguments(self):
        """A bad errors= or on_error= is refused before any process starts."""
        with pytest.raises(ValueError, match="errors"):
            poison("raise").map(range(N), devices=2, errors="ignore")
        with pytest.raises(TypeError, match="on_error"):
            poison("raise").map(range(N), devices=2, errors="skip", on_error=3)


def computed_log(tmp_path: Path):
    """A stage that logs every item it computes (to tell computed from resumed ones)."""
    log = tmp_path / "computed"

    @producer
    def work(x):
        with open(log, "a") as f:
            f.write(f"{x}\n")
        return {"x": x, "sq": x * x}

    def computed() -> list[int]:
        if not log.exists():
            return []
        return [int(line) for line in log.read_text().split()]

    return work, computed


def ledger_keys(db: Path) -> set[str]:
    with sqlite3.connect(db) as con:
        return {k for (k,) in con.execute("SELECT key FROM units WHERE error IS NULL")}


class TestResume:
    def test_a_resumed_run_computes_only_what_is_missing(self, tmp_path):
        """A run that stopped half-way: the same call computes only what the file lacks and
        returns what an uninterrupted run returns."""
        work, computed = computed_log(tmp_path)
        db = tmp_path / "run.db"
        marker, go = tmp_path / "crashed", tmp_path / "go"

        @producer
        def stop_at_20(y):
            # item 20 crashes the run once, after the caller has taken 2 results (so the
            # file holds some whatever the timing; the first chunks are single items, so
            # items 0 and 1 never wait behind item 20 in a chunk)
            if y["x"] == 20 and first_time(marker):
                assert wait_for(go.exists, 60)
                raise RuntimeError("crash")
            return y

        job = work >> stop_at_20  # (the same run each time: a ledger knows whose it is)
        results = job.imap(range(40), devices=2, resume=db)
        with pytest.raises(WorkerError, match="crash"):
            for k, _ in enumerate(results):
                if k == 1:
                    go.touch()
        done = ledger_keys(db)
        assert 0 < len(done) < 40
        first = computed()
        out = job.map(range(40), devices=2, resume=db)
        assert out == [{"x": x, "sq": x * x} for x in range(40)]
        again = computed()[len(first) :]
        assert not {f"i:{x}" for x in again} & done  # nothing the file held ran again
        assert len(ledger_keys(db)) == 40
        assert job.map(range(40), devices=2, resume=db) == out  # complete: nothing runs
        assert computed()[len(first) + len(again) :] == []

    def test_a_changed_input_is_a_value_error(self, tmp_path):
        """An item that differs from the one recorded under its key is a ValueError."""
        work, _ = computed_log(tmp_path)
        db = tmp_path / "run.db"
        work.map(range(10), devices=2, resume=db)
        with pytest.raises(ValueError, match=r"item 3 .*input changed"):
            work.map([0, 1, 2, 99, 4], devices=2, resume=db)

    def test_key_names_items_whatever_their_order(self, tmp_path):
        """With key=, the input may come in another order: results follow the input."""
        db = tmp_path / "run.db"

        @producer
        def double(item):
            return item * 2

        first = double.map(list(range(10)), devices=2, resume=db, key=lambda x: x)
        assert first == [x * 2 for x in range(10)]
        order = [9, 3, 0, 12, 5]
        assert double.map(order, devices=2, resume=db, key=lambda x: x) == [x * 2 for x in order]
        with sqlite3.connect(db) as con:
            assert con.execute("SELECT count(*) FROM units").fetchone() == (11,)

    def test_set_aside_items_are_retried_only_when_asked(self, tmp_path):
        """A failure is recorded; a resumed run reports it again without running it, and
        runs it again with retry_failed=True."""
        marker = tmp_path / "failed-once"

        @producer
        def flaky(x):
            if x == BAD and first_time(marker):
                raise ValueError("first time")
            return x

        db = tmp_path / "run.db"
        seen: list[Failure] = []
        out = flaky.map(range(N), devices=2, errors="skip", on_error=seen.append, resume=db)
        assert BAD not in out and [f.index for f in seen] == [BAD]
        seen.clear()
        out = flaky.map(range(N), devices=2, errors="skip", on_error=seen.append, resume=db)
        assert BAD not in out and [f.index for f in seen] == [BAD]
        assert "set aside by an earlier run" in str(seen[0].error)
        out = flaky.map(range(N), devices=2, errors="skip", resume=db, retry_failed=True)
        assert out == list(range(N))

    def test_the_consumer_gets_the_same_result(self, tmp_path):
        """With a consumer, a resumed run folds stored and new results alike."""
        work, _ = computed_log(tmp_path)

        @consumer(init=0)
        def total(acc, y):
            return acc + y["sq"]

        db = tmp_path / "run.db"
        work.map(range(15), devices=2, resume=db)
        assert (work >> total).map(range(30), devices=2, resume=db) == sum(x * x for x in range(30))


KILLED_JOB = textwrap.dedent(
    """
    import sys, time
    from easycore import producer, consumer

    @producer
    def work(x):
        time.sleep(0.004)
        if x % 97 == 13:                     # poison items: set aside every time
            raise ValueError(f"poison {x}")
        return x * x

    @consumer(init=0)
    def total(acc, y):
        return acc + y

    n, db = int(sys.argv[1]), sys.argv[2]
    failed = []
    out = (work >> total).map(
        range(n), devices=2, errors="skip", on_error=failed.append, resume=db
    )
    print("RESULT", out, sorted(f.index for f in failed), flush=True)
    """
)


def run_killed(tmp_path: Path, n: int, kills: list[float]) -> tuple[int, list[int]]:
    """Run KILLED_JOB, SIGKILL the caller after each delay of `kills`, then let it finish."""
    script = tmp_path / "job.py"
    script.write_text(KILLED_JOB)
    db = tmp_path / "run.db"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for delay in [*kills, None]:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(n), str(db)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        if delay is not None:
            time.sleep(delay)
            proc.kill()
            proc.communicate(timeout=30)
            if db.exists():  # a torn write never corrupts the file
                with sqlite3.connect(db) as con:
                    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            continue
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    _, total, failed = line.split(" ", 2)
    return int(total), [int(x) for x in failed.strip("[]").split(",") if x.strip()]


class TestKilledCaller:
    def test_killed_at_many_points_then_resumed(self, tmp_path):
        """SIGKILL of the caller at several points; each time the same call resumes, and the
        final result equals an uninterrupted run's."""
        n = 600
        total, failed = run_killed(tmp_path, n, [1.0, 1.6, 2.2, 2.8])
        bad = [x for x in range(n) if x % 97 == 13]
        assert total == sum(x * x for x in range(n) if x not in bad)
        assert failed == bad


class TestWorkersReplaced:
    def test_after_max_items_per_worker(self, tmp_path):
        """A worker is replaced (its end, then a fresh one and its init) after n items;
        nothing is lost or doubled."""
        log = tmp_path / "log"

        def start(worker):
            with open(log, "a") as f:
                f.write(f"init {os.getpid()}\n")

        def stop(state):
            with open(log, "a") as f:
                f.write(f"end {os.getpid()}\n")

        @producer(init=start, end=stop)
        def work(x):
            return (x, os.getpid())

        out = work.map(range(40), devices=2, max_items_per_worker=6)
        assert [x for x, _ in out] == list(range(40))
        per_pid: dict[int, int] = {}
        for _, pid in out:
            per_pid[pid] = per_pid.get(pid, 0) + 1
        assert max(per_pid.values()) <= 6
        assert len(per_pid) >= 40 // 6
        lines = log.read_text().split("\n")
        assert {f"init {p}" for p in per_pid} <= set(lines)
        assert {f"end {p}" for p in per_pid} <= set(lines)

    def test_a_slower_second_pool_runs_no_more_than_max_items_per_worker(self):
        """Each worker of the second pool runs n items too: chunks that wait for it go to
        a worker that may still run them (it took chunks routed while it was busy with its
        last ones: 24 of 20)."""

        @producer(init=lambda: None)
        def first(x, *, state):
            return (os.getpid(),)

        @producer(init=lambda: None)
        def second(t, *, state):
            time.sleep(0.01)
            return (*t, os.getpid())

        got = (first.on(1) >> second.on(1)).map(range(120), max_items_per_worker=20)
        for hop in range(2):
            per_pid: dict[int, int] = {}
            for t in got:
                per_pid[t[hop]] = per_pid.get(t[hop], 0) + 1
            assert sorted(per_pid.values()) == [20] * 6

    def test_after_max_worker_memory(self):
        """A worker whose resident memory passed the bound is replaced between chunks."""
        import numpy as np

        kept = []

        @producer
        def leak(x):
            kept.append(np.ones(4_000_000))  # 32 MB that this worker never frees
            time.sleep(0.01)
            return (x, os.getpid())

        @producer
        def own(x):  # (the bound counts a worker's own pages: shared ones are not its)
            return psutil.Process().memory_full_info().uss

        base = max(own.map(range(2), devices=2))  # what a worker holds before leaking
        out = leak.map(range(16), devices=2, max_worker_memory=base + 100 * 2**20)
        assert [x for x, _ in out] == list(range(16))
        assert len({pid for _, pid in out}) > 2

    def test_a_size_with_a_unit(self):
        """max_worker_memory takes bytes or a string with a unit; nonsense is a ValueError."""
        assert poison("raise").map([1, 2], devices=1, max_worker_memory="64GiB") == [10, 20]
        with pytest.raises(ValueError, match="size"):
            poison("raise").map([1], devices=1, max_worker_memory="lots")
        with pytest.raises(ValueError, match="max_items_per_worker"):
            poison("raise").map([1], devices=1, max_items_per_worker=0)


SPAWNER = textwrap.dedent(
    """
    import multiprocessing, os, subprocess, sys, time

    DAEMON = (  # forks a child in a session of its own, says its pid and leaves it orphaned
        "import os, time\\n"
        "if os.fork() == 0:\\n"
        "    os.setsid()\\n"
        "    print(os.getpid(), flush=True)\\n"
        "    os.close(1)\\n"
        "    time.sleep(300)\\n"
    )

    def _sleep():
        time.sleep(300)

    def spawn(x):
        child = multiprocessing.Process(target=_sleep)   # a worker's own process
        child.start()
        grand = subprocess.Popen(["sleep", "300"])        # and a program it runs
        session = subprocess.Popen(["sleep", "300"], start_new_session=True)   # setsid
        out = subprocess.run(                             # a daemon (double fork, setsid)
            [sys.executable, "-c", DAEMON],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, check=True,
        ).stdout
        return (os.getpid(), child.pid, grand.pid, session.pid, int(out))

    def spawn_then_hang(path):
        pids = spawn(0)
        if not os.path.exists(path):                     # the first time: hang
            with open(path + ".tmp", "w") as f:
                f.write(" ".join(map(str, pids)))
            os.rename(path + ".tmp", path)
            time.sleep(300)
        return pids

    def spawn_then_exit(x):
        _, *started = spawn(x)
        with open(__file__ + ".pids", "w") as f:
            f.write(" ".join(map(str, started)))
        os._exit(3)

    def started():
        with open(__file__ + ".pids") as f:
            return [int(p) for p in f.read().split()]
    """
)


@pytest.fixture
def spawner_mod(tmp_path, monkeypatch):
    """A module of work functions that start processes (importable by the workers)."""
    (tmp_path / "spawner_mod.py").write_text(SPAWNER)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("spawner_mod", None)
    import spawner_mod

    yield spawner_mod
    sys.modules.pop("spawner_mod", None)


def gone(pids) -> bool:
    return not any(running(p) for p in pids)


class TestWorkersChildren:
    """What a producer starts: a multiprocessing child, a program, a program in a session of
    its own (setsid, out of the worker's process group) and a daemon (setsid, its parent
    gone): all of them end with their worker, however the worker ends."""

    def test_children_end_when_the_runner_closes(self, spawner_mod):
        """A producer may start processes; they are gone once its worker closes."""
        with producer(spawner_mod.spawn).open(devices=1) as runner:
            ((_, *started),) = runner.map([0])
            assert not gone(started)
        assert wait_for(lambda: gone(started), 5), "a closed worker's processes live"

    def test_children_end_when_the_worker_is_killed(self, spawner_mod, tmp_path):
        """SIGKILL of a busy worker takes what it started with it; the item re-runs."""
        path = str(tmp_path / "pids")
        result: list = []
        runner = producer(spawner_mod.spawn_then_hang).open(devices=1)
        try:
            thread = threading.Thread(target=lambda: result.extend(runner.map([path], retries=1)))
            thread.start()
            assert wait_for(lambda: os.path.exists(path), 30)
            pid, *started = (int(p) for p in Path(path).read_text().split())
            os.kill(pid, signal.SIGKILL)
            assert wait_for(lambda: gone([pid, *started]), 5), "a killed worker's children live"
            thread.join(30)
            ((pid2, *started2),) = result
            assert pid2 != pid
        finally:
            runner.close()
        assert wait_for(lambda: gone(started2), 5)

    @pytest.mark.parametrize("start_method", [None, "spawn"])
    def test_children_end_when_the_worker_times_out(self, spawner_mod, tmp_path, start_method):
        """A worker killed for a timeout takes what it started with it; the item re-runs."""
        path = str(tmp_path / "pids")
        with producer(spawner_mod.spawn_then_hang).open(
            devices=1, start_method=start_method
        ) as runner:
            ((pid2, *started2),) = runner.map([path], timeout=3, retries=1)
            pid, *started = (int(p) for p in Path(path).read_text().split())
            assert pid2 != pid
            assert wait_for(lambda: gone([pid, *started]), 5), "a timed-out worker's children live"
        assert wait_for(lambda: gone(started2), 5)

    def test_children_end_when_the_worker_dies(self, spawner_mod):
        """A worker that dies on its own (os._exit) takes what it started with it."""
        with pytest.raises(WorkerDied, match="exit code 3"):
            producer(spawner_mod.spawn_then_exit).map([0], devices=1)
        started = spawner_mod.started()
        assert len(started) == 4
        assert wait_for(lambda: gone(started), 5), "a dead worker's children live"

    def test_children_end_when_the_caller_is_killed(self, spawner_mod, tmp_path):
        """SIGKILL of the caller: workers and what they started all go."""
        script = tmp_path / "caller.py"
        script.write_text(
            textwrap.dedent(
                """
                import sys, time
                import spawner_mod
                from easycore import producer
                with producer(spawner_mod.spawn).open(devices=1) as runner:
                    print(*runner.map([0])[0], flush=True)
                    time.sleep(300)
                """
            )
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
        proc = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
        )
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 5 and not gone(pids)
        proc.kill()
        proc.communicate(timeout=10)
        assert wait_for(lambda: gone(pids), 15), "orphans left behind"


class TestDataLoaderInAWorker:
    def test_a_dataloader_with_workers_inside_a_worker(self):
        """A producer may run a DataLoader with num_workers (processes of its own)."""

        @producer
        def load(n):
            import torch

            loader = torch.utils.data.DataLoader(list(range(n)), batch_size=4, num_workers=2)
            return int(sum(int(b.sum()) for b in loader))

        assert load.map([8, 12], devices=1) == [sum(range(8)), sum(range(12))]

    def test_multiprocessing_objects_a_worker_keeps_leave_no_semaphore(self):
        """A queue the work keeps alive to the end owns named semaphores; they go at close."""

        @producer
        def keep(n):
            import multiprocessing

            q = multiprocessing.Queue()
            q.put(n)
            multiprocessing.kept_by_this_test = q  # alive when the worker ends
            return n

        before = set(os.listdir("/dev/shm"))
        assert keep.map([1, 2], devices=1) == [1, 2]
        assert not {e for e in set(os.listdir("/dev/shm")) - before if e.startswith("sem.")}
