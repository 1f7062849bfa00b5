"""A long sequence of runs on one Ray (issue #40, point 17): what a run leaves in Ray's
reused worker processes (an abandoned endless stream, an open runner with init and end, two
pools) must not touch the next run: an item that raises is that item's WorkerError, on tasks
and on actors, and a worker that dies by os._exit is a WorkerDied that comes without a
minute's wait (the module's timeout bounds the whole sequence)."""

from __future__ import annotations

import itertools
import os

import pytest

from easycore import WorkerDied, WorkerError, producer

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("local_ray")]


@producer
def square(x):
    return x * x


@producer
def plus_one(x):
    return x + 1


def raises_on_3(x):
    if x == 3:
        raise KeyError("nope")
    return x


def exits_on_3(x):
    if x == 3:
        os._exit(3)
    return x


def test_a_sequence_of_runs_reports_each_failure_as_its_own():
    """An endless imap left unread, an open runner with init and end, two pools: then, on
    tasks (no init) and on actors (an init), an item that raises is its WorkerError (not a
    death), and a worker that dies by os._exit a WorkerDied."""
    abandoned = square.imap(itertools.count(), devices=2, engine="ray")
    assert [next(abandoned) for _ in range(50)] == [x * x for x in range(50)]

    state = producer(init=lambda: 10, end=lambda state: None)(lambda x, *, state: x + state)
    with state.open(devices=2, engine="ray") as runner:
        assert runner.map(range(6)) == [x + 10 for x in range(6)]
    assert (square.on(1) >> plus_one.on(1)).map(range(8), engine="ray") == [
        x * x + 1 for x in range(8)
    ]
    for _ in range(2):
        for init in (None, dict):
            with pytest.raises(WorkerError, match="nope") as info:
                producer(init=init)(raises_on_3).map(range(6), devices=2, engine="ray")
            assert not isinstance(info.value, WorkerDied), info.value  # (a WorkerError too)
            assert info.value.index == 3
            with pytest.raises(WorkerDied):
                producer(init=init)(exits_on_3).map(range(6), devices=2, engine="ray")
    abandoned.close()


def test_a_run_that_a_death_fails_starts_no_fresh_actor(tmp_path):
    """With no retries, the death of an actor fails the run at once: the error does not wait
    for a fresh actor to start and run its init (a Ray worker starts slowly on a busy
    machine), and none is started for a run that is over."""

    def init():
        (tmp_path / f"init-{os.getpid()}").touch()

    with pytest.raises(WorkerDied, match="item 3"):
        producer(init=init)(exits_on_3).map(range(6), devices=2, engine="ray")
    assert len(list(tmp_path.glob("init-*"))) == 2  # the two actors', no third
