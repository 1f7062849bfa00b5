"""What the engines reported differently before they shared one run core, each case on
inline, worker processes and Ray (a real local Ray with 2 CPUs)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from easycore import SerializationError, WorkerDied, WorkerError, consumer, producer, write
from helpers import (
    KillsWhenPickled,
    KillsWhenUnpickled,
    no_actors_left,
    one_unloadable,
    running_ray,
)

pytestmark = pytest.mark.timeout(300)

ENGINES = ["inline", "processes", "ray"]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    yield from running_ray(2)


@pytest.fixture(autouse=True)
def no_leaks():
    """After every test: no easycore actor alive (Ray's own processes stay for the module)."""
    yield from no_actors_left()


def where(engine: str) -> dict:
    return {"inline": {"devices": "inline"}, "processes": {}, "ray": {"engine": "ray"}}[engine]


@producer
def first(x):
    return x


@producer
def pair_sum(batch):
    if 4 in batch:
        msg = f"refuses {batch}"
        raise ValueError(msg)
    return sum(batch)


@producer
def plain_sum(batch):
    return sum(batch)


def read_jsonl(files) -> list[int]:
    return [json.loads(line)["x"] for f in files for line in Path(f).read_text().splitlines()]


def two_pools(second):
    return first.on(1) >> second.on(1, batch_size=2)


@pytest.mark.parametrize("engine", ENGINES)
class TestOneBookkeeping:
    def test_resume_with_a_batching_second_pool(self, engine, tmp_path):
        """resume= with a pool that batches the previous pool's results: the result, then
        the same call again from the ledger (it raised KeyError inline and on Ray)."""
        db = tmp_path / "run.db"
        want = [1, 5, 9, 13]
        assert two_pools(plain_sum).map(range(8), resume=db, **where(engine)) == want
        assert two_pools(plain_sum).map(range(8), resume=db, **where(engine)) == want

    def test_a_failed_batch_is_reported_with_its_batch_index(self, engine):
        """errors='skip': the batch [4, 5] of the second pool is Failure.index 2, with its
        items and stage (it was 1 inline and on Ray)."""
        failures = []
        got = two_pools(pair_sum).map(
            range(8), errors="skip", on_error=failures.append, **where(engine)
        )
        assert got == [1, 5, 13]
        assert [(f.index, f.item, f.stage) for f in failures] == [(2, [4, 5], "pair_sum")]

    def test_a_consumer_error_names_the_value_it_folded(self, engine):
        """A consumer raising on its third value names output unit 2, the batch it folded
        (it was 4, a first-pool index, on worker processes)."""

        @consumer(init=list)
        def third_fails(acc, y):
            if len(acc) == 2:
                raise RuntimeError("the third")
            acc.append(y)

        with pytest.raises(WorkerError, match="batch 2") as info:
            (two_pools(plain_sum) >> third_fails).map(range(8), **where(engine))
        assert info.value.index == 2
        assert isinstance(info.value.__cause__, RuntimeError)

    def test_an_init_error_names_the_worker_in_its_pool(self, engine):
        """An init that raises in the second pool names worker 0 of that pool (the slot
        number across the chain, 1, on worker processes)."""

        def broken():
            raise RuntimeError("no model")

        @producer(init=broken)
        def late(x, *, state):
            return x

        with pytest.raises(WorkerError, match="no model") as info:
            (first.on(1) >> late.on(1)).map(range(4), **where(engine))
        assert info.value.worker == 0

    @pytest.mark.parametrize("last", [False, True], ids=["first-pool", "last-pool"])
    def test_a_result_that_cannot_be_pickled_is_named_alike(self, engine, last):
        """A result that cannot cross to the next pool (or back to the caller): the same
        SerializationError index, stage and worker on every engine, and errors="skip"
        sets that item aside alone (on Ray the error named no worker and the wrong stage,
        and Ray logged the later pool's failure as an "Unhandled error"). Inline, nothing
        crosses processes: the lock is a result like any other."""

        @producer
        def locked(x):
            return threading.Lock() if x == 30 else x

        pipeline = (first.on(1) >> locked.on(1)) if last else (locked.on(1) >> first.on(1))
        if engine == "inline":
            got = pipeline.map(range(100), **where(engine))
            assert type(got[30]) is type(threading.Lock()) and got[31] == 31
            return
        with pytest.raises(SerializationError, match="item 30") as info:
            pipeline.map(range(100), **where(engine))
        error = info.value
        assert (error.index, error.stage, error.worker, error.device) == (
            30,
            "<result pickling>",
            0,
            "cpu",
        )
        failures = []
        got = pipeline.map(range(100), errors="skip", on_error=failures.append, **where(engine))
        assert got == [x for x in range(100) if x != 30]
        assert [(f.index, f.item, f.stage) for f in failures] == [(30, 30, "locked")]

    @pytest.mark.parametrize("batch", [None, 3], ids=["items", "batches"])
    def test_a_failed_unit_runs_no_neighbour_twice(self, engine, batch, tmp_path):
        """A unit that fails in the first pool travels on as a marker: the units of its
        chunk run once each, in both pools (on worker processes its chunk's other units ran
        the first pool again, an init-heavy stage's side effects twice), and errors="skip"
        sets aside what failed, with the index and stage of the pool it failed in."""
        calls = tmp_path / "calls"

        @producer
        def logged(x):
            with open(calls, "a") as f:
                f.write(f"{x}\n")
            if x % 97 == 5:
                raise ValueError(x)
            return x

        pipeline = logged.on(1) >> (plain_sum.on(1, batch_size=batch) if batch else first.on(1))
        failures = []
        got = pipeline.map(range(1000), errors="skip", on_error=failures.append, **where(engine))
        bad = {x for x in range(1000) if x % 97 == 5}
        if batch:
            groups = [range(k, min(k + 3, 1000)) for k in range(0, 1000, 3)]
            assert got == [sum(g) for g in groups if not bad & set(g)]
            assert [(f.index, f.stage) for f in failures] == [
                (k // 3, "logged") for k in sorted(bad)
            ]
        else:
            assert got == [x for x in range(1000) if x not in bad]
            assert [(f.index, f.item, f.stage) for f in failures] == [
                (x, x, "logged") for x in sorted(bad)
            ]
        assert sorted(int(x) for x in calls.read_text().split()) == list(range(1000))

    def test_an_ordered_run_raises_its_first_failure_in_input_order(self, engine):
        """Items 3 (failing late) and 5 (failing at once) both raise: every engine delivers
        items 0-2, then raises item 3's error (worker processes raised item 5's, the first
        to come back, before items 0-2 were all delivered)."""

        @producer
        def late_and_early(x):
            if x == 3:
                time.sleep(1.0)
            if x in (3, 5):
                raise ValueError(f"bad {x}")
            return x

        got = []
        with pytest.raises(WorkerError, match="bad 3") as info:
            got.extend(late_and_early.imap(range(40), **where(engine)))
        assert got == [0, 1, 2]
        assert (info.value.index, info.value.stage) == (3, "late_and_early")

    def test_a_sink_that_raises_commits_each_item_once_across_a_resume(self, engine, tmp_path):
        """Items 13 and 31 fail the first run: it raises item 13's error, and the files it
        committed hold no item after it (a file holds a whole chunk, so the chunk of item 13
        is not committed); the same call again completes the job, every item in exactly one
        file."""
        go = tmp_path / "go"

        @producer
        def rows(x):
            if x in (13, 31) and not go.exists():
                raise ValueError(f"bad {x}")
            return {"x": x}

        out, db = tmp_path / "out", str(tmp_path / "run.db")
        pipeline = rows >> write.jsonl(str(out), rows_per_file=4)
        with pytest.raises(WorkerError, match="bad 13") as info:
            pipeline.map(range(60), resume=db, **where(engine))
        assert info.value.index == 13
        names = sorted(os.listdir(out))
        assert not [n for n in names if n.startswith(".")]
        assert all(x < 13 for x in read_jsonl([out / n for n in names]))
        go.touch()
        written = pipeline.map(range(60), resume=db, **where(engine))
        assert sorted(read_jsonl(written.files)) == list(range(60))

    def test_stats_after_a_run_describe_that_run(self, engine):
        """stats() after a run is that run's: its busy share does not fade while the runner
        waits (it faded inline and on Ray, whose runs never marked their end)."""

        @producer
        def slow(x):
            time.sleep(0.01)
            return x

        kw = {"devices": "inline"} if engine == "inline" else {"devices": 1, **where(engine)}
        with slow.open(**kw) as runner:
            assert runner.map(range(20)) == list(range(20))
            before = runner.stats()
            time.sleep(0.5)
            after = runner.stats()
        assert before[0].done == after[0].done == 20
        assert after[0].busy == before[0].busy > 0


@producer(init=lambda: None)
def ran_in(x, *, state):
    import os

    return (os.getpid(),)


@producer(init=lambda: None)
def then_in(t, *, state):
    import os

    return (*t, os.getpid())


@pytest.mark.parametrize("engine", ["processes", "ray"])
def test_a_worker_runs_max_items_per_worker_items_and_no_more(engine, tmp_path):
    """Each worker of each pool runs exactly n items, then a fresh one takes its place; a
    resumed run's known results are not items a worker ran (on Ray an actor took chunks of
    up to n past the bound, 70 of 50, and counted resumed items as run; for processes see
    also test_long_jobs' slower second pool)."""
    import collections

    pipeline = ran_in.on(1) >> then_in.on(1)
    got = pipeline.map(range(60), max_items_per_worker=20, **where(engine))
    for hop in range(2):
        assert sorted(collections.Counter(t[hop] for t in got).values()) == [20] * 3

    # a pool that batches: a chunk is whole output units (4 items), never cut below one
    @producer(init=lambda: None)
    def batch_in(batch, *, state):
        return [then_in.fn(t, state=state) for t in batch]

    got = (ran_in.on(1) >> batch_in.on(1, batch_size=4)).map(
        range(16), max_items_per_worker=3, ordered=False, **where(engine)
    )
    flat = [t for b in got for t in b]
    assert len(flat) == 16
    assert sorted(collections.Counter(t[0] for t in flat).values()) == [4] * 4
    assert sorted(collections.Counter(t[1] for t in flat).values()) == [4, 12]
    # a first run where every third item fails: the resumed run's chunks mix known
    # results and items to run
    refuse = tmp_path / "refuse"
    refuse.touch()

    @producer(init=lambda: None)
    def picky(x, *, state):
        if x % 3 == 0 and refuse.exists():
            raise ValueError(x)
        return ran_in.fn(x, state=state)

    pipeline = picky.on(1) >> then_in.on(1)
    db = tmp_path / "run.db"
    pipeline.map(range(120), resume=db, errors="skip", on_error=lambda f: None, **where(engine))
    refuse.unlink()
    got = pipeline.map(
        range(120), resume=db, retry_failed=True, max_items_per_worker=20, **where(engine)
    )
    for hop in range(2):
        counts = collections.Counter(t[hop] for t in got[::3])
        assert sorted(counts.values()) == [20] * 2


@pytest.mark.parametrize("engine", ["processes", "ray"])
def test_an_item_that_does_not_unpickle_in_a_worker_is_named_alike(engine):
    """An item that pickles here but not in the worker: the same error on processes and Ray,
    saying what the worker was doing (Ray said "while running item 25"), and errors="skip"
    sets that item aside alone."""
    data = one_unloadable(40, 25)
    with pytest.raises(SerializationError, match="while unpickling item 25 ") as info:
        first.map(data, devices=1, **where(engine))
    assert (info.value.index, info.value.stage, info.value.worker) == (25, "<item unpickling>", 0)
    failures = []
    got = first.map(data, devices=1, errors="skip", on_error=failures.append, **where(engine))
    assert got == [x for x in range(40) if x != 25]
    assert [(f.index, f.stage) for f in failures] == [(25, "first")]


@pytest.mark.parametrize("engine", ["processes", "ray"])
def test_an_item_whose_unpickling_kills_its_worker_fails_alone(engine):
    """With errors="skip" and no retries, that item alone is set aside: its chunk runs again
    one item per chunk, which names it (on processes the chunk's other items were failed
    with it, as the Ray engine did not), and the error is the same on both engines."""
    data: list = list(range(200))
    data[100] = KillsWhenUnpickled(os.getpid(), 100)
    failures = []
    got = first.map(data, devices=1, errors="skip", on_error=failures.append, **where(engine))
    assert got == [x for x in range(200) if x != 100]
    assert [(f.index, type(f.error), f.error.worker) for f in failures] == [(100, WorkerDied, 0)]


@pytest.mark.parametrize("engine", ["processes", "ray"])
@pytest.mark.parametrize("retries", [0, 1])
def test_a_result_whose_pickling_kills_its_worker_fails_alone(engine, retries):
    """With errors="skip", that item alone is set aside: the chunk whose results were being
    sent runs again one item per chunk, which names it (on processes the chunk's other items,
    91 here, were set aside with it, also with retries=1); with retries=1, raising names it."""

    @producer
    def deadly(x):
        return KillsWhenPickled() if x == 100 else x

    failures = []
    got = deadly.map(
        range(200),
        devices=1,
        retries=retries,
        errors="skip",
        on_error=failures.append,
        **where(engine),
    )
    assert got == [x for x in range(200) if x != 100]
    assert [(f.index, type(f.error)) for f in failures] == [(100, WorkerDied)]
    if retries:
        with pytest.raises(WorkerDied, match="item 100 after 1 retry") as info:
            deadly.map(range(200), devices=1, retries=retries, **where(engine))
        assert info.value.index == 100


@pytest.mark.timeout(120, method="thread")  # the old wait took no signal
class TestRayCapacity:
    def test_pools_that_together_do_not_fit_are_a_value_error(self):
        """Two pools of 2 + 1 CPU actors on a Ray of 2 CPUs: a ValueError at once, naming
        both pools (it waited forever for the third actor)."""
        with pytest.raises(ValueError, match=r"together ask for 3 CPU actor\(s\)"):
            (first.on(2) >> plain_sum.on(1)).map(range(10), engine="ray")
        assert first.on(1).map(range(3), engine="ray") == [0, 1, 2]  # still usable
