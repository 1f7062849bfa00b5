"""0.4 Example 1, functional: square in workers, sum in the caller.

Run: python examples/sum_of_squares.py [N_WORKERS]
"""

from __future__ import annotations

import sys

from easycore import consumer, producer


@producer
def square(x):
    return x * x


@consumer(init=0)
def summer(total, x):
    return total + x


if __name__ == "__main__":
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    result = (square >> summer).map(range(100), devices=workers, ordered=False)
    print(result)
    assert result == sum(x * x for x in range(100))
