"""Stages that wait (API.md section 11), on worker processes and inline: a timeout charges
the item that ran past it and no other, at every concurrency (an item awaiting past it, or
blocking the event loop past it, fails alone); and what is caught at decoration."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

import easycore
from easycore import Failure, ItemTimeout, consumer, producer

pytestmark = pytest.mark.timeout(90)


@producer
async def sleepy(x):
    """Item 3 awaits 3 s; the others a moment."""
    await asyncio.sleep(3 if x == 3 else 0.01)
    return x, os.getpid()


@producer
async def blocks_2(x, seconds=1.6):
    """Item 2 blocks the event loop ``seconds`` (a sync call); the others await a little,
    so that they are in flight meanwhile."""
    if x == 2:
        time.sleep(seconds)
    else:
        await asyncio.sleep(0.3)
    return x, os.getpid()


def skipping(stage, data, **kw):
    failures: list[Failure] = []
    out = stage.map(data, errors="skip", on_error=failures.append, **kw)
    return out, failures


@pytest.mark.parametrize("devices", [1, "inline"])
def test_an_item_awaiting_past_the_timeout_fails_alone(devices):
    """concurrency=1: item 3 is cancelled at the timeout; the items queued behind it run
    as if it had not been there, on the same worker."""
    out, failures = skipping(sleepy, range(8), devices=devices, timeout=1)
    assert [v for v, _ in out] == [0, 1, 2, 4, 5, 6, 7]
    assert len({pid for _, pid in out}) == 1  # its worker went on
    assert [f.index for f in failures] == [3]
    assert isinstance(failures[0].error, ItemTimeout)


@pytest.mark.parametrize("devices", [1, "inline"])
def test_an_item_blocking_the_loop_past_the_timeout_fails_alone(devices):
    """concurrency=4: item 2 holds the loop 1.6 s (timeout=1) while its neighbours await:
    it fails (not delivered), and no neighbour is charged for the time it held them."""
    out, failures = skipping(blocks_2, range(8), devices=devices, concurrency=4, timeout=1)
    assert [v for v, _ in out] == [0, 1, 3, 4, 5, 6, 7]
    assert len({pid for _, pid in out}) == 1  # its worker went on
    assert [f.index for f in failures] == [2]
    assert isinstance(failures[0].error, ItemTimeout)


def test_an_item_blocking_the_loop_for_good_kills_its_worker_and_fails_alone():
    """Item 2 never gives the loop back: its worker is killed for it, and the neighbours it
    held run again, uncharged (retries=0: one charge would have failed them)."""

    @producer
    async def hangs_2(x):
        return await blocks_2.fn(x, seconds=60)

    out, failures = skipping(hangs_2, range(8), devices=1, concurrency=4, timeout=1)
    assert [v for v, _ in out] == [0, 1, 3, 4, 5, 6, 7]
    assert [f.index for f in failures] == [2]
    assert isinstance(failures[0].error, ItemTimeout)
    assert "killed" in str(failures[0].error)


# -- caught at decoration, or the same error on every engine -------------------------------


def test_an_async_consumer_is_refused_at_decoration():
    async def fold(acc, x):
        return acc + x

    with pytest.raises(TypeError, match=r"consumer 'fold' is `async def`.*plain `def`"):
        consumer(fold)
    with pytest.raises(TypeError, match="consumer 'fold'"):
        consumer(init=0)(fold)


def test_an_async_generator_producer_is_refused_at_decoration():
    async def pages(x):
        yield x

    with pytest.raises(TypeError, match=r"producer 'pages' is an async generator.*`async def`"):
        producer(pages)
    with pytest.raises(TypeError, match="producer 'pages'"):
        producer(init=dict)(pages)


async def _double(x):
    return 2 * x


@producer
def forgot_async(x):
    return _double(x)  # (a coroutine, never awaited)


@producer
async def awaits(x):
    await asyncio.sleep(0)
    return x


@pytest.mark.parametrize(
    ("pipeline", "kw"),
    [
        (forgot_async, {"devices": 1}),
        (forgot_async, {"devices": 1, "seed": 0}),
        (forgot_async, {"devices": 1, "concurrency": 2}),
        (awaits >> forgot_async, {"devices": 1}),
        (forgot_async, {"devices": "inline"}),
        (awaits >> forgot_async, {"devices": "inline"}),
    ],
    ids=["worker", "worker-seeded", "threads", "after-async", "inline", "inline-after-async"],
)
def test_a_plain_producer_returning_a_coroutine_is_one_error_everywhere(pipeline, kw):
    with pytest.raises(easycore.WorkerError, match="item 0") as info:
        pipeline.map(range(3), **kw)
    cause = info.value.__cause__
    assert isinstance(cause, TypeError)
    assert "producer 'forgot_async' is a plain function that returned a coroutine" in str(cause)
    assert "make it `async def`" in str(cause)


def test_inline_async_stages_run_inside_a_running_event_loop(tmp_path):
    """A notebook runs the caller's code inside an event loop: inline async init, items
    (with their timeout) and end work there all the same."""
    ended = tmp_path / "ended"

    async def init():
        await asyncio.sleep(0)
        return 10

    async def end(state):
        ended.write_text(str(state))

    @producer(init=init, end=end)
    async def add(x, state):
        await asyncio.sleep(3 if x == 2 else 0)
        return x + state

    async def cell():
        failures: list[Failure] = []
        out = add.map(
            range(4), devices="inline", timeout=1, errors="skip", on_error=failures.append
        )
        return out, [f.index for f in failures]

    assert asyncio.run(cell()) == ([10, 11, 13], [2])
    assert ended.read_text() == "10"
