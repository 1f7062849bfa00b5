"""Prepared stages: the one copy of "run the user's producers on an item".

A hop's fused producers, prepared where they run (a worker process, the calling process for
``devices="inline"``, or any other engine): :meth:`PreparedStages.start` runs every ``init``
with its injected names, :meth:`~PreparedStages.run` runs the stages over one unit (seeded
from its index when the run has a seed), a :class:`ChunkRun` over a chunk with retries
(the one chunk executor, on every engine), and :meth:`~PreparedStages.finish` runs every
``end``. Failures come back as :class:`StageFailure` values naming the stage (over a chunk,
as a :class:`~easycore._exec.core.protocol.Broken` in the failed unit's place); the caller
turns them into errors.

Stages that wait (docs/contract.md section 11): producers, ``init``, ``end`` may be ``async def``;
they run on one event loop per place (a worker, an actor, the caller for ``"inline"``). A
hop with ``concurrency=k`` runs up to ``k`` units at once (:meth:`ChunkRun.start`):
as tasks of that loop when a stage is async, else on ``k`` threads. The ``k`` slots belong to
the place, not to a chunk: the units of the chunks it holds take them first come, first
served, so a slot that one chunk's slow unit leaves free takes the next chunk's unit at
once. Each unit keeps its own retries, seed (:func:`easycore.item_seed`) and timeout (an
async unit past it fails: :class:`~easycore._errors.TimedOutItem`, counting its own time
only, not what other units held the loop); results keep their chunk's order.
``concurrency=1`` with plain functions is the loop of old.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import linecache
import threading
import time
from collections.abc import Callable, Sequence
from types import CoroutineType, coroutine
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, Protocol

from easycore._errors import ItemTimeout, TimedOutItem, WorkerError, user_error, user_traceback
from easycore._exec.core.protocol import (
    AT_FLIGHT,
    AT_INDEX,
    AT_STARTED,
    RUNNING,
    Broken,
    ErrorReport,
    Task,
    pickling_error,
    settled,
)
from easycore._inject import call_with, injected, is_async_fn
from easycore._seeding import (
    ITEM_SEED,
    bind_thread,
    derive_seed,
    drop_hooks,
    seed_loaded,
    seed_on_import,
)

if TYPE_CHECKING:  # (loaded when a stage waits, or a pool writes: others never pay)
    import asyncio
    import concurrent.futures

    from easycore._longjobs.sinks import ShardWriter, Sink

__all__ = [
    "ChunkRun",
    "Finished",
    "Flight",
    "PreparedStages",
    "Ran",
    "StageDef",
    "StageFailure",
    "call_key",
    "cancel_grace",
    "code_in",
    "is_async_fn",
]

# In a stop with a grace (an abort), how long a worker in the middle of a unit is waited
# for: a unit about to finish lets it run `end`; a long one is not waited for.
UNIT_GRACE = 0.25

# a chunk's values (a failed unit's a Broken), how many units ran (not passed on), and
# whether any value is Broken
Ran = tuple[list[Any], int, bool]


def cancel_grace(timeout: float) -> float:
    """How long past ``timeout`` a watchdog waits before it kills a worker whose async unit
    should have been cancelled by then (its event loop is blocked: a sync call in it)."""
    return 1.0 + 0.5 * timeout


class StageDef(Protocol):
    """What running needs of a producer stage (``easycore.Stage`` is one)."""

    fn: Callable[..., Any]
    name: str
    has_init: bool
    init: Any
    end: Callable[..., Any] | None
    fn_names: tuple[str, ...]
    init_names: tuple[str, ...]
    end_names: tuple[str, ...]


class StageFailure(NamedTuple):
    """User code raised: ``stage`` names it (``"load (init)"`` for an init), ``error`` is it."""

    stage: str
    error: BaseException

    def report(self) -> ErrorReport:
        """The failure as it crosses to the caller from another process."""
        return ErrorReport.of(self.stage, self.error)

    def to_error(self, what: str, index: int | None, device: str | None = "cpu") -> WorkerError:
        """The ``WorkerError`` for a failure in this process: an inline stage (``device``
        ``"cpu"``, worker 0) or the consumer (``device=None``). Raise it ``from`` ``error``:
        its traceback moves into the message (from the user's code on), so that Python
        does not print it twice."""
        exc = self.error
        tb = user_traceback(exc)
        exc.with_traceback(None)
        return user_error(
            self.stage,
            type(exc).__name__,
            str(exc),
            tb,
            what=what,
            device=device,
            worker=0 if device is not None else None,
            index=index,
            remote=False,
            cls=ItemTimeout if isinstance(exc, TimedOutItem) else WorkerError,
        )


def call_key(key: Callable[[Any], Any], unit: Any, index: int, label: str) -> Any:
    """``key(unit)``, the run's ``key=`` for unit ``index`` (``label`` names it), called in the
    calling process: what it raises is a ``WorkerError`` as a consumer's (stage ``"key="``,
    the unit's index and item, ``__cause__`` the original)."""
    try:
        return key(unit)
    except Exception as exc:
        error = StageFailure("key=", exc).to_error(f"while keying {label}", index, device=None)
        error.item = unit
        raise error from exc


class Finished(RuntimeError):
    """Units reached a place whose stages have finished (their ``end`` ran) or not started."""


class _Prepared:
    __slots__ = ("fn", "is_async", "kwargs", "name", "stage", "state")

    def __init__(self, stage: StageDef, state: Any, context: dict[str, Any]) -> None:
        self.stage = stage
        self.fn = stage.fn
        self.is_async = is_async_fn(stage.fn)
        self.name = stage.name
        self.state = state
        self.kwargs = injected(stage.fn_names, {**context, "state": state})


class PreparedStages:
    """A hop's fused producers in the place they run: ``init`` done, names injected.

    Args:
        stages: the hop's producers, in order.
        device, cfg, worker: what ``device``, ``cfg`` and ``worker`` inject.
        hop: the hop's number in the chain (seeds differ per hop).
        in_caller: the stages run in the calling process (``devices="inline"``): torch or
            numpy first imported by an item's own work is seeded for that item (a worker
            installs such hooks once, at start-up), and only ``Exception``s count as the
            stage's failure (Ctrl-C and ``SystemExit`` propagate, as in any other code).
        concurrency: units :meth:`start_units` runs at once (async stages: tasks of this
            place's event loop; plain ones: threads).
    """

    def __init__(
        self,
        stages: Sequence[StageDef],
        *,
        device: str,
        cfg: Any,
        worker: int,
        hop: int = 0,
        in_caller: bool = False,
        concurrency: int = 1,
    ) -> None:
        defs = tuple(stages)
        # a sink ends the last pool's stages: it writes what they make (easycore._longjobs.sinks)
        # the sink this pool writes with (``easycore.write``; its module loads only then)
        last: Any = defs[-1] if defs else None
        self.sink: Sink | None = last if getattr(last, "is_sink", False) is True else None
        self.defs = defs[:-1] if self.sink is not None else defs
        self.writer: ShardWriter | None = None
        self.context: dict[str, Any] = {"device": device, "cfg": cfg, "worker": worker}
        self.hop = hop
        self.in_caller = in_caller
        self.catch: type[BaseException] = Exception if in_caller else BaseException
        self.prepared: list[_Prepared] = []
        self.concurrency = concurrency
        # a stage is async: units run on the event loop (start_units: as concurrent tasks)
        self.is_async = any(is_async_fn(s.fn) for s in self.defs)
        # units go through start_units (concurrently): ChunkRun.start, not ChunkRun.run
        self.waits = self.is_async or concurrency > 1
        # the units in flight here, of every chunk (a worker's slots are shared by its chunks)
        self.flight = Flight(by_step=self.is_async)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._gate: asyncio.Semaphore | None = None  # (made with the loop: the k slots)
        self._loop_held = [0.0]  # seconds timed units' steps held the loop (see _Spent)
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        # (an actor that waits runs chunks on several threads at once: one loop thread, one
        # pool of k threads between them; finish holds it throughout, so a chunk that
        # arrives meanwhile waits, then is refused: Finished)
        self._starting = threading.RLock()
        self.open = False  # started and not finished: units may run (see start_units)
        self.where = ""  # the place, for a Broken's message (a Ray actor's node and process)

    # -- the event loop and the threads -------------------------------------------------------
    def loop(self) -> asyncio.AbstractEventLoop:
        """This place's event loop, made on first use (a worker's is its main thread's loop
        too: ``asyncio.get_event_loop()`` in a plain ``init`` finds it). It runs when
        something awaits on it: ``init``, ``end`` and, in the caller (``"inline"``), items
        (:meth:`run`); in a worker or an actor, items run while it runs on a thread
        of its own (:meth:`start_units`), so that chunks in flight at once share it."""
        import asyncio

        if self._loop is None or self._loop.is_closed():
            loop = self._loop = asyncio.new_event_loop()
            self._gate = asyncio.Semaphore(self.concurrency)  # (bound to it on first use)
            if not self.in_caller:  # (the caller's own loop policy is none of our business)
                asyncio.set_event_loop(loop)
        return self._loop

    def wait_for(self, value: Any) -> Any:
        """``value``, or what it gives once awaited on the loop when it is awaitable (an
        async ``init``/``end``: the loop's own thread is not running then)."""
        return _run_until(self.loop(), value) if inspect.isawaitable(value) else value

    # -- init / end ----------------------------------------------------------------------
    def start(self) -> StageFailure | None:
        """Run every ``init`` in order; stop at the first that raises and return it."""
        self.prepared = []
        if self.is_async and not self.in_caller:
            # the worker's loop exists (and is its thread's) before a plain init runs: a
            # client it makes with asyncio.get_event_loop() belongs to the loop items run on
            self.loop()
        for stage in self.defs:
            state = None
            if stage.has_init:
                try:
                    state = self.wait_for(call_with(stage.init, stage.init_names, self.context))
                except self.catch as exc:
                    return StageFailure(f"{stage.name} (init)", exc)
            self.prepared.append(_Prepared(stage, state, self.context))
        if self.sink is not None:
            try:
                from easycore._longjobs.sinks import ShardWriter

                self.writer = ShardWriter(self.sink)
            except self.catch as exc:
                return StageFailure(f"{self.sink.name} (init)", exc)
        self.open = True
        return None

    def finish(self) -> StageFailure | None:
        """Run ``end`` of every started stage, all of them; return the first failure."""
        with self._starting:  # (a chunk arriving meanwhile, on an actor's other thread, waits)
            self.open = False
            # the loop's own thread stops (``end`` runs here, as ``init`` did); a loop
            # blocked by a sync call in an item is left to the process's exit
            thread, self._loop_thread = self._loop_thread, None
            if thread is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                thread.join(5.0)
                if thread.is_alive():
                    self._loop = None  # (still running there: not ours to close)
            first: StageFailure | None = None
            for st in self.prepared:
                end, names = st.stage.end, st.stage.end_names
                if end is None:
                    continue
                try:
                    self.wait_for(call_with(end, names, {**self.context, "state": st.state}))
                except self.catch as exc:
                    first = first or StageFailure(f"{st.name} (end)", exc)  # (a failure is truthy)
            self.prepared = []
            loop, self._loop = self._loop, None
            if loop is not None and not loop.is_closed():
                import asyncio

                try:
                    pending = _cancel_all(loop)
                    if pending:
                        _run_until(loop, asyncio.gather(*pending, return_exceptions=True))
                    _run_until(loop, loop.shutdown_asyncgens())
                finally:
                    loop.close()
                    if not self.in_caller:
                        asyncio.set_event_loop(None)
            threads, self._threads = self._threads, None
            if threads is not None:
                threads.shutdown(wait=False, cancel_futures=True)
            return first

    # -- one unit --------------------------------------------------------------------------
    def broken(self, index: int, failed: StageFailure) -> Broken:
        """Unit ``index`` failed: its marker (the failure as a report, except in the caller,
        where the raised error's cause is then the live exception)."""
        return Broken(self.hop, index, failed if self.in_caller else failed.report(), self.where)

    def _seed(self, task: Task, index: int) -> Any:
        """Seed unit ``index`` of ``task`` (:func:`easycore.item_seed`; in the caller also
        torch or numpy that its work imports first); what :func:`_unseed` undoes. None: no
        seed."""
        if task.seed is None:
            return None
        value = derive_seed(task.seed, task.numbering[0] + index * task.numbering[1], self.hop)
        seed_loaded(value)
        return ITEM_SEED.set(value), seed_on_import() if self.in_caller else []

    def run(self, item: Any, index: int, task: Task) -> tuple[Any, StageFailure | None]:
        """Run the stages over unit ``index`` of ``task`` once: ``(value, None)`` or ``(None,
        failure)``.

        Async stages run on the loop (:meth:`arun`); the task's ``timeout`` then cancels the
        unit (plain stages are not timed here: a watchdog kills their worker).
        """
        if self.is_async:  # (on the loop: here, or on its own thread when it runs there)
            coro = self.arun(item, index, task)
            if self._loop_thread is None:
                done: tuple[Any, StageFailure | None] = _run_until(self.loop(), coro)
                return done
            import asyncio

            return asyncio.run_coroutine_threadsafe(coro, self.loop()).result()
        seeded = self._seed(task, index)
        try:
            value = item
            for st in self.prepared:
                try:
                    value = st.fn(value, **st.kwargs)
                    if type(value) is CoroutineType:
                        _refuse(st.name, value)
                except self.catch as exc:
                    return None, StageFailure(st.name, exc)
            return value, None
        finally:
            _unseed(seeded)

    async def arun(
        self, item: Any, index: int, task: Task, started: float | None = None, key: int = -1
    ) -> tuple[Any, StageFailure | None]:
        """:meth:`run` on the loop (async stages), seeded in the unit's own context, failed
        once past the task's ``timeout`` seconds of its own time (from ``started``, when its
        unpickling went before; ``key``: its :attr:`flight` key). Its own time leaves out what other
        units' steps held the loop meanwhile (:class:`_Spent`): awaiting past it, it is
        cancelled; holding the loop past it, its result is dropped; either way no other unit
        is charged for it."""
        import asyncio

        where = [self.prepared[0].name if self.prepared else ""]
        chain = self._achain(item, index, task, where)
        timeout = task.timeout
        if timeout is None:
            return await chain
        loop = asyncio.get_running_loop()
        spent = _Spent(self._loop_held, time.monotonic() if started is None else started)
        unit = loop.create_task(_awaited(_steps(chain, spent, self.flight, key)))
        expired: list[bool] = []

        def check() -> None:
            rest = timeout - spent()
            if rest > 0:  # (other units held the loop: its own time is not up yet)
                timer[0] = loop.call_later(rest, check)
            elif not unit.done():
                expired.append(True)
                unit.cancel()

        timer = [loop.call_later(max(timeout - spent(), 0.0), check)]
        try:
            done: tuple[Any, StageFailure | None] = await unit
        except asyncio.CancelledError:
            if not expired:
                raise  # (not ours: the run is over)
        finally:
            timer[0].cancel()
            chain.close()  # (cancelled before it started: never awaited)
        if not expired and spent.total < timeout:
            return done
        how = "it was cancelled" if expired else "it held the event loop: its result was dropped"
        error = TimedOutItem(f"ran past timeout={timeout}s; {how} and its worker went on")
        return None, StageFailure(where[0], error)

    async def _achain(
        self, item: Any, index: int, task: Task, where: list[str]
    ) -> tuple[Any, StageFailure | None]:
        """The stages over one unit on the loop, seeded (:meth:`_seed`) in its own context."""
        import asyncio

        value = item
        seeded = self._seed(task, index)
        try:
            for st in self.prepared:
                where[0] = st.name
                try:
                    value = st.fn(value, **st.kwargs)
                    if not st.is_async and type(value) is CoroutineType:
                        _refuse(st.name, value)
                    if inspect.isawaitable(value):
                        value = await value
                except asyncio.CancelledError:
                    raise  # (a timeout's cancellation, or the loop closing)
                except self.catch as exc:
                    return None, StageFailure(st.name, exc)
            return value, None
        finally:
            _unseed(seeded)

    def retries_left(self, task: Task, index: int) -> int:
        """Retries unit ``index`` of ``task`` may still use (deaths have charged some)."""
        return task.retries - task.spent.get((self.hop, index), 0)

    # -- units in flight together (concurrency=k, async stages) --------------------------------
    def start_units(
        self, jobs: Sequence[tuple[int, Any]], unit: Callable[..., Any]
    ) -> concurrent.futures.Future[list[Any]]:
        """Start ``unit(k, index, item)`` (a coroutine: the tries of one unit) for each job
        ``(index, item)`` on this place's ``concurrency`` slots, behind the units started
        before (first come, first served): async stages as tasks of the loop, plain ones on
        ``concurrency`` threads.

        Returns:
            A future of the results in job order.
        """
        import asyncio
        import concurrent.futures

        with self._starting:  # (finish waits until the loop has this chunk's work)
            if not self.open:  # (a chunk that reached an actor after its finish: never run)
                raise Finished(f"the stages of hop {self.hop} have finished (or not started)")
            if not self.is_async:
                threads = self._threads = self._threads or concurrent.futures.ThreadPoolExecutor(
                    self.concurrency,
                    thread_name_prefix="easycore-item",
                    initializer=bind_thread,
                    initargs=(self.context["device"],),
                )
                return _gather([threads.submit(_now, unit, k, *job) for k, job in enumerate(jobs)])
            loop = self.loop()  # (on a thread of its own from now until finish)
            if self._loop_thread is None:
                self._loop_thread = threading.Thread(
                    target=_serve_loop, args=(loop, self.context["device"]), name="easycore-loop"
                )
                self._loop_thread.daemon = True
                self._loop_thread.start()
            gate = self._gate
            assert gate is not None  # (made with the loop)

            async def one(k: int, index: int, item: Any) -> Any:
                async with gate:
                    return await unit(k, index, item)

            async def every() -> list[Any]:  # (one raising or cancelled cancels every unit)
                tasks = [asyncio.ensure_future(one(k, *job)) for k, job in enumerate(jobs)]
                try:
                    return list(await asyncio.gather(*tasks))
                except BaseException:
                    for task in tasks:
                        task.cancel()
                    raise

            return asyncio.run_coroutine_threadsafe(every(), loop)


def _serve_loop(loop: Any, device: str) -> None:
    """The loop thread: bound to the device before anything runs on it, the loop its
    current one (``get_event_loop()`` in an item finds it), until ``finish`` stops it."""
    import asyncio

    bind_thread(device)
    asyncio.set_event_loop(loop)
    loop.run_forever()


_NEVER = threading.Event()  # a stop that never comes (inline, Ray)
_RUN = object()  # (a position not passed on: run)


def _now(make: Callable[..., Any], *args: Any) -> Any:
    """What the coroutine ``make(*args)`` returns, run here to its end: one that never waits
    (the tries of a plain unit: :func:`_retrying`)."""
    coro = make(*args)
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    msg = "a unit of plain stages waited"
    raise RuntimeError(msg)


def _unseed(seeded: Any) -> None:
    """Undo :meth:`PreparedStages._seed`."""
    if seeded is not None:
        token, hooks = seeded
        if hooks:
            drop_hooks(hooks)
        ITEM_SEED.reset(token)


def _not_pickled(exc: BaseException) -> StageFailure:
    """A unit whose result does not pickle on its way on (``exc``: why)."""
    return StageFailure("<result pickling>", TypeError(f"the result cannot be pickled: {exc}"))


def _refuse(name: str, value: CoroutineType[Any, Any, Any]) -> NoReturn:
    """Plain stage ``name`` returned a coroutine, never awaited (closed here)."""
    value.close()
    msg = (
        f"producer {name!r} is a plain function that returned a coroutine: make it "
        "`async def` and await the call"
    )
    raise TypeError(msg)


async def _awaited(value: Any) -> Any:
    return await value


def _run_until(loop: asyncio.AbstractEventLoop, aw: Any) -> Any:
    """``loop.run_until_complete(aw)``; on a thread of its own when an event loop already
    runs in this thread (the caller inside a notebook's loop: asyncio runs no loop inside
    another), seeing this thread's context variables. An interrupt while it runs there
    cancels what the loop runs, and waits for it to end."""
    import asyncio
    import concurrent.futures
    import contextvars

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # (none runs here: the usual case)
        running = False
    else:
        running = True
    if not running:  # (outside the except: an error of the unit must not chain to it)
        return loop.run_until_complete(aw)
    run = functools.partial(contextvars.copy_context().run, loop.run_until_complete, aw)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="easycore-loop") as helper:
        future = helper.submit(run)
        try:
            return future.result()
        except BaseException:  # (the helper's shutdown then waits for the loop to stop)
            if not future.done():
                loop.call_soon_threadsafe(_cancel_all, loop)
            raise


def _cancel_all(loop: asyncio.AbstractEventLoop) -> set[asyncio.Task[Any]]:
    """Cancel every task of ``loop`` (none is done); return them."""
    import asyncio

    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    return tasks


class _Spent:
    """One unit's own time on its place's event loop: the seconds since it started, less
    those that other units' steps held the loop meanwhile (``held``: the place's total)."""

    __slots__ = ("base", "held", "own", "start", "total")

    def __init__(self, held: list[float], start: float) -> None:
        self.held, self.start, self.base = held, start, held[0]
        # the seconds its own steps held the loop; its own time when it finished
        self.own = self.total = 0.0

    def __call__(self) -> float:
        return time.monotonic() - self.start - (self.held[0] - self.base - self.own)

    def add(self, seconds: float) -> None:
        self.held[0] += seconds
        self.own += seconds


@coroutine
def _steps(coro: Any, spent: _Spent, flight: Flight, key: int) -> Any:
    """Runs a unit's coroutine step by step, timing each step (the loop is held for it):
    ``spent`` hears of it, and with a ``key``, ``flight`` (the unit holding the loop is
    what a watchdog times)."""
    value: Any = None
    error: BaseException | None = None
    while True:
        t0 = time.monotonic()
        if key >= 0:
            flight.step(key, t0 - spent())
        try:
            out = coro.send(value) if error is None else coro.throw(error)
        except StopIteration as stop:
            spent.total = spent()
            return stop.value
        finally:
            spent.add(time.monotonic() - t0)
            if key >= 0:
                flight.step(None)
        try:
            value, error = (yield out), None
        except BaseException as exc:  # (a cancellation: passed on to the unit)
            value, error = None, exc


class ChunkRun:
    """A chunk's units through one hop's prepared stages (unit ``k`` is unit ``base + k`` of
    the hop): the one chunk executor, on every engine (a worker process, a Ray actor, the
    caller for ``"inline"``).

    :meth:`run` runs them one at a time, here; :meth:`start` (a hop that waits:
    :attr:`PreparedStages.waits`) starts them on the place's slots, and :meth:`result` is
    what they ran to. Either way each unit is retried while ``task`` allows
    (:func:`_retrying`, the one retry loop); one that still fails becomes a
    :class:`~easycore._exec.core.protocol.Broken` in its place (a marker that came in passes on); a
    sink writes the values (:meth:`_ran`, the one write path).
    """

    __slots__ = ("base", "future", "passed", "spans", "stages", "task", "units")

    def __init__(self, stages: PreparedStages, units: Any, base: int, task: Task) -> None:
        self.stages, self.units, self.base, self.task = stages, units, base, task
        self.passed: dict[int, Any] = {}  # position -> a marker that came in (passed on)
        self.future: concurrent.futures.Future[list[Any]] | None = None
        self.spans: list[float] = []  # the seconds each unit started held its slot

    def run(self, cur: Any, at: int, stop: Any = _NEVER, since: float | None = None) -> Ran:
        """Run the units one at a time, here. The index of the unit in hand, and with a
        timeout its start time, go into the slot ``cur[at:]`` (a worker's shared one);
        ``since`` (when the chunk's unpickling began) is the first unit's start time.
        ``stop`` (an Event): units not run yet are left out.

        Returns:
            The values (written by the sink when there is one), how many units ran (not
            passed on), and whether any value is Broken.
        """
        stages, task, base = self.stages, self.task, self.base
        only = stages.prepared[0] if len(stages.prepared) == 1 else None
        if only is not None and not (
            only.kwargs or task.seed is not None or task.timed or task.retries or task.marked
        ):
            # the hot path: one stage, nothing injected, no per-item seed, clock or retry
            values: list[Any] = []
            marked = False
            fast = only.fn
            append = values.append
            where = float(base)
            here = at + AT_INDEX  # (per item, only the store: this loop is W1's whole cost)
            for item in self.units:
                cur[here] = where
                where += 1.0
                try:
                    value = fast(item)
                    if type(value) is CoroutineType:
                        _refuse(only.name, value)
                    append(value)
                except stages.catch as exc:
                    append(stages.broken(base + len(values), StageFailure(only.name, exc)))
                    marked = True
        else:
            done = [
                self._tries(item, index, cur, at, stop, since if k == 0 else None)
                for k, (index, item) in enumerate(self._jobs())
            ]
            values, marked = self._placed(done)
        if stages.writer is not None:
            cur[at + AT_STARTED] = RUNNING  # writing is no unit's time: `timeout` does not apply
        return self._ran(values, marked)

    def start(self, stop: Any = _NEVER, since: float | None = None) -> ChunkRun:
        """Start the units on the place's ``concurrency`` slots, behind those of chunks
        started earlier, so a slot that one chunk frees takes the next chunk's unit at once
        (:meth:`PreparedStages.start_units`): an async unit is cancelled past the run's
        timeout of its own time, counted from ``since`` for the first when a slot is free
        for it then (its chunk's unpickling). ``stop`` (an Event): units not started yet
        are left out. Returns this chunk; its ``future`` is done when every unit is."""
        stages, task = self.stages, self.task
        grace = cancel_grace(task.timeout) if stages.is_async and task.timeout else 0.0
        stages.flight.timing = (task.timed, grace)

        def unit(k: int, index: int, item: Any) -> Any:  # (a coroutine: the unit's tries)
            attempt = functools.partial(self._flown, item, index)
            allowed = stages.retries_left(task, index)
            return _retrying(attempt, allowed, stop, since if k == 0 else None)

        self.future = stages.start_units(self._jobs(), unit)
        return self

    def result(self) -> tuple[Ran, float]:
        """What ran (as :meth:`run` returns it), and the slot-seconds, once ``future`` is
        done; a sink has written the values."""
        assert self.future is not None
        return self._ran(*self._placed(self.future.result())), sum(self.spans)

    def unpicklable(self, values: Any, exc: BaseException, cur: Any = None, at: int = 0) -> Any:
        """``values`` (of the units) did not pickle on their way on (``exc``): each that
        does not pickle alone (every one not passed on, when none alone is the one) becomes
        a Broken in its place (stage ``"<result pickling>"``), unless its unit, run again
        while its retries allow (where the chunk ran: its slot ``cur[at:]``), gives a result
        that pickles."""
        values = list(values)
        mine = [k for k, v in enumerate(values) if settled(v) is None]  # (not passed on)
        bad = {k: e for k in mine if (e := pickling_error(values[k])) is not None}
        for k in bad or mine:
            failed: StageFailure | None = _not_pickled(bad.get(k, exc))
            if cur is not None and k in bad:
                values[k], failed = self._again(k, cur, at) or (None, failed)
            if failed is not None:
                values[k] = self.stages.broken(self.base + k, failed)
        return values

    def _again(self, k: int, cur: Any, at: int) -> tuple[Any, StageFailure | None] | None:
        """Unit ``k``, whose result did not pickle, run again while its retries allow, until
        its result pickles (None: no retry left)."""
        index, item = self.base + k, self.units[k]
        allowed = self.stages.retries_left(self.task, index)
        if allowed <= 0:
            return None

        def attempt(since: float | None) -> tuple[Any, StageFailure | None]:
            value, failed = self._in_slot(item, index, cur, at, since)
            exc = pickling_error(value) if failed is None else None
            return (value, failed) if exc is None else (None, _not_pickled(exc))

        done: tuple[Any, StageFailure | None] = _now(_retrying, attempt, allowed - 1, _NEVER)
        return done

    def _jobs(self) -> list[tuple[int, Any]]:
        """The units to run, ``(index, unit)``; markers that came in go to :attr:`passed`."""
        if self.task.marked:
            passed = {k: settled(u) for k, u in enumerate(self.units)}
            self.passed = {k: done for k, done in passed.items() if done is not None}
        return [(self.base + k, u) for k, u in enumerate(self.units) if k not in self.passed]

    def _placed(self, done: Any) -> tuple[list[Any], bool]:
        """The chunk's values: the markers passed on, and in the other places what its jobs
        gave (``done``, in order; one that failed: a Broken); whether any is Broken."""
        values: list[Any] = []
        marked = False
        results = iter(done)
        for k in range(len(self.units)):
            value = self.passed.get(k, _RUN)
            if value is _RUN:
                value, failed = next(results)
                if failed is not None:
                    value = self.stages.broken(self.base + k, failed)
            marked = marked or type(value) is Broken
            values.append(value)
        return values, marked

    def _ran(self, values: list[Any], marked: bool) -> Ran:
        """What the chunk ran to, written by the sink when there is one: each written value
        becomes a small ``Wrote``; a unit whose result could not be written (every one, when
        the file failed) fails as the sink's stage, a Broken."""
        stages, base, writer = self.stages, self.base, self.stages.writer
        if writer is not None:
            try:
                bad = writer.write(base, values, self.task.keys)
            except stages.catch as exc:
                bad = [(k, exc) for k in range(len(values))]
            for k, exc in bad:
                values[k] = stages.broken(base + k, StageFailure(writer.sink.name, exc))
            marked = marked or bool(bad)
        return values, len(values) - len(self.passed), marked

    def _tries(
        self, item: Any, index: int, cur: Any, at: int, stop: Any, since: float | None
    ) -> tuple[Any, StageFailure | None]:
        """Unit ``index`` run here, one at a time: its first try, then (when it failed) the
        rest of its tries in the one retry loop."""
        if stop.is_set():
            return None, None
        done = self._in_slot(item, index, cur, at, since)
        allowed = self.stages.retries_left(self.task, index) if done[1] is not None else 0
        if allowed <= 0:
            return done
        attempt = functools.partial(self._in_slot, item, index, cur, at)
        retried: tuple[Any, StageFailure | None] = _now(_retrying, attempt, allowed - 1, stop)
        return retried

    def _in_slot(
        self, item: Any, index: int, cur: Any, at: int, since: float | None
    ) -> tuple[Any, StageFailure | None]:
        """One try of unit ``index``, one at a time: its index (and when timed, its start:
        ``since``, or now) in the slot ``cur[at:]``."""
        task, stages = self.task, self.stages
        cur[at + AT_INDEX] = float(index)
        # inline: nothing can stop a plain function in the caller, but a unit past the
        # timeout fails as it does in a worker (which is killed for it)
        limit = task.timeout if stages.in_caller and not stages.is_async else None
        start = 0.0
        if task.timed or limit is not None:  # (the clock is read only when it is needed)
            start = time.monotonic() if since is None else since
        if task.timed:
            cur[at + AT_STARTED] = start
        done = stages.run(item, index, task)
        if limit is not None and done[1] is None and time.monotonic() - start > limit:
            how = "in the calling process nothing stops it: its result was dropped"
            error = TimedOutItem(f"ran past timeout={task.timeout}s; {how}")
            return None, StageFailure(stages.prepared[0].name, error)
        return done

    async def _flown(
        self, item: Any, index: int, since: float | None
    ) -> tuple[Any, StageFailure | None]:
        """One try of unit ``index`` among units in flight together: the place's
        :class:`Flight` hears of it (its start: ``since`` when the place was idle since
        then, else now), :attr:`spans` of its slot-seconds."""
        stages, task = self.stages, self.task
        key, started = stages.flight.begin(index, since)
        try:
            if stages.is_async:
                return await stages.arun(item, index, task, started, key)
            return stages.run(item, index, task)
        finally:
            self.spans.append(stages.flight.end(key))  # (atomic: threads append at once)


async def _retrying(
    attempt: Callable[[float | None], Any], allowed: int, stop: Any, since: float | None = None
) -> tuple[Any, StageFailure | None]:
    """The one retry loop: ``attempt(since)`` (one try of a unit: its ``(value, failure)``,
    or a coroutine of them), again while it fails and ``allowed`` retries remain, each retry
    on a clock of its own; none once ``stop`` is set (``(None, None)``: left out). Plain
    stages never wait in it (:func:`_now`)."""
    value: Any = None
    failed: StageFailure | None = None
    for _ in range(max(allowed, 0) + 1):
        if stop.is_set():
            break
        done = attempt(since)
        value, failed = done if type(done) is tuple else await done
        since = None
        if failed is None:
            break
    return value, failed


def _gather(
    futures: list[concurrent.futures.Future[Any]],
) -> concurrent.futures.Future[list[Any]]:
    """One future of every unit's result (in order), once all are done; a unit cancelled
    before it started (the threads shut down) is left out."""
    import concurrent.futures

    done: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Any) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            done.set_result([(None, None) if f.cancelled() else f.result() for f in futures])

    if not futures:
        done.set_result([])
    for f in futures:
        f.add_done_callback(one_done)
    return done


class Flight:
    """The units in flight in one place (of every chunk it runs), oldest first: the oldest
    and their number go into the place's slot (see :meth:`to_slot`).

    ``by_step`` (async stages, whose units the loop cancels at their timeout): what a
    watchdog times is the unit holding the event loop now (:meth:`step`), from its own
    start (:class:`_Spent`); while none holds it, the oldest goes to the slot untimed
    (start None).

    While :meth:`hold` is on (a chunk is being unpickled, which the place's shared slot
    says), the slot hears of no change; :meth:`release` tells it how things stand.
    """

    def __init__(self, by_step: bool = False) -> None:
        self.slot: tuple[Any, int] | None = None  # (cur, at): the slot told (see to_slot)
        self.items: dict[int, tuple[int, float]] = {}
        self.lock = threading.Lock()
        self.keys = itertools.count()
        self.held = False
        self.by_step = by_step
        self.stepping: tuple[int, float] | None = None  # (index, own start) holding the loop
        self.last_end = 0.0  # when the last unit ended
        self.timing = (False, 0.0)  # the newest chunk's: units timed, the grace added

    def to_slot(self, cur: Any, at: int) -> None:
        """The oldest unit in flight goes into the slot ``cur[at:]`` from now on (its index,
        and its start when its chunk is timed, with the grace of an async unit's own
        cancellation: :attr:`timing`; else RUNNING), their number too."""
        with self.lock:
            self.slot = (cur, at)

    def hold(self) -> None:
        with self.lock:
            self.held = True

    def release(self, empty: Callable[[], None] | None = None) -> None:
        """End :meth:`hold`, telling how things stand (``empty`` is called instead of
        telling the oldest when no unit is in flight)."""
        with self.lock:
            self.held = False
            self._tell(bool(self.items))
            if not self.items and empty is not None:
                empty()

    def _tell(self, oldest: bool) -> None:
        if self.slot is None or self.held:
            return
        cur, at = self.slot
        cur[at + AT_FLIGHT] = float(len(self.items))
        if not oldest:
            return
        first = next(iter(self.items.values()), None)
        start: float | None
        if self.stepping is not None:
            index, start = self.stepping
        elif first is None:
            cur[at + AT_STARTED] = RUNNING
            return
        else:  # (by_step: the loop cancels the oldest at its timeout, no watchdog)
            index, start = first[0], None if self.by_step else first[1]
        cur[at + AT_INDEX] = float(index)
        timed, grace = self.timing
        cur[at + AT_STARTED] = start + grace if timed and start is not None else RUNNING

    def step(self, key: int | None, start: float = 0.0) -> None:
        """(``by_step``) The unit of ``key`` holds the event loop from now, its own time
        counted from ``start``; None: it gave the loop back."""
        with self.lock:
            self.stepping = None if key is None else (self.items[key][0], start)
            self._tell(True)

    def begin(self, index: int, since: float | None = None) -> tuple[int, float]:
        """Unit ``index`` starts now (or at ``since``, when this place was idle since then:
        its chunk's unpickling was its own time, not a wait for a slot). Returns its key for
        :meth:`end` and its start."""
        with self.lock:
            idle = since is not None and not self.items and self.last_end <= since
            start = since if idle else time.monotonic()
            key = next(self.keys)
            self.items[key] = (index, start)
            self._tell(len(self.items) == 1)
        return key, start

    def end(self, key: int) -> float:
        """The unit of ``key`` is over: the seconds it was in flight."""
        with self.lock:
            first = next(iter(self.items), None)
            _, start = self.items.pop(key)
            self.last_end = now = time.monotonic()
            self._tell(first == key)
        return now - start


def code_in(make: Callable[..., Any], args: tuple[Any, ...], where: str, lines: list[str]) -> Any:
    """A function's code, rebuilt by ``make(*args)`` (cloudpickle's reduction, which names
    its file ``"<dynamic-code>"``), in the file ``where`` it was defined, so that a traceback
    in a worker shows the user's file and line; ``lines``: the file's source, sent along when
    it is not on disk (a notebook's cell), for the traceback's source lines.
    """
    if lines:
        linecache.cache.setdefault(where, (sum(map(len, lines)), None, lines, where))
    return make(*args).replace(co_filename=where)
