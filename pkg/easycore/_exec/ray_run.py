"""The Ray transport: one run's chunks through the chain's actors over object references.

The counterpart of ``run.Run`` under the same books and loop (``core.RunBooks``); the engine
(``ray_engine.RayEngine``) owns the actors and replaces them when asked. See the engine's
docstring for the data flow and ARCHITECTURE.md for where each guarantee is kept.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import cloudpickle

from easycore._exec.blame import Dead, blame_in_order, settle_death, unpicklable
from easycore._exec.core import ErrorPolicy, RunBooks, Work
from easycore._exec.plan import StageStats
from easycore._exec.ray_actor import Meta, Packed
from easycore._exec.ray_ledger import Actor, ActorPools, RayChunk, RayLedger, first_line, ray_module
from easycore._exec.sources import Source
from easycore._options import RunOptions
from easycore._protocol import CACHED, PROTOCOL, UNPICKLING, UNREADABLE, Broken, is_cached

__all__ = ["POLL", "RayRun"]

POLL = 0.05  # seconds between looks at a live source or the clock, while waiting


class RayRun:
    """The Ray transport of one run on the engine's actors, over the run's books."""

    def __init__(
        self,
        engine: ActorPools,
        source: Source,
        options: RunOptions,
        bars: list[Any] | None,
        policy: ErrorPolicy,
    ) -> None:
        self.engine = engine
        self.chain = engine.chain
        self.hops = self.chain.hops
        self.books = RunBooks(self.chain, source, options, policy, bars, shares=1)
        self.options = options
        self.ledger = RayLedger(engine)
        self.last_probe = time.monotonic()
        self.widest = max(len(h.devices) for h in self.hops)

    # -- the transport's part of the loop (core.RunBooks.stream) ----------------------------
    def busy(self) -> bool:
        return bool(self.ledger)

    def wait(self) -> None:
        """Wait for a chunk's hop to finish (a live source or the clock: a while at most)."""
        ray = ray_module()

        live = self.books.source.wakeup() is not None
        refs = list(self.ledger.pending)
        if refs:
            wait = POLL if live or self.options.timeout else 1.0
            ready, _ = ray.wait(refs, num_returns=1, timeout=wait)
            if ready:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in ready:
                if ref in self.ledger.pending:
                    self.on_ready(ref)
        elif live:
            time.sleep(POLL)
            self.books.source.drain_wakeups()
        elif not (self.books.redo or self.books.deliverable()):
            raise self.books.stalled()
        if self.options.timeout is not None:
            self.check_clock()
        self.engine.recycle_idle()
        self.ledger.sweep()

    def dispatch(self, most_chunks: int | None = None) -> None:
        """Send chunks while the window has room: re-runs first, then new input.

        Re-runs (counted in the window already, and perhaps split into many) go out while
        fewer chunks than the window's worth are in flight.
        """
        books = self.books
        chunks = (books.depth + 1) * self.widest  # chunks in flight, at most
        sent = 0
        while most_chunks is None or sent < most_chunks:
            sent += 1
            # (depth + 1) chunks an actor of the widest pool; a pool that waits: the books'
            # window, its actors' units in flight counted on top
            window = books.window(self.widest) if books.slots > 1 else chunks * books.chunk_size
            if books.redo:
                if self.ledger.chunks() >= chunks:
                    return
            elif books.taken >= window:
                return
            work = books.take(window - books.taken)
            if work is None or not self.send(work):
                return

    def send(self, work: Work) -> bool:
        """Send ``work`` down the chain (False: every actor of a pool is being replaced)."""
        books = self.books
        if all(is_cached(u) for u in work.items):  # resume=: every result is known
            n = len(work.items)
            books.store(work.start, [CACHED] * self.hops[-1].units(n), n)
            return True
        picks = []
        fits = len(work.items)  # first-hop units that every actor picked may still take
        for pool, hop in zip(self.engine.pools, self.hops, strict=True):
            # An actor running a solo chunk takes nothing else; a solo chunk needs an idle
            # one. A slot of tasks holds one chunk at a time: Ray would run more of them at
            # once, so a pool would use more CPUs (and hold more items) than its devices say.
            spent = [a for a in pool if not (a.dead or a.retiring or a.queue) and self.room(a) <= 0]
            if spent:  # done with its max_items_per_worker in an earlier run: replaced
                for a in spent:
                    a.retiring = True
                self.engine.recycle_idle()
            free = [
                a
                for a in pool
                if not (a.dead or a.retiring or any(c.work.solo for c in a.queue))
                and not (a.queue and (work.solo or a.task is not None))
                and self.room(a) > 0
            ]
            if not free:
                dead = next((a for a in pool if a.dead), None)
                if dead is None:
                    books.redo.appendleft(work)
                    return False
                free = [self.engine.replace(dead)]  # (only now: see on_death)
            picks.append(min(free, key=lambda a: len(a.queue)))
            fits = min(fits, self.room(picks[-1]) * hop.unit)
        if fits < len(work.items):  # no actor takes more than it may still run (as a worker)
            fits = max(books.align, fits - fits % books.align)  # (whole output units)
            if fits < len(work.items):
                books.again([Work(work.start + fits, work.items[fits:], work.solo)])
                work = Work(work.start, work.items[:fits], work.solo)
        chunk = RayChunk(work, picks)
        spent = books.charges.spent(work.start, work.end)
        arg: Any = work.items
        keys = books.keys_of(work.items, work.start)  # (key= raising is its own error)
        for hop, actor in zip(self.hops, picks, strict=True):
            try:
                if hop.index == 0 and self.options.timeout is not None:
                    # unpickled inside run(), on the clock (see ray_actor.Packed)
                    arg = Packed(len(work.items), cloudpickle.dumps(list(work.items), PROTOCOL))
                arg, meta = actor.run(
                    arg,
                    work.start // hop.unit,
                    self.options.run_seed,
                    self.options.retries,
                    {i: k for (h, i), k in spent.items() if h == hop.index},
                    books.numbering if hop.index == 0 else (0, 1),
                    keys if hop is self.hops[-1] else None,
                )
            except Exception as exc:  # an item that cannot be pickled
                unpicklable(books, work, exc)
                return True
            self.ledger.send(chunk, hop.index, meta)
        chunk.values = arg
        return True

    def room(self, actor: Actor) -> int:
        """Units ``actor`` may still take (``max_items_per_worker``; see RunBooks.room)."""
        return self.books.room(actor.hop, actor.ran, (c.work for c in actor.queue))

    # -- results -----------------------------------------------------------------------------
    def on_ready(self, ref: Any) -> None:
        ray = ray_module()

        books = self.books
        chunk, h = self.ledger.pending[ref]
        actor = chunk.actors[h]
        try:
            meta: Meta = ray.get(ref)
            values = ray.get(chunk.values) if h == len(self.hops) - 1 else None
        except ray.exceptions.RayError as exc:
            if isinstance(exc, ray.exceptions.RayActorError | ray.exceptions.WorkerCrashedError):
                dead = self.dead_actor(chunk)
                if dead.task is None:
                    self.on_death(dead, exc, culprit=None)  # (forgets every chunk of the actor)
                else:  # a task's process died: that chunk alone was running there
                    self.ledger.forget(chunk)
                    books.again(self.blame(dead, [chunk.work], exc, None))
            elif isinstance(exc, ray.exceptions.RayTaskError | ray.exceptions.RaySystemError):
                # a result that would not pickle there, or not unpickle here (a class this
                # process lacks, a __setstate__ that raises): its unit fails, named
                at = self.dead_actor(chunk)  # (the first hop that failed; else the last)
                self.ledger.forget(chunk)
                cause = getattr(exc, "cause", None) or exc
                unpicklable(books, chunk.work, cause, (at.hop, at.device, at.index))
            if ref in self.ledger.pending:  # lost with its node, or not the dead actor's:
                self.ledger.forget(chunk)  # run it again
                books.again([Work(chunk.work.start, chunk.work.items)])
            return
        self.ledger.done(ref)
        books.count(h, meta.n, meta.busy, chunk.work.items, meta.elapsed)
        actor.ran += meta.n  # (replaced once it has finished what it has)
        actor.retiring = actor.retiring or books.retires(actor.ran, lambda: meta.rss)
        if values is not None:
            if len(values) > 1 and any(_unreadable(v) for v in values):
                books.again(books.rerun(chunk.work))  # one unit a chunk (blame.isolate)
                return
            books.outputs(
                chunk.work, values, lambda h: (chunk.actors[h].device, chunk.actors[h].index)
            )

    # -- failures ----------------------------------------------------------------------------
    def dead_actor(self, chunk: RayChunk) -> Actor:
        """The first actor on ``chunk``'s path that failed (later hops fail because of it)."""
        ray = ray_module()

        for h, meta in enumerate(chunk.metas):
            try:
                ray.get(meta, timeout=0)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayError:
                return chunk.actors[h]
        return chunk.actors[-1]

    def on_death(self, actor: Actor, exc: BaseException, culprit: int | None) -> None:
        """``actor`` is gone: blame the chunk it was running, re-run the rest; it is
        replaced once its pool needs it (:meth:`send`), not here: a run that the death fails
        raises without waiting for a fresh actor's start and ``init`` (many seconds on a
        busy machine: Ray starts workers at a low priority).

        ``culprit``: the unit (of ``actor``'s hop) known to be in hand (a timeout).
        """
        lost = self.ledger.lose(actor)
        # A sync actor runs its chunks in order, so the oldest it had was running, unless
        # replies of chunks it finished died with it (a reply goes out on Ray's own thread,
        # after the next task has started: an os._exit there loses it). With several chunks
        # lost, which one was running is not known: none is charged and each runs again
        # alone, where a death names it. (retries=0 raising names them all.)
        # An actor of a pool that waits runs chunks at once: one being unpickled is not
        # known to be the oldest either.
        unknown = culprit is None or (culprit == int(UNPICKLING) and self.engine.waits[actor.hop])
        again: list[Work] = []
        if unknown and len(lost) > 1 and self.books.pins_down():
            again = [Work(work.start, work.items, solo=True) for work in lost]
        elif lost:
            again = self.blame(actor, lost, exc, culprit)  # (may raise)
        actor.dead = True
        self.books.again(again)

    def blame(
        self, actor: Actor, lost: list[Work], exc: BaseException, culprit: int | None
    ) -> list[Work]:
        """Blame the chunk ``actor`` was running for its death (its oldest; not known, every
        chunk it had: ``blame_in_order``); what runs again. ``culprit``: the unit in hand,
        known from a timeout (or ``UNPICKLING``: the chunk's items were being unpickled)."""
        blame = blame_in_order(self.books, actor.hop, lost, culprit)
        dead = Dead(
            actor.hop,
            actor.index,
            actor.device,
            actor.who(self.chain),
            first_line(exc),
            timed_out=isinstance(exc, TimeoutError),  # (check_clock: past the timeout)
            where=f", {actor.where}" if actor.where else "",
            kind="actor",
        )
        return settle_death(self.books, dead, blame, lost)

    def check_clock(self) -> None:
        """Units past ``timeout`` have had their actors killed: deaths charging them."""
        timeout = self.options.timeout
        assert timeout is not None
        now = time.monotonic()
        if now - self.last_probe < min(timeout / 4, 0.5):
            return
        self.last_probe = now
        for actor, unit in self.engine.kill_overdue(timeout):
            if actor.queue:
                self.on_death(actor, TimeoutError(), culprit=unit)

    # -- stopping ----------------------------------------------------------------------------
    def drain(self) -> None:
        """An early stop: wait for what is in flight and drop it (the actors stay up)."""
        ray = ray_module()

        refs = list(self.ledger.pending)
        if refs:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.wait(refs, num_returns=len(refs), timeout=None)
        self.ledger.clear()

    def close(self) -> None:
        """The run is over: cancel what is still queued (an error or an interrupt) and
        forget every chunk (the books clear themselves)."""
        ray = ray_module()

        for ref, (chunk, h) in list(self.ledger.pending.items()):
            # Not a plain task's: ray.cancel of a normal task that is finishing races Ray's
            # reply callback and can abort this process (a RAY_CHECK in its task manager,
            # ray-project/ray#54846); such a chunk, already sent, runs to its end unseen.
            if chunk.actors[h].task is None:
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
        self.ledger.clear(cut_short=True)  # (an actor that had a chunk may be mid-unit)

    def stats(self) -> list[StageStats]:
        queued, flying = self.ledger.units(self.hops)
        return self.books.stats(queued, [0] * len(self.hops), flying)


def _unreadable(value: Any) -> bool:
    """A unit of a chunk whose items did not unpickle in the actor (which one is not known)."""
    return type(value) is Broken and value.failure.stage == UNREADABLE
