"""0.4 Example 4, functional: parameters from outside through cfg.

Run: python examples/sum_of_power.py [EXPONENT]
"""

from __future__ import annotations

import sys

from easycore import CfgNode, consumer, producer


@producer
def power(x, *, cfg):
    return x**cfg.exponent


@consumer(init=0)
def summer(total, x):
    return total + x


if __name__ == "__main__":
    cfg = CfgNode({"exponent": int(sys.argv[1]) if len(sys.argv) > 1 else 3})
    result = (power >> summer).map(range(100), devices=3, cfg=cfg)
    print(result)
    assert result == sum(x**cfg.exponent for x in range(100))
