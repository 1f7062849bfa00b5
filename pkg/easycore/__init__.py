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
"""

from __future__ import annotations

__version__ = "0.5.0"

from easycore._config import CfgNode
from easycore._errors import (
    EasycoreError,
    FrozenError,
    ItemTimeout,
    SerializationError,
    WorkerDied,
    WorkerError,
)
from easycore._exec import Runner, StageStats
from easycore._pipeline import Pipeline, Stage, compose, consumer, producer
from easycore._registry import Registry

__all__ = [
    "CfgNode",
    "EasycoreError",
    "FrozenError",
    "ItemTimeout",
    "Pipeline",
    "Registry",
    "Runner",
    "SerializationError",
    "Stage",
    "StageStats",
    "WorkerDied",
    "WorkerError",
    "__version__",
    "compose",
    "consumer",
    "producer",
]
