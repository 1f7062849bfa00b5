"""The worker processes of a runner: spawn, respawn, pair across hops, wait on, stop.

A :class:`WorkerSet` owns the processes of every hop (one per device) and their pipes. It
knows nothing of chunks: it reads what workers send and hands each message (or a death) to
whoever runs, and it starts, replaces and stops processes.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.sharedctypes import RawArray
from typing import Any

import attrs
import cloudpickle

from easycore._config.cfgnode import CfgNode
from easycore._devices import cpu_count
from easycore._errors import SerializationError, WorkerDied, WorkerError, describe_exitcode
from easycore._exec.core.plan import Chain, Hop, pack_payload
from easycore._exec.core.protocol import (
    IDLE,
    SLOT_WIDTH,
    STOP,
    AddPeer,
    Ended,
    EndFailed,
    InitFailed,
    Ready,
    Slots,
)
from easycore._exec.core.scheduler import Place
from easycore._exec.core.stages import UNIT_GRACE
from easycore._exec.process.channel import Channel
from easycore._exec.process.startup import (
    context,
    descriptors,
    kill_all,
    kill_workers,
    note_torch,
    start_worker,
)
from easycore._exec.process.worker_loop import WorkerSpec, worker_main

__all__ = ["Worker", "WorkerSet"]


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def poller(fds: Sequence[int]) -> Any:
    """A ``select.poll`` object watching ``fds`` for input."""
    poll = select.poll()
    for fd in fds:
        poll.register(fd, select.POLLIN)
    return poll


@attrs.define(eq=False, kw_only=True)
class Worker(Place):
    """One worker process as the caller sees it (the chunks it has: :class:`Place`)."""

    slot: int  # global: its place in the worker set and in the shared slots
    device: str
    proc: Any
    chan: Channel
    ready: bool = False
    timed_out: int | None = None  # index of the unit we killed it for
    stopping: bool = False  # told to end (retiring): its goodbye brings a fresh worker
    parked: bool = False  # no process: a place of a self-sizing pool beyond its size
    last_nbytes: int = 0  # size of the last reply (pickle + shared memory), for chunk sizing

    def resident_bytes(self) -> int:
        """Its own resident memory now: pages it shares with the process it was forked
        from (the caller, or a forkserver) are not counted, so a worker forked from a caller
        that holds gigabytes is not over the bound at birth (0 when it cannot be read)."""
        try:
            with open(f"/proc/{self.proc.pid}/smaps_rollup", "rb") as f:
                lines = f.read().splitlines()
            return 1024 * sum(int(ln.split()[1]) for ln in lines if ln.startswith(b"Private_"))
        except (OSError, ValueError, IndexError):
            pass
        try:  # (a kernel without smaps_rollup: all it has, shared pages included)
            with open(f"/proc/{self.proc.pid}/statm", "rb") as f:
                return int(f.read().split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            return 0


class _Waiter:
    """``multiprocessing.connection.wait`` for file descriptors, without a selector per call.

    The run loop waits once per message; building and filling a selector each time cost
    more than handling a small message. One ``poll`` object is kept while the set of
    descriptors stays the same.
    """

    def __init__(self) -> None:
        self._fds: tuple[int, ...] = ()
        self._poll: Any = None
        self._lock = threading.Lock()  # a poll object cannot be used by two threads at once

    def wait(self, fds: Sequence[int], timeout: float | None) -> set[int]:
        """The descriptors of ``fds`` that are readable (or closed), waiting up to ``timeout`` s."""
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        key = tuple(fds)
        if not self._lock.acquire(blocking=False):
            return {fd for fd, _ in poller(key).poll(ms)}
        try:
            if key != self._fds or self._poll is None:
                self._poll, self._fds = poller(key), key
            return {fd for fd, _ in self._poll.poll(ms)}
        finally:
            self._lock.release()


_LIVE: weakref.WeakSet[WorkerSet] = weakref.WeakSet()  # every worker set of this process
os.register_at_fork(after_in_child=_LIVE.clear)  # (a forked child's are none)


def _caller_ends() -> list[int]:
    """This process's ends of the pipes of all its workers (every runner's): a worker forked
    from here lets go of its copies, or a worker would not see EOF when the caller dies."""
    fds = []
    for ws in list(_LIVE):
        for w in ws.workers:
            if w.parked:
                continue
            with contextlib.suppress(OSError, ValueError):
                fds += [w.chan.fileno(), w.chan.sock.fileno()]  # (the channel reads a dup)
    return [fd for fd in fds if fd >= 0]


def _culprit_of(stages: Sequence[Any], cfg: CfgNode) -> str:
    roles = (("work function", "fn"), ("init", "init"), ("end", "end"))
    parts = [(f"the {r} of stage {s.name!r}", getattr(s, a)) for s in stages for r, a in roles]
    for name, obj in [*parts, ("cfg", cfg)]:
        try:
            cloudpickle.dumps(obj)
        except Exception as exc:
            return f"{name} cannot be pickled: {exc}"
    return "the pipeline cannot be pickled"


# A handler of what a worker sent: (worker, message), or (worker, None) once it is gone.
Handler = Callable[[Worker, Any], None]


class WorkerSet:
    """Every worker process of a runner, over all hops, by global slot."""

    slots: Slots  # the workers' shared slots (from start on)

    def __init__(self, chain: Chain, cfg: CfgNode, start_method: str | None) -> None:
        self.chain = chain
        self.cfg = cfg
        self.start_method = start_method
        self.workers: list[Worker] = []
        self._pairs: dict[tuple[int, int], int] = {}  # (from slot, to slot) -> pipe key
        self._pair_keys = itertools.count()
        self._waiter = _Waiter()
        self._finalizer = weakref.finalize(self, kill_all, [])  # (see _watch)
        self.descriptors: dict[int, tuple[int, int, int]] = {}  # opened to start its workers
        _LIVE.add(self)

    # -- start -----------------------------------------------------------------------------
    def start(self, wait: bool) -> None:
        """Pickle each hop's stages and ``cfg`` once, for every worker of the hop, and start
        one process per device; with ``wait``, wait until every worker has run its ``init``.

        Raises:
            SerializationError: a stage function or ``cfg`` cannot be pickled.
            WorkerError: an ``init`` raised (``wait``).
            WorkerDied: a worker died while starting (``wait``).
        """
        for hop in self.chain.hops:
            try:
                hop.payload = pack_payload(hop.stages, self.cfg)
            except Exception as exc:
                culprit = _culprit_of(hop.stages, self.cfg)
                msg = f"{culprit}; workers receive their functions pickled"
                raise SerializationError(msg) from exc
        self.slots = Slots(RawArray("d", SLOT_WIDTH * len(self.chain.devices)))
        self.workers = []
        self._pairs.clear()
        for hop in self.chain.hops:  # (a self-sizing pool: its first size)
            for k in range(len(hop.devices)):
                slot = hop.first_slot + k
                self.workers.append(self._spawn(slot) if k < hop.size else self._parked(slot))
        self._watch()
        while wait and not all(w.ready or w.parked for w in self.workers):
            self.wait_and_handle(None, None)

    def _spawn(self, slot: int) -> Worker:
        device = self.chain.devices[slot]
        hop = next(h for h in reversed(self.chain.hops) if slot >= h.first_slot)
        index = slot - hop.first_slot
        env_set = any(k in os.environ for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"))
        threads = None if env_set else max(1, cpu_count() // len(self.chain.devices))
        # asked again at each start: a respawn forks only if the caller still may. GPU
        # workers never fork: a caller that only asked torch.cuda.is_available() has
        # started the CUDA driver, which a forked child cannot start again
        one_pool_of_cpus = len(self.chain.hops) == 1 and "cuda" not in " ".join(self.chain.devices)
        # the descriptors this process opened to start its workers (pipes, sentinels) do not
        # stand in the way of a fork
        own = {fd: ident for ws in list(_LIVE) for fd, ident in ws.descriptors.items()}
        ctx = context(self.start_method, one_pool_of_cpus, own)
        method = ctx.get_start_method()
        before = descriptors() if method == "fork" else {}
        parent, child = ctx.Pipe(duplex=True)
        spec = WorkerSpec(
            slot=slot,
            worker=index,
            device=device,
            threads=threads,
            payload=hop.payload,
            entropy=int.from_bytes(os.urandom(8), "little") >> 1,
            hop=hop.index,
            last=hop is self.chain.last,
            group=hop.batch,
            unit=hop.unit,
            concurrency=hop.concurrency,
            # forked: it lets go of the caller's ends of every worker's pipe; else it sees
            # this process's environment, as a forked one does
            release=(parent.fileno(), *_caller_ends()) if method == "fork" else (),
            environ=None if method == "fork" else dict(os.environ),
        )
        proc = ctx.Process(
            target=worker_main,
            args=(child, self.slots.raw, spec),
            name=f"easycore-worker-{slot}-{device}",
            daemon=True,
        )
        start_worker(proc, method, self.chain.devices)
        child.close()
        self.slots.reset(slot)
        worker = Worker(
            slot=slot,
            index=index,
            hop=hop.index,
            device=device,
            proc=proc,
            chan=Channel(parent),
            concurrency=hop.concurrency,
            unit=hop.unit,
        )
        if method == "fork":  # (a forkserver's connection is not a fork's to hold)
            # (those of buried workers, closed since, are dropped)
            self.descriptors = {
                fd: ident
                for fd, ident in descriptors().items()
                if before.get(fd) != ident or self.descriptors.get(fd) == ident
            }
        return worker

    def respawn(self, slot: int) -> None:
        """Replace the (dead) worker in ``slot`` by a fresh one, which runs ``init`` again;
        one that was leaving its self-sizing pool (``parking``) is not replaced."""
        self._pairs = {pair: key for pair, key in self._pairs.items() if slot not in pair}
        self.workers[slot] = self._parked(slot) if self.workers[slot].parking else self._spawn(slot)
        self._watch()

    def grow(self, hop: Hop) -> None:
        """One worker more in self-sizing pool ``hop`` (it takes work once its init ran;
        none once stopped)."""
        slot = next((w.slot for w in self.of_hop(hop) if w.parked), None)
        if slot is None:
            return
        self.respawn(slot)
        self.workers[slot].joining = True

    def _parked(self, slot: int) -> Worker:
        hop = next(h for h in reversed(self.chain.hops) if slot >= h.first_slot)
        index = slot - hop.first_slot
        return Worker(
            slot=slot,
            index=index,
            hop=hop.index,
            device="cpu",
            proc=None,
            chan=None,  # type: ignore[arg-type]
            gone=True,
            parked=True,
        )

    def _watch(self) -> None:
        # If the runner is dropped without close(), its processes are killed, not orphaned.
        self._finalizer.detach()
        procs = [w.proc for w in self.workers if not w.parked]
        self._finalizer = weakref.finalize(self, kill_all, procs)

    def of_hop(self, hop: Hop) -> list[Worker]:
        return self.workers[hop.first_slot : hop.first_slot + len(hop.devices)]

    def pool(self, hop: Hop) -> list[Worker]:
        """The workers of ``hop`` that have a process (a self-sizing pool's, not parked)."""
        places = self.of_hop(hop)
        return [w for w in places if not w.parked] if hop.bounds else places

    def in_flight(self) -> list[int]:
        """Per hop, the units its live workers are running now (read from the slots)."""
        return [
            sum(self.slots.in_flight(w.slot) for w in self.of_hop(hop) if not w.gone)
            for hop in self.chain.hops
        ]

    def pair(self, src: Worker, dst: Worker) -> tuple[int, int | None]:
        """The pipe from ``src`` to ``dst`` (next hop): its key, and ``src``'s end if new.

        Raises:
            OSError: ``dst`` is dying (nothing is registered then).

        A new pipe is a socket pair made here: ``dst`` gets its end now, ``src`` with the
        forward order; we keep neither end, so a worker's death is an EOF to its peers.
        """
        key = self._pairs.get((src.slot, dst.slot))
        if key is not None:
            return key, None
        key = next(self._pair_keys)
        a, b = socket.socketpair()
        with b:
            try:
                dst.chan.send_control(AddPeer(key), b.fileno())
            except BaseException:
                a.close()
                raise
        self._pairs[(src.slot, dst.slot)] = key
        return key, a.detach()

    # -- waiting -----------------------------------------------------------------------------
    def wait_and_handle(
        self, unit_timeout: float | None, handler: Handler | None, extra: Sequence[Any] = ()
    ) -> None:
        """Wait for any pipe, process sentinel or ``extra`` socket, then read what came;
        workers past ``unit_timeout`` in a unit are killed first (:meth:`kill_overdue`).

        Start-up messages are handled here; every other message, and a death (``None``),
        goes to ``handler``. Without a handler (start-up), a death raises.

        Raises:
            WorkerError: an ``init`` raised.
            WorkerDied: a worker died before it was ready.
        """
        live = [w for w in self.workers if not w.gone]
        fds = [w.chan.fileno() for w in live] + [w.proc.sentinel for w in live]
        fds += [x if isinstance(x, int) else x.fileno() for x in extra]
        ready = self._waiter.wait(fds, self.kill_overdue(unit_timeout))
        n = len(live)
        for k, w in enumerate(live):
            if fds[k] in ready or fds[n + k] in ready:
                self._read(w, handler, fds[n + k] in ready)

    def _read(self, w: Worker, handler: Handler | None, ended: bool) -> None:
        """Handle what ``w`` sent, then its death if it has ``ended`` (its sentinel said so,
        which it does once it has written all it wrote) or its pipe broke."""
        # Read everything the worker sent before looking at whether it is alive: a result that
        # reached the pipe before the death must count, and must not be re-run.
        try:
            while w.chan.poll():
                frame, fds = w.chan.recv_frame()
                msg = w.chan.decode(frame, fds)
                if isinstance(msg, Ready):
                    w.ready, w.joining = True, False
                    note_torch(msg.torch_loaded)
                elif isinstance(msg, InitFailed):
                    raise _failed(w, msg, "while starting")
                elif w.stopping and isinstance(msg, Ended | EndFailed):  # a retired worker
                    note_torch(isinstance(msg, Ended) and msg.torch_loaded)
                    w.proc.join(5.0)
                    self._bury(w)
                    if isinstance(msg, EndFailed):
                        raise _failed(w, msg, "while ending (the worker was being replaced)")
                    self.respawn(w.slot)  # a fresh worker in its slot
                    return
                elif handler is not None:
                    w.last_nbytes = len(frame) + w.chan.shm_in
                    w.chan.shm_in = 0
                    handler(w, msg)
        except (EOFError, OSError):
            ended = True  # (its pipe broke)
        if ended:
            self._bury(w)
            if w.stopping and w.proc.exitcode == 0:  # it ended before we read its goodbye
                self.respawn(w.slot)
                return
            when = "ending (it was being replaced)" if w.stopping else "starting (during init)"
            if w.stopping or not w.ready or handler is None:  # (None: only during start-up)
                raise _died(self.chain, w, when)
            handler(w, None)

    @staticmethod
    def _bury(w: Worker) -> None:
        w.proc.join(1.0)
        kill_all([w.proc])  # (one whose pipe broke may linger) and whatever it started
        w.gone = True
        with contextlib.suppress(Exception):
            w.chan.close()

    # -- replacing a healthy worker (max_items_per_worker, max_worker_memory) ---------------
    def give_back(self, last: Hop) -> None:
        """Tell the last hop's workers which of their shared-memory segments the caller is
        done with. First-hop workers learn it from the next chunk sent to them; the others
        get no chunks from the caller, so a bare note carries the list (else they would map
        new shared memory for every result)."""
        if last.index == 0:
            return
        for w in self.of_hop(last):
            if not w.gone and w.chan.released:
                with contextlib.suppress(OSError):
                    w.chan.send(None)

    def retire(self, due: Iterable[Any]) -> None:
        """Ask workers ``due`` for replacement (``Scheduler.retirees``: they hold no chunk)
        to run ``end`` and exit; a fresh worker replaces each when it has (see
        :meth:`_read`)."""
        for w in due:
            if not w.stopping:
                w.stopping = True
                with contextlib.suppress(OSError, ValueError):  # dying: its sentinel tells us
                    w.chan.conn.send_bytes(STOP)

    # -- timeouts ----------------------------------------------------------------------------
    def kill_overdue(self, timeout: float | None) -> float | None:
        """Kill each worker whose unit in hand has run past ``timeout`` (its death then
        charges that unit: ``Worker.timed_out``); returns how long a wait may last before
        another unit can pass it (None: no limit)."""
        if timeout is None:
            return None
        slots = self.slots
        now = time.monotonic()
        nearest = timeout
        for w in self.workers:
            index, start = slots.index(w.slot), slots.started(w.slot)
            if w.gone or start <= 1.0:  # (timed units, also of chunks no longer tracked)
                continue
            nearest = min(nearest, start + timeout - now)
            overdue = now - start > timeout and slots.index(w.slot) == index
            if overdue and w.timed_out is None:
                w.timed_out = int(index)
                kill_workers([w.proc])  # and every process it started
        # A worker may start a unit without telling us; look again at least every 0.25 s.
        return max(0.0, min(nearest, 0.25))

    # -- stop --------------------------------------------------------------------------------
    def stop(self, grace: float | None) -> BaseException | None:
        """Tell every worker to run ``end`` and exit; wait up to ``grace`` s (None: for
        good), then kill what is left. Returns the first ``end`` failure or death.

        With a grace (an abort: an error or Ctrl-C), only workers that can run ``end`` soon
        are waited for: one between units, or one finishing its unit within ``UNIT_GRACE``.
        One still in ``init``, or in a long unit (whatever signals its code ignores: a
        worker reads STOP only between units), is killed at once.
        """
        workers, self.workers = self.workers, []
        self.descriptors = {}  # (closed now: their numbers go to later descriptors)
        failure: BaseException | None = None
        # those no longer waited for said goodbye (or died): they exit by themselves
        waiting = {w.slot: w for w in workers if not w.gone}
        try:
            for w in waiting.values():
                with contextlib.suppress(OSError, ValueError):
                    w.chan.conn.send_bytes(STOP)
            since = time.monotonic()
            while waiting:
                for w in list(waiting.values()):
                    done, err = _read_goodbye(self.chain, w)
                    failure = failure or err
                    if done:
                        del waiting[w.slot]
                wait = _patience(self.slots, waiting.values(), grace, since)
                if not waiting or wait == 0.0:
                    break
                fds = [fd for w in waiting.values() for fd in (w.chan.fileno(), w.proc.sentinel)]
                self._waiter.wait(fds, wait)
        except BaseException:
            kill_all([w.proc for w in workers if not w.parked])
            raise
        finally:
            for w in workers:  # a goodbye said: it exits by itself, now
                if not w.gone and w.slot not in waiting and w.proc.is_alive():
                    w.proc.join(0.5 if grace is not None else 5.0)
            kill_all([w.proc for w in workers if not w.parked])  # the rest, what they started
            for w in workers:
                with contextlib.suppress(Exception):
                    w.chan.close()
                w.gone = True
            self._finalizer.detach()
        return failure


def _patience(
    slots: Slots, waiting: Iterable[Worker], grace: float | None, since: float
) -> float | None:
    """How long to wait for the goodbyes of ``waiting``, told to stop at ``since`` with
    ``grace`` s (None: for good; 0.0: not at all).

    A worker still in ``init`` cannot run ``end`` before it is done; one in a unit only
    once the unit is: it is waited for ``UNIT_GRACE`` s at most (then, between units, it
    is running ``end``, and has the grace).
    """
    if grace is None:
        return None
    now = time.monotonic()
    ready = [w for w in waiting if w.ready]  # one still in init: not worth waiting for
    if now >= since + grace or not ready:
        return 0.0
    if any(slots.started(w.slot) == IDLE for w in ready):
        return since + grace - now  # running `end` (or about to): it has the grace
    return max(0.0, since + min(grace, UNIT_GRACE) - now)  # in a unit: it may end it soon


def _read_goodbye(chain: Chain, w: Worker) -> tuple[bool, BaseException | None]:
    """Read what a stopping worker sends; (finished?, error from its `end`)."""
    try:
        while w.chan.poll():
            msg = w.chan.decode(*w.chan.recv_frame())
            if isinstance(msg, Ready):
                w.ready = True
                note_torch(msg.torch_loaded)
            elif isinstance(msg, Ended):
                note_torch(msg.torch_loaded)
                return True, None
            elif isinstance(msg, EndFailed | InitFailed):
                what = "while ending" if isinstance(msg, EndFailed) else "while starting"
                return True, _failed(w, msg, what)
            # replies of chunks that no longer matter are dropped
    except (EOFError, OSError):
        pass
    if w.proc.is_alive():
        return False, None
    w.proc.join(0.1)
    if w.proc.exitcode in (0, None):
        return True, None
    return True, _died(chain, w, "ending" if w.ready else "starting (during init)")


def _failed(w: Worker, msg: InitFailed | EndFailed, what: str) -> WorkerError:
    """The error an ``init`` or ``end`` of ``w`` raised (``what``: when)."""
    return msg.error.to_error(what=what, device=w.device, worker=w.index, index=None)


def _died(chain: Chain, w: Worker, when: str) -> WorkerDied:
    """``w`` died outside any unit (``when``: while starting or ending)."""
    code = w.proc.exitcode
    text = f"{chain.who(w.hop, w.index)} on {w.device} died while {when}: {describe_exitcode(code)}"
    return WorkerDied(text, w.device, w.index, code, None, chain.hops[w.hop].name)
