"""The process engine: one worker process per device on this machine (the default).

:class:`ProcessEngine` does what a runner needs of an engine (``engine.Engine``): it
starts the workers (``workers.WorkerSet``, every ``init``), streams a run through
:class:`~.run.Run` (the transport over the workers' pipes, under the run's
``books.RunBooks``), reports per-hop statistics, and stops the workers (every ``end``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

from easycore._config.cfgnode import CfgNode
from easycore._exec.core.books import RAISE, ErrorPolicy, RunBooks
from easycore._exec.core.engine import Segments
from easycore._exec.core.plan import Chain, StageStats, idle_stats
from easycore._exec.core.report import Trace
from easycore._exec.core.sizing import Balancer
from easycore._exec.core.sources import Source, source_of
from easycore._exec.process.run import Run
from easycore._exec.process.workers import WorkerSet
from easycore._options import RunOptions

__all__ = ["ProcessEngine"]


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
        self.balancer = Balancer(chain) if chain.sizing else None
        self.trace = Trace(None)  # (the runner's, with trace=)

    in_caller = False

    def start(self) -> None:
        """Start every worker (and with ``wait``, wait for every ``init``).

        Raises:
            SerializationError: a stage function or ``cfg`` cannot be pickled.
            WorkerError, WorkerDied: an ``init`` raised, a worker died while starting (no
                worker is left running).
        """
        try:
            self.workers.start(self.wait)
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
        source = source_of(data)
        run = Run(
            self.workers,
            source,
            options,
            self.ids,
            policy=policy,
            bars=bars,
            balancer=self.balancer,
            trace=self.trace,
        )
        self.last_run = run  # for stats(); it lets go of the data when the run ends
        yield from run.books.stream(run, is_current)

    @property
    def books(self) -> RunBooks | None:
        return None if self.last_run is None else self.last_run.books

    def stats(self) -> list[StageStats]:
        return idle_stats(self.chain) if self.last_run is None else self.last_run.stats()

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
