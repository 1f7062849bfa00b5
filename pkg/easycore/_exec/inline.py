"""``devices="inline"``: every hop in the calling process, so a debugger's breakpoints work.

The same prepared stages as a worker process runs (``easycore._stages``), with the same
ordering, injection (``device="cpu"``, ``worker=0``), seeds, retries and errors; ``timeout``
is not enforced (nothing can be killed). Also the engine of a pipeline without producers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from easycore._config import CfgNode
from easycore._errors import item_label
from easycore._exec.engine import PRIMED
from easycore._exec.plan import Chain, StageStats
from easycore._exec.run import Failed
from easycore._exec.sources import batched
from easycore._options import RunOptions
from easycore._protocol import CACHED, is_cached
from easycore._seeding import seed_loaded
from easycore._stages import PreparedStages

__all__ = ["InlineEngine"]


class InlineEngine:
    """Runs a chain's hops one after the other, item by item, in this process."""

    in_caller = True

    def __init__(self, chain: Chain, cfg: CfgNode) -> None:
        self.chain = chain
        self.cfg = cfg
        self.prepared: list[PreparedStages] = []

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
        return [StageStats(h.name, h.devices) for h in self.chain.hops]

    def stream(
        self,
        data: Iterable[Any],
        options: RunOptions,
        *,
        bars: list[Any] | None = None,
        tolerant: bool = False,
        is_current: Callable[[], bool] = lambda: True,
    ) -> Iterator[Any]:
        """Yield PRIMED, then ``(index, [result])`` per unit of the last hop, in input order.

        ``bars``: the last one counts results. A failure raises, ``tolerant`` or not: a
        one-item ``submit`` turns it into its future's exception.
        """
        if options.seed is None and self.chain.hops[0].stages:
            seed_loaded(int.from_bytes(os.urandom(8), "little") >> 1)
        n = options.numbering
        numbering = (0, 1) if n is None else (n.first, n.step)
        stream: Iterator[tuple[int, Any]] = enumerate(data)
        for hop, stages in zip(self.chain.hops, self.prepared, strict=False):
            if hop.batch:
                stream = enumerate(batched((v for _, v in stream), hop.batch))
            stream = self._run_hop(stream, stages, hop.index, options, numbering, tolerant)
        yield PRIMED  # nothing runs ahead of the caller here
        bar = bars[-1] if bars else None
        for index, value in stream:
            if bar is not None:
                bar.update(1)
            yield index, [value]

    def _run_hop(
        self,
        stream: Iterator[tuple[int, Any]],
        stages: PreparedStages,
        hop: int,
        options: RunOptions,
        numbering: tuple[int, int],
        tolerant: bool,
    ) -> Iterator[tuple[int, Any]]:
        for index, item in stream:
            if is_cached(item):  # resume=: the ledger has its result
                yield index, CACHED
                continue
            failed_before = _failed_in(item)
            if failed_before is not None:  # a unit of a batch failed in an earlier hop
                yield index, failed_before
                continue
            value, failed = stages.run_retrying(
                item, index, options.seed, options.retries, numbering
            )
            if failed is not None:
                if hop == 0:
                    label, at = options.label(index), options.global_index(index)
                else:
                    label, at = item_label(index, self.chain.hops[hop].batch), index
                error = failed.to_error(f"while running {label}", at)
                if not tolerant:
                    raise error from failed.error
                error.__cause__ = failed.error
                value = Failed(error, item, failed.stage)
            yield index, value


def _failed_in(unit: Any) -> Failed | None:
    """The failure a unit carries: itself, or the first failed member of a batch."""
    if type(unit) is Failed:
        return unit
    if type(unit) is list:
        return next((v for v in unit if type(v) is Failed), None)
    return None
