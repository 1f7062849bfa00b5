"""The process transport: one ``map``/``imap`` on worker processes, over the run's books.

The books (``core.RunBooks``: input taken, re-runs, charges, order, sizes, the error policy,
the loop) are the engine-neutral part; this module moves chunks through the workers' pipes
and turns what comes back (Done, Held, Sent, Unreadable, deaths, timeouts) into
entries in those books. Results come back per chunk, so the per-item cost in the caller is a
list append, not a message.

Kept here: exactly-once (the ledger knows where every chunk is; a dead worker's chunks re-run
under new ids, a late reply for an old id is dropped) and which unit a death or a timeout
blames (``blame.assign_blame``, from the worker's shared slot).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from easycore._errors import SerializationError, describe_exitcode
from easycore._exec.blame import Dead, assign_blame, isolate, settle_death, unpicklable
from easycore._exec.core import RAISE, ErrorPolicy, RunBooks
from easycore._exec.ledger import Ledger
from easycore._exec.plan import Chain, StageStats
from easycore._exec.sources import Source
from easycore._exec.workers import Worker, WorkerSet
from easycore._options import RunOptions
from easycore._protocol import (
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
from easycore._transport import Damaged, contains_undecoded

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
    ) -> None:
        self.workers = workers
        self.chain: Chain = workers.chain
        self.hops = self.chain.hops
        self.books = RunBooks(self.chain, source, options, policy, bars)
        self.options = options
        self.ledger = Ledger(workers, ids, len(self.hops), options.ordered)
        # slot -> deaths in a row that charged no item (a delivered chunk starts the count again)
        self.idle_deaths: dict[int, int] = {}

    # -- insight -----------------------------------------------------------------------------
    def stats(self) -> list[StageStats]:
        queued, waiting = self.ledger.units(self.hops)
        return self.books.stats(queued, waiting, self.workers.in_flight())

    # -- the transport's part of the loop (core.RunBooks.stream) -------------------------
    def busy(self) -> bool:
        return bool(self.ledger)

    def wait(self) -> None:
        """Wait for the next message, death or submitted item; handle it; enforce timeouts."""
        source = self.books.source
        wake = source.wakeup()
        # Nothing in flight and every worker idle, yet work remains: waiting would hang
        # forever. (A worker being replaced comes back: its goodbye wakes us.)
        idle = not self.ledger and (wake is None or source.exhausted)
        if idle and all(w.ready and not w.retiring for w in self.workers.workers):
            raise self.books.stalled()
        timeout = self.options.timeout
        self.workers.wait_and_handle(
            self.workers.wait_time(timeout), self.on_message, () if wake is None else (wake,)
        )
        if wake is not None:
            source.drain_wakeups()
        self.workers.kill_overdue(timeout)

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, most_chunks: int | None = None) -> None:
        """Route held chunks on, give releases back, replace workers due for it (once they
        hold no chunk), then send new chunks to the first hop (at most ``most_chunks``)."""
        self._route()
        self.workers.give_back(self.chain.last)
        self.workers.retire_idle()
        books = self.books
        # One chunk at a time to the worker holding the fewest, so consecutive chunks go to
        # different workers: an ordered stream is then fed by all of them at once, not by one
        # worker working through a deep queue of consecutive chunks while the others' results
        # wait behind it (a deep prefetch would otherwise starve the caller).
        open_ = [w for w in self.workers.of_hop(self.hops[0]) if w.has_room(books.depth)]
        sent = 0
        while open_ and (most_chunks is None or sent < most_chunks):
            w = min(open_, key=lambda w: len(w.outstanding))
            limit = books.room(w.hop, w.units_done, w.outstanding.values())
            if limit <= 0:  # (max_items_per_worker: it takes no more than it may still run)
                open_.remove(w)
                if not w.outstanding:  # done with its share in an earlier run: replaced
                    w.retiring = True
                    self.workers.retire_idle()
                continue
            work = books.take(books.window(len(self.workers.workers)) - books.taken, limit)
            if work is None:
                return
            chunk_id = next(self.ledger.ids)
            task = Task(
                chunk_id,
                self.options.run_seed,
                work.start,
                work.items,
                self.options.timeout is not None,
                self.options.retries,
                books.charges.spent(work.start, work.end),
                books.numbering,
                self.options.markers,
                self.options.timeout,
                books.keys_of(work.items, work.start),
            )
            try:
                frame = w.chan.encode(task)
            except Exception as exc:
                unpicklable(books, work, exc)
                continue
            self.ledger.send(chunk_id, work.start, work.items, w)
            try:
                w.chan.send_frame(frame)
            except OSError:
                open_.remove(w)  # it is dying; its sentinel will tell us and we re-queue
                continue
            sent += 1
            if not w.has_room(books.depth):
                open_.remove(w)

    def _route(self) -> None:
        """Send chunks finished by hop h to workers of hop h + 1 that have room.

        With ``max_items_per_worker``, a chunk goes to a worker that may still run all of
        its units, or else to one that has nothing and may run some (a chunk is never cut:
        such a worker runs less than a chunk past the bound, then is replaced)."""
        books = self.books
        for h in range(len(self.hops) - 2, -1, -1):
            targets = self.workers.of_hop(self.hops[h + 1])
            while (held := self.ledger.next_held(h)) is not None:
                chunk, src = held
                units = self.hops[h + 1].units(len(chunk.items))
                room = [
                    t
                    for t in targets
                    if t.has_room(books.depth)
                    and (
                        (r := books.room(t.hop, t.units_done, t.outstanding.values())) >= units
                        or (r > 0 and not t.outstanding)
                    )
                ]
                if not room:
                    break
                dst = min(room, key=lambda t: len(t.outstanding))
                try:
                    key, fd = self.workers.pair(src, dst)
                except OSError:
                    break  # dst is dying: its sentinel will tell us, the chunk stays held
                try:
                    src.chan.send_control(Forward(chunk.id, key), fd)
                except OSError:
                    break  # the holder is dying: its death re-runs the chunk
                finally:
                    if fd is not None:
                        os.close(fd)
                self.ledger.move(chunk, src, dst)

    # -- messages ----------------------------------------------------------------------------
    def on_message(self, w: Worker, msg: Any) -> None:
        """Handle what worker ``w`` sent; ``None``: it is gone."""
        if msg is None:
            self.on_death(w)
        elif isinstance(msg, Done | Held):
            self._on_finished(w, msg)
        elif isinstance(msg, Sent):
            chunk = self.ledger.sent(w, msg.chunk_id)
            if chunk is not None:
                self.books.sizers[w.hop].limit_bytes(len(chunk.items), msg.nbytes)
                self.books.resize()
        elif isinstance(msg, Unreadable):
            self._on_unreadable(w, msg)
        elif isinstance(msg, Damaged):
            self._on_damaged(w, msg)

    def _on_finished(self, w: Worker, msg: Done | Held) -> None:
        held = isinstance(msg, Held)
        chunk = self.ledger.current(w, msg.chunk_id)
        if chunk is None:
            if held:  # its results wait in w for nothing
                with contextlib.suppress(OSError):
                    w.chan.send_control(Drop(msg.chunk_id))
            return
        self.idle_deaths.pop(w.slot, None)  # retries bound deaths in a row, not over a run
        books = self.books
        n = msg.n_done
        books.count(w.hop, n, msg.busy, chunk.items, msg.elapsed, 0 if held else w.last_nbytes)
        w.count_done(n, books.retires)
        if isinstance(msg, Held):  # (a failed unit travels on as a Broken marker)
            self.ledger.hold(chunk, w)
            return
        self.ledger.finish(chunk)
        if msg.marked:
            path = [self.workers.workers[slot] for slot in chunk.path]
            books.outputs(chunk, msg.values, lambda h: (path[h].device, path[h].index))
        else:
            books.store(chunk.start, msg.values, len(chunk.items))

    def _on_damaged(self, w: Worker, msg: Damaged) -> None:
        """Results that did not all unpickle here: the units whose results hold something
        this process cannot rebuild fail (all of the chunk's when it is not known which)."""
        done = msg.message
        if not isinstance(done, Done):
            text = f"a message from worker {w.index} on {w.device} could not be unpickled here"
            raise SerializationError(f"{text}: {msg.error}") from msg.error
        chunk = self.ledger.live.get(done.chunk_id)
        if chunk is None:
            return  # (a stale id: dropped, as _on_finished drops it)
        error = SerializationError(
            f"its result cannot be unpickled in the calling process: {msg.error}"
        )
        report = ErrorReport.of("<result unpickling>", error)
        values = list(done.values)
        bad = [k for k, v in enumerate(values) if contains_undecoded(v)]
        for k in bad or range(len(values)):
            if settled(values[k]) is None:  # (a marker passed on stays)
                values[k] = Broken(w.hop, chunk.start // self.hops[w.hop].unit + k, report)
        self._on_finished(w, done._replace(values=values, marked=True))

    def _on_unreadable(self, w: Worker, msg: Unreadable) -> None:
        """A chunk did not unpickle in ``w`` (which unit's item is not known): see
        ``blame.isolate``."""
        chunk = self.ledger.oldest_at(w)
        if chunk is None:
            text = f"a chunk could not be unpickled in worker {w.index} on {w.device}"
            raise SerializationError(text)
        self.ledger.untrack(chunk)
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
        running, lost = self.ledger.forget(w)
        assert self.workers.slots is not None
        blame = assign_blame(self.books, w, self.workers.slots, running, lost)
        if not blame.charged:
            self.idle_deaths[w.slot] = self.idle_deaths.get(w.slot, 0) + 1
        code = w.proc.exitcode
        who = self.chain.who(w.hop, w.index)
        dead = Dead(
            w.hop, w.index, w.device, who, describe_exitcode(code), code, w.timed_out is not None
        )
        # Re-run what it had ahead of new input.
        self.books.again(
            settle_death(self.books, dead, blame, lost, self.idle_deaths.get(w.slot, 0))
        )
        self.workers.respawn(w.slot)

    # -- an early stop -----------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for the chunks in flight and drop their results (the caller stopped early)."""
        self.books.source.exhausted = True
        self.books.redo.clear()
        for chunk in self.ledger.drop_held():
            with contextlib.suppress(OSError):
                self.workers.workers[chunk.slot].chan.send_control(Drop(chunk.id))
        timeout = self.options.timeout
        while self.ledger:
            self.workers.wait_and_handle(self.workers.wait_time(timeout), self._discard)
            self.workers.kill_overdue(timeout)

    def _discard(self, w: Worker, msg: Any) -> None:
        if isinstance(msg, Damaged):
            msg = msg.message
        if msg is None:
            self.ledger.forget(w)
            self.workers.respawn(w.slot)
        elif isinstance(msg, Sent):
            self.ledger.sent(w, msg.chunk_id)
        elif isinstance(msg, Unreadable):
            chunk = self.ledger.oldest_at(w)
            if chunk is not None:
                self.ledger.untrack(chunk)
        else:
            self.ledger.withdraw(w, msg.chunk_id)
            if isinstance(msg, Held):
                with contextlib.suppress(OSError):
                    w.chan.send_control(Drop(msg.chunk_id))

    def close(self) -> None:
        """Forget the chunks once the run is over (the books drop its input and results)."""
        self.ledger.clear()
