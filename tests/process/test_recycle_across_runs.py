"""max_items_per_worker on an open runner counts the items a worker ran in earlier runs:
a worker that is past the bound when a run starts is replaced before it takes work (the run
stalled with an internal error, and hung on Ray)."""

from __future__ import annotations

import os

import pytest

from easycore import producer

pytestmark = pytest.mark.timeout(60)


@producer
def tagged(x):
    return (x + 1, os.getpid())


def test_a_worker_past_the_bound_from_an_earlier_run_is_replaced():
    with tagged.open(devices=2) as runner:
        first = runner.map(range(4))
        out = runner.map(range(6), max_items_per_worker=1)
    assert [x for x, _ in first] == [1, 2, 3, 4]
    assert [x for x, _ in out] == [1, 2, 3, 4, 5, 6]
    # one item per worker: six fresh workers, none of the first run's
    assert len({p for _, p in out}) == 6
    assert not {p for _, p in out} & {p for _, p in first}
