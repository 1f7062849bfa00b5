"""What a user meets in the first hour (issue #44): a resumed run shares its work among the
workers, errors name exactly the items they concern and carry them, and options that
would do nothing are refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from easycore import ItemTimeout, WorkerDied, WorkerError, consumer, producer

pytestmark = pytest.mark.timeout(120)


def slow_until(flag: Path, bad: int):
    """A producer of ``(x, worker)`` taking 20 ms an item, raising at ``bad`` while ``flag``
    exists."""

    @producer
    def work(x, worker):
        time.sleep(0.02)
        if x == bad and flag.exists():
            msg = f"item {x} failed"
            raise ValueError(msg)
        return x, worker

    return work


class TestResume:
    def test_a_resumed_run_shares_its_work_among_the_workers(self, tmp_path):
        """The units a ledger holds cost nothing: they do not teach the chunk size, so the
        work left is shared by both workers rather than sent to one in a single chunk."""
        flag, db = tmp_path / "fail", tmp_path / "run.db"
        flag.touch()
        work = slow_until(flag, 20)
        with pytest.raises(WorkerError, match="item 20"):
            work.map(range(60), devices=2, resume=db)
        flag.unlink()
        out = work.map(range(60), devices=2, resume=db)
        assert [x for x, _ in out] == list(range(60))
        computed = Counter(w for _, w in out[20:])  # (the ledger held items 0..19)
        assert set(computed) == {0, 1}, computed


@producer
def fails_on_short(batch):
    """Raises on the input's last batch (the only one shorter than 8)."""
    if len(batch) < 8:
        msg = f"a short batch of {len(batch)}"
        raise ValueError(msg)
    return len(batch)


@producer
def dies_on_short(batch):
    if len(batch) < 8:
        os._exit(3)
    return len(batch)


@producer
def double(x):
    return 2 * x


class TestNames:
    def test_the_last_batch_names_the_items_it_holds(self):
        """30 items in batches of 8: batch 3 holds items 24..29, not 24..31."""
        with pytest.raises(WorkerError, match=r"batch 3 \(items 24\.\.29\)") as info:
            fails_on_short.map(range(30), devices=2, batch_size=8)
        assert info.value.index == 3

    def test_a_pools_last_batch_names_the_items_it_holds(self):
        """The same for the batches a later pool forms of the previous pool's results."""
        p = double.on(1) >> fails_on_short.on(1, batch_size=8)
        with pytest.raises(WorkerError, match=r"batch 3 \(items 24\.\.29\) of stage"):
            p.map(range(30))

    def test_a_consumers_error_names_the_items_of_the_last_batch(self):
        """The consumer folding the last batch's result names the items that batch holds,
        for map's batches and for a later pool's."""

        @consumer(init=0)
        def picky(acc, y):
            if y is None:
                raise ValueError("no")
            return acc + 1

        @producer
        def short_is_none(batch):
            return None if len(batch) < 8 else len(batch)

        with pytest.raises(WorkerError, match=r"batch 3 \(items 24\.\.29\)") as info:
            (short_is_none >> picky).map(range(30), devices=2, batch_size=8)
        assert info.value.index == 3
        with pytest.raises(WorkerError, match=r"batch 3 \(items 24\.\.29\)"):
            (double.on(1) >> short_is_none.on(1, batch_size=8) >> picky).map(range(30))

    def test_a_death_names_the_items_of_the_last_batch(self):
        with pytest.raises(WorkerDied, match=r"batch 3 \(items 24\.\.29\)"):
            dies_on_short.map(range(30), devices=2, batch_size=8)


@producer
def crash(x):
    if x == 3:
        os._exit(3)
    return x


@producer
def parse(x):
    if x == 3:
        msg = f"cannot parse {x}"
        raise ValueError(msg)
    return x


@producer
def stuck(x):
    if x == 3:
        time.sleep(60)
    return x


@producer
async def waits(x):
    import asyncio

    if x == 3:
        await asyncio.sleep(60)
    return x


class TestErrorsCarry:
    """Every run error is a WorkerError naming the stage, index and item it concerns."""

    def test_user_code_raised(self):
        with pytest.raises(WorkerError) as info:
            parse.map(range(6), devices=2)
        assert (info.value.stage, info.value.index, info.value.item) == ("parse", 3, 3)

    def test_a_batch_is_the_item(self):
        with pytest.raises(WorkerError) as info:
            fails_on_short.map(range(30), devices=2, batch_size=8)
        assert info.value.item == list(range(24, 30))

    def test_a_dead_worker(self):
        with pytest.raises(WorkerError) as info:
            crash.map(range(6), devices=2)
        error = info.value
        assert isinstance(error, WorkerDied)
        assert (error.stage, error.index, error.item, error.exitcode) == ("crash", 3, 3, 3)

    def test_a_worker_that_dies_starting(self):
        """A death in ``init`` concerns no item, and names its pool."""

        def start():
            os._exit(3)

        with pytest.raises(WorkerDied) as info:
            producer(init=start)(parse.fn).map(range(6), devices=2)
        assert (info.value.stage, info.value.index, info.value.item) == ("parse", None, None)

    def test_a_killed_item(self):
        with pytest.raises(ItemTimeout) as info:
            stuck.map(range(6), devices=2, timeout=1)
        assert (info.value.stage, info.value.index, info.value.item) == ("stuck", 3, 3)

    def test_a_cancelled_async_item_names_no_internal_class(self):
        """An async item past its timeout: nothing of the user's raised, and the message
        does not say that it did."""
        with pytest.raises(ItemTimeout) as info:
            waits.map(range(6), devices=2, timeout=1)
        error = info.value
        assert (error.stage, error.index, error.item) == ("waits", 3, 3)
        assert "raised" not in str(error) and "TimedOutItem" not in str(error)
        assert str(error).startswith("waits ran past timeout=1")
        assert str(error).count("waits") == 1  # (the stage named once)


SCRIPT = """\
import linecache
import sys

from easycore import producer


@producer
def predict(x):
    if x == 3:
        raise ValueError("bad item")  # the user's line
    return x


# a notebook's cell: its file is not on disk, its lines are in linecache
CELL = "/no/such/dir/cell-7.py"
SOURCE = "def in_cell(x):\\n    if x == 3:\\n        raise KeyError('from a cell')\\n    return x"
linecache.cache[CELL] = (len(SOURCE), None, SOURCE.splitlines(True), CELL)
exec(compile(SOURCE, CELL, "exec"))

if __name__ == "__main__":
    stage = producer(in_cell) if sys.argv[1] == "cell" else predict
    stage.map(range(6), devices=sys.argv[2] if sys.argv[2] == "inline" else int(sys.argv[2]))
"""


@pytest.mark.parametrize("devices", ["2", "inline"])
@pytest.mark.parametrize("where", ["script", "cell"])
def test_an_uncaught_error_shows_the_users_line_once(tmp_path, where, devices):
    """A function defined in the user's script (or a notebook's cell): the uncaught error
    shows its file, line and source line once, and no frame of easycore before them."""
    import easycore

    script = tmp_path / "predict.py"
    script.write_text(SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), where, devices],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    out = run.stderr
    assert run.returncode == 1, out
    if where == "script":
        frame, line = f'File "{script}", line 10, in predict', 'raise ValueError("bad item")'
    else:
        frame, line = 'File "/no/such/dir/cell-7.py", line 3, in in_cell', "raise KeyError("
    assert out.count(frame) == 1, out
    assert out.count(line) == 1, out
    assert "<dynamic-code>" not in out and "RemoteTraceback" not in out, out
    library = os.path.dirname(easycore.__file__)
    shown = out.rsplit("raceback:\n", 1)[1]  # (the error's "Remote traceback:" or "Traceback:")
    assert library not in shown, shown
    # the caller's side: map and the run's entry points, not the machinery below them
    assert out.count(f'File "{library}') <= 3, out


class TestRefused:
    """Options that would do nothing are refused, naming what to do instead."""

    def test_devices_where_every_pool_has_its_own(self):
        p = double.on(1) >> parse.on(1)
        with pytest.raises(ValueError, match=r"devices=4 describes no pool.*own \.on"):
            p.map(range(6), devices=4)
        with pytest.raises(ValueError, match="describes no pool"):
            p.open(devices=["cpu", "cpu"])
        assert p.map(range(3)) == [0, 2, 4]  # (its own devices; "auto" says nothing)
        assert (double >> parse.on(1)).map(range(3), devices=2) == [0, 2, 4]

    def test_on_error_without_errors_skip(self):
        with pytest.raises(ValueError, match="add errors='skip'"):
            parse.map(range(6), devices=2, on_error=print)
        failures = []
        assert parse.map(range(6), devices=2, errors="skip", on_error=failures.append) == [
            0,
            1,
            2,
            4,
            5,
        ]
        assert [f.index for f in failures] == [3]
