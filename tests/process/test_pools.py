"""Pipelines cut into pools with ``.on``: each pool its own workers, items moving worker to
worker, and every guarantee of contract section 3 per pool. The leak check in conftest runs
after every case (no worker left, no shared memory left)."""

from __future__ import annotations

import os
import random
import re
import signal
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from easycore import (
    ItemTimeout,
    SerializationError,
    StageStats,
    WorkerDied,
    WorkerError,
    consumer,
    producer,
)
from helpers import first_time

pytestmark = pytest.mark.timeout(120)


@producer
def inc(x):
    return x + 1


@producer
def double(x):
    return 2 * x


@producer
def total(batch):
    return sum(batch)


@consumer(init=list)
def collect(acc, y):
    acc.append(y)


class TestResults:
    def test_two_pools_equal_sequential(self):
        """inc on 2 workers, double on 1: the same list as running them in a loop."""
        out = (inc.on(2) >> double.on(1)).map(range(1000))
        assert out == [2 * (x + 1) for x in range(1000)]

    def test_consumer_folds_in_order(self):
        out = (inc.on(1) >> double.on(2) >> collect).map(range(300))
        assert out == [2 * (x + 1) for x in range(300)]

    def test_unordered_gives_every_result_once(self):
        out = (inc.on(2) >> double.on(2)).map(range(500), ordered=False)
        assert sorted(out) == [2 * (x + 1) for x in range(500)]

    def test_three_pools(self):
        p = inc.on(1) >> double.on(2) >> inc.on(1)
        assert p.map(range(200)) == [2 * (x + 1) + 1 for x in range(200)]

    def test_unbound_producers_run_on_map_devices(self):
        """A run of producers without .on is a pool on map's devices."""

        @producer
        def where(x, *, worker, device):
            return (x, worker, device)

        with (inc >> where.on(1)).open(devices=2) as runner:
            assert runner.devices == ("cpu", "cpu", "cpu")  # 2 for `inc`, 1 for `where`
            out = runner.map(range(50))
        assert [x for x, _, _ in out] == [x + 1 for x in range(50)]
        assert {w for _, w, _ in out} == {0}  # `worker` is the index within its own pool

    def test_generator_input(self):
        out = (inc.on(1) >> double.on(1)).map(x for x in range(100))
        assert out == [2 * (x + 1) for x in range(100)]

    def test_empty_input(self):
        assert (inc.on(1) >> double.on(1)).map([]) == []

    def test_imap_is_lazy_and_bounded_across_pools(self):
        """An endless input: the whole chain holds a bounded number of items (backpressure)."""
        pulled = 0

        def endless():
            nonlocal pulled
            while True:
                pulled += 1
                yield pulled

        @producer
        def slow(x):
            time.sleep(0.002)
            return x

        stream = (inc.on(1) >> slow.on(1)).imap(endless())
        first = [next(stream) for _ in range(200)]
        assert first == [x + 1 for x in range(1, 201)]
        assert pulled < 200 + 2_000  # bounded by the window, not by the input
        stream.close()

    def test_arrays_cross_between_pools(self):
        """Big arrays and tensors from one pool reach the next with their values."""
        import torch

        @producer
        def make(x):
            return np.full((256, 256), x, dtype=np.float32), torch.full((300, 300), float(x))

        @producer
        def check(pair):
            a, t = pair
            # in shared memory: a view of the sender's segment (a ctypes mapping), not an
            # array unpickled from the byte stream (a memoryview or bytes underneath)
            owner = a
            while isinstance(owner, np.ndarray):
                owner = owner.base
            assert type(owner).__name__.startswith("c_char_Array"), type(owner)
            return float(a.mean()) + float(t.mean())

        out = (make.on(2) >> check.on(1)).map(range(60))
        assert out == [2.0 * x for x in range(60)]


class TestDirect:
    def test_results_go_worker_to_worker(self):
        """A first-pool result is unpickled in the second pool's worker, never in the caller."""

        class Probe:
            def __init__(self):
                self.seen = []

            def __setstate__(self, state):
                self.__dict__.update(state)
                self.seen.append(os.getpid())

        @producer
        def make(x):
            return Probe()

        @producer
        def report(probe, *, worker):
            return (os.getpid(), list(probe.seen))

        out = (make.on(2) >> report.on(1)).map(range(20))
        caller = os.getpid()
        for pid, seen in out:
            assert seen == [pid], "the probe was unpickled outside the receiving worker"
            assert caller not in seen


class TestBatching:
    def test_a_pool_batches_what_the_previous_yields(self):
        """.on(batch_size=k) hands its producer lists of k consecutive results."""
        out = (inc.on(2) >> total.on(1, batch_size=4)).map(range(10))
        ys = [x + 1 for x in range(10)]
        assert out == [sum(ys[0:4]), sum(ys[4:8]), sum(ys[8:10])]

    def test_batches_are_the_same_whatever_the_routing(self):
        @producer
        def show(batch):
            return list(batch)

        out = (inc.on(2) >> show.on(2, batch_size=3)).map(range(50), ordered=False)
        assert sorted(out) == [[x + 1 for x in range(i, min(i + 3, 50))] for i in range(0, 50, 3)]

    def test_first_pool_batch_size(self):
        out = (total.on(2, batch_size=5) >> double.on(1)).map(range(12))
        assert out == [2 * sum(range(0, 5)), 2 * sum(range(5, 10)), 2 * sum(range(10, 12))]

    def test_conflicting_batch_sizes_are_refused(self):
        with pytest.raises(ValueError, match="conflicts"):
            (total.on(1, batch_size=5) >> double.on(1)).map(range(12), batch_size=3)

    def test_inline_gives_the_same_batches(self):
        p = inc.on(2) >> total.on(1, batch_size=4) >> double.on(1)
        assert p.map(range(37), devices="inline") == p.map(range(37))


class TestSeeds:
    def test_seeded_runs_match_across_layouts(self):
        """seed: the same results whatever the pools' sizes, and inline."""

        @producer
        def noise(x):
            return x + random.random()

        @producer
        def more(batch):
            return [round(y + np.random.rand(), 12) for y in batch]

        def run(a, b, **kw):
            return (noise.on(a) >> more.on(b, batch_size=3)).map(range(40), seed=7, **kw)

        reference = run(1, 1)
        assert run(2, 1) == reference
        assert run(1, 2, ordered=True) == reference
        assert (noise >> more.on(1, batch_size=3)).map(range(40), seed=7, devices="inline") == (
            reference
        )
        assert run(1, 1) != (noise.on(1) >> more.on(1, batch_size=3)).map(range(40), seed=8)


class TestFaults:
    def test_exception_in_second_pool_names_stage_and_item(self):
        @producer
        def picky(x):
            if x == 8:
                raise KeyError("no eight")
            return x

        with pytest.raises(
            WorkerError, match=r"(?s)picky raised KeyError.*item 7 of stage 'picky'"
        ) as e:
            (inc.on(2) >> picky.on(1)).map(range(20))
        assert isinstance(e.value.__cause__, KeyError)

    def test_exception_in_first_pool(self):
        @producer
        def picky(x):
            if x == 5:
                raise ValueError("five")
            return x

        with pytest.raises(WorkerError, match="item 5 of stage 'picky'"):
            (picky.on(2) >> inc.on(1)).map(range(20))

    @pytest.mark.parametrize("where", ["first", "second"])
    @pytest.mark.parametrize("how", ["raise", "sigkill", "exit"])
    def test_transient_failure_is_retried_exactly(self, where, how, tmp_path):
        """A failure that happens once, in either pool: retries give the fault-free result."""
        marker = tmp_path / "failed"

        def maybe_fail(x):
            if x == 13 and first_time(marker):
                if how == "raise":
                    raise RuntimeError("once")
                if how == "exit":
                    os._exit(5)
                os.kill(os.getpid(), signal.SIGKILL)

        @producer
        def a(x):
            if where == "first":
                maybe_fail(x)
            return x + 1

        @producer
        def b(x):
            if where == "second":
                maybe_fail(x - 1)
            return 3 * x

        out = (a.on(2) >> b.on(2) >> collect).map(range(60), retries=1)
        assert out == [3 * (x + 1) for x in range(60)]
        assert marker.exists()

    def test_death_in_second_pool_without_retries(self):
        @producer
        def crash(x):
            if x == 10:
                os.kill(os.getpid(), signal.SIGKILL)
            return x

        with pytest.raises(WorkerDied, match=r"of stage 'crash'.*SIGKILL.*item 9"):
            (inc.on(1) >> crash.on(1)).map(range(30))

    def test_poison_item_after_retries(self):
        @producer
        def crash(x):
            if x == 4:
                os._exit(7)
            return x

        with pytest.raises(
            WorkerDied, match=r"item 3 of stage 'crash' after 2 retries|item 3 after"
        ):
            (inc.on(2) >> crash.on(1)).map(range(10), retries=2)

    def test_respawned_worker_runs_init_again(self, tmp_path):
        """A worker of the second pool dies once: its replacement runs init; nothing doubles."""
        marker = tmp_path / "died"
        inits = tmp_path / "inits"

        def init():
            with open(inits, "a") as f:
                f.write("x")

        @producer(init=init)
        def b(x):
            if x == 20 and first_time(marker):
                os.kill(os.getpid(), signal.SIGKILL)
            return x

        out = (inc.on(1) >> b.on(1) >> collect).map(range(100), retries=1)
        assert out == [x + 1 for x in range(100)]
        assert inits.read_text() == "xx"

    def test_timeout_in_second_pool(self):
        @producer
        def stuck(x):
            if x == 3:
                time.sleep(60)
            return x

        t0 = time.monotonic()
        with pytest.raises(ItemTimeout, match="item 2 ran past timeout"):
            (inc.on(1) >> stuck.on(1)).map(range(6), timeout=1.0)
        assert time.monotonic() - t0 < 20

    def test_unpicklable_middle_result(self):
        import threading

        @producer
        def bad(x):
            return threading.Lock() if x == 4 else x

        with pytest.raises(SerializationError, match="item 4 of stage 'bad'"):
            (bad.on(1) >> inc.on(1)).map(range(8))

    def test_runner_usable_after_an_early_stop(self):
        with (inc.on(2) >> double.on(1)).open() as runner:
            stream = runner.imap(range(10_000))
            assert [next(stream) for _ in range(5)] == [2, 4, 6, 8, 10]
            stream.close()
            assert runner.map(range(10)) == [2 * (x + 1) for x in range(10)]

    def test_runner_closed_after_an_error_and_reactivates(self):
        @producer
        def picky(x):
            if x == 3:
                raise ValueError("three")
            return x

        runner = (inc.on(1) >> picky.on(1)).open()
        with pytest.raises(WorkerError):
            runner.map(range(10))
        assert not runner.is_active
        with pytest.raises(RuntimeError, match="activate"):
            runner.map([0])
        runner.activate()
        assert runner.map([0, 5]) == [1, 6]
        runner.close()

    def test_consumer_interrupt_leaves_nothing(self):
        """KeyboardInterrupt while folding: it propagates; every worker of every pool is gone."""

        @consumer(init=0)
        def stop_at_50(acc, y):
            if acc == 50:
                raise KeyboardInterrupt
            return acc + 1

        with pytest.raises(KeyboardInterrupt):
            (inc.on(2) >> double.on(1) >> stop_at_50).map(range(10_000))

    def test_death_while_sending_results_on_runs_out_of_retries(self):
        """A result that kills its worker as it is sent to the next pool: WorkerDied after
        the retries, not an endless loop of re-runs."""

        class Bomb:
            def __reduce__(self):
                os.kill(os.getpid(), signal.SIGKILL)

        @producer
        def make(x):
            return Bomb()

        t0 = time.monotonic()
        with pytest.raises(WorkerDied, match=r"of stage 'make'.*after 1 retry"):
            (make.on(1) >> inc.on(1)).map([0], retries=1)
        assert time.monotonic() - t0 < 30

    def test_death_while_sending_names_the_results_being_sent(self):
        """The sender thread dies pickling item 5's result while item 6 or 7 runs: the error
        says which results were being sent (and what ran), not just an innocent item."""

        class Bomb:
            def __reduce__(self):
                os.kill(os.getpid(), signal.SIGKILL)

        @producer
        def make(x):
            time.sleep(0.02)
            return Bomb() if x == 5 else x

        with pytest.raises(WorkerDied, match=r"(?s)while sending the results of item \d+ .*"):
            (make.on(1) >> inc.on(1)).map(range(40), retries=1)

    def test_last_pool_segments_are_reused(self):
        """Results of the last pool dropped by the caller give their shared memory back."""
        import gc

        @producer
        def big(x):
            return np.full((256, 256), x, dtype=np.float32)  # 256 KiB: shared memory

        with (inc.on(1) >> big.on(1)).open() as runner:
            for _ in range(2):
                for y in runner.imap(range(150)):
                    del y
                gc.collect()
            mapped = len(runner._engine.workers.workers[-1].chan.peer)
        assert mapped < 60, f"{mapped} segments for 300 results: released ones are not reused"

    def test_fork_is_refused(self):
        with pytest.raises(ValueError, match="forkserver"):
            (inc.on(1) >> double.on(1)).map([1], start_method="fork")


class TestRunner:
    def test_init_once_per_worker_across_maps(self, tmp_path):
        log = tmp_path / "inits"

        def init(worker):
            with open(log, "a") as f:
                f.write(f"{worker}\n")

        @producer(init=init)
        def a(x):
            return x

        @producer(init=init)
        def b(x):
            return x

        with (a.on(2) >> b.on(1)).open() as runner:
            assert runner.map(range(10)) == list(range(10))
            assert runner.map(range(5)) == list(range(5))
            assert runner.n_workers == 3
        assert sorted(log.read_text().split()) == ["0", "0", "1"]

    def test_stats_per_pool(self):
        @producer
        def slow(batch):
            time.sleep(0.01)
            return len(batch)

        with (inc.on(2) >> slow.on(1, batch_size=10)).open() as runner:
            before = runner.stats()
            assert [s.done for s in before] == [0, 0]
            assert runner.map(range(200)) == [10] * 20
            stats = runner.stats()
        assert all(isinstance(s, StageStats) for s in stats)
        assert [s.name for s in stats] == ["inc", "slow"]
        assert [s.devices for s in stats] == [("cpu", "cpu"), ("cpu",)]
        assert [s.done for s in stats] == [200, 20]  # items for inc, batches for slow
        assert [s.queued for s in stats] == [0, 0]
        assert [s.in_flight for s in stats] == [0, 0]
        assert [s.slots for s in stats] == [2, 1]
        assert [s.waiting for s in stats] == [0, 0]
        assert all(0.0 <= s.busy <= 1.0 for s in stats)
        assert stats[1].busy > stats[0].busy  # the bottleneck shows

    def test_stats_during_a_run_show_the_queue(self):
        """Seen from inside the loop: the slow pool has work queued or waiting."""

        @producer
        def slow(x):
            time.sleep(0.005)
            return x

        with (inc.on(1) >> slow.on(1)).open() as runner:
            seen = []
            for k, _ in enumerate(runner.imap(range(300))):
                if k == 100:
                    seen = runner.stats()
        # the slow pool has work lined up (held by its worker, or waiting for room in it)
        assert seen[1].queued + seen[1].in_flight + seen[0].waiting > 0
        assert 0 < seen[1].done < 300

    def test_progress_bar_per_pool(self, capsys):
        (inc.on(1) >> double.on(1)).map(range(50), progress=True)
        err = capsys.readouterr().err
        assert "inc (1)" in err and "double (1)" in err
        assert "50/50" in err

    def test_progress_bars_count_every_pool_inline(self, capsys):
        (inc.on(1) >> double.on(1)).map(range(50), devices="inline", progress=True)
        shown = [line.strip() for line in re.split(r"[\r\n]", capsys.readouterr().err)]
        for pool in ("inc (1)", "double (1)"):  # (each bar reaches its total, not the last alone)
            assert any(line.startswith(pool) and "50/50" in line for line in shown), pool


class TestSubmit:
    def test_futures_resolve(self):
        with (inc.on(2) >> double.on(1)).open() as runner:
            futures = [runner.submit(x) for x in range(50)]
            assert [f.result(timeout=30) for f in futures] == [2 * (x + 1) for x in range(50)]

    def test_single_pool_submit(self):
        with double.open(devices=2) as runner:
            assert runner.submit(21).result(timeout=30) == 42

    def test_a_failure_fails_only_its_future(self):
        @producer
        def picky(x):
            if x == 3:
                raise ValueError("three")
            if x == 7:
                os.kill(os.getpid(), signal.SIGKILL)
            return x

        with (inc.on(1) >> picky.on(1)).open() as runner:
            futures = [runner.submit(x) for x in range(12)]
            outcomes = []
            for f in futures:
                exc = f.exception(timeout=30)
                outcomes.append(type(exc).__name__ if exc else f.result())
            assert runner.is_active
        assert outcomes == [1, 2, "WorkerError", 4, 5, 6, "WorkerDied", 8, 9, 10, 11, 12]

    def test_map_after_submit_and_close_waits(self):
        @producer
        def slow(x):
            time.sleep(0.02)
            return x

        runner = slow.open(devices=2)
        futures = [runner.submit(x) for x in range(10)]
        assert [f.result(timeout=30) for f in futures] == list(range(10))
        assert runner.map(range(3)) == [0, 1, 2]  # map waits for the submit run to end
        late = [runner.submit(x) for x in range(10)]
        runner.close()  # waits for what was submitted
        assert [f.result(timeout=0) for f in late] == list(range(10))

    def test_refused_cases(self):
        with (inc >> collect).open(devices=1) as runner, pytest.raises(TypeError, match="consumer"):
            runner.submit(1)
        for pipeline in (inc.on(1) >> total.on(1, batch_size=2), total.on(1, batch_size=2)):
            with pipeline.open() as runner, pytest.raises(TypeError, match="batch_size"):
                runner.submit(1)
        runner = inc.open(devices=1)
        runner.close()
        with pytest.raises(RuntimeError, match="activate"):
            runner.submit(1)

    def test_submit_from_many_threads(self):
        import threading

        with (inc.on(2) >> double.on(1)).open() as runner:
            results: dict[int, object] = {}

            def feed(base):
                futures = {x: runner.submit(x) for x in range(base, base + 50)}
                for x, f in futures.items():
                    results[x] = f.result(timeout=60)

            threads = [threading.Thread(target=feed, args=(k * 1000,)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
        assert results == {x: 2 * (x + 1) for k in range(4) for x in range(k * 1000, k * 1000 + 50)}

    def test_unpicklable_middle_result_fails_only_its_future(self):
        import threading

        @producer
        def make(x):
            return threading.Lock() if x == 3 else x

        with (make.on(1) >> inc.on(1)).open() as runner:
            futures = [runner.submit(x) for x in range(8)]
            exc = futures[3].exception(timeout=30)
            assert isinstance(exc, SerializationError)
            assert [f.result(timeout=30) for k, f in enumerate(futures) if k != 3] == [
                x + 1 for x in range(8) if x != 3
            ]
            assert runner.is_active

    def test_map_right_after_submit_waits_for_it(self):
        with inc.open(devices=2) as runner:
            for k in range(20):
                f = runner.submit(k)
                assert f.result(timeout=30) == k + 1
                assert runner.map([k]) == [k + 1]

    def test_close_from_a_callback_fails_the_pending_futures(self):
        @producer
        def slow(x):
            time.sleep(0.05)
            return x

        runner = slow.open(devices=1)
        first = runner.submit(0)
        first.add_done_callback(lambda _: runner.close())
        rest = [runner.submit(x) for x in range(1, 40)]
        assert first.result(timeout=30) == 0
        failed = [f for f in rest if f.exception(timeout=30) is not None]  # no hang
        assert failed, "40 slow items cannot all be done when the first one closes the runner"
        assert all(isinstance(f.exception(), RuntimeError) for f in failed)
        assert not runner.is_active
        runner.activate()  # the runner comes back whole
        assert runner.map([1, 2]) == [1, 2]
        assert runner.submit(3).result(timeout=30) == 3
        runner.close()

    def test_map_while_submitted_items_are_pending_waits_for_them(self):
        @producer
        def slow(x):
            time.sleep(0.02)
            return x

        with slow.open(devices=2) as runner:
            futures = [runner.submit(x) for x in range(30)]
            assert runner.map([100, 101]) == [100, 101]  # waits for the 30 first
            assert all(f.done() for f in futures)
            assert [f.result() for f in futures] == list(range(30))

    def test_cancelling_one_future_leaves_the_others(self):
        with inc.open(devices=1) as runner:
            futures = [runner.submit(x) for x in range(10)]
            assert not futures[5].cancel()  # queued items run: cancel() cannot stop them
            assert [f.result(timeout=30) for f in futures] == [x + 1 for x in range(10)]

    def test_unpicklable_item_fails_only_its_future(self):
        import threading

        with (inc.on(1) >> double.on(1)).open() as runner:
            futures = [runner.submit(threading.Lock() if x == 2 else x) for x in range(6)]
            assert isinstance(futures[2].exception(timeout=30), SerializationError)
            others = [f.result(timeout=30) for k, f in enumerate(futures) if k != 2]
            assert others == [2 * (x + 1) for x in range(6) if x != 2]
            assert runner.is_active

    def test_an_open_imap_holds_the_runner(self):
        with inc.open(devices=1) as runner:
            stream = runner.imap(range(10))  # not started yet, but it has the runner
            with pytest.raises(RuntimeError, match="already running"):
                runner.submit(1)
            assert list(stream) == [x + 1 for x in range(10)]
            assert runner.submit(1).result(timeout=30) == 2

    def test_inline_submit(self):
        @producer
        def picky(x):
            if x == 3:
                raise ValueError("three")
            return x

        with picky.open(devices="inline") as runner:
            assert runner.submit(1).result() == 1
            assert isinstance(runner.submit(3).exception(), WorkerError)
            assert runner.is_active  # an item's error fails only its future
            assert runner.submit(4).result() == 4


def tagger(k):
    @producer
    def tag(x):
        return (k, x)

    return tag


@settings(max_examples=8, deadline=None)
@given(
    n=st.integers(0, 120),
    sizes=st.lists(
        st.tuples(st.integers(1, 2), st.none() | st.integers(1, 5)), min_size=2, max_size=3
    ),
    ordered=st.booleans(),
)
def test_any_layout_equals_the_inline_run(n, sizes, ordered):
    """Random pools and batch sizes: the results equal the in-process run's."""
    stages = [tagger(k) for k in range(len(sizes))]
    pipeline = stages[0].on(sizes[0][0])
    for stage, (workers, batch) in zip(stages[1:], sizes[1:], strict=True):
        pipeline = pipeline >> stage.on(workers, batch_size=batch)
    expected = pipeline.map(range(n), devices="inline")
    out = pipeline.map(range(n), ordered=ordered)
    if ordered:
        assert out == expected
    else:
        assert sorted(out, key=repr) == sorted(expected, key=repr)


def test_inline_submit_runs_now_on_the_callers_thread_with_inits_state():
    """devices="inline": a submitted item runs in submit itself, on the caller's thread (an
    init's thread-bound state, such as an SQLite connection, serves it; breakpoints stop in
    the caller); its error fails only its own future."""
    import sqlite3
    import threading

    def connect():
        return sqlite3.connect(":memory:")

    @producer(init=connect)
    def ask(x, *, state):
        assert x != 3, "three"
        return state.execute("SELECT ?", (x,)).fetchone()[0], threading.get_ident()

    with ask.open(devices="inline") as runner:
        futures = [runner.submit(x) for x in range(5)]
        assert all(f.done() for f in futures)
        assert [f.result() for f in futures if f.exception() is None] == [
            (x, threading.get_ident()) for x in (0, 1, 2, 4)
        ]
        assert "three" in str(futures[3].exception())
