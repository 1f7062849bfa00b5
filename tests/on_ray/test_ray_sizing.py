"""Pools that size themselves on engine="ray": actors added and removed within the budget
(the cluster's CPUs by default), results those of a fixed split; the report and the trace."""

from __future__ import annotations

import json
import os
import random
import time

import pytest

from easycore import item_seed, producer
from easycore._exec.core import sizing

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("local_ray")]


@producer(init=lambda: None)
def seeded(x):
    time.sleep(0.01)
    return x, item_seed()


@producer
def plain(x):
    time.sleep(0.01)
    return x * 3


@pytest.fixture
def churn(monkeypatch):
    monkeypatch.setattr(sizing, "CHURN", random.Random(3))
    monkeypatch.setattr(sizing, "CHURN_EVERY", 0.2)


def test_actors_come_and_go_and_change_nothing_but_speed(churn, tmp_path):
    path = tmp_path / "run.json"
    with seeded.on((1, 2)).open(engine="ray", trace=path) as runner:
        out = runner.map(range(150), seed=5)
        stats = runner.stats()
        report = runner.report()
    assert out == seeded.map(range(150), seed=5, devices="inline")
    assert stats[0].resizes and stats[0].workers in (1, 2)
    assert report.limited_by == "seeded" and report.pools[0].workers in (1, 2)
    events = json.loads(path.read_text())["traceEvents"]
    assert [e for e in events if e["ph"] == "X"] and [e for e in events if e["ph"] == "i"]


def test_a_one_shot_pool_of_tasks_sizes_itself(churn):
    assert plain.on((1, 2)).map(range(120), engine="ray") == [3 * x for x in range(120)]


def test_a_budget_beyond_the_cluster_is_refused_before_any_actor_starts():
    with pytest.raises(ValueError, match="Ray cluster has 2 CPU"):
        (plain.on((2, 3)) >> seeded.on((1, 3))).map(range(4), engine="ray", cpus=6)


def test_a_dead_actor_leaves_its_pool_and_a_fresh_one_joins(tmp_path):
    flag = tmp_path / "died"

    @producer(init=lambda: None)
    def dies_once(x):
        if x == 20 and not flag.exists():
            flag.write_text("")
            os._exit(3)
        return x

    with dies_once.on((1, 2)).open(engine="ray") as runner:
        assert runner.map(range(60), retries=1) == list(range(60))
        places = runner._engine.pools[0]
        assert places and not any(a.gone for a in places)  # (none dead kept in the pool)
        assert runner.map(range(10)) == list(range(10))
