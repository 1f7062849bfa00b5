"""A CPU-bound pure-Python job on 1 and on 2 workers: the speed-up of parallel workers.

Run: python examples/cpu_speedup.py [ITEMS]
"""

from __future__ import annotations

import os
import sys
import time

from easycore import consumer, producer


@producer
def count_primes(n):
    """Count primes below n the slow way (pure Python, holds the GIL)."""
    return sum(all(k % d for d in range(2, int(k**0.5) + 1)) for k in range(2, n))


@consumer(init=0)
def total(acc, x):
    return acc + x


def timed(workers: int, data: list[int]) -> tuple[int, float]:
    pipeline = count_primes >> total
    with pipeline.open(devices=workers) as runner:  # start-up not timed
        t0 = time.perf_counter()
        result = runner.map(data)
        return result, time.perf_counter() - t0


if __name__ == "__main__":
    items = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    data = [20_000] * items
    one, t1 = timed(1, data)
    two, t2 = timed(2, data)
    assert one == two
    cores = len(os.sched_getaffinity(0))
    print(
        f"{items} items: 1 worker {t1:.2f} s, 2 workers {t2:.2f} s"
        f" -> speed-up {t1 / t2:.2f}x ({cores} cores)"
    )
