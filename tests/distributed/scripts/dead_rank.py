"""Rank 1 dies before the results are exchanged; rank 0 must get an error, not a hang."""

from __future__ import annotations

import os
import time

from easycore import distributed, producer


@producer
def same(x):
    return x


if __name__ == "__main__":
    distributed.init(timeout=60)
    if distributed.rank() == 1:
        os._exit(7)
    start = time.monotonic()
    try:
        same.map(range(10), devices=1, distributed=True)
    except Exception as exc:
        took = time.monotonic() - start
        print(f"rank 0 got {type(exc).__name__}: {exc} after {took:.1f} s", flush=True)
    else:
        raise SystemExit("rank 0 finished a map whose other rank was dead")
