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
* Each actor runs its chunks in the order sent (a sync actor), so when it dies holding one
  unfinished chunk, that one was running: it is blamed (charged a retry once it holds a
  single output unit, split into units first). Holding several, the oldest need not be the
  one: replies of finished chunks can die with the actor. Then none is charged and each
  runs again *solo* (alone on every actor of its path), where a death names it (with no
  retries and ``errors="raise"``, all are charged, and the error names them all).
  The dead actor is replaced (its ``init`` runs) when its pool next needs it, not at once:
  a run that the death fails raises without waiting for a fresh actor.
* An actor runs the user's code on its main thread, one task at a time, as a local worker
  does (``signal.signal`` works there; an actor with a second concurrency group would run
  every task on other threads). An actor of a pool that waits (``concurrency=k``, async
  stages) is the exception: it runs chunks at once on threads (``max_concurrency=k+1``),
  sharing its ``k`` slots, so that a slot one chunk's slow unit leaves free takes the next
  chunk's; its units are never timed by a signal (async ones are cancelled, thread ones
  are reported to the clock), and a death there without a timeout blames no chunk at
  once: each runs again solo, as above.
* ``timeout``: an actor's watchdog thread tells the engine's clock (a small actor holding no
  CPU, :class:`~.ray_actor.UnitClock`) when its unit in hand passes the limit; the driver
  asks the clock, kills that actor, then as for a death, blaming that unit.
* A one-shot run with no ``timeout`` and no recycling runs its first pool, when on CPUs
  with stages that have no ``init`` and no ``end`` and do not wait, as plain Ray tasks
  (``actor.run_task``), not actors (a pool fed by another stays on actors, which queue
  chunks still being made upstream; a slot of tasks takes one at a time): Ray
  starts a task on a warm worker in milliseconds, where an actor needs a new process (about
  0.4 s), and such a pool keeps nothing an actor would hold. Each of its workers is then a
  slot of tasks (what ``worker`` injects); a task's death names its chunk, charged as an
  actor's would be, and Ray's own retries are off. A task gets its units pickled
  (``actor.Packed``): Ray unpickles a task's arguments before it runs, before the
  driver's ``sys.path`` is added there.
* Ctrl-C or an error: actors' queued tasks are cancelled, ``end`` gets a short grace,
  every actor is killed (a plain task already sent finishes its chunk unseen: Ray's cancel
  of a normal task can abort the driver when it races the task's reply); a Ray this
  engine started is shut down (one the user started is left running).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import ray

from easycore._config.cfgnode import CfgNode
from easycore._devices import parse_devices
from easycore._errors import SerializationError, WorkerDied
from easycore._exec.core.books import RAISE, ErrorPolicy, RunBooks
from easycore._exec.core.plan import (
    Chain,
    PipelineDef,
    StageStats,
    idle_stats,
    pack_payload,
    plan_chain,
)
from easycore._exec.core.protocol import ErrorReport
from easycore._exec.core.report import Trace
from easycore._exec.core.sizing import Balancer
from easycore._exec.core.sources import Source, source_of
from easycore._exec.core.stages import UNIT_GRACE, is_async_fn
from easycore._exec.ray.actor import StageActor, UnitClock, run_task
from easycore._exec.ray.run import Actor, RayRun, first_line
from easycore._options import RunOptions
from easycore._reaping import descendants, end_processes

__all__ = ["RayEngine", "check_fits", "ray_devices"]

#: Seconds an actor may take to be placed and run its ``init`` before the run fails (a
#: cluster without room for it would otherwise wait forever).
START_TIMEOUT = float(os.environ.get("EASYCORE_RAY_START_TIMEOUT", "300"))


#: Bytes of a task pool's producers sent along with each task (above: by reference).
INLINE_PAYLOAD = 64 * 1024

_USERS = 0  # runners of this process using Ray now
_OWNED = False  # this process started (or connected) Ray and shuts it down after the last


def _connect() -> None:
    """Use the Ray this process is connected to, else ``ray.init()`` (``RAY_ADDRESS``, or a
    new local Ray); count the runner as a user.

    Before ``ray.init`` goes to a ``RAY_ADDRESS`` (``host:port`` or ``ray://host:port``), a
    plain TCP connect checks that something answers there, within
    ``EASYCORE_RAY_CONNECT_TIMEOUT`` seconds (10): Ray itself would make a GCS client 20
    times (``RAY_NUM_REDIS_GET_RETRIES``), each waiting out ``RAY_py_gcs_connect_timeout_s``
    (30 s) and more, minutes without a word. ``auto``, ``local`` and no address are Ray's.

    Raises:
        ConnectionError: nothing answers at ``RAY_ADDRESS``.
    """
    global _USERS, _OWNED
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS", "")
        host, colon, port = address.removeprefix("ray://").rpartition(":")
        if colon and port.isdigit() and "://" not in host:
            limit = float(os.environ.get("EASYCORE_RAY_CONNECT_TIMEOUT", "10"))
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=limit).close()
            except OSError as err:
                msg = (
                    f"nothing answers at RAY_ADDRESS={address} ({err.strerror or err}): start "
                    "the Ray cluster there (`ray start --head`), or unset RAY_ADDRESS to run "
                    "on a local Ray started for the run"
                )
                raise ConnectionError(msg) from err
        ray.init(include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
        _OWNED = True
    _USERS += 1


def _disconnect() -> None:
    """The runner is done with Ray: shut down a Ray this module started, after its last user."""
    global _USERS, _OWNED
    _USERS = max(0, _USERS - 1)
    if _USERS == 0 and _OWNED:
        _OWNED = False
        with contextlib.suppress(Exception):
            ray.shutdown()


def _kill(actors: Sequence[Actor]) -> None:
    """Kill actors now, and what their work started on this machine (found first: killed,
    an actor leaves its children to the raylet; those that left its session too)."""
    here = {p for a in actors if a.where is not None and (p := a.where.pid) and _local(p)}
    below = descendants(here) if here else []
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor.handle, no_restart=True)
    end_processes(below, within=0.0)


def _wait_for_ends(actors: Sequence[Actor], refs: list[Any], grace: float | None) -> list[Any]:
    """Wait for the ``end`` of each actor (``refs``): ``grace`` seconds at most, and only
    UNIT_GRACE for those whose run was cancelled mid-work (their ``end`` waits behind a
    unit that may not finish soon, as a local worker's does). The refs that are ready."""
    if not refs:
        return []
    if grace is None:
        return list(ray.wait(refs, num_returns=len(refs))[0])
    start = time.monotonic()
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(grace, UNIT_GRACE))
    idle = [r for a, r in zip(actors, refs, strict=True) if not a.cut_short and r not in ready]
    left = grace - (time.monotonic() - start)
    if idle and left > 0:
        ready += ray.wait(idle, num_returns=len(idle), timeout=left)[0]
    return list(ready)


def _local(pid: int) -> bool:
    """Whether ``pid`` is an easycore actor's process on this machine."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::StageActor")
    except OSError:
        return False


def ray_devices(devices: Any, resources: dict[str, float]) -> list[str]:
    """``devices`` on Ray: ``"cpu"`` for an actor with one CPU, ``"cuda"`` for one with a GPU.

    ``n`` is n CPU actors; ``"cuda"`` (or ``"cuda:i"``, a ``torch.device``) one GPU actor per
    entry; ``"auto"`` a GPU actor per GPU of the cluster, else a CPU actor per CPU. Whether
    they fit the cluster: :func:`check_fits`, for every pool at once.

    Raises:
        ValueError: ``"inline"``, an unknown device, ``"cuda"`` on a cluster without a GPU.
    """
    gpus = int(resources.get("GPU", 0))
    if isinstance(devices, int):  # (as on processes: n CPU workers, here actors)
        return parse_devices(devices)
    if isinstance(devices, str) and devices == "auto":
        return ["cuda"] * gpus if gpus else ["cpu"] * max(int(resources.get("CPU", 0)), 1)
    if isinstance(devices, str) and devices == "cuda":
        if not gpus:
            msg = "devices='cuda' but the Ray cluster has no GPU"
            raise ValueError(msg)
        return ["cuda"] * gpus
    entries = [devices] if isinstance(devices, str) else list(devices)
    if not entries:
        msg = "devices is empty"
        raise ValueError(msg)
    return [_one_group(d) if isinstance(d, tuple) else _one(d) for d in entries]


def check_fits(chain: Chain, resources: dict[str, float]) -> None:
    """Every pool's actors at once: pools run together, so together they must fit.

    Raises:
        ValueError: the pools together ask for more CPUs or GPUs than the cluster has (Ray
            would wait forever for an actor it cannot place).
    """
    for unit, need in _needs(chain.peak).items():
        have = int(resources.get(unit, 0))
        if need > have:
            each = ", ".join(f"{h.name}: {_needs(h.devices)[unit]}" for h in chain.hops)
            per = "one CPU each" if unit == "CPU" else "one GPU each, a group's GPUs counted"
            msg = (
                f"the pools together ask for {need} {unit} actor(s) ({each}; {per}), and the "
                f"Ray cluster has {have} {unit}(s): ask for fewer, or add nodes "
                "(ray start --address=...)"
            )
            raise ValueError(msg)


def _needs(devices: Sequence[str]) -> dict[str, int]:
    """The CPUs and GPUs that actors of ``devices`` hold together."""
    return {"CPU": devices.count("cpu"), "GPU": sum(map(_gpus_of, devices))}


def _one_group(entry: tuple[Any, ...]) -> str:
    """A tuple of GPUs for one actor: ``"cuda*k"``, an actor with ``num_gpus=k`` (Ray makes
    it see those GPUs only, as ``cuda:0`` .. ``cuda:k-1``)."""
    if not entry or any(_one(d) != "cuda" for d in entry):
        msg = f"a device group holds GPUs only, such as ('cuda:0', 'cuda:1'); got {entry!r}"
        raise ValueError(msg)
    return "cuda" if len(entry) == 1 else f"cuda*{len(entry)}"


def _gpus_of(device: str) -> int:
    """GPUs an actor of ``device`` holds: ``"cuda"`` 1, ``"cuda*k"`` k, ``"cpu"`` 0."""
    return 0 if device == "cpu" else int(device.partition("*")[2] or 1)


def _one(device: Any) -> str:
    text = str(device)
    if text in ("cpu", "cuda") or text.startswith("cuda:"):
        return text.partition(":")[0]
    msg = f"unknown device {device!r} for engine='ray' (use 'cpu', 'cuda' or an int)"
    raise ValueError(msg)


def _keeps(hop: Any) -> bool:
    """Whether a pool keeps something in its workers: an ``init``, an ``end``, a sink."""
    return any(
        getattr(st, "is_sink", False) is True or st.has_init or st.end is not None
        for st in hop.stages
    )


@functools.cache
def _remote(fn: Any, **options: Any) -> Any:
    """``fn`` as a Ray actor class or remote function (made once per process)."""
    return ray.remote(**options)(fn)


class RayEngine:
    """A chain's hops as groups of Ray actors (see the module docstring)."""

    in_caller = False

    def __init__(
        self,
        pipeline: PipelineDef,
        devices: Any,
        cfg: CfgNode,
        concurrency: int = 1,
        tasks: bool = False,
        cpus: int | None = None,
    ) -> None:
        _connect()
        try:
            resources = ray.cluster_resources()  # type: ignore[no-untyped-call]
            parse = functools.partial(ray_devices, resources=resources)
            cpus = int(resources.get("CPU", 1)) if cpus is None else cpus
            self.chain: Chain = plan_chain(pipeline, devices, parse, concurrency, cpus)
            check_fits(self.chain, resources)
        except BaseException:
            _disconnect()
            raise
        self.connected = True
        self.cfg = cfg
        # Pools run as Ray tasks rather than actors (``tasks``: the run keeps no worker
        # state: no timeout clock, no recycling): those on CPUs whose stages have neither
        # ``init`` nor ``end``, so that nothing is lost by not keeping a process.
        # A pool that waits (``concurrency=k``, async stages) runs on actors that take several
        # chunks at once (a task holds one: its slots would empty with its slowest unit); so
        # does a pool fed by another: an actor queues a chunk still being made upstream (Ray
        # runs it once its input is ready), a slot of tasks takes one chunk at a time and
        # idles while the driver hears of each (W8 on Ray: 3.5-4.0 s as tasks, 3.15 s).
        self.waits = [
            h.concurrency > 1 or any(is_async_fn(getattr(st, "fn", None)) for st in h.stages)
            for h in self.chain.hops
        ]
        self.as_tasks = [
            tasks and h.index == 0 and not waits and set(h.devices) == {"cpu"} and not _keeps(h)
            for h, waits in zip(self.chain.hops, self.waits, strict=True)
        ]
        self.pools: list[list[Actor]] = []
        self.payloads: list[bytes] = []
        self.tag = ""  # names this start's task pools (see _task_sender)
        self.last_run: RayRun | None = None
        self.trace = Trace(None)  # (the runner's, with trace=)
        self.balancer = Balancer(self.chain) if self.chain.sizing else None
        self.clock: Any = None  # the UnitClock actor, while started
        self.next_key = itertools.count()  # actors' names at the clock
        self.timeout: float | None = None  # the current run's (actors watch for it)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start every actor and run every ``init``.

        Raises:
            SerializationError: a stage function or ``cfg`` cannot be pickled.
            WorkerError: an ``init`` raised (no actor is left).
            WorkerDied: an actor died while starting, or could not be placed in time.
        """
        if not self.connected:
            _connect()
            self.connected = True
        # A task pool's name, new with each start: a Ray worker keeps the bodies it prepared
        # by that name, and must never run one pool's chunk with another's stages (an id()
        # or a counter can come back: another engine at the same address, a second driver).
        self.tag = os.urandom(8).hex()
        try:
            self.payloads = []
            for h in self.chain.hops:  # pickled once for the pool's actors
                try:
                    self.payloads.append(pack_payload(h.stages, self.cfg))
                except Exception as exc:
                    msg = f"the producers {h.name!r} or cfg cannot be pickled to reach the actors"
                    raise SerializationError(msg) from exc
            self.pools = [  # (a self-sizing pool: its first size)
                [self._new_actor(hop.index, k, d) for k, d in enumerate(hop.devices[: hop.size])]
                for hop in self.chain.hops
            ]
            self._await_started([a for pool in self.pools for a in pool if not a.lone])
        except BaseException:
            self.stop(grace=0.0, report=False)
            raise

    def _new_actor(self, hop: int, index: int, device: str) -> Actor:
        h = self.chain.hops[hop]
        actor = Actor(hop=hop, index=index, device=device, concurrency=h.concurrency)
        if self.as_tasks[hop]:
            actor.run, actor.lone = self._task_sender(hop, index), True
            return actor
        gpus = _gpus_of(device)
        opts: dict[str, Any] = {"num_gpus": gpus} if gpus else {"num_cpus": 1}
        if self.waits[hop]:
            # chunks at once, on threads of the actor: a slot that one chunk's slow unit
            # leaves free takes the next chunk's unit (the stages' loop, or their k threads,
            # are the actor's, shared by all); each chunk running holds a unit in a slot or
            # waits for one, so k + 1 of them keep the k slots full
            opts["max_concurrency"] = h.concurrency + 1
        actor.key = next(self.next_key)
        # (no concurrency groups: with any, Ray runs every task off the actor's main thread)
        cls = _remote(StageActor, max_restarts=0, max_task_retries=0).options(**opts)
        seen = "cpu" if device == "cpu" else "cuda:0"  # (Ray shows it its GPUs from cuda:0)
        args = (self.payloads[hop], sys.path, seen, index, hop, h.batch, self.clock)
        actor.handle = cls.remote(*args, actor.key, self.timeout, h.concurrency)
        actor.run = actor.handle.run.options(num_returns=2).remote
        return actor

    def _task_sender(self, hop: int, index: int) -> Callable[..., Any]:
        """What sends a chunk of worker ``index`` of task pool ``hop`` (see ``run_task``:
        one CPU, two returns, values and meta, no retries by Ray: the run's books charge
        them)."""
        h = self.chain.hops[hop]
        fn = _remote(run_task, num_cpus=1, num_returns=2, max_retries=0)
        # A small payload goes inline with each task (Ray would fetch a reference from this
        # process before every task); a big one once to the object store.
        payload: Any = self.payloads[hop]
        if len(payload) > INLINE_PAYLOAD:
            payload = ray.put(payload)
        pool = f"{self.tag}-{hop}"

        def send(*run_args: Any) -> Any:  # (its units come Packed: see run_task)
            args = (pool, payload, sys.path, index, hop, h.batch, h.concurrency)
            return fn.remote(*args, *run_args)

        return send

    def _failed(self, actor: Actor, what: str, report: ErrorReport | None = None) -> Exception:
        """The error of ``actor`` whose ``init`` or ``end`` raised (``report``; ``what``:
        while doing what), or that ``what`` (died, was not placed)."""
        if report is not None:
            where = f"{what} ({actor.where})"
            return report.to_error(what=where, device=actor.device, worker=actor.index, index=None)
        msg = f"{actor.describe(self.chain)} {what}"
        return WorkerDied(msg, actor.device, actor.index, stage=self.chain.hops[actor.hop].name)

    def _await_started(self, actors: Sequence[Actor]) -> None:
        """Run ``start`` (device binding, every ``init``) on new actors and wait for it."""
        refs = [a.handle.start.remote() for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=START_TIMEOUT)
        if len(ready) < len(refs):
            late = actors[next(k for k, r in enumerate(refs) if r not in ready)]
            raise self._failed(
                late,
                f"was not placed and started within {START_TIMEOUT:.0f} s "
                f"(EASYCORE_RAY_START_TIMEOUT); the cluster has {ray.available_resources()} free",  # type: ignore[no-untyped-call]
            )
        for actor, ref in zip(actors, refs, strict=True):
            try:
                report, actor.where = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                raise self._failed(actor, f"died while starting: {first_line(exc)}") from None
            if report is not None:
                raise self._failed(actor, "while starting", report)

    def replace(self, actor: Actor) -> Actor:
        """A fresh actor (its ``init`` run) in ``actor``'s place (never a slot of tasks: no
        death marks one gone, and a pool of tasks recycles none)."""
        _kill([actor])
        if self.clock is not None:
            self.clock.note.remote(actor.key, None)
        fresh = self._new_actor(actor.hop, actor.index, actor.device)
        pool = self.pools[actor.hop]
        pool[pool.index(actor)] = fresh
        self._await_started([fresh])
        return fresh

    def grow(self, hop: int) -> None:
        """One actor more in self-sizing pool ``hop``: it takes chunks once its ``init`` has
        run (:meth:`joined`), the run goes on meanwhile (none once stopped)."""
        if not self.pools:
            return
        pool = self.pools[hop]
        index = min(set(range(len(self.chain.hops[hop].devices))) - {a.index for a in pool})
        fresh = self._new_actor(hop, index, "cpu")
        if not fresh.lone:
            fresh.joining, fresh.starting = True, fresh.handle.start.remote()
            fresh.asked = time.monotonic()
        pool.append(fresh)

    def joined(self) -> None:
        """Actors added to a pool whose ``init`` has run take chunks from now on; those
        leaving it whose ``end`` has run leave.

        Raises:
            WorkerError, WorkerDied: an ``init`` or ``end`` raised, the actor died in it, or
                it was not placed and started within ``START_TIMEOUT``.
        """
        for actor in [a for pool in self.pools for a in pool if a.joining or a.ending]:
            if actor.joining and ray.wait([actor.starting], timeout=0)[0]:
                actor.joining = False
                report, actor.where = self._reply(actor, actor.starting, "starting")
                if report is not None:
                    raise self._failed(actor, "while starting", report)
            elif actor.joining and time.monotonic() - actor.asked > START_TIMEOUT:
                raise self._failed(actor, f"was not placed and started in {START_TIMEOUT:.0f} s")
            if actor.ending and not actor.joining and ray.wait([actor.ending], timeout=0)[0]:
                if (report := self._reply(actor, actor.ending, "ending")) is not None:
                    raise self._failed(actor, "while ending", report)
                self.leave(actor)

    def _reply(self, actor: Actor, ref: Any, what: str) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise self._failed(actor, f"died while {what}: {first_line(exc)}") from None

    def leave(self, actor: Actor) -> None:
        """``actor`` leaves its self-sizing pool (it shrank, or died): killed, not replaced."""
        _kill([actor])
        if self.clock is not None:
            self.clock.note.remote(actor.key, None)
        self.pools[actor.hop].remove(actor)

    def kill_overdue(self, timeout: float) -> list[tuple[Actor, int]]:
        """Kill each busy actor whose unit in hand has run past ``timeout`` (the clock says
        so): [(actor, that unit)]."""
        busy = [a for pool in self.pools for a in pool if a.queue and not a.lone]
        late: dict[int, tuple[int, float]] = {}
        if busy and self.clock is not None:
            with contextlib.suppress(ray.exceptions.RayError):
                late = ray.get(self.clock.overdue.remote(), timeout=5.0)
        killed = [(a, late[a.key][0]) for a in busy if late.get(a.key, (0, 0.0))[1] > timeout]
        _kill([a for a, _ in killed])
        return killed

    def recycle(self, due: Sequence[Any]) -> None:
        """Replace each actor ``due`` for it (``Scheduler.retirees``: it has finished its
        chunks): its ``end``, then a fresh actor's ``init``.

        Raises:
            WorkerError: its ``end`` raised.
        """
        for actor in due:
            if actor.parking and not actor.lone:  # (its pool shrank: it leaves once its
                actor.ending = actor.ending or actor.handle.finish.remote()  # end has run)
                continue
            if not actor.lone:
                with contextlib.suppress(ray.exceptions.RayError):  # (a death there: replaced)
                    if (report := ray.get(actor.handle.finish.remote())) is not None:
                        raise self._failed(actor, "while ending", report)
            if actor.parking:
                self.leave(actor)
            else:
                self.replace(actor)

    def stop(self, grace: float | None, report: bool) -> None:
        """Run ``end`` on every actor (``grace`` seconds at most), then kill them all.

        Raises:
            WorkerError, WorkerDied: (``report``) an ``end`` raised or an actor died in it.
        """
        every = [a for pool in self.pools for a in pool if not a.lone]
        actors = [a for a in every if not a.gone]
        self.pools = []
        failure: BaseException | None = None
        try:
            # (an actor still joining its pool: its end only if it was placed and started,
            # which a run that fails does not wait for; one leaving: the end it is running)
            joining = [a.starting for a in actors if a.joining]
            wait = START_TIMEOUT if grace is None else 0.0
            started = (
                ray.wait(joining, num_returns=len(joining), timeout=wait)[0] if joining else []
            )
            actors = [a for a in actors if not a.joining or a.starting in started]
            refs = [a.ending or a.handle.finish.remote() for a in actors]
            ready = _wait_for_ends(actors, refs, grace)
            for actor, ref in zip(actors, refs, strict=True):
                if ref in ready and failure is None:
                    try:
                        if (ended := ray.get(ref)) is not None:
                            failure = self._failed(actor, "while ending", ended)
                    except ray.exceptions.RayError as exc:
                        failure = self._failed(actor, f"died while ending: {first_line(exc)}")
        finally:
            _kill(every)
            if self.clock is not None:
                with contextlib.suppress(Exception):
                    ray.kill(self.clock, no_restart=True)
            self.clock, self.timeout = None, None
            if self.connected:
                self.connected = False
                _disconnect()
        if report and failure is not None:
            raise failure

    def _watch_for(self, timeout: float | None) -> None:
        """Tell every actor the ``timeout`` of the run about to start (before its tasks),
        and the clock to tell when a unit passes it (started for the first timed run)."""
        if timeout is not None and self.clock is None:
            self.clock = _remote(UnitClock, num_cpus=0, max_restarts=0, max_task_retries=0).remote()
        elif timeout == self.timeout:
            return
        self.timeout = timeout
        told = []
        for a in [a for pool in self.pools for a in pool if not (a.lone or a.gone)]:
            ref = a.handle.watch.remote(timeout, self.clock)
            if self.waits[a.hop]:
                told.append(ref)
        # (an actor that runs chunks at once runs its tasks in no set order: it knows
        # the timeout before any chunk is sent; one that died is found by the run)
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(told)

    @property
    def books(self) -> RunBooks | None:
        return None if self.last_run is None else self.last_run.books

    def stats(self) -> list[StageStats]:
        return idle_stats(self.chain) if self.last_run is None else self.last_run.stats()

    # -- runs --------------------------------------------------------------------------------
    def stream(
        self,
        data: Iterable[Any] | Source,
        options: RunOptions,
        *,
        bars: list[Any] | None = None,
        policy: ErrorPolicy = RAISE,
        is_current: Callable[[], bool] = lambda: True,
    ) -> Iterator[Any]:
        """PRIMED, then the run's segments (``outcomes.Segment``)."""
        self._watch_for(options.timeout)
        run = RayRun(self, source_of(data), options, bars, policy)
        self.last_run = run
        yield from run.books.stream(run, is_current)
