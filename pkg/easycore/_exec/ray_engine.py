"""``engine="ray"``: every hop a group of Ray actors, scheduled and placed by Ray.

The driver (the calling process) runs the same loop of named steps as the local engine, over
Ray object references instead of pipes::

    Source ─take─> chunk ─ hop 0 actor.run(items) ─ref─> hop 1 actor.run(ref) ─ref─> ... ─┐
      ^ backpressure: at most (prefetch + 1) chunks per actor of the widest pool          │
      │   taken and not yet yielded                                                        │
    yield / consumer fold <── ordered: segments keyed by their first unit <── ray.wait ────┘

* Results of one pool reach the next as object references (Ray moves the bytes between
  nodes; the driver only sees each chunk's small :class:`~.ray_actor.Meta`), and a big array
  or tensor result lives in Ray's object store.
* Each actor runs its chunks in the order sent (a sync actor), so the oldest chunk it has
  not finished is the one it was running when it died: that one is blamed (charged a retry
  once it holds a single output unit, split into units first), the rest re-run uncharged.
  The dead actor is replaced (its ``init`` runs) before more work goes to its pool.
* ``timeout``: an actor reports the unit in hand from a second thread (a Ray concurrency
  group); one past the limit has its actor killed, then as for a death, blaming that unit.
* Ctrl-C or an error: queued tasks are cancelled, ``end`` gets a short grace, every actor is
  killed; a Ray this engine started is shut down (one the user started is left running).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs
import cloudpickle

from easycore._config import CfgNode
from easycore._errors import (
    ItemTimeout,
    SerializationError,
    WorkerDied,
    after_retries,
    item_label,
)
from easycore._exec.engine import PRIMED
from easycore._exec.plan import Chain, PipelineDef, StageStats, plan_chain
from easycore._exec.ray_actor import Broken, Meta, Placement, StageActor
from easycore._exec.run import Failed
from easycore._exec.sizing import ChunkSizer
from easycore._exec.sources import Source, source_of
from easycore._options import RunOptions, parse_bytes
from easycore._protocol import CACHED, PROTOCOL, is_cached

__all__ = ["RayEngine", "ray_devices"]

#: Seconds an actor may take to be placed and run its ``init`` before the run fails (a
#: cluster without room for it would otherwise wait forever).
START_TIMEOUT = float(os.environ.get("EASYCORE_RAY_START_TIMEOUT", "300"))
POLL = 0.05  # seconds between looks at a live source or the clock, while waiting


def _ray() -> Any:
    """The ray module (imported on first use: ``import easycore`` never imports it)."""
    import ray

    return ray


_USERS = 0  # runners of this process using Ray now
_OWNED = False  # this process started (or connected) Ray and shuts it down after the last


def _connect() -> None:
    """Use the Ray this process is connected to, else ``ray.init()`` (``RAY_ADDRESS``, or a
    new local Ray); count the runner as a user."""
    global _USERS, _OWNED
    ray = _ray()

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=True, logging_level="WARNING")
        _OWNED = True
    _USERS += 1


def _disconnect() -> None:
    """The runner is done with Ray: shut down a Ray this module started, after its last user."""
    global _USERS, _OWNED
    ray = _ray()

    _USERS = max(0, _USERS - 1)
    if _USERS == 0 and _OWNED:
        _OWNED = False
        with contextlib.suppress(Exception):
            ray.shutdown()


def ray_devices(devices: Any, resources: dict[str, float]) -> list[str]:
    """``devices`` on Ray: ``"cpu"`` for an actor with one CPU, ``"cuda"`` for one with a GPU.

    ``n`` is n CPU actors; ``"cuda"`` (or ``"cuda:i"``, a ``torch.device``) one GPU actor per
    entry; ``"auto"`` a GPU actor per GPU of the cluster, else a CPU actor per CPU.

    Raises:
        ValueError: ``"inline"``, an unknown device, or more than the cluster holds.
    """
    gpus = int(resources.get("GPU", 0))
    cpus = int(resources.get("CPU", 0))
    if isinstance(devices, str) and devices == "auto":
        out = ["cuda"] * gpus if gpus else ["cpu"] * max(cpus, 1)
    elif isinstance(devices, str) and devices == "cuda":
        out = ["cuda"] * gpus
        if not gpus:
            msg = "devices='cuda' but the Ray cluster has no GPU"
            raise ValueError(msg)
    elif isinstance(devices, bool):
        msg = f"devices must be an int, a device list or a keyword, got {devices!r}"
        raise ValueError(msg)
    elif isinstance(devices, int):
        if devices < 1:
            msg = f"devices={devices}: need at least 1 actor (an int means that many CPU actors)"
            raise ValueError(msg)
        out = ["cpu"] * devices
    else:
        entries = [devices] if isinstance(devices, str) else list(devices)
        out = [_one(d) for d in entries]
        if not out:
            msg = "devices is empty"
            raise ValueError(msg)
    need_cpu, need_gpu = out.count("cpu"), out.count("cuda")
    if need_gpu > gpus:
        msg = f"{need_gpu} GPU actor(s) asked for, and the Ray cluster has {gpus} GPU(s)"
        raise ValueError(msg)
    if need_cpu > cpus:
        msg = (
            f"{need_cpu} CPU actor(s) asked for (one CPU each), and the Ray cluster has "
            f"{cpus} CPU(s): ask for fewer, or add nodes (ray start --address=...)"
        )
        raise ValueError(msg)
    return out


def _one(device: Any) -> str:
    text = str(device)
    if text == "cpu":
        return "cpu"
    if text == "cuda" or text.startswith("cuda:"):
        return "cuda"
    msg = f"unknown device {device!r} for engine='ray' (use 'cpu', 'cuda' or an int)"
    raise ValueError(msg)


def _actor_class() -> Any:
    """StageActor as a Ray actor class (made once per process)."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        ray = _ray()

        _ACTOR_CLASS = ray.remote(
            max_restarts=0, max_task_retries=0, concurrency_groups={"probe": 1}
        )(StageActor)
    return _ACTOR_CLASS


_ACTOR_CLASS: Any = None


@attrs.define(eq=False)
class _Actor:
    """One actor of a hop, as the driver tracks it."""

    hop: int
    index: int  # its place in the hop's pool (what ``worker`` injects)
    device: str
    handle: Any
    where: Placement | None = None
    queue: deque[_Chunk] = attrs.Factory(deque)  # sent, not finished; the oldest runs
    assigned: int = 0  # units sent to it since it started (max_items_per_worker)
    retiring: bool = False  # finishes what it has, then a fresh actor takes its place

    def describe(self, chain: Chain) -> str:
        who = chain.who(self.hop, self.index).replace("worker", "Ray actor", 1)
        return f"{who} on {self.device}" + (f", {self.where}" if self.where else "")


@attrs.define(eq=False)
class _Chunk:
    """Consecutive first-hop units travelling the chain together."""

    start: int  # first-hop index of its first unit
    items: list[Any]
    actors: list[_Actor] = attrs.Factory(list)  # per hop, once sent
    values: Any = None  # the last hop's result reference
    metas: list[Any] = attrs.Factory(list)  # per hop


class RayEngine:
    """A chain's hops as groups of Ray actors (see the module docstring)."""

    in_caller = False

    def __init__(self, pipeline: PipelineDef, devices: Any, cfg: CfgNode) -> None:
        ray = _ray()

        _connect()
        try:
            resources = ray.cluster_resources()
            self.chain: Chain = plan_chain(
                pipeline, devices, parse=lambda d: ray_devices(d, resources)
            )
        except BaseException:
            _disconnect()
            raise
        self.connected = True
        self.cfg = cfg
        self.pools: list[list[_Actor]] = []
        self.payloads: list[bytes] = []
        self.last_run: _RayRun | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start every actor and run every ``init``.

        Raises:
            WorkerError: an ``init`` raised (no actor is left).
            WorkerDied: an actor died while starting, or could not be placed in time.
        """
        if not self.connected:
            _connect()
            self.connected = True
        try:
            self.payloads = [self._payload(hop.index) for hop in self.chain.hops]
            self.pools = [
                [self._new_actor(hop.index, k, dev) for k, dev in enumerate(hop.devices)]
                for hop in self.chain.hops
            ]
            self._await_started([a for pool in self.pools for a in pool])
        except BaseException:
            self.stop(grace=0.0, report=False)
            raise

    def _payload(self, hop: int) -> bytes:
        """A hop's producers and ``cfg``, pickled once for its actors.

        Raises:
            SerializationError: a stage function or ``cfg`` cannot be pickled.
        """
        h = self.chain.hops[hop]
        try:
            payload: bytes = cloudpickle.dumps((h.stages, self.cfg), PROTOCOL)
        except Exception as exc:
            msg = f"the producers {h.name!r} or cfg cannot be pickled; actors receive them pickled"
            raise SerializationError(msg) from exc
        return payload

    def _new_actor(self, hop: int, index: int, device: str) -> _Actor:
        h = self.chain.hops[hop]
        opts: dict[str, Any] = {"num_gpus": 1} if device == "cuda" else {"num_cpus": 1}
        entropy = int.from_bytes(os.urandom(8), "little") >> 1
        handle = (
            _actor_class()
            .options(**opts)
            .remote(self.payloads[hop], sys.path, device, index, hop, entropy, h.batch)
        )
        return _Actor(hop, index, device, handle)

    def _await_started(self, actors: Sequence[_Actor]) -> None:
        """Run ``start`` (device binding, every ``init``) on new actors and wait for it."""
        ray = _ray()

        refs = [a.handle.start.remote() for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=START_TIMEOUT)
        if len(ready) < len(refs):
            late = actors[next(k for k, r in enumerate(refs) if r not in ready)]
            msg = (
                f"{late.describe(self.chain)} was not placed and started within "
                f"{START_TIMEOUT:.0f} s (EASYCORE_RAY_START_TIMEOUT); the cluster has "
                f"{ray.available_resources()} free"
            )
            raise WorkerDied(msg, late.device, late.index)
        for actor, ref in zip(actors, refs, strict=True):
            try:
                report, actor.where = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                msg = f"{actor.describe(self.chain)} died while starting: {_first_line(exc)}"
                raise WorkerDied(msg, actor.device, actor.index) from None
            if report is not None:
                raise report.to_error(
                    what=f"while starting ({actor.where})",
                    device=actor.device,
                    worker=actor.index,
                    index=None,
                )

    def replace(self, actor: _Actor, kill: bool = True) -> _Actor:
        """A fresh actor (its ``init`` run) in ``actor``'s place."""
        ray = _ray()

        if kill:
            with contextlib.suppress(Exception):
                ray.kill(actor.handle, no_restart=True)
        fresh = self._new_actor(actor.hop, actor.index, actor.device)
        self.pools[actor.hop][actor.index] = fresh
        self._await_started([fresh])
        return fresh

    def stop(self, grace: float | None, report: bool) -> None:
        """Run ``end`` on every actor (``grace`` seconds at most), then kill them all.

        Raises:
            WorkerError, WorkerDied: (``report``) an ``end`` raised or an actor died in it.
        """
        ray = _ray()

        actors = [a for pool in self.pools for a in pool]
        self.pools = []
        failure: BaseException | None = None
        try:
            refs = [a.handle.finish.remote() for a in actors]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=grace) if refs else ([], [])
            for actor, ref in zip(actors, refs, strict=True):
                if ref not in ready or failure is not None:
                    continue
                try:
                    ended = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    msg = f"{actor.describe(self.chain)} died while ending: {_first_line(exc)}"
                    failure = WorkerDied(msg, actor.device, actor.index)
                    continue
                if ended is not None:
                    failure = ended.to_error(
                        what=f"while ending ({actor.where})",
                        device=actor.device,
                        worker=actor.index,
                        index=None,
                    )
        finally:
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor.handle, no_restart=True)
            if self.connected:
                self.connected = False
                _disconnect()
        if report and failure is not None:
            raise failure

    def stats(self) -> list[StageStats]:
        if self.last_run is None:
            return [StageStats(h.name, h.devices) for h in self.chain.hops]
        return self.last_run.stats()

    # -- runs --------------------------------------------------------------------------------
    def stream(
        self,
        data: Iterable[Any] | Source,
        options: RunOptions,
        *,
        bars: list[Any] | None = None,
        tolerant: bool = False,
        is_current: Callable[[], bool] = lambda: True,
    ) -> Iterator[Any]:
        """PRIMED, then segments ``(index of the first unit, [results])`` of the last hop."""
        run = _RayRun(self, source_of(data), options, bars, tolerant)
        self.last_run = run
        try:
            run.dispatch()
            yield PRIMED
            yield from run.loop(is_current)
        except GeneratorExit:
            if is_current():
                run.drain()
            raise
        finally:
            run.cancel()


class _RayRun:
    """One run's state on the engine's actors."""

    def __init__(
        self,
        engine: RayEngine,
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
        self.redo: deque[_Chunk] = deque()  # to run again, ahead of new input
        self.pending: dict[Any, tuple[_Chunk, int]] = {}  # meta ref -> (chunk, hop)
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
        ray = _ray()

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
                chunk = _Chunk(self.taken, items)
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

    def send(self, chunk: _Chunk) -> bool:
        """Send ``chunk`` down the chain (False: every actor of a pool is being replaced)."""
        if all(is_cached(u) for u in chunk.items):  # resume=: every result is known
            self.finish(chunk, [CACHED] * math.ceil(len(chunk.items) / self.align))
            return True
        pools = self.engine.pools
        picks = []
        for pool in pools:
            free = [a for a in pool if not a.retiring]
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

    def spent(self, chunk: _Chunk, unit: int) -> dict[int, int]:
        """Retries the deaths of earlier attempts used, per unit of a hop of ``unit`` items."""
        if not self.charged:
            return {}
        out = {}
        for o in range(chunk.start // self.align, self.end_unit(chunk)):
            if o in self.charged:
                for i in range(o * self.align // unit, (o + 1) * self.align // unit):
                    out[i] = self.charged[o]
        return out

    def end_unit(self, chunk: _Chunk) -> int:
        return math.ceil((chunk.start + len(chunk.items)) / self.align)

    # -- results -----------------------------------------------------------------------------
    def on_ready(self, ref: Any) -> None:
        ray = _ray()

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
                self.redo.appendleft(_Chunk(chunk.start, chunk.items))
            return
        except ray.exceptions.RayTaskError as exc:  # a result that would not pickle
            self.pending[ref] = (chunk, h)
            self.forget(chunk)
            self.on_unpicklable(chunk, exc)
            return
        except ray.exceptions.RayError:  # a result lost with its node: run it again
            self.pending[ref] = (chunk, h)
            self.forget(chunk)
            self.redo.appendleft(_Chunk(chunk.start, chunk.items))
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

    def outputs(self, chunk: _Chunk, values: list[Any]) -> list[Any]:
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

    def unit_items(self, chunk: _Chunk, out: int) -> Any:
        at = out * self.align - chunk.start
        items = chunk.items[at : at + self.align]
        return items[0] if self.align == 1 else items

    def finish(self, chunk: _Chunk, values: list[Any]) -> None:
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
    def dead_actor(self, chunk: _Chunk) -> _Actor:
        """The first actor on ``chunk``'s path that failed (later hops fail because of it)."""
        ray = _ray()

        for h, meta in enumerate(chunk.metas):
            try:
                ray.get(meta, timeout=0)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayError:
                return chunk.actors[h]
        return chunk.actors[-1]

    def forget(self, chunk: _Chunk) -> None:
        """Take ``chunk`` out of every actor queue and the pending set."""
        for actor in chunk.actors:
            with contextlib.suppress(ValueError):
                actor.queue.remove(chunk)
        for meta in chunk.metas:
            self.pending.pop(meta, None)

    def on_death(self, actor: _Actor, exc: BaseException, culprit: int | None) -> None:
        """``actor`` is gone: blame the chunk it was running, re-run the rest, replace it.

        ``culprit``: the unit (of ``actor``'s hop) known to be in hand (a timeout).
        """
        lost = list(actor.queue)
        for chunk in lost:
            self.forget(chunk)
        again: list[_Chunk] = []
        for n, chunk in enumerate(lost):
            self.outstanding -= 1
            if n > 0:  # queued behind the running one: innocent
                again.append(chunk)
                continue
            again.extend(self.blame(actor, chunk, exc, culprit))  # (raises when out of retries)
        self.engine.replace(actor)
        for chunk in reversed(again):
            self.outstanding += 1
            self.redo.appendleft(chunk)

    def blame(
        self, actor: _Actor, chunk: _Chunk, exc: BaseException, culprit: int | None
    ) -> list[_Chunk]:
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
                _Chunk(o * self.align, []),
                [Failed(error, self.unit_items(chunk, o), hop.name)],
            )
            self.outstanding += 1  # (delivered like a chunk)
        return self.split(chunk, sorted(again))

    def split(self, chunk: _Chunk, units: Iterable[int]) -> list[_Chunk]:
        out = []
        for o in units:
            at = o * self.align - chunk.start
            out.append(_Chunk(o * self.align, chunk.items[at : at + self.align]))
        return out

    def death_error(
        self, actor: _Actor, exc: BaseException, chunk: _Chunk, out: int, culprit: int | None
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
        msg = f"{who} died while running {label}{tries}: {_first_line(exc)}"
        return WorkerDied(msg, actor.device, actor.index, None, self.options.global_index(first))

    def on_unpicklable(self, chunk: _Chunk, exc: BaseException) -> None:
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
        ray = _ray()

        now = time.monotonic()
        timeout = self.options.timeout
        assert timeout is not None
        if now - self.last_probe < min(timeout / 4, 0.5):
            return
        self.last_probe = now
        busy = [a for pool in self.engine.pools for a in pool if a.queue]
        probes = [a.handle.now.options(concurrency_group="probe").remote() for a in busy]
        for actor, probe in zip(busy, probes, strict=True):
            try:
                held = ray.get(probe, timeout=5.0)
            except ray.exceptions.RayError:
                continue  # dead: its results say so
            if held is not None and held[1] > timeout and actor.queue:
                with contextlib.suppress(Exception):
                    ray.kill(actor.handle, no_restart=True)
                self.on_death(actor, TimeoutError(), culprit=held[0])

    def recycle(self) -> None:
        """Replace retiring actors that have finished their chunks (``end``, then a fresh
        actor's ``init``)."""
        ray = _ray()

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
        ray = _ray()

        refs = list(self.pending)
        if refs:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.wait(refs, num_returns=len(refs), timeout=None)
        self.clear()

    def cancel(self) -> None:
        """The run is over: cancel what is still queued (an error or an interrupt)."""
        ray = _ray()

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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.split("\n", 1)[0][:300]
