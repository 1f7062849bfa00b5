"""Where every chunk of a run is, so that nothing is lost or delivered twice.

A chunk is consecutive first-hop items on their way through the hops. Its states::

    QUEUED  sent to worker ``slot`` of hop ``hop`` (queued there, running, or, when ``src``
            is set, still being sent there by worker ``src`` of the hop before)
    HELD    done in hop ``hop``; its results wait in worker ``slot`` for room in the next hop

The ledger is the only place that moves a chunk between states and between the workers'
books (``Worker.outstanding``: QUEUED chunks counted against its depth; ``Worker.holding``:
chunks whose results it holds or is sending). When a worker dies, :meth:`Ledger.forget`
takes every chunk it ran, held or was sending, to be re-run from its first-hop items (kept
here) under a new id; a late message for the old id finds nothing and is dropped.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from easycore._exec.core import Work
from easycore._exec.plan import Hop
from easycore._exec.workers import Worker, WorkerSet

__all__ = ["Chunk", "ChunkState", "Ledger"]


class ChunkState(enum.Enum):
    QUEUED = "queued"
    HELD = "held"


@attrs.define(eq=False, slots=True)
class Chunk(Work):
    """:class:`~easycore._exec.core.Work` on its way through the hops (its first-hop items
    are kept to re-run it after a death)."""

    id: int = attrs.field(kw_only=True)
    hop: int = 0  # the hop that has it
    slot: int = -1  # the worker of that hop that runs it, holds its results, or receives it
    state: ChunkState = ChunkState.QUEUED
    src: int = -1  # >= 0 while moving: the worker sending it to `slot` (not yet confirmed)
    path: list[int] = attrs.Factory(list)  # the worker of each hop it went to, so far
    ledger: Any = None  # the ledger (the run) it belongs to


class Ledger:
    """The chunks of one run: live ones by id, and held ones by hop (waiting for room)."""

    def __init__(self, workers: WorkerSet, ids: Iterator[int], n_hops: int, ordered: bool):
        self.workers = workers
        self.ids = ids  # never repeat on a runner: a late reply from an earlier run matches nothing
        self.ordered = ordered
        self.live: dict[int, Chunk] = {}
        self.waiting: list[list[Chunk]] = [[] for _ in range(n_hops)]  # HELD, by hop

    def __bool__(self) -> bool:
        return bool(self.live)

    def send(self, chunk_id: int, start: int, items: Sequence[Any], w: Worker) -> Chunk:
        """A new chunk of first-hop items, queued at ``w`` (a worker of the first hop)."""
        chunk = Chunk(start, items, id=chunk_id, slot=w.slot, ledger=self, path=[w.slot])
        w.outstanding[chunk.id] = chunk
        self.live[chunk.id] = chunk
        return chunk

    def current(self, w: Worker, chunk_id: int) -> Chunk | None:
        """The chunk ``w`` answered for, taken off its queue; None for a stale id."""
        chunk: Chunk | None = w.outstanding.pop(chunk_id, None)
        if chunk is None or self.live.get(chunk_id) is not chunk:
            return None  # a chunk we already re-ran elsewhere (its sender died unconfirmed)
        if chunk.src >= 0:  # it arrived before its sender's confirmation did
            self.workers.workers[chunk.src].holding.pop(chunk_id, None)
            chunk.src = -1
        return chunk

    def hold(self, chunk: Chunk, w: Worker) -> None:
        """``w`` finished ``chunk`` for its hop and keeps the results until we route them."""
        chunk.state = ChunkState.HELD
        w.holding[chunk.id] = chunk
        held = self.waiting[chunk.hop]
        held.append(chunk)
        if self.ordered:
            held.sort(key=lambda c: c.start)

    def next_held(self, hop: int) -> tuple[Chunk, Worker] | None:
        """The held chunk of ``hop`` to move on next (in input order when ordered), and the
        worker that holds it."""
        held = self.waiting[hop]
        return (held[0], self.workers.workers[held[0].slot]) if held else None

    def move(self, chunk: Chunk, src: Worker, dst: Worker) -> None:
        """``src`` was told to send held ``chunk`` to ``dst`` (a worker of the next hop)."""
        self.waiting[chunk.hop].remove(chunk)
        chunk.hop, chunk.src, chunk.slot = chunk.hop + 1, src.slot, dst.slot
        chunk.path.append(dst.slot)
        chunk.state = ChunkState.QUEUED
        dst.outstanding[chunk.id] = chunk

    def sent(self, w: Worker, chunk_id: int) -> Chunk | None:
        """``w`` confirmed sending ``chunk_id`` on."""
        chunk: Chunk | None = w.holding.pop(chunk_id, None)
        if chunk is not None and chunk.src == w.slot:
            chunk.src = -1
        return chunk

    def finish(self, chunk: Chunk) -> None:
        """Its results reached the caller."""
        del self.live[chunk.id]

    def untrack(self, chunk: Chunk) -> None:
        """Forget a chunk everywhere: live, its hop's waiting list, its holder or queue."""
        books = self.workers.workers
        self.live.pop(chunk.id, None)
        if chunk.state is ChunkState.HELD:
            if chunk in self.waiting[chunk.hop]:
                self.waiting[chunk.hop].remove(chunk)
            books[chunk.slot].holding.pop(chunk.id, None)
            return
        books[chunk.slot].outstanding.pop(chunk.id, None)  # queued at, or moving to, `slot`
        if chunk.src >= 0:  # moving: its sender holds it until Sent
            books[chunk.src].holding.pop(chunk.id, None)

    def forget(self, w: Worker) -> tuple[list[Chunk], list[Chunk]]:
        """Take every chunk a dead worker ran, held or was sending: (ran, all of them)."""
        running = sorted(w.outstanding.values(), key=lambda c: c.start)
        lost = running + list(w.holding.values())
        for chunk in lost:
            self.untrack(chunk)
        return running, lost

    def units(self, hops: Sequence[Hop]) -> tuple[list[int], list[int]]:
        """Per hop, units queued at its workers and units held waiting for the next hop
        (snapshots: a submit run's thread may be changing the books)."""
        queued, waiting = [], []
        for hop in hops:
            workers = [w for w in list(self.workers.workers) if w.hop == hop.index]
            q = sum(len(c.items) for w in workers for c in list(w.outstanding.values()))
            held = sum(len(c.items) for c in list(self.waiting[hop.index]))
            queued.append(hop.units(q))
            waiting.append(hop.units(held))
        return queued, waiting

    def drop_held(self) -> list[Chunk]:
        """Forget every held chunk (an early stop); they are returned, to tell holders."""
        held = list(itertools.chain.from_iterable(self.waiting))
        for chunk in held:
            self.untrack(chunk)
        return held

    def withdraw(self, w: Worker, chunk_id: int) -> None:
        """An early stop: ``w`` answered for ``chunk_id``; forget the chunk wherever it is."""
        chunk = self.live.get(chunk_id) or w.outstanding.get(chunk_id)
        if chunk is not None:
            self.untrack(chunk)

    def oldest_at(self, w: Worker) -> Chunk | None:
        """The oldest chunk queued at ``w`` (the one it was reading when it could not)."""
        return w.outstanding[min(w.outstanding)] if w.outstanding else None

    def clear(self) -> None:
        """The run is over: nothing of it stays tracked, here or in the workers' books."""
        self.live.clear()
        for held in self.waiting:
            held.clear()
        for w in list(self.workers.workers):
            for book in (w.outstanding, w.holding):
                for chunk_id, chunk in list(book.items()):
                    if chunk.ledger is self:
                        del book[chunk_id]
