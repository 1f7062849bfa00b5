"""The fault matrix (after loky's crash cases): every failure gives a clear error or the exact
fault-free result, never a hang; the leak check in conftest runs after every case."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from easycore import (
    EasycoreError,
    ItemTimeout,
    SerializationError,
    WorkerDied,
    WorkerError,
    consumer,
    producer,
)
from helpers import HomeSick, SlowToLoad, Unloadable, first_time, one_unloadable

pytestmark = pytest.mark.timeout(60)

N = 8
BAD = 3  # the item that fails
EXPECTED = sum(x * x for x in range(N))


def fail(how: str):
    """Inject one failure of kind `how` here."""
    if how == "raise":
        raise ValueError("injected failure")
    if how == "exit":
        os._exit(3)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "segfault":
        ctypes.string_at(0)
    if how == "unpicklable":
        return threading.Lock()
    raise AssertionError(how)


def pipeline_failing_in(stage: str, how: str, marker: Path | None):
    """square >> summer, with `how` injected in `stage` (every time, or once with marker)."""

    def should_fail() -> bool:
        return marker is None or first_time(marker)

    def work(x):
        if stage == "work" and x == BAD and should_fail():
            out = fail(how)
            if out is not None:
                return out
        return x * x

    def init():
        if stage == "init":
            fail(how)
        return None

    def end():
        if stage == "end":
            fail(how)

    def fold(total, y):
        if stage == "consumer" and y == BAD * BAD:
            fail(how)
        return total + y

    return producer(init=init, end=end)(work) >> consumer(init=0)(fold)


DEATHS = {"exit": "exit code 3", "sigkill": "SIGKILL", "segfault": "SIGSEGV"}

# (stage, failure, expected error, message must match)
CRASH_CASES = [
    ("work", "raise", WorkerError, f"item {BAD}"),
    ("work", "exit", WorkerDied, f"exit code 3.*item {BAD}"),
    ("work", "sigkill", WorkerDied, f"SIGKILL.*item {BAD}"),
    ("work", "segfault", WorkerDied, f"SIGSEGV.*item {BAD}"),
    ("work", "unpicklable", SerializationError, f"item {BAD}.*pickle"),
    ("init", "raise", WorkerError, "init.*while starting"),
    ("init", "exit", WorkerDied, "while starting.*exit code 3"),
    ("init", "sigkill", WorkerDied, "while starting.*SIGKILL"),
    ("init", "segfault", WorkerDied, "while starting.*SIGSEGV"),
    ("end", "raise", WorkerError, "end.*while ending"),
    ("end", "exit", WorkerDied, "while ending.*exit code 3"),
    ("end", "sigkill", WorkerDied, "while ending.*SIGKILL"),
    ("end", "segfault", WorkerDied, "while ending.*SIGSEGV"),
    ("consumer", "raise", WorkerError, f"fold.*item {BAD}"),
]


def case_id(case):
    return f"{case[0]}-{case[1]}"


class TestCrashMatrix:
    @pytest.mark.parametrize("retries", [0, 2])
    @pytest.mark.parametrize("case", CRASH_CASES, ids=case_id)
    def test_persistent_failure(self, case, retries):
        """A failure that happens every time gives its error, with or without retries."""
        stage, how, error, match = case
        p = pipeline_failing_in(stage, how, marker=None)
        t0 = time.monotonic()
        with pytest.raises(error, match=f"(?s){match}") as info:
            p.map(range(N), devices=2, retries=retries)
        assert time.monotonic() - t0 < 30
        if how == "raise":
            assert isinstance(info.value.__cause__, ValueError)
            assert "injected failure" in str(info.value)
            assert "Traceback" in str(info.value)
        if stage == "work" and retries:
            assert f"after {retries} retries" in str(info.value)
        if isinstance(info.value, WorkerDied) and stage == "work":
            assert info.value.index == BAD

    @pytest.mark.parametrize("how", ["raise", "exit", "sigkill", "segfault", "unpicklable"])
    def test_transient_work_failure_retried(self, how, tmp_path):
        """retries=2: a failure that happens once is re-run; the result equals a clean run."""
        p = pipeline_failing_in("work", how, marker=tmp_path / "failed-once")
        assert p.map(range(N), devices=2, retries=2) == EXPECTED
        assert (tmp_path / "failed-once").exists()

    @pytest.mark.parametrize("how", ["raise", "exit", "sigkill"])
    def test_transient_failure_without_retries_fails(self, how, tmp_path):
        """retries=0: even a one-off failure is an error."""
        p = pipeline_failing_in("work", how, marker=tmp_path / "once")
        with pytest.raises(EasycoreError, match=f"item {BAD}"):
            p.map(range(N), devices=2)

    def test_results_exactly_once_in_order(self, tmp_path):
        """After a death and retry, every result reaches the consumer exactly once, in order;
        the dead worker is respawned on its device and its init runs again."""
        inits = tmp_path / "inits"

        def init(device):
            with open(inits, "a") as f:
                f.write(f"{device}\n")

        def work(x):
            if x == 50 and first_time(tmp_path / "m"):
                os.kill(os.getpid(), signal.SIGKILL)
            return x

        collect = consumer(init=list)(lambda acc, y: acc.append(y))
        out = (producer(init=init)(work) >> collect).map(range(200), devices=2, retries=1)
        assert out == list(range(200))
        assert inits.read_text().split() == ["cpu"] * 3

    def test_idle_deaths_spread_over_a_run_do_not_add_up(self, tmp_path):
        """`retries` bounds deaths in a row, not over a whole run: a worker killed while idle
        (it had delivered everything) three times, with work done between the kills, does
        not exhaust retries=1 (a long run with rare deaths used to fail after retries+1)."""
        pids = tmp_path / "pids"

        def init():
            with open(pids, "a") as f:
                f.write(f"{os.getpid()}\n")

        def take(acc, x):
            if x in (100, 200, 300):
                time.sleep(0.3)  # the worker delivers what it has and waits for work
                os.kill(int(pids.read_text().split()[-1]), signal.SIGKILL)
                time.sleep(0.1)
            acc.append(x)

        work = producer(init=init)(lambda x: (time.sleep(0.001), x)[1])
        out = (work >> consumer(init=list)(take)).map(range(400), devices=1, retries=1)
        assert out == list(range(400))
        assert len(pids.read_text().split()) == 4  # three kills, three replacements

    def test_poison_item_named(self):
        """An item that keeps killing workers is named with index and a short repr."""

        def work(x):
            if x == "poison":
                os._exit(9)
            return x

        with pytest.raises(WorkerDied, match=r"item 2 after 2 retries \(item: 'poison'\)"):
            producer(work).map(["a", "b", "poison", "c"], devices=2, retries=2)

    @pytest.mark.parametrize("how", ["raise", "exit"])
    def test_init_failure_with_no_items(self, how):
        """A failing init is reported even when there is nothing to run."""
        p = pipeline_failing_in("init", how, marker=None)
        with pytest.raises(EasycoreError, match="while starting"):
            p.map([], devices=2)

    def test_original_exception_type_kept(self):
        """__cause__ is the original exception with its type; the error pickles."""
        import pickle

        class Custom(Exception):
            pass

        def work(x):
            raise Custom("custom message")

        with pytest.raises(WorkerError) as info:
            producer(work).map([1], devices=1)
        err = info.value
        assert type(err.__cause__).__name__ == "Custom"
        assert "custom message" in str(err)
        assert err.device == "cpu" and err.worker == 0 and err.index == 0
        again = pickle.loads(pickle.dumps(err))
        assert str(again) == str(err) and again.index == 0

    def test_unpicklable_exception(self):
        """An exception that does not unpickle still gives a WorkerError naming it."""

        def work(x):
            class Local(Exception):
                def __reduce__(self):
                    raise TypeError("no")

            raise Local("local failure")

        with pytest.raises(WorkerError, match="local failure"):
            producer(work).map([1], devices=1)

    def test_detected_quickly(self):
        """A dead worker is seen through its sentinel, long before the others finish."""

        def work(x):
            if x == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(5)
            return x

        t0 = time.monotonic()
        with pytest.raises(WorkerDied):
            producer(work).map(range(4), devices=2)
        assert time.monotonic() - t0 < 4.5  # the other worker was still sleeping


class TestTimeout:
    def test_timeout_kills_and_raises(self):
        """An item past `timeout` kills its worker: ItemTimeout naming the item."""

        def work(x):
            if x == 2:
                time.sleep(60)
            return x

        t0 = time.monotonic()
        with pytest.raises(ItemTimeout, match=r"item 2 ran past timeout=0.5s") as info:
            producer(work).map(range(4), devices=2, timeout=0.5)
        assert time.monotonic() - t0 < 20
        assert isinstance(info.value, WorkerError)

    def test_timeout_retried(self, tmp_path):
        """With retries, a timed-out item is re-run on a fresh worker."""

        def work(x):
            if x == 2 and first_time(tmp_path / "slow"):
                time.sleep(60)
            return x * 10

        assert producer(work).map(range(5), devices=2, timeout=0.5, retries=1) == [
            0,
            10,
            20,
            30,
            40,
        ]

    def test_unpickling_counts(self):
        """An item whose unpickling in the worker runs past `timeout` is an ItemTimeout too:
        the clock starts when the worker takes the item, not after unpickling it."""
        data = [0, 1, SlowToLoad(2, seconds=30), 3]
        t0 = time.monotonic()
        # (named alone, or as one of the chunk it came in: which one was slow is not known)
        with pytest.raises(ItemTimeout, match=r"item 2\b.* ran past timeout=1.0s") as info:
            producer(lambda x: x * 10).map(data, devices=1, timeout=1.0)
        assert time.monotonic() - t0 < 15
        assert info.value.index == 2

    def test_unpickling_past_timeout_retried(self, tmp_path):
        """With retries, an item whose unpickling timed out once is re-run on a fresh worker."""
        data = [0, 1, SlowToLoad(2, seconds=30, marker=str(tmp_path / "slow")), 3]
        t0 = time.monotonic()
        got = producer(lambda x: x * 10).map(data, devices=1, timeout=1.0, retries=1)
        assert got == [0, 10, 20, 30]
        assert time.monotonic() - t0 < 15


class TestPickling:
    def test_unpicklable_item(self):
        """An item that cannot be pickled is a SerializationError (a TypeError) naming its index."""
        data = [1, 2, threading.Lock(), 4]
        with pytest.raises(TypeError, match="item 2 cannot be pickled"):
            producer(lambda x: x).map(data, devices=2)

    def test_item_that_does_not_unpickle_in_the_worker(self):
        """An item that pickles here but fails to unpickle in the worker is named, no hang."""
        data = [1, 2, Unloadable(), 4]
        with pytest.raises(SerializationError, match="unpickling item"):
            producer(lambda x: x).map(data, devices=1)

    @pytest.mark.parametrize("timeout", [None, 30.0])
    def test_an_item_that_does_not_unpickle_fails_alone(self, timeout):
        """Its chunk fails in the worker with no item named: the chunk's units run again
        one per chunk, so errors="skip" sets aside that item alone (it set aside the whole
        chunk, hundreds of good items) and the raised error names it, as on Ray."""
        data = one_unloadable(20_000, 15_000)
        seen: list = []
        got = producer(lambda x: x).map(
            data, devices=2, timeout=timeout, errors="skip", on_error=seen.append
        )
        assert got == [x for x in range(20_000) if x != 15_000]
        assert [f.index for f in seen] == [15_000]
        with pytest.raises(SerializationError, match="unpickling item 15000 in") as info:
            producer(lambda x: x).map(data, devices=2, timeout=timeout)
        assert info.value.index == 15_000

    @pytest.mark.parametrize("pools", [1, 2])
    def test_a_result_that_does_not_unpickle_in_the_caller_is_named(self, pools):
        """A result that unpickles in a worker but not in the calling process is a
        SerializationError naming its item (not a raw RuntimeError with no item), and
        with errors="skip" only that item is set aside: the run goes on."""
        here = os.getpid()
        make = producer(lambda x: HomeSick(here, x) if x == 3 else x)
        pipeline = make if pools == 1 else producer(lambda x: x).on(1) >> make.on(2)
        where = {"devices": 2} if pools == 1 else {}  # (pools have their own .on devices)
        with pytest.raises(SerializationError, match="cannot be unpickled") as info:
            pipeline.map(range(8), **where)
        assert info.value.index == 3
        failures = []
        got = pipeline.map(range(8), **where, errors="skip", on_error=failures.append)
        assert got == [0, 1, 2, 4, 5, 6, 7]
        assert [(f.index, f.item) for f in failures] == [(3, 3)]

    def test_unpicklable_function_preflight(self):
        """A work function that cannot be pickled is named before any worker starts."""
        lock = threading.Lock()

        def work(x):
            with lock:
                return x

        with pytest.raises(SerializationError, match="work function of stage 'work'"):
            producer(work).map([1], devices=2)


class TestRunnerAfterErrors:
    def test_runner_closed_after_error_and_reactivates(self):
        """After an error the runner is closed, never half-alive; activate() restarts it."""

        def work(x):
            if x == 1:
                raise RuntimeError("bad")
            return x

        runner = producer(work).open(devices=2)
        with pytest.raises(WorkerError):
            runner.map(range(5))
        assert not runner.is_active
        runner.activate()
        with runner:
            assert runner.map([0, 2]) == [0, 2]

    @pytest.mark.parametrize("devices", [2, "inline"])
    @pytest.mark.parametrize("with_consumer", [False, True])
    def test_input_that_raises(self, with_consumer, devices):
        """The input iterable's own exception reaches the caller as raised (it is not blamed
        on a stage); the runner is closed and activate() restarts it."""

        def data():
            yield from range(5)
            raise LookupError("the input broke")

        pipeline = producer(lambda x: x * x)
        if with_consumer:
            pipeline = pipeline >> consumer(init=0)(lambda acc, y: acc + y)
        runner = pipeline.open(devices=devices)
        with pytest.raises(LookupError, match="the input broke"):
            runner.map(data())
        assert not runner.is_active
        runner.activate()
        with runner:
            assert runner.map(range(4)) == (14 if with_consumer else [0, 1, 4, 9])

    def test_consumer_failure_names_the_item_in_a_big_chunk(self):
        """Results arrive in chunks of thousands; the failing one is still named exactly."""

        def fold(acc, y):
            if y == 123_457:
                raise ValueError("no")
            return acc + y

        with pytest.raises(WorkerError, match="while folding item 123457 ") as info:
            (producer(lambda x: x) >> consumer(init=0)(fold)).map(range(200_000), devices=2)
        assert info.value.index == 123_457

    def test_no_fd_leak(self):
        """Failing runs leave no file descriptor behind."""

        def work(x):
            if x == 3:
                os._exit(1)
            return x

        def count() -> int:
            gc.collect()
            return len(os.listdir("/proc/self/fd"))

        with pytest.raises(WorkerDied):
            producer(work).map(range(6), devices=2)  # warm-up: forkserver etc. start once
        before = count()
        for _ in range(3):
            with pytest.raises(WorkerDied):
                producer(work).map(range(6), devices=2)
        assert count() <= before
