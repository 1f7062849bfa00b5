"""The process transport: one ``map``/``imap`` on worker processes, over the run's books.

The books (``core.RunBooks``: input taken, re-runs, charges, order, sizes, the error policy)
are the engine-neutral part; this module moves chunks through the workers' pipes and turns
what comes back (Done, Held, deaths, timeouts) into entries in those books. Results come
back per chunk and are yielded as segments, so the per-item cost in the caller is a list
append, not a message. Each turn of :meth:`Run.loop`::

    dispatch      route held chunks to the next hop's workers that have room, give segment
                  releases back to last-hop workers, send new chunks to first-hop workers
    deliver       yield what is ready (in input order with ordered=True)
    wait          for a pipe, a process sentinel or (submit) the wake-up socket
    on_message    Done / Held / Sent / BadOutput / Unreadable, or on_death for a gone worker
    check_timeouts

Guarantees kept here: backpressure (at most ``books.window()`` items taken from the source
and not yet yielded), exactly-once (the ledger knows where every chunk is; a dead worker's chunks
re-run under new ids, a late reply for an old id is dropped), ordering (segments keyed by
start index), and the fault matrix (which item to blame for a death or a timeout, retries
charged per unit, errors raised with the stage and item named).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cloudpickle

from easycore._errors import (
    EasycoreError,
    SerializationError,
    after_retries,
    item_label,
    short_repr,
)
from easycore._exec.blame import assign_blame, death_error, requeue
from easycore._exec.core import RAISE, ErrorPolicy, Failed, RunBooks, Segment, Work
from easycore._exec.ledger import Chunk, Ledger
from easycore._exec.plan import Chain, StageStats
from easycore._exec.sources import Source
from easycore._exec.workers import Worker, WorkerSet
from easycore._options import RunOptions
from easycore._protocol import (
    BadOutput,
    Done,
    Drop,
    ErrorReport,
    Forward,
    Held,
    Sent,
    Task,
    Unreadable,
)

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
        is_current: False once the runner was closed (or re-activated) under this run.
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
        is_current: Callable[[], bool] = lambda: True,
    ) -> None:
        self.workers = workers
        self.chain: Chain = workers.chain
        self.hops = self.chain.hops
        self.books = RunBooks(self.chain, source, options, policy, bars)
        self.options = options
        # workers are replaced after n items or past a memory bound (long jobs)
        self.recycling = (
            options.max_items_per_worker is not None or options.max_worker_memory is not None
        )
        self.is_current = is_current
        self.ledger = Ledger(workers, ids, len(self.hops), options.ordered)
        # slot -> deaths in a row that charged no item (a delivered chunk starts the count again)
        self.idle_deaths: dict[int, int] = {}

    # -- insight -----------------------------------------------------------------------------
    def stats(self) -> list[StageStats]:
        queued, waiting = [], []
        for hop in self.hops:
            # snapshots: another thread (a submit run) may be changing these
            workers = [w for w in list(self.workers.workers) if w.hop == hop.index]
            q = sum(len(c.items) for w in workers for c in list(w.outstanding.values()))
            held = sum(len(c.items) for c in list(self.ledger.waiting[hop.index]))
            queued.append(-(-q // hop.unit))
            waiting.append(-(-held // hop.unit))
        return self.books.stats(queued, waiting)

    # -- the loop ----------------------------------------------------------------------------
    def loop(self) -> Iterator[Segment]:
        """Yield segments until the run is done."""
        books = self.books
        try:
            while True:
                # Refill before yielding (the workers compute while the caller folds results)
                # and after (yielding frees room): never wait with room and nothing in flight.
                # With a result ready, only a chunk per worker goes out first: after a pause
                # the caller finds many results at once, and the rest of the refill waits
                # for its next call rather than delay the result it came for.
                self.dispatch(len(self.workers.workers) if books.deliverable() else None)
                yield from books.deliver()
                if not self.is_current():
                    msg = "the runner was closed while this run had items pending"
                    raise RuntimeError(msg)
                self.dispatch()
                if books.source.should_end(self._settled()):
                    return
                if not self.ledger:
                    if books.source.exhausted and self._settled():
                        return
                    self._check_stalled()
                self.wait()
        finally:
            books.finished = time.monotonic()

    def _settled(self) -> bool:
        """Nothing in flight, to re-run, or to yield."""
        return not (self.ledger or self.books.unsettled())

    def _check_stalled(self) -> None:
        source = self.books.source
        if source.wakeup() is not None and not source.exhausted:
            return  # idle until the next submit
        if all(w.ready and not w.retiring for w in self.workers.workers):
            # Nothing in flight, every worker idle, yet work remains: waiting would hang
            # forever, so fail loudly instead (this is a bug in easycore). (A worker being
            # replaced comes back: its goodbye wakes us.)
            msg = f"easycore internal error: stalled with {self.books.taken} item(s) pending"
            raise EasycoreError(msg)

    def wait(self) -> None:
        """Wait for the next message, death or submitted item; handle it; enforce timeouts."""
        source = self.books.source
        wake = source.wakeup()
        self.workers.wait_and_handle(
            self._wait_time(), self.on_message, () if wake is None else (wake,)
        )
        if wake is not None:
            source.drain_wakeups()
        self._check_timeouts()

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, most_chunks: int | None = None) -> None:
        """Route held chunks on, give releases back, replace workers due for it (once they
        hold no chunk), then send new chunks to the first hop (at most ``most_chunks``)."""
        self._route()
        self._give_back()
        if self.recycling:
            for w in self.workers.workers:
                if w.retiring and not (w.stopping or w.outstanding or w.holding):
                    self.workers.retire(w)
        books = self.books
        timed = self.options.timeout is not None
        most = self.options.max_items_per_worker
        n_workers = len(self.workers.workers)
        # One chunk at a time to the worker holding the fewest, so consecutive chunks go to
        # different workers: an ordered stream is then fed by all of them at once, not by one
        # worker working through a deep queue of consecutive chunks while the others' results
        # wait behind it (a deep prefetch would otherwise starve the caller).
        open_ = [w for w in self.workers.of_hop(self.hops[0]) if w.has_room(books.depth)]
        sent = 0
        while open_ and (most_chunks is None or sent < most_chunks):
            w = min(open_, key=lambda w: len(w.outstanding))
            limit = None
            if most is not None:  # a worker takes no more than it may still run
                limit = most - w.units_done - sum(len(c.items) for c in w.outstanding.values())
                if limit <= 0:
                    open_.remove(w)
                    continue
            work = books.take(books.window(n_workers) - books.taken, limit)
            if work is None:
                return
            chunk_id = next(self.ledger.ids)
            task = Task(
                chunk_id,
                self.options.seed,
                work.start,
                work.items,
                timed,
                self.options.retries,
                books.charges.spent(work.start, work.end),
                books.numbering,
                self.options.resume is not None,
            )
            try:
                frame = w.chan.encode(task)
            except Exception as exc:
                self._unpicklable(work, exc)
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

    def _give_back(self) -> None:
        """Tell last-hop workers which of their segments we are done with.

        Workers of the first hop learn it from the next chunk we send them; the others get
        no chunks from us, so a bare note carries the list (else they would map new shared
        memory for every result).
        """
        if self.chain.last.index == 0:
            return
        for w in self.workers.of_hop(self.chain.last):
            if w.alive and w.chan.released:
                with contextlib.suppress(OSError):
                    w.chan.send(None)

    def _route(self) -> None:
        """Send chunks finished by hop h to workers of hop h + 1 that have room."""
        books = self.workers.workers
        for h in range(len(self.hops) - 2, -1, -1):
            held = self.ledger.waiting[h]
            targets = self.workers.of_hop(self.hops[h + 1])
            while held:
                room = [t for t in targets if t.has_room(self.books.depth)]
                if not room:
                    break
                dst = min(room, key=lambda t: len(t.outstanding))
                chunk = held[0]
                src = books[chunk.slot]
                try:
                    key, fd = self.workers.pair(src, dst)
                except OSError:
                    break  # dst is dying: its sentinel will tell us, the chunk stays held
                held.pop(0)
                try:
                    src.chan.send_control(Forward(chunk.id, key), fd)
                except OSError:
                    # the holder is dying: leave the chunk with it, its death re-runs it
                    held.insert(0, chunk)
                    break
                finally:
                    if fd is not None:
                        os.close(fd)
                self.ledger.move(chunk, src, dst)

    # -- failures ----------------------------------------------------------------------------
    # A failed unit fails its output unit (what the last hop makes of `align` first-hop
    # units): the policy raises, or delivers a Failed in its place; the chunk's other output
    # units run again.
    def _unpicklable(self, work: Work, exc: Exception) -> None:
        """A chunk would not pickle: the units whose items do not fail; the others go again
        (one per chunk)."""
        books = self.books
        again = []
        for part in books.rerun(work):
            for k, item in enumerate(part.items):
                try:
                    cloudpickle.dumps(item)  # a probe: must not consume releases
                except Exception as inner:
                    at = part.start + k
                    msg = (
                        f"{self.options.label(at)} cannot be pickled to reach a worker: "
                        f"{inner} (item: {short_repr(item)})"
                    )
                    index = books.index(0, at)
                    error = SerializationError(msg, "<item pickling>", None, None, index)
                    error.__cause__ = inner
                    out = part.start // books.align
                    books.fail(
                        out, error, books.unit_items(part.items, part.start, out), self.hops[0].name
                    )
                    break
            else:
                again.append(part)
        if len(again) == 1 and len(again[0].items) == len(work.items):
            raise SerializationError(f"a chunk of items cannot be pickled: {exc}") from exc
        books.again(again)

    def _errors(
        self, w: Worker, chunk: Chunk, errors: list[tuple[int, ErrorReport]], doing: str
    ) -> dict[int, Failed]:
        """What ``w`` reported for units of ``chunk`` (at its hop), settled as failures of
        the output units they belong to (the policy may raise the first)."""
        books = self.books
        per = self.hops[w.hop].unit
        out: dict[int, Failed] = {}
        for k, report in errors:
            index = chunk.start // per + k  # a unit of w's hop
            unit = index * per // books.align
            if unit in out:
                continue
            what = f"{doing} {books.label(w.hop, index)}{after_retries(self.options.retries)}"
            error = report.to_error(
                what=what, device=w.device, worker=w.index, index=books.index(w.hop, index)
            )
            item = books.unit_items(chunk.items, chunk.start, unit)
            out[unit] = books.policy.settle(error, item, books.stage_of(w.hop, report.stage))
        return out

    def _fail_held(self, chunk: Chunk, failed: dict[int, Failed]) -> None:
        """Units of a chunk failed before its last hop; the chunk's other output units did
        not move on: they run again from the start."""
        books = self.books
        for unit, failure in failed.items():
            books.store(unit * books.align, [failure], books.align)
        books.again(books.rerun(Work(chunk.start, chunk.items), failed))

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
        elif isinstance(msg, BadOutput):
            chunk = self.ledger.live.get(msg.chunk_id)
            if chunk is not None:  # that unit fails; the chunk's others run again
                failed = self._errors(w, chunk, [(msg.position, msg.error)], "while sending")
                self.ledger.untrack(chunk)
                self._fail_held(chunk, failed)
        elif isinstance(msg, Unreadable):
            self._on_unreadable(w, msg)

    def _on_finished(self, w: Worker, msg: Done | Held) -> None:
        held = isinstance(msg, Held)
        chunk = self.ledger.current(w, msg.chunk_id)
        if chunk is None:
            if held:  # its results wait in w for nothing
                with contextlib.suppress(OSError):
                    w.chan.send_control(Drop(msg.chunk_id))
            return
        if self.idle_deaths:  # retries bound deaths in a row, not deaths over a long run
            self.idle_deaths.pop(w.slot, None)
        books = self.books
        h = w.hop
        n = msg.n_done if isinstance(msg, Held) else len(msg.values)
        books.count(h, n, msg.elapsed)
        books.measured(h, len(chunk.items), msg.elapsed, 0 if held else w.last_nbytes)
        self._check_health(w, n)
        failed = self._errors(w, chunk, msg.errors, "while running") if msg.errors else {}
        if isinstance(msg, Held):
            if failed:
                self.ledger.live.pop(chunk.id, None)
                self._fail_held(chunk, failed)
            else:
                self.ledger.hold(chunk, w)
            return
        values = msg.values
        if failed:  # (the last hop's units are output units)
            values = list(values)
            for unit, failure in failed.items():
                values[unit - chunk.start // books.align] = failure
        self.ledger.finish(chunk)
        books.store(chunk.start, values, len(chunk.items))

    def _check_health(self, w: Worker, n: int) -> None:
        """Mark a worker for replacement after ``max_items_per_worker`` units, or once its
        resident memory passed ``max_worker_memory`` (it finishes the chunks it has)."""
        if not self.recycling:
            return
        w.units_done += n
        most, memory = self.options.max_items_per_worker, self.options.max_worker_memory
        due = most is not None and w.units_done >= most
        w.retiring = due or (memory is not None and w.resident_bytes() > memory)

    def _on_unreadable(self, w: Worker, msg: Unreadable) -> None:
        if not w.outstanding:
            text = f"a chunk could not be unpickled in worker {w.index} on {w.device}"
            raise SerializationError(text)
        books = self.books
        chunk = w.outstanding[min(w.outstanding)]
        unit = self.hops[w.hop].unit
        first, last = chunk.start // unit, (chunk.end - 1) // unit
        what = (
            f"while unpickling {books.label(w.hop, first)} .. "
            f"{item_label(last, None)} in the worker"
        )
        error = msg.error.to_error(
            what=what,
            device=w.device,
            worker=w.index,
            index=books.index(w.hop, first),
            cls=SerializationError,
        )
        # the chunk's units fail (which one is unknown)
        self.ledger.untrack(chunk)
        for a in range(0, len(chunk.items), books.align):
            out = (chunk.start + a) // books.align
            items = books.unit_items(chunk.items, chunk.start, out)
            books.fail(out, error, items, self.hops[w.hop].name)

    # -- deaths ----------------------------------------------------------------------------
    def on_death(self, w: Worker) -> None:
        """A worker is gone: blame what it held, charge retries, re-queue, respawn it."""
        books = self.books
        running, lost = self.ledger.forget(w)
        assert self.workers.slots is not None
        unit = self.hops[w.hop].unit
        blame = assign_blame(w, self.workers.slots, running, lost, unit)
        runs = [books.charges.charge(w.hop, index) for index in blame.charged]
        if not blame.charged:
            self.idle_deaths[w.slot] = self.idle_deaths.get(w.slot, 0) + 1
            runs = [self.idle_deaths[w.slot]]
        spared: set[int] = set()  # output units failed instead of re-run
        if max(runs) > self.options.retries:
            held = sum(len(c.items) for c in lost)
            error = death_error(w, blame, held, self.chain, self.options)
            culprit = blame.culprit
            for index in [culprit] if culprit is not None else blame.charged:
                out = index * unit // books.align
                if out in spared:
                    continue
                spared.add(out)
                chunk = next(c for c in lost if c.start <= out * books.align < c.end)
                items = books.unit_items(chunk.items, chunk.start, out)
                books.fail(out, error, items, self.hops[w.hop].name)
            if not spared:  # nothing of ours to blame: raise, or go on
                books.policy.settle(error, None, self.hops[w.hop].name)
        # Re-run what it had ahead of new input.
        books.again(requeue(lost, blame, unit, books.align, spared))
        self.workers.respawn(w.slot)

    # -- timeouts ----------------------------------------------------------------------------
    def _wait_time(self) -> float | None:
        timeout = self.options.timeout
        if timeout is None:
            return None
        now = time.monotonic()
        slots = self.workers.slots
        assert slots is not None
        nearest = timeout
        for w in self.workers.workers:
            start = slots.started(w.slot)
            if w.alive and start > 1.0:  # timed units, also of chunks no longer tracked
                nearest = min(nearest, start + timeout - now)
        # A worker may start a unit without telling us; look again at least every 0.25 s.
        return max(0.0, min(nearest, 0.25))

    def _check_timeouts(self) -> None:
        timeout = self.options.timeout
        if timeout is None:
            return
        slots = self.workers.slots
        assert slots is not None
        now = time.monotonic()
        for w in self.workers.workers:
            if not w.alive or w.timed_out is not None:
                continue
            index, start = slots.index(w.slot), slots.started(w.slot)
            if start > 1.0 and now - start > timeout and slots.index(w.slot) == index:
                w.timed_out = int(index)
                w.proc.kill()

    # -- an early stop -----------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for the chunks in flight and drop their results (the caller stopped early)."""
        self.books.source.exhausted = True
        self.books.redo.clear()
        for chunk in list(self.ledger.held_chunks()):
            self.ledger.untrack(chunk)
            with contextlib.suppress(OSError):
                self.workers.workers[chunk.slot].chan.send_control(Drop(chunk.id))
        while self.ledger:
            self.workers.wait_and_handle(self._wait_time(), self._discard)
            self._check_timeouts()

    def _discard(self, w: Worker, msg: Any) -> None:
        if msg is None:
            self.ledger.forget(w)
            self.workers.respawn(w.slot)
            return
        if isinstance(msg, Sent):
            w.holding.pop(msg.chunk_id, None)
            return
        if isinstance(msg, Unreadable):
            if not w.outstanding:
                return
            chunk_id = min(w.outstanding)
        else:
            chunk_id = msg.chunk_id
        chunk = self.ledger.live.get(chunk_id) or w.outstanding.get(chunk_id)
        if chunk is not None:  # (for BadOutput, w is its sender, not where it is queued)
            self.ledger.untrack(chunk)
        if isinstance(msg, Held):
            with contextlib.suppress(OSError):
                w.chan.send_control(Drop(chunk_id))

    def let_go(self) -> None:
        """Drop the input and results once the run is over (stats() keeps the counters)."""
        self.books.source = _Ended()
        self.books.clear()
        self.ledger.clear()


class _Ended(Source):
    exhausted = True

    def take(self, n: int) -> Sequence[Any]:
        return []
