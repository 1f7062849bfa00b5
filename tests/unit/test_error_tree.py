"""The error tree as a caller meets it (issue #44): ``WorkerError`` is any failure of a run's
items, and every run error pickles with the stage, index and item it names."""

from __future__ import annotations

import pickle
import threading

import cloudpickle
import pytest

from easycore import ItemTimeout, SerializationError, WorkerDied, WorkerError


def test_every_run_error_is_a_worker_error():
    """``except WorkerError`` catches any failure of my items, a dead worker's included."""
    for cls in (WorkerDied, ItemTimeout, SerializationError):
        assert issubclass(cls, WorkerError)


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps], ids=["pickle", "cloudpickle"])
def test_a_dead_workers_error_pickles_with_what_it_names(dumps):
    died = WorkerDied("gone", "cpu", 1, -9, 5, "work", [10, 11])
    again = pickle.loads(dumps(died))
    assert (again.stage, again.index, again.item, again.exitcode) == ("work", 5, [10, 11], -9)
    assert (again.device, again.worker, str(again)) == ("cpu", 1, "gone")


def test_an_item_that_does_not_pickle_travels_as_its_repr():
    """The error of an item that would not pickle still pickles: its item becomes a repr."""
    error = SerializationError("cannot pickle", "work", None, None, 3)
    error.concerns("work", threading.Lock())
    again = pickle.loads(pickle.dumps(error))
    assert (again.stage, again.index) == ("work", 3)
    assert isinstance(again.item, str) and "lock" in again.item


def test_concerns_names_the_stage_only_where_none_is_named():
    """The stage a worker named is kept; else the pool's is named."""
    raised = WorkerError("boom", "predict (init)")
    raised.concerns("predict", 7)
    assert (raised.stage, raised.item) == ("predict (init)", 7)
    died = WorkerDied("gone", "cpu", 0, -9, 8)
    died.concerns("slow", 8)
    assert (died.stage, died.item) == ("slow", 8)
