"""easycore: run work in parallel across CPU cores and GPUs with plain functions.

>>> from easycore import producer, consumer
>>> @producer
... def square(x):
...     return x * x
>>> @consumer(init=0)
... def summer(total, x):
...     return total + x
>>> (square >> summer).map(range(10), devices="inline")
285

``import easycore`` does not import torch; torch loads when a pipeline first runs on workers.
The executor itself (``easycore._exec``) loads on first use too: a program that only reads a
config, or a worker process, never pays for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.5.0"

from easycore import write
from easycore._checkpoint import load_checkpoint, save_checkpoint
from easycore._config import CfgNode
from easycore._errors import (
    EasycoreError,
    Failure,
    FrozenError,
    ItemTimeout,
    SerializationError,
    SkippedItemsWarning,
    WorkerDied,
    WorkerError,
)
from easycore._options import RunKwargs
from easycore._pipeline import Pipeline, Stage, compose, consumer, producer
from easycore._registry import Registry
from easycore._seeding import derive_seed, item_seed, permutation, seed_everything
from easycore._sinks import Written

if TYPE_CHECKING:
    from easycore._exec import Runner, StageStats

__all__ = [
    "CfgNode",
    "EasycoreError",
    "Failure",
    "FrozenError",
    "ItemTimeout",
    "Pipeline",
    "Registry",
    "RunKwargs",
    "Runner",
    "SerializationError",
    "SkippedItemsWarning",
    "Stage",
    "StageStats",
    "WorkerDied",
    "WorkerError",
    "Written",
    "__version__",
    "compose",
    "consumer",
    "derive_seed",
    "item_seed",
    "load_checkpoint",
    "permutation",
    "producer",
    "save_checkpoint",
    "seed_everything",
    "write",
]


def __getattr__(name: str) -> Any:
    # Runner and StageStats live in the executor, loaded on first use (see the docstring).
    if name in ("Runner", "StageStats"):
        from easycore import _exec

        return getattr(_exec, name)
    msg = f"module 'easycore' has no attribute {name!r}"
    raise AttributeError(msg)
