"""W6: feeding a training loop, easycore's ``imap`` against torch's ``DataLoader``.

A loop in the caller takes one batch per step and spends a fixed time on it (a sleep that
stands for a GPU step, so the CPU is free); two workers make each batch (pure-Python
"decoding", then a 64x3x32x32 float tensor). Both feeders stay up across epochs
(``pipeline.open()``, ``DataLoader(persistent_workers=True)``); epoch 1 warms up, epoch 2 is
timed. Three cases:

``fast``   the workers make batches faster than the loop takes them
``slow``   the workers are slower than the loop (the loop waits whatever the feeder)
``pause``  the workers are a little slower than the loop, but the loop pauses 1 s every 50
           steps (a checkpoint, an evaluation): a feeder that keeps working through the
           pause has a stock of batches after it, and the steps after a pause wait for none

``ideal`` is the epoch no feeder can beat: the loop's, fed by workers that start making
batches when the epoch starts and never stop (an unbounded prefetch), each batch taking
what making the epoch's batches took on average, as measured in the workers (on a machine
whose cores the workers fill, a batch takes longer than its nominal time, for every feeder
alike). It is at least the loop's own time (steps and pauses) and at least the workers'
time divided by their number; when the workers are slower than the loop, the steps before
the first pause wait for them whatever the feeder. Reported
per sample: the epoch time, the time the loop waited in ``next()`` (all steps) and the wait
of the 10 steps after each pause.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import bench_workloads as wl

#: case -> (batches per epoch, seconds to make a batch (one worker), seconds per step,
#: pauses after these steps)
CASES: dict[str, tuple[int, float, float, tuple[int, ...]]] = {
    "fast": (100, 0.010, 0.015, ()),
    "slow": (100, 0.040, 0.010, ()),
    "pause": (150, 0.030, 0.012, (50, 100)),
}
PAUSE_SECONDS = 1.0
AFTER_PAUSE = 10  # steps after a pause whose wait is reported on its own
SHAPE = (64, 3, 32, 32)
_SPINS_PER_SECOND = wl.w2_iters() / wl.W2_SECONDS  # pure-Python work, calibrated as W2's


def make_batch(i: int, make: float) -> Any:
    """A batch: ``make`` seconds of pure-Python work, then a float tensor filled with ``i``;
    its last element is the time making it took here."""
    import torch

    t0 = time.perf_counter()
    wl.spin(i, int(make * _SPINS_PER_SECOND))
    batch = torch.full(SHAPE, float(i), dtype=torch.float32)
    batch.view(-1)[-1] = time.perf_counter() - t0
    return batch


def ideal(case: str, workers: int, made: float | None = None) -> float:
    """The best epoch a feeder can give the loop (``made``: seconds the workers spent making
    the epoch's batches; the nominal make time when not measured)."""
    n, make, step, pauses = CASES[case]
    per_batch = make if made is None else made / n
    clock = 0.0
    for k in range(n):
        ready = (k // workers + 1) * per_batch  # the workers make batches side by side
        clock = max(clock, ready) + step + (PAUSE_SECONDS if k + 1 in pauses else 0.0)
    return clock


def _train(batches: Iterable[Any], case: str) -> dict[str, float]:
    """The loop: per step, take a batch (the wait), check it, spend the step."""
    n, _, step, pauses = CASES[case]
    waits: list[float] = []
    made = 0.0
    it: Iterator[Any] = iter(batches)
    t0 = time.perf_counter()
    for k in range(n):
        w0 = time.perf_counter()
        batch = next(it)
        waits.append(time.perf_counter() - w0)
        if tuple(batch.shape) != SHAPE or float(batch[0, 0, 0, 0]) != float(k):
            got = f"{float(batch.flatten()[0])}, shape {tuple(batch.shape)}"
            raise wl.WrongResult(f"step {k} got batch {got}")
        made += float(batch.view(-1)[-1])
        del batch
        time.sleep(step)
        if k + 1 in pauses:
            time.sleep(PAUSE_SECONDS)
    seconds = time.perf_counter() - t0
    after = [w for p in pauses for w in waits[p : p + AFTER_PAUSE]]
    return {"seconds": seconds, "wait": sum(waits), "after_pause": sum(after), "made": made}


def measure(lib: str, opts: dict[str, str], workers: int) -> dict[str, Any]:
    """One sample: epoch 1 untimed, epoch 2 timed. ``opts``: ``case``, ``prefetch``."""
    import torch

    case = opts["case"]
    n, make, _, _ = CASES[case]
    prefetch = int(opts["prefetch"]) if "prefetch" in opts else None
    if lib == "easycore":
        from easycore import producer

        runner = producer(_Maker(make)).open(devices=workers, prefetch=prefetch)
        try:
            _train(runner.imap(range(n)), case)
            out = _train(runner.imap(range(n)), case)
        finally:
            runner.close()
    elif lib == "dataloader":
        loader = torch.utils.data.DataLoader(
            _Batches(n, make),
            batch_size=None,
            num_workers=workers,
            persistent_workers=True,
            prefetch_factor=prefetch or 2,
        )
        _train(loader, case)
        out = _train(loader, case)
        del loader
    elif lib == "spdl":  # one process pool for both epochs, a pipeline per epoch
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers) as ex:
            _train(_spdl_epoch(ex, n, make, workers, prefetch), case)
            out = _train(_spdl_epoch(ex, n, make, workers, prefetch), case)
    elif lib == "torchdata":  # one Loader, iterated once per epoch
        from torchdata import nodes

        node = nodes.ParallelMapper(
            nodes.IterableWrapper(range(n)), _Maker(make), workers, method="process"
        )
        loader = nodes.Loader(nodes.Prefetcher(node, (prefetch or 2) * workers))
        _train(loader, case)
        out = _train(loader, case)
        del loader
    else:  # pragma: no cover - the harness names only these
        raise ValueError(lib)
    seconds = out.pop("seconds")
    return {"seconds": seconds, "extra": {**out, "ideal": ideal(case, workers, out["made"])}}


def _spdl_epoch(ex: Any, n: int, make: float, workers: int, prefetch: int | None) -> Any:
    """An epoch from SPDL: batches made on the process pool ``ex``, two per worker in
    flight, in order; the sink holds SPDL's default 3 batches (or ``prefetch`` x workers)."""
    from spdl.pipeline import PipelineBuilder

    pipeline = (
        PipelineBuilder()
        .add_source(range(n))
        .pipe(_Maker(make), executor=ex, concurrency=2 * workers, output_order="input")
        .add_sink(prefetch * workers if prefetch else 3)
        .build(num_threads=1)
    )
    with pipeline.auto_stop():
        yield from pipeline.get_iterator()


class _Maker:
    """easycore's work function for a case (carries the make time to the workers)."""

    __name__ = "make_batch"

    def __init__(self, make: float) -> None:
        self.make = make

    def __call__(self, i: int) -> Any:
        return make_batch(i, self.make)


class _Batches:
    """The DataLoader's map-style dataset: batch ``i`` is ``make_batch(i)``."""

    def __init__(self, n: int, make: float) -> None:
        self.n = n
        self.make = make

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return make_batch(i, self.make)


# ---------------------------------------------------------------------------------------------
# W7: resuming a training epoch at 90% (API.md section 12)
# ---------------------------------------------------------------------------------------------
#: items per epoch, where the run resumes, items per batch, seconds of work per item
RESUME_ITEMS, RESUME_AT, RESUME_BATCH, RESUME_ITEM_SECONDS = 100_000, 90_000, 64, 0.00005


def resume_batch(batch: list[int]) -> tuple[int, int, float]:
    """W7's work on a batch of indices: ~50 us of pure Python per item, then a seeded draw."""
    import random

    iters = int(RESUME_ITEM_SECONDS * _SPINS_PER_SECOND)
    for i in batch:
        wl.spin(i, iters)
    return batch[0], len(batch), random.random()


def measure_resume(opts: dict[str, str], workers: int) -> dict[str, Any]:
    """One sample of W7: the time to the first batch after position ``RESUME_AT``.

    ``how=resume``: ``imap(..., state=)`` from a state taken at 90% (untimed: a run to 90%
    and its ``state_dict()``); ``how=skip``: a fresh ``imap`` whose first 90% of batches
    are taken and dropped (computed); ``how=scratch``: the first batch of a fresh epoch (for
    scale). Each on an open runner (workers up before the clock starts); the batch must be
    the one at 90% (its first index, and the seeded draw of the uninterrupted run).
    """
    from easycore import derive_seed, producer, seed_everything

    how = opts["how"]
    data = list(range(RESUME_ITEMS))  # an epoch's index list (a sequence: resumes by index)
    skip = RESUME_AT // RESUME_BATCH
    kw: dict[str, Any] = {"batch_size": RESUME_BATCH, "seed": 0, "epoch": 1}
    with producer(resume_batch).open(devices=workers) as runner:
        state = None
        if how == "resume":
            it = runner.imap(data, **kw)
            for _ in range(skip):
                next(it)
            state = it.state_dict()
            it.close()
        t0 = time.perf_counter()
        it = runner.imap(data, state=state, **kw)
        if how == "skip":
            for _ in range(skip):
                next(it)
        first = next(it)
        seconds = time.perf_counter() - t0
        it.close()
    want = 0 if how == "scratch" else skip
    import random

    seed_everything(derive_seed(0, want, epoch=1))
    if first[0] != want * RESUME_BATCH or first[2] != random.random():
        raise wl.WrongResult(f"W7 {how}: first batch {first} is not batch {want}")
    return {"seconds": seconds, "extra": {}}
