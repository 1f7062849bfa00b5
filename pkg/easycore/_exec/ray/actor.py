"""The Ray actor of ``engine="ray"``: one hop's prepared stages in a Ray worker process.

The same :class:`~easycore._exec.core.stages.PreparedStages` as a local worker runs (``init`` once,
units with injection, seeds and retries, ``end`` at close). The driver (``ray.engine``)
sends it chunks; a chunk's results go to the next hop's actor as an object reference, never
through the driver, so a unit that failed here travels on as a :class:`Broken` marker that
later hops pass through.

This module is imported in Ray's worker processes, and by the driver only once a run asks for
``engine="ray"``: ``import easycore`` never imports it (nor ray).
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import attrs
import ray

from easycore._exec.core.protocol import (
    AT_INDEX,
    AT_STARTED,
    IDLE,
    RUNNING,
    SLOT_WIDTH,
    UNPICKLING,
    UNREADABLE,
    Broken,
    ErrorReport,
    Task,
    batches,
)
from easycore._exec.core.stages import ChunkRun, Finished, PreparedStages
from easycore._reaping import become_subreaper, end_children
from easycore._seeding import seed_loaded, setup_torch

__all__ = ["Meta", "Placement", "StageActor", "UnitClock", "rss_bytes", "run_task"]

#: Seconds between a watchdog's looks at the unit in hand, at most.
WATCH_EVERY = 0.25


class Packed(NamedTuple):
    """A timed run's first-hop items, pickled by the driver so that the actor unpickles them
    inside ``run``, where the timeout's clock sees it (Ray would before ``run`` starts)."""

    n: int  # how many
    blob: bytes


class Placement(NamedTuple):
    """Where an actor runs, for messages: its node and process."""

    node_ip: str
    node_id: str
    pid: int

    def __str__(self) -> str:
        return f"Ray node {self.node_ip} ({self.node_id[:8]}), pid {self.pid}"


class Meta(NamedTuple):
    """What the driver learns from a chunk besides its results (small: no data)."""

    n: int  # units run
    elapsed: float  # seconds the actor spent on them
    rss: int  # the actor's resident memory afterwards, in bytes (0 when unknown)
    busy: float  # slot-seconds: ``elapsed``, with units in flight together counted each


def rss_bytes() -> int:
    """This process's resident memory, in bytes (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@attrs.define(eq=False, slots=False)
class UnitClock:
    """Where the stage actors of an engine say that a unit ran past the run's ``timeout``
    (made a Ray actor of its own, holding no CPU, by the driver).

    A stage actor runs the user's code on its main thread, one task at a time (a Ray actor
    with a second concurrency group runs every task on other threads, where
    ``signal.signal`` raises): nothing can ask it anything while a unit runs. Its watchdog
    thread tells the clock instead; the driver asks the clock, and kills that actor.
    """

    late: dict[int, tuple[int, float] | None] = attrs.Factory(dict)  # key -> (unit, seconds run)

    def note(self, key: int, late: tuple[int, float] | None) -> None:
        """Actor ``key``'s unit in hand has run past the timeout: (the unit, seconds run);
        None: that unit is over (or the actor is)."""
        self.late[key] = late

    def overdue(self) -> dict[int, tuple[int, float]]:
        """Every late unit in hand now, by actor key."""
        return {key: late for key, late in self.late.items() if late is not None}


@attrs.define(eq=False, slots=False)
class StageActor:
    """One hop's producers on one Ray actor (made a Ray actor class by the driver).

    Its tasks run one at a time on its main thread, as a local worker runs the user's code
    (``signal.signal`` works there), except for a hop that waits: several at once on
    threads, sharing the stages' ``concurrency`` slots. A watchdog thread tells ``clock`` when the
    unit in hand (the oldest in flight) passes the run's ``timeout``.

    Args:
        payload: the hop's producers and ``cfg``, cloudpickled by the driver.
        paths: the driver's ``sys.path``; those that exist here and are missing go at the end
            of the actor's, so that functions importable in the driver (a test module, a
            project not installed) import here too, as in a local worker.
        worker, hop: as for a local worker.
        device: as the actor's code sees it: ``"cpu"``, or ``"cuda:0"`` for an actor holding
            GPUs (Ray has set ``CUDA_VISIBLE_DEVICES`` to them, so torch sees the first as
            ``cuda:0``).
        batch: this hop groups the previous hop's results by this many (None: one each).
        clock: the engine's :class:`UnitClock` actor (None before a run with a timeout).
        key: this actor's name at the clock.
        timeout: the run's ``timeout`` (see :meth:`watch`).
        concurrency: units it runs at once, of one chunk or more (async stages: tasks of
            its event loop, each cancelled at the timeout; plain ones: threads).
    """

    payload: bytes
    paths: Sequence[str]
    device: str
    worker: int
    hop: int
    batch: int | None
    clock: Any = None
    key: int = 0
    timeout: float | None = None
    concurrency: int = 1
    # the unit in hand (the oldest in flight), as a local worker's shared slot holds it:
    # its index, and its start (> RUNNING) as long as it runs
    slot: list[float] = attrs.field(init=False, factory=lambda: [IDLE] * SLOT_WIDTH)
    stages: PreparedStages = attrs.field(init=False)

    @stages.default
    def _prepare(self, stages: Sequence[Any] = (), cfg: Any = None) -> PreparedStages:
        """The hop's ``stages`` here (none until :meth:`start`: a run there finds them closed)."""
        n = self.concurrency
        return PreparedStages(
            stages, device=self.device, cfg=cfg, worker=self.worker, hop=self.hop, concurrency=n
        )

    def start(self, task: bool = False) -> tuple[ErrorReport | None, Placement]:
        """Bind the device and run every ``init``: (the failure or None, where it runs).

        ``task``: this body serves Ray tasks (see :func:`run_task`) in a worker process that
        Ray owns and reuses: it neither adopts that process's orphans nor watches a clock.
        """
        ctx = ray.get_runtime_context()
        if not task:
            # what the work starts stays below this actor, also what leaves its session
            # (setsid, a daemon): finish() ends it, and a driver killing the actor finds it
            become_subreaper()
        where = Placement(ray.util.get_node_ip_address(), ctx.get_node_id(), os.getpid())  # type: ignore[no-untyped-call]
        sys.path.extend(p for p in self.paths if p not in sys.path and os.path.isdir(p))
        seed_loaded(int.from_bytes(os.urandom(8), "little") >> 1)  # (a run with no seed)
        # Ray gives an actor's torch one thread per CPU it holds (OMP_NUM_THREADS); bind the
        # GPU before anything can touch CUDA.
        setup_torch(self.device, None)
        try:
            stages, cfg = pickle.loads(self.payload)
        except BaseException as exc:
            return ErrorReport.of("<payload>", exc), where
        self.stages = self._prepare(stages, cfg)
        self.stages.where = str(where)
        self.stages.flight.to_slot(self.slot, 0)
        if not task:
            threading.Thread(target=self._watch, name="easycore-watchdog", daemon=True).start()
        failed = self.stages.start()
        return (failed.report() if failed is not None else None), where

    def watch(self, timeout: float | None, clock: Any) -> None:
        """The ``timeout`` of the run about to start (None: none), and the clock to tell."""
        self.timeout, self.clock = timeout, clock

    def _watch(self) -> None:
        """(watchdog thread) Tell the clock when the unit in hand has run past the timeout,
        and when that unit is over."""
        told: tuple[int, float] | None = None
        while True:
            timeout, clock = self.timeout, self.clock
            time.sleep(WATCH_EVERY if timeout is None else min(max(timeout / 4, 0.01), WATCH_EVERY))
            start = self.slot[AT_STARTED]
            current = (int(self.slot[AT_INDEX]), start) if start > RUNNING else None
            if clock is None or current == told:
                continue
            if told is not None:
                clock.note.remote(self.key, None)
                told = None
            if timeout is not None and current is not None:
                elapsed = time.monotonic() - current[1]
                if elapsed > timeout:
                    clock.note.remote(self.key, (current[0], elapsed))
                    told = current

    def run(
        self,
        units: Sequence[Any],
        base: int,
        seed: int | None,
        retries: int,
        spent: dict[tuple[int, int], int],
        numbering: tuple[int, int],
        keys: Sequence[Any] | None = None,
    ) -> tuple[list[Any], Meta]:
        """Run unit ``base + k`` for each ``units[k]`` (grouped first by ``batch`` when this
        hop takes batches of the previous hop's results); failures come back as Broken."""
        t0 = time.perf_counter()
        if type(units) is Packed:
            units = self.unpack(units, base)
            if type(units) is Broken:  # they did not unpickle here: each unit fails
                return self._failed(units.unit, base, units.failure, t0)
        if self.batch is not None:
            units = batches(units, self.batch)
        task = Task(0, seed, 0, units, True, retries, spent, numbering, True, self.timeout, keys)
        try:
            if not self.stages.open:
                raise Finished("this actor has finished: the run it ran for is over")
            if self.stages.waits:
                (out, n, _), busy = ChunkRun(self.stages, units, base, task).start().result()
            else:
                (out, n, _), busy = ChunkRun(self.stages, units, base, task).run(self.slot, 0), None
                self.slot[AT_STARTED] = IDLE
        except (Finished, concurrent.futures.CancelledError) as exc:
            # The run is over (its end cancelled this chunk, or the chunk came after it):
            # nobody reads it. Its units fail, not the call: Ray would log a failed call
            # that nobody waits for as an unhandled error.
            return self._failed(len(units), base, ErrorReport.of("<run over>", exc), t0)
        took = time.perf_counter() - t0
        return out, Meta(n, took, rss_bytes(), took if busy is None else busy)

    def _failed(self, n: int, base: int, failure: Any, t0: float) -> tuple[list[Any], Meta]:
        """Each of ``n`` units from ``base`` failed with ``failure``, before any ran."""
        took = time.perf_counter() - t0
        out = [Broken(self.hop, base + k, failure, self.stages.where) for k in range(n)]
        return out, Meta(0, took, rss_bytes(), took)

    def unpack(self, packed: Packed, base: int) -> Any:
        """The items of a timed run, unpickled here on the clock: the first unit's (or, for
        several, UNPICKLING's) time starts now, as a local worker's does. A Broken (its
        ``unit``: how many) when they do not unpickle. (A hop that waits may have units of
        other chunks in flight meanwhile: the watchdog hears of them again afterwards.)"""
        self.stages.flight.hold()
        self.slot[AT_INDEX] = base if packed.n == 1 else UNPICKLING
        self.slot[AT_STARTED] = time.monotonic()
        try:
            return pickle.loads(packed.blob)
        except Exception as exc:
            return Broken(self.hop, packed.n, ErrorReport.of(UNREADABLE, exc), self.stages.where)
        finally:
            self.stages.flight.release(self._idle)

    def _idle(self) -> None:
        self.slot[AT_STARTED] = IDLE

    def finish(self) -> ErrorReport | None:
        """Run every ``end``, then end what the work started; the first failure, or None."""
        failed = self.stages.finish()
        end_children(1.0)
        return failed.report() if failed is not None else None


# The bodies of init-less pools that Ray tasks ran in this worker process, by (pool, worker):
# a task finds its body prepared by an earlier one (a few are kept: Ray reuses its workers).
_BODIES: dict[tuple[str, int], StageActor] = {}
_KEEP_BODIES = 16


def run_task(
    pool: str,
    payload: bytes,
    paths: Sequence[str],
    worker: int,
    hop: int,
    batch: int | None,
    concurrency: int,
    *run_args: Any,
) -> tuple[list[Any], Meta]:
    """One chunk of an init-less CPU pool as a plain Ray task (made a remote function by the
    driver): :meth:`StageActor.run` on this process's body for (``pool``, ``worker``),
    prepared on first use. Ray starts a task on a warm worker in milliseconds, where an
    actor needs a new process; with no ``init`` there is nothing else an actor would keep.

    Ray unpickles a task's arguments before the task runs, where a class that only the
    driver's ``sys.path`` finds (a test module, a project not installed) does not import
    yet: so the driver sends the chunk's units pickled (:class:`Packed`: a pool of tasks is
    always a run's first), and they are read after the body has extended ``sys.path``.

    Raises:
        RuntimeError: the stages did not unpickle here (the driver reports the chunk).
    """
    body = _BODIES.get((pool, worker))
    if body is None:
        body = StageActor(payload, paths, "cpu", worker, hop, batch, concurrency=concurrency)
        failed, _ = body.start(task=True)
        if failed is not None:
            msg = f"the pool's producers did not load here: {failed.type_name}: {failed.text}"
            raise RuntimeError(msg)
        if len(_BODIES) >= _KEEP_BODIES:
            _BODIES.pop(next(iter(_BODIES)))
        _BODIES[(pool, worker)] = body
    return body.run(*run_args)
