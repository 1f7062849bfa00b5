"""``devices="inline"``: every hop in the calling process, so a debugger's breakpoints work.

The same prepared stages as a worker process runs (``easycore._exec.core.stages``), with the same
ordering, injection (``device="cpu"``, ``worker=0``), seeds, retries and errors; ``timeout``
fails a unit past it: an ``async def`` one is cancelled (run on an event loop here, one
unit at a time: ``concurrency`` does not apply; on a helper thread when the caller runs
inside an event loop, a notebook), a plain one runs to its end (nothing can stop it here)
and its result is dropped. Also the engine of a pipeline without producers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from easycore._config.cfgnode import CfgNode
from easycore._exec.core.books import RAISE, ErrorPolicy, RunBooks, stage_stats
from easycore._exec.core.plan import Chain, StageStats, idle_stats
from easycore._exec.core.protocol import SLOT_WIDTH, Task, batches
from easycore._exec.core.report import Trace
from easycore._exec.core.sources import source_of
from easycore._exec.core.stages import ChunkRun, PreparedStages
from easycore._options import RunOptions
from easycore._seeding import seed_loaded

if TYPE_CHECKING:
    from easycore._longjobs.sinks import Sink

__all__ = ["InlineEngine"]


class InlineEngine:
    """Runs a chain's hops one after the other, item by item, in this process."""

    in_caller = True

    def __init__(self, chain: Chain, cfg: CfgNode) -> None:
        self.chain = chain
        self.cfg = cfg
        self.prepared: list[PreparedStages] = []
        self.books: RunBooks | None = None  # the last run's, for stats()
        self.trace = Trace(None)  # (the runner's, with trace=)
        self.flying = [0] * len(chain.hops)  # per hop, the unit running now (0 or 1)
        self.sink: Sink | None = None
        self.slot = [0.0] * SLOT_WIDTH  # the unit in hand (as a worker's: read by nobody)

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
        failures = [f for f in [stages.finish() for stages in self.prepared] if f is not None]
        self.prepared = []
        if failures and report:
            raise failures[0].to_error("while ending", None) from failures[0].error

    def stats(self) -> list[StageStats]:
        if self.books is None:
            return idle_stats(self.chain, concurrent=False)
        nothing = [0] * len(self.chain.hops)  # nothing queued: a unit runs when it is pulled
        return stage_stats(self.books, nothing, nothing, self.flying, concurrent=False)

    def stream(
        self,
        data: Iterable[Any],
        options: RunOptions,
        *,
        bars: list[Any] | None = None,
        policy: ErrorPolicy = RAISE,
        is_current: Callable[[], bool] = lambda: True,
    ) -> Iterator[Any]:
        """Yield PRIMED, then the results as segments, in input order, each computed when
        the caller asks for it (the core's stream with this engine as its transport)."""
        if options.seed is None and self.chain.hops[0].stages:
            seed_loaded(int.from_bytes(os.urandom(8), "little") >> 1)
        # one chunk at a time: an output unit, or as many as a sink's file holds
        sink = self.sink = self.prepared[-1].sink if self.prepared else None
        group = min(WRITE_GROUP, sink.rows_per_file or WRITE_GROUP) if sink else 1
        source = source_of(data)
        self.books = RunBooks(self.chain, source, options, policy, bars, group, trace=self.trace)
        yield from self.books.stream(self, is_current, ahead=False)  # (nothing runs ahead here)

    # -- the transport's part of the loop (books.RunBooks.stream) ----------------------------
    def busy(self) -> bool:
        return False  # (a chunk runs within dispatch)

    def drain(self) -> None:
        pass  # (nothing is in flight between the caller's calls)

    def close(self) -> None:
        pass  # (the books clear themselves; nothing else is held)

    def wait(self) -> None:
        if self.books is not None and not self.books.deliverable():
            raise self.books.stalled()

    def dispatch(self, most_chunks: int | None = None) -> None:
        """Run the next chunk through every hop, once the caller has taken what came before."""
        books = self.books
        assert books is not None
        # (nothing runs until the caller has taken the chunk before)
        if books.taken or (work := books.take(books.chunk_size)) is None:
            return
        options = books.options
        seed, retries, timeout = options.run_seed, options.retries, options.timeout
        keys = books.keys_of(work.items, work.start) if self.sink is not None else None
        units: list[Any] = list(work.items)
        for hop, stages in zip(self.chain.hops, self.prepared, strict=False):
            if hop.batch:
                units = batches(units, hop.batch)
            # (units may be markers; the timeout fails an async unit past it)
            task = Task(0, seed, 0, units, False, retries, {}, books.numbering, True, timeout, keys)
            t0 = time.perf_counter()
            self.flying[hop.index] = 1
            try:
                run = ChunkRun(stages, units, work.start // hop.unit, task)
                units, n, _ = run.run(self.slot, 0)
            finally:
                self.flying[hop.index] = 0
            took = time.perf_counter() - t0
            books.count(hop.index, n, took, elapsed=took)
        books.outputs(work, units, lambda hop: ("cpu", 0))  # (every inline stage's device, worker)


WRITE_GROUP = 256  # units written to one file (at most) in the calling process
