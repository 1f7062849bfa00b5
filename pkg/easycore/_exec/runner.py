"""``Runner``: workers for one pipeline that stay up across calls (the public facade), and
the one-shot runs of ``Pipeline.map``/``imap`` (:func:`run_map`, :func:`run_imap`).

The runner holds an engine (worker processes, or the calling process for ``"inline"``),
a :class:`~easycore._exec.submit.Seat` that lets one run at a time hold it, and the
lifecycle: ``activate`` (every ``init``), ``close`` (every ``end``), and the abort that any
error or Ctrl-C inside a run ends in (the runner is then closed, no process left).
"""

from __future__ import annotations

import _thread
import concurrent.futures
import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Any

import attrs

from easycore._devices import INLINE
from easycore._errors import EasycoreError, surfaced
from easycore._exec.core.books import PRIMED, RAISE, SKIP, ErrorPolicy
from easycore._exec.core.engine import Engine
from easycore._exec.core.fold import collect, fold
from easycore._exec.core.plan import (
    Chain,
    PipelineDef,
    StageStats,
    first_batch,
    frozen_cfg,
    plan_chain,
)
from easycore._exec.core.report import PoolReport, Report, Trace, report
from easycore._exec.core.sources import LiveSource, batched, items_of
from easycore._exec.inline import InlineEngine
from easycore._exec.process.engine import ProcessEngine
from easycore._exec.process.startup import check_capacity
from easycore._exec.submit import Seat
from easycore._longjobs.commit import check_sink, commit_written, committing, sink_of, total_written
from easycore._longjobs.position import Position, check_state, drop_passed, mark_passed, start_at
from easycore._longjobs.resume import RunIdentity, RunLedger, check_ledger
from easycore._longjobs.sinks import Sink
from easycore._longjobs.skip import set_aside
from easycore._options import (
    DEFAULT_PREFETCH,
    RunKwargs,
    RunOptions,
    check_concurrency,
    check_count,
    run_options,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ABORT_GRACE", "Runner", "StageStats", "count_units", "run_imap", "run_map"]

ABORT_GRACE = 2.0  # seconds a worker gets to run `end` after an error or Ctrl-C
ENGINES = ("local", "ray")

Segments = Iterator[tuple[int, list[Any]]]


def _make_engine(
    runner: Runner,
    devices: Any,
    start_method: str | None,
    wait: bool,
    tasks: bool,
    concurrency: int,
    cpus: int | None,
) -> Engine:
    """The engine of ``runner``: Ray, the calling process (``"inline"``, or nothing to run in
    workers) or worker processes; its chain planned (an impossible device: ``ValueError``).

    ``wait`` False: a one-shot map's runner sends work to each worker as soon as it is ready
    instead of after the slowest one (init errors surface in the map). ``tasks``: a one-shot
    run that keeps no worker state (on Ray, init-less pools run as tasks). ``concurrency``:
    items each worker of the pool ``devices`` describes holds at once; ``cpus``: the budget
    of the pools that size themselves.
    """
    if runner.engine == "ray" and runner.pipeline.producers:
        if isinstance(devices, str) and devices == INLINE:
            msg = "devices='inline' runs in this process; it does not go with engine='ray'"
            raise ValueError(msg)
        from easycore._exec.ray.engine import RayEngine  # imports ray: only here

        # connects: "auto" counts it
        return RayEngine(runner.pipeline, devices, runner.cfg, concurrency, tasks, cpus)
    chain = plan_chain(runner.pipeline, devices, concurrency=concurrency, cpus=cpus)
    if chain.named and start_method == "fork" and runner.engine == "local":
        msg = (
            "a pipeline with several pools (.on) needs start_method 'forkserver' or "
            "'spawn': with 'fork', workers inherit each other's pipes"
        )
        raise ValueError(msg)
    if INLINE in chain.devices or not runner.pipeline.producers:
        return InlineEngine(chain, runner.cfg)
    check_capacity(len(chain.peak))
    return ProcessEngine(chain, runner.cfg, start_method, wait)


class Runner:
    """Workers for one pipeline that stay up across calls; made by ``Pipeline.open``.

    ``init`` runs once per worker when the runner activates, ``end`` at :meth:`close`.
    ``map``/``imap`` may be called any number of times, one at a time. After an error or
    Ctrl-C inside a call the runner is closed (``is_active`` is False, no process left);
    :meth:`activate` starts it again.

    Args:
        pipeline: the pipeline whose stages the workers run.
        devices: the devices of producers not bound with ``.on``, as ``map`` takes them.
        cfg: a mapping or ``CfgNode``, injected frozen as ``cfg``.
        start_method: None (default): a fork of this process where safe, else the
            forkserver; or ``"forkserver"``, ``"spawn"``, ``"fork"``.
        prefetch: chunks each worker may hold for a run (default 2; see :meth:`imap`).
        engine: ``"local"`` (worker processes here) or ``"ray"`` (Ray actors).
        epoch: the epoch of the runner's ``map``/``imap`` calls that do not give one.
        concurrency: items each worker of the pool ``devices`` describes holds at once.
        cpus: the CPU budget of the pools that size themselves (``.on((lo, hi))``).
        trace: a path: a Chrome Trace Event file of the runner's runs, written as each ends.

    Raises:
        ValueError: a bad argument or an impossible device, before any process starts.
        WorkerError: an ``init`` raised.

    >>> from easycore import producer
    >>> @producer
    ... def inc(x):
    ...     return x + 1
    >>> with inc.open(devices="inline") as runner:
    ...     runner.map([1, 2])
    [2, 3]
    """

    def __init__(
        self,
        pipeline: PipelineDef,
        devices: Any = "auto",
        *,
        cfg: Mapping[str, Any] | None = None,
        start_method: str | None = None,
        prefetch: int | None = None,
        engine: str = "local",
        epoch: int = 0,
        concurrency: int = 1,
        cpus: int | None = None,
        trace: str | os.PathLike[str] | None = None,
        _wait: bool = True,
        _tasks: bool = False,
    ) -> None:
        RunOptions(prefetch=prefetch, epoch=epoch)  # checked as a run's options are
        check_concurrency(concurrency)
        check_count("cpus", cpus)
        if trace is not None and not isinstance(trace, str | os.PathLike):
            msg = f"trace must be a path (str or os.PathLike) or None, got {trace!r}"
            raise TypeError(msg)
        self.trace = Trace(trace)
        self.epoch = epoch  # the epoch of runs that do not name one
        if engine not in ENGINES:
            msg = f"engine must be one of {ENGINES}, got {engine!r}"
            raise ValueError(msg)
        self.pipeline = pipeline
        self.engine = engine
        # chunks each worker may hold for a run (queued, running, or done and waiting)
        self.prefetch = prefetch or DEFAULT_PREFETCH
        self.cfg = frozen_cfg(cfg)
        self._engine = _make_engine(self, devices, start_method, _wait, _tasks, concurrency, cpus)
        self._engine.trace = self.trace
        self._chain = self._engine.chain
        self._sink: Sink | None = sink_of(self._chain.last.stages)  # easycore.write, or None
        if self._sink is not None:  # (before any worker starts)
            check_sink(self._sink, self._engine.in_caller)
        self.devices: tuple[str, ...] = self._chain.devices
        self._seat = Seat()
        self._imap = False  # the last run was an imap (the report has the caller's wait)
        self._active = False
        self._generation = 0  # +1 per activate(): a run of an earlier activation must stop
        self.activate()

    # -- public state ------------------------------------------------------------------------
    @property
    def is_active(self) -> bool:
        """True between :meth:`activate` and :meth:`close`."""
        return self._active

    @property
    def n_workers(self) -> int:
        """How many workers this runner has, over all its pools (1 for ``"inline"``)."""
        return 1 if INLINE in self.devices else len(self.devices)

    def __repr__(self) -> str:
        where = str(list(self.devices))
        if self._chain.named:
            pools = [f"{h.name}: {h.bounds or list(h.devices)}" for h in self._chain.hops]
            where = "{" + ", ".join(pools) + "}"
        return f"<Runner {self.pipeline!r} on {where} ({'active' if self._active else 'closed'})>"

    def stats(self) -> list[StageStats]:
        """Per pool, for the run under way or the last one: what is done, busy and queued.

        The pool whose workers are busy near 100% while the pool before it has results
        waiting is the bottleneck; give it more devices.

        Returns:
            One :class:`~easycore.StageStats` per pool, in pipeline order.
        """
        return self._engine.stats()

    def report(self) -> Report:
        """Where the time of the run under way (or the last one) goes: per pool its items a
        second, workers, busy share, share of time with nothing to do and share of time its
        results waited for the next pool; the pool that limits the run; for an ``imap``,
        the share of your loop's time spent waiting in ``next()``. ``str()`` of it is a
        few sentences.

        Returns:
            An :class:`~easycore.Report`.
        """
        books = self._engine.books
        stats = self.stats()
        if books is None:
            idle = tuple(PoolReport(s.name, s.workers, 0.0, 0.0, 0.0, 0.0) for s in stats)
            return Report(idle, 0.0, 0.0, None)
        seconds = (books.finished or time.monotonic()) - books.started
        workers = [s.workers for s in stats]
        return report(
            self._chain, books.record, books.done, books.busy, workers, seconds, self._imap
        )

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        # Leaving early (GeneratorExit from an abandoned imap) is a normal close, not an error.
        if exc[0] is None or exc[0] is GeneratorExit:
            self.close()
        else:
            self._abort()

    # -- lifecycle ---------------------------------------------------------------------------
    def activate(self) -> None:
        """Start the workers and run every producer's ``init``; no-op when already active.

        Raises:
            WorkerError: an ``init`` raised (no worker is left running).
            WorkerDied: a worker died while starting.
            SerializationError: a stage function or ``cfg`` cannot be pickled.
        """
        if self._active:
            return
        self._generation += 1  # a leftover run of the previous activation sees it and ends
        self._seat.stop_leftover(ABORT_GRACE + 3.0)
        t0 = time.perf_counter()
        self._engine.start()
        self._active = True
        self.startup_seconds = time.perf_counter() - t0

    def close(self) -> None:
        """Run every worker's ``end`` and stop the workers; idempotent.

        Raises:
            WorkerError: an ``end`` raised (the workers are stopped all the same).
            WorkerDied: a worker died during ``end``.
        """
        try:
            self._seat.stop_feeder(abort=False)  # submitted items finish first
        except BaseException:
            self._abort()
            raise
        if self._active:
            self._active = False
            self._engine.stop(grace=None, report=True)

    def _abort(self) -> None:
        """Stop everything now after an error or interrupt: ``end`` gets a short grace (and
        ``trace=``'s file holds what ran, whatever run was cut short)."""
        self._seat.stop_feeder(abort=True, timeout=ABORT_GRACE + 3.0)
        self._active = False
        try:
            self._engine.stop(grace=ABORT_GRACE, report=False)
        finally:
            with contextlib.suppress(OSError):
                self.trace.write()

    # -- running -----------------------------------------------------------------------------
    @surfaced
    def map(self, data: Iterable[Any], *positional: Any, **options: Unpack[RunKwargs]) -> Any:
        """Run ``data`` through the pipeline on this runner's workers.

        The options are :class:`~easycore.RunKwargs`, as for :meth:`Pipeline.map
        <easycore.Pipeline.map>` (``ordered``, ``batch_size``, ``progress``, ``seed``,
        ``timeout`` and ``retries`` also by position); ``prefetch`` overrides the runner's for
        this run (see :meth:`imap`).

        Args:
            data: any iterable, consumed lazily.
            *positional: ``ordered``, ``batch_size``, ``progress``, ``seed``, ``timeout``,
                ``retries`` by position, in that order.
            **options: the run's options, each described in :class:`~easycore.RunKwargs`
                (``epoch`` None: the runner's; ``state`` is for :meth:`imap`).

        Returns:
            The consumer's result, or a list of the producers' results without a consumer.

        Raises:
            RuntimeError: the runner is closed (call ``activate()``) or busy.
            TypeError, ValueError: a bad option, before any item is sent.
            WorkerError: user code raised (``ItemTimeout``, ``SerializationError`` and
                ``WorkerDied`` are kinds of it: any failure of the items).
            WorkerDied: a worker process died.
        """
        return self.run_map(data, run_options("map", positional, options, self.epoch))

    def _settle(self, options: RunOptions) -> RunOptions:
        """The run's options with the runner's defaults filled in."""
        return attrs.evolve(
            options,
            batch_size=first_batch(self.pipeline, options.batch_size),
            prefetch=options.prefetch or self.prefetch,
        )

    def run_map(self, data: Iterable[Any], options: RunOptions) -> Any:
        """:meth:`map` with its options as one value (for easycore's own callers).

        Args:
            data: the items.
            options: the run's options.

        Returns:
            As :meth:`map`.

        Raises:
            WorkerError: as :meth:`map` (and every error :meth:`map` lists).
        """
        self._imap = False
        options = self._settle(options)
        token, stream = self._open_stream(data, options)
        try:
            if self._sink is not None:
                return total_written(commit_written(stream))
            consumer = self.pipeline.consumer
            if consumer is None:
                return collect(stream)
            total = len(data) if isinstance(data, Sized) else None
            return fold(stream, consumer, self.cfg, options, self._chain, self._abort, total)
        finally:
            self._seat.release(token)

    @surfaced
    def imap(
        self, data: Iterable[Any], *positional: Any, **options: Unpack[RunKwargs]
    ) -> Iterator[Any]:
        """Yield the producers' results lazily, with bounded memory (no consumer allowed).

        Work starts now, not at the first ``next()``. ``prefetch=k`` (the runner's by
        default, 2 unless ``open(prefetch=...)`` said otherwise): each worker may hold ``k``
        chunks, queued, running, or finished and waiting for the caller, so a caller busy
        elsewhere (a training step, a checkpoint) finds up to ``k`` chunks per worker ready
        when it comes back. A chunk is one item when items take 50 ms or more, else as many
        items as take about 50 ms or make about 1 MiB of results (a worker with
        ``concurrency=c`` counts ``c`` items as one chunk); at most about
        ``n_workers * (k + 1)`` chunks are in flight or waiting, and with tensors or arrays
        the waiting results stay in shared memory (they are not copied again when taken).

        Training that resumes: the iterator's ``state_dict()`` is its position (what the
        caller has received), a small JSON-serialisable dict; ``imap(..., state=that)`` with
        the same input, ``seed``, ``epoch`` and batch sizes continues with exactly the next
        result, and every result after it is the uninterrupted run's. Items before the
        position are not read or computed again: a ``range``, a sequence or a map-style
        dataset (a torch or Hugging Face ``Dataset``) resumes by index, an object with
        ``iter_from(index)`` (an iterator of its items from that one on) is asked for the
        rest; any other input (a generator) is a ``ValueError`` with ``state=``. ``epoch``
        (None: the one given to ``open``, 0 by default) gives every item of a seeded run
        another seed in every epoch (see :func:`easycore.derive_seed`).

        Args:
            data: any iterable, endless ones included (with ``state=``: a sequence, a
                ``range`` or an object with ``iter_from``).
            *positional: as for :meth:`map`.
            **options: as for :meth:`map`, and ``state`` (see above).

        Returns:
            An iterator of the results, with ``state_dict()``; closing it ends the run (the
            runner stays up).

        Raises:
            TypeError: the pipeline has a consumer (use :meth:`map`), or a bad option.
            RuntimeError: the runner is closed or busy.
            ValueError: ``state`` is not an imap position, is one of another run (another
                seed, epoch, batch size or input length: the message names it), comes with
                ``resume=``, or the input cannot start in the middle.
        """
        if self.pipeline.consumer is not None:
            msg = f"imap is for pipelines without a consumer; {self.pipeline!r} has one: use map"
            raise TypeError(msg)
        return self.run_imap(data, run_options("imap", positional, options, self.epoch))

    def run_imap(self, data: Iterable[Any], options: RunOptions, owned: bool = False) -> _Results:
        """:meth:`imap` with its options as one value (for easycore's own callers).

        Args:
            data: the items.
            options: the run's options.
            owned: the results own this runner (a one-shot ``Pipeline.imap``): it closes
                when they are exhausted, closed or dropped, and aborts on an error (here too).

        Returns:
            As :meth:`imap`.

        Raises:
            ValueError: ``state`` with ``resume``, or a ``state`` that does not fit.
        """
        try:
            options, data, position = start_at(
                self._settle(options), data, self._chain.align, self._sink
            )
            token, stream = self._open_stream(data, options, position)
        except BaseException as exc:
            if owned:
                self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        where = None if self._sink is not None else position  # a sink's files are its position
        self._imap = True
        return _Results(self._seat, token, stream, where, self if owned else None, self)

    def _open_stream(
        self, data: Iterable[Any], options: RunOptions, position: Position | None = None
    ) -> tuple[object, Segments]:
        """The runner taken for this run now (a second run raises ``RuntimeError``; the
        caller gives it back, ``Seat.release``, when the run ends), and the run's segments
        ``(index of first item, results)`` in the requested order, work started."""
        token = self._seat.claim(lambda: self._active)
        try:
            size = options.batch_size
            align = self._chain.align
            data = items_of(data)  # a map-style dataset: by index, as DataLoader reads it
            source: Iterable[Any] = batched(data, size) if size else data
            if options.passed:  # units received beyond the position: not run, not delivered
                source = mark_passed(source, options.first, options.passed, align)
            ledger = None
            if options.resume is not None:
                identity = RunIdentity.of(self.pipeline, self.cfg, options)  # whose results
                ledger = RunLedger(options.resume, options, self._chain.align, identity)
                source = ledger.source(source)
            bars = _progress_bars(self._chain, data, size) if options.progress else None
            stream = self._stream(source, options, SKIP if options.skip else RAISE, bars)
            if options.passed:
                stream = drop_passed(stream, align)
            if ledger is not None:
                stream = ledger.record(stream)
            if options.skip:
                passed = None if position is None else position.passed
                stream = set_aside(stream, options, align, passed)
            supervised = _supervised(stream, self._abort, bars)
            if self._sink is not None:  # the run holds the directory, and commits the files
                supervised = committing(supervised, self._sink, ledger)
            primed = next(supervised)  # work starts now (an error here has closed the runner)
            assert primed is PRIMED
            return token, supervised
        except BaseException:
            self._seat.release(token)
            raise

    # -- submit ------------------------------------------------------------------------------
    def submit(self, item: Any) -> concurrent.futures.Future[Any]:
        """Send one item to the workers now; its result arrives in the returned future.

        For callers that feed items one at a time (a server, a training loop prefetching
        batches). Items run as workers free up, in no set order. An item that raises, or
        whose worker dies, fails only its own future (``WorkerError``/``WorkerDied``; the
        worker is respawned); the rest go on. ``map``/``imap`` and :meth:`close` first wait
        for the submitted items to finish. Safe to call from several threads, and from a
        future's callback.

        Args:
            item: one input item.

        Returns:
            A ``concurrent.futures.Future`` holding the item's result or its error.

        Raises:
            RuntimeError: the runner is closed or closing, or a ``map``/``imap`` is running.
            TypeError: the pipeline has a consumer, or a pool groups items (``batch_size``):
                one item, one result.
        """
        if self.pipeline.consumer is not None or self._sink is not None:
            msg = f"submit is for pipelines without a consumer or sink; {self.pipeline!r} has one"
            raise TypeError(msg)
        if self._chain.align > 1 or first_batch(self.pipeline, None) is not None:
            msg = "submit needs one result per item; a pool of this pipeline has a batch_size"
            raise TypeError(msg)
        self._imap = False  # (its report has no loop of the caller's)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # queued items run; cancel() cannot stop them
        if not self._engine.in_caller:
            self._seat.submit(item, future, self._active, self._feed)
            return future
        token = self._seat.claim(lambda: self._active)  # (inline: now, on init's thread)
        try:
            segments = self._stream([item], RunOptions(), RAISE)
            next(segments)  # PRIMED
            future.set_result(next(segments)[1][0])
        except EasycoreError as exc:  # (its own future's: the runner stays up)
            future.set_exception(exc)
        finally:
            self._seat.release(token)
        return future

    def _feed(self, source: LiveSource) -> Segments:
        """The submit feeder's run (in its thread): under the skip policy, unordered, fed live."""
        stream = self._stream(source, RunOptions(ordered=False, prefetch=self.prefetch), SKIP)
        supervised = _supervised(stream, self._abort)
        next(supervised)  # PRIMED
        return supervised

    def _stream(
        self, source: Any, options: RunOptions, policy: ErrorPolicy, bars: Any = None
    ) -> Segments:
        """The engine's run of ``source``; it stops once this activation has ended (a run of
        an earlier one must not go on after ``close`` or a new ``activate``)."""
        generation = self._generation
        return self._engine.stream(
            source,
            options,
            bars=bars,
            policy=policy,
            is_current=lambda: self._active and self._generation == generation,
        )


@attrs.define(eq=False)
class _Results:
    """An ``imap``'s results one by one (a sink's: one ``Written`` per committed file).

    They hold the runner (its seat) from their creation until the run ends, is closed, or is
    dropped (a generator closed before its first ``next`` never runs its ``finally``).
    ``close()`` stops the run early (see :meth:`close`). ``position`` counts each result as
    the caller receives it (``state_dict``; None for a sink's, whose committed files are its
    position). ``owner``: the runner of a one-shot ``Pipeline.imap``, closed when the
    results are exhausted, closed or dropped, aborted on an error.
    """

    _seat: Seat | None
    _token: object
    _stream: Segments
    _position: Position | None
    _owner: Runner | None
    _runner: Runner  # (for report(), also once the run is over)
    _values: Iterator[Any] = attrs.field(init=False, factory=lambda: iter(()))
    _at: int = attrs.field(init=False, default=0)  # where the next value's output unit begins

    def __iter__(self) -> _Results:
        return self

    @surfaced
    def __next__(self) -> Any:
        try:
            while True:
                for value in self._values:
                    if self._position is not None:
                        self._position.passed(self._at)
                        self._at += self._position.align
                        return value
                    if value.files:  # (a Written of bytes only is for map's count)
                        return value
                self._at, values = next(self._stream)
                self._values = iter(values)
        except StopIteration:
            self._close(early=False)  # (every end runs, and an end's error is raised)
            raise
        except BaseException as exc:
            self._end(exc)
            raise

    def report(self) -> Report:
        """Where this run's time goes, during or after it (see :meth:`Runner.report`)."""
        return self._runner.report()

    def state_dict(self) -> dict[str, Any]:
        """This stream's position: what the caller has received so far, as a small
        JSON-serialisable dict for ``imap(..., state=...)`` (see :meth:`Runner.imap`)."""
        if self._position is None:
            msg = (
                "a sink's imap has no position of its own: its committed files are; to resume "
                "it after a crash, run it with resume='run.db' (a ledger beside the output) and "
                "give the same resume= again"
            )
            raise TypeError(msg)
        return self._position.state()

    def close(self) -> None:
        """Stop early: an open runner's work in flight is waited for and dropped (the
        runner stays usable); a one-shot ``Pipeline.imap``'s workers stop now, as after
        Ctrl-C (one between items runs its ``end``; an item still running after a short
        grace is cut short, its worker killed): its runner is not used again, and a
        ``break`` must not wait for the slowest item in flight."""
        self._close(early=True)

    def _close(self, early: bool) -> None:
        self._values = iter(())
        try:
            if early and self._owner is not None and self._seat is not None:
                self._owner._abort()  # (the stream then drains nothing: its runner is closed)
            self._stream.close()  # type: ignore[attr-defined]
        except BaseException as exc:
            self._end(exc)
            raise
        self._end()

    def _end(self, exc: BaseException | None = None) -> None:
        """Give the runner back; the runner they own closes (``exc``: as a ``with`` block's
        end on that exception does)."""
        seat, self._seat = self._seat, None
        if seat is not None:
            seat.release(self._token)
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.__exit__(None if exc is None else type(exc), exc, None)

    def __del__(self) -> None:
        if self._seat is None:
            return
        # Ctrl-C while the results are let go of (a loop left by `return`): Python drops
        # what __del__ raises, and what a finalizer run meanwhile raises, so Ctrl-C is only
        # noted here (with Python's own handler in place), and once this returns a thread
        # makes it pending again, for the caller's own code to get its KeyboardInterrupt
        noted: list[object] = []
        held = threading.current_thread() is threading.main_thread()
        held = held and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        before = signal.signal(signal.SIGINT, lambda *_: noted.append(1)) if held else None
        try:
            with contextlib.suppress(Exception):  # (nobody to tell: the caller dropped us)
                self.close()
        except KeyboardInterrupt:
            noted.append(1)
        finally:
            if held:
                signal.signal(signal.SIGINT, before)
        if noted:
            _thread.start_new_thread(_thread.interrupt_main, (signal.SIGINT,))


def _supervised(
    stream: Segments, abort: Callable[[], None], bars: list[Any] | None = None
) -> Segments:
    """Any error or interrupt inside a run closes the runner (``abort``; an early stop
    does not); the run's progress ``bars`` close at its end."""
    try:
        yield from stream
    except GeneratorExit:
        raise
    except BaseException:
        abort()
        raise
    finally:
        for bar in bars or ():
            bar.close()


def count_units(data: Iterable[Any], batch_size: int | None) -> int | None:
    """How many units (items, or batches of ``batch_size``) ``data`` makes; None without
    ``len`` (a ``__len__`` may raise: a DataLoader over an IterableDataset)."""
    try:
        n = len(data)  # type: ignore[arg-type]
    except TypeError:
        return None
    return n if batch_size is None else math.ceil(n / batch_size)


def _progress_bars(chain: Chain, data: Iterable[Any], batch_size: int | None) -> list[Any]:
    """One tqdm bar per hop of ``chain`` (a total when ``len(data)`` exists)."""
    from tqdm.auto import tqdm

    total = count_units(data, batch_size)
    bars = []
    for k, hop in enumerate(chain.hops):
        n_units = None if total is None else math.ceil(total / hop.unit)
        desc = f"{hop.name} ({len(hop.devices)})" if chain.named else None
        if hop.bounds:  # (its bar shows its workers as they change)
            desc = f"{hop.name} ({hop.size} workers)"
        bars.append(tqdm(total=n_units, unit="item", dynamic_ncols=True, position=k, desc=desc))
    return bars


def run_map(pipeline: PipelineDef, data: Iterable[Any], options: RunOptions, **where: Any) -> Any:
    """``Pipeline.map``: fresh workers for one run, closed after it (``where``: the keyword
    arguments of :class:`Runner` that say where: ``devices``, ``cfg``, ``start_method``,
    ``engine``, ``concurrency``)."""
    with _one_shot(pipeline, options, where) as runner:
        return runner.run_map(data, options)


def run_imap(
    pipeline: PipelineDef, data: Iterable[Any], options: RunOptions, **where: Any
) -> Iterator[Any]:
    """``Pipeline.imap``: workers start, and work with them, now; they stop when the results
    are exhausted, closed or dropped."""
    return _one_shot(pipeline, options, where).run_imap(data, options, owned=True)


def _one_shot(pipeline: PipelineDef, options: RunOptions, where: dict[str, Any]) -> Runner:
    """The runner of one ``map``/``imap`` call: a ``resume`` path that is no ledger, or
    another run's, is refused before any worker starts; work goes to each worker as soon as
    it is ready (init errors surface in the run). A run that keeps nothing per worker
    between chunks (no ``timeout`` clock, no recycling) runs Ray's init-less pools as plain
    tasks, not actors."""
    check_state(options, getattr(pipeline, "sink", None))
    if options.resume is not None:
        check_ledger(options.resume, RunIdentity.of(pipeline, where["cfg"], options))
    recycles = options.max_items_per_worker or options.max_worker_memory
    tasks = options.timeout is None and recycles is None
    return Runner(pipeline, **where, _wait=False, _tasks=tasks)
