"""The error tree: roots, builtin mix-ins, pickling with message and attributes."""

from __future__ import annotations

import pickle

import cloudpickle
import pytest

from easycore import (
    EasycoreError,
    FrozenError,
    ItemTimeout,
    SerializationError,
    WorkerDied,
    WorkerError,
)

ERRORS = [
    EasycoreError("root"),
    FrozenError("frozen node"),
    WorkerError("user code raised", "predict", "cuda:1", 1, 42, "Traceback..."),
    ItemTimeout("too slow", "<timeout>", "cpu", 0, 7),
    SerializationError("cannot pickle", "<item pickling>", None, None, 3),
    WorkerDied("gone", "cpu", 1, -9, 5),
]


class TestTree:
    @pytest.mark.parametrize("err", ERRORS, ids=lambda e: type(e).__name__)
    def test_all_derive_from_root(self, err):
        """Every library error is an EasycoreError."""
        assert isinstance(err, EasycoreError)

    def test_builtin_mixins(self):
        """The builtin mix-ins callers already catch are there."""
        assert issubclass(FrozenError, AttributeError)
        assert issubclass(SerializationError, TypeError)
        assert issubclass(SerializationError, WorkerError)
        assert issubclass(ItemTimeout, WorkerError)
        assert issubclass(WorkerDied, WorkerError)

    @pytest.mark.parametrize(
        "dumps", [pickle.dumps, cloudpickle.dumps], ids=["pickle", "cloudpickle"]
    )
    @pytest.mark.parametrize("err", ERRORS, ids=lambda e: type(e).__name__)
    def test_pickle_round_trip(self, err, dumps):
        """Errors survive a pickle round trip with message and attributes."""
        again = pickle.loads(dumps(err))
        assert type(again) is type(err)
        assert str(again) == str(err)
        assert vars(again) == vars(err)

    def test_attributes(self):
        """WorkerError and WorkerDied carry where it happened."""
        err = ERRORS[2]
        assert (err.stage, err.device, err.worker, err.index) == ("predict", "cuda:1", 1, 42)
        died = ERRORS[-1]
        assert (died.device, died.worker, died.exitcode, died.index) == ("cpu", 1, -9, 5)
