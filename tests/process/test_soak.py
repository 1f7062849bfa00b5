"""Soak: many items with ~1% random faults (raise, os._exit, SIGKILL) over 2 workers, retries=3.

Short in CI; `EASYCORE_SOAK=20000 just soak` for a long run. Prints its figures.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from easycore import consumer, producer

ITEMS = int(os.environ.get("EASYCORE_SOAK", "2000"))


@pytest.mark.timeout(600)
def test_soak_random_faults(tmp_path: Path, capsys):
    """With ~1% of items failing once, retries=3 gives exactly the fault-free result."""
    rng = random.Random(1234)
    faults = {
        i: rng.choice(["raise", "exit", "sigkill"]) for i in range(ITEMS) if rng.random() < 0.01
    }

    def work(x, *, worker):
        how = faults.get(x)
        if how is not None:
            try:
                fd = os.open(tmp_path / str(x), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                how = None
            else:
                os.close(fd)
        if how == "raise":
            raise RuntimeError(f"fault at {x}")
        if how == "exit":
            os._exit(7)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        return x * x

    collect = consumer(init=list)(lambda acc, y: acc.append(y))
    t0 = time.perf_counter()
    out = (producer(work) >> collect).map(range(ITEMS), devices=2, retries=3)
    wall = time.perf_counter() - t0
    assert out == [x * x for x in range(ITEMS)]
    injected = len(list(tmp_path.iterdir()))
    assert injected == len(faults)
    kinds = {k: sum(1 for v in faults.values() if v == k) for k in ("raise", "exit", "sigkill")}
    with capsys.disabled():
        print(
            f"\nsoak: {ITEMS} items, {injected} faults injected {kinds}, "
            f"{injected} retries used, {wall:.2f} s wall"
        )
