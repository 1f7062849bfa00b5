"""One measurement of one library on one workload, run inside a fresh process.

Every library is wrapped in a *session*: constructing it creates the pool (if the library
has one), :meth:`Session.run` runs the workload's function over the items and returns what
the caller receives (a sum for W1, a list otherwise), :meth:`Session.close` shuts the pool
down. :func:`measure` times sessions in one of three ways:

``call`` (the default for W1-W3b)
    the one-shot call a user writes — create the pool, run, shut down — timed end to end,
    after one untimed call on a few items in the same process (imports done, easycore's
    forkserver up, joblib's reusable loky executor started: a program's second call).
``warm`` (``--mode warm``)
    the pool is created and used once before the clock starts, then only ``run`` is timed
    (easycore: ``pipeline.open(devices=n)`` then ``runner.map(items)``).
W4 (``phase=cold`` / ``phase=warm``)
    create, run one item, shut down: the first such cycle in a fresh process (cold) or the
    second one (warm). Library imports happen before the clock starts.

Variants are ``default`` or comma-separated ``key=value`` options: ``chunksize`` (Pool,
concurrent.futures, mpire's ``chunk_size``), ``batch_size`` (joblib), ``context``
(multiprocessing start method), ``phase`` (W4), ``caller=torch`` (import torch before any
clock, as a torch program has: easycore's workers then fork from its torch forkserver),
``stream=1`` (W3/W3b: each library's streaming call, every result folded by the caller as it
arrives and dropped: ``Pool.imap``, ``Executor.map``, joblib's generator output, mpire's
``imap``, an easycore consumer; ``run`` returns the fold).
"""

from __future__ import annotations

import functools
import gc
import importlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import bench_workloads as wl

#: Module each library needs imported before any clock starts.
LIB_MODULES: dict[str, tuple[str, ...]] = {
    "sequential": (),
    "pool": ("multiprocessing.pool",),
    "futures": ("concurrent.futures",),
    "joblib": ("joblib",),
    "mpire": ("mpire",),
    # easycore's executor loads on first use (a program that only reads a config never pays
    # for it): imported here as the rest of the library is, before any clock starts
    "easycore": ("easycore", "easycore._exec.runner"),
    "dataloader": ("torch",),
    "spdl": ("spdl.pipeline", "concurrent.futures"),
    "torchdata": ("torchdata.nodes",),
    "raydata": ("ray", "ray.data"),
    "raytasks": ("ray",),
    "reference": (),
}

#: Modules the caller of a workload uses anyway (it receives tensors or arrays), imported
#: before pools are created: fork-based pools then inherit them instead of importing them
#: again in every worker, as in a program that already works with torch or numpy.
WORKLOAD_MODULES: dict[str, tuple[str, ...]] = {
    "W3": ("torch",),
    "W3b": ("numpy",),
    "W5": ("torch", "numpy"),
}

#: Libraries that pass work through the pool itself (not easycore, not in-process).
PEERS = ("pool", "futures", "joblib", "mpire")


def work_function(workload: str, lib: str) -> Callable[[int], Any]:
    """The function a library runs for a workload.

    Peers get the W3 variant that pins torch to one thread per worker (what a careful user
    does); easycore and the in-process loop get the plain one.
    """
    if workload == "W1":
        return wl.square
    if workload == "W2":
        return wl.busy_5ms
    if workload == "W3":
        return wl.make_tensor_1thread if lib in PEERS else wl.make_tensor
    if workload == "W3b":
        return wl.make_array
    if workload == "W4":
        return wl.identity
    if workload == "W5":
        return wl.w5_fused_1thread if lib in PEERS else wl.w5_fused
    msg = f"unknown workload {workload!r}"
    raise ValueError(msg)


def parse_variant(variant: str) -> dict[str, str]:
    """``"chunksize=100,context=fork"`` -> ``{"chunksize": "100", "context": "fork"}``."""
    if variant in ("", "default"):
        return {}
    opts: dict[str, str] = {}
    for part in variant.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            msg = f"variant option {part!r} is not key=value"
            raise ValueError(msg)
        opts[key.strip()] = value.strip()
    return opts


def _int_or_none(opts: dict[str, str], key: str) -> int | None:
    return int(opts[key]) if key in opts else None


def _collect(total: bool, results: Iterable[Any], stream: str = "") -> Any:
    """What the caller keeps: the sum (W1), every result in a list, or (``stream``: the
    workload, W3/W3b streamed) the fold of every result as it arrives, each one dropped
    after its fold."""
    if stream:
        return functools.reduce(wl.FOLDS[stream], results, wl.FOLD_INIT)
    return sum(results) if total else list(results)


# ---------------------------------------------------------------------------------------------
# sessions
# ---------------------------------------------------------------------------------------------
class Session(Protocol):
    """A library's pool, ready to run the workload's function."""

    def run(self, items: Sequence[int]) -> Any:
        """Run the function over ``items``; return the sum (W1), the list of results, or
        (``stream``) the fold of the results."""

    def close(self) -> None:
        """Shut the pool down and wait for its processes."""


class Sequential:
    """The in-process loop: ``sum(map(fn, items))`` or ``list(map(fn, items))``."""

    def __init__(
        self, fn: Callable[[int], Any], total: bool, workers: int, opts: dict[str, str], keep: bool
    ) -> None:
        del workers, keep
        self.fn, self.total, self.stream = fn, total, opts.get("stream", "")

    def run(self, items: Sequence[int]) -> Any:
        return _collect(self.total, map(self.fn, items), self.stream)

    def close(self) -> None:
        pass


class MpPool:
    """``multiprocessing.Pool(workers).map(fn, items, chunksize)`` (streamed: ``imap``, whose
    default chunksize is 1); default start method."""

    def __init__(
        self, fn: Callable[[int], Any], total: bool, workers: int, opts: dict[str, str], keep: bool
    ) -> None:
        import multiprocessing as mp

        del keep
        ctx = mp.get_context(opts["context"]) if "context" in opts else mp.get_context()
        self.fn, self.total, self.stream = fn, total, opts.get("stream", "")
        self.chunksize = _int_or_none(opts, "chunksize")
        self.pool = ctx.Pool(workers)

    def run(self, items: Sequence[int]) -> Any:
        if self.stream:  # imap: results as they come (its default chunksize is 1)
            return _collect(False, self.pool.imap(self.fn, items, self.chunksize or 1), self.stream)
        return _collect(self.total, self.pool.map(self.fn, items, chunksize=self.chunksize))

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


class Futures:
    """``ProcessPoolExecutor(workers).map(fn, items, chunksize=...)`` (its default is 1)."""

    def __init__(
        self, fn: Callable[[int], Any], total: bool, workers: int, opts: dict[str, str], keep: bool
    ) -> None:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        del keep
        ctx = mp.get_context(opts["context"]) if "context" in opts else None
        self.fn, self.total, self.stream = fn, total, opts.get("stream", "")
        self.chunksize = _int_or_none(opts, "chunksize") or 1
        self.ex = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)

    def run(self, items: Sequence[int]) -> Any:
        out = self.ex.map(self.fn, items, chunksize=self.chunksize)  # yields in order
        return _collect(self.total, out, self.stream)

    def close(self) -> None:
        self.ex.shutdown(wait=True)


class Joblib:
    """``joblib.Parallel(n_jobs=workers)(delayed(fn)(x) for x in items)``, loky backend
    (streamed: ``return_as="generator"``).

    joblib keeps its loky executor alive between calls by default, so ``close`` has nothing
    to shut down: that reuse is joblib's own default behaviour.
    """

    def __init__(
        self, fn: Callable[[int], Any], total: bool, workers: int, opts: dict[str, str], keep: bool
    ) -> None:
        from joblib import Parallel

        del keep
        batch: int | str = _int_or_none(opts, "batch_size") or "auto"
        self.fn, self.total, self.stream = fn, total, opts.get("stream", "")
        # streamed: joblib's generator output, results as they complete, in order
        how = {"return_as": "generator"} if self.stream else {}
        self.parallel = Parallel(n_jobs=workers, batch_size=batch, **how)

    def run(self, items: Sequence[int]) -> Any:
        from joblib import delayed

        call = delayed(self.fn)
        return _collect(self.total, self.parallel(call(x) for x in items), self.stream)

    def close(self) -> None:
        pass


class Mpire:
    """``mpire.WorkerPool(n_jobs=workers).map(fn, items, chunk_size=...)`` (streamed: ``imap``).

    ``concatenate_numpy_output=False``: by default mpire glues numpy results into one big
    array (an extra copy, and not the 200 arrays the workload returns); a user who wants the
    arrays back turns that off. It changes nothing for non-numpy results. ``keep_alive`` is
    on only in ``warm`` mode, where the pool must survive between ``map`` calls.
    """

    def __init__(
        self, fn: Callable[[int], Any], total: bool, workers: int, opts: dict[str, str], keep: bool
    ) -> None:
        from mpire import WorkerPool

        kwargs: dict[str, Any] = {"n_jobs": workers, "keep_alive": keep}
        if "context" in opts:
            kwargs["start_method"] = opts["context"]
        self.fn, self.total, self.stream = fn, total, opts.get("stream", "")
        self.chunk_size = _int_or_none(opts, "chunksize")
        self.pool = WorkerPool(**kwargs)

    def run(self, items: Sequence[int]) -> Any:
        if self.stream:  # imap: ordered, results as they come
            out = self.pool.imap(self.fn, items, chunk_size=self.chunk_size)
            return _collect(False, out, self.stream)
        out = self.pool.map(
            self.fn, items, chunk_size=self.chunk_size, concatenate_numpy_output=False
        )
        return _collect(self.total, out)

    def close(self) -> None:
        self.pool.stop_and_join()


class Easycore:
    """easycore exactly as the README shows it, with no tuning.

    ``call``: ``(producer(fn) >> summer).map(items, devices=workers)`` for W1 (a consumer
    sums; variant ``fold=sum``: ``sum(producer(fn).map(...))``),
    ``producer(fn).map(items, devices=workers)`` otherwise; W3/W3b streamed (variant
    ``stream=1``): ``(producer(fn) >> consumer(init=FOLD_INIT)(fold)).map(...)``. ``warm``:
    the same pipeline's ``open(devices=workers)`` runner, then ``runner.map(items)``.
    """

    def __init__(
        self, fn: Callable[[int], Any], total: bool, workers: int, opts: dict[str, str], keep: bool
    ) -> None:
        from easycore import consumer, producer

        pipeline: Any = producer(fn)
        self.flatten = False
        if "pools" in opts:  # W5 with a pool per stage: "pools=2+1" workers for decode + model
            first, second = (int(k) for k in opts["pools"].split("+"))
            model = producer(init=wl.w5_load)(_w5_model_batch)
            pipeline = producer(wl.w5_decode).on(first) >> model.on(second, batch_size=wl.W5_BATCH)
            self.flatten = True
        # W1 sums: with a consumer (the README's way), or "fold=sum": sum() over map's list,
        # the same code shape as the peers' rows
        self.sum = total and opts.get("fold") == "sum"
        if total and not self.sum:
            pipeline = pipeline >> consumer(init=0)(_add)
        if "stream" in opts:  # W3/W3b streamed: the README's way, a consumer folds each result
            pipeline = pipeline >> consumer(init=wl.FOLD_INIT)(wl.FOLDS[opts["stream"]])
        self.pipeline = pipeline
        self.where = {} if self.flatten else {"devices": workers}  # (pools: their own .on)
        self.runner = pipeline.open(**self.where) if keep else None
        # "resume=1": a run ledger in a fresh SQLite file per run (its overhead is measured)
        self.ledger = "resume" in opts
        self.kwargs: dict[str, Any] = {}

    def run(self, items: Sequence[int]) -> Any:
        if self.ledger:
            import tempfile

            folder = tempfile.mkdtemp(prefix="easycore-bench-")
            self.kwargs["resume"] = f"{folder}/run.db"
        if self.runner is not None:
            out = self.runner.map(items, **self.kwargs)
        else:
            out = self.pipeline.map(items, **self.where, **self.kwargs)
        if self.sum:
            return sum(out)
        return [y for batch in out for y in batch] if self.flatten else out

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


class Spdl:
    """SPDL (``spdl.pipeline.PipelineBuilder``), as its docs advise for Python code that
    holds the GIL: the stage on a ``ProcessPoolExecutor(workers)`` (``pipe(fn,
    executor=..., concurrency=2 * workers, output_order="input")``: two tasks per worker in
    flight, so a worker never waits for its next item), ``build(num_threads=1)`` (the
    event loop's own thread pool has nothing to run). W5 (``stages=1``): items aggregated
    into batches of 64 before they cross to the decode processes (SPDL's advice on the cost
    of crossing a process boundary), then the model per batch on the pipeline's thread in
    the caller: 2 + 1 processes, as easycore's ``decode.on(2) >> model.on(1)``."""

    def __init__(
        self, fn: Callable[[int], Any], total: bool, workers: int, opts: dict[str, str], keep: bool
    ) -> None:
        from concurrent.futures import ProcessPoolExecutor

        del total, keep
        self.fn, self.workers, self.stages = fn, workers, "stages" in opts
        self.ex = ProcessPoolExecutor(workers)

    def run(self, items: Sequence[int]) -> Any:
        from spdl.pipeline import PipelineBuilder

        b = PipelineBuilder().add_source(items)
        kw: dict[str, Any] = {"executor": self.ex, "output_order": "input"}
        if self.stages:
            b = b.aggregate(wl.W5_BATCH, drop_last=False)
            b = b.pipe(_w5_decode_batch, concurrency=2 * self.workers, **kw)
            b = b.pipe(wl.w5_predict_batch, output_order="input")
        else:
            b = b.pipe(self.fn, concurrency=2 * self.workers, **kw)
        pipeline = b.add_sink(2 * self.workers).build(num_threads=1)
        with pipeline.auto_stop():
            out = list(pipeline.get_iterator())
        return [y for batch in out for y in batch] if self.stages else out

    def close(self) -> None:
        self.ex.shutdown()


class TorchData:
    """``torchdata.nodes`` as its docs build a loader: ``IterableWrapper(items)`` ->
    ``ParallelMapper(fn, num_workers=workers, method="process", in_order=True)`` (processes:
    the work holds the GIL; its default of 2 x workers items in flight) -> ``Loader``. W5
    (``stages=1``): ``Batcher(64)`` before the decode workers, then ``Mapper`` running the
    model per batch in the caller (2 + 1 processes)."""

    def __init__(
        self, fn: Callable[[int], Any], total: bool, workers: int, opts: dict[str, str], keep: bool
    ) -> None:
        del total, keep
        self.fn, self.workers, self.stages = fn, workers, "stages" in opts

    def run(self, items: Sequence[int]) -> Any:
        from torchdata import nodes

        node: Any = nodes.IterableWrapper(items)
        fn = self.fn
        if self.stages:
            node, fn = nodes.Batcher(node, wl.W5_BATCH, drop_last=False), _w5_decode_batch
        node = nodes.ParallelMapper(node, fn, self.workers, in_order=True, method="process")
        if self.stages:
            node = nodes.Mapper(node, wl.w5_predict_batch)
        out = list(nodes.Loader(node))
        return [y for batch in out for y in batch] if self.stages else out

    def close(self) -> None:
        pass


def _w5_decode_batch(xs: Sequence[int]) -> list[Any]:
    """W5's decode over a batch (SPDL and torchdata batch before crossing to a process)."""
    return [wl.w5_decode(x) for x in xs]


def _w5_model_batch(vs: Sequence[Any], *, state: Any) -> list[float]:
    """W5's model stage in its own pool: one call per batch, the model is the worker's state."""
    return wl.w5_predict_batch(vs, state)


def _add(total: int, x: int) -> int:
    """The W1 consumer: a running sum."""
    return total + x


SESSIONS: dict[str, Callable[..., Session]] = {
    "sequential": Sequential,
    "pool": MpPool,
    "futures": Futures,
    "joblib": Joblib,
    "mpire": Mpire,
    "easycore": Easycore,
    "spdl": Spdl,
    "torchdata": TorchData,
}


# ---------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------
def measure(
    lib: str, workload: str, variant: str, n: int, workers: int, mode: str
) -> dict[str, Any]:
    """Run one timed measurement and check the result; return ``{"seconds": ..., ...}``.

    Raises:
        bench_workloads.WrongResult: the library returned a wrong result.
    """
    opts = parse_variant(variant)
    if workload == "W6":  # a training loop fed by the library: its own harness
        import bench_training

        return bench_training.measure(lib, opts, workers)
    if workload == "W7" and "write" in opts:  # results written to Parquet: its own harness
        import bench_write

        return bench_write.measure(lib, opts, n, workers)
    if workload == "W7":  # resuming an epoch at 90%: easycore alone (no peer resumes)
        import bench_training

        return bench_training.measure_resume(opts, workers)
    if workload == "W8":  # requests to a local server, then a CPU step: its own harness
        import bench_waiting

        return bench_waiting.measure(lib, opts, n, workers)
    if workload == "W9":  # pools that size themselves: its own harness
        import bench_sizing

        return bench_sizing.measure(lib, opts, n, workers)
    if workload == "W10":  # an image pipeline: its own harness
        import bench_images

        return bench_images.measure(lib, opts, n, workers)
    if lib in ("raydata", "raytasks") or opts.get("engine") == "ray":  # on a local Ray
        import bench_ray

        return bench_ray.measure(lib, workload, opts, n, workers)
    workers = int(opts.pop("procs", workers))
    caller = ("torch",) if opts.pop("caller", "") == "torch" else ()  # W4: a torch program
    if "stream" in opts:  # sessions fold with this workload's fold
        opts["stream"] = workload
    for module in LIB_MODULES[lib] + WORKLOAD_MODULES.get(workload, ()) + caller:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:  # an easycore from before its executor was a package
            if not module.startswith("easycore."):
                raise
    if lib == "reference":
        return _reference(workload, opts, n)
    fn = work_function(workload, lib)
    total = workload == "W1"
    items = wl.items_for(workload, n)
    make = SESSIONS[lib]

    def cycle(data: Sequence[int], keep: bool = False) -> Any:
        session = make(fn, total, workers, opts, keep)
        try:
            return session.run(data)
        finally:
            session.close()

    extra: dict[str, Any] = {}
    if workload == "W4":
        phase = opts.get("phase", "cold")
        if phase == "warm":
            cycle(items)
        _settle()
        t0 = time.perf_counter()
        result = cycle(items)
        seconds = time.perf_counter() - t0
    else:
        warmup = wl.items_for(workload, min(n, max(2 * workers, n // 100)))
        if mode == "call":
            cycle(warmup)
            _settle()
            t0 = time.perf_counter()
            result = cycle(items)
            seconds = time.perf_counter() - t0
        elif mode == "warm":
            session = make(fn, total, workers, opts, True)
            try:
                session.run(warmup)
                _settle()
                t0 = time.perf_counter()
                result = session.run(items)
                seconds = time.perf_counter() - t0
                runner = getattr(session, "runner", None)
                if runner is not None:
                    extra["startup_seconds"] = runner.startup_seconds
            finally:
                session.close()
        else:
            msg = f"unknown mode {mode!r}"
            raise ValueError(msg)
    check = wl.check_folded if "stream" in opts else wl.CHECKS[workload]
    check(result, n)
    return {"seconds": seconds, "n": n, "extra": extra}


def _settle() -> None:
    """Collect garbage before a clock starts, for every library alike.

    After ``import torch`` a process holds ~165,000 objects, and CPython owes it a full
    collection (~0.1 s on this machine) that falls on whichever container allocation comes
    next: without this, a sample pays it or not by chance. Collections caused by the timed
    work itself still count.
    """
    gc.collect()


def _reference(workload: str, opts: dict[str, str], n: int) -> dict[str, Any]:
    """Physical references: ``import torch`` (W4) or copying the arrays in-process (W3, W3b)."""
    what = opts.get("what", "")
    if workload == "W4" and what == "import-torch":
        t0 = time.perf_counter()
        import torch

        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "n": n, "extra": {"torch": torch.__version__}}
    if workload in ("W3", "W3b") and what == "copy":
        return _copy_reference(workload, n)
    msg = f"no reference {what!r} for {workload}"
    raise ValueError(msg)


def _copy_reference(workload: str, n: int) -> dict[str, Any]:
    """Copy ``n`` arrays in this process (``clone()`` / ``np.copy``), the physical reference.

    One untimed pass first, so the timed ones measure copying rather than the first touch of
    fresh memory. torch is timed with its default thread count and with one thread, and the
    faster counts: on a loaded machine torch's threads can make a 4 MiB copy several times
    slower, which would flatter everything measured against this reference.
    """
    make = wl.make_tensor if workload == "W3" else wl.make_array
    arrays = [make(i) for i in range(n)]
    copy = _copier(workload)
    warm = [copy(a) for a in arrays]
    del warm
    timings: dict[str, float] = {}
    for threads in _thread_settings(workload):
        if threads:
            import torch

            torch.set_num_threads(threads)
        _settle()
        t0 = time.perf_counter()
        copies = [copy(a) for a in arrays]
        timings[f"torch threads={threads}" if threads else "numpy"] = time.perf_counter() - t0
        wl.CHECKS[workload](copies, n)
        del copies
    return {"seconds": min(timings.values()), "n": n, "extra": timings}


def _thread_settings(workload: str) -> list[int]:
    """torch thread counts to try for the copy reference (``[0]``: numpy, no setting)."""
    if workload != "W3":
        return [0]
    import torch

    return sorted({torch.get_num_threads(), 1}, reverse=True)


def _copier(workload: str) -> Callable[[Any], Any]:
    if workload == "W3":
        return lambda t: t.clone()
    import numpy as np

    return np.copy
