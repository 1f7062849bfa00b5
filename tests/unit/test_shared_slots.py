"""A place's shared slots under chunks that arrive at once (a Ray actor that waits runs up
to ``k + 1`` chunk calls on threads of its own, in no set order, and ``finish`` on another).

These are races: each case is tried many times, and a lost one shows as a thread that died
(on "This event loop is already running") or a chunk whose results are wrong."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from easycore import producer
from easycore._exec.core.protocol import Task
from easycore._exec.core.stages import ChunkRun, PreparedStages


@producer
async def doubled(x: int) -> int:
    await asyncio.sleep(0.001)
    return 2 * x


@producer
def tripled(x: int) -> int:
    return 3 * x


@pytest.fixture
def thread_deaths() -> Iterator[list[BaseException]]:
    """Exceptions that ended a thread while the test ran."""
    seen: list[BaseException] = []
    before = threading.excepthook

    def hook(args: Any) -> None:
        seen.append(args.exc_value)

    threading.excepthook = hook
    try:
        yield seen
    finally:
        threading.excepthook = before


def _place(stage: Any) -> PreparedStages:
    place = PreparedStages([stage], device="cpu", cfg=None, worker=0, concurrency=4)
    assert place.start() is None
    return place


def _chunk(place: PreparedStages, base: int) -> list[Any]:
    units = [base + k for k in range(6)]
    task = Task(0, None, base, units, False, 0, {})
    (values, _, _), _ = ChunkRun(place, units, base, task).start().result()
    return values


def _at_once(*calls: Any) -> list[Any]:
    """Run ``calls`` on threads of their own, released together; what each gave."""
    gate = threading.Barrier(len(calls))
    out: list[Any] = [None] * len(calls)

    def run(k: int) -> None:
        gate.wait()
        try:
            out[k] = calls[k]()
        except BaseException as exc:  # (a chunk cancelled by finish: the run is over)
            out[k] = exc

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.parametrize(
    ("stage", "factor"), [(doubled, 2), (tripled, 3)], ids=["async", "threads"]
)
def test_two_chunks_arriving_at_once_share_the_slots(
    stage: Any, factor: int, thread_deaths: list[BaseException]
) -> None:
    for _ in range(40):
        place = _place(stage)
        first, second = _at_once(partial(_chunk, place, 0), partial(_chunk, place, 100))
        assert first == [factor * k for k in range(6)]
        assert second == [factor * (100 + k) for k in range(6)]
        assert place.finish() is None
    assert thread_deaths == []


@pytest.mark.parametrize(
    ("stage", "factor"), [(doubled, 2), (tripled, 3)], ids=["async", "threads"]
)
def test_a_chunk_arriving_beside_finish_waits_for_it(
    stage: Any, factor: int, thread_deaths: list[BaseException]
) -> None:
    for _ in range(40):
        place = _place(stage)
        _chunk(place, 0)  # (the loop thread, or the threads, are running)
        chunk, finished = _at_once(partial(_chunk, place, 10), place.finish)
        assert finished is None
        # the chunk ran whole before finish, or was cancelled by it, or (arriving after it)
        # refused: never run on stages whose end ran, never a thread that died
        if isinstance(chunk, BaseException):
            assert isinstance(chunk, (RuntimeError, concurrent.futures.CancelledError))
        else:
            assert chunk == [factor * (10 + k) for k in range(6)]
        place.finish()
    assert thread_deaths == []


@pytest.mark.parametrize(
    ("stage", "factor"), [(doubled, 2), (tripled, 3)], ids=["async", "threads"]
)
def test_an_actor_after_its_finish_fails_a_chunk_rather_than_the_call(
    stage: Any, factor: int
) -> None:
    # (Ray logs a failed call nobody waits for as an unhandled error; such a chunk belongs
    # to a run that is over)
    from easycore._exec.core.protocol import Broken
    from easycore._exec.ray.actor import StageActor

    actor = StageActor(b"", [], "cpu", worker=0, hop=1, batch=None, concurrency=4)
    actor.stages = _place(stage)
    assert actor.run([1, 2], 10, None, 0, {}, (0, 1))[0] == [factor, 2 * factor]
    # (the stages' finish alone: the actor's also ends every child of this process)
    assert actor.stages.finish() is None
    values, meta = actor.run([1, 2, 3], 10, None, 0, {}, (0, 1))
    assert [(type(v), v.hop, v.unit) for v in values] == [(Broken, 1, 10 + k) for k in range(3)]
    assert values[0].failure.stage == "<run over>" and meta.n == 0


def test_a_segment_released_twice_is_lent_once():
    """A message that did not unpickle is read again leniently, and the arrays its first
    reading built release their segments too: a segment must not be free twice (two
    arrays of later messages would share it)."""
    from easycore._exec.process.channel import _Pool

    pool = _Pool()
    seg = pool.alloc(1 << 20)
    pool.release([seg])
    pool.release([seg])
    assert pool.alloc(1 << 20) == seg
    assert pool.alloc(1 << 20) != seg
