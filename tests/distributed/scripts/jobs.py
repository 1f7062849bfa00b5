"""What the distributed tests run: the same scenarios on every rank of a job, and in-process.

Each scenario is ``fn(devices, distributed, marks)``: the test computes the single-process
result with ``devices="inline"``, ``distributed=False``; each rank of a launched job runs it
with ``devices=1`` (or ``"local"``), ``distributed=True``. ``marks`` is a file the consumer's
``end`` appends the rank to, so the test can count how often the consumer ran.
"""

from __future__ import annotations

import os
import random

import torch  # imported before any item, as in a worker: seeding covers torch from item 0

from easycore import WorkerError, consumer, distributed, producer


@producer
def square(x):
    return x * x


@producer
def scale(x, *, cfg):
    return x * cfg.K


@producer
def length_and_sum(batch):
    return (len(batch), sum(batch))


@producer
def noisy(x):
    return (x, random.random(), float(torch.rand(1)))


@producer
def noisy_batch(batch):
    return [(x, random.random()) for x in batch]


@producer
def fail_at_5(x):
    if x == 5:
        raise ValueError(f"bad item {x}")
    return x


@producer
def die_at_3(x):
    if x == 3:
        os._exit(3)
    return x


def mark(acc, *, cfg):
    with open(cfg.MARKS, "a") as f:
        f.write(f"{distributed.rank()}\n")
    return tuple(acc)


@consumer(init=list, end=mark)
def collect(acc, y):
    acc.append(y)


@consumer(init=0)
def fussy_sum(total, y):
    if y == 16:
        raise KeyError(f"consumer refuses {y}")
    return total + y


def _local(devices):
    return "local" if devices != "inline" else devices


SCENARIOS = {
    "plain": lambda dev, d, marks: square.map(range(23), devices=dev, distributed=d),
    "consumer": lambda dev, d, marks: (square >> collect).map(
        range(23), devices=dev, cfg={"MARKS": marks}, distributed=d
    ),
    "cfg": lambda dev, d, marks: scale.map(range(7), devices=dev, cfg={"K": 3}, distributed=d),
    "batches": lambda dev, d, marks: length_and_sum.map(
        range(23), devices=dev, batch_size=4, distributed=d
    ),
    "seed": lambda dev, d, marks: noisy.map(range(11), devices=dev, seed=7, distributed=d),
    "seed_batches": lambda dev, d, marks: (noisy_batch >> collect).map(
        range(13), devices=dev, batch_size=3, seed=5, cfg={"MARKS": marks + ".b"}, distributed=d
    ),
    "generator": lambda dev, d, marks: square.map(
        (i for i in range(17)), devices=dev, distributed=d
    ),
    "local": lambda dev, d, marks: square.map(range(9), devices=_local(dev), distributed=d),
    "error_item": lambda dev, d, marks: fail_at_5.map(range(12), devices=dev, distributed=d),
    "error_died": lambda dev, d, marks: die_at_3.map(range(8), devices=dev, distributed=d),
    "error_consumer": lambda dev, d, marks: (square >> fussy_sum).map(
        range(9), devices=dev, distributed=d
    ),
    "after_errors": lambda dev, d, marks: square.map(range(5), devices=dev, distributed=d),
}


def describe(exc: BaseException) -> dict:
    """What a test checks of an error, in plain picklable values."""
    cause = exc.__cause__
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "cause_type": type(cause).__name__ if cause is not None else None,
        "cause": str(cause) if cause is not None else None,
        "index": getattr(exc, "index", None),
        "stage": getattr(exc, "stage", None),
    }


def run(name: str, devices, is_distributed: bool, marks: str):
    """("ok", result) or ("error", description) of one scenario."""
    try:
        return ("ok", SCENARIOS[name](devices, is_distributed, marks))
    except WorkerError as exc:
        return ("error", describe(exc))
