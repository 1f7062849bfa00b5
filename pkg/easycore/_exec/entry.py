"""The entry points of a run: ``run_map`` and ``run_imap`` (``Pipeline.map``/``imap``), and
``Runner`` (``Pipeline.open``). ``easycore`` and ``_pipeline`` import them on first use.

They live here, not in the package's ``__init__``, which imports nothing: a worker
process importing its loop (``_exec/process/worker_loop.py``), a Ray actor, or a sink's
writer then loads what it uses and not the whole caller's side.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from easycore._exec.core.plan import PipelineDef, StageStats
from easycore._exec.runner import Runner
from easycore._longjobs.position import check_state
from easycore._longjobs.resume import RunIdentity, check_ledger
from easycore._options import RunOptions

__all__ = ["Runner", "StageStats", "run_imap", "run_map"]


def run_map(
    pipeline: PipelineDef, data: Iterable[Any], options: RunOptions, distributed: bool, **where: Any
) -> Any:
    """``Pipeline.map``: fresh workers for one run, closed after it (``where``: the keyword
    arguments of :class:`Runner` that say where: ``devices``, ``cfg``, ``start_method``,
    ``engine``, ``concurrency``)."""
    if distributed:
        from easycore._exec.sharded import sharded_map  # imports torch.distributed helpers

        return sharded_map(pipeline, data, options, **where)
    with _one_shot(pipeline, options, where) as runner:
        return runner.run_map(data, options)


def run_imap(
    pipeline: PipelineDef, data: Iterable[Any], options: RunOptions, **where: Any
) -> Iterator[Any]:
    """``Pipeline.imap``: workers start, and work with them, now; they stop when the results
    are exhausted, closed or dropped."""
    return _one_shot(pipeline, options, where).run_imap(data, options, owned=True)


def _one_shot(pipeline: PipelineDef, options: RunOptions, where: dict[str, Any]) -> Runner:
    """The runner of one ``map``/``imap`` call: a ``resume`` path that is no ledger, or
    another run's, is refused before any worker starts; work goes to each worker as soon as
    it is ready (init errors surface in the run). A run that keeps nothing per worker
    between chunks (no ``timeout`` clock, no recycling) runs Ray's init-less pools as plain
    tasks, not actors."""
    check_state(options, getattr(pipeline, "sink", None))
    if options.resume is not None:
        check_ledger(options.resume, RunIdentity.of(pipeline, where["cfg"], options))
    recycles = options.max_items_per_worker or options.max_worker_memory
    tasks = options.timeout is None and recycles is None
    return Runner(pipeline, **where, _wait=False, _tasks=tasks)
