"""Library types are told by ``isinstance``, not by their names: a user's own class that
shares a name (``device``, ``Failed``) is not taken for one (no processes here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from easycore import producer, write


class device:  # (named as torch's class, on purpose)
    def __str__(self) -> str:
        return "cpu"


class Failed(dict):
    """A row whose type shares the name of the engine's failure marker."""


@producer
def double(x):
    return 2 * x


@producer
def row(x):
    return Failed(i=x)


def test_a_class_named_device_is_not_a_torch_device():
    with pytest.raises(ValueError, match="devices must be"):
        double.map([1], devices=device())


def test_a_row_whose_type_is_named_failed_is_written(tmp_path):
    written = (row >> write.jsonl(str(tmp_path))).map(range(3), devices="inline")
    rows = [json.loads(line) for f in written.files for line in Path(f).read_text().splitlines()]
    assert rows == [{"i": 0}, {"i": 1}, {"i": 2}]
