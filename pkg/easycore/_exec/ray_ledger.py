"""Where every chunk of a Ray run is: the driver's record of each actor and what it holds.

The Ray counterpart of ``workers.Worker`` and ``ledger.Ledger``. A chunk goes down the whole
chain at once (each hop's actor is handed the hop before's result reference), so it sits in
the queue of one actor of every hop until that hop's small ``Meta`` comes back.
:class:`RayLedger` is the only place that puts a chunk in an actor's queue or takes it out:
when an actor dies, :meth:`RayLedger.lose` takes every chunk it had, oldest first.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from easycore._exec.core import Work
from easycore._exec.plan import Chain, Hop
from easycore._exec.ray_actor import Placement

__all__ = ["Actor", "ActorPools", "RayChunk", "RayLedger", "first_line", "ray_module"]


def ray_module() -> Any:
    """The ray module (imported on first use: ``import easycore`` never imports it)."""
    import ray

    return ray


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.split("\n", 1)[0][:300]


@attrs.define(eq=False)
class Actor:
    """One actor of a hop, as the driver tracks it."""

    hop: int
    index: int  # its place in the hop's pool (what ``worker`` injects)
    device: str
    handle: Any
    where: Placement | None = None
    queue: deque[RayChunk] = attrs.Factory(deque)  # sent, not finished; the oldest runs
    ran: int = 0  # units it ran since it started (max_items_per_worker)
    retiring: bool = False  # finishes what it has, then a fresh actor takes its place
    cut_short: bool = False  # a run was cancelled while it had work: it may be mid-unit
    dead: bool = False  # died: replaced when its pool next needs it (a failing run: never)
    # Not an actor but a slot of Ray tasks (an init-less pool; see ray_actor.run_task): sends
    # ``run``'s arguments as a task; its chunks run independently of each other.
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


@attrs.define(eq=False)
class RayChunk:
    """A chunk on its way through the chain's actors."""

    work: Work  # its first-hop units
    actors: list[Actor]  # per hop
    values: Any = None  # the last hop's result reference
    metas: list[Any] = attrs.Factory(list)  # per hop, once sent


class ActorPools(Protocol):
    """What a run needs of its engine: the actors of every hop, and fresh ones."""

    chain: Chain
    pools: list[list[Actor]]
    waits: list[bool]  # per hop: its actors run several chunks at once (a pool that waits)

    def replace(self, actor: Actor) -> Actor: ...
    def kill_overdue(self, timeout: float) -> list[tuple[Actor, int]]: ...
    def recycle_idle(self) -> None: ...


class RayLedger:
    """The chunks of one Ray run: by the reference of each hop's ``Meta`` still to come."""

    def __init__(self, engine: ActorPools) -> None:
        self.engine = engine
        self.pending: dict[Any, tuple[RayChunk, int]] = {}  # meta ref -> (chunk, hop)
        # references of forgotten chunks, read once ready: Ray logs an error that nobody
        # read as an "Unhandled error" (a death or a failed hop fails every later hop's)
        self.dropped: list[Any] = []

    def __bool__(self) -> bool:
        return bool(self.pending)

    def chunks(self) -> int:
        """Chunks in flight."""
        return len({id(c) for c, _ in self.pending.values()})

    def send(self, chunk: RayChunk, hop: int, meta: Any) -> None:
        """Hop ``hop`` of ``chunk`` went to its actor; ``meta`` will say when it is done."""
        chunk.actors[hop].queue.append(chunk)
        chunk.metas.append(meta)
        self.pending[meta] = (chunk, hop)

    def done(self, ref: Any) -> tuple[RayChunk, int]:
        """Hop h of a chunk is done (its ``Meta`` is ``ref``): (the chunk, h)."""
        chunk, h = self.pending.pop(ref)
        with contextlib.suppress(ValueError):  # (the oldest, mostly: found at once)
            chunk.actors[h].queue.remove(chunk)
        return chunk, h

    def forget(self, chunk: RayChunk) -> None:
        """Take ``chunk`` out of every actor queue and the pending set."""
        for actor in chunk.actors:
            with contextlib.suppress(ValueError):
                actor.queue.remove(chunk)
        for meta in chunk.metas:
            self.pending.pop(meta, None)
        self.dropped += [r for r in (*chunk.metas, chunk.values) if r is not None]

    def sweep(self, wait: float = 0.0) -> None:
        """Read the forgotten references that are ready (``wait``: seconds to wait for the
        rest), so that Ray does not log their errors as unhandled."""
        if not self.dropped:
            return
        ray = ray_module()
        ready, self.dropped = ray.wait(self.dropped, num_returns=len(self.dropped), timeout=wait)
        for ref in ready:
            with contextlib.suppress(Exception):
                ray.get(ref, timeout=0)

    def lose(self, actor: Actor) -> list[Work]:
        """``actor`` is gone: forget every chunk it had; their units, oldest first."""
        lost = list(actor.queue)
        for chunk in lost:
            self.forget(chunk)
        return [chunk.work for chunk in lost]

    def clear(self, cut_short: bool = False) -> None:
        """Forget every chunk (``cut_short``: an actor that had one may be mid-unit)."""
        for actor in [a for pool in self.engine.pools for a in pool]:
            actor.cut_short = actor.cut_short or (cut_short and bool(actor.queue))
            actor.queue.clear()
        self.pending.clear()
        self.sweep(wait=1.0)  # (a failed hop's later hops fail at once)
        self.dropped.clear()

    def units(self, hops: Sequence[Hop]) -> tuple[list[int], list[int]]:
        """Per hop, units sent and not done, and the estimate of those in flight.

        An actor is not asked mid-chunk: in flight are the units of the chunks it is on (its
        oldest, once the hops before have finished it; an actor that waits runs all it has),
        up to its concurrency. (Snapshots: a submit run's thread may change the books.)
        """
        queued = [0] * len(hops)
        for chunk, h in list(self.pending.values()):
            queued[h] += hops[h].units(len(chunk.work.items))
        flying = [0] * len(hops)
        for actor in [a for pool in list(self.engine.pools) for a in list(pool)]:
            h = actor.hop
            queue = list(actor.queue)
            if not self.engine.waits[h]:
                queue = queue[:1]  # (one at a time, in order)
            ready = [c for c in queue if not any(m in self.pending for m in c.metas[:h])]
            units = sum(hops[h].units(len(c.work.items)) for c in ready)
            flying[h] += min(hops[h].concurrency, units)
        return queued, flying
