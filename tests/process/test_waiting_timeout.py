"""Stages that wait (API.md section 11), on worker processes and inline: a timeout charges
the item that ran past it and no other, at every concurrency (an item awaiting past it, or
blocking the event loop past it, fails alone); and what is caught at decoration."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from easycore import Failure, ItemTimeout, producer

pytestmark = pytest.mark.timeout(90)


@producer
async def sleepy(x):
    """Item 3 awaits 3 s; the others a moment."""
    await asyncio.sleep(3 if x == 3 else 0.01)
    return x, os.getpid()


@producer
async def blocks_2(x, seconds=2.0):
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
    """concurrency=4: item 2 holds the loop 2 s (timeout=1) while its neighbours await:
    it fails (not delivered), and no neighbour is charged for the time it held them."""
    out, failures = skipping(blocks_2, range(8), devices=devices, concurrency=4, timeout=1)
    assert [v for v, _ in out] == [0, 1, 3, 4, 5, 6, 7]
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
