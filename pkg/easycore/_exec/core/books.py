"""The run core: one run's books, whatever runs the work (no processes, no Ray, no I/O).

Every engine is a transport under this core: it starts a hop's workers, sends them chunks
and reports what came back (done, held, died holding these chunks, timed out); the books
say what is taken from the input, what re-runs, what is charged, how failures become
results, and what is yielded in which order. So an option acts the same on every engine.

Units and segments, defined once:

* a run's *stream* is the input as the first hop sees it (items, or ``map``'s batches);
  a *first-hop unit* is one element of it, numbered from 0;
* a hop's unit is ``hop.unit`` consecutive first-hop units (a pool with ``batch_size``
  groups the previous hop's results); an *output unit* is the last hop's (``chain.align``
  first-hop units): what the caller receives as one result, or fails as a whole;
* a segment (``outcomes.Segment``) is ``(start, values)``: the results of consecutive
  output units, the first of which begins at first-hop unit ``start``. The runner's
  wrappers (``resume=``, ``errors="skip"``, the consumer's fold) read segments and nothing
  else.

A failed output unit becomes an ``outcomes.Failed`` in its place in the stream. The run's
:class:`ErrorPolicy` says what delivery does with it: ``skip`` (and ``submit``) deliver it,
``raise`` raises its error when delivery reaches it. So a run that raises raises the failure
of the first failed unit in delivery order (input order with ``ordered``), on every engine
and every run, however the workers' timing goes.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Protocol

import attrs

from easycore._errors import EasycoreError, ItemTimeout, WorkerError, after_retries, item_label
from easycore._exec.core.outcomes import Failed, Segment
from easycore._exec.core.plan import Chain, StageStats
from easycore._exec.core.protocol import UNREADABLE, Broken, is_cached
from easycore._exec.core.report import Recorder, Trace
from easycore._exec.core.sizing import (
    MAX_CHUNK,
    TARGET_CHUNK_SECONDS,
    WRITE_CHUNK_SECONDS,
    ChunkSizer,
)
from easycore._exec.core.sources import Source, source_of
from easycore._exec.core.stages import StageFailure
from easycore._longjobs.sinks import SinkError
from easycore._options import DEFAULT_PREFETCH, RunOptions

__all__ = [
    "PRIMED",
    "RAISE",
    "SKIP",
    "Charges",
    "ErrorPolicy",
    "RunBooks",
    "Transport",
    "Work",
    "stage_stats",
]


# The first thing a run's stream yields, once its work has started: the runner takes it at
# once, so work starts when imap() is called (and the stream's cleanup runs even if it is
# never iterated further).
PRIMED: Any = object()


@attrs.frozen
class ErrorPolicy:
    """What delivery does with a failed output unit: raise its error, or deliver it as a
    :class:`Failed` result.

    ``isolates``: before a unit whose fault is not pinned down fails, run it alone (a run
    that goes on must not fail an innocent neighbour; one that raises names the chunk).
    """

    name: str
    isolates: bool

    def stops(self, value: Any) -> bool:
        """Whether output unit ``value`` ends the run when delivery reaches it: every
        failure under ``raise``; under ``skip``, one whose error is the run's, whatever the
        item (a sink's ``SinkError``: its directory or key column), never set aside."""
        return type(value) is Failed and (
            not self.isolates or isinstance(value.exc.__cause__ or value.exc, SinkError)
        )

    def unplaced(self, error: BaseException) -> None:
        """A failure that stands for no unit (a death while holding none): raised under
        ``raise``; under ``skip`` the run goes on."""
        if not self.isolates:
            raise error


RAISE = ErrorPolicy("raise", isolates=False)
SKIP = ErrorPolicy("skip", isolates=True)  # errors="skip", and submit's futures


@attrs.define(eq=False, slots=True)
class Work:
    """Consecutive first-hop units to send: new input, or a re-run (``solo``: alone on each
    worker of its path, so that a death while it runs names it)."""

    start: int
    items: Sequence[Any]
    solo: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.items)


class Charges(Counter[tuple[int, int]]):
    """Runs charged to units by deaths and timeouts, keyed ``(hop, unit of that hop)``."""

    def __init__(self, chain: Chain) -> None:
        super().__init__()
        self.hops = chain.hops

    def charge(self, hop: int, unit: int) -> int:
        """One more run charged to ``unit`` of ``hop``; the runs charged so far."""
        self[hop, unit] += 1
        return self[hop, unit]

    def spent(self, start: int, end: int) -> dict[tuple[int, int], int]:
        """Runs charged to units within first-hop units ``[start, end)``, for a worker's own
        retries (a unit may retry ``retries`` minus what deaths used)."""
        return {(h, i): k for (h, i), k in self.items() if start <= i * self.hops[h].unit < end}


def _failed(error: BaseException, item: Any, stage: str) -> Failed:
    """A failed output unit; a run error names its stage and item (a worker knows the
    unit's index, not always its stage, never the caller's item)."""
    if isinstance(error, WorkerError):
        error.concerns(stage, item)
    return Failed(error, item, stage)


class Transport(Protocol):
    """What an engine does for one run under :meth:`RunBooks.stream`."""

    def dispatch(self, most_chunks: int | None = None) -> None:
        """Send chunks while the window has room (at most ``most_chunks``)."""

    def busy(self) -> bool:
        """Whether a chunk is out at a worker."""

    def wait(self) -> None:
        """Wait for what comes back (or a submitted item, or the clock) and handle it."""

    def drain(self) -> None:
        """The caller stopped early: wait for the chunks in flight and drop their results."""

    def close(self) -> None:
        """The run is over (done, failed or stopped; its books cleared): let go of its
        chunks."""


class RunBooks:
    """One run's books: input taken, re-runs, order of delivery, chunk sizes, counters.

    Args:
        chain: the pipeline's hops.
        source: the stream's units.
        options: the run's options.
        policy: what a failed output unit becomes.
        bars: one progress bar per hop, or None.
        fixed: every chunk this many output units (inline's), not sized by the clock.
        shares: a pool that waits (``concurrency=k``) gets chunks of at least ``k / shares``
            units: 16 where a chunk costs a message (a worker process), 1 where it costs a
            remote call (a Ray actor: about a millisecond of the caller's and the actor's).
        trace: the runner's trace (``trace=``), which the run adds its events to.
    """

    def __init__(
        self,
        chain: Chain,
        source: Source,
        options: RunOptions,
        policy: ErrorPolicy,
        bars: list[Any] | None = None,
        fixed: int | None = None,
        shares: int = 16,
        trace: Trace | None = None,
    ) -> None:
        self.chain = chain
        self.hops = chain.hops
        self.workers = len(chain.devices)
        self.align = chain.align  # chunks hold whole output units
        self.source = source
        self.options = options
        self.policy = policy
        self.bars = bars
        # chunks each worker may hold: queued, running, or done and waiting (prefetch; a
        # worker with concurrency=k counts k units as one)
        self.depth = options.prefetch or DEFAULT_PREFETCH
        n = options.numbering
        self.numbering = (0, 1) if n is None else (n.first, n.step)
        self.charges = Charges(chain)
        # A resumed stream (imap's state=) begins at first-hop unit `first`: every index,
        # seed and message is then the uninterrupted run's (see easycore._longjobs.position).
        self.first = options.first
        self.pulled = self.first  # first-hop units taken from the source (the next one's index)
        self.taken = 0  # first-hop units taken and not yet yielded
        self.redo: deque[Work] = deque()  # to run again, ahead of new input
        self.segments: dict[int, tuple[list[Any], int]] = {}  # ordered: by start
        self.ready: deque[tuple[int, list[Any], int]] = deque()  # unordered: as they come
        # under raise: starts of stored segments holding a Failed, which delivery raises
        self.raises: set[int] = set()
        self.next_out = self.first
        # a sink writes a file (or more) per chunk: chunks of ~0.5 s make fewer, bigger files
        hop = self.hops[-1]
        last = hop.stages[-1] if hop.stages else None
        sink: Any = last if getattr(last, "is_sink", False) is True else None
        self.writes = sink is not None
        seconds = WRITE_CHUNK_SECONDS if self.writes else TARGET_CHUNK_SECONDS
        self.sizers = [ChunkSizer(seconds) for _ in self.hops]
        # a sink that writes item keys (a key column, WebDataset's __key__) and a key=:
        # each chunk carries its units' keys to the worker that writes them
        wants_keys = sink is not None and (sink.key_column is not None or sink.kind == "webdataset")
        self.key_fn = options.key if wants_keys else None
        # whether the writing pool's units are batches (its batch_size, or the run's for a
        # first pool): from the run's configuration, never from a result's type
        self.batched = self.writes and (hop.batch if hop.index else options.batch_size) is not None
        # The least chunk, whole output units. A worker of a hop with concurrency=k holds up
        # to `depth x k` units (its k slots are shared by its chunks, each answered as it
        # ends): chunks of a sixteenth of k or more, so that a chunk held open by one slow
        # unit holds few others' results (on Ray, of k: there a chunk's call costs more than
        # a unit's wait saves).
        self.slots = max(h.concurrency for h in self.hops)  # (a worker of the widest hop)
        least = -(-self.slots // shares // self.align) * self.align
        if fixed is not None:
            least = fixed * self.align
        # a sink given rows_per_file: chunks of that many items (a row each, as a rule), the
        # last ones too (a file holds one chunk's rows: chunks sized by the clock made files
        # of a few rows)
        if sink is not None and sink.rows_per_file:
            units = sink.rows_per_file // (options.batch_size or 1)  # (first-hop units)
            least = max(least, units - units % self.align)
        self.least = self.chunk_size = least
        self.done = [0] * len(self.hops)
        self.busy = [0.0] * len(self.hops)
        self.started = time.monotonic()
        self.finished: float | None = None
        self.balancer: Any = None  # the self-sizing pools' (set by the scheduler)
        sizes = [h.size if h.bounds else len(h.devices) for h in self.hops]
        self.record = Recorder(chain, trace or Trace(None), sizes, self.started)

    def keys_of(self, units: Sequence[Any], start: int) -> tuple[bool, list[Any] | None] | None:
        """What the sink's worker is told of a chunk (its first-hop units ``units``, the
        first numbered ``start``): ``(batched, keys)``, ``keys`` the ``key=`` of each unit
        for a sink that writes keys (else None); None when neither matters.

        Raises:
            TypeError: ``key=`` returned something else than a str, an int or a tuple.
            WorkerError: ``key=`` raised (stage ``"key="``, naming the unit).
        """
        if self.key_fn is None:
            return (True, None) if self.batched else None
        from easycore._longjobs.resume import key_of

        keys = [
            None if is_cached(u) else key_of(self.options, self.key_fn, u, k)[0]
            for k, u in enumerate(units, start)
        ]
        return self.batched, keys

    # -- names and numbers -------------------------------------------------------------------
    def label(self, hop: int, index: int, last: int | None = None, within: Any = None) -> str:
        """Name unit ``index`` of hop ``hop`` in messages: ``"batch 2 (items 8..11)"``; or
        units ``index`` to ``last``: ``"item 3 .. item 9 of stage 'f'"`` (the stage named
        where there are hops), a batch with the items it holds when the chunk it is
        ``within`` is known (the input's last batch may hold fewer)."""

        def name(i: int, n: int | None = None) -> str:
            return self.options.label(i, n) if hop == 0 else item_label(i, self.hops[hop].batch, n)

        end = index if last is None else last
        size = None if within is None else self.size(hop, end, within)
        text = name(end, size) if end == index else f"{name(index)} .. {name(end, size)}"
        return f"{text} of stage {self.hops[hop].name!r}" if self.chain.named else text

    def size(self, hop: int, index: int, within: Any) -> int | None:
        """How many units of its input unit ``index`` of ``hop`` holds, a batch in chunk
        ``within`` (the input's last may hold fewer than ``batch_size``); else None."""
        if hop == 0:  # (items: no size; a batch is a list, a CACHED marker is not)
            batch = self.options.batch_size and within.items[index - within.start]
            return len(batch) if type(batch) is list else None
        unit = self.hops[hop].unit
        first = index * unit
        return -(-(min(first + unit, within.end) - first) // self.hops[hop - 1].unit)

    def index(self, hop: int, index: int) -> int:
        """A unit's index as errors report it (of the whole input, for the first hop)."""
        return self.options.global_index(index) if hop == 0 else index

    def unit_items(self, items: Sequence[Any], start: int, out: int) -> Any:
        """The first-hop unit(s) of output unit ``out`` among ``items`` (from ``start``)."""
        a = out * self.align - start
        return items[a] if self.align == 1 else list(items[a : a + self.align])

    def pins_down(self) -> bool:
        """Whether units under suspicion (a death that names none of them) run again one by
        one, so that only the one at fault is charged, retried or set aside; else (no
        retries, errors raised) they fail together at once."""
        return self.options.retries > 0 or self.policy.isolates

    # -- what goes out -----------------------------------------------------------------------
    def take(self, room: int, limit: int | None = None) -> Work | None:
        """The next chunk: a re-run, or new input (at most ``room`` units; ``limit``: at most
        that many for the worker it goes to)."""
        if self.redo:
            return self.redo.popleft()
        if self.raises:  # the run ends when delivery reaches it: nothing new is needed
            return None
        room = min(self.chunk_size, room)
        if limit is not None:
            room = min(room, max(limit, self.align))
        total = self.source.total
        if total is not None and room > self.least:  # (it never goes below the floor)
            # A known length: chunks shrink as the input runs out ("guided" scheduling), so
            # the workers finish together instead of one waiting on the other's last chunk.
            share = -(-(total - (self.pulled - self.first)) // (2 * len(self.hops[0].devices)))
            floor = min((s.floor() for s in self.sizers if s.per_item is not None), default=1)
            room = min(room, max(share, floor, self.least))
        if room <= 0 or self.source.exhausted:
            return None
        room = max(self.align, room - room % self.align)  # (whole output units)
        items = self.pull(room)
        if not items:
            return None
        work = Work(self.pulled, items)
        self.pulled += len(items)
        self.taken += len(items)
        return work

    def pull(self, room: int) -> Sequence[Any]:
        """``room`` units to run from the source (fewer at its end). ``CACHED`` markers
        (units a ledger or a resumed position holds) ride along uncounted, up to
        ``MAX_CHUNK`` units in all: a worker passes them on for nothing."""
        if not self.options.markers:
            return self.source.take(room)
        most = max(self.align, MAX_CHUNK - MAX_CHUNK % self.align)
        items: list[Any] = []
        fresh = 0
        while fresh < room and len(items) < most and not self.source.exhausted:
            more = self.source.take(min(room - fresh, most - len(items)))
            items += more
            fresh += self.runs(more)
        return items

    def runs(self, items: Sequence[Any]) -> int:
        """How many of ``items`` (first-hop units) a worker runs: not ``CACHED`` markers."""
        if not self.options.markers:
            return len(items)
        return sum(not is_cached(u) for u in items)

    def rerun(self, work: Work, skip: Collection[int] = ()) -> list[Work]:
        """``work``'s output units not in ``skip``, one chunk each (to run again)."""
        a = self.align
        return [
            Work(s, work.items[s - work.start : s - work.start + a], work.solo)
            for s in range(work.start, work.end, a)
            if s // a not in skip
        ]

    def again(self, works: Sequence[Work]) -> None:
        """Run ``works`` again, in this order, before anything else."""
        self.redo.extendleft(reversed(works))

    def resize(self) -> None:
        if any(s.per_item is None for s in self.sizers):
            return  # a hop not yet measured may be the slow one: no big chunks before then
        size = min(s.size for s in self.sizers)
        self.chunk_size = max(size - size % self.align, self.least)

    def count(
        self,
        hop: int,
        n: int,
        busy: float,
        items: Sequence[Any] = (),
        elapsed: float = 0.0,
        nbytes: int = 0,
        worker: int = 0,
    ) -> None:
        """``hop`` finished ``n`` of its units in ``busy`` slot-seconds of work (its wall
        time, with units in flight together counted each); a chunk of first-hop units
        ``items`` that took ``elapsed`` s (``nbytes`` back) sizes the chunks to come, by
        the units it ran (``CACHED`` markers cost nothing: they would make the next chunk
        everything left, for one worker); ``worker``: the pool's worker that ran it."""
        self.done[hop] += n
        self.busy[hop] += busy
        if self.bars is not None:
            self.bars[hop].update(n)
        ran = self.runs(items)
        self.sizers[hop].update(ran, elapsed, nbytes)  # (nothing ran: as it was)
        self.resize()
        self.record.span(hop, worker, time.monotonic(), elapsed, n)
        if self.balancer is not None:
            self.balancer.measure(hop, busy, ran)

    def resized(self, hop: int, r: Any) -> None:
        """Self-sizing pool ``hop`` changed its size (a ``sizing.Resize``)."""
        self.record.resized(self.started + r.at, hop, r.before, r.after, r.why)
        if self.bars is not None:
            self.bars[hop].set_description(f"{self.hops[hop].name} ({r.after} workers)")

    # -- what comes back ---------------------------------------------------------------------
    def store(self, start: int, values: list[Any], n: int, failed: bool = False) -> None:
        """Results of output units from first-hop unit ``start``, standing for ``n`` units
        (``failed``: a :class:`Failed` is among them)."""
        if failed and any(self.policy.stops(v) for v in values):
            self.raises.add(start)
        if self.options.ordered:
            self.segments[start] = (values, n)
        else:
            self.ready.append((start, values, n))

    def fail(self, out: int, error: BaseException, item: Any, stage: str) -> None:
        """Output unit ``out`` failed: a :class:`Failed` in its place in the stream."""
        self.store(out * self.align, [_failed(error, item, stage)], self.align, failed=True)

    def outputs(self, work: Work, values: list[Any], place: Callable[[int], Any]) -> None:
        """Store the last hop's values of ``work``, each
        :class:`~easycore._exec.core.protocol.Broken` (a unit of hop h that failed there) as
        a :class:`Failed` of its output unit: the error names it, and ``place(h)``: the
        device and index of the worker of hop h that it had. A Broken made in the caller
        (inline) holds the ``StageFailure`` itself: the error's cause is then the live
        exception."""
        out = []
        failed = False
        for value in values:
            if type(value) is Broken:
                hop, index, report = value.hop, value.unit, value.failure
                where = f" ({value.where})" if value.where else ""
                doing = "unpickling" if report.stage == UNREADABLE else "running"
                what = f"while {doing} {self.label(hop, index, within=work)}"
                what += f"{after_retries(self.options.retries)}{where}"
                at = self.index(hop, index)
                if isinstance(report, StageFailure):
                    error = report.to_error(what, at)
                    error.__cause__ = report.error
                else:
                    device, worker = place(hop)
                    error = report.to_error(what=what, device=device, worker=worker, index=at)
                if isinstance(error, ItemTimeout):  # (cancelled: no cause, as a killed item)
                    error.__cause__ = None
                item = self.unit_items(
                    work.items, work.start, index * self.hops[hop].unit // self.align
                )
                stage = self.hops[hop].name if report.stage.startswith("<") else report.stage
                value = _failed(error, item, stage)  # (a transport's "<...>": the hop's)
                failed = True
            out.append(value)
        self.store(work.start, out, len(work.items), failed)

    def deliverable(self) -> bool:
        return self.next_out in self.segments if self.options.ordered else bool(self.ready)

    def deliver(self) -> Iterator[Segment]:
        """What is ready, in input order with ``ordered``.

        Raises:
            Exception: under ``raise``, the error of the first failed output unit reached,
                once the units before it are delivered (not a sink's: its chunk's file holds
                the units after it too, so none of that chunk is committed).
        """
        while self.deliverable():
            if self.options.ordered:
                start = self.next_out
                values, n = self.segments.pop(start)
                self.next_out += n
            else:
                start, values, n = self.ready.popleft()
            self.taken -= n
            if start in self.raises:
                k = next(k for k, v in enumerate(values) if self.policy.stops(v))
                if k and not self.writes:
                    yield Segment(start, values[:k])
                raise values[k].exc
            yield Segment(start, values)

    def stream(
        self, transport: Transport, is_current: Callable[[], bool], ahead: bool = True
    ) -> Iterator[Any]:
        """:data:`PRIMED`, then segments until the run is done, ``transport`` moving the
        chunks (``ahead``: the first chunks go out before PRIMED, as soon as the caller
        primes the stream; inline, nothing runs ahead of the caller).

        Each turn refills before yielding (the workers compute while the caller folds
        results) and after (yielding frees room): it never waits with room and nothing in
        flight. With a result ready, only a chunk per worker goes out first: after a pause
        the caller finds many results at once, and the rest of the refill waits for its next
        call rather than delay the result it came for; while it takes such a stock, each call
        sends a chunk per worker before its result (the workers would otherwise sit idle
        until the stock is gone). An early stop (the caller closes the
        stream: ``break`` out of ``imap``) drains what is in flight, so the runner stays
        usable (a failure there closes the runner); however the run ends, the transport
        lets go of it.

        Raises:
            RuntimeError: ``is_current()`` turned False (the runner was closed under it).
        """
        record = self.record
        record.caller_s = 0.0
        try:
            if ahead:
                transport.dispatch()
            yield PRIMED
            back = time.monotonic()  # (the caller's time in next() is what it waits)
            while True:
                transport.dispatch(self.workers if self.deliverable() else None)
                for segment in self.deliver():
                    record.caller_s += time.monotonic() - back
                    yield segment
                    back = time.monotonic()
                    if self.deliverable() and is_current():  # a stock: refill as it goes
                        transport.dispatch(self.workers)
                if not is_current():
                    msg = "the runner was closed while this run had items pending"
                    raise RuntimeError(msg)
                transport.dispatch()
                # (nothing in flight, nor waiting to be re-run or yielded)
                settled = not (transport.busy() or self.redo or self.segments or self.ready)
                if self.source.should_end(settled) or (settled and self.source.exhausted):
                    return
                transport.wait()
        except GeneratorExit:
            self.finished = time.monotonic()  # (stats: the drain is not the run's time)
            if is_current():
                transport.drain()
            raise
        finally:
            self.finished = self.finished or time.monotonic()
            # the run is over: its input and results dropped (the counters stay, for stats;
            # a transport may serve a newer run by then)
            self.source = source_of(())
            for held in (self.redo, self.segments, self.ready, self.raises):
                held.clear()
            transport.close()
            try:
                record.trace.write()
            except OSError as exc:  # (the run's own outcome stands)
                warnings.warn(f"easycore could not write the trace: {exc}", stacklevel=2)

    def stalled(self) -> EasycoreError:
        """Work remains, yet nothing is in flight or can go out (a bug in easycore)."""
        return EasycoreError(f"easycore internal error: stalled with {self.taken} item(s) pending")


def stage_stats(
    books: RunBooks,
    queued: Sequence[int],
    waiting: Sequence[int],
    in_flight: Sequence[int],
    concurrent: bool = True,
) -> list[StageStats]:
    """Per hop: done, busy (of its slots' time), queued, in flight and waiting units.

    ``queued``: units at its workers and not finished, those in flight included (the
    engine's snapshot); ``count`` summed slot-seconds into ``busy``. ``concurrent``:
    False where units run one at a time whatever ``concurrency`` says (inline).
    """
    wall = max((books.finished or time.monotonic()) - books.started, 1e-9)
    workers = books.record.now[0]
    resizes = [
        [r for h_, r in books.balancer.resizes if h_ == h] if books.balancer else []
        for h in range(len(books.hops))
    ]
    out = []
    for h, hop in enumerate(books.hops):
        k = hop.concurrency if concurrent else 1
        held = books.record.worker_s[h] if hop.bounds else 0.0
        held = held if held > 0 else wall * len(hop.devices)
        out.append(
            StageStats(
                hop.name,
                ("cpu",) * workers[h] if hop.bounds else hop.devices,
                done=books.done[h],
                busy=min(1.0, books.busy[h] / (held * k)),
                queued=max(0, queued[h] - in_flight[h]),  # (snapshots taken apart)
                waiting=waiting[h],
                in_flight=in_flight[h],
                concurrency=k,
                resizes=tuple(resizes[h]),
            )
        )
    return out
