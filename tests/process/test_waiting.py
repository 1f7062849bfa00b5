"""Stages that wait (API.md section 11), on worker processes and inline, against a real HTTP
server on localhost (``tests/local_http.py``): ``async def`` producers and plain ones on
threads, ``concurrency=k`` items in flight per worker, with order, retries, skip, timeouts,
seeds, resume and Ctrl-C holding per item."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import easycore
from easycore import Failure, ItemTimeout, WorkerError, consumer, producer
from helpers import first_held, running
from local_http import HTTPFailed, aget, get

pytestmark = pytest.mark.timeout(90)

PKG = str(Path(__file__).resolve().parents[2] / "pkg")
TESTS = str(Path(__file__).resolve().parents[1])


@producer
async def afetch(url):
    return int(await aget(url))


@producer
def tfetch(url):
    return int(get(url))


@producer
async def afetch_pid(url):
    return int(await aget(url)), os.getpid()


@producer
def tfetch_pid(url):
    return int(get(url)), os.getpid()


def urls(server, n, **query):
    q = "&".join(f"{k}={v}" for k, v in query.items())
    return [f"{server.url}/v/{i}" + (f"?{q}" if q else "") for i in range(n)]


class TestInFlight:
    @pytest.mark.parametrize("stage", [afetch, tfetch], ids=["async", "threads"])
    def test_each_worker_holds_up_to_k_items_and_order_holds(self, server, stage):
        """One worker with concurrency=6 over a slow server: results in input order, and the
        server held more than one of its requests at once, never more than 6."""
        out = stage.map(urls(server, 30, delay=0.1), devices=1, concurrency=6)
        assert out == list(range(30))
        assert 2 <= server.peak <= 6

    def test_concurrency_one_is_one_at_a_time(self, server):
        """concurrency=1 (the default) with an async producer: one request at a time."""
        out = afetch.map(urls(server, 8, delay=0.02), devices=1)
        assert out == list(range(8))
        assert server.peak == 1

    def test_pools_fetch_then_compute_then_fold(self, server):
        """fetch.on(2, concurrency=8) >> a CPU pool >> a consumer, unordered: every item once."""

        @producer
        def square(x):
            return x * x

        @consumer(init=list, end=sorted)
        def collect(acc, x):
            acc.append(x)

        pipeline = afetch.on(2, concurrency=8) >> square.on(1) >> collect
        assert pipeline.map(urls(server, 40, delay=0.01), ordered=False) == sorted(
            i * i for i in range(40)
        )

    def test_async_init_and_end_run_on_the_workers_loop(self, server, tmp_path):
        """An async init's state (made on the worker's loop) serves async items on that loop;
        an async end runs at the worker's end."""
        marks = tmp_path / "ends"

        async def init(worker):
            await asyncio.sleep(0)
            return {"loop": asyncio.get_running_loop(), "worker": worker}

        async def end(state):
            await asyncio.sleep(0)
            with open(marks, "a") as f:
                f.write(f"{state['worker']}\n")

        @producer(init=init, end=end)
        async def fetch(url, state):
            assert asyncio.get_running_loop() is state["loop"]
            return int(await aget(url))

        assert fetch.map(urls(server, 12), devices=2, concurrency=4) == list(range(12))
        assert sorted(marks.read_text().split()) == ["0", "1"]

    def test_a_plain_init_sees_the_loop_the_items_run_on(self):
        def init():
            return asyncio.get_event_loop()

        @producer(init=init)
        async def same_loop(x, state):
            return asyncio.get_running_loop() is state

        assert same_loop.map(range(6), devices=1, concurrency=3) == [True] * 6

    def test_a_plain_init_may_run_the_loop_itself(self):
        """A plain init that runs the worker's loop to make its client (code written before
        async stages could have an async init) works, and items run on that loop."""

        async def client():
            return asyncio.get_running_loop()

        def init():
            return asyncio.get_event_loop().run_until_complete(client())

        @producer(init=init)
        async def same_loop(x, state):
            return asyncio.get_running_loop() is state

        assert same_loop.map(range(6), devices=1, concurrency=3) == [True] * 6

    def test_a_runner_keeps_its_concurrency_across_maps(self, server):
        with afetch.open(devices=1, concurrency=4) as runner:
            assert runner.map(urls(server, 10, delay=0.05)) == list(range(10))
            assert runner.map(urls(server, 5)) == list(range(5))
        assert 2 <= server.peak <= 4

    def test_submit_on_a_runner_with_concurrency(self, server):
        """Items fed one at a time with submit get their own futures, results right."""
        with afetch.open(devices=1, concurrency=4) as runner:
            futures = [runner.submit(u) for u in urls(server, 6, delay=0.02)]
            assert [f.result(timeout=60) for f in futures] == list(range(6))

    def test_an_endless_input_is_pulled_only_as_far_as_the_window(self):
        """Backpressure holds with items in flight: imap over an endless generator at
        concurrency 8 pulls a bounded number of items ahead of the consumer."""
        pulled = itertools.count()

        def endless():
            for i in itertools.count():
                next(pulled)
                yield i

        @producer
        async def wait(x):
            await asyncio.sleep(0.005)
            return x

        results = wait.imap(endless(), devices=1, concurrency=8, progress=True)
        first = [next(results) for _ in range(200)]
        results.close()
        assert first == list(range(200))
        ahead = next(pulled) - 200
        assert ahead < 5000, f"pulled {ahead} items ahead of the consumer"

    def test_imap_takes_concurrency(self, server):
        assert list(tfetch.imap(urls(server, 10), devices=1, concurrency=3)) == list(range(10))


class TestFaults:
    @pytest.mark.parametrize("stage", [afetch, tfetch], ids=["async", "threads"])
    def test_retries_ride_out_500s_and_dropped_connections(self, server, stage):
        """Every path answers 500 once and drops the connection once: retries=2 gives every
        result, each asked three times."""
        data = urls(server, 12, fail=2, drop=1)
        assert stage.map(data, devices=2, concurrency=4, retries=2) == list(range(12))
        assert all(server.times(i) == 3 for i in range(12))

    @pytest.mark.parametrize("stage", [afetch, tfetch], ids=["async", "threads"])
    def test_skip_names_the_right_items(self, server, stage):
        """Item 3 always answers 500 and item 7 always drops: with errors="skip" they are
        left out, reported with their own index, item and the HTTP error as cause."""
        data = urls(server, 10, delay=0.01)
        data[3] = f"{server.url}/v/3?fail=-1"
        data[7] = f"{server.url}/v/7?drop=-1"
        failures: list[Failure] = []
        out = stage.map(
            data, devices=2, concurrency=5, retries=1, errors="skip", on_error=failures.append
        )
        assert out == [i for i in range(10) if i not in (3, 7)]
        assert sorted(f.index for f in failures) == [3, 7]
        for f in failures:
            assert f.item == data[f.index]
            assert isinstance(f.error, WorkerError)
            assert isinstance(f.error.__cause__, HTTPFailed)
        assert server.times(3) == 2  # tried, then retried once

    def test_an_error_raises_naming_the_item(self, server):
        data = urls(server, 6)
        data[4] = f"{server.url}/v/4?fail=-1"
        with pytest.raises(WorkerError, match="item 4") as info:
            afetch.map(data, devices=1, concurrency=3)
        assert isinstance(info.value.__cause__, HTTPFailed)

    def test_an_async_item_past_the_timeout_is_cancelled_and_its_worker_goes_on(self, server):
        """Item 2 waits 30 s for its answer: with timeout=1 it is cancelled (ItemTimeout,
        reported for index 2), and the same worker process ran every other item."""
        data = urls(server, 8, delay=0.05)
        data[2] = f"{server.url}/v/2?delay=30"
        failures: list[Failure] = []
        out = afetch_pid.map(
            data, devices=1, concurrency=4, timeout=1, errors="skip", on_error=failures.append
        )
        assert [v for v, _ in out] == [0, 1, 3, 4, 5, 6, 7]
        assert len({pid for _, pid in out}) == 1  # never replaced
        assert [f.index for f in failures] == [2]
        assert isinstance(failures[0].error, ItemTimeout)
        assert failures[0].error.__cause__ is None  # (as a killed item: none of its code raised)

    def test_a_cancelled_async_item_is_retried(self, tmp_path):
        """The first run of item 1 hangs, the retry answers: retries=1 gives every result."""
        seen = tmp_path / "seen"

        @producer
        async def once_slow(x):
            if x == 1 and not seen.exists():
                seen.write_text("x")
                await asyncio.sleep(30)
            return x

        assert once_slow.map(range(4), devices=1, concurrency=2, timeout=1, retries=1) == [
            0,
            1,
            2,
            3,
        ]

    def test_an_async_timeout_raises_item_timeout(self):
        @producer
        async def hang(x):
            await asyncio.sleep(30 if x == 1 else 0)
            return x

        with pytest.raises(ItemTimeout, match="item 1"):
            hang.map(range(3), devices=1, concurrency=3, timeout=0.5)

    def test_a_thread_item_past_the_timeout_kills_its_worker(self, server):
        """A plain function on a thread cannot be cancelled: its worker is killed as with
        concurrency=1 (ItemTimeout for that item), the others run again on a fresh one."""
        data = urls(server, 6, delay=0.05)
        data[1] = f"{server.url}/v/1?delay=30"
        failures: list[Failure] = []
        out = tfetch_pid.map(
            data, devices=1, concurrency=3, timeout=1, errors="skip", on_error=failures.append
        )
        assert [v for v, _ in out] == [0, 2, 3, 4, 5]
        assert [f.index for f in failures] == [1]
        assert isinstance(failures[0].error, ItemTimeout)
        assert "killed" in str(failures[0].error)

    def test_resume_fetches_only_what_the_ledger_lacks(self, server, tmp_path):
        """A run that skipped item 5 (500s), resumed with retry_failed=True once the server
        answers: only item 5 is fetched again; the result equals a clean run."""
        db = tmp_path / "run.db"
        data = urls(server, 10)
        data[5] = f"{server.url}/v/5?fail=1"
        first = afetch.map(
            data, devices=2, concurrency=4, errors="skip", resume=db, on_error=lambda f: None
        )
        assert first == [i for i in range(10) if i != 5]
        again = afetch.map(
            data, devices=2, concurrency=4, errors="skip", resume=db, retry_failed=True
        )
        assert again == list(range(10))
        assert [server.times(i) for i in range(10)] == [1] * 5 + [2] + [1] * 4


@producer
def kills_beside(x):
    """Item 1 kills its worker while item 0, innocent and slow, runs beside it."""
    if x == 0:
        time.sleep(1.0)
    if x == 1:
        time.sleep(0.3)
        os._exit(9)
    return x


@producer
async def akills_beside(x):
    if x == 0:
        await asyncio.sleep(1.0)
    if x == 1:
        await asyncio.sleep(0.3)
        os._exit(9)
    return x


class TestDeathBesideOthers:
    """A worker running several items side by side dies: the slot names only the oldest in
    flight, so which one killed it is found by running each again alone."""

    @pytest.mark.parametrize("stage", [kills_beside, akills_beside], ids=["threads", "async"])
    @pytest.mark.parametrize("retries", [0, 1])
    def test_skip_sets_aside_the_killer_only(self, stage, retries):
        failures: list[Failure] = []
        out = stage.map(
            range(6), devices=1, concurrency=3, retries=retries, errors="skip",
            on_error=failures.append,
        )  # fmt: skip
        assert out == [0, 2, 3, 4, 5]
        assert [(f.index, type(f.error).__name__) for f in failures] == [(1, "WorkerDied")]

    def test_retries_with_raise_name_the_killer(self):
        with pytest.raises(easycore.WorkerDied) as info:
            kills_beside.map(range(6), devices=1, concurrency=3, retries=1)
        assert info.value.index == 1 and info.value.item == 1

    def test_without_retries_the_error_names_every_item_in_flight(self):
        with pytest.raises(easycore.WorkerDied) as info:
            kills_beside.map(range(6), devices=1, concurrency=3)
        text = str(info.value)
        assert "item 0" in text and "item 1" in text  # (either may have killed it)
        assert info.value.index == 0 and info.value.item == 0


class TestSeeds:
    def test_item_seed_is_each_items_own_whatever_the_interleaving(self):
        """item_seed() is derive_seed(seed, index) in every item, also while items of one
        worker interleave (random delays), on any number of workers, threads and inline;
        draws of the global random made before the first await are the item's own too."""

        @producer
        async def draw(x):
            before = random.random()  # right after the worker seeded the item
            await asyncio.sleep(random.Random(x).random() / 50)
            return before, random.Random(easycore.item_seed()).random(), easycore.item_seed()

        @producer
        def tdraw(x):
            time.sleep(random.Random(x).random() / 50)
            return random.Random(easycore.item_seed()).random(), easycore.item_seed()

        want = [easycore.derive_seed(7, i) for i in range(24)]
        own = [random.Random(s).random() for s in want]
        first = []
        for s in want:
            random.seed(s)
            first.append(random.random())
        for kw in [{"devices": 2, "concurrency": 8}, {"devices": 1}, {"devices": "inline"}]:
            out = draw.map(range(24), seed=7, **kw)
            assert [o[2] for o in out] == want, kw
            assert [o[1] for o in out] == own, kw
            assert [o[0] for o in out] == first, kw
        out = tdraw.map(range(24), seed=7, devices=2, concurrency=8)
        assert out == list(zip(own, want, strict=True))

    def test_no_seed_no_item_seed(self):
        @producer
        async def which(x):
            return easycore.item_seed()

        assert which.map(range(3), devices=1, concurrency=2) == [None] * 3
        assert easycore.item_seed() is None


def held_stages(started: Path, release: Path) -> dict[str, object]:
    """An async and a plain stage whose items touch ``started/<item>`` as they begin, then
    wait until ``release`` exists."""

    @producer
    async def ahold(x):
        (started / str(x)).touch()
        while not release.exists():
            await asyncio.sleep(0.01)
        return x

    @producer
    def thold(x):
        (started / str(x)).touch()
        while not release.exists():
            time.sleep(0.01)
        return x

    return {"async": ahold, "threads": thold}


def wait_for_files(folder: Path, n: int) -> None:
    deadline = time.monotonic() + 60
    while len(list(folder.iterdir())) < n:
        assert time.monotonic() < deadline, f"{len(list(folder.iterdir()))} of {n} started"
        time.sleep(0.02)


class TestStats:
    @pytest.mark.parametrize("kind", ["async", "threads"])
    def test_in_flight_is_k_per_worker_while_items_wait(self, tmp_path, kind):
        """2 workers at concurrency 4, prefetch 2 (each holds 2 chunks of 4), every item held:
        4 items in flight per worker, the other 4 it holds queued; none once done."""
        started, release = tmp_path / "started", tmp_path / "release"
        started.mkdir()
        stage = held_stages(started, release)[kind]
        with stage.open(devices=2, concurrency=4) as runner:
            results = runner.imap(range(40), prefetch=2)  # work starts now
            wait_for_files(started, 8)
            deadline = time.monotonic() + 30
            while (s := runner.stats()[0]).queued != 8 and time.monotonic() < deadline:
                time.sleep(0.02)  # (the chunks may still be on their way)
            assert len(list(started.iterdir())) == 8  # each slot holds one item, no more
            assert (s.concurrency, s.slots, s.in_flight, s.queued, s.done) == (4, 8, 8, 8, 0)
            release.touch()
            assert list(results) == list(range(40))
            s = runner.stats()[0]
        assert (s.in_flight, s.queued, s.done) == (0, 0, 40)

    @pytest.mark.parametrize("kind", ["async", "threads"])
    def test_busy_counts_every_slot(self, kind):
        """64 items that each hold a slot 0.1 s on one worker at concurrency 8: the slots
        were busy n * 0.1 slot-seconds at least within the map's wall time, which a worker's
        own time (at most that wall time) could never show."""

        @producer
        async def anap(x):
            await asyncio.sleep(0.1)
            return x

        @producer
        def tnap(x):
            time.sleep(0.1)
            return x

        n = 64
        with (anap if kind == "async" else tnap).open(devices=1, concurrency=8) as runner:
            t0 = time.monotonic()
            assert runner.map(range(n)) == list(range(n))
            took = time.monotonic() - t0
            s = runner.stats()[0]
        assert s.slots == 8 and 0.0 < s.busy <= 1.0
        assert s.busy * s.slots * took >= n * 0.1 * 0.99, (s.busy, took)


def _exit_on_load():
    os._exit(3)


class DiesOnLoad:
    """Pickles fine; unpickling it (in a worker) ends that process."""

    def __reduce__(self):
        return (_exit_on_load, ())


class TestSlotsAcrossChunks:
    """A worker's ``k`` slots are shared by the chunks it holds (``prefetch`` of them): a slot
    that one chunk's slow item leaves free takes the next chunk's item at once."""

    @pytest.mark.parametrize("kind", ["async", "threads"])
    def test_a_slow_item_keeps_one_slot_not_four(self, tmp_path, kind):
        """One worker at concurrency 4, prefetch 2 (it holds up to 8 items): item 0 is
        held, the rest return at once. Items after the first chunk's start while item 0
        still waits (a chunk done is answered at once, and the next one sent), until the
        run's window is full: item 0's result is not yet yielded, so the run stops taking
        input short of the 40 items. Results come in order once item 0 is let go."""
        started, release = tmp_path / "started", tmp_path / "release"
        started.mkdir()
        stage = first_held(started, release)[kind]
        with stage.open(devices=1, concurrency=4) as runner:
            results = runner.imap(range(40), prefetch=2)
            wait_for_files(started, 8)
            while True:  # until the window is full
                n = len(list(started.iterdir()))
                time.sleep(0.3)
                if len(list(started.iterdir())) == n:
                    break
            assert sorted(int(p.name) for p in started.iterdir()) == list(range(n))
            assert n < 40
            assert (runner.stats()[0].in_flight, release.exists()) == (1, False)
            release.touch()
            assert list(results) == list(range(40))

    def test_a_death_unpickling_a_later_chunk_names_that_chunk(self, tmp_path):
        """An item whose unpickling ends the worker, in a later chunk while item 0 of the
        first is still in flight: the death names the item being unpickled (5), not the
        oldest chunk the worker had (the slot says how many chunks it held ahead). Item 0
        is held only in the first worker (so it is in flight when that worker dies) and
        returns at once when it runs again: the error is raised once the results before
        it are in."""
        started = tmp_path / "started"

        @producer
        def hold(x):
            if x == 0 and not started.exists():
                started.touch()
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # until this worker dies
                    time.sleep(0.01)
            return x

        data: list[object] = list(range(12))
        data[5] = DiesOnLoad()
        with pytest.raises(easycore.WorkerDied, match="unpickling") as info:
            hold.map(data, devices=1, concurrency=4, prefetch=2)
        assert info.value.index == 5


class TestInline:
    def test_an_async_error_is_the_users_alone(self):
        """The user's exception carries no internal one as its context (easycore's look for
        a running event loop), and the message shows no such error first."""

        @producer
        async def work(x):
            if x == 1:
                raise ValueError("bad item")
            return x

        with pytest.raises(WorkerError) as info:
            work.map(range(3), devices="inline")
        assert isinstance(info.value.__cause__, ValueError)
        assert info.value.__cause__.__context__ is None
        assert "no running event loop" not in str(info.value)

    def test_stats_count_the_item_in_hand(self):
        """Inline, items run one at a time (concurrency does not apply): one slot, and the
        item running is in flight."""
        holder = {}

        @producer
        async def look(x):
            s = holder["runner"].stats()[0]
            return s.in_flight, s.slots

        with look.open(devices="inline", concurrency=4) as runner:
            holder["runner"] = runner
            assert runner.map(range(3)) == [(1, 1)] * 3
            s = runner.stats()[0]
        assert (s.in_flight, s.done, s.concurrency) == (0, 3, 1)

    def test_async_stages_run_on_a_loop_in_the_caller(self, server, tmp_path):
        ends = tmp_path / "end"

        async def init():
            return asyncio.get_running_loop()

        async def end(state):
            ends.write_text(str(os.getpid()))

        @producer(init=init, end=end)
        async def fetch(url, state):
            assert asyncio.get_running_loop() is state
            return int(await aget(url)), os.getpid()

        out = fetch.map(urls(server, 5), devices="inline", concurrency=4)
        assert out == [(i, os.getpid()) for i in range(5)]
        assert ends.read_text() == str(os.getpid())

    def test_inline_retries_skip_and_a_cancelled_timeout(self, server):
        data = urls(server, 6, fail=1)
        data[4] = f"{server.url}/v/4?delay=30"
        failures: list[Failure] = []
        out = afetch.map(
            data,
            devices="inline",
            retries=1,
            timeout=0.5,
            errors="skip",
            on_error=failures.append,
        )
        assert out == [0, 1, 2, 3, 5]
        assert [f.index for f in failures] == [4]
        assert isinstance(failures[0].error, ItemTimeout)


class TestValidation:
    @pytest.mark.parametrize(
        ("value", "error"),
        [(0, ValueError), (-2, ValueError), (2.0, TypeError), ("4", TypeError), (True, TypeError)],
    )
    def test_every_entry_point_checks_concurrency(self, value, error):
        with pytest.raises(error, match="concurrency"):
            afetch.on(2, concurrency=value)
        with pytest.raises(error, match="concurrency"):
            afetch.map([], devices=2, concurrency=value)
        with pytest.raises(error, match="concurrency"):
            afetch.imap([], devices=2, concurrency=value)
        with pytest.raises(error, match="concurrency"):
            afetch.open(devices=2, concurrency=value)
        with pytest.raises(error, match="concurrency"):
            (afetch >> afetch).map([], devices="inline", concurrency=value)

    def test_repr_shows_it(self):
        assert repr(afetch.on(2, concurrency=8)) == "Pipeline(afetch.on(2, concurrency=8))"

    def test_a_run_concurrency_that_describes_no_pool_is_refused(self):
        """As devices= is: every pool has its own .on(...), so concurrency= on the run
        would be dropped silently."""
        for pipeline in (afetch.on(1), afetch.on(1, concurrency=3)):
            with pytest.raises(ValueError, match=r"concurrency=6 describes no pool"):
                pipeline.map([], concurrency=6)
            with pytest.raises(ValueError, match=r"concurrency=6 describes no pool"):
                pipeline.open(concurrency=6)
        assert afetch.on(1).map([], devices="inline", concurrency=6) == []  # (inline: none)


SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys
    sys.path.insert(0, sys.argv[3])
    from easycore import producer

    pids, started = sys.argv[1], sys.argv[4]

    def init():
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\\n")

    def mark(x):
        open(os.path.join(started, str(x)), "w").close()

    @producer(init=init)
    async def wait(x):
        mark(x)
        await asyncio.sleep(100)
        return x

    @producer(init=init)
    def twait(x):
        import time
        mark(x)
        time.sleep(100)
        return x

    stage = wait if sys.argv[2] == "async" else twait
    print(stage.map(range(100), devices=2, concurrency=8))
    """
)


@pytest.mark.parametrize("kind", ["async", "threads"])
def test_ctrl_c_with_items_in_flight_leaves_nothing(tmp_path, kind):
    """Ctrl-C once 2 workers hold 8 waiting items each (16 items have started: each touched
    its marker): KeyboardInterrupt, workers gone."""

    pids = tmp_path / "pids"
    started = tmp_path / "started"
    started.mkdir()
    env = {**os.environ, "PYTHONPATH": PKG + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(pids), kind, TESTS, str(started)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(started.iterdir())) < 16:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the items never were all in flight"
            time.sleep(0.05)
        workers = [int(p) for p in pids.read_text().split()]
        assert len(workers) == 2
        assert len(list(started.iterdir())) == 16  # 8 per worker, no more: each slot holds one
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in err
    deadline = time.monotonic() + 5
    while any(running(p) for p in workers):
        assert time.monotonic() < deadline, "workers outlived Ctrl-C"
        time.sleep(0.05)


@producer
async def on_its_loop(x):
    return asyncio.get_event_loop_policy().get_event_loop() is asyncio.get_running_loop()


class TestTheLoop:
    def test_an_item_finds_the_loop_it_runs_on_as_the_threads_loop(self):
        """Libraries call get_event_loop(): on the worker's loop thread it is that loop."""
        assert on_its_loop.map(range(6), devices=1, concurrency=3) == [True] * 6


@producer
def slow_at_two(x):
    if x == 2:
        time.sleep(1.5)
    return x


@pytest.mark.parametrize("devices", ["inline", 1])
def test_a_plain_item_past_its_timeout_fails_inline_as_in_a_worker(devices):
    """Inline nothing can stop it, yet the outcome is a worker's: ItemTimeout, or the item
    set aside under errors="skip" (its late result dropped)."""
    with pytest.raises(ItemTimeout) as info:
        slow_at_two.map(range(4), devices=devices, timeout=0.5)
    assert info.value.index == 2 and info.value.__cause__ is None
    failures: list[Failure] = []
    out = slow_at_two.map(
        range(4), devices=devices, timeout=0.5, errors="skip", on_error=failures.append
    )
    assert out == [0, 1, 3] and [f.index for f in failures] == [2]
