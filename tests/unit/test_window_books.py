"""The window and the first chunks of a pool that waits, on the run's books and the
scheduler (no workers):
its units in flight (``k`` a worker) count on top of the ``2 x prefetch x k`` results it
may hold (docs/guide/performance.md, "Memory and prefetch"); on Ray its chunks start at
``k`` units (an actor call each), on worker processes at ``k / 16``."""

from __future__ import annotations

import pytest

from easycore import producer
from easycore._exec.core.books import RAISE, RunBooks
from easycore._exec.core.plan import plan_chain
from easycore._exec.core.scheduler import Place, Scheduler
from easycore._exec.core.sources import source_of
from easycore._options import RunOptions


def books(concurrency: int = 1, prefetch: int | None = None, **kw: int) -> RunBooks:
    chain = plan_chain(producer(lambda x: x)._as_pipeline(), 2, concurrency=concurrency)
    return RunBooks(chain, source_of(range(10_000)), RunOptions(prefetch=prefetch), RAISE, **kw)


def window(b: RunBooks, n: int) -> int:
    """The window of a run on ``n`` places."""
    places = [Place(hop=0, index=i) for i in range(n)]
    return Scheduler(b, lambda h: places, iter(range(10))).window()


@pytest.mark.parametrize("prefetch", [None, 1, 8])
def test_a_pool_that_waits_counts_its_slots_on_top_of_its_results(prefetch):
    p = prefetch or 2  # (the default)
    assert window(books(64, prefetch), 2) == 2 * p * 2 * 64 + 2 * 64


def test_a_pool_that_waits_with_big_chunks_holds_prefetch_plus_one_of_them():
    b = books(4, 2)
    b.chunk_size = 100  # (fast waits: chunks of ~50 ms are many units)
    assert window(b, 2) == 3 * 2 * 100


@pytest.mark.parametrize("prefetch", [None, 3])
def test_a_plain_pool_keeps_its_window(prefetch):
    b, p = books(1, prefetch), prefetch or 2
    assert window(b, 2) == 2 * p * 2  # chunks of one unit: 2 x prefetch a worker
    b.chunk_size = 50
    assert window(b, 2) == (p + 1) * 2 * 50


def test_chunks_of_a_pool_that_waits_start_at_k_on_ray_and_k_over_16_on_processes():
    assert (books(64).chunk_size, books(64, shares=1).chunk_size) == (4, 64)
    assert (books(4).chunk_size, books(1, shares=1).chunk_size) == (1, 1)
    work = books(64, shares=1).take(10_000)
    assert work is not None and len(work.items) == 64
