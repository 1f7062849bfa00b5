"""What cannot wait is refused at decoration, ``init`` and ``end`` included (API.md 11)."""

from __future__ import annotations

import pytest

from easycore import consumer, producer


async def aend(acc):
    return acc


async def ainit():
    return 0


async def agen_state():
    yield 1


async def astop(state):
    assert state == 0


def fold(total, x):
    return total + x


def work(x):
    return x


@pytest.mark.parametrize(
    ("kwargs", "role"),
    [
        ({"init": 0, "end": aend}, r"consumer end 'aend' is `async def`"),
        ({"init": ainit}, r"consumer init 'ainit' is `async def`"),
        ({"init": agen_state}, r"consumer init 'agen_state' is an async generator"),
    ],
)
def test_consumer_init_end_that_wait_are_refused(kwargs, role):
    with pytest.raises(TypeError, match=role + r".*make it a plain `def`"):
        consumer(**kwargs)(fold)


@pytest.mark.parametrize("where", ["init", "end"])
def test_producer_init_end_async_generator_is_refused(where):
    with pytest.raises(
        TypeError,
        match=rf"producer {where} 'agen_state' is an async generator.*"
        r"make it `async def` \(or a plain `def`\) without `yield`",
    ):
        producer(**{where: agen_state})(work)


def test_producer_async_init_and_end_still_run():
    stage = producer(init=ainit, end=astop)(work)
    assert stage.map([1, 2], devices="inline") == [1, 2]
