"""``Runner``: workers for one pipeline that stay up across calls (the public facade).

The runner holds an engine (worker processes, or the calling process for ``"inline"``),
a :class:`~easycore._exec.submit.Seat` that lets one run at a time hold it, and the
lifecycle: ``activate`` (every ``init``), ``close`` (every ``end``), and the abort that any
error or Ctrl-C inside a run ends in (the runner is then closed, no process left).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs

from easycore._devices import INLINE
from easycore._errors import EasycoreError, Failure
from easycore._exec.commit import commit_written, total_written
from easycore._exec.core import RAISE, SKIP
from easycore._exec.engine import PRIMED, Engine, ProcessEngine
from easycore._exec.fold import collect, fold
from easycore._exec.inline import InlineEngine
from easycore._exec.plan import PipelineDef, StageStats, first_batch, frozen_cfg, plan_chain
from easycore._exec.policy import set_aside
from easycore._exec.resume import RunIdentity, RunLedger
from easycore._exec.sources import LiveSource, batched
from easycore._exec.startup import check_capacity
from easycore._exec.submit import Seat
from easycore._options import DEFAULT_PREFETCH, RunOptions, check_prefetch
from easycore._sinks import Sink, check_fresh, recover

__all__ = ["ABORT_GRACE", "OwnedResults", "Runner"]

ABORT_GRACE = 2.0  # seconds a worker gets to run `end` after an error or Ctrl-C
ENGINES = ("local", "ray")

Segments = Iterator[tuple[int, list[Any]]]


class Runner:
    """Workers for one pipeline that stay up across calls; made by ``Pipeline.open``.

    ``init`` runs once per worker when the runner activates, ``end`` at :meth:`close`.
    ``map``/``imap`` may be called any number of times, one at a time. After an error or
    Ctrl-C inside a call the runner is closed (``is_active`` is False, no process left);
    :meth:`activate` starts it again.

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
        _wait: bool = True,
    ) -> None:
        check_prefetch(prefetch)
        if engine not in ENGINES:
            msg = f"engine must be one of {ENGINES}, got {engine!r}"
            raise ValueError(msg)
        self.pipeline = pipeline
        self.engine = engine
        # chunks each worker may hold for a run (queued, running, or done and waiting)
        self.prefetch = prefetch or DEFAULT_PREFETCH
        self.cfg = frozen_cfg(cfg)
        self._engine: Engine
        if engine == "ray" and pipeline.producers:
            if isinstance(devices, str) and devices == INLINE:
                msg = "devices='inline' runs in this process; it does not go with engine='ray'"
                raise ValueError(msg)
            from easycore._exec.ray_engine import RayEngine  # imports ray: only here

            ray_engine = RayEngine(pipeline, devices, self.cfg)  # connects: "auto" counts it
            self._engine = ray_engine
            self._chain = ray_engine.chain
        else:
            self._chain = plan_chain(pipeline, devices)
        self.devices: tuple[str, ...] = self._chain.devices
        self._inline = INLINE in self.devices
        if self._chain.named and start_method == "fork" and engine == "local":
            msg = (
                "a pipeline with several pools (.on) needs start_method 'forkserver' or "
                "'spawn': with 'fork', workers inherit each other's pipes"
            )
            raise ValueError(msg)
        if engine == "ray" and pipeline.producers:
            pass  # (made above)
        elif self._inline or not pipeline.producers:
            self._engine = InlineEngine(self._chain, self.cfg)
        else:
            check_capacity(len(self.devices))
            # _wait False: the runner a one-shot map opens sends work to each worker as soon
            # as it is ready instead of after the slowest one (init errors surface in the map)
            self._engine = ProcessEngine(self._chain, self.cfg, start_method, _wait)
        self._seat = Seat()
        self._active = False
        self._generation = 0  # +1 per activate(): a run of an earlier activation must stop
        self.startup_seconds = 0.0
        self.activate()

    # -- public state ------------------------------------------------------------------------
    @property
    def is_active(self) -> bool:
        """True between :meth:`activate` and :meth:`close`."""
        return self._active

    @property
    def n_workers(self) -> int:
        """How many workers this runner has, over all its pools (1 for ``"inline"``)."""
        return 1 if self._inline else len(self.devices)

    def __repr__(self) -> str:
        state = "active" if self._active else "closed"
        if self._chain.named:
            where = ", ".join(f"{h.name}: {list(h.devices)}" for h in self._chain.hops)
            return f"<Runner {self.pipeline!r} on {{{where}}} ({state})>"
        return f"<Runner {self.pipeline!r} on {list(self.devices)} ({state})>"

    def stats(self) -> list[StageStats]:
        """Per pool, for the run under way or the last one: what is done, busy and queued.

        The pool whose workers are busy near 100% while the pool before it has results
        waiting is the bottleneck; give it more devices.
        """
        return self._engine.stats()

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
        if not self._active:
            return
        self._active = False
        self._engine.stop(grace=None, report=True)

    def _abort(self) -> None:
        """Stop everything now after an error or interrupt: ``end`` gets a short grace."""
        self._seat.stop_feeder(abort=True, timeout=ABORT_GRACE + 3.0)
        self._active = False
        self._engine.stop(grace=ABORT_GRACE, report=False)

    def _is_current(self, generation: int) -> bool:
        return self._active and self._generation == generation

    # -- running -----------------------------------------------------------------------------
    def map(
        self,
        data: Iterable[Any],
        ordered: bool = True,
        batch_size: int | None = None,
        progress: bool = False,
        seed: int | None = None,
        timeout: float | None = None,
        retries: int = 0,
        prefetch: int | None = None,
        *,
        errors: str = "raise",
        on_error: Callable[[Failure], Any] | None = None,
        resume: str | os.PathLike[str] | None = None,
        key: Callable[[Any], Any] | None = None,
        retry_failed: bool = False,
        max_items_per_worker: int | None = None,
        max_worker_memory: int | str | None = None,
    ) -> Any:
        """Run ``data`` through the pipeline on this runner's workers.

        ``prefetch`` overrides the runner's for this run (see :meth:`imap`); ``errors``,
        ``on_error``, ``resume``, ``key``, ``retry_failed``, ``max_items_per_worker`` and
        ``max_worker_memory`` are those of :meth:`Pipeline.map <easycore.Pipeline.map>`.

        Returns:
            The consumer's result, or a list of the producers' results without a consumer.

        Raises:
            RuntimeError: the runner is closed (call ``activate()``) or busy.
            WorkerError, WorkerDied, ItemTimeout: see :mod:`easycore._errors`.
        """
        options = RunOptions(
            ordered=ordered,
            batch_size=batch_size,
            progress=progress,
            timeout=timeout,
            retries=retries,
            seed=seed,
            prefetch=prefetch,
            errors=errors,
            on_error=on_error,
            resume=resume,
            key=key,
            retry_failed=retry_failed,
            max_items_per_worker=max_items_per_worker,
            max_worker_memory=max_worker_memory,
        )
        return self.run_map(data, options)

    def _settle(self, options: RunOptions) -> RunOptions:
        """The run's options with the runner's defaults filled in."""
        return attrs.evolve(
            options,
            batch_size=first_batch(self.pipeline, options.batch_size),
            prefetch=options.prefetch or self.prefetch,
        )

    def run_map(self, data: Iterable[Any], options: RunOptions) -> Any:
        """:meth:`map` with its options as one value."""
        options = self._settle(options)
        stream = self._results(options, data)
        if self._sink is not None:
            return total_written(commit_written(stream, self._sink))
        consumer = self.pipeline.consumer
        if consumer is None:
            return collect(stream)
        return fold(stream, consumer, self.cfg, options, self._chain, self._abort)

    def imap(
        self,
        data: Iterable[Any],
        ordered: bool = True,
        batch_size: int | None = None,
        progress: bool = False,
        seed: int | None = None,
        timeout: float | None = None,
        retries: int = 0,
        prefetch: int | None = None,
        *,
        errors: str = "raise",
        on_error: Callable[[Failure], Any] | None = None,
        resume: str | os.PathLike[str] | None = None,
        key: Callable[[Any], Any] | None = None,
        retry_failed: bool = False,
        max_items_per_worker: int | None = None,
        max_worker_memory: int | str | None = None,
    ) -> Iterator[Any]:
        """Yield the producers' results lazily, with bounded memory (no consumer allowed).

        Work starts now, not at the first ``next()``. ``prefetch=k`` (the runner's by
        default, 2 unless ``open(prefetch=...)`` said otherwise): each worker may hold ``k``
        chunks, queued, running, or finished and waiting for the caller, so a caller busy
        elsewhere (a training step, a checkpoint) finds up to ``k`` chunks per worker ready
        when it comes back. A chunk is one item when items take 50 ms or more, else as many
        items as take about 50 ms or make about 1 MiB of results; at most about
        ``n_workers * (k + 1)`` chunks are in flight or waiting, and with tensors or arrays
        the waiting results stay in shared memory (they are not copied again when taken).
        """
        if self.pipeline.consumer is not None:
            msg = f"imap is for pipelines without a consumer; {self.pipeline!r} has one: use map"
            raise TypeError(msg)
        options = RunOptions(
            ordered=ordered,
            batch_size=batch_size,
            progress=progress,
            timeout=timeout,
            retries=retries,
            seed=seed,
            prefetch=prefetch,
            errors=errors,
            on_error=on_error,
            resume=resume,
            key=key,
            retry_failed=retry_failed,
            max_items_per_worker=max_items_per_worker,
            max_worker_memory=max_worker_memory,
        )
        return self.run_imap(data, options)

    def run_imap(self, data: Iterable[Any], options: RunOptions) -> Iterator[Any]:
        """:meth:`imap` with its options as one value."""
        stream = self._results(self._settle(options), data)
        if self._sink is not None:
            return commit_written(stream, self._sink)
        return _Items(stream)

    @property
    def _sink(self) -> Sink | None:
        """The sink the last pool's workers write with (``easycore.write``), or None."""
        stages = self._chain.last.stages
        return stages[-1] if stages and isinstance(stages[-1], Sink) else None

    def _results(self, options: RunOptions, data: Iterable[Any]) -> _Claimed:
        """Segments ``(index of first item, results)`` in the requested order.

        The runner is taken for this run now (a second run raises ``RuntimeError``) and
        given back when the stream ends, is closed, or is dropped.
        """
        token = self._seat.claim(lambda: self._active)
        try:
            stream = self._open_stream(data, options)
        except BaseException:
            self._seat.release(token)
            raise
        return _Claimed(self._seat, token, stream)

    def _open_stream(self, data: Iterable[Any], options: RunOptions) -> Segments:
        size = options.batch_size
        source: Iterable[Any] = batched(data, size) if size else data
        ledger = None
        if options.resume is not None:
            identity = RunIdentity.of(self.pipeline, self.cfg, options)  # whose results
            ledger = RunLedger(options.resume, options, self._chain.align, identity)
            source = ledger.source(source)
        if self._sink is not None:  # commits a crash cut short, then no temporary file
            known = ledger.committed_shards() if ledger is not None else []
            try:
                recover(self._sink, known)
                check_fresh(self._sink, known)  # never replace another run's files
            except BaseException:
                if ledger is not None:
                    ledger.close()
                raise
        bars = self._progress_bars(data, size) if options.progress else None
        generation = self._generation
        stream = self._engine.stream(
            source,
            options,
            bars=bars,
            policy=SKIP if options.skip else RAISE,
            is_current=lambda: self._is_current(generation),
        )
        if ledger is not None:
            stream = ledger.record(stream)
        if options.skip:
            stream = set_aside(stream, options, self._chain.align)
        supervised = self._supervised(stream, bars)
        primed = next(supervised)  # work starts now (an error here has closed the runner)
        assert primed is PRIMED
        return supervised

    def _supervised(self, stream: Segments, bars: list[Any] | None = None) -> Segments:
        """Any error or interrupt inside a run closes the runner (an early stop does not)."""
        try:
            yield from stream
        except GeneratorExit:
            raise
        except BaseException:
            self._abort()
            raise
        finally:
            for bar in bars or ():
                bar.close()

    def _progress_bars(self, data: Iterable[Any], batch_size: int | None) -> list[Any]:
        from tqdm.auto import tqdm

        total = None
        with contextlib.suppress(TypeError):
            n = len(data)  # type: ignore[arg-type]
            total = n if batch_size is None else math.ceil(n / batch_size)
        bars = []
        for k, hop in enumerate(self._chain.hops):
            n_units = None if total is None else math.ceil(total / hop.unit)
            desc = f"{hop.name} ({len(hop.devices)})" if self._chain.named else None
            bars.append(tqdm(total=n_units, unit="item", dynamic_ncols=True, position=k, desc=desc))
        return bars

    # -- submit ------------------------------------------------------------------------------
    def submit(self, item: Any) -> concurrent.futures.Future[Any]:
        """Send one item to the workers now; its result arrives in the returned future.

        For callers that feed items one at a time (a server, a training loop prefetching
        batches). Items run as workers free up, in no set order. An item that raises, or
        whose worker dies, fails only its own future (``WorkerError``/``WorkerDied``; the
        worker is respawned); the rest go on. ``map``/``imap`` and :meth:`close` first wait
        for the submitted items to finish. Safe to call from several threads, and from a
        future's callback.

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
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # queued items run; cancel() cannot stop them
        if self._engine.in_caller:
            self._submit_inline(item, future)
        else:
            self._seat.submit(item, future, self._active, self._feed)
        return future

    def _feed(self, source: LiveSource) -> Segments:
        """The submit feeder's run (in its thread): under the skip policy, unordered, fed live."""
        generation = self._generation
        stream = self._engine.stream(
            source,
            RunOptions(ordered=False, prefetch=self.prefetch),
            policy=SKIP,
            is_current=lambda: self._is_current(generation),
        )
        supervised = self._supervised(stream)
        next(supervised)  # PRIMED
        return supervised

    def _submit_inline(self, item: Any, future: concurrent.futures.Future[Any]) -> None:
        token = self._seat.claim(lambda: self._active)
        try:
            stream = self._engine.stream([item], RunOptions())
            next(stream)  # PRIMED
            future.set_result(next(stream)[1][0])
        except EasycoreError as exc:  # fails only its own future: the runner stays up
            future.set_exception(exc)
        finally:
            self._seat.release(token)


class _Claimed:
    """A run's stream that holds the runner from its creation until it ends, is closed, or
    is dropped (a generator closed before its first ``next`` never runs its ``finally``)."""

    def __init__(self, seat: Seat, token: object, stream: Segments) -> None:
        self._seat: Seat | None = seat
        self._token = token
        self._stream = stream

    def __iter__(self) -> _Claimed:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._stream)
        except BaseException:
            self._release()
            raise

    def close(self) -> None:
        try:
            close = getattr(self._stream, "close", None)
            if close is not None:
                close()  # an early stop drains what is in flight
        finally:
            self._release()

    def _release(self) -> None:
        seat, self._seat = self._seat, None
        if seat is not None:
            seat.release(self._token)

    def __del__(self) -> None:
        if self._seat is not None:
            with contextlib.suppress(Exception):
                self.close()


class _Items:
    """A run's results one by one (its segments flattened); ``close()`` stops the run early:
    what is in flight is waited for and dropped, and the runner stays usable."""

    def __init__(self, segments: _Claimed) -> None:
        self._segments = segments
        self._values: Iterator[Any] = iter(())

    def __iter__(self) -> _Items:
        return self

    def __next__(self) -> Any:
        while True:
            for value in self._values:
                return value
            self._values = iter(next(self._segments)[1])

    def close(self) -> None:
        self._values = iter(())
        self._segments.close()


class OwnedResults:
    """The results of a one-shot ``Pipeline.imap``, owning its runner: the runner closes
    when they are exhausted, closed or dropped, and aborts on an error."""

    def __init__(self, runner: Runner, results: Iterator[Any]) -> None:
        self._runner: Runner | None = runner
        self._results = results

    def __iter__(self) -> OwnedResults:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._results)
        except StopIteration:
            self.close()
            raise
        except BaseException as exc:
            runner, self._runner = self._runner, None
            if runner is not None:
                runner.__exit__(type(exc), exc, exc.__traceback__)
            raise

    def close(self) -> None:
        """Stop early: what is in flight is waited for and dropped, then every ``end`` runs."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        try:
            close = getattr(self._results, "close", None)
            if close is not None:
                close()
        except BaseException as exc:
            runner.__exit__(type(exc), exc, exc.__traceback__)
            raise
        runner.close()

    def __del__(self) -> None:
        if self._runner is not None:
            with contextlib.suppress(Exception):
                self.close()
