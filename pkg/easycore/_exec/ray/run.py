"""The Ray transport: one run's chunks through the chain's actors over object references.

The counterpart of ``run.Run`` under the same books and loop (``books.RunBooks``); the engine
(``engine.RayEngine``) owns the actors and replaces them when asked. See the engine's
docstring for the data flow and ARCHITECTURE.md for where each guarantee is kept.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Sequence
from typing import Any, Protocol

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
    # sends a chunk (``StageActor.run``'s arguments): ``(values ref, meta ref)``. A place
    # that is ``lone`` is not an actor but a slot of Ray tasks (an init-less pool; see
    # actor.run_task): its chunks run independently of each other, one at a time.
    run: Any = None
    starting: Any = None  # its start's reference, while it is ``joining`` its pool
    asked: float = 0.0  # when it was asked to start (joining)
    ending: Any = None  # its end's reference, while it leaves its pool (``parking``)

    def who(self, chain: Chain) -> str:
        kind = "Ray task" if self.lone else "Ray actor"
        return chain.who(self.hop, self.index).replace("worker", kind, 1)

    def describe(self, chain: Chain) -> str:
        return f"{self.who(chain)} on {self.device}" + (f", {self.where}" if self.where else "")


class ActorPools(Protocol):
    """What a run needs of its engine: the actors of every hop, and fresh ones."""

    chain: Chain
    pools: list[list[Actor]]
    waits: list[bool]  # per hop: its actors run several chunks at once (a pool that waits)

    balancer: Any  # the self-sizing pools' sizes, or None

    def replace(self, actor: Actor) -> Actor: ...
    def grow(self, hop: int) -> None: ...
    def joined(self) -> None: ...
    def leave(self, actor: Actor) -> None: ...
    def kill_overdue(self, timeout: float) -> list[tuple[Actor, int]]: ...
    def recycle(self, due: Sequence[Place]) -> None: ...


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
        trace = getattr(engine, "trace", None)
        self.books = RunBooks(self.chain, source, options, policy, bars, shares=1, trace=trace)
        self.options = options
        pools = lambda h: engine.pools[h] if engine.pools else []  # (none once stopped)  # noqa: E731
        balancer = getattr(engine, "balancer", None)
        self.sched = Scheduler(self.books, pools, itertools.count(), True, balancer)
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
        elif joining := [a.starting for pool in self.engine.pools for a in pool if a.joining]:
            ray.wait(joining, num_returns=1, timeout=POLL)  # (an actor added to its pool)
        elif not (self.books.redo or self.books.deliverable()):
            raise self.books.stalled()
        self.check_clock()
        self.sweep()  # (actors due for replacement: dispatch, which always comes next)

    def dispatch(self, most_chunks: int | None = None) -> None:
        """Carry out the scheduler's commands: actors due for it replaced, then chunks sent
        down the chain while the window has room (re-runs first), a dead actor replaced
        when its pool has no other to take one."""
        self.engine.joined()
        for h in self.sched.tick():
            self.engine.grow(h)
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
        run = (self.options.run_seed, self.options.retries, spent)
        arg: Any = chunk.items
        keys = books.keys_of(chunk.items, chunk.start)  # (key= raising is its own error)
        chunk.refs = []  # each hop's Meta, then the last hop's values
        for hop, actor in zip(self.hops, chunk.path, strict=True):
            try:
                if hop.index == 0 and (self.options.timeout is not None or actor.lone):
                    # unpickled inside run(), on the clock; a task's, once the driver's
                    # sys.path is there (see actor.Packed, actor.run_task)
                    arg = Packed(len(chunk.items), cloudpickle.dumps(list(chunk.items), PROTOCOL))
                numbering = books.numbering if hop.index == 0 else (0, 1)
                last = (numbering, keys if hop is self.hops[-1] else None)
                arg, meta = actor.run(arg, chunk.start // hop.unit, *run, *last)
            except Exception as exc:  # an item that cannot be pickled
                self.forget(chunk)
                unpicklable(books, chunk, exc)
                return
            chunk.refs.append(meta)
            self.pending[meta] = (chunk, hop.index)
        chunk.refs.append(arg)

    def forget(self, chunk: Chunk) -> None:
        """Forget ``chunk``: the scheduler's books, its pending references (read once
        ready: :meth:`sweep`)."""
        self.sched.untrack(chunk)
        for ref in chunk.refs or ():
            self.pending.pop(ref, None)
        self.dropped += chunk.refs or []

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
            values = ray.get(chunk.refs[-1]) if h == len(self.hops) - 1 else None
        except ray.exceptions.RayError as exc:
            if isinstance(exc, ray.exceptions.RayActorError | ray.exceptions.WorkerCrashedError):
                dead = self.dead_actor(chunk)
                # (an actor: every chunk it had; a task's process: that chunk alone ran there)
                self.on_death(dead, exc, None, [chunk] if dead.lone else None)
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
        books.count(h, meta.n, meta.busy, chunk.items, meta.elapsed, 0, actor.index)
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
            books.outputs(chunk, values, lambda h: (chunk.path[h].device, chunk.path[h].index))

    # -- failures ----------------------------------------------------------------------------
    def dead_actor(self, chunk: Chunk) -> Actor:
        """The first actor on ``chunk``'s path that failed (later hops fail because of it)."""
        path: list[Actor] = chunk.path
        for actor, meta in zip(path, chunk.refs, strict=False):  # (then the values)
            try:
                ray.get(meta, timeout=0)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayError:
                return actor
        return path[-1]

    def on_death(
        self, actor: Actor, exc: BaseException, culprit: int | None, lost: Any = None
    ) -> None:
        """``actor`` is gone: blame the chunk it was running (``blame_in_order``: its oldest;
        not known, every chunk it had), re-run the rest; it is replaced once its pool needs
        it (``Scheduler.sends``), not here: a run that the death fails raises without
        waiting for a fresh actor's start and ``init`` (many seconds on a busy machine: Ray
        starts workers at a low priority).

        ``culprit``: the unit (of ``actor``'s hop) known to be in hand (a timeout; or
        ``UNPICKLING``: the chunk's items were being unpickled). ``lost``: a task's chunk
        (a slot of tasks stays); else every chunk the actor had.
        """
        if lost is None:
            _, lost = self.sched.died(actor)
        if not actor.lone and (actor.parking or self.hops[actor.hop].bounds):
            self.engine.leave(actor)  # (a self-sizing pool: the scheduler adds a fresh one)
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
        again = [Work(work.start, work.items, solo=True) for work in lost]
        if lost and not (unknown and len(lost) > 1 and self.books.pins_down()):
            blame = blame_in_order(self.books, actor.hop, lost, culprit)
            who = (actor.hop, actor.index, actor.device, actor.who(self.chain), first_line(exc))
            where = f", {actor.where}" if actor.where else ""
            timed_out = isinstance(exc, TimeoutError)  # (check_clock: past the timeout)
            dead = Dead(*who, None, timed_out, where, "actor")
            again = settle_death(self.books, dead, blame, lost)  # (may raise)
        self.books.again(again)

    def check_clock(self) -> None:
        """Units past ``timeout`` have had their actors killed: deaths charging them."""
        timeout, now = self.options.timeout, time.monotonic()
        if timeout is None or now - self.last_probe < min(timeout / 4, 0.5):
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
        hops, (queued, _) = self.hops, self.sched.units()
        flying = [0] * len(hops)
        for actor in [a for pool in list(self.engine.pools) for a in list(pool)]:
            h = actor.hop
            chunks = sorted(list(actor.queue.values()), key=lambda c: c.id)
            chunks = chunks[: None if self.engine.waits[h] else 1]  # (else one at a time)
            ready = [c for c in chunks if not any(m in self.pending for m in (c.refs or [])[:h])]
            flying[h] += min(hops[h].concurrency, sum(hops[h].units(len(c.items)) for c in ready))
        return stage_stats(self.books, queued, [0] * len(hops), flying)
