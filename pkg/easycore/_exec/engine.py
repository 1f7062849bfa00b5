"""Engines: where a runner's hops run. Each runs the same prepared stages (``_stages``).

* :class:`ProcessEngine`: one worker process per device on this machine (the default);
* ``InlineEngine`` (``inline.py``): everything in the calling process.

An engine starts (``init`` everywhere), streams a run's results as segments
(``outcomes.Segment``), reports per-hop statistics, and stops (``end`` everywhere). Its run
keeps its books in ``core.RunBooks``; what an engine adds is the transport (how chunks
reach workers and what comes back). Another engine implements the same four calls; the
runner, the consumer fold, ``submit`` and the options stay as they are.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from easycore._config import CfgNode
from easycore._exec.core import RAISE, ErrorPolicy
from easycore._exec.plan import Chain, StageStats, idle_stats
from easycore._exec.run import Run
from easycore._exec.sources import Source, source_of
from easycore._exec.workers import WorkerSet
from easycore._options import RunOptions

__all__ = ["Engine", "ProcessEngine"]

Segments = Iterator[Any]  # PRIMED, then outcomes.Segment values


class Engine(Protocol):
    """What a runner needs of an engine."""

    in_caller: bool  # runs user code in the calling process (submit then runs at once)
    chain: Chain  # the pools it runs, planned

    def start(self) -> None: ...
    def stream(
        self,
        data: Any,  # an iterable; for a process engine also a Source (submit's live one)
        options: RunOptions,
        *,
        bars: list[Any] | None = None,
        policy: ErrorPolicy = ...,
        is_current: Callable[[], bool] = ...,
    ) -> Segments: ...
    def stats(self) -> list[StageStats]: ...
    def stop(self, grace: float | None, report: bool) -> None: ...


class ProcessEngine:
    """One worker process per device, every hop; runs go through :class:`~.run.Run`.

    Args:
        wait: ``start`` waits until every ``init`` has run (``open``); False for a one-shot
            ``map``, where work goes to each worker as soon as it is ready and init errors
            surface during the run.
    """

    def __init__(self, chain: Chain, cfg: CfgNode, start_method: str | None, wait: bool) -> None:
        self.chain = chain
        self.workers = WorkerSet(chain, cfg, start_method)
        self.wait = wait
        # chunk ids never repeat on a runner: a late reply from an earlier run cannot match
        self.ids = itertools.count()
        self.last_run: Run | None = None

    in_caller = False

    def start(self) -> None:
        """Start every worker (and with ``wait``, wait for every ``init``).

        Raises:
            SerializationError: a stage function or ``cfg`` cannot be pickled.
            WorkerError, WorkerDied: an ``init`` raised, a worker died while starting (no
                worker is left running).
        """
        self.workers.start_payloads()
        try:
            self.workers.start()
            if self.wait:
                self.workers.wait_ready()
        except BaseException:
            self.stop(grace=0.0, report=False)
            raise

    def stream(
        self,
        data: Iterable[Any] | Source,
        options: RunOptions,
        *,
        bars: list[Any] | None = None,
        policy: ErrorPolicy = RAISE,
        is_current: Callable[[], bool] = lambda: True,
    ) -> Segments:
        run = Run(
            self.workers,
            source_of(data),
            options,
            self.ids,
            policy=policy,
            bars=bars,
        )
        self.last_run = run  # for stats(); it lets go of the data when the run ends
        yield from run.books.stream(run, is_current)

    def stats(self) -> list[StageStats]:
        if self.last_run is None:
            return idle_stats(self.chain)
        return self.last_run.stats()

    def stop(self, grace: float | None, report: bool) -> None:
        """Run ``end`` in every worker (``grace`` seconds at most; None: for as long as it
        takes) and stop them.

        Raises:
            WorkerError, WorkerDied: (``report``) an ``end`` raised or a worker died; every
                worker is stopped all the same.
        """
        failure = self.workers.stop(grace)
        if report and failure is not None:
            raise failure
