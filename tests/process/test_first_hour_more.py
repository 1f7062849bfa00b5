"""An uncaught run error shows the user's line and at most one frame of easycore, on every
engine and entry point; an async item past its timeout has no internal class as its cause,
as a killed item (API.md sections 2, 3 and 11; issue #44.5, #44.6)."""

from __future__ import annotations

import asyncio
import os
import warnings

import pytest

import easycore
from easycore import (
    ItemTimeout,
    SkippedItemsWarning,
    WorkerError,
    load_checkpoint,
    producer,
    save_checkpoint,
    write,
)
from helpers import run_error_script

pytestmark = pytest.mark.timeout(120)


@producer
async def waits(x):
    await asyncio.sleep(5 if x == 1 else 0)
    return x


@pytest.mark.parametrize("devices", [2, "inline"])
def test_an_async_timeout_has_no_cause(devices):
    """As a sync item past its timeout (killed: ``__cause__`` None), not TimedOutItem."""
    with pytest.raises(ItemTimeout) as info:
        waits.map(range(3), devices=devices, timeout=0.5)
    assert info.value.__cause__ is None
    assert info.value.index == 1


@pytest.mark.parametrize("how", ["map", "imap", "runner", "runner-imap"])
@pytest.mark.parametrize("where", ["2", "inline"])
def test_the_callers_side_shows_one_frame_of_easycore(tmp_path, how, where):
    script, out = run_error_script(tmp_path, how, where)
    assert out.count(f'File "{script}", line 10, in predict') == 1, out
    library = os.path.dirname(easycore.__file__)
    assert out.count(f'File "{library}') <= 1, out


@pytest.mark.parametrize("where", ["2", "inline"])
def test_an_uncaught_async_timeout_shows_no_internal_cause(tmp_path, where):
    """(On Ray: tests/on_ray/test_ray_first_hour.py.)"""
    _, out = run_error_script(tmp_path, "timeout", where)
    assert "ItemTimeout: waits ran past timeout=0.5s" in out, out
    assert "TimedOutItem" not in out and "direct cause" not in out, out
    library = os.path.dirname(easycore.__file__)
    assert out.count(f'File "{library}') <= 1, out


@producer
def fails_on_two(x):
    if x == 2:
        raise ValueError("bad item")
    return x


def versioned(version):
    def work(x):
        return x * version

    return producer(work)


@pytest.mark.parametrize("devices", [2, "inline"])
def test_the_skip_summary_points_at_the_callers_line(devices):
    with pytest.warns(SkippedItemsWarning) as caught:
        assert fails_on_two.map(range(4), devices=devices, errors="skip") == [0, 1, 3]
    assert [w.filename for w in caught] == [__file__]


def test_accepting_changed_code_warns_at_the_callers_line(tmp_path):
    db = tmp_path / "run.db"
    versioned(1).map(range(2), devices="inline", resume=db)
    with pytest.warns(UserWarning, match="accept_changed_code=True") as caught:
        versioned(2).map(range(3), devices="inline", resume=db, accept_changed_code=True)
    assert [w.filename for w in caught] == [__file__]


def test_checkpoint_warnings_point_at_the_callers_line(tmp_path):
    save_checkpoint(tmp_path, 5, model={"w": 1})
    with pytest.warns(UserWarning, match="holds checkpoint-5") as caught:
        save_checkpoint(tmp_path, 3, model={"w": 2})
    newest = tmp_path / "checkpoint-5"
    newest.write_bytes(newest.read_bytes()[:10])  # (cut short: unreadable)
    with warnings.catch_warnings(record=True) as more:
        warnings.simplefilter("always")
        assert load_checkpoint(tmp_path)["step"] == 3
    assert [w.filename for w in [*caught, *more]] == [__file__, __file__]


def key_of(x):
    return 1 // (x - 2)


@producer
def as_row(x):
    return {"x": x}


@pytest.mark.parametrize("devices", [2, "inline"])
def test_a_key_function_that_raises_names_key_and_the_item(tmp_path, devices):
    with pytest.raises(WorkerError, match=r"key= raised ZeroDivisionError") as info:
        fails_on_two.map(range(4), devices=devices, resume=tmp_path / "run.db", key=key_of)
    error = info.value
    assert (error.stage, error.index, error.item) == ("key=", 2, 2)
    assert "item 2" in str(error) and "return 1 // (x - 2)" in str(error)
    assert isinstance(error.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("devices", [2, "inline"])
def test_a_key_function_that_raises_for_a_sinks_key_column_names_key_and_the_item(
    tmp_path, devices
):
    """Without resume=, a sink's key_column asks key= too: the same error."""
    sink = write.jsonl(str(tmp_path / "out"), key_column="k")
    with pytest.raises(WorkerError, match=r"key= raised ZeroDivisionError") as info:
        (as_row >> sink).map(range(4), devices=devices, key=key_of)
    error = info.value
    assert (error.stage, error.index, error.item) == ("key=", 2, 2)
    assert isinstance(error.__cause__, ZeroDivisionError)
