"""Stages that wait on engine="ray" (API.md section 11): a timeout charges the item that ran
past it and no other, at every concurrency, as on worker processes; a plain producer that
returns a coroutine is the same error as there."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from easycore import Failure, ItemTimeout, WorkerError, producer

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("local_ray")]


@producer
async def sleepy(x):
    """Item 3 awaits 3 s; the others a moment."""
    await asyncio.sleep(3 if x == 3 else 0.01)
    return x, os.getpid()


@producer
async def blocks_2(x):
    """Item 2 holds the event loop 1.6 s (a sync call); the others await meanwhile."""
    if x == 2:
        time.sleep(1.6)
    else:
        await asyncio.sleep(0.3)
    return x, os.getpid()


def skipping(stage, data, **kw):
    failures: list[Failure] = []
    out = stage.map(data, engine="ray", errors="skip", on_error=failures.append, **kw)
    return out, failures


def test_an_item_awaiting_past_the_timeout_fails_alone():
    out, failures = skipping(sleepy, range(8), devices=1, timeout=1)
    assert [v for v, _ in out] == [0, 1, 2, 4, 5, 6, 7]
    assert len({pid for _, pid in out}) == 1  # its actor went on
    assert [f.index for f in failures] == [3]
    assert isinstance(failures[0].error, ItemTimeout)


def test_an_item_blocking_the_loop_past_the_timeout_fails_alone():
    out, failures = skipping(blocks_2, range(8), devices=1, concurrency=4, timeout=1)
    assert [v for v, _ in out] == [0, 1, 3, 4, 5, 6, 7]
    assert [f.index for f in failures] == [2]
    assert isinstance(failures[0].error, ItemTimeout)


def test_an_item_blocking_the_loop_for_good_replaces_the_actor_and_fails_alone():
    """Item 2 never gives the loop back: its actor is killed for it, and the neighbours it
    held run again, uncharged."""

    @producer
    async def hangs_2(x):
        if x == 2:
            time.sleep(60)
        await asyncio.sleep(0.3)
        return x

    out, failures = skipping(hangs_2, range(8), devices=1, concurrency=4, timeout=1)
    assert out == [0, 1, 3, 4, 5, 6, 7]
    assert [f.index for f in failures] == [2]
    assert isinstance(failures[0].error, ItemTimeout)


async def _double(x):
    return 2 * x


@producer
def forgot_async(x):
    return _double(x)  # (a coroutine, never awaited)


@pytest.mark.parametrize("kw", [{}, {"timeout": 30}, {"concurrency": 2}])
def test_a_plain_producer_returning_a_coroutine_is_the_error_it_is_locally(kw):
    with pytest.raises(WorkerError, match="item 0") as info:
        forgot_async.map(range(3), devices=1, engine="ray", **kw)
    cause = info.value.__cause__
    assert isinstance(cause, TypeError)
    assert "producer 'forgot_async' is a plain function that returned a coroutine" in str(cause)
    assert "make it `async def`" in str(cause)
