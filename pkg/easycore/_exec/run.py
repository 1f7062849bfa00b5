"""One ``map``/``imap`` on worker processes: the loop of named steps that moves chunks.

Work moves in chunks of consecutive first-hop items; results come back per chunk and are
yielded as segments ``(start index, [results])``, so the per-item cost in the caller is a
list append, not a message. Each turn of :meth:`Run.loop`::

    dispatch      route held chunks to the next hop's workers that have room, give segment
                  releases back to last-hop workers, send new chunks to first-hop workers
    deliver       yield what is ready (in input order with ordered=True)
    wait          for a pipe, a process sentinel or (submit) the wake-up socket
    on_message    Done / Held / Sent / BadOutput / Unreadable, or on_death for a gone worker
    check_timeouts

Guarantees kept here: backpressure (at most ``window()`` items taken from the source and not
yet yielded), exactly-once (the ledger knows where every chunk is; a dead worker's chunks
re-run under new ids, a late reply for an old id is dropped), ordering (segments keyed by
start index), and the fault matrix (which item to blame for a death or a timeout, retries
charged per unit, errors raised with the stage and item named).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import cloudpickle

from easycore._errors import (
    EasycoreError,
    SerializationError,
    after_retries,
    item_label,
    short_repr,
)
from easycore._exec.blame import assign_blame, death_error, requeue
from easycore._exec.ledger import Chunk, Ledger
from easycore._exec.plan import Chain, StageStats
from easycore._exec.sizing import ChunkSizer
from easycore._exec.sources import Source
from easycore._exec.workers import Worker, WorkerSet
from easycore._options import DEFAULT_PREFETCH, RunOptions
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

__all__ = ["Failed", "Run"]


class Failed:
    """A unit that failed in a tolerant run (``submit``, ``errors="skip"``), delivered in place
    of its result: the error it would have raised, its first-hop item(s), its stage."""

    __slots__ = ("exc", "item", "stage")

    def __init__(self, exc: BaseException, item: Any = None, stage: str = "") -> None:
        self.exc = exc
        self.item = item
        self.stage = stage


class Run:
    """The state of one run on an active worker set.

    Args:
        workers: the runner's processes.
        source: the items (batches already formed when the first hop takes batches).
        options: the run's options.
        ids: chunk ids, shared by every run of the runner.
        tolerant: a failed unit (an output of the last hop: an item, or a batch) is delivered
            as a :class:`Failed` in place of its result and the run goes on (``submit``:
            it fails its own future; ``errors="skip"``: it is set aside).
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
        tolerant: bool = False,
        bars: list[Any] | None = None,
        is_current: Callable[[], bool] = lambda: True,
    ) -> None:
        self.workers = workers
        self.chain: Chain = workers.chain
        self.hops = self.chain.hops
        self.align = self.chain.align  # chunks hold whole units of every hop
        self.source = source
        self.options = options
        self.tolerant = tolerant
        # chunks each worker may hold: queued, running, or done and waiting for us (prefetch)
        self.depth = options.prefetch or DEFAULT_PREFETCH
        # workers are replaced after n items or past a memory bound (long jobs)
        self.recycling = (
            options.max_items_per_worker is not None or options.max_worker_memory is not None
        )
        self.bars = bars
        self.is_current = is_current
        n = options.numbering
        self.numbering = (0, 1) if n is None else (n.first, n.step)
        self.ledger = Ledger(workers, ids, len(self.hops), options.ordered)
        self.pulled = 0  # items taken from the source so far (the next item's index)
        self.redo: deque[tuple[int, Sequence[Any]]] = deque()
        self.attempts: dict[tuple[int, int], int] = {}  # (hop, unit index) -> runs charged
        # results, and how many first-hop items they stand for
        self.segments: dict[int, tuple[list[Any], int]] = {}  # ordered: by start index
        self.ready: deque[tuple[int, list[Any], int]] = deque()  # unordered: as they come
        self.next_out = 0
        self.taken = 0  # items pulled from the source and not yet yielded
        self.sizers = [ChunkSizer() for _ in self.hops]
        self.chunk_size = self.align
        self.done = [0] * len(self.hops)
        self.busy_seconds = [0.0] * len(self.hops)
        self.started = time.monotonic()
        self.finished: float | None = None
        # slot -> deaths in a row that charged no item (a delivered chunk starts the count again)
        self.idle_deaths: dict[int, int] = {}

    # -- insight -----------------------------------------------------------------------------
    def stats(self) -> list[StageStats]:
        wall = max((self.finished or time.monotonic()) - self.started, 1e-9)
        out = []
        for hop in self.hops:
            h = hop.index
            workers = [w for w in list(self.workers.workers) if w.hop == h]
            # snapshots: another thread (a submit run) may be changing these
            queued = sum(len(c.items) for w in workers for c in list(w.outstanding.values()))
            waiting = sum(len(c.items) for c in list(self.ledger.waiting[h]))
            busy = self.busy_seconds[h] / (wall * len(hop.devices))
            out.append(
                StageStats(
                    hop.name,
                    hop.devices,
                    done=self.done[h],
                    busy=min(1.0, busy),
                    queued=-(-queued // hop.unit),
                    waiting=-(-waiting // hop.unit),
                )
            )
        return out

    def _label(self, hop: int, index: int) -> str:
        return self.chain.label(hop, index, self.options)

    def _index(self, hop: int, index: int) -> int:
        """A unit's index as errors report it (of the whole input, for the first hop)."""
        return self.options.global_index(index) if hop == 0 else index

    # -- the loop ----------------------------------------------------------------------------
    def loop(self) -> Iterator[tuple[int, list[Any]]]:
        """Yield segments ``(index of the first item, results)`` until the run is done."""
        try:
            while True:
                # Refill before yielding (the workers compute while the caller folds results)
                # and after (yielding frees room): never wait with room and nothing in flight.
                # With a result ready, only a chunk per worker goes out first: after a pause
                # the caller finds many results at once, and the rest of the refill waits
                # for its next call rather than delay the result it came for.
                self.dispatch(len(self.workers.workers) if self._deliverable() else None)
                yield from self.deliver()
                if not self.is_current():
                    msg = "the runner was closed while this run had items pending"
                    raise RuntimeError(msg)
                self.dispatch()
                if self.source.should_end(self._settled()):
                    return
                if not self.ledger:
                    if self.source.exhausted and self._settled():
                        return
                    self._check_stalled()
                self.wait()
        finally:
            self.finished = time.monotonic()

    def _deliverable(self) -> bool:
        return self.next_out in self.segments if self.options.ordered else bool(self.ready)

    def _settled(self) -> bool:
        """Nothing in flight, to re-run, or to yield."""
        return not (self.ledger or self.redo or self.segments or self.ready)

    def _check_stalled(self) -> None:
        if self.source.wakeup() is not None and not self.source.exhausted:
            return  # idle until the next submit
        if all(w.ready and not w.retiring for w in self.workers.workers):
            # Nothing in flight, every worker idle, yet work remains: waiting would hang
            # forever, so fail loudly instead (this is a bug in easycore). (A worker being
            # replaced comes back: its goodbye wakes us.)
            msg = f"easycore internal error: stalled with {self.taken} item(s) pending"
            raise EasycoreError(msg)

    def wait(self) -> None:
        """Wait for the next message, death or submitted item; handle it; enforce timeouts."""
        wake = self.source.wakeup()
        self.workers.wait_and_handle(
            self._wait_time(), self.on_message, () if wake is None else (wake,)
        )
        if wake is not None:
            self.source.drain_wakeups()
        self._check_timeouts()

    def deliver(self) -> Iterator[tuple[int, list[Any]]]:
        if self.options.ordered:
            while self.next_out in self.segments:
                start = self.next_out
                values, n = self.segments.pop(start)
                self.taken -= n
                self.next_out += n
                yield start, values
        else:
            while self.ready:
                start, values, n = self.ready.popleft()
                self.taken -= n
                yield start, values

    def _store(self, start: int, values: list[Any], n: int) -> None:
        if self.options.ordered:
            self.segments[start] = (values, n)
        else:
            self.ready.append((start, values, n))

    # -- dispatch ----------------------------------------------------------------------------
    def window(self) -> int:
        """How many items may be taken from the source and not yet yielded (backpressure).

        One chunk per worker beyond what the workers hold: new work can go out while the
        results just received still wait to be yielded.
        """
        n = len(self.workers.workers)
        depth = self.depth
        return max((depth + 1) * n * self.chunk_size, 2 * depth * n * self.align)

    def _floor(self) -> int:
        return min((s.floor() for s in self.sizers if s.per_item is not None), default=1)

    def _resize(self, hop: int, n: int, elapsed: float, nbytes: int) -> None:
        self.sizers[hop].update(n, elapsed, nbytes)
        self._resize_to_sizers()

    def _resize_to_sizers(self) -> None:
        if any(s.per_item is None for s in self.sizers):
            return  # a hop not yet measured may be the slow one: no big chunks before then
        size = min(s.size for s in self.sizers)
        self.chunk_size = max(self.align, size - size % self.align)

    def _take(self, limit: int | None = None) -> tuple[int, Sequence[Any]] | None:
        """The next chunk: one to re-run, or new items (``limit``: at most that many)."""
        if self.redo:
            return self.redo.popleft()
        room = min(self.chunk_size, self.window() - self.taken)
        if limit is not None:
            room = min(room, max(limit, self.align))
        total = self.source.total
        if total is not None:
            # A known length: chunks shrink as the input runs out ("guided" scheduling), so
            # the workers finish together instead of one waiting on the other's last chunk.
            share = -(-(total - self.pulled) // (2 * len(self.hops[0].devices)))
            room = min(room, max(share, self._floor()))
        if room <= 0 or self.source.exhausted:
            return None
        if self.align > 1:
            room = max(self.align, room - room % self.align)
        items = self.source.take(room)
        if not items:
            return None
        start = self.pulled
        self.pulled += len(items)
        self.taken += len(items)
        return start, items

    def dispatch(self, most_chunks: int | None = None) -> None:
        """Route held chunks on, give releases back, replace workers due for it (once they
        hold no chunk), then send new chunks to the first hop (at most ``most_chunks``)."""
        self._route()
        self._give_back()
        if self.recycling:
            for w in self.workers.workers:
                if w.retiring and not (w.stopping or w.outstanding or w.holding):
                    self.workers.retire(w)
        timed = self.options.timeout is not None
        most = self.options.max_items_per_worker
        # One chunk at a time to the worker holding the fewest, so consecutive chunks go to
        # different workers: an ordered stream is then fed by all of them at once, not by one
        # worker working through a deep queue of consecutive chunks while the others' results
        # wait behind it (a deep prefetch would otherwise starve the caller).
        open_ = [w for w in self.workers.of_hop(self.hops[0]) if w.has_room(self.depth)]
        sent = 0
        while open_ and (most_chunks is None or sent < most_chunks):
            w = min(open_, key=lambda w: len(w.outstanding))
            limit = None
            if most is not None:  # a worker takes no more than it may still run
                limit = most - w.units_done - sum(len(c.items) for c in w.outstanding.values())
                if limit <= 0:
                    open_.remove(w)
                    continue
            taken = self._take(limit)
            if taken is None:
                return
            start, items = taken
            chunk_id = next(self.ledger.ids)
            task = Task(
                chunk_id,
                self.options.seed,
                start,
                items,
                timed,
                self.options.retries,
                self._spent(start, len(items)),
                self.numbering,
                self.options.resume is not None,
            )
            try:
                frame = w.chan.encode(task)
            except Exception as exc:
                if not self.tolerant:
                    self._unpicklable(start, items, exc)
                self._fail_unpicklable(start, items)
                continue
            self.ledger.send(chunk_id, start, items, w)
            try:
                w.chan.send_frame(frame)
            except OSError:
                open_.remove(w)  # it is dying; its sentinel will tell us and we re-queue
                continue
            sent += 1
            if not w.has_room(self.depth):
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

    def _spent(self, start: int, n: int) -> dict[tuple[int, int], int]:
        """Runs already charged to units of a chunk (by deaths), for the worker's retries."""
        if not self.attempts:
            return {}
        end = start + n
        return {
            (h, i): k for (h, i), k in self.attempts.items() if start <= i * self.hops[h].unit < end
        }

    def _route(self) -> None:
        """Send chunks finished by hop h to workers of hop h + 1 that have room."""
        books = self.workers.workers
        for h in range(len(self.hops) - 2, -1, -1):
            held = self.ledger.waiting[h]
            targets = self.workers.of_hop(self.hops[h + 1])
            while held:
                room = [t for t in targets if t.has_room(self.depth)]
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

    # -- tolerant runs: failures by output unit ----------------------------------------------
    # An output unit is what the last hop makes of `align` consecutive first-hop items (one
    # item without batching pools); it is what a tolerant run delivers or fails as a whole.
    def _unit_items(self, items: Sequence[Any], start: int, unit: int) -> Any:
        """The first-hop item(s) of output unit ``unit`` among ``items`` (from ``start``)."""
        a = unit * self.align - start
        return items[a] if self.align == 1 else list(items[a : a + self.align])

    def _fail_unit(self, unit: int, error: BaseException, item: Any, stage: str) -> None:
        """Deliver output unit ``unit`` as a failure, in its place in the stream."""
        self._store(unit * self.align, [Failed(error, item, stage)], self.align)

    def _rerun_units(
        self, items: Sequence[Any], start: int, failed: dict[int, Failed] | set[int]
    ) -> None:
        """Run the output units of ``items`` not in ``failed`` again, one unit per chunk."""
        for a in range(0, len(items), self.align):
            if (start + a) // self.align not in failed:
                self.redo.append((start + a, items[a : a + self.align]))

    def _fail_unpicklable(self, start: int, items: Sequence[Any]) -> None:
        """Tolerant runs: the units whose items do not pickle fail; the others go again."""
        for a in range(0, len(items), self.align):
            unit = (start + a) // self.align
            for k in range(a, min(a + self.align, len(items))):
                try:
                    cloudpickle.dumps(items[k])
                except Exception as inner:
                    msg = f"item {start + k} cannot be pickled to reach a worker: {inner}"
                    index = self._index(0, start + k)
                    error = SerializationError(msg, "<item pickling>", None, None, index)
                    error.__cause__ = inner
                    self._fail_unit(
                        unit, error, self._unit_items(items, start, unit), self.hops[0].name
                    )
                    break
            else:
                self.redo.append((start + a, items[a : a + self.align]))

    def _unpicklable(self, start: int, items: Sequence[Any], exc: Exception) -> NoReturn:
        for k, item in enumerate(items):
            try:
                cloudpickle.dumps(item)  # a probe: must not consume releases
            except Exception as inner:
                label = self.options.label(start + k)
                msg = (
                    f"{label} cannot be pickled to reach a worker: {inner} "
                    f"(item: {short_repr(item)})"
                )
                index = self._index(0, start + k)
                raise SerializationError(msg, "<item pickling>", None, None, index) from inner
        raise SerializationError(f"a chunk of items cannot be pickled: {exc}") from exc

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
                self.sizers[w.hop].limit_bytes(len(chunk.items), msg.nbytes)
                self._resize_to_sizers()
        elif isinstance(msg, BadOutput):
            self._on_bad_output(w, msg)
        elif isinstance(msg, Unreadable):
            self._on_unreadable(w, msg)

    def _raise_report(
        self, w: Worker, report: ErrorReport, hop: int, index: int, what: str
    ) -> NoReturn:
        raise report.to_error(
            what=what, device=w.device, worker=w.index, index=self._index(hop, index)
        )

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
        h = w.hop
        n = msg.n_done if isinstance(msg, Held) else len(msg.values)
        self.done[h] += n
        self.busy_seconds[h] += msg.elapsed
        if self.bars is not None:
            self.bars[h].update(n)
        self._resize(h, len(chunk.items), msg.elapsed, 0 if held else w.last_nbytes)
        self._check_health(w, n)
        errors = msg.errors
        if errors and not self.tolerant:
            k, report = min(errors, key=lambda e: e[0])
            index = chunk.start // self.hops[h].unit + k
            what = f"while running {self._label(h, index)}{after_retries(self.options.retries)}"
            self._raise_report(w, report, h, index, what)
        if isinstance(msg, Held):
            if errors:
                self._fail_held(w, chunk, errors)
            else:
                self.ledger.hold(chunk, w)
            return
        values = msg.values
        if errors:  # (the last hop's units are output units)
            values = list(values)
            for unit, failed in self._failures(w, chunk, errors).items():
                values[unit - chunk.start // self.align] = failed
        self.ledger.finish(chunk)
        self._store(chunk.start, values, len(chunk.items))

    def _check_health(self, w: Worker, n: int) -> None:
        """Mark a worker for replacement after ``max_items_per_worker`` units, or once its
        resident memory passed ``max_worker_memory`` (it finishes the chunks it has)."""
        if not self.recycling:
            return
        w.units_done += n
        most, memory = self.options.max_items_per_worker, self.options.max_worker_memory
        due = most is not None and w.units_done >= most
        w.retiring = due or (memory is not None and w.resident_bytes() > memory)

    def _on_bad_output(self, w: Worker, msg: BadOutput) -> None:
        chunk = self.ledger.live.get(msg.chunk_id)
        if chunk is None:
            return
        if self.tolerant:  # fail that unit; the chunk's others run again
            self.ledger.untrack(chunk)
            self._fail_held(w, chunk, [(msg.position, msg.error)])
            return
        index = chunk.start // self.hops[w.hop].unit + msg.position
        what = f"while sending {self._label(w.hop, index)} to the next stage"
        self._raise_report(w, msg.error, w.hop, index, what)

    def _on_unreadable(self, w: Worker, msg: Unreadable) -> None:
        if not w.outstanding:
            text = f"a chunk could not be unpickled in worker {w.index} on {w.device}"
            raise SerializationError(text)
        chunk = w.outstanding[min(w.outstanding)]
        unit = self.hops[w.hop].unit
        first, last = chunk.start // unit, (chunk.end - 1) // unit
        what = (
            f"while unpickling {self._label(w.hop, first)} .. "
            f"{item_label(last, None)} in the worker"
        )
        error = msg.error.to_error(
            what=what,
            device=w.device,
            worker=w.index,
            index=self._index(w.hop, first),
            cls=SerializationError,
        )
        if not self.tolerant:
            raise error
        # tolerant: the chunk's units fail (which one is unknown), the run goes on
        self.ledger.untrack(chunk)
        for a in range(0, len(chunk.items), self.align):
            unit = (chunk.start + a) // self.align
            items = self._unit_items(chunk.items, chunk.start, unit)
            self._fail_unit(unit, error, items, self.hops[w.hop].name)

    def _failures(
        self, w: Worker, chunk: Chunk, errors: list[tuple[int, ErrorReport]]
    ) -> dict[int, Failed]:
        """Tolerant runs: what ``w`` reported for units of ``chunk`` (at its hop), as
        failures of the output units they belong to."""
        per = self.hops[w.hop].unit
        out: dict[int, Failed] = {}
        for k, report in errors:
            index = chunk.start // per + k  # a unit of w's hop
            what = f"while running {self._label(w.hop, index)}"
            error = report.to_error(
                what=what, device=w.device, worker=w.index, index=self._index(w.hop, index)
            )
            unit = index * per // self.align
            stage = self.hops[w.hop].name if report.stage.startswith("<") else report.stage
            item = self._unit_items(chunk.items, chunk.start, unit)
            out.setdefault(unit, Failed(error, item, stage))
        return out

    def _fail_held(self, w: Worker, chunk: Chunk, errors: list[tuple[int, ErrorReport]]) -> None:
        """Tolerant runs: units of a chunk failed before its last hop; the other output units
        of the chunk did not move on: they run again from the start."""
        failed = self._failures(w, chunk, errors)
        self.ledger.live.pop(chunk.id, None)
        for unit, failure in failed.items():
            self._store(unit * self.align, [failure], self.align)
        self._rerun_units(chunk.items, chunk.start, failed)

    # -- deaths ----------------------------------------------------------------------------
    def on_death(self, w: Worker) -> None:
        """A worker is gone: blame what it held, charge retries, re-queue, respawn it."""
        running, lost = self.ledger.forget(w)
        assert self.workers.slots is not None
        unit = self.hops[w.hop].unit
        blame = assign_blame(w, self.workers.slots, running, lost, unit)
        exhausted = False
        for index in blame.charged:
            key = (w.hop, index)
            self.attempts[key] = self.attempts.get(key, 0) + 1
            exhausted = exhausted or self.attempts[key] > self.options.retries
        if not blame.charged:
            self.idle_deaths[w.slot] = self.idle_deaths.get(w.slot, 0) + 1
            exhausted = self.idle_deaths[w.slot] > self.options.retries
        spared: set[int] = set()  # tolerant: output units failed instead of re-run
        if exhausted:
            held = sum(len(c.items) for c in lost)
            error = death_error(w, blame, held, self.chain, self.options)
            if not self.tolerant:
                raise error
            culprit = blame.culprit
            for index in [culprit] if culprit is not None else blame.charged:
                out = index * unit // self.align
                if out in spared:
                    continue
                spared.add(out)
                chunk = next(c for c in lost if c.start <= out * self.align < c.end)
                items = self._unit_items(chunk.items, chunk.start, out)
                self._fail_unit(out, error, items, self.hops[w.hop].name)
        # Re-run what it had ahead of new input.
        self.redo.extendleft(reversed(requeue(lost, blame, unit, self.align, spared)))
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
                w.kill()

    # -- an early stop -----------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for the chunks in flight and drop their results (the caller stopped early)."""
        self.source.exhausted = True
        self.redo.clear()
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
        self.source = _Ended()
        self.redo.clear()
        self.segments.clear()
        self.ready.clear()
        self.ledger.clear()


class _Ended(Source):
    exhausted = True

    def take(self, n: int) -> Sequence[Any]:
        return []
