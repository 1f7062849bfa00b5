"""The process transport: one ``map``/``imap`` on worker processes, over the run's books.

The books (``books.RunBooks``: input taken, re-runs, charges, order, sizes, the error policy,
the loop) are the engine-neutral part; this module moves chunks through the workers' pipes
and turns what comes back (Done, Held, Sent, Unreadable, deaths, timeouts) into
entries in those books. Results come back per chunk, so the per-item cost in the caller is a
list append, not a message.

Kept here: exactly-once (the scheduler knows where every chunk is; a dead worker's chunks re-run
under new ids, a late reply for an old id is dropped) and which unit a death or a timeout
blames (``blame.assign_blame``, from the worker's shared slot).
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Iterator
from typing import Any

from easycore._errors import SerializationError, describe_exitcode
from easycore._exec.core.blame import Dead, assign_blame, isolate, settle_death, unpicklable
from easycore._exec.core.books import RAISE, ErrorPolicy, RunBooks, stage_stats
from easycore._exec.core.plan import Chain, StageStats
from easycore._exec.core.protocol import (
    Broken,
    Done,
    Drop,
    ErrorReport,
    Forward,
    Held,
    Sent,
    Task,
    Unreadable,
    settled,
)
from easycore._exec.core.report import Trace
from easycore._exec.core.scheduler import Scheduler, Send
from easycore._exec.core.sizing import Balancer
from easycore._exec.core.sources import Source
from easycore._exec.process.channel import Damaged, contains_undecoded
from easycore._exec.process.workers import Worker, WorkerSet
from easycore._options import RunOptions

__all__ = ["Run"]


class Run:
    """The process transport of one run on an active worker set, over the run's books.

    Args:
        workers: the runner's processes.
        source: the items (batches already formed when the first hop takes batches).
        options: the run's options.
        ids: chunk ids, shared by every run of the runner.
        policy: what a failed output unit becomes (raised, or delivered as ``Failed``).
        bars: one progress bar per hop, or None.
        balancer: the sizes of the self-sizing pools (None: none).
        trace: the runner's trace.
    """

    def __init__(
        self,
        workers: WorkerSet,
        source: Source,
        options: RunOptions,
        ids: Iterator[int],
        *,
        policy: ErrorPolicy = RAISE,
        bars: list[Any] | None = None,
        balancer: Balancer | None = None,
        trace: Trace | None = None,
    ) -> None:
        self.workers = workers
        self.chain: Chain = workers.chain
        # (hops, not self, in the lambda: a cycle would keep the worker set alive past its run)
        self.hops = hops = self.chain.hops
        self.books = RunBooks(self.chain, source, options, policy, bars, trace=trace)
        self.options = options
        self.sched = Scheduler(self.books, lambda h: workers.pool(hops[h]), ids, False, balancer)
        # slot -> deaths in a row that charged no item (a delivered chunk starts the count again)
        self.idle_deaths: collections.Counter[int] = collections.Counter()

    # -- insight -----------------------------------------------------------------------------
    def stats(self) -> list[StageStats]:
        return stage_stats(self.books, *self.sched.units(), self.workers.in_flight())

    # -- the transport's part of the loop (books.RunBooks.stream) -------------------------
    def busy(self) -> bool:
        return bool(self.sched)

    def wait(self) -> None:
        """Wait for the next message, death or submitted item; handle it; enforce timeouts."""
        source = self.books.source
        wake = source.wakeup()
        # Nothing in flight and every worker idle, yet work remains: waiting would hang
        # forever. (A worker being replaced comes back: its goodbye wakes us.)
        idle = not self.sched and (wake is None or source.exhausted)
        if idle and all(w.parked or (w.ready and not w.retiring) for w in self.workers.workers):
            raise self.books.stalled()
        self.workers.wait_and_handle(
            self.options.timeout, self.on_message, () if wake is None else (wake,)
        )
        if wake is not None:
            source.drain_wakeups()

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, most_chunks: int | None = None) -> None:
        """Carry out the scheduler's commands: held chunks on to the next pool, releases
        given back, workers due for it replaced (once they hold no chunk), then new chunks
        to the first pool (at most ``most_chunks``)."""
        sched, books, options = self.sched, self.books, self.options
        for h in sched.tick():
            self.workers.grow(self.hops[h])
        for fwd in sched.forwards():
            try:
                key, fd = self.workers.pair(fwd.src, fwd.dst)
            except OSError:
                sched.unforward(fwd)  # dst is dying: its sentinel will tell us
                break
            try:
                fwd.src.chan.send_control(Forward(fwd.chunk.id, key), fd)
            except OSError:
                break  # the holder is dying: its death re-runs the chunk
            finally:
                if fd is not None:
                    os.close(fd)
        self.workers.give_back(self.chain.last)
        self.workers.retire(sched.retirees())
        for send in sched.sends(most_chunks):
            assert isinstance(send, Send)  # (a worker process is respawned as it dies)
            chunk = send.chunk
            w = chunk.place
            task = Task(
                chunk.id,
                options.run_seed,
                chunk.start,
                chunk.items,
                options.timeout is not None,
                options.retries,
                books.charges.spent(chunk.start, chunk.end),
                books.numbering,
                options.markers,
                options.timeout,
                books.keys_of(chunk.items, chunk.start),
            )
            try:
                frame = w.chan.encode(task)
            except Exception as exc:
                sched.untrack(chunk)
                unpicklable(books, chunk, exc)
                continue
            with contextlib.suppress(OSError):  # dying: its death runs the chunk again
                w.chan.send_frame(frame)

    # -- messages ----------------------------------------------------------------------------
    def on_message(self, w: Worker, msg: Any) -> None:
        """Handle what worker ``w`` sent; ``None``: it is gone."""
        if msg is None:
            self.on_death(w)
        elif isinstance(msg, Done | Held):
            self._on_finished(w, msg)
        elif isinstance(msg, Sent):
            chunk = self.sched.sent(w, msg.chunk_id)
            if chunk is not None:
                self.books.sizers[w.hop].limit_bytes(len(chunk.items), msg.nbytes)
                self.books.resize()
        elif isinstance(msg, Unreadable):
            self._on_unreadable(w, msg)
        elif isinstance(msg, Damaged):
            self._on_damaged(w, msg)

    def _on_finished(self, w: Worker, msg: Done | Held) -> None:
        held = isinstance(msg, Held)
        chunk = self.sched.done(w, msg.chunk_id)
        if chunk is None:
            if held:  # its results wait in w for nothing
                with contextlib.suppress(OSError):
                    w.chan.send_control(Drop(msg.chunk_id))
            return
        self.idle_deaths.pop(w.slot, None)  # retries bound deaths in a row, not over a run
        books = self.books
        n = msg.n_done
        nbytes = 0 if held else w.last_nbytes
        books.count(w.hop, n, msg.busy, chunk.items, msg.elapsed, nbytes, w.index)
        self.sched.count(w, n, w.resident_bytes)
        if isinstance(msg, Held):  # (a failed unit travels on as a Broken marker)
            self.sched.hold(chunk, w)
            return
        self.sched.finish(chunk)
        if msg.marked:
            books.outputs(chunk, msg.values, lambda h: (chunk.path[h].device, chunk.path[h].index))
        else:
            books.store(chunk.start, msg.values, len(chunk.items))

    def _on_damaged(self, w: Worker, msg: Damaged) -> None:
        """Results that did not all unpickle here: the units whose results hold something
        this process cannot rebuild fail (all of the chunk's when it is not known which)."""
        done = msg.message
        if not isinstance(done, Done):
            text = f"a message from worker {w.index} on {w.device} could not be unpickled here"
            raise SerializationError(f"{text}: {msg.error}") from msg.error
        chunk = self.sched.live.get(done.chunk_id)
        if chunk is None:
            return  # (a stale id: dropped, as _on_finished drops it)
        text = f"its result cannot be unpickled in the calling process: {msg.error}"
        report = ErrorReport.of("<result unpickling>", SerializationError(text))
        values = list(done.values)
        bad = [k for k, v in enumerate(values) if contains_undecoded(v)]
        for k in bad or range(len(values)):
            if settled(values[k]) is None:  # (a marker passed on stays)
                values[k] = Broken(w.hop, chunk.start // self.hops[w.hop].unit + k, report)
        self._on_finished(w, done._replace(values=values, marked=True))

    def _on_unreadable(self, w: Worker, msg: Unreadable) -> None:
        """A chunk did not unpickle in ``w`` (which unit's item is not known): see
        ``blame.isolate``."""
        chunk = self.sched.oldest_at(w)
        if chunk is None:
            text = f"a chunk could not be unpickled in worker {w.index} on {w.device}"
            raise SerializationError(text)
        self.sched.untrack(chunk)
        books, per = self.books, self.hops[w.hop].unit

        def lone(out: int) -> BaseException:
            first, last = out * books.align // per, ((out + 1) * books.align - 1) // per
            return msg.error.to_error(
                what=f"while unpickling {books.label(w.hop, first, last, chunk)} in the worker",
                device=w.device,
                worker=w.index,
                index=books.index(w.hop, first),
            )

        isolate(books, chunk, lone, w.hop)

    # -- deaths ----------------------------------------------------------------------------
    def on_death(self, w: Worker) -> None:
        """A worker is gone: blame what it held, charge retries, re-queue, respawn it."""
        running, lost = self.sched.died(w)
        blame = assign_blame(self.books, w, self.workers.slots, running, lost)
        if not blame.charged:
            self.idle_deaths[w.slot] += 1
        code = w.proc.exitcode
        who = self.chain.who(w.hop, w.index)
        dead = Dead(
            w.hop, w.index, w.device, who, describe_exitcode(code), code, w.timed_out is not None
        )
        # Re-run what it had ahead of new input.
        self.books.again(settle_death(self.books, dead, blame, lost, self.idle_deaths[w.slot]))
        self.workers.respawn(w.slot)

    # -- an early stop -----------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for the chunks in flight and drop their results (the caller stopped early)."""
        self.books.source.exhausted = True
        self.books.redo.clear()
        for chunk in self.sched.drop_held():
            with contextlib.suppress(OSError):
                chunk.place.chan.send_control(Drop(chunk.id))
        while self.sched:
            self.workers.wait_and_handle(self.options.timeout, self._discard)

    def _discard(self, w: Worker, msg: Any) -> None:
        if isinstance(msg, Damaged):
            msg = msg.message
        if msg is None:
            self.sched.died(w)
            self.workers.respawn(w.slot)
        elif isinstance(msg, Sent):
            self.sched.sent(w, msg.chunk_id)
        elif isinstance(msg, Unreadable):
            chunk = self.sched.oldest_at(w)
            if chunk is not None:
                self.sched.untrack(chunk)
        else:
            self.sched.withdraw(w, msg.chunk_id)
            if isinstance(msg, Held):
                with contextlib.suppress(OSError):
                    w.chan.send_control(Drop(msg.chunk_id))

    def close(self) -> None:
        """Forget the chunks once the run is over (the books drop its input and results)."""
        self.sched.clear()
