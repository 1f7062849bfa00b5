"""max_items_per_worker on an open Ray runner counts what an actor ran in earlier runs: one
past the bound when a run starts is replaced before it takes work (the run hung)."""

from __future__ import annotations

import os

import pytest

from easycore import producer

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("local_ray")]


@producer
def tagged(x):
    return (x + 1, os.getpid())


def test_an_actor_past_the_bound_from_an_earlier_run_is_replaced():
    with tagged.open(devices=2, engine="ray") as runner:
        first = runner.map(range(4))
        out = runner.map(range(6), max_items_per_worker=1)
    assert [x for x, _ in first] == [1, 2, 3, 4]
    assert [x for x, _ in out] == [1, 2, 3, 4, 5, 6]
    assert len({p for _, p in out}) == 6
