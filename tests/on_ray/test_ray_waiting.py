"""Stages that wait on engine="ray" (API.md section 11): each actor holds up to k items of an
async producer (tasks of its event loop) or a plain one (threads), against a real HTTP server
on localhost, with order, retries, skip indices, seeds and a cancelled timeout per item."""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

import easycore
from easycore import Failure, ItemTimeout, producer
from helpers import first_held
from local_http import HTTPFailed, aget, get

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("local_ray")]


@producer
async def afetch_pid(url):
    return int(await aget(url)), os.getpid()


@producer
def tfetch(url):
    return int(get(url))


@producer
def square(x):
    return x * x


def urls(server, n, **query):
    q = "&".join(f"{k}={v}" for k, v in query.items())
    return [f"{server.url}/v/{i}" + (f"?{q}" if q else "") for i in range(n)]


def test_an_actor_holds_up_to_k_items_in_order(server):
    out = afetch_pid.map(urls(server, 24, delay=0.1), devices=1, concurrency=6, engine="ray")
    assert [v for v, _ in out] == list(range(24))
    assert 2 <= server.peak <= 6


def test_threads_pools_retries_and_skip(server):
    """A plain fetch on 4 threads of one actor, then a CPU pool: 500s and drops once are
    ridden out by retries; item 2 always fails and is skipped with its own index."""
    data = urls(server, 12, fail=1, drop=1)
    data[2] = f"{server.url}/v/2?fail=-1"
    failures: list[Failure] = []
    out = (tfetch.on(1, concurrency=4) >> square.on(1)).map(
        data, engine="ray", retries=2, errors="skip", on_error=failures.append
    )
    assert out == [i * i for i in range(12) if i != 2]
    assert [f.index for f in failures] == [2]
    assert isinstance(failures[0].error.__cause__, HTTPFailed)


def test_an_async_item_past_the_timeout_is_cancelled_and_the_actor_goes_on(server):
    data = urls(server, 6, delay=0.05)
    data[3] = f"{server.url}/v/3?delay=30"
    failures: list[Failure] = []
    out = afetch_pid.map(
        data,
        devices=1,
        concurrency=3,
        timeout=1,
        engine="ray",
        errors="skip",
        on_error=failures.append,
    )
    assert [v for v, _ in out] == [0, 1, 2, 4, 5]
    assert len({pid for _, pid in out}) == 1
    assert [f.index for f in failures] == [3]
    assert isinstance(failures[0].error, ItemTimeout)


def test_item_seed_as_on_the_local_engine():
    @producer
    async def draw(x):
        await asyncio.sleep(random.Random(x).random() / 50)
        return random.Random(easycore.item_seed()).random()

    want = [random.Random(easycore.derive_seed(3, i)).random() for i in range(16)]
    assert draw.map(range(16), seed=3, devices=2, concurrency=5, engine="ray") == want


@producer
def tfetch_pid(url):
    return int(get(url)), os.getpid()


def test_a_thread_item_past_the_timeout_replaces_the_actor(server):
    """A plain item on a thread cannot be cancelled: its actor is killed (ItemTimeout for
    that item), the others it held run again."""
    data = urls(server, 6, delay=0.05)
    data[1] = f"{server.url}/v/1?delay=30"
    failures: list[Failure] = []
    out = tfetch_pid.map(
        data,
        devices=1,
        concurrency=3,
        timeout=1,
        engine="ray",
        errors="skip",
        on_error=failures.append,
    )
    assert [v for v, _ in out] == [0, 2, 3, 4, 5]
    assert [f.index for f in failures] == [1]
    assert isinstance(failures[0].error, ItemTimeout)


@pytest.mark.parametrize("init", [None, dict], ids=["tasks", "actor"])
def test_stats_count_items_in_flight_and_busy_slots(tmp_path, init):
    """One actor (or one slot of Ray tasks) at concurrency 4, its items held: 4 in flight;
    released, each item holds its slot 0.2 s more: busy counts every slot's time (32 x 0.2
    slot-seconds at least within the run's wall time, which one actor's own time could never
    show)."""
    started, release = tmp_path / "started", tmp_path / "release"
    started.mkdir()

    @producer(init=init)
    async def hold(x):
        (started / str(x)).touch()
        while not release.exists():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        return x

    with hold.open(devices=1, concurrency=4, engine="ray") as runner:
        t0 = time.monotonic()
        results = runner.imap(range(32), prefetch=1)
        while len(list(started.iterdir())) < 4:
            assert time.monotonic() < t0 + 60, "the items never started"
            time.sleep(0.02)
        s = runner.stats()[0]
        assert (s.slots, s.in_flight) == (4, 4)
        assert len(list(started.iterdir())) == 4  # one item per slot, no more
        release.touch()
        assert list(results) == list(range(32))
        took = time.monotonic() - t0
        s = runner.stats()[0]
    assert (s.in_flight, s.queued, s.done) == (0, 0, 32)
    assert s.busy * s.slots * took >= 32 * 0.2 * 0.99, (s.busy, took)


@pytest.mark.parametrize("kind", ["async", "threads"])
def test_a_slow_item_keeps_one_slot_of_its_actor_not_all(tmp_path, kind):
    """One actor at concurrency 4: item 0 is held, the rest return at once. The actor takes
    the next chunks while item 0 waits (its slots are the actor's, not one chunk's), so
    items 1-7 start before item 0 is let go; the results come in order."""
    started, release = tmp_path / "started", tmp_path / "release"
    started.mkdir()
    stage = first_held(started, release)[kind]
    with stage.open(devices=1, concurrency=4, engine="ray") as runner:
        results = runner.imap(range(40), prefetch=2)
        deadline = time.monotonic() + 60
        while not all((started / str(i)).exists() for i in range(8)):
            assert time.monotonic() < deadline, sorted(p.name for p in started.iterdir())
            time.sleep(0.02)
        assert not release.exists()
        release.touch()
        assert list(results) == list(range(40))
