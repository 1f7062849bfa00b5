"""``devices="inline"``: every hop in the calling process, so a debugger's breakpoints work.

The same prepared stages as a worker process runs (``easycore._stages``), with the same
ordering, injection (``device="cpu"``, ``worker=0``), seeds, retries and errors; ``timeout``
is not enforced on plain functions (nothing can be killed), and cancels an ``async def``
unit (run on an event loop here, one unit at a time: ``concurrency`` does not apply). Also
the engine of a pipeline without producers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from easycore._config import CfgNode
from easycore._errors import after_retries
from easycore._exec.core import RAISE, ErrorPolicy, Failed, RunBooks, Segment
from easycore._exec.engine import PRIMED
from easycore._exec.plan import Chain, StageStats, idle_stats
from easycore._exec.sources import batched, source_of
from easycore._options import RunOptions
from easycore._protocol import CACHED, is_cached
from easycore._seeding import seed_loaded
from easycore._stages import PreparedStages, StageFailure

__all__ = ["InlineEngine"]


class InlineEngine:
    """Runs a chain's hops one after the other, item by item, in this process."""

    in_caller = True

    def __init__(self, chain: Chain, cfg: CfgNode) -> None:
        self.chain = chain
        self.cfg = cfg
        self.prepared: list[PreparedStages] = []
        self.books: RunBooks | None = None  # the last run's, for stats()
        self.flying = [0] * len(chain.hops)  # per hop, the unit running now (0 or 1)

    def start(self) -> None:
        """Run every ``init``.

        Raises:
            WorkerError: an ``init`` raised (the ``end`` of those started ran).
        """
        self.prepared = []
        for hop in self.chain.hops:
            stages = PreparedStages(
                hop.stages, device="cpu", cfg=self.cfg, worker=0, hop=hop.index, in_caller=True
            )
            self.prepared.append(stages)
            failed = stages.start()
            if failed is not None:
                self.stop(None, report=False)
                raise failed.to_error("while starting", None) from failed.error

    def stop(self, grace: float | None, report: bool) -> None:
        """Run every started ``end`` (``grace`` does not apply: nothing can be killed).

        Raises:
            WorkerError: an ``end`` raised (``report``; every ``end`` ran all the same).
        """
        first = None
        for stages in self.prepared:
            failed = stages.finish()
            if failed is not None and first is None:
                first = failed
        self.prepared = []
        if first is not None and report:
            raise first.to_error("while ending", None) from first.error

    def stats(self) -> list[StageStats]:
        if self.books is None:
            return idle_stats(self.chain, concurrent=False)
        nothing = [0] * len(self.chain.hops)  # nothing queued: a unit runs when it is pulled
        return self.books.stats(nothing, nothing, self.flying, concurrent=False)

    def stream(
        self,
        data: Iterable[Any],
        options: RunOptions,
        *,
        bars: list[Any] | None = None,
        policy: ErrorPolicy = RAISE,
        is_current: Callable[[], bool] = lambda: True,
    ) -> Iterator[Any]:
        """Yield PRIMED, then one segment per output unit, in input order.

        ``bars``: the last one counts results.
        """
        if options.seed is None and self.chain.hops[0].stages:
            seed_loaded(int.from_bytes(os.urandom(8), "little") >> 1)
        books = self.books = RunBooks(self.chain, source_of(()), options, policy)
        # (index of the unit at this hop, value, its first-hop units)
        units: Iterator[tuple[int, Any, list[Any]]] = (
            (i, item, [item]) for i, item in enumerate(data, books.first)
        )
        for hop, stages in zip(self.chain.hops, self.prepared, strict=False):
            if hop.batch:
                units = _batched(units, hop.batch)
            units = self._run_hop(units, stages, hop.index, books)
        yield PRIMED  # nothing runs ahead of the caller here
        bar = bars[-1] if bars else None
        # one segment per unit; with a sink, per file's group (the run ledger records a file
        # with all its units)
        sink = self.prepared[-1].sink if self.prepared else None
        groups = _written(units, self.prepared[-1], books) if sink else ([u] for u in units)
        try:
            for group in groups:
                if bar is not None:
                    bar.update(len(group))
                yield Segment(group[0][0] * books.align, [v for _, v, _ in group])
        finally:
            books.finished = time.monotonic()

    def _run_hop(
        self,
        units: Iterator[tuple[int, Any, list[Any]]],
        stages: PreparedStages,
        hop: int,
        books: RunBooks,
    ) -> Iterator[tuple[int, Any, list[Any]]]:
        options = books.options
        for index, unit, origin in units:
            if is_cached(unit):  # resume=: the ledger has its result
                yield index, CACHED, origin
                continue
            before = _failed_in(unit)
            if before is not None:  # (a unit of) an earlier hop failed: this one does
                item = origin[0] if books.align == 1 else origin
                yield index, Failed(before.exc, item, before.stage, before.hop), origin
                continue
            t0 = time.perf_counter()
            self.flying[hop] = 1
            try:
                value, failed = stages.run_retrying(  # (timeout: cancels an async unit)
                    unit,
                    index,
                    options.run_seed,
                    options.retries,
                    books.numbering,
                    options.timeout,
                )
            finally:
                self.flying[hop] = 0
            books.count(hop, 1, time.perf_counter() - t0)
            if failed is not None:
                doing = f"while running {books.label(hop, index)}{after_retries(options.retries)}"
                value = _settle(books, failed, doing, hop, index, origin)
            yield index, value, origin


WRITE_GROUP = 256  # units written to one file (at most) in the calling process


def _written(
    units: Iterator[tuple[int, Any, list[Any]]], stages: PreparedStages, books: RunBooks
) -> Iterator[list[tuple[int, Any, list[Any]]]]:
    """The last hop's units in groups, written by its sink (a file holds one group's)."""
    hop = len(books.hops) - 1
    size = min(WRITE_GROUP, stages.sink.rows_per_file or WRITE_GROUP) if stages.sink else 1
    for group in batched(units, size):
        base = group[0][0]
        values = [v for _, v, _ in group]
        inputs = [o[0] if books.align == 1 else o for _, _, o in group]
        keys = books.keys_of([u for _, _, origin in group for u in origin])
        for k, failed in stages.write(base, values, inputs, (), keys):
            index, _, origin = group[k]
            doing = f"while writing {books.label(hop, index)}"
            values[k] = _settle(books, failed, doing, hop, index, origin)
        yield [
            (index, value, origin) for (index, _, origin), value in zip(group, values, strict=True)
        ]


def _settle(
    books: RunBooks, failed: StageFailure, doing: str, hop: int, index: int, origin: list[Any]
) -> Failed:
    """Unit ``index`` of ``hop`` failed (``failed``: the stages' report), settled by the policy."""
    error = failed.to_error(doing, books.index(hop, index))
    error.__cause__ = failed.error
    item = origin[0] if books.align == 1 else origin
    return books.policy.settle(error, item, failed.stage, hop)


def _batched(
    units: Iterator[tuple[int, Any, list[Any]]], size: int
) -> Iterator[tuple[int, Any, list[Any]]]:
    """Batches of ``size`` consecutive units (the last may be shorter), as units."""
    for batch in batched(units, size):
        # (a resumed stream begins at a whole output unit: so at a whole batch of each hop)
        j = batch[0][0] // size
        yield j, [v for _, v, _ in batch], [o for _, _, origin in batch for o in origin]


def _failed_in(unit: Any) -> Failed | None:
    """The failure a unit carries: itself, or a batch's member that failed at the earliest
    hop (the first in input order among those; see ``core.Failed``)."""
    if type(unit) is Failed:
        return unit
    if type(unit) is list:
        return min((v for v in unit if type(v) is Failed), key=lambda f: f.hop, default=None)
    return None
