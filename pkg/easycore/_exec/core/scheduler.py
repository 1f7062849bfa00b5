"""The run's scheduler: which worker takes which chunk, and what a worker's death leaves to
run again. It does no I/O: one copy for every engine that has workers.

It owns the chunk table (every chunk of the run, by id, and where it is), the window (input
taken and not yet yielded), each place's room (``prefetch``, ``max_items_per_worker``, a solo
chunk) and routing (which worker of the next pool takes a held chunk). A *place* is a worker
process or a Ray actor as the scheduler sees it (:class:`Place`; the engines' ``Worker`` and
``Actor`` are places). The transport asks for commands, carries them out, and tells the
scheduler what came back::

    commands (generators; the state changes as each is yielded)
      sends(most)   Send: a new chunk, or one to run again, at a place of the first pool
                    (pipelined: at one place of every pool at once, Ray's way)
                    Revive: a dead place must be replaced before anything can go out
      forwards()    Forward: a held chunk from its holder to a place of the next pool
      retirees()    places due for replacement (max_items_per_worker, max_worker_memory)
                    that hold nothing: the engine ends and replaces them (or, ``parking``,
                    ends them: a self-sizing pool shrank)
      tick()        samples the pools for the report; with self-sizing pools, the sizes the
                    balancer wants: places marked ``parking``, pools that get a new place
    events
      done(place, id)   a place answered for a chunk: the chunk, or None for a stale id
      hold(chunk, place) its results stay in the place for the next pool
      sent(place, id)   a holder confirmed sending a chunk on
      count(place, n)   it finished n units (counted against max_items_per_worker)
      died(place)       a place is gone: the chunks it ran and every chunk it had
      untrack(chunk)    forget a chunk (an I/O command failed, an early stop, an error)

A chunk is QUEUED at a place (sent there: queued, running, or done and on its way back;
``src`` set while its holder of the pool before still sends it there), or HELD: done in its
pool, its results waiting in the place for room in the next pool. When a place dies,
:meth:`Scheduler.died` takes every chunk it ran, held or was sending, to be re-run from the
first-pool items the chunk keeps, under a new id: a late message for the old id finds
nothing and is dropped. So nothing is lost or delivered twice.
"""

from __future__ import annotations

import enum
import itertools
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import attrs

from easycore._exec.core.books import RunBooks, Work
from easycore._exec.core.sizing import Balancer

__all__ = ["Chunk", "Forward", "Place", "Revive", "Scheduler", "Send"]


class State(enum.Enum):
    QUEUED = "queued"
    HELD = "held"


@attrs.define(eq=False, slots=True)
class Chunk(Work):
    """:class:`~easycore._exec.core.books.Work` on its way through the pools (its first-pool
    items are kept to run it again after a death)."""

    id: int = attrs.field(kw_only=True)
    hop: int = 0  # the pool that has it (pipelined: the first not yet done with it)
    state: State = State.QUEUED
    # the place of each pool, so far (the engine's: a Worker, an Actor)
    path: list[Any] = attrs.Factory(list)
    src: Any = None  # while moving: the holder sending it to path[-1], unconfirmed
    owner: Any = None  # the scheduler (the run) it belongs to
    refs: Any = None  # what the transport keeps of it (Ray: its object references)

    @property
    def place(self) -> Any:
        """Where it is now: the place that runs it, holds it, or receives it."""
        return self.path[self.hop] if len(self.path) > self.hop else self.path[-1]


class Queue(dict[int, Chunk]):
    """A place's chunks by id, their first-pool units and solo chunks counted as they come
    and go (room is asked for every chunk sent: no walk over what a place has)."""

    __slots__ = ("n_items", "n_solo")

    def __init__(self) -> None:
        super().__init__()
        self.n_items = 0
        self.n_solo = 0

    def _count(self, chunk: Chunk, sign: int) -> None:
        self.n_items += sign * len(chunk.items)
        self.n_solo += sign * chunk.solo

    def __setitem__(self, key: int, chunk: Chunk) -> None:
        self.pop(key)
        super().__setitem__(key, chunk)
        self._count(chunk, 1)

    def __delitem__(self, key: int) -> None:
        self._count(self[key], -1)
        super().__delitem__(key)

    def pop(self, key: int, default: Any = None) -> Any:  # type: ignore[override]
        if key not in self:
            return default
        chunk = super().pop(key)
        self._count(chunk, -1)
        return chunk


@attrs.define(eq=False, kw_only=True)
class Place:
    """A worker of a pool as the scheduler sees it (one runs one place at a time)."""

    hop: int
    index: int  # within its pool (the ``worker`` its functions are given)
    concurrency: int = 1  # units it runs at once (its pool's concurrency=k)
    unit: int = 1  # first-pool items per unit of its pool
    # chunks sent to it and not yet answered: queued there, running, or done and on their way
    queue: Queue = attrs.Factory(Queue)
    holding: dict[int, Chunk] = attrs.Factory(dict)  # held results, kept or being sent on
    ran: int = 0  # units it finished (max_items_per_worker)
    retiring: bool = False  # takes nothing more: replaced once it holds nothing
    parking: bool = False  # retiring, and not replaced: its self-sizing pool shrank
    joining: bool = False  # added to a self-sizing pool, still in its init: takes nothing yet
    gone: bool = False  # dead (replaced by a fresh place when its pool needs one)
    lone: bool = False  # holds one chunk at a time (a slot of Ray tasks)

    def units(self) -> int:
        """First-pool units of the chunks queued at it."""
        return self.queue.n_items


class Send(NamedTuple):
    """Send ``chunk`` to ``chunk.path`` (one place; pipelined: one of every pool)."""

    chunk: Chunk


class Forward(NamedTuple):
    """Tell ``src`` to send held ``chunk`` to ``dst``, a place of the next pool (both the
    engine's places)."""

    chunk: Chunk
    src: Any
    dst: Any


class Revive(NamedTuple):
    """Replace the dead ``place`` (the engine's): its pool has no other to take a chunk."""

    place: Any


class Scheduler:
    """The chunks of one run and where they go.

    Args:
        books: the run's books (input, re-runs, order, sizes).
        pool: the places of pool ``h`` now (an engine replaces a dead place in its list).
        ids: chunk ids, never repeated on a runner (a late reply from an earlier run
            matches nothing).
        pipelined: a chunk goes down every pool at once, each pool's place reading the
            result of the one before (Ray's object references): no place holds a chunk for
            the next pool, and the window, not each place, bounds what is out.
        balancer: the sizes of the self-sizing pools (None: every pool is fixed).
    """

    def __init__(
        self,
        books: RunBooks,
        pool: Callable[[int], Sequence[Place]],
        ids: Iterator[int],
        pipelined: bool = False,
        balancer: Balancer | None = None,
    ) -> None:
        self.books = books
        self.balancer = books.balancer = balancer
        self.sampled = 0.0
        self.hops = books.hops
        self.pool = pool
        sizes = [sum(not p.parking for p in pool(h)) for h in range(len(self.hops))]
        zeros = [0] * len(sizes)
        books.record.sample(books.started, sizes, zeros, zeros)  # (the pools as they are)
        if balancer is not None:
            balancer.begin(books.started, sizes)
            for h, r in balancer.resizes:
                books.resized(h, r)
        self.ids = ids
        self.pipelined = pipelined
        self.depth = books.depth
        self.live: dict[int, Chunk] = {}
        self.waiting: list[list[Chunk]] = [[] for _ in self.hops]  # HELD, by pool

    def __bool__(self) -> bool:
        return bool(self.live)

    def places(self) -> list[Place]:
        return [p for h in range(len(self.hops)) for p in self.pool(h)]

    # -- room --------------------------------------------------------------------------------
    def window(self) -> int:
        """First-pool units that may be taken and not yet yielded (backpressure), for ``n``
        places (every place; pipelined: of the widest pool, a chunk being at one of each):
        what they may hold (``prefetch`` chunks each), and a chunk more each, so new work
        goes out while results just received still wait to be yielded; ``2 x prefetch``
        chunks of a unit each, at least (not on Ray's plain pools: a chunk more than
        prefetch an actor of the widest pool, however small). Slots that wait count ``k``
        units as a chunk, and their units in flight (``k`` a place) on top: those hold no
        result while they wait, so one long wait leaves the others' results room to pile up
        behind it in order. The bound docs/guide/performance.md gives."""
        sizes = [len(self.pool(h)) for h in range(len(self.hops))]
        n = max(sizes) if self.pipelined else sum(sizes)
        books, depth, k = self.books, self.depth, self.books.slots
        flying = n * k if k > 1 else 0
        least = 2 * depth * n * max(books.align, k) + flying
        if self.pipelined and k == 1:
            least = 0  # (Ray's plain pools: prefetch + 1 chunks an actor, however small)
        return max((depth + 1) * n * books.chunk_size, least)

    def has_room(self, p: Place) -> bool:
        """Whether ``p`` may take another chunk: fewer than ``prefetch`` chunks (pipelined:
        no bound of its own); one that waits (``concurrency=k``, each chunk answered as it
        ends) fewer than ``prefetch x k`` units. A place that runs a chunk alone (solo)
        takes nothing else."""
        if p.gone or p.retiring or p.joining or p.queue.n_solo:
            return False
        if p.lone and p.queue:
            return False
        if self.pipelined:
            return True
        if p.concurrency == 1:
            return len(p.queue) < self.depth
        return p.units() < self.depth * p.concurrency * p.unit

    def room(self, p: Place) -> int:
        """Units of its pool ``p`` may still take under ``max_items_per_worker`` (no bound:
        ``sys.maxsize``): those it ran and those queued at it count."""
        most = self.books.options.max_items_per_worker
        if most is None:
            return sys.maxsize
        return most - p.ran - sum(self.hops[p.hop].units(len(c.items)) for c in p.queue.values())

    def _takes(self, p: Place, solo: bool) -> bool:
        return self.has_room(p) and not (solo and p.queue) and self.room(p) > 0

    # -- commands ----------------------------------------------------------------------------
    def sends(self, most: int | None = None) -> Iterator[Send | Revive]:
        """New chunks (re-runs first) while the window and the places have room, at most
        ``most``; one at a time to the place holding the fewest, so that consecutive chunks
        go to different places: an ordered stream is fed by all of them at once."""
        books = self.books
        sent = 0
        # (pipelined: chunks out at once, prefetch + 1 a place of the widest pool; re-runs
        # wait for room under it, as the window does not bound them)
        widest = max(len(self.pool(h)) for h in range(len(self.hops))) if self.pipelined else 0
        cap = (self.depth + 1) * widest
        while most is None or sent < most:
            if self.pipelined and books.redo and len(self.live) >= cap:
                return
            solo = bool(books.redo) and books.redo[0].solo
            path: list[Place] = []
            for h in range(len(self.hops) if self.pipelined else 1):
                free = [p for p in self.pool(h) if self._takes(p, solo)]
                if not free:
                    dead = next((p for p in self.pool(h) if p.gone), None)
                    if dead is None or not self.pipelined:
                        return
                    yield Revive(dead)  # (the engine puts a fresh place in its pool)
                    free = [p for p in self.pool(h) if self._takes(p, solo)]
                    if not free:
                        return
                path.append(min(free, key=lambda p: len(p.queue)))
            fits = min(self.room(p) * self.hops[p.hop].unit for p in path)
            work = books.take(self.window() - books.taken, fits)
            if work is None:
                return
            if len(work.items) > fits:  # (a re-run: no place takes more than it may run)
                cut = max(books.align, fits - fits % books.align)
                if cut < len(work.items):
                    books.again([Work(work.start + cut, work.items[cut:], work.solo)])
                    work = Work(work.start, work.items[:cut], work.solo)
            yield Send(self._track(work, path))
            sent += 1

    def forwards(self) -> Iterator[Forward]:
        """Held chunks on to places of the next pool with room, later pools first (in input
        order when ordered). With ``max_items_per_worker``, a chunk goes to a place that
        may still run all of its units, or else to one that has nothing and may run some (a
        chunk is never cut: such a place runs less than a chunk past the bound, then is
        replaced)."""
        for h in range(len(self.hops) - 2, -1, -1):
            while self.waiting[h]:
                chunk = self.waiting[h][0]
                units = self.hops[h + 1].units(len(chunk.items))
                room = [p for p in self.pool(h + 1) if self.has_room(p)]
                fit = [p for p in room if self.room(p) >= units]
                fit = fit or [p for p in room if self.room(p) > 0 and not p.queue]
                if not fit:
                    break
                dst = min(fit, key=lambda p: len(p.queue))
                src = chunk.place
                self.waiting[h].pop(0)
                chunk.hop, chunk.src, chunk.state = h + 1, src, State.QUEUED
                chunk.path.append(dst)
                dst.queue[chunk.id] = chunk
                yield Forward(chunk, src, dst)

    def unforward(self, command: Forward) -> None:
        """A forward that could not be carried out (its receiver is dying): the chunk is
        held again by its holder."""
        chunk, src, dst = command
        dst.queue.pop(chunk.id, None)
        chunk.path.pop()
        chunk.hop, chunk.src = chunk.hop - 1, None
        self.hold(chunk, src)

    def tick(self) -> list[int]:
        """Sample the pools for the run's report (every 10 ms at most); with self-sizing
        pools, move them toward the balancer's sizes: places beyond a pool's size are marked
        ``parking`` (idle ones first; they leave once they hold nothing, see
        :meth:`retirees`), and the pools below their size are returned, a pool once per
        place to add (within the budget: places still leaving count)."""
        now = time.monotonic()
        if now - self.sampled < 0.01:
            return []
        self.sampled = now
        try:
            return self._tick(now)
        finally:  # (its own cost, for the benchmarks: the controller's share of the run)
            self.books.record.control_s += time.monotonic() - now

    def _tick(self, now: float) -> list[int]:
        # (the places staying in their pools: not those leaving; those still joining idle)
        pools = [[p for p in self.pool(h) if not p.parking] for h in range(len(self.hops))]
        busy = [[p for p in places if p.queue or p.holding] for places in pools]
        record = self.books.record  # (units queued: the trace's counters only)
        queued = self.units()[0] if record.trace else []
        record.sample(
            now,
            [len(places) for places in pools],
            [len(places) - len(b) for places, b in zip(pools, busy, strict=True)],
            [len(held) for held in self.waiting],
            queued,
        )
        bal = self.balancer
        if bal is None:
            return []
        low = min((c.hop for c in list(self.live.values())), default=len(self.hops))
        done = self.books.source.exhausted and not self.books.redo
        seen = len(bal.resizes)
        bal.decide(now, [done and low >= h for h in range(len(self.hops))], [len(b) for b in busy])
        for h, r in bal.resizes[seen:]:
            self.books.resized(h, r)
        grow: list[int] = []
        every = [list(self.pool(h)) for h in range(len(self.hops))]  # (those leaving too)
        alive = sum(len(every[h]) for h in bal.sizing)
        for h in bal.sizing:
            staying = pools[h]
            idle_first = lambda p: (bool(p.queue or p.holding), not p.joining, len(p.queue))  # noqa: E731
            for p in sorted(staying, key=idle_first)[: max(0, len(staying) - bal.target[h])]:
                p.parking = p.retiring = True
            hi = self.hops[h].bounds[1]  # type: ignore[index]
            # (places still leaving count against the budget and the pool's places)
            more = min(bal.target[h] - len(staying), bal.budget - alive, hi - len(every[h]))
            grow += [h] * max(0, more)
            alive += max(0, more)
        return grow

    def retirees(self) -> list[Place]:
        """Places due for replacement that hold nothing (the engine ends and replaces
        them); a place done with its ``max_items_per_worker`` in an earlier run too."""
        idle = [p for p in self.places() if not (p.gone or p.queue or p.holding)]
        for p in idle:
            p.retiring = p.retiring or self.room(p) <= 0
        return [p for p in idle if p.retiring]

    # -- events ------------------------------------------------------------------------------
    def _track(self, work: Work, path: list[Place]) -> Chunk:
        chunk = Chunk(work.start, work.items, work.solo, id=next(self.ids), path=path, owner=self)
        self.live[chunk.id] = chunk
        for p in path:
            p.queue[chunk.id] = chunk
        return chunk

    def done(self, p: Place, chunk_id: int) -> Chunk | None:
        """``p`` answered for ``chunk_id`` (done or held in its pool): the chunk, taken off
        its queue; None for a stale id (a chunk already run again elsewhere)."""
        chunk = p.queue.pop(chunk_id, None)
        if chunk is None or self.live.get(chunk_id) is not chunk:
            return None
        if chunk.src is not None:  # it arrived before its sender's confirmation did
            chunk.src.holding.pop(chunk_id, None)
            chunk.src = None
        return chunk

    def hold(self, chunk: Chunk, p: Place) -> None:
        """``p`` finished ``chunk`` for its pool and keeps the results until routed."""
        chunk.state = State.HELD
        p.holding[chunk.id] = chunk
        held = self.waiting[chunk.hop]
        held.append(chunk)
        if self.books.options.ordered:
            held.sort(key=lambda c: c.start)

    def sent(self, p: Place, chunk_id: int) -> Chunk | None:
        """``p`` confirmed sending ``chunk_id`` on."""
        chunk = p.holding.pop(chunk_id, None)
        if chunk is not None and chunk.src is p:
            chunk.src = None
        return chunk

    def finish(self, chunk: Chunk) -> None:
        """Its results reached the caller."""
        self.untrack(chunk)

    def count(self, p: Place, n: int, rss: Callable[[], int] = lambda: 0) -> None:
        """``p`` finished ``n`` units; whether it is due for a fresh one
        (``max_items_per_worker``, ``max_worker_memory``: ``rss()`` its memory now): it then
        takes nothing more and is replaced once it holds nothing."""
        p.ran += n
        options = self.books.options
        most, memory = options.max_items_per_worker, options.max_worker_memory
        p.retiring = p.retiring or (most is not None and p.ran >= most)
        p.retiring = p.retiring or (memory is not None and rss() > memory)

    def untrack(self, chunk: Chunk) -> None:
        """Forget a chunk everywhere: the table, its pool's held list, every place."""
        self.live.pop(chunk.id, None)
        if chunk.state is State.HELD and chunk in self.waiting[chunk.hop]:
            self.waiting[chunk.hop].remove(chunk)
        for p in (*chunk.path, chunk.src):
            if p is not None:
                p.queue.pop(chunk.id, None)
                p.holding.pop(chunk.id, None)

    def died(self, p: Place) -> tuple[list[Chunk], list[Chunk]]:
        """``p`` is gone: forget every chunk it ran, held or was sending; (those it ran,
        oldest first; all of them)."""
        p.gone = True
        running = sorted(p.queue.values(), key=lambda c: c.id)
        lost = running + [c for c in p.holding.values() if c.id not in p.queue]
        for chunk in lost:
            self.untrack(chunk)
        return running, lost

    def oldest_at(self, p: Place) -> Chunk | None:
        """The oldest chunk queued at ``p`` (the one it was reading when it could not)."""
        return p.queue[min(p.queue)] if p.queue else None

    def drop_held(self) -> list[Chunk]:
        """Forget every held chunk (an early stop); they are returned, to tell holders."""
        held = list(itertools.chain.from_iterable(self.waiting))
        for chunk in held:
            self.untrack(chunk)
        return held

    def withdraw(self, p: Place, chunk_id: int) -> None:
        """An early stop: ``p`` answered for ``chunk_id``; forget it wherever it is."""
        chunk = self.live.get(chunk_id) or p.queue.get(chunk_id)
        if chunk is not None:
            self.untrack(chunk)

    def units(self) -> tuple[list[int], list[int]]:
        """Per pool, units queued at its places and units held for the next pool
        (snapshots: a submit run's thread may be changing them)."""
        queued, waiting = [], []
        for h, hop in enumerate(self.hops):
            q = sum(len(c.items) for p in list(self.pool(h)) for c in list(p.queue.values()))
            queued.append(hop.units(q))
            waiting.append(hop.units(sum(len(c.items) for c in list(self.waiting[h]))))
        return queued, waiting

    def clear(self) -> None:
        """The run is over: none of its chunks stays anywhere (places serve the next run)."""
        for chunk in list(self.live.values()):
            self.untrack(chunk)
        for held in self.waiting:
            held.clear()
        for p in self.places():  # (also chunks forgotten here but left in a place's books)
            for book in (p.queue, p.holding):
                for chunk_id in [i for i, c in book.items() if c.owner is self]:
                    del book[chunk_id]
