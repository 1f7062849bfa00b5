"""``@producer``, ``@consumer``, ``Stage``, ``Pipeline`` and ``compose``.

A ``Stage`` wraps one user function with its ``init``/``end`` and the names it wants injected
(checked once, here, at decoration time). A ``Pipeline`` is an immutable value: producer stages
followed by at most one consumer. ``>>`` derives a new pipeline and never changes an operand.
Running is the business of ``easycore._exec``; this module only describes, and hands a run
over to it with the options checked (``RunOptions``).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import pkgutil
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, overload

import attrs

from easycore import _inject
from easycore._errors import surfaced
from easycore._options import RunKwargs, check_concurrency, check_count, run_options

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from easycore._exec.runner import Runner

__all__ = ["Binding", "Pipeline", "Stage", "compose", "consumer", "producer"]

_binding_tokens = itertools.count(1)


def _devices_converter(devices: Any) -> Any:
    return tuple(devices) if isinstance(devices, list) else devices


@attrs.frozen
class Binding:
    """Where a run of producers executes: its own pool, made by ``.on(devices, batch_size)``.

    ``concurrency``: items each of its workers holds at once. ``token`` tells two ``.on``
    calls apart even with equal arguments: each is its own pool.
    """

    devices: Any = attrs.field(converter=_devices_converter)
    batch_size: int | None = None
    concurrency: int = 1
    token: int = attrs.field(factory=_binding_tokens.__next__)
    bounds: tuple[int, int] | None = None  # a pool that sizes itself: (lo, hi) CPU workers


def _bounds(devices: tuple[Any, ...]) -> tuple[int, int] | None:
    """``.on((lo, hi))``'s bounds; None for a tuple of devices.

    Raises:
        ValueError: a pair of ints that are no bounds (``lo < 1`` or ``lo > hi``).
    """
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in devices)
    if len(devices) != 2 or not ints:
        return None
    lo, hi = devices
    if not 1 <= lo <= hi:
        msg = (
            f".on({devices!r}): a pair of ints is a pool that sizes itself, (lo, hi) with "
            "1 <= lo <= hi; GPUs are strings: .on(['cuda:0', 'cuda:1'])"
        )
        raise ValueError(msg)
    return lo, hi


def _fn_name(fn: Any) -> str:
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


def _import_stage(module: str, qualname: str) -> Stage:
    obj = pkgutil.resolve_name(f"{module}:{qualname}")
    if not isinstance(obj, Stage):  # pragma: no cover - the module changed under us
        msg = f"{module}.{qualname} is no longer an easycore stage"
        raise TypeError(msg)
    return obj


def _where(
    devices: Any,
    cfg: Any,
    start_method: str | None,
    engine: str,
    concurrency: int,
    cpus: int | None,
    trace: Any,
) -> dict[str, Any]:
    """Where a run's workers are, as :class:`~easycore.Runner` takes it (``concurrency``
    checked here, before anything else)."""
    check_concurrency(concurrency)
    return dict(
        devices=devices,
        cfg=cfg,
        start_method=start_method,
        engine=engine,
        concurrency=concurrency,
        cpus=cpus,
        trace=trace,
    )


class _Runs:
    """``map``, ``imap``, ``open`` and ``>>``, written once for :class:`Pipeline` and
    :class:`Stage`.

    A stage runs as the one-stage pipeline ``compose(stage)``, so both take the same
    arguments (``stage.map(data, 2)``, ``stage.open(2)``) and cannot drift apart.
    """

    __slots__ = ()

    def _as_pipeline(self) -> Pipeline:
        """The pipeline to run: a stage as a one-stage pipeline, a pipeline as an equal one."""
        return compose(self)

    def __rshift__(self, other: Stage | Pipeline) -> Pipeline:
        return compose(self, other)

    def __rrshift__(self, other: object) -> Pipeline:
        return compose(other, self)  # raises TypeError naming it

    @surfaced
    def open(
        self,
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
    ) -> Runner:
        """Start workers that stay up across calls; use as a context manager.

        ``init`` runs once per worker here (not per ``map``), ``end`` at ``close()``.

        Args:
            devices: an int (CPU workers), a list of device strings or ``torch.device``s,
                ``"cuda"``, ``"auto"`` or ``"inline"`` (no processes); for producers bound
                with :meth:`Pipeline.on` their own devices apply instead (``"inline"`` still runs
                everything in the calling process).
            cfg: a mapping or ``CfgNode``; workers receive it frozen.
            start_method: None (default): a fork of this process where safe, else the
                forkserver; or ``"forkserver"``, ``"spawn"``, ``"fork"``.
            prefetch: chunks each worker may hold for a run, queued, running or finished
                and waiting for the caller (default 2; see :meth:`imap`).
            engine: ``"local"`` (worker processes on this machine) or ``"ray"`` (every pool
                a group of Ray actors on the cluster ``ray.init()`` connects to; see
                :meth:`map`).
            epoch: the epoch of the runner's ``map``/``imap`` calls that do not give one
                (see :meth:`map`).
            concurrency: items each worker of the pool ``devices`` describes holds at once
                (see :meth:`map`); pools made with ``.on`` have their own.
            cpus: the CPU budget of pools that size themselves (see :meth:`map`).
            trace: a path: every run's Chrome Trace Event file, written as each run ends
                (see :meth:`map`).

        Returns:
            An active :class:`~easycore.Runner`.

        Raises:
            ValueError: an impossible device, or ``concurrency`` below 1, before any
                process starts.
            TypeError: ``concurrency`` not an int.
            WorkerError: an ``init`` raised.
        """
        from easycore._exec.runner import Runner

        where = _where(devices, cfg, start_method, engine, concurrency, cpus, trace)
        return Runner(self._as_pipeline(), **where, prefetch=prefetch, epoch=epoch)

    @surfaced
    def map(
        self,
        data: Iterable[Any],
        devices: Any = "auto",
        cfg: Mapping[str, Any] | None = None,
        *positional: Any,
        start_method: str | None = None,
        distributed: bool = False,
        engine: str = "local",
        concurrency: int = 1,
        cpus: int | None = None,
        trace: str | os.PathLike[str] | None = None,
        **options: Unpack[RunKwargs],
    ) -> Any:
        """Run the pipeline over ``data`` on fresh workers and close them.

        The run's options are the keyword arguments of :class:`~easycore.RunKwargs`
        (``ordered``, ``batch_size``, ``progress``, ``seed``, ``timeout`` and ``retries``
        may also follow ``cfg`` by position, in that order); an unknown one is a
        ``TypeError`` naming the closest option.

        ``devices`` applies to producers not bound with :meth:`Pipeline.on` (those run on their own
        pool's devices); ``batch_size`` batches the input of the first pool.

        With ``distributed=True``, in a job launched by ``torchrun`` or Slurm (every rank
        calls ``map`` with the same ``data``): item (or batch) ``i`` runs on rank
        ``i % world_size`` on that rank's ``devices`` (``"local"``: its own GPU, else its
        share of the CPU cores), the consumer folds once on rank 0, and every rank returns
        the result of a single-process run with the same ``seed`` and ``batch_size`` (an
        error on any rank raises ``WorkerError`` on every rank; see
        :mod:`easycore.distributed`).

        Long jobs: ``errors="skip"`` sets aside an item that still fails after its retries,
        reported as an :class:`~easycore.Failure` to ``on_error`` (else in one warning per
        run); ``resume="run.db"`` records every finished item (its key, a digest of it and
        its result) in that SQLite file, so the same call after a crash computes only what
        the file lacks (a file of another run, or a changed item, is a ``ValueError``);
        ``max_items_per_worker`` and ``max_worker_memory`` replace a worker between chunks.
        Nothing is lost or doubled (see :class:`~easycore.RunKwargs` for each option).

        ``engine="ray"`` runs every pool as a group of Ray actors on the cluster that
        ``ray.init()`` connects to (``RAY_ADDRESS``, else a local Ray started for the run);
        there ``devices=n`` means n actors of one CPU each and a GPU entry an actor holding
        one GPU. Everything above holds the same (a seeded run gives the same results).

        Stages that wait: a producer and its ``init``/``end`` may be ``async def``;
        ``concurrency=k`` lets each worker of the pool ``devices`` describes hold up to ``k``
        items at once (async producers as tasks of one event loop per worker, plain ones on
        ``k`` threads; ``.on(n, concurrency=k)`` sets it per pool), each item with its own
        :func:`easycore.item_seed`. ``epoch=e``: with ``seed``, every item gets a seed of its
        own in every epoch, the same on every run (:func:`easycore.derive_seed`).

        Args:
            data: any iterable (generators too), consumed lazily under backpressure.
            devices: an int (CPU workers), a list of device strings or ``torch.device`` s (one
                worker each), ``"cuda"``, ``"auto"`` (every GPU, else one worker per core) or
                ``"inline"`` (everything in this process).
            cfg: a mapping or ``CfgNode``, injected frozen as ``cfg``.
            *positional: ``ordered``, ``batch_size``, ``progress``, ``seed``, ``timeout``,
                ``retries`` by position, in that order.
            start_method: None (default): a fork of this process where safe, else the
                forkserver; or ``"forkserver"``, ``"spawn"``, ``"fork"``.
            distributed: share the items out between the ranks of a torchrun/Slurm job.
            engine: ``"local"`` (worker processes here) or ``"ray"`` (on a Ray cluster).
            concurrency: items each worker of the pool ``devices`` describes holds at once
                (default 1; pools made with ``.on`` have their own).
            cpus: the CPU budget that pools made with ``.on((lo, hi))`` share, after the
                workers of fixed pools (default: the cores this process may use; on Ray, the
                cluster's CPUs).
            trace: a path: a Chrome Trace Event file of the run (a span per chunk per pool,
                workers and items waiting per pool, each resize), written when the run ends,
                however it ends; open it in Perfetto.
            **options: the run's options, each described in :class:`~easycore.RunKwargs`
                (``ordered``, ``batch_size``, ``progress``, ``seed``, ``timeout``,
                ``retries``, ``prefetch``, ``errors``, ``on_error``, ``resume``, ``key``,
                ``retry_failed``, ``accept_changed_code``, ``max_items_per_worker``,
                ``max_worker_memory``, ``epoch``; ``state`` is for :meth:`imap`).

        Returns:
            The consumer's result, or a list of results when there is no consumer.

        Raises:
            WorkerError: user code raised (``__cause__`` is the original exception);
                ``ItemTimeout``, ``SerializationError`` and ``WorkerDied`` are kinds of it:
                catch it for any failure of the items.
            WorkerDied: a worker process died.
            TypeError: an argument of the wrong type (``ordered``, ``concurrency``...),
                before any process starts.
            ValueError: a bad argument or device, or a ``resume`` ledger of another run or
                input, before any process starts.

        >>> @producer
        ... def square(x):
        ...     return x * x
        >>> square.map(range(4), devices="inline")
        [0, 1, 4, 9]
        """
        where = _where(devices, cfg, start_method, engine, concurrency, cpus, trace)
        run = run_options("map", positional, options)
        if distributed:  # (its module loads torch.distributed's helpers: only then)
            from easycore._exec.sharded import sharded_map

            return sharded_map(self._as_pipeline(), data, run, **where)
        from easycore._exec.runner import run_map

        return run_map(self._as_pipeline(), data, run, **where)

    @surfaced
    def imap(
        self,
        data: Iterable[Any],
        devices: Any = "auto",
        cfg: Mapping[str, Any] | None = None,
        *positional: Any,
        start_method: str | None = None,
        engine: str = "local",
        concurrency: int = 1,
        cpus: int | None = None,
        trace: str | os.PathLike[str] | None = None,
        **options: Unpack[RunKwargs],
    ) -> Iterator[Any]:
        """Yield results lazily with bounded memory; for pipelines without a consumer.

        Workers start, and the first chunks go to them, when ``imap`` is called (as a
        DataLoader's iterator does), not at the first ``next()``; they stop when the results
        are exhausted, closed, or garbage-collected. ``prefetch=k``: each worker may hold ``k``
        chunks, queued, running or finished and waiting for the caller (see
        :meth:`Runner.imap`).

        The iterator's ``state_dict()`` is its position, a small JSON-serialisable dict;
        ``imap(..., state=that)`` continues with exactly the next result, every result after
        it the uninterrupted run's (seeds included), without computing the items before it
        (see :meth:`Runner.imap` for the inputs that can resume). ``epoch``: see
        :meth:`map`.

        Args:
            data: any iterable, endless ones included (with ``state=``: a sequence, a
                ``range`` or an object with ``iter_from``).
            devices: as for :meth:`map`.
            cfg: as for :meth:`map`.
            *positional: as for :meth:`map`.
            start_method: as for :meth:`map`.
            engine: as for :meth:`map`.
            concurrency: as for :meth:`map`.
            cpus: as for :meth:`map`.
            trace: as for :meth:`map`.
            **options: as for :meth:`map`, and ``state`` (see above).

        Returns:
            An iterator of the results, with ``state_dict()``; closing it (or dropping it)
            stops the workers.

        Raises:
            TypeError: the pipeline has a consumer (use :meth:`map`), or a bad argument.
            ValueError: a bad argument or device, before any process starts; ``state`` is
                not an imap position or one of another run (another seed, epoch, batch size
                or input length), or the input (a generator) cannot start in the middle.
            WorkerError: user code raised, when the iterator reaches that item.
            WorkerDied: a worker process died.
        """
        pipeline = self._as_pipeline()
        if pipeline.consumer is not None:
            msg = (
                f"imap is for pipelines without a consumer; {pipeline!r} ends in "
                f"{pipeline.consumer!r}: use map"
            )
            raise TypeError(msg)
        from easycore._exec.runner import run_imap

        where = _where(devices, cfg, start_method, engine, concurrency, cpus, trace)
        return run_imap(pipeline, data, run_options("imap", positional, options), **where)


@attrs.frozen(eq=True, repr=False)
class Stage(_Runs):
    """One decorated function: a producer (runs in workers) or a consumer (a fold, in the caller).

    Made by :func:`producer` and :func:`consumer`; calling a stage calls the function itself.
    Compose stages with ``>>`` or :func:`compose`; run them with ``map``, ``imap`` or ``open``.

    Attributes:
        fn: the decorated function.
        kind: ``"producer"`` or ``"consumer"``.
        init: a producer's ``init`` callable; a consumer's first accumulator (or its maker).
        end: the ``end`` callable, or None.
        fn_names: the injectable names ``fn`` declares.
        init_names: the injectable names ``init`` declares.
        end_names: the injectable names ``end`` declares.
    """

    fn: Callable[..., Any]
    kind: str  # "producer" or "consumer"
    init: Any = None
    end: Callable[..., Any] | None = None
    fn_names: tuple[str, ...] = ()
    init_names: tuple[str, ...] = ()
    end_names: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The wrapped function's name, used in error messages and ``repr``."""
        return _fn_name(self.fn)

    @property
    def has_init(self) -> bool:
        """Whether ``init`` was given (a consumer's ``init=None`` counts as none)."""
        return self.init is not None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        extra = ""
        if self.has_init:
            extra += f", init={_fn_name(self.init) if callable(self.init) else repr(self.init)}"
        if self.end is not None:
            extra += f", end={_fn_name(self.end)}"
        return f"{self.kind}({self.name}{extra})"

    def __reduce__(self) -> Any:
        # A stage decorated at a module's top level travels by reference (the worker imports
        # the module), like a plain function; others (``__main__``, notebooks, closures) travel
        # by value through cloudpickle.
        module = getattr(self.fn, "__module__", None)
        qualname = getattr(self.fn, "__qualname__", "")
        if module and module != "__main__" and "<locals>" not in qualname:
            with contextlib.suppress(Exception):
                if module in sys.modules and _import_stage(module, qualname) is self:
                    return (_import_stage, (module, qualname))
        return (Stage, tuple(getattr(self, a.name) for a in attrs.fields(Stage)))

    def on(self, devices: Any, batch_size: int | None = None, *, concurrency: int = 1) -> Pipeline:
        """Give this producer its own pool of workers; see :meth:`Pipeline.on`.

        Args:
            devices: the pool's devices, as ``map`` takes them (not ``"inline"``).
            batch_size: hand this pool lists of this many results of the pool before it.
            concurrency: items each worker holds at once (default 1).

        Returns:
            A one-stage :class:`Pipeline` bound to that pool.

        Raises:
            TypeError: the stage is a consumer, or ``concurrency`` is not an int.
            ValueError: ``devices='inline'``, a bad ``batch_size`` or ``concurrency``.
        """
        return compose(self).on(devices, batch_size, concurrency=concurrency)


# The roles of a stage's three functions, for their checks: (role, positional, allowed).
_ROLES = {
    "producer": (
        ("producer", 1, _inject.PRODUCER_WORK),
        ("producer init", 0, _inject.PRODUCER_INIT),
        ("producer end", 0, _inject.PRODUCER_END),
    ),
    "consumer": (
        ("consumer", 2, _inject.CONSUMER),
        ("consumer init", 0, _inject.CONSUMER),
        ("consumer end", 1, _inject.CONSUMER),
    ),
}


def _stage(kind: str, fn: Callable[..., Any], init: Any, end: Callable[..., Any] | None) -> Stage:
    """A decorated function as a :class:`Stage`, the signatures of its functions checked.

    What cannot wait (docs/contract.md section 11) is refused here: a consumer or its
    ``init``/``end`` that is ``async def`` or an async generator (the consumer folds in the
    calling process), an async generator as a producer or its ``init``/``end``.
    """
    if isinstance(fn, Stage):
        msg = f"{fn!r} is already a stage; decorate the plain function once"
        raise TypeError(msg)
    names: list[tuple[str, ...]] = []
    for part, (role, n, allowed) in zip((fn, init, end), _ROLES[kind], strict=True):
        # A consumer's init may be a value (its first accumulator): only a callable declares names.
        if part is None or (role == "consumer init" and not callable(part)):
            names.append(())
            continue
        what = f"{role} {_fn_name(part)!r}"
        asyncgen = _inject.is_async_fn(part, inspect.isasyncgenfunction)
        if kind == "consumer" and (asyncgen or _inject.is_async_fn(part)):
            msg = (
                f"{what} is {'an async generator' if asyncgen else '`async def`'}: a consumer "
                "folds results in the calling process and cannot wait; make it a plain `def` "
                "and do the waiting in an `async def` producer before it"
            )
            raise TypeError(msg)
        if asyncgen:
            fix = (
                "a producer returns one result per item; make it `async def` and `return` "
                "the result (a list, to give several)"
                if role == "producer"
                else "it runs once per worker; make it `async def` (or a plain `def`) "
                "without `yield`"
            )
            msg = f"{what} is an async generator: {fix}"
            raise TypeError(msg)
        names.append(_inject.injected_names(part, role=role, positional=n, allowed=allowed))
    return Stage(fn, kind, init, end, *names)


@overload
def producer(fn: Callable[..., Any], /) -> Stage: ...
@overload
def producer(
    fn: None = None,
    /,
    *,
    init: Callable[..., Any] | None = None,
    end: Callable[..., Any] | None = None,
) -> Callable[[Callable[..., Any]], Stage]: ...
def producer(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    init: Callable[..., Any] | None = None,
    end: Callable[..., Any] | None = None,
) -> Stage | Callable[[Callable[..., Any]], Stage]:
    """Declare a work function that runs in worker processes, one item at a time.

    Works bare (``@producer``) or with options (``@producer(init=load, end=save)``). The
    function takes the item first and may declare ``device``, ``cfg``, ``state`` and
    ``worker`` to have them filled in. ``init`` (declaring any of ``device``, ``cfg``,
    ``worker``) runs once per worker and returns its ``state``; ``end`` (also ``state``) runs
    when the worker stops.

    Args:
        fn: the work function (when used bare).
        init: called once per worker; its return value is the stage's ``state``.
        end: called once per worker at shutdown.

    Returns:
        A :class:`Stage`, still callable as the original function.

    Raises:
        TypeError: a function declares a parameter that cannot be injected, or ``*args``.

    >>> @producer
    ... def square(x):
    ...     return x * x
    >>> square(3)
    9
    """

    def wrap(f: Callable[..., Any]) -> Stage:
        return _stage("producer", f, init, end)

    return wrap if fn is None else wrap(fn)


@overload
def consumer(fn: Callable[..., Any], /) -> Stage: ...
@overload
def consumer(
    fn: None = None, /, *, init: Any = None, end: Callable[..., Any] | None = None
) -> Callable[[Callable[..., Any]], Stage]: ...
def consumer(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    init: Any = None,
    end: Callable[..., Any] | None = None,
) -> Stage | Callable[[Callable[..., Any]], Stage]:
    """Declare a fold ``(accumulator, item) -> accumulator`` that runs in the calling process.

    ``init`` is the first accumulator: a value (deep-copied for every run, so ``init=[]`` is
    safe) or a callable taking nothing or ``cfg``. Returning ``None`` from the function keeps
    the accumulator (for in-place updates such as ``list.append``). ``end(acc)`` (may also
    declare ``cfg``) turns the accumulator into the run's result.

    Args:
        fn: the fold function (when used bare).
        init: the initial accumulator, or a callable making it.
        end: turns the final accumulator into the result.

    Returns:
        A :class:`Stage`, still callable as the original function.

    >>> @consumer(init=0)
    ... def summer(total, x):
    ...     return total + x
    >>> summer(1, 2)
    3
    """

    def wrap(f: Callable[..., Any]) -> Stage:
        return _stage("consumer", f, init, end)

    return wrap if fn is None else wrap(fn)


# attrs converters typed for mypy (``converter=tuple`` leaves the element type unknown)
def _stages_tuple(value: Iterable[Stage]) -> tuple[Stage, ...]:
    return tuple(value)


def _bindings_tuple(value: Iterable[Binding | None]) -> tuple[Binding | None, ...]:
    return tuple(value)


@attrs.frozen(repr=False)
class Pipeline(_Runs):
    """An immutable chain: producer stages, then at most one consumer.

    Consecutive producers run fused in the same worker, item by item. Build with ``>>`` or
    :func:`compose`; every ``>>`` returns a new pipeline.

    >>> @producer
    ... def inc(x):
    ...     return x + 1
    >>> @producer
    ... def double(x):
    ...     return 2 * x
    >>> inc >> double
    Pipeline(inc >> double)
    >>> (inc >> double).map([1, 2, 3], devices="inline")
    [4, 6, 8]

    Attributes:
        producers: the producer stages, in order.
        consumer: the consumer stage, or None.
        sink: an ``easycore.write`` sink the results go to in place of a consumer, or None.
        placement: per producer, the pool ``.on`` bound it to, or None (the run's devices).
    """

    producers: tuple[Stage, ...] = attrs.field(converter=_stages_tuple, default=())
    consumer: Stage | None = None
    sink: Any = None  # an easycore.write sink: where the results go, in place of a consumer
    # One entry per producer: the pool it is bound to by ``.on``, or None (the run's devices).
    placement: tuple[Binding | None, ...] = attrs.field(converter=_bindings_tuple, default=())

    def __attrs_post_init__(self) -> None:
        if len(self.placement) != len(self.producers):
            object.__setattr__(self, "placement", (None,) * len(self.producers))

    @property
    def stages(self) -> tuple[Stage, ...]:
        """All stages in order, the consumer (if any) last."""
        return self.producers + ((self.consumer,) if self.consumer is not None else ())

    @property
    def pools(self) -> tuple[tuple[tuple[Stage, ...], Binding | None], ...]:
        """The producers cut into pools: ``((stages, binding or None), ...)``.

        Each ``.on`` is one pool; consecutive producers without ``.on`` fuse into one pool
        that runs on the run's ``devices``.
        """
        runs = itertools.groupby(zip(self.producers, self.placement, strict=True), lambda p: p[1])
        return tuple((tuple(stage for stage, _ in run), binding) for binding, run in runs)

    def __repr__(self) -> str:
        parts = []
        for stages, binding in self.pools:
            text = " >> ".join(s.name for s in stages)
            if binding is not None:
                devices = binding.devices
                args = repr(list(devices) if isinstance(devices, tuple) else devices)
                args = repr(binding.bounds) if binding.bounds else args
                if binding.batch_size is not None:
                    args += f", batch_size={binding.batch_size}"
                if binding.concurrency != 1:
                    args += f", concurrency={binding.concurrency}"
                text = f"({text}).on({args})" if len(stages) > 1 else f"{text}.on({args})"
            parts.append(text)
        if self.consumer is not None:
            parts.append(self.consumer.name)
        if self.sink is not None:
            parts.append(repr(self.sink))
        return f"Pipeline({' >> '.join(parts)})"

    def on(self, devices: Any, batch_size: int | None = None, *, concurrency: int = 1) -> Pipeline:
        """Run these producers, fused, in a pool of their own on ``devices``.

        ``decode.on(4) >> predict.on(["cuda:0", "cuda:1"], batch_size=32) >> collect`` runs
        ``decode`` on 4 CPU workers and ``predict`` on two GPUs; items go from pool to pool
        directly between workers. ``batch_size`` groups what the previous pool yields item by
        item into lists for this pool. Producers without ``.on`` run on ``map``'s ``devices``.

        ``concurrency=k``: each worker of the pool holds up to ``k`` items at once, for stages
        that wait (``fetch.on(2, concurrency=64)``): ``async def`` producers run as tasks of
        one event loop per worker, plain ones on ``k`` threads of the worker.

        ``.on((lo, hi))``, a pair of ints: a pool of CPU workers that sizes itself between
        ``lo`` and ``hi`` while the run goes, within the run's ``cpus=`` budget (the run
        moves workers to the pool that limits it; see ``Runner.stats``' ``resizes``).

        Args:
            devices: the pool's devices, as ``map`` takes them (not ``"inline"``), or
                ``(lo, hi)``: bounds of a pool that sizes itself.
            batch_size: hand this pool lists of this many results of the pool before it
                (on the first pool: of input items).
            concurrency: items each worker holds at once (default 1).

        Returns:
            A new pipeline; this one is unchanged.

        Raises:
            TypeError: the pipeline has a consumer or is already (partly) bound, or
                ``concurrency`` is not an int.
            ValueError: ``devices='inline'``, a bad ``batch_size``, ``concurrency`` < 1, or
                bounds that are none (``lo < 1`` or ``lo > hi``).
        """
        if self.consumer is not None or self.sink is not None:
            what = "a consumer" if self.sink is None else "a sink"
            msg = f".on binds producers to workers; {self!r} ends in {what}: bind before it"
            raise TypeError(msg)
        if not self.producers:
            msg = ".on needs at least one producer"
            raise TypeError(msg)
        if any(b is not None for b in self.placement):
            msg = f"{self!r} is already bound with .on; bind each run of producers once"
            raise TypeError(msg)
        check_concurrency(concurrency)
        if isinstance(devices, str) and devices == "inline":
            msg = (
                ".on('inline') is not supported: 'inline' applies to a whole run, "
                "use map(..., devices='inline') to debug every stage in the calling process"
            )
            raise ValueError(msg)
        check_count("batch_size", batch_size)
        bounds = _bounds(devices) if type(devices) is tuple else None
        binding = Binding(devices, batch_size, concurrency, bounds=bounds)
        return attrs.evolve(self, placement=(binding,) * len(self.producers))

    def __len__(self) -> int:
        return len(self.stages)


def compose(*parts: Any) -> Pipeline:
    """Chain stages and pipelines into a new :class:`Pipeline` (same as ``a >> b >> c``).

    The last operand may be a sink (``easycore.write.parquet(...)``): the results are
    written to files instead of returned.

    Args:
        *parts: stages and pipelines, in order; a consumer only last.

    Returns:
        A new pipeline; the operands are unchanged.

    Raises:
        TypeError: an operand is not a stage, pipeline or sink, a consumer or a sink is
            followed by anything, there are two consumers, or a consumer and a sink; the
            message names the offending operand.

    >>> @producer
    ... def inc(x):
    ...     return x + 1
    >>> compose(inc, inc)
    Pipeline(inc >> inc)
    """
    producers: list[Stage] = []
    placement: list[Binding | None] = []
    last: Stage | None = None
    sink: Any = None
    for part in parts:
        if sink is not None:
            msg = (
                f"nothing can follow the sink {sink!r}, but {part!r} does: a sink ends a "
                "pipeline, in place of a consumer"
            )
            raise TypeError(msg)
        if getattr(part, "is_sink", False) is True:  # (easycore._longjobs.sinks.Sink; duck-typed)
            part = Pipeline(sink=part)
        elif isinstance(part, Stage):  # as a one-stage pipeline
            part = Pipeline((part,)) if part.kind == "producer" else Pipeline(consumer=part)
        if not isinstance(part, Pipeline):
            msg = (
                f"cannot compose {part!r} (a {type(part).__name__}): operands of >> and compose "
                "must be @producer/@consumer stages, pipelines or sinks (easycore.write)"
            )
            raise TypeError(msg)
        for stage, binding in zip(part.stages, (*part.placement, None), strict=False):
            if last is not None:
                msg = (
                    f"nothing can follow the consumer {last!r}, but {stage!r} does: the consumer "
                    "must be the last stage, and a pipeline has at most one"
                )
                raise TypeError(msg)
            if stage.kind == "consumer":
                last = stage
            else:
                producers.append(stage)
                placement.append(binding)
        if part.sink is not None and last is not None:
            msg = (
                f"the sink {part.sink!r} cannot follow the consumer {last!r}: a pipeline ends "
                "in a consumer or in a sink, not both"
            )
            raise TypeError(msg)
        sink = part.sink
    return Pipeline(producers, last, sink, placement)
