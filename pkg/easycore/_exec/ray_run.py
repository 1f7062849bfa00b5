"""One run of ``engine="ray"``: chunks through the chain's actors over object references.

The driver's loop of named steps (``dispatch``, ``send``, ``on_ready``, ``on_death`` /
``blame``, ``check_clock``, ``recycle``, ``finish``), the Ray counterpart of ``run.Run``; the
engine (``ray_engine.RayEngine``) owns the actors and replaces them when asked. See the
engine's docstring for the data flow and ARCHITECTURE.md for where each guarantee is kept.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import attrs

from easycore._errors import (
    ItemTimeout,
    SerializationError,
    WorkerDied,
    after_retries,
    item_label,
)
from easycore._exec.plan import Chain, StageStats
from easycore._exec.ray_actor import Broken, Meta, Placement
from easycore._exec.run import Failed
from easycore._exec.sizing import ChunkSizer
from easycore._exec.sources import Source, source_of
from easycore._options import RunOptions, parse_bytes
from easycore._protocol import CACHED, is_cached

__all__ = ["POLL", "Actor", "ActorPools", "RayChunk", "RayRun", "first_line", "ray_module"]

POLL = 0.05  # seconds between looks at a live source or the clock, while waiting


def ray_module() -> Any:
    """The ray module (imported on first use: ``import easycore`` never imports it)."""
    import ray

    return ray


@attrs.define(eq=False)
class Actor:
    """One actor of a hop, as the driver tracks it."""

    hop: int
    index: int  # its place in the hop's pool (what ``worker`` injects)
    device: str
    handle: Any
    where: Placement | None = None
    queue: deque[RayChunk] = attrs.Factory(deque)  # sent, not finished; the oldest runs
    assigned: int = 0  # units sent to it since it started (max_items_per_worker)
    retiring: bool = False  # finishes what it has, then a fresh actor takes its place

    def describe(self, chain: Chain) -> str:
        who = chain.who(self.hop, self.index).replace("worker", "Ray actor", 1)
        return f"{who} on {self.device}" + (f", {self.where}" if self.where else "")


@attrs.define(eq=False)
class RayChunk:
    """Consecutive first-hop units travelling the chain together."""

    start: int  # first-hop index of its first unit
    items: list[Any]
    actors: list[Actor] = attrs.Factory(list)  # per hop, once sent
    values: Any = None  # the last hop's result reference
    metas: list[Any] = attrs.Factory(list)  # per hop
    # runs alone on each actor of its path, so that a death while it runs names it
    solo: bool = False


class ActorPools(Protocol):
    """What a run needs of its engine: the actors of every hop, and fresh ones."""

    chain: Chain
    pools: list[list[Actor]]

    def replace(self, actor: Actor) -> Actor: ...
    def overdue(self, actors: list[Actor]) -> list[tuple[int, float] | None]: ...


class RayRun:
    """One run's state on the engine's actors."""

    def __init__(
        self,
        engine: ActorPools,
        source: Source,
        options: RunOptions,
        bars: list[Any] | None,
        tolerant: bool,
    ) -> None:
        self.engine = engine
        self.chain = engine.chain
        self.hops = self.chain.hops
        self.align = self.chain.align
        self.source = source
        self.options = options
        self.bars = bars
        self.tolerant = tolerant
        self.taken = 0  # first-hop units taken from the source
        self.redo: deque[RayChunk] = deque()  # to run again, ahead of new input
        self.pending: dict[Any, tuple[RayChunk, int]] = {}  # meta ref -> (chunk, hop)
        self.outstanding = 0  # chunks sent or waiting, not yet yielded
        self.ready: dict[int, list[Any]] = {}  # ordered: segments by first output unit
        self.next_out = 0
        self.out: deque[tuple[int, list[Any]]] = deque()
        self.charged: dict[int, int] = {}  # output unit -> retries its deaths used
        self.sizers = [ChunkSizer() for _ in self.hops]
        self.done = [0] * len(self.hops)
        self.busy = [0.0] * len(self.hops)
        self.t0 = time.perf_counter()
        self.last_probe = time.monotonic()
        self.window = (options.prefetch or 2) + 1
        self.window *= max(len(h.devices) for h in self.hops)
        memory = options.max_worker_memory
        self.memory = parse_bytes(memory) if memory is not None else None
        numbering = options.numbering
        self.numbering = (0, 1) if numbering is None else (numbering.first, numbering.step)

    # -- the loop ----------------------------------------------------------------------------
    def loop(self, is_current: Callable[[], bool]) -> Iterator[tuple[int, list[Any]]]:
        ray = ray_module()

        live = self.source.wakeup() is not None
        while True:
            if not is_current():
                msg = "the runner was closed while this run was going on"
                raise RuntimeError(msg)
            while self.out:
                self.outstanding -= 1
                yield self.out.popleft()
            self.dispatch()
            idle = not self.pending and not self.redo and not self.out
            if idle and (self.source.exhausted or self.source.should_end(True)):
                return
            wait = POLL if live or self.options.timeout else 1.0
            refs = list(self.pending)
            if refs:
                ready, _ = ray.wait(refs, num_returns=1, timeout=wait)
                if ready:
                    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                for ref in ready:
                    if ref in self.pending:
                        self.on_ready(ref)
            elif live:
                time.sleep(POLL)
                self.source.drain_wakeups()
            if self.options.timeout is not None:
                self.check_clock()
            self.recycle()

    def dispatch(self) -> None:
        """Send chunks while the window has room: re-runs first, then new input.

        The window counts chunks taken and not yet yielded; re-runs (counted already, and
        perhaps split into many) go out while fewer than a window's worth are in flight.
        """
        while True:
            if self.redo:
                if len({id(c) for c, _ in self.pending.values()}) >= self.window:
                    return
                chunk = self.redo.popleft()
            elif self.outstanding >= self.window:
                return
            else:
                size = self.chunk_size()
                items = list(self.source.take(size)) if not self.source.exhausted else []
                if not items:
                    return
                chunk = RayChunk(self.taken, items)
                self.taken += len(items)
                self.outstanding += 1
            if not self.send(chunk):
                return

    def chunk_size(self) -> int:
        size = min(s.size * h.unit for s, h in zip(self.sizers, self.hops, strict=True))
        most = self.options.max_items_per_worker
        if most is not None:  # no chunk runs past a worker's allowance by much
            size = min(size, most * self.hops[0].unit)
        total = self.source.total
        if total is not None:  # near the end, spread what is left over every actor
            left = max(total - self.taken, 1)
            size = min(size, math.ceil(left / len(self.hops[0].devices)))
        return max(self.align, size // self.align * self.align)

    def send(self, chunk: RayChunk) -> bool:
        """Send ``chunk`` down the chain (False: every actor of a pool is being replaced)."""
        if all(is_cached(u) for u in chunk.items):  # resume=: every result is known
            self.finish(chunk, [CACHED] * math.ceil(len(chunk.items) / self.align))
            return True
        pools = self.engine.pools
        picks = []
        for pool in pools:
            # an actor running a solo chunk takes nothing else; a solo chunk needs an idle one
            free = [a for a in pool if not (a.retiring or any(c.solo for c in a.queue))]
            if chunk.solo:
                free = [a for a in free if not a.queue]
            if not free:
                self.redo.appendleft(chunk)
                return False
            picks.append(min(free, key=lambda a: len(a.queue)))
        arg: Any = chunk.items
        chunk.actors, chunk.metas = picks, []
        for hop, actor in zip(self.hops, picks, strict=True):
            base = chunk.start // hop.unit
            numbering = self.numbering if hop.index == 0 else (0, 1)
            try:
                arg, meta = actor.handle.run.options(num_returns=2).remote(
                    arg,
                    base,
                    self.options.seed,
                    self.options.retries,
                    self.spent(chunk, hop.unit),
                    numbering,
                )
            except Exception as exc:  # an item that cannot be pickled
                self.on_unpicklable(chunk, exc)
                return True
            actor.queue.append(chunk)
            actor.assigned += math.ceil(len(chunk.items) / hop.unit)
            most = self.options.max_items_per_worker
            if most is not None and actor.assigned >= most:
                actor.retiring = True  # replaced once it has finished what it has
            chunk.metas.append(meta)
            self.pending[meta] = (chunk, hop.index)
        chunk.values = arg
        return True

    def spent(self, chunk: RayChunk, unit: int) -> dict[int, int]:
        """Retries the deaths of earlier attempts used, per unit of a hop of ``unit`` items."""
        if not self.charged:
            return {}
        out = {}
        for o in range(chunk.start // self.align, self.end_unit(chunk)):
            if o in self.charged:
                for i in range(o * self.align // unit, (o + 1) * self.align // unit):
                    out[i] = self.charged[o]
        return out

    def end_unit(self, chunk: RayChunk) -> int:
        return math.ceil((chunk.start + len(chunk.items)) / self.align)

    # -- results -----------------------------------------------------------------------------
    def on_ready(self, ref: Any) -> None:
        ray = ray_module()

        chunk, h = self.pending.pop(ref)
        actor = chunk.actors[h]
        try:
            meta: Meta = ray.get(ref)
            values = ray.get(chunk.values) if h == len(self.hops) - 1 else None
        except ray.exceptions.RayActorError as exc:
            self.pending[ref] = (chunk, h)  # (on_death forgets every chunk of the actor)
            self.on_death(self.dead_actor(chunk), exc, culprit=None)
            if ref in self.pending:  # it was not the dead actor's: run it again as it is
                self.forget(chunk)
                self.redo.appendleft(RayChunk(chunk.start, chunk.items))
            return
        except ray.exceptions.RayTaskError as exc:  # a result that would not pickle
            self.pending[ref] = (chunk, h)
            self.forget(chunk)
            self.on_unpicklable(chunk, exc)
            return
        except ray.exceptions.RayError:  # a result lost with its node: run it again
            self.pending[ref] = (chunk, h)
            self.forget(chunk)
            self.redo.appendleft(RayChunk(chunk.start, chunk.items))
            return
        if actor.queue and actor.queue[0] is chunk:
            actor.queue.popleft()
        else:
            with contextlib.suppress(ValueError):
                actor.queue.remove(chunk)
        self.done[h] += meta.n
        self.busy[h] += meta.elapsed
        hop_units = math.ceil(len(chunk.items) / self.hops[h].unit)
        self.sizers[h].update(hop_units, meta.elapsed, 0)
        if self.bars is not None:
            self.bars[h].update(meta.n)
        if self.memory is not None and meta.rss > self.memory:
            actor.retiring = True
        if values is not None:
            self.finish(chunk, self.outputs(chunk, values))

    def outputs(self, chunk: RayChunk, values: list[Any]) -> list[Any]:
        """The last hop's values with failures raised, or (tolerant) as Failed."""
        first = chunk.start // self.align
        out = []
        for k, value in enumerate(values):
            if type(value) is Broken:
                actor = chunk.actors[value.hop]
                hop = self.hops[value.hop]
                label = self.chain.label(value.hop, value.unit, self.options)
                error = value.report.to_error(
                    what=f"while running {label} ({actor.where})",
                    device=actor.device,
                    worker=actor.index,
                    index=self.global_index(value.hop, value.unit),
                )
                if not self.tolerant:
                    raise error
                stage = hop.name if value.report.stage.startswith("<") else value.report.stage
                value = Failed(error, self.unit_items(chunk, first + k), stage)
            out.append(value)
        return out

    def global_index(self, hop: int, index: int) -> int:
        return self.options.global_index(index) if hop == 0 else index

    def unit_items(self, chunk: RayChunk, out: int) -> Any:
        at = out * self.align - chunk.start
        items = chunk.items[at : at + self.align]
        return items[0] if self.align == 1 else items

    def finish(self, chunk: RayChunk, values: list[Any]) -> None:
        """A chunk's output units are known: deliver them (ordered: in input order)."""
        first = chunk.start // self.align
        if not self.options.ordered:
            self.out.append((first, values))
            return
        self.ready[first] = values
        while self.next_out in self.ready:
            values = self.ready.pop(self.next_out)
            self.out.append((self.next_out, values))
            self.next_out += len(values)

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

    def forget(self, chunk: RayChunk) -> None:
        """Take ``chunk`` out of every actor queue and the pending set."""
        for actor in chunk.actors:
            with contextlib.suppress(ValueError):
                actor.queue.remove(chunk)
        for meta in chunk.metas:
            self.pending.pop(meta, None)

    def on_death(self, actor: Actor, exc: BaseException, culprit: int | None) -> None:
        """``actor`` is gone: blame the chunk it was running, re-run the rest, replace it.

        ``culprit``: the unit (of ``actor``'s hop) known to be in hand (a timeout).
        """
        lost = list(actor.queue)
        for chunk in lost:
            self.forget(chunk)
        # A sync actor runs its chunks in order, so the oldest it had was running, unless
        # replies of chunks it finished died with it (a reply goes out on Ray's own thread,
        # after the next task has started: an os._exit there loses it). With several chunks
        # lost, which one was running is not known: none is charged and each runs again
        # alone, where a death names it. (retries=0 raises at once, naming the oldest.)
        ambiguous = (
            culprit is None and len(lost) > 1 and (self.options.retries > 0 or self.tolerant)
        )
        again: list[RayChunk] = []
        for n, chunk in enumerate(lost):
            self.outstanding -= 1
            if ambiguous:
                again.append(RayChunk(chunk.start, chunk.items, solo=True))
                continue
            if n > 0:  # queued behind the running one: innocent
                again.append(chunk)
                continue
            again.extend(self.blame(actor, chunk, exc, culprit))  # (raises when out of retries)
        self.engine.replace(actor)
        for chunk in reversed(again):
            self.outstanding += 1
            self.redo.appendleft(chunk)

    def blame(
        self, actor: Actor, chunk: RayChunk, exc: BaseException, culprit: int | None
    ) -> list[RayChunk]:
        """What of the chunk ``actor`` was running when it died runs again."""
        hop = self.hops[actor.hop]
        first, end = chunk.start // self.align, self.end_unit(chunk)
        if culprit is not None:
            suspects = [culprit * hop.unit // self.align]
        elif end - first == 1:
            suspects = [first]
        elif self.options.retries == 0 and not self.tolerant:
            suspects = list(range(first, end))  # which one is unknown; none may re-run
        else:  # split it: a death of one alone pins the culprit down
            return self.split(chunk, range(first, end))
        again = [o for o in range(first, end) if o not in suspects]
        for o in suspects:
            self.charged[o] = self.charged.get(o, 0) + 1
            if self.charged[o] <= self.options.retries:
                again.append(o)
                continue
            error = self.death_error(actor, exc, chunk, o, culprit)
            if not self.tolerant:
                raise error
            self.finish(
                RayChunk(o * self.align, []),
                [Failed(error, self.unit_items(chunk, o), hop.name)],
            )
            self.outstanding += 1  # (delivered like a chunk)
        return self.split(chunk, sorted(again))

    def split(self, chunk: RayChunk, units: Iterable[int]) -> list[RayChunk]:
        out = []
        for o in units:
            at = o * self.align - chunk.start
            out.append(RayChunk(o * self.align, chunk.items[at : at + self.align], solo=chunk.solo))
        return out

    def death_error(
        self, actor: Actor, exc: BaseException, chunk: RayChunk, out: int, culprit: int | None
    ) -> BaseException:
        tries = after_retries(self.options.retries)
        who = actor.describe(self.chain)
        if culprit is not None:
            label = self.chain.label(actor.hop, culprit, self.options)
            msg = (
                f"{label} ran longer than timeout={self.options.timeout} s on {who}; "
                f"the actor was killed{tries}"
            )
            index = self.global_index(actor.hop, culprit)
            return ItemTimeout(msg, "<timeout>", actor.device, actor.index, index)
        first, end = chunk.start // self.align, self.end_unit(chunk)
        if end - first == 1:
            label = self.chain.label(len(self.hops) - 1, out, self.options)
        else:
            label = f"{self.options.label(chunk.start)} .. {item_label(end - 1, None)}"
        msg = f"{who} died while running {label}{tries}: {first_line(exc)}"
        return WorkerDied(msg, actor.device, actor.index, None, self.options.global_index(first))

    def on_unpicklable(self, chunk: RayChunk, exc: BaseException) -> None:
        """An item of ``chunk`` (or a result) would not pickle."""
        first, end = chunk.start // self.align, self.end_unit(chunk)
        if end - first > 1:  # run its units one by one to name the one
            parts = self.split(chunk, range(first, end))
            self.outstanding += len(parts) - 1
            self.redo.extendleft(reversed(parts))
            return
        label = self.options.label(chunk.start) if self.align == 1 else f"unit {first}"
        error = SerializationError(f"{label} or its result could not be pickled: {exc}")
        error.__cause__ = exc
        if not self.tolerant:
            raise error
        stage = self.hops[0].name
        self.finish(chunk, [Failed(error, self.unit_items(chunk, first), stage)])

    def check_clock(self) -> None:
        """Kill an actor whose unit in hand passed ``timeout`` (then as for a death)."""
        ray = ray_module()

        now = time.monotonic()
        timeout = self.options.timeout
        assert timeout is not None
        if now - self.last_probe < min(timeout / 4, 0.5):
            return
        self.last_probe = now
        busy = [a for pool in self.engine.pools for a in pool if a.queue]
        for actor, held in zip(busy, self.engine.overdue(busy), strict=True):
            if held is not None and held[1] > timeout and actor.queue:
                with contextlib.suppress(Exception):
                    ray.kill(actor.handle, no_restart=True)
                self.on_death(actor, TimeoutError(), culprit=held[0])

    def recycle(self) -> None:
        """Replace retiring actors that have finished their chunks (``end``, then a fresh
        actor's ``init``)."""
        ray = ray_module()

        for pool in self.engine.pools:
            for actor in list(pool):
                if actor.retiring and not actor.queue:
                    report = None
                    with contextlib.suppress(ray.exceptions.RayError):
                        report = ray.get(actor.handle.finish.remote())
                    if report is not None:
                        raise report.to_error(
                            what=f"while ending ({actor.where})",
                            device=actor.device,
                            worker=actor.index,
                            index=None,
                        )
                    self.engine.replace(actor)

    # -- stopping ----------------------------------------------------------------------------
    def drain(self) -> None:
        """An early stop: wait for what is in flight and drop it (the actors stay up)."""
        ray = ray_module()

        refs = list(self.pending)
        if refs:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.wait(refs, num_returns=len(refs), timeout=None)
        self.clear()

    def cancel(self) -> None:
        """The run is over: cancel what is still queued (an error or an interrupt)."""
        ray = ray_module()

        for ref in list(self.pending):
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        self.clear()
        self.source = source_of(())

    def clear(self) -> None:
        for pool in self.engine.pools:
            for actor in pool:
                actor.queue.clear()
        self.pending.clear()
        self.redo.clear()

    def stats(self) -> list[StageStats]:
        wall = max(time.perf_counter() - self.t0, 1e-9)
        queued = [0] * len(self.hops)
        for chunk, h in self.pending.values():
            queued[h] += math.ceil(len(chunk.items) / self.hops[h].unit)
        return [
            StageStats(
                hop.name,
                hop.devices,
                self.done[k],
                min(1.0, self.busy[k] / (wall * len(hop.devices))),
                queued[k],
                0,
            )
            for k, hop in enumerate(self.hops)
        ]


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.split("\n", 1)[0][:300]
