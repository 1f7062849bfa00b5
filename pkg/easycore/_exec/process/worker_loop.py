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
from typing import Any, NamedTuple

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
from easycore._exec.process.channel import CONTROL, Channel, Damaged
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


def _temp_vars() -> list[str | None]:
    """The variables tempfile reads first to choose its directory."""
    return [os.environ.get(k) for k in ("TMPDIR", "TEMP", "TMP")]


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


class _PeerClosed(NamedTuple):
    """(main thread) an upstream peer's pipe reached EOF: stop tracking its releases."""

    chan: Channel


def _die_with_caller() -> None:
    """The caller is gone: end this worker and every process it started."""
    end_children()
    remove_own_mp_tempdir()
    with contextlib.suppress(OSError):
        os.killpg(0, signal.SIGKILL)  # our own process group: we lead it (see worker_main)
    os._exit(0)


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


def _lead_a_group() -> None:
    """Make this worker a process group of its own, free to start processes.

    Whatever the work starts (multiprocessing, a DataLoader with workers, subprocess)
    joins the group, and the caller kills the group when this worker dies, is killed or
    closes: nothing it started outlives it. What leaves the group (a session of its own,
    a daemon) stays below this worker, its subreaper, and ends with it (``_reaping``).
    Ctrl-C in a terminal goes to the caller's group only, and the caller decides what
    happens (it ignored SIGINT here anyway).
    """
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    become_subreaper()
    # multiprocessing refuses children to a daemonic process; this one's children die with
    # its group, which is what the daemon flag was there for.
    with contextlib.suppress(Exception):
        mp.current_process()._config["daemon"] = False  # type: ignore[attr-defined]


def _release_multiprocessing_objects() -> None:
    """Unlink the named semaphores of multiprocessing objects the work left alive.

    A queue, lock or event the work made (a DataLoader's, say) owns a named semaphore in
    /dev/shm that its finaliser unlinks; a queue's feeder thread can keep one alive past the
    work's end, and ``os._exit`` skips finalisers. Run the ones multiprocessing itself runs
    at a process's exit (priority >= 0: semaphores, queues, managers), but join no children:
    the caller ends this worker's group.
    """
    with contextlib.suppress(Exception):  # (what multiprocessing's _exit_function runs)
        multiprocessing.util._run_finalizers(0)  # type: ignore[attr-defined]


def _send(chan: Channel, obj: Any, bare: bool = False) -> None:
    """Send to the caller; if the caller is gone there is nobody to report to: exit."""
    try:
        if bare:
            chan.send_bare(obj)
        else:
            chan.send(obj)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        _die_with_caller()


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
        end_children()
        remove_own_mp_tempdir()
        os._exit(70)


# ---------------------------------------------------------------------------------------------
# the reader
# ---------------------------------------------------------------------------------------------
class _Reader:
    """The one thread that receives: the caller's pipe, and pipes from peers of other hops.

    Tasks (from the caller, or an upstream peer) go to the main thread with the channel that
    decodes them; control frames and a downstream peer's release notes go to the outlet. New
    peer pipes arrive as descriptors after control frames; a peer's death is an EOF on its
    pipe (nobody else holds its end).
    """

    def __init__(
        self, caller: Channel, tasks: queue.SimpleQueue[Any], stop: threading.Event, outlet: Any
    ) -> None:
        self.tasks = tasks
        self.stop = stop
        self.outlet = outlet
        self.caller = caller
        # fd -> (role, peer key, channel); role: "caller", "up" (sends us tasks) or "down"
        self.pipes: dict[int, tuple[str, int, Channel]] = {caller.fileno(): ("caller", -1, caller)}
        self.poll: Any = None

    def _watch(self) -> None:
        self.poll = select.poll()
        for fd in self.pipes:
            self.poll.register(fd, select.POLLIN)

    def loop(self) -> None:
        self._watch()
        while True:
            for fd, _ in self.poll.poll():
                entry = self.pipes.get(fd)
                if entry is not None and self._read(*entry):
                    return

    def _read(self, role: str, key: int, ch: Channel) -> bool:
        """Handle one frame from ``ch``; True once STOP has come."""
        try:
            frame, fds = ch.recv_frame()
        except (EOFError, OSError):
            if role == "caller":
                _die_with_caller()  # the caller died or closed our pipe without STOP: no orphan
            self._lost(role, key, ch)
            return False
        if role == "up":
            self.tasks.put((ch, frame, fds))
        elif role == "down":
            self.outlet.released(key, frame, fds)
        elif frame == STOP:
            self.stop.set()
            self.tasks.put(None)
            self.outlet.close()
            return True
        elif frame[:1] == CONTROL:
            self._control(Channel.read_control(frame), fds)
        else:
            self.tasks.put((ch, frame, fds))
        return False

    def _control(self, op: Any, fds: list[int]) -> None:
        peer = Channel(mpc.Connection(fds[0])) if fds else None
        if isinstance(op, AddPeer) and peer is not None:  # an upstream worker will send here
            self._add("up", op.key, peer)
        elif isinstance(op, Forward):
            if peer is not None:  # the first chunk to this downstream worker
                self._add("down", op.key, peer)
            self.outlet.forward(op.chunk_id, op.key, peer)
        elif isinstance(op, Drop):
            self.outlet.drop(op.chunk_id)

    def _add(self, role: str, key: int, ch: Channel) -> None:
        self.pipes[ch.fileno()] = (role, key, ch)
        self.poll.register(ch.fileno(), select.POLLIN)

    def _lost(self, role: str, key: int, ch: Channel) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.poll.unregister(ch.fileno())
        self.pipes.pop(ch.fileno(), None)
        if role == "up":
            self.tasks.put((_PeerClosed(ch), None, None))
        else:
            self.outlet.gone(key)


# ---------------------------------------------------------------------------------------------
# the outlets: where a finished chunk goes
# ---------------------------------------------------------------------------------------------
class _ToCaller:
    """Last hop: each chunk's results go back to the caller in one ``Done`` reply."""

    def __init__(self, caller: Channel, cur: Any, at: int, unit: int) -> None:
        self.caller = caller
        self.cur = cur
        self.at = at
        self.unit = unit  # first-hop items per unit of this hop
        self.stages: PreparedStages | None = None  # set once init has run

    def deliver(self, task: Task, units: Any, ran: Ran, elapsed: float, busy: float) -> None:
        values, n, marked = ran
        self.cur[self.at + AT_SENDING] = float(task.chunk_id)  # if pickling kills us: this chunk
        try:
            frame = self.caller.encode(Done(task.chunk_id, values, n, marked, elapsed, busy))
        except Exception as exc:  # (what does not pickle runs again while its retries allow)
            assert self.stages is not None
            run = ChunkRun(self.stages, units, task.start // self.unit, task)
            values = run.unpicklable(values, exc, self.cur, self.at)
            frame = self.caller.encode(Done(task.chunk_id, values, n, True, elapsed, busy))
        try:
            self.caller.send_frame(frame)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            _die_with_caller()
        self.cur[self.at + AT_SENDING] = NOT_SENDING

    # (control traffic only concerns held chunks: a last hop never has any)
    def forward(self, chunk_id: int, key: int, peer: Channel | None) -> None:
        if peer is not None:  # pragma: no cover - the caller never forwards from a last hop
            peer.close()

    def drop(self, chunk_id: int) -> None:
        pass

    def released(self, key: int, frame: bytes, fds: list[int]) -> None:  # pragma: no cover
        for fd in fds:
            os.close(fd)

    def gone(self, key: int) -> None:
        pass

    def close(self) -> None:
        pass


class _ToNextHop:
    """Other hops: results wait here (held) until the caller routes them to a worker of the
    next hop, which this outlet's sender thread then sends them to directly.

    The caller knows every queue's depth, which is how backpressure holds across hops; only
    the sender thread encodes on downstream pipes, so their shared-memory segments need no lock.
    """

    def __init__(self, caller: Channel, cur: Any, at: int, unit: int) -> None:
        self.caller = caller
        self.cur = cur
        self.at = at
        self.unit = unit  # first-hop items per unit of this hop
        self.stages: PreparedStages | None = None  # set once init has run
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(target=_or_die, args=(self._send_loop,), daemon=True)
        self.thread.start()

    # main thread
    def deliver(self, task: Task, units: Any, ran: Ran, elapsed: float, busy: float) -> None:
        values, n, marked = ran
        self.inbox.put(
            ("held", task.chunk_id, task._replace(units=values, marked=task.marked or marked))
        )
        _send(self.caller, Held(task.chunk_id, n, elapsed, busy))

    # reader thread
    def forward(self, chunk_id: int, key: int, peer: Channel | None) -> None:
        self.inbox.put(("fwd", chunk_id, key, peer))

    def drop(self, chunk_id: int) -> None:
        self.inbox.put(("drop", chunk_id))

    def released(self, key: int, frame: bytes, fds: list[int]) -> None:
        self.inbox.put(("rel", key, frame, fds))

    def gone(self, key: int) -> None:
        self.inbox.put(("gone", key))

    def close(self) -> None:
        self.inbox.put(None)

    # sender thread
    def _send_loop(self) -> None:
        held: dict[int, Task] = {}
        down: dict[int, Channel] = {}
        while True:
            op = self.inbox.get()
            if op is None:
                return
            kind = op[0]
            if kind == "held":
                held[op[1]] = op[2]
            elif kind == "drop":
                held.pop(op[1], None)
            elif kind == "rel":
                _, key, frame, fds = op
                ch = down.get(key)
                if ch is None:
                    for fd in fds:
                        os.close(fd)
                else:
                    ch.decode(frame, fds)
            elif kind == "gone":
                ch = down.pop(op[1], None)
                if ch is not None:
                    ch.close()
            elif kind == "fwd":
                _, chunk_id, key, new = op
                if new is not None:
                    down[key] = new
                task = held.pop(chunk_id, None)
                ch = down.get(key)
                if task is None or ch is None:
                    continue  # dropped, or the peer died: the caller re-runs the chunk
                self._send_on(ch, task)

    def _send_on(self, ch: Channel, task: Task) -> None:
        self.cur[self.at + AT_SENDING] = float(task.chunk_id)  # if we die now: this chunk
        try:
            frame = self._encode(ch, task)
            nbytes = len(frame) + ch.shm_bytes
            try:
                ch.send_frame(frame)
            except OSError:
                return  # the peer died; its reader-side EOF cleans up
        finally:
            self.cur[self.at + AT_SENDING] = NOT_SENDING
        _send(self.caller, Sent(task.chunk_id, nbytes), bare=True)

    def _encode(self, ch: Channel, task: Task) -> bytes:
        """``task``'s frame; a result that does not pickle is a Broken in its place (every
        result of this hop, when none alone is the one)."""
        try:
            return ch.encode(task)
        except Exception as exc:  # (the units ran: no retry here)
            assert self.stages is not None
            run = ChunkRun(self.stages, task.units, task.start // self.unit, task)
            values = run.unpicklable(task.units, exc)
            return ch.encode(task._replace(units=values, marked=True))


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
    entered = time.monotonic()
    # What a forked worker inherited is never collected here (a collection would touch, and
    # so copy, every page of it); a forkserver froze its own before it forked this one.
    gc.freeze()
    _let_go(spec.release)
    if spec.environ is not None:  # the caller's now, not the forkserver's of its start
        temp = _temp_vars()
        os.environ.clear()
        os.environ.update(spec.environ)
        if _temp_vars() != temp:  # tempfile's directory, found in the forkserver: not ours
            tempfile.tempdir = None
    name_mp_tempdir()  # (removed at the end, or by whoever buries this worker)
    # Ctrl-C reaches the whole foreground process group; the caller decides what happens.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # (blocked by a fork: see _spawn)
    _lead_a_group()
    chan = Channel(conn)
    tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
    stop = threading.Event()
    cur = worker_view(slots)
    at = spec.slot * SLOT_WIDTH
    outlet = (
        _ToCaller(chan, cur, at, spec.unit) if spec.last else _ToNextHop(chan, cur, at, spec.unit)
    )
    reader = _Reader(chan, tasks, stop, outlet)
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
        _send(chan, InitFailed(ErrorReport.of("<payload>", exc)))
        return
    stages = PreparedStages(
        producers,
        device=device,
        cfg=cfg,
        worker=spec.worker,
        hop=spec.hop,
        concurrency=spec.concurrency,
    )
    outlet.stages = stages
    failed = stages.start()
    if failed is not None:
        _send(chan, InitFailed(failed.report()))
        end_children()  # what the init started
        remove_own_mp_tempdir()
        return
    _send(chan, Ready(os.getpid(), entered, time.monotonic(), "torch" in sys.modules))

    serve = _serve_waiting if stages.waits else _serve
    serve(chan, tasks, stop, stages, outlet, spec, cur, at)

    failed = stages.finish()  # every stage's end runs even when an earlier one fails
    goodbye = EndFailed(failed.report()) if failed is not None else None
    _send(chan, goodbye or Ended("torch" in sys.modules))
    _release_multiprocessing_objects()
    end_children()  # whatever the work started and left running, in any session
    remove_own_mp_tempdir()
    # Nothing is left to do: skip interpreter teardown (the caller joins us right now).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(
    chan: Channel,
    tasks: queue.SimpleQueue[Any],
    stop: threading.Event,
    stages: PreparedStages,
    outlet: _ToCaller | _ToNextHop,
    spec: WorkerSpec,
    cur: Any,
    at: int,
) -> None:
    """Run tasks until STOP: decode, run the stages, hand the results to the outlet."""
    clock = time.monotonic
    upstream: set[Channel] = set()
    while True:
        entry = _next_entry(tasks, upstream)
        if entry is None or stop.is_set():
            return
        t0 = clock()
        task = _take(entry, chan, upstream, cur, at, t0)
        if task is None:
            cur[at + AT_STARTED] = IDLE
            continue
        units = _units_of(task, spec)
        if not task.timed:
            cur[at + AT_STARTED] = RUNNING
        cur[at + AT_FLIGHT] = 1.0
        ran = ChunkRun(stages, units, task.start // spec.unit, task).run(cur, at, stop, since=t0)
        cur[at + AT_STARTED] = IDLE
        cur[at + AT_FLIGHT] = 0.0
        if stop.is_set():
            return
        elapsed = clock() - t0
        outlet.deliver(task, units, ran, elapsed, elapsed)
        del units, ran, task
        if upstream:
            _flush_releases(upstream)


def _serve_waiting(
    chan: Channel,
    tasks: queue.SimpleQueue[Any],
    stop: threading.Event,
    stages: PreparedStages,
    outlet: _ToCaller | _ToNextHop,
    spec: WorkerSpec,
    cur: Any,
    at: int,
) -> None:
    """:func:`_serve` for a hop that waits (``concurrency=k``, async stages): each chunk is
    started as it comes, its units queued for the worker's ``k`` slots behind those of the
    chunks before (a slot that one chunk's slow unit leaves free takes the next chunk's unit
    at once), and each is answered when it is done, so that the caller sends the next one
    then (a chunk held up by one slow unit holds up no other). The slot names the oldest
    unit in flight (what a watchdog times and a death blames; async stages: the unit holding
    the event loop, the only one timed: the loop cancels the others, ``Flight.by_step``)."""
    clock = time.monotonic
    upstream: set[Channel] = set()
    pending: collections.deque[tuple[ChunkRun | Unreadable, float]] = collections.deque()

    def tick(_: Any) -> None:
        tasks.put(_TICK)

    stages.flight.to_slot(cur, at)
    while True:
        k = 0
        while k < len(pending):  # answer what is done
            run, t0 = pending[k]
            if isinstance(run, ChunkRun):
                if not run.future.done():
                    k += 1
                    continue
                del pending[k]
                ran, busy = run.result()
                if stop.is_set():
                    return
                outlet.deliver(run.task, run.units, ran, clock() - t0, busy)
                del run, ran
            elif k == 0:  # (answered for the oldest chunk not answered: in its turn)
                pending.popleft()
                _send(chan, run)
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
        stages.flight.hold()  # (the slot says UNPICKLING, and which chunk: AT_AHEAD)
        cur[at + AT_AHEAD] = float(len(pending))
        task = None
        try:
            task = _take(entry, chan, upstream, cur, at, t0, pending)
            if task is not None:
                units = _units_of(task, spec)
                run = ChunkRun(stages, units, task.start // spec.unit, task).start(stop, t0)
                run.future.add_done_callback(tick)
                pending.append((run, t0))
        finally:
            # no unit in flight: the chunk's own time goes on (its unpickling), as in _serve
            started = t0 if task is not None and task.timed else RUNNING
            stages.flight.release(functools.partial(_set, cur, at + AT_STARTED, started))


_TICK = object()  # (in the task queue) a chunk of a hop that waits is done


def _set(cur: Any, at: int, value: float) -> None:
    cur[at] = value


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
    entry: Any,
    chan: Channel,
    upstream: set[Channel],
    cur: Any,
    at: int,
    t0: float,
    pending: Any = None,
) -> Task | None:
    """Decode a task-queue entry: the task, or None (a closed peer, only releases, or a task
    that did not unpickle: the caller hears so, in the order chunks are answered: at once,
    or after those ``pending``)."""
    src, frame, fds = entry
    if isinstance(src, _PeerClosed):
        upstream.discard(src.chan)
        src.chan.close()
        return None
    # An item's time starts now: a timeout counts its unpickling (a slow __setstate__),
    # and a death in it is charged to the chunk (see UNPICKLING).
    cur[at + AT_INDEX] = UNPICKLING
    cur[at + AT_STARTED] = t0
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
            _send(chan, unreadable)
        else:
            pending.append((unreadable, t0))
        return None
    if task is not None and src is not chan:
        upstream.add(src)
    return task  # type: ignore[no-any-return]


def _units_of(task: Task, spec: WorkerSpec) -> Any:
    """A task's units for this hop: grouped into batches when it takes them."""
    return task.units if spec.group is None else batches(task.units, spec.group)
