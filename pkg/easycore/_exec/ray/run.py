"""The Ray transport: one run's chunks through the chain's actors over object references.

The counterpart of ``run.Run`` under the same books and loop (``books.RunBooks``); the engine
(``engine.RayEngine``) owns the actors and replaces them when asked. See the engine's
docstring for the data flow and ARCHITECTURE.md for where each guarantee is kept.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import attrs
import cloudpickle
import ray

from easycore._exec.core.blame import Dead, blame_in_order, settle_death, unpicklable
from easycore._exec.core.books import ErrorPolicy, RunBooks, Work, stage_stats
from easycore._exec.core.plan import Chain, StageStats
from easycore._exec.core.protocol import CACHED, PROTOCOL, UNPICKLING, UNREADABLE, Broken, is_cached
from easycore._exec.core.scheduler import Chunk, Place, Revive, Scheduler
from easycore._exec.core.sources import Source
from easycore._exec.ray.actor import Meta, Packed, Placement
from easycore._options import RunOptions

__all__ = ["POLL", "Actor", "ActorPools", "RayRun", "first_line"]

POLL = 0.05  # seconds between looks at a live source or the clock, while waiting


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.split("\n", 1)[0][:300]


@attrs.define(eq=False, kw_only=True)
class Actor(Place):
    """One actor of a hop, as the driver tracks it: a place of the run's scheduler (what it
    has: :class:`Place`; a dead one is replaced when its pool next needs it, a failing
    run's never). A chunk goes down the whole chain at once (each hop's actor is handed the
    hop before's result reference), so it sits in the queue of one actor of every hop until
    that hop's small ``Meta`` comes back (the scheduler's pipelined mode)."""

    device: str
    handle: Any = None
    key: int = -1  # its name at the engine's clock
    where: Placement | None = None
    cut_short: bool = False  # a run was cancelled while it had work: it may be mid-unit
    # Not an actor but a slot of Ray tasks (an init-less pool; see actor.run_task): sends
    # ``run``'s arguments as a task; its chunks run independently of each other (``lone``:
    # it holds one at a time).
    task: Callable[..., Any] | None = None

    def run(self, *args: Any) -> Any:
        """Send a chunk: ``(values ref, meta ref)``."""
        if self.task is not None:
            return self.task(*args)
        return self.handle.run.options(num_returns=2).remote(*args)

    def who(self, chain: Chain) -> str:
        kind = "Ray task" if self.task is not None else "Ray actor"
        return chain.who(self.hop, self.index).replace("worker", kind, 1)

    def describe(self, chain: Chain) -> str:
        return f"{self.who(chain)} on {self.device}" + (f", {self.where}" if self.where else "")


class ActorPools(Protocol):
    """What a run needs of its engine: the actors of every hop, and fresh ones."""

    chain: Chain
    pools: list[list[Actor]]
    waits: list[bool]  # per hop: its actors run several chunks at once (a pool that waits)

    def replace(self, actor: Actor) -> Actor: ...
    def kill_overdue(self, timeout: float) -> list[tuple[Actor, int]]: ...
    def recycle(self, due: Sequence[Place]) -> None: ...


class Refs(NamedTuple):
    """A chunk's object references: each hop's ``Meta``, and the last hop's values."""

    metas: list[Any]
    values: Any


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
        pools = lambda h: engine.pools[h] if engine.pools else []  # (none once stopped)  # noqa: E731
        self.sched = Scheduler(self.books, pools, itertools.count(), pipelined=True)
        self.pending: dict[Any, tuple[Chunk, int]] = {}  # meta ref -> (chunk, hop)
        # references of forgotten chunks, read once ready: Ray logs an error that nobody
        # read as an "Unhandled error" (a death or a failed hop fails every later hop's)
        self.dropped: list[Any] = []
        self.last_probe = time.monotonic()

    # -- the transport's part of the loop (books.RunBooks.stream) ----------------------------
    def busy(self) -> bool:
        return bool(self.pending)

    def wait(self) -> None:
        """Wait for a chunk's hop to finish (a live source or the clock: a while at most)."""
        live = self.books.source.wakeup() is not None
        refs = list(self.pending)
        if refs:
            wait = POLL if live or self.options.timeout else 1.0
            ready, _ = ray.wait(refs, num_returns=1, timeout=wait)
            if ready:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in ready:
                if ref in self.pending:
                    self.on_ready(ref)
        elif live:
            time.sleep(POLL)
            self.books.source.drain_wakeups()
        elif not (self.books.redo or self.books.deliverable()):
            raise self.books.stalled()
        if self.options.timeout is not None:
            self.check_clock()
        self.engine.recycle(self.sched.retirees())
        self.sweep()

    def dispatch(self, most_chunks: int | None = None) -> None:
        """Carry out the scheduler's commands: actors due for it replaced, then chunks sent
        down the chain while the window has room (re-runs first), a dead actor replaced
        when its pool has no other to take one."""
        self.engine.recycle(self.sched.retirees())
        for cmd in self.sched.sends(most_chunks):
            if isinstance(cmd, Revive):
                self.engine.replace(cmd.place)  # (only now: see on_death)
            else:
                self.send(cmd.chunk)

    def send(self, chunk: Chunk) -> None:
        """Send ``chunk`` down the chain, to the actor of each hop on its path."""
        books = self.books
        if all(is_cached(u) for u in chunk.items):  # resume=: every result is known
            self.sched.finish(chunk)
            n = len(chunk.items)
            books.store(chunk.start, [CACHED] * self.hops[-1].units(n), n)
            return
        spent = books.charges.spent(chunk.start, chunk.end)
        arg: Any = chunk.items
        keys = books.keys_of(chunk.items, chunk.start)  # (key= raising is its own error)
        chunk.refs = Refs([], None)
        for hop, actor in zip(self.hops, chunk.path, strict=True):
            try:
                if hop.index == 0 and self.options.timeout is not None:
                    # unpickled inside run(), on the clock (see actor.Packed)
                    arg = Packed(len(chunk.items), cloudpickle.dumps(list(chunk.items), PROTOCOL))
                arg, meta = actor.run(
                    arg,
                    chunk.start // hop.unit,
                    self.options.run_seed,
                    self.options.retries,
                    {i: k for (h, i), k in spent.items() if h == hop.index},
                    books.numbering if hop.index == 0 else (0, 1),
                    keys if hop is self.hops[-1] else None,
                )
            except Exception as exc:  # an item that cannot be pickled
                self.forget(chunk)
                unpicklable(books, chunk, exc)
                return
            chunk.refs.metas.append(meta)
            self.pending[meta] = (chunk, hop.index)
        chunk.refs = chunk.refs._replace(values=arg)

    def forget(self, chunk: Chunk) -> None:
        """Forget ``chunk``: the scheduler's books, its pending references (read once
        ready: :meth:`sweep`)."""
        self.sched.untrack(chunk)
        refs: Refs | None = chunk.refs
        if refs is not None:
            for meta in refs.metas:
                self.pending.pop(meta, None)
            self.dropped += [r for r in (*refs.metas, refs.values) if r is not None]

    def sweep(self, wait: float = 0.0) -> None:
        """Read the forgotten references that are ready (``wait``: seconds to wait for the
        rest), so that Ray does not log their errors as unhandled."""
        if not self.dropped:
            return
        ready, self.dropped = ray.wait(self.dropped, num_returns=len(self.dropped), timeout=wait)
        for ref in ready:
            with contextlib.suppress(Exception):
                ray.get(ref, timeout=0)

    # -- results -----------------------------------------------------------------------------
    def on_ready(self, ref: Any) -> None:
        books = self.books
        chunk, h = self.pending[ref]
        actor: Actor = chunk.path[h]
        try:
            meta: Meta = ray.get(ref)
            values = ray.get(chunk.refs.values) if h == len(self.hops) - 1 else None
        except ray.exceptions.RayError as exc:
            if isinstance(exc, ray.exceptions.RayActorError | ray.exceptions.WorkerCrashedError):
                dead = self.dead_actor(chunk)
                if dead.task is None:
                    self.on_death(dead, exc, culprit=None)  # (forgets every chunk of the actor)
                else:  # a task's process died: that chunk alone was running there
                    self.forget(chunk)
                    books.again(self.blame(dead, [chunk], exc, None))
            elif isinstance(exc, ray.exceptions.RayTaskError | ray.exceptions.RaySystemError):
                # a result that would not pickle there, or not unpickle here (a class this
                # process lacks, a __setstate__ that raises): its unit fails, named
                at = self.dead_actor(chunk)  # (the first hop that failed; else the last)
                self.forget(chunk)
                cause = getattr(exc, "cause", None) or exc
                unpicklable(books, chunk, cause, (at.hop, at.device, at.index))
            if ref in self.pending:  # lost with its node, or not the dead actor's:
                self.forget(chunk)  # run it again
                books.again([Work(chunk.start, chunk.items)])
            return
        del self.pending[ref]
        self.sched.done(actor, chunk.id)
        books.count(h, meta.n, meta.busy, chunk.items, meta.elapsed)
        self.sched.count(actor, meta.n, lambda: meta.rss)  # (replaced once it has finished)
        if values is not None:
            self.sched.finish(chunk)
            # a unit of a chunk whose items did not unpickle in the actor (which one is not
            # known): one unit a chunk (blame.isolate)
            if len(values) > 1 and any(
                type(v) is Broken and v.failure.stage == UNREADABLE for v in values
            ):
                books.again(books.rerun(chunk))
                return
            path = chunk.path
            books.outputs(chunk, values, lambda h: (path[h].device, path[h].index))

    # -- failures ----------------------------------------------------------------------------
    def dead_actor(self, chunk: Chunk) -> Actor:
        """The first actor on ``chunk``'s path that failed (later hops fail because of it)."""
        path: list[Actor] = chunk.path
        for h, meta in enumerate(chunk.refs.metas):
            try:
                ray.get(meta, timeout=0)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayError:
                return path[h]
        return path[-1]

    def on_death(self, actor: Actor, exc: BaseException, culprit: int | None) -> None:
        """``actor`` is gone: blame the chunk it was running, re-run the rest; it is
        replaced once its pool needs it (``Scheduler.sends``), not here: a run that the death fails
        raises without waiting for a fresh actor's start and ``init`` (many seconds on a
        busy machine: Ray starts workers at a low priority).

        ``culprit``: the unit (of ``actor``'s hop) known to be in hand (a timeout).
        """
        _, lost = self.sched.died(actor)
        for chunk in lost:
            self.forget(chunk)
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
        self.books.again(again)

    def blame(
        self, actor: Actor, lost: Sequence[Work], exc: BaseException, culprit: int | None
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
        for actor, unit in self.engine.kill_overdue(timeout):  # (actors with chunks)
            self.on_death(actor, TimeoutError(), culprit=unit)

    # -- stopping ----------------------------------------------------------------------------
    def drain(self) -> None:
        """An early stop: wait for what is in flight and drop it (the actors stay up)."""
        refs = list(self.pending)
        if refs:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.wait(refs, num_returns=len(refs), timeout=None)
        self.clear()

    def close(self) -> None:
        """The run is over: cancel what is still queued (an error or an interrupt) and
        forget every chunk (the books clear themselves)."""
        for ref, (chunk, h) in list(self.pending.items()):
            # Not a plain task's: ray.cancel of a normal task that is finishing races Ray's
            # reply callback and can abort this process (a RAY_CHECK in its task manager,
            # ray-project/ray#54846); such a chunk, already sent, runs to its end unseen.
            if not chunk.path[h].lone:
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
        self.clear(cut_short=True)  # (an actor that had a chunk may be mid-unit)

    def clear(self, cut_short: bool = False) -> None:
        """Forget every chunk (``cut_short``: an actor that had one may be mid-unit)."""
        for actor in [a for pool in self.engine.pools for a in pool]:
            actor.cut_short = actor.cut_short or (cut_short and bool(actor.queue))
        self.sched.clear()
        self.pending.clear()
        self.sweep(wait=1.0)  # (a failed hop's later hops fail at once)
        self.dropped.clear()

    def stats(self) -> list[StageStats]:
        """Per hop, units sent and not done, and the estimate of those in flight: an actor
        is not asked mid-chunk; in flight are the units of the chunks it is on (its oldest,
        once the hops before have finished it; an actor that waits runs all it has), up to
        its concurrency. (Snapshots: a submit run's thread may change the books.)"""
        hops = self.hops
        queued, _ = self.sched.units()
        flying = [0] * len(hops)
        for actor in [a for pool in list(self.engine.pools) for a in list(pool)]:
            h = actor.hop
            chunks = sorted(list(actor.queue.values()), key=lambda c: c.id)
            if not self.engine.waits[h]:
                chunks = chunks[:1]  # (one at a time, in order)
            metas = [c.refs.metas[:h] if c.refs else [None] for c in chunks]  # (None: unsent)
            ready = [
                c
                for c, ms in zip(chunks, metas, strict=True)
                if not any(m in self.pending for m in ms)
            ]
            units = sum(hops[h].units(len(c.items)) for c in ready)
            flying[h] += min(hops[h].concurrency, units)
        return stage_stats(self.books, queued, [0] * len(hops), flying)
