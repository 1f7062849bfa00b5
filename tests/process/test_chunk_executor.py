"""The one chunk executor of every engine (``easycore._exec.core.stages.ChunkRun``): its one
retry loop counts every failure of a unit against the same ``retries``."""

from __future__ import annotations

import threading
from pathlib import Path

from easycore import producer


def test_a_result_that_does_not_pickle_and_a_raise_share_the_retries(tmp_path: Path) -> None:
    """Item 3's first result cannot be pickled back to the caller and its second try raises:
    with ``retries=2`` the third try's result comes back (the re-run for a result that does
    not pickle once failed the item at the first exception, its retries left unused)."""
    calls = tmp_path / "calls"

    @producer
    def flaky(x: int) -> object:
        if x == 3:
            with open(calls, "a") as f:
                f.write("x")
            tries = calls.stat().st_size
            if tries == 1:
                return threading.Lock()
            if tries == 2:
                raise ValueError("second try")
        return 2 * x

    assert flaky.on(1).map(range(6), retries=2) == [0, 2, 4, 6, 8, 10]
    assert calls.read_text() == "xxx"
