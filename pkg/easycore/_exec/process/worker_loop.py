"""The loop inside a worker process (the caller's side is ``easycore._exec``).

A worker runs one hop of a chain of pools. Its threads::

    caller pipe ──┐                       ┌─> main thread: init, then per Task: decode, run the
    upstream   ───┼─> reader thread ─ tasks    prepared stages (core/stages.py), hand the
    peers' pipes  │   (the only one that       results to the outlet; on STOP: end, goodbye
                  │    receives)
    downstream ───┘   control frames ──────> outlet: last hop: a Done reply to the caller;
    peers' release notes                     other hops: results held, a Held note to the
                                             caller, and a sender thread that forwards held
                                             chunks to the next hop's worker when told to

* The reader always drains every pipe, so the caller's ``send`` never waits on our compute
  and our ``send`` of a large result never deadlocks against the caller sending us work. On
  EOF of the caller's pipe (the caller is gone, nobody is left to report to) it ends the
  process at once: no orphans.
* A worker leads a process group and is the subreaper of what its work starts; before it
  exits it ends every process below it, also those in a session of their own
  (``easycore._reaping``).
* Before each unit the main thread writes the unit's index (and with a timeout, its start
  time) into the worker's shared slot (``easycore._exec.core.protocol.Slots``), so the caller knows
  which item a dead or timed-out worker held without any per-item message. Before it
  unpickles a chunk it writes ``UNPICKLING`` and the time: the first unit's clock starts
  there, so a timeout counts an item's unpickling.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import functools
import gc
import multiprocessing as mp
import multiprocessing.connection as mpc
import multiprocessing.util
import os
import pickle
import queue
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

from easycore._devices import bind_gpus
from easycore._exec.core.protocol import (
    AT_AHEAD,
    AT_FLIGHT,
    AT_INDEX,
    AT_SENDING,
    AT_STARTED,
    IDLE,
    NOT_SENDING,
    RUNNING,
    SLOT_WIDTH,
    STOP,
    UNPICKLING,
    UNREADABLE,
    AddPeer,
    Done,
    Drop,
    Ended,
    EndFailed,
    ErrorReport,
    Forward,
    Held,
    InitFailed,
    Ready,
    Sent,
    Task,
    Unreadable,
    batches,
    worker_view,
)
from easycore._exec.core.stages import ChunkRun, PreparedStages, Ran
from easycore._exec.process.channel import CONTROL, CONTROL_FD, Channel, Damaged
from easycore._reaping import (
    become_subreaper,
    end_children,
    name_mp_tempdir,
    remove_own_mp_tempdir,
)
from easycore._seeding import seed_loaded, setup_torch

__all__ = ["WorkerSpec", "worker_main"]

# A worker names its multiprocessing directory after tempfile's (name_mp_tempdir), which
# tempfile finds on first use by writing a probe file into each candidate: found once here,
# in the process that imports this module (a forkserver, or a caller that forks workers),
# so no worker pays that file I/O on its way to its first item. (None usable: each worker
# finds out as before.)
with contextlib.suppress(OSError):
    tempfile.gettempdir()


class WorkerSpec(NamedTuple):
    """Who a worker is: given to ``worker_main`` by the caller."""

    slot: int  # its place in the caller's worker set and in the shared slots
    worker: int  # its index within its hop: the `worker` injected into its functions
    device: str
    threads: int | None  # torch's intra-op threads, None when the user set them
    payload: bytes  # (the hop's producers, cfg), cloudpickled
    entropy: int  # seeds this worker's random streams when the run has no seed
    hop: int = 0  # its pool's place in the chain
    last: bool = True  # results go to the caller (else to the next hop's workers)
    group: int | None = None  # incoming results per unit (the hop's batch_size)
    unit: int = 1  # first-hop items per unit of this hop
    concurrency: int = 1  # units it runs at once (async tasks or threads)
    release: tuple[int, ...] = ()  # forked: the caller's descriptors to let go (_let_go)
    environ: dict[str, str] | None = None  # not forked: the caller's environment at the start


def _leave(code: int, group: bool = False) -> NoReturn:
    """Exit now, ending every process this worker started (``group``: its whole process
    group, itself included) and removing its multiprocessing directory."""
    end_children()
    remove_own_mp_tempdir()
    if group:
        with contextlib.suppress(OSError):
            os.killpg(0, signal.SIGKILL)  # our own process group: we lead it (see worker_main)
    os._exit(code)


def _end(chan: Channel, goodbye: Any) -> NoReturn:
    """Say ``goodbye`` to the caller and exit, leaving nothing behind.

    A queue, lock or event the work made (a DataLoader's, say) owns a named semaphore in
    /dev/shm that its finaliser unlinks; a queue's feeder thread can keep one alive past the
    work's end, and ``os._exit`` skips finalisers. The ones multiprocessing itself runs at a
    process's exit run here (priority >= 0: semaphores, queues, managers), but no child is
    joined: ``_leave`` ends them. Nothing else is left to do: interpreter teardown is
    skipped (the caller joins us right now).
    """
    _send(chan.send, goodbye)
    with contextlib.suppress(Exception):  # (what multiprocessing's _exit_function runs)
        multiprocessing.util._run_finalizers(0)  # type: ignore[attr-defined]
    sys.stdout.flush()
    sys.stderr.flush()
    _leave(0)


def _let_go(fds: tuple[int, ...]) -> None:
    """(a forked worker) Start as a forkserver's worker would: the caller's signal handlers
    (a handler of SIGTERM that cleans up, say) are not ours, and the caller's ends of its
    workers' pipes, ours included, are let go (a worker sees EOF when the caller dies only
    if no other process holds them). Each number is taken by /dev/null rather than closed:
    objects inherited from the caller still name it, and a number reused here could
    otherwise be closed under us by one of them."""
    if not fds:
        return
    signal.set_wakeup_fd(-1)  # (an event loop's of the caller: its signals are not ours)
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        with contextlib.suppress(OSError):
            os.dup2(null, fd)
    os.close(null)


def _send(send: Callable[[Any], None], obj: Any) -> None:
    """``send(obj)`` to the caller (a message, bare, or a frame); if the caller is gone there
    is nobody to report to: exit."""
    try:
        send(obj)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        _leave(0, group=True)


def _or_die(target: Callable[..., None], *args: Any) -> None:
    """Run a helper thread's loop; if it breaks, end the process (a death the caller handles).

    A dead reader or sender thread in a live process would leave the caller waiting for
    chunks nobody sends; a dead process is seen at once, and its chunks re-run.
    """
    try:
        target(*args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        _leave(70)


# ---------------------------------------------------------------------------------------------
# the reader
# ---------------------------------------------------------------------------------------------
class _Reader:
    """The one thread that receives: the caller's pipe, and pipes from peers of other hops.

    Tasks (from the caller, or an upstream peer) go to the main thread with the channel that
    decodes them; control frames and a downstream peer's release notes go to the outlet's
    inbox. New peer pipes arrive as descriptors after control frames; a peer's death is an
    EOF on its pipe (nobody else holds its end). An upstream peer sends tasks and release
    notes only (never STOP, nor control frames).
    """

    def __init__(
        self, caller: Channel, tasks: queue.SimpleQueue[Any], stop: threading.Event, inbox: Any
    ) -> None:
        self.tasks = tasks
        self.stop = stop
        self.inbox = inbox
        # fd -> (role, peer key, channel); role: "caller", "up" (sends us tasks) or "down"
        self.pipes: dict[int, tuple[str, int, Channel]] = {caller.fileno(): ("caller", -1, caller)}
        self.poll = select.poll()
        self.poll.register(caller.fileno(), select.POLLIN)

    def loop(self) -> None:
        while True:
            for fd, _ in self.poll.poll():
                if self._read(*self.pipes[fd]):
                    return

    def _read(self, role: str, key: int, ch: Channel) -> bool:
        """Handle one frame from ``ch``; True once STOP has come."""
        try:
            frame, fds = ch.recv_frame()
        except (EOFError, OSError):
            if role == "caller":  # the caller died or closed our pipe without STOP: no orphan
                _leave(0, group=True)
            self.poll.unregister(ch.fileno())
            del self.pipes[ch.fileno()]
            if role == "up":
                self.tasks.put((ch, None, None))  # (the main thread stops tracking it)
            else:
                self.inbox.put(("gone", key))
            return False
        if role == "down":
            self.inbox.put(("rel", key, frame, fds))
        elif frame == STOP:
            self.stop.set()
            self.tasks.put(None)
            self.inbox.put(None)
            return True
        elif frame[:1] not in (CONTROL, CONTROL_FD):
            self.tasks.put((ch, frame, fds))
        else:
            op = pickle.loads(memoryview(frame)[1:])
            peer = Channel(mpc.Connection(fds[0])) if fds else None
            if peer is not None:  # AddPeer: an upstream worker; Forward: the first chunk to it
                role = "up" if isinstance(op, AddPeer) else "down"
                self.pipes[peer.fileno()] = (role, op.key, peer)
                self.poll.register(peer.fileno(), select.POLLIN)
            if isinstance(op, Forward):
                self.inbox.put(("fwd", op.chunk_id, op.key, peer))
            elif isinstance(op, Drop):
                self.inbox.put(("drop", op.chunk_id))
        return False


# ---------------------------------------------------------------------------------------------
# the outlets: where a finished chunk goes
# ---------------------------------------------------------------------------------------------
class _ToCaller:
    """Last hop: each chunk's results go back to the caller in one ``Done`` reply."""

    def __init__(
        self, caller: Channel, cur: Any, spec: WorkerSpec, stages: PreparedStages, inbox: Any
    ) -> None:
        self.caller = caller
        self.cur = cur
        self.at = spec.slot * SLOT_WIDTH
        self.spec = spec
        self.stages = stages
        # control traffic (the reader's): it concerns held chunks only, which a last hop
        # never has, so only its end (None) comes here, and nobody reads it
        self.inbox = inbox

    def chunk(self, task: Task, units: Any = None) -> ChunkRun:
        """``task``'s run here, over ``units`` (by default the task's, grouped into batches
        when this hop takes them)."""
        if units is None:
            units = task.units if self.spec.group is None else batches(task.units, self.spec.group)
        return ChunkRun(self.stages, units, task.start // self.spec.unit, task)

    def deliver(self, run: ChunkRun, ran: Ran, elapsed: float, busy: float) -> None:
        values, n, marked = ran
        task = run.task
        self.cur[self.at + AT_SENDING] = float(task.chunk_id)  # if pickling kills us: this chunk
        try:
            frame = self.caller.encode(Done(task.chunk_id, values, n, marked, elapsed, busy))
        except Exception as exc:  # (what does not pickle runs again while its retries allow)
            values = run.unpicklable(values, exc, self.cur, self.at)
            frame = self.caller.encode(Done(task.chunk_id, values, n, True, elapsed, busy))
        _send(self.caller.send_frame, frame)
        self.cur[self.at + AT_SENDING] = NOT_SENDING


class _ToNextHop(_ToCaller):
    """Other hops: results wait here (held) until the caller routes them to a worker of the
    next hop, which this outlet's sender thread (:meth:`_send_loop`) then sends them to
    directly.

    The caller knows every queue's depth, which is how backpressure holds across hops; only
    the sender thread encodes on downstream pipes, so their shared-memory segments need no lock.
    """

    # main thread
    def deliver(self, run: ChunkRun, ran: Ran, elapsed: float, busy: float) -> None:
        values, n, marked = ran
        task = run.task
        self.inbox.put(
            ("held", task.chunk_id, task._replace(units=values, marked=task.marked or marked))
        )
        _send(self.caller.send, Held(task.chunk_id, n, elapsed, busy))

    # sender thread
    def _send_loop(self) -> None:
        held: dict[int, Task] = {}
        down: dict[int, Channel] = {}
        # (the reader puts a pipe's "fwd" before anything it reads from it, "gone" after)
        while (op := self.inbox.get()) is not None:
            match op:
                case ("held", chunk_id, task):
                    held[chunk_id] = task
                case ("drop", chunk_id):
                    held.pop(chunk_id, None)
                case ("rel", key, frame, fds):
                    down[key].decode(frame, fds)
                case ("gone", key):
                    down.pop(key).close()
                case ("fwd", chunk_id, key, new):
                    if new is not None:
                        down[key] = new
                    task = held.pop(chunk_id, None)
                    ch = down.get(key)
                    if task is not None and ch is not None:  # else dropped, or the peer died:
                        self._send_on(ch, task)  # the caller re-runs the chunk

    def _send_on(self, ch: Channel, task: Task) -> None:
        """Send ``task`` on; a result that does not pickle is a Broken in its place (every
        result of this hop, when none alone is the one)."""
        self.cur[self.at + AT_SENDING] = float(task.chunk_id)  # if we die now: this chunk
        try:
            try:
                frame = ch.encode(task)
            except Exception as exc:  # (the units ran: no retry here)
                values = self.chunk(task, task.units).unpicklable(task.units, exc)
                frame = ch.encode(task._replace(units=values, marked=True))
            nbytes = len(frame) + ch.shm_bytes
            try:
                ch.send_frame(frame)
            except OSError:
                return  # the peer died; its reader-side EOF cleans up
        finally:
            self.cur[self.at + AT_SENDING] = NOT_SENDING
        _send(self.caller.send_bare, Sent(task.chunk_id, nbytes))


def _flush_releases(upstream: set[Channel]) -> None:
    # Tell upstream peers which of their segments we no longer use (they reuse them).
    for ch in list(upstream):
        if ch.released:
            try:
                ch.send(None)
            except OSError:
                upstream.discard(ch)


# ---------------------------------------------------------------------------------------------
# the main thread
# ---------------------------------------------------------------------------------------------
def worker_main(conn: Any, slots: Any, spec: WorkerSpec) -> None:
    """Entry point of a worker process (the ``target`` given to ``Process``)."""
    # What a forked worker inherited is never collected here (a collection would touch, and
    # so copy, every page of it); a forkserver froze its own before it forked this one.
    gc.freeze()
    _let_go(spec.release)
    if spec.environ is not None:  # the caller's now, not the forkserver's of its start
        if any(os.environ.get(k) != spec.environ.get(k) for k in ("TMPDIR", "TEMP", "TMP")):
            tempfile.tempdir = None  # tempfile's directory, found in the forkserver: not ours
        os.environ.clear()
        os.environ.update(spec.environ)
    name_mp_tempdir()  # (removed at the end, or by whoever buries this worker)
    # Ctrl-C reaches the whole foreground process group; the caller decides what happens.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # (blocked by a fork: see _spawn)
    # Lead a process group of our own, free to start processes: whatever the work starts
    # (multiprocessing, a DataLoader with workers, subprocess) joins the group, and the
    # caller kills the group when this worker dies, is killed or closes: nothing it started
    # outlives it. What leaves the group (a session of its own, a daemon) stays below this
    # worker, its subreaper, and ends with it (``_reaping``). Ctrl-C in a terminal goes to
    # the caller's group only, and the caller decides what happens.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    become_subreaper()
    # multiprocessing refuses children to a daemonic process; this one's children die with
    # its group, which is what the daemon flag was there for.
    with contextlib.suppress(Exception):
        mp.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    chan = Channel(conn)
    tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # the outlet's (see _Reader)
    stop = threading.Event()
    reader = _Reader(chan, tasks, stop, inbox)
    # (a bare thread: Thread.start() waits until the new thread runs, milliseconds on a
    # busy machine, on the way to this worker's first item)
    _thread.start_new_thread(_or_die, (reader.loop,))

    device = bind_gpus(spec.device)  # a group of GPUs: only those visible, before CUDA starts
    setup_torch(device, spec.threads)
    # Never share a random stream with another worker (torch's default seed is a constant,
    # numpy's state survives fork): seed everything from per-worker entropy.
    seed_loaded(spec.entropy)

    try:
        producers, cfg = pickle.loads(spec.payload)
    except BaseException as exc:
        _end(chan, InitFailed(ErrorReport.of("<payload>", exc)))
    stages = PreparedStages(
        producers,
        device=device,
        cfg=cfg,
        worker=spec.worker,
        hop=spec.hop,
        concurrency=spec.concurrency,
    )
    outlet = (_ToCaller if spec.last else _ToNextHop)(chan, worker_view(slots), spec, stages, inbox)
    if isinstance(outlet, _ToNextHop):
        _thread.start_new_thread(_or_die, (outlet._send_loop,))
    failed = stages.start()
    if failed is not None:
        _end(chan, InitFailed(failed.report()))  # (and what the init started ends)
    _send(chan.send, Ready("torch" in sys.modules))

    (_serve_waiting if stages.waits else _serve)(tasks, stop, outlet)

    failed = stages.finish()  # every stage's end runs even when an earlier one fails
    _end(chan, EndFailed(failed.report()) if failed is not None else Ended("torch" in sys.modules))


def _serve(tasks: queue.SimpleQueue[Any], stop: threading.Event, outlet: _ToCaller) -> None:
    """Run tasks until STOP: decode, run the stages, hand the results to the outlet."""
    clock = time.monotonic
    cur, at = outlet.cur, outlet.at
    upstream: set[Channel] = set()
    while True:
        entry = _next_entry(tasks, upstream)
        if entry is None or stop.is_set():
            return
        t0 = clock()
        task = _take(entry, outlet, upstream, t0)
        if task is None:
            cur[at + AT_STARTED] = IDLE
            continue
        run = outlet.chunk(task)
        if not task.timed:
            cur[at + AT_STARTED] = RUNNING
        cur[at + AT_FLIGHT] = 1.0
        ran = run.run(cur, at, stop, since=t0)
        cur[at + AT_STARTED] = IDLE
        cur[at + AT_FLIGHT] = 0.0
        if stop.is_set():
            return
        elapsed = clock() - t0
        outlet.deliver(run, ran, elapsed, elapsed)
        del run, ran, task
        if upstream:
            _flush_releases(upstream)


def _serve_waiting(tasks: queue.SimpleQueue[Any], stop: threading.Event, outlet: _ToCaller) -> None:
    """:func:`_serve` for a hop that waits (``concurrency=k``, async stages): each chunk is
    started as it comes, its units queued for the worker's ``k`` slots behind those of the
    chunks before (a slot that one chunk's slow unit leaves free takes the next chunk's unit
    at once), and each is answered when it is done, so that the caller sends the next one
    then (a chunk held up by one slow unit holds up no other). The slot names the oldest
    unit in flight (what a watchdog times and a death blames; async stages: the unit holding
    the event loop, the only one timed: the loop cancels the others, ``Flight.by_step``)."""
    clock = time.monotonic
    cur, at, flight = outlet.cur, outlet.at, outlet.stages.flight
    upstream: set[Channel] = set()
    pending: collections.deque[tuple[ChunkRun | Unreadable, float]] = collections.deque()

    flight.to_slot(cur, at)
    while True:
        k = 0
        while k < len(pending):  # answer what is done
            run, t0 = pending[k]
            if isinstance(run, ChunkRun) and run.future.done():
                del pending[k]
                ran, busy = run.result()
                if stop.is_set():
                    return
                outlet.deliver(run, ran, clock() - t0, busy)
                del run, ran
            elif k == 0 and not isinstance(run, ChunkRun):  # (answered for the oldest chunk
                pending.popleft()  # not answered: in its turn)
                _send(outlet.caller.send, run)
            else:
                k += 1
        if not pending:
            cur[at + AT_STARTED] = IDLE
            if upstream:
                _flush_releases(upstream)
        entry = _next_entry(tasks, upstream)
        if entry is None or stop.is_set():
            for run, _ in pending:  # units in flight end (those not started are left out)
                if type(run) is ChunkRun:
                    run.future.result()
            return
        if entry is _TICK:
            continue
        t0 = clock()
        flight.hold()  # (the slot says UNPICKLING, and which chunk: AT_AHEAD)
        cur[at + AT_AHEAD] = float(len(pending))
        task = None
        try:
            task = _take(entry, outlet, upstream, t0, pending)
            if task is not None:
                run = outlet.chunk(task).start(stop, t0)
                run.future.add_done_callback(lambda _: tasks.put(_TICK))
                pending.append((run, t0))
        finally:
            # no unit in flight: the chunk's own time goes on (its unpickling), as in _serve
            started = t0 if task is not None and task.timed else RUNNING
            flight.release(functools.partial(cur.__setitem__, at + AT_STARTED, started))


_TICK = object()  # (in the task queue) a chunk of a hop that waits is done


def _next_entry(tasks: queue.SimpleQueue[Any], upstream: set[Channel]) -> Any:
    """The next entry of the task queue; while waiting, releases go back upstream."""
    while True:
        if not upstream:
            return tasks.get()
        try:
            return tasks.get(timeout=0.05)
        except queue.Empty:
            _flush_releases(upstream)


def _take(
    entry: Any, outlet: _ToCaller, upstream: set[Channel], t0: float, pending: Any = None
) -> Task | None:
    """Decode a task-queue entry: the task, or None (a closed peer, only releases, or a task
    that did not unpickle: the caller hears so, in the order chunks are answered: at once,
    or after those ``pending``)."""
    src, frame, fds = entry
    if frame is None:  # an upstream peer's pipe reached EOF: stop tracking its releases
        upstream.discard(src)
        src.close()
        return None
    # An item's time starts now: a timeout counts its unpickling (a slow __setstate__),
    # and a death in it is charged to the chunk (see UNPICKLING).
    outlet.cur[outlet.at + AT_INDEX] = UNPICKLING
    outlet.cur[outlet.at + AT_STARTED] = t0
    try:
        task = src.decode(frame, fds)
        if type(task) is Damaged:
            raise task.error
    except BaseException as exc:
        # A task that pickled in the caller but does not unpickle here: the caller takes it
        # to be about the oldest chunk not answered (chunks arrive in order; a hop that
        # waits, which answers chunks as they end, says so once those before are answered).
        unreadable = Unreadable(ErrorReport.of(UNREADABLE, exc))
        if pending is None:
            _send(outlet.caller.send, unreadable)
        else:
            pending.append((unreadable, t0))
        return None
    if task is not None and src is not outlet.caller:
        upstream.add(src)
    return task  # type: ignore[no-any-return]
