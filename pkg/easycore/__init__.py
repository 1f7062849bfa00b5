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

from easycore._config.cfgnode import CfgNode
from easycore._config.registry import Registry
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
from easycore._seeding import derive_seed, item_seed, permutation, seed_everything

if TYPE_CHECKING:
    from easycore import write
    from easycore._exec.core.report import PoolReport, Report
    from easycore._exec.core.sizing import Resize
    from easycore._exec.runner import Runner, StageStats
    from easycore._longjobs.checkpoint import load_checkpoint, save_checkpoint
    from easycore._longjobs.sinks import Written

# Loaded on first use, like the executor: a worker process never pays for them.
_LAZY = {
    "PoolReport": "easycore._exec.core.report",
    "Report": "easycore._exec.core.report",
    "Resize": "easycore._exec.core.sizing",
    "Runner": "easycore._exec.runner",
    "StageStats": "easycore._exec.runner",
    "Written": "easycore._longjobs.sinks",
    "load_checkpoint": "easycore._longjobs.checkpoint",
    "save_checkpoint": "easycore._longjobs.checkpoint",
}

__all__ = [
    "CfgNode",
    "EasycoreError",
    "Failure",
    "FrozenError",
    "ItemTimeout",
    "Pipeline",
    "PoolReport",
    "Registry",
    "Report",
    "Resize",
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
    # The executor, sinks and checkpoints load on first use (see the docstring).
    import importlib

    if name == "write":
        return importlib.import_module("easycore.write")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    msg = f"module 'easycore' has no attribute {name!r}"
    raise AttributeError(msg)
