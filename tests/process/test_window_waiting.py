"""The window of a pool that waits (``concurrency=k``) counts its items in flight on top of
the results ``prefetch`` bounds (docs/guide/performance.md, "Memory and prefetch"): in an
ordered run, one long wait leaves the other items room to be fed and to finish behind it,
``2 x prefetch x k`` results per worker, and no more input than
``(2 x prefetch + 1) x k`` items per worker is taken while it waits."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import first_held, started_while_held

pytestmark = pytest.mark.timeout(90)

K = 4  # the pool's concurrency
N = 60  # items
THEN = 0.1  # each item but 0 waits this long: a chunk is one item (a chunk of many items
# makes the window many items: it counts chunks, of 50 ms of work or 1 MiB of results)


@pytest.mark.parametrize(
    ("kind", "prefetch"), [("async", None), ("threads", None), ("async", 1), ("async", 3)]
)
def test_one_long_wait_leaves_the_others_fed_and_memory_bounded(tmp_path, kind, prefetch):
    """One worker at concurrency 4: item 0 waits until released, the others 0.1 s.
    While it waits, the stream keeps feeding the worker: at least ``2 x prefetch x k`` items
    after it start (their results wait in order behind it), and at most
    ``(2 x prefetch + 1) x k`` items are taken in all (prefetch is honoured; the default is
    2). Once item 0 ends, every result comes, in order."""
    started, release = tmp_path / "started", tmp_path / "release"
    started.mkdir()
    stage = first_held(started, release, THEN)[kind]
    depth = prefetch or 2
    kw = {} if prefetch is None else {"prefetch": prefetch}
    with stage.open(devices=1, concurrency=K) as runner, ThreadPoolExecutor(1) as caller:
        results = caller.submit(runner.map, range(N), **kw)  # (waiting for item 0)
        try:
            n = started_while_held(started, 1 + 2 * depth * K)
            assert (started / "0").exists() and not release.exists()
            assert n <= (2 * depth + 1) * K, f"{n} items taken while item 0 waits"
        finally:
            release.touch()
        assert results.result() == list(range(N))


def test_two_workers_each_count_their_own_slots(tmp_path):
    """Two workers at concurrency 4, default prefetch: item 0 holds one slot of one worker;
    the window counts both workers' slots: ``2 x (2 x 2 + 1) x 4`` items at most, and at
    least ``2 x 2 x 2 x 4`` after item 0 start while it waits."""
    started, release = tmp_path / "started", tmp_path / "release"
    started.mkdir()
    stage = first_held(started, release, THEN)["async"]
    with stage.open(devices=2, concurrency=K) as runner, ThreadPoolExecutor(1) as caller:
        results = caller.submit(runner.map, range(N))
        try:
            n = started_while_held(started, 1 + 2 * 2 * 2 * K)
            assert n <= 2 * 5 * K, f"{n} items taken while item 0 waits"
        finally:
            release.touch()
        assert results.result() == list(range(N))
