"""Engines: where a runner's hops run, and what a runner needs of one (:class:`Engine`).

The engines are ``process.engine.ProcessEngine`` (worker processes, the default),
``inline.InlineEngine`` (the calling process) and ``ray.engine.RayEngine`` (Ray actors).
Each starts (``init`` everywhere), streams a run's results as segments
(``outcomes.Segment``), reports per-hop statistics, and stops (``end`` everywhere); its
run keeps its books in ``books.RunBooks``, and what an engine adds is the transport.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from easycore._exec.core.books import ErrorPolicy, RunBooks
from easycore._exec.core.plan import Chain, StageStats
from easycore._exec.core.report import Trace
from easycore._options import RunOptions

__all__ = ["Engine"]

Segments = Iterator[Any]  # PRIMED, then outcomes.Segment values


class Engine(Protocol):
    """What a runner needs of an engine."""

    in_caller: bool  # runs user code in the calling process (submit then runs at once)
    chain: Chain  # the pools it runs, planned
    trace: Trace  # the runner's (``trace=``): each run adds its events

    @property
    def books(self) -> RunBooks | None:
        """The books of the run under way or the last one (None before any)."""

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
