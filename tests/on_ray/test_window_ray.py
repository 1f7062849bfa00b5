"""On engine="ray" the window of a pool that waits counts its actors' items in flight on top
of the results ``prefetch`` bounds, as on worker processes (tests/process/
test_window_waiting.py): one long wait leaves the others fed, and the input taken stays
bounded."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import first_held, started_while_held

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("local_ray")]

K = 4


def test_one_long_wait_leaves_the_others_fed_and_memory_bounded(tmp_path):
    """One actor at concurrency 4, default prefetch (2): item 0 waits until released, the
    others 0.1 s. While it waits at least ``2 x 2 x 4`` items after it start, and at most
    ``(2 x 2 + 1) x 4`` are taken; then every result comes, in order."""
    started, release = tmp_path / "started", tmp_path / "release"
    started.mkdir()
    stage = first_held(started, release, 0.1)["async"]
    with (
        stage.open(devices=1, concurrency=K, engine="ray") as runner,
        ThreadPoolExecutor(1) as caller,
    ):
        results = caller.submit(runner.map, range(60))
        try:
            n = started_while_held(started, 1 + 2 * 2 * K)
            assert n <= 5 * K, f"{n} items taken while item 0 waits"
        finally:
            release.touch()
        assert results.result() == list(range(60))
