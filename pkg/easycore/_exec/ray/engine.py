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
* A one-shot run with no ``timeout`` and no recycling runs a CPU pool whose stages have no
  ``init`` and no ``end`` as plain Ray tasks (``actor.run_task``), not actors: Ray
  starts a task on a warm worker in milliseconds, where an actor needs a new process (about
  0.4 s), and such a pool keeps nothing an actor would hold. Each of its workers is then a
  slot of tasks (what ``worker`` injects); a task's death names its chunk, charged as an
  actor's would be, and Ray's own retries are off. A task gets its units pickled or as a
  reference it reads itself (``actor.Packed``, ``Later``): Ray unpickles a task's
  arguments before it runs, before the driver's ``sys.path`` is added there.
* Ctrl-C or an error: actors' queued tasks are cancelled, ``end`` gets a short grace,
  every actor is killed (a plain task already sent finishes its chunk unseen: Ray's cancel
  of a normal task can abort the driver when it races the task's reply); a Ray this
  engine started is shut down (one the user started is left running).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import cloudpickle

from easycore._config.cfgnode import CfgNode
from easycore._errors import (
    SerializationError,
    WorkerDied,
)
from easycore._exec.core.books import RAISE, ErrorPolicy
from easycore._exec.core.plan import (
    Chain,
    PipelineDef,
    StageStats,
    idle_stats,
    pack_payload,
    plan_chain,
)
from easycore._exec.core.protocol import PROTOCOL
from easycore._exec.core.sources import Source, source_of
from easycore._exec.core.stages import UNIT_GRACE, is_async_fn
from easycore._exec.ray.actor import Later, Packed, StageActor, UnitClock, run_task
from easycore._exec.ray.ledger import Actor, first_line, ray_module
from easycore._exec.ray.run import RayRun
from easycore._options import RunOptions
from easycore._reaping import descendants

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
    ray = ray_module()

    if not ray.is_initialized():
        import socket  # (here, to keep the connection code in this one function)

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
        ray.init(include_dashboard=False, log_to_driver=True, logging_level="WARNING")
        _OWNED = True
    _USERS += 1


def _disconnect() -> None:
    """The runner is done with Ray: shut down a Ray this module started, after its last user."""
    global _USERS, _OWNED
    ray = ray_module()

    _USERS = max(0, _USERS - 1)
    if _USERS == 0 and _OWNED:
        _OWNED = False
        with contextlib.suppress(Exception):
            ray.shutdown()


def _kill(actors: Sequence[Actor]) -> None:
    """Kill actors now, and what their work started on this machine (found first: killed,
    an actor leaves its children to the raylet; those that left its session too)."""
    ray = ray_module()

    here = {p for a in actors if a.where is not None and (p := a.where.pid) and _local(p)}
    below = descendants(here) if here else []
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor.handle, no_restart=True)
    for pid in below:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _wait_for_ends(actors: Sequence[Actor], refs: list[Any], grace: float | None) -> list[Any]:
    """Wait for the ``end`` of each actor (``refs``): ``grace`` seconds at most, and only
    UNIT_GRACE for those whose run was cancelled mid-work (their ``end`` waits behind a
    unit that may not finish soon, as a local worker's does). The refs that are ready."""
    ray = ray_module()

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
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(b"ray::StageActor")
    except OSError:
        return False


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
        out = [_one_group(d) if isinstance(d, tuple) else _one(d) for d in entries]
        if not out:
            msg = "devices is empty"
            raise ValueError(msg)
    need_cpu, need_gpu = out.count("cpu"), sum(_gpus_of(d) for d in out)
    if need_gpu > gpus:
        msg = f"{need_gpu} GPU(s) asked for by the actors, and the Ray cluster has {gpus} GPU(s)"
        raise ValueError(msg)
    if need_cpu > cpus:
        msg = (
            f"{need_cpu} CPU actor(s) asked for (one CPU each), and the Ray cluster has "
            f"{cpus} CPU(s): ask for fewer, or add nodes (ray start --address=...)"
        )
        raise ValueError(msg)
    return out


def check_fits(chain: Chain, resources: dict[str, float]) -> None:
    """Every pool's actors at once: pools run together, so together they must fit.

    Raises:
        ValueError: the pools together ask for more CPUs or GPUs than the cluster has (Ray
            would wait forever for an actor it cannot place).
    """
    devices = chain.devices
    for kind, unit in (("cpu", "CPU"), ("cuda", "GPU")):

        def count(ds: tuple[str, ...], kind: str = kind) -> int:
            return ds.count("cpu") if kind == "cpu" else sum(_gpus_of(d) for d in ds)

        need, have = count(devices), int(resources.get(unit, 0))
        if need > have:
            each = ", ".join(f"{h.name}: {count(h.devices)}" for h in chain.hops)
            msg = (
                f"the pools together ask for {need} {unit} actor(s) ({each}), and the Ray "
                f"cluster has {have} {unit}(s): ask for fewer, or add nodes"
            )
            raise ValueError(msg)


def _one_group(entry: tuple[Any, ...]) -> str:
    """A tuple of GPUs for one actor: ``"cuda*k"``, an actor with ``num_gpus=k`` (Ray makes
    it see those GPUs only, as ``cuda:0`` .. ``cuda:k-1``)."""
    if not entry or any(_one(d) != "cuda" for d in entry):
        msg = f"a device group holds GPUs only, such as ('cuda:0', 'cuda:1'); got {entry!r}"
        raise ValueError(msg)
    return "cuda" if len(entry) == 1 else f"cuda*{len(entry)}"


def _gpus_of(device: str) -> int:
    """GPUs an actor of ``device`` holds: ``"cuda"`` 1, ``"cuda*k"`` k, ``"cpu"`` 0."""
    if device == "cuda":
        return 1
    return int(device[5:]) if device.startswith("cuda*") else 0


def _one(device: Any) -> str:
    text = str(device)
    if text == "cpu":
        return "cpu"
    if text == "cuda" or text.startswith("cuda:"):
        return "cuda"
    msg = f"unknown device {device!r} for engine='ray' (use 'cpu', 'cuda' or an int)"
    raise ValueError(msg)


def _actor_class() -> Any:
    """StageActor as a Ray actor class (made once per process). No concurrency groups: with
    any, Ray runs every task off the actor's main thread."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        ray = ray_module()

        _ACTOR_CLASS = ray.remote(max_restarts=0, max_task_retries=0)(StageActor)
    return _ACTOR_CLASS


def _task_function() -> Any:
    """``run_task`` as a Ray remote function (made once per process): one CPU, two returns
    (values, meta), no retries by Ray (the run's books charge them)."""
    global _TASK_FUNCTION
    if _TASK_FUNCTION is None:
        ray = ray_module()

        _TASK_FUNCTION = ray.remote(num_cpus=1, num_returns=2, max_retries=0)(run_task)
    return _TASK_FUNCTION


def _clock_class() -> Any:
    """UnitClock as a Ray actor class (made once per process)."""
    global _CLOCK_CLASS
    if _CLOCK_CLASS is None:
        ray = ray_module()

        _CLOCK_CLASS = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(UnitClock)
    return _CLOCK_CLASS


_ACTOR_CLASS: Any = None
_CLOCK_CLASS: Any = None
_TASK_FUNCTION: Any = None


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
    ) -> None:
        ray = ray_module()

        _connect()
        try:
            resources = ray.cluster_resources()
            self.chain: Chain = plan_chain(
                pipeline,
                devices,
                parse=lambda d: ray_devices(d, resources),
                concurrency=concurrency,
            )
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
        # chunks at once (a task holds one: its slots would empty with its slowest unit).
        self.waits = [
            h.concurrency > 1 or any(is_async_fn(getattr(st, "fn", None)) for st in h.stages)
            for h in self.chain.hops
        ]
        self.as_tasks = [
            tasks
            and not waits
            and set(h.devices) == {"cpu"}
            and not any(
                getattr(st, "is_sink", False) is True or st.has_init or st.end is not None
                for st in h.stages
            )
            for h, waits in zip(self.chain.hops, self.waits, strict=True)
        ]
        self.pools: list[list[Actor]] = []
        self.payloads: list[bytes] = []
        self.tag = ""  # names this start's task pools (see _task_sender)
        self.last_run: RayRun | None = None
        self.clock: Any = None  # the UnitClock actor, while started
        self.keys: dict[Actor, int] = {}  # each actor's name at the clock
        self.next_key = itertools.count()
        self.timeout: float | None = None  # the current run's (actors watch for it)

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
        # A task pool's name, new with each start: a Ray worker keeps the bodies it prepared
        # by that name, and must never run one pool's chunk with another's stages (an id()
        # or a counter can come back: another engine at the same address, a second driver).
        self.tag = os.urandom(8).hex()
        try:
            self.payloads = [self._payload(hop.index) for hop in self.chain.hops]
            self.pools = [
                [self._new_actor(hop.index, k, dev) for k, dev in enumerate(hop.devices)]
                for hop in self.chain.hops
            ]
            self._await_started([a for pool in self.pools for a in pool if a.task is None])
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
            payload: bytes = pack_payload(h.stages, self.cfg)
        except Exception as exc:
            msg = f"the producers {h.name!r} or cfg cannot be pickled; actors receive them pickled"
            raise SerializationError(msg) from exc
        return payload

    def _new_actor(self, hop: int, index: int, device: str) -> Actor:
        h = self.chain.hops[hop]
        if self.as_tasks[hop]:
            return Actor(
                hop=hop,
                index=index,
                device=device,
                handle=None,
                task=self._task_sender(hop, index),
                lone=True,
            )
        gpus = _gpus_of(device)
        opts: dict[str, Any] = {"num_gpus": gpus} if gpus else {"num_cpus": 1}
        if self.waits[hop]:
            # chunks at once, on threads of the actor: a slot that one chunk's slow unit
            # leaves free takes the next chunk's unit (the stages' loop, or their k threads,
            # are the actor's, shared by all); each chunk running holds a unit in a slot or
            # waits for one, so k + 1 of them keep the k slots full
            opts["max_concurrency"] = h.concurrency + 1
        entropy = int.from_bytes(os.urandom(8), "little") >> 1
        key = next(self.next_key)
        handle = (
            _actor_class()
            .options(**opts)
            .remote(
                self.payloads[hop],
                sys.path,
                device,
                index,
                hop,
                entropy,
                h.batch,
                self.clock,
                key,
                self.timeout,
                h.concurrency,
            )
        )
        actor = Actor(hop=hop, index=index, device=device, handle=handle, concurrency=h.concurrency)
        self.keys[actor] = key
        return actor

    def _task_sender(self, hop: int, index: int) -> Callable[..., Any]:
        """What sends a chunk of worker ``index`` of task pool ``hop`` (see ``run_task``)."""
        ray = ray_module()

        h = self.chain.hops[hop]
        fn = _task_function()
        # A small payload goes inline with each task (Ray would fetch a reference from this
        # process before every task); a big one once to the object store.
        payload: Any = self.payloads[hop]
        if len(payload) > INLINE_PAYLOAD:
            payload = ray.put(payload)
        pool = f"{self.tag}-{hop}"

        def send(units: Any, *run_args: Any) -> Any:
            # (read in the task once the driver's sys.path is there: see run_task)
            if isinstance(units, ray.ObjectRef):
                units = Later(units)
            elif type(units) is not Packed:
                units = Packed(len(units), cloudpickle.dumps(list(units), PROTOCOL))
            args = (pool, payload, sys.path, index, hop, h.batch, h.concurrency)
            return fn.remote(*args, units, *run_args)

        return send

    def _await_started(self, actors: Sequence[Actor]) -> None:
        """Run ``start`` (device binding, every ``init``) on new actors and wait for it."""
        ray = ray_module()

        refs = [a.handle.start.remote() for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=START_TIMEOUT)
        if len(ready) < len(refs):
            late = actors[next(k for k, r in enumerate(refs) if r not in ready)]
            msg = (
                f"{late.describe(self.chain)} was not placed and started within "
                f"{START_TIMEOUT:.0f} s (EASYCORE_RAY_START_TIMEOUT); the cluster has "
                f"{ray.available_resources()} free"
            )
            raise WorkerDied(msg, late.device, late.index, stage=self.chain.hops[late.hop].name)
        for actor, ref in zip(actors, refs, strict=True):
            try:
                report, actor.where = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                msg = f"{actor.describe(self.chain)} died while starting: {first_line(exc)}"
                stage = self.chain.hops[actor.hop].name
                raise WorkerDied(msg, actor.device, actor.index, stage=stage) from None
            if report is not None:
                raise report.to_error(
                    what=f"while starting ({actor.where})",
                    device=actor.device,
                    worker=actor.index,
                    index=None,
                )

    def replace(self, actor: Actor, kill: bool = True) -> Actor:
        """A fresh actor (its ``init`` run) in ``actor``'s place (a task slot stays)."""
        if actor.task is not None:
            return actor
        if kill:
            _kill([actor])
        key = self.keys.pop(actor, None)
        if key is not None and self.clock is not None:
            self.clock.clear.remote(key)
        fresh = self._new_actor(actor.hop, actor.index, actor.device)
        self.pools[actor.hop][actor.index] = fresh
        self._await_started([fresh])
        return fresh

    def kill_overdue(self, timeout: float) -> list[tuple[Actor, int]]:
        """Kill each busy actor whose unit in hand has run past ``timeout`` (its clock
        says so): [(actor, that unit)]."""
        busy = [a for pool in self.pools for a in pool if a.queue and a.task is None]
        killed = []
        for actor, held in zip(busy, self.overdue(busy), strict=True):
            if held is not None and held[1] > timeout:
                _kill([actor])
                killed.append((actor, held[0]))
        return killed

    def recycle(self, due: Sequence[Any]) -> None:
        """Replace each actor ``due`` for it (``Scheduler.retirees``: it has finished its
        chunks): its ``end``, then a fresh actor's ``init``.

        Raises:
            WorkerError: its ``end`` raised.
        """
        ray = ray_module()

        for actor in due:
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
            self.replace(actor)

    def stop(self, grace: float | None, report: bool) -> None:
        """Run ``end`` on every actor (``grace`` seconds at most), then kill them all.

        Raises:
            WorkerError, WorkerDied: (``report``) an ``end`` raised or an actor died in it.
        """
        ray = ray_module()

        every = [a for pool in self.pools for a in pool if a.task is None]
        actors = [a for a in every if not a.gone]
        self.pools = []
        failure: BaseException | None = None
        try:
            refs = [a.handle.finish.remote() for a in actors]
            ready = _wait_for_ends(actors, refs, grace)
            for actor, ref in zip(actors, refs, strict=True):
                if ref not in ready or failure is not None:
                    continue
                try:
                    ended = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    msg = f"{actor.describe(self.chain)} died while ending: {first_line(exc)}"
                    stage = self.chain.hops[actor.hop].name
                    failure = WorkerDied(msg, actor.device, actor.index, stage=stage)
                    continue
                if ended is not None:
                    failure = ended.to_error(
                        what=f"while ending ({actor.where})",
                        device=actor.device,
                        worker=actor.index,
                        index=None,
                    )
        finally:
            _kill(every)
            if self.clock is not None:
                with contextlib.suppress(Exception):
                    ray.kill(self.clock, no_restart=True)
            self.clock, self.timeout = None, None
            self.keys.clear()
            if self.connected:
                self.connected = False
                _disconnect()
        if report and failure is not None:
            raise failure

    def overdue(self, actors: Sequence[Actor]) -> list[tuple[int, float] | None]:
        """Per actor: (its unit in hand, seconds run) when that unit has passed the run's
        ``timeout``, else None."""
        ray = ray_module()

        late: dict[int, tuple[int, float]] = {}
        if actors and self.clock is not None:
            with contextlib.suppress(ray.exceptions.RayError):
                late = ray.get(self.clock.overdue.remote(), timeout=5.0)
        return [late.get(self.keys.get(a, -1)) for a in actors]

    def _watch_for(self, timeout: float | None) -> None:
        """Tell every actor the ``timeout`` of the run about to start (before its tasks),
        and the clock to tell when a unit passes it (started for the first timed run)."""
        if timeout is not None and self.clock is None:
            self.clock = _clock_class().remote()
        elif timeout == self.timeout:
            return
        self.timeout = timeout
        told = []
        for a in [a for pool in self.pools for a in pool if a.task is None and not a.gone]:
            ref = a.handle.watch.remote(timeout, self.clock)
            if self.waits[a.hop]:
                told.append(ref)
        # (an actor that runs chunks at once runs its tasks in no set order: it knows
        # the timeout before any chunk is sent; one that died is found by the run)
        ray = ray_module()
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(told)

    def stats(self) -> list[StageStats]:
        if self.last_run is None:
            return idle_stats(self.chain)
        return self.last_run.stats()

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
