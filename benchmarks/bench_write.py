"""W7 write: results of 256 float32 each written to Parquet from ``workers`` processes.

Each item ``i`` becomes ``{"id": i, "emb": embed(i)}`` with ``embed(i)`` 256 float32 drawn
from ``numpy.random.default_rng(i)`` (~8 us of work: the results, 1 KiB each, are what
costs). Every library runs the same per-item function (the batch functions of the peers
call it per item); every sample writes into a fresh temporary directory, and its files are
read back with ``pyarrow`` after the clock stops (every id once, some embeddings compared).

Rows (``run.py --only "W7 write"``):

* ``easycore write=parquet``: ``(embed >> write.parquet(out)).map(range(n), devices=2)``:
  the workers write the files, the caller commits them;
* ``easycore write=none``: the same work without writing, ``embed >> consumer``: the
  results cross to the caller, which folds and drops them (the compute-only time the
  write row is held against: writing should add at most 15%);
* ``raydata``: ``ray.data.range(n).map_batches(fn).write_parquet(out)`` on a local Ray with
  ``workers`` CPUs started before the clock (``bench_ray.py``'s setup), at its default batch
  size and at batches of 1,000;
* ``datasets``: HF ``Dataset.from_dict({"id": ...}).map(fn, batched=True,
  num_proc=workers).to_parquet(out)`` (its cache in the sample's temporary directory).

Every row is timed as the one-shot call a user writes, after one untimed call on a few
items in the same process (imports done, easycore's forkserver up, Ray's workers started).
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from typing import Any

import bench_workloads as wl
import numpy as np

DIM = 256


def embed(i: int) -> dict[str, Any]:
    """Item ``i``'s row: its id and 256 float32 seeded by it."""
    return {"id": i, "emb": np.random.default_rng(i).random(DIM, dtype=np.float32)}


def embed_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """The peers' batch function: ``embed`` per item, stacked."""
    ids = [int(i) for i in batch["id"]]
    return {"id": np.asarray(ids, dtype=np.int64), "emb": np.stack([embed(i)["emb"] for i in ids])}


def _fold(state: tuple[int, int], row: dict[str, Any]) -> tuple[int, int]:
    """Compute only: count the rows and sum their ids (checked), drop the rest."""
    return state[0] + 1, state[1] + row["id"]


# -- the rows -----------------------------------------------------------------------------------
def _easycore(n: int, out: str, workers: int, opts: dict[str, str]) -> Any:
    from easycore import consumer, producer, write

    work = producer(embed)
    if opts.get("write") == "none":
        return (work >> consumer(init=(0, 0))(_fold)).map(range(n), devices=workers)
    kw: dict[str, Any] = {}
    if "resume" in opts:
        kw["resume"] = os.path.join(os.path.dirname(out), f"run-{os.path.basename(out)}.db")
    return (work >> write.parquet(out)).map(range(n), devices=workers, **kw)


def _raydata(n: int, out: str, workers: int, opts: dict[str, str]) -> Any:
    import ray

    size = {"batch_size": int(opts["batch_size"])} if "batch_size" in opts else {}
    ray.data.range(n).map_batches(embed_batch, **size).write_parquet(out)


def _datasets(n: int, out: str, workers: int, opts: dict[str, str]) -> Any:
    import datasets

    ds = datasets.Dataset.from_dict({"id": np.arange(n, dtype=np.int64)})
    ds = ds.map(embed_batch, batched=True, num_proc=workers)
    os.makedirs(out, exist_ok=True)
    ds.to_parquet(os.path.join(out, "part-0.parquet"))


RUNS = {"easycore": _easycore, "raydata": _raydata, "datasets": _datasets}


def _check(lib: str, n: int, out: str, result: Any, opts: dict[str, str]) -> None:
    """The files hold every id once, each with its embedding (compute only: the fold)."""
    if opts.get("write") == "none":
        if result != (n, n * (n - 1) // 2):
            raise wl.WrongResult(f"W7 write: {lib} compute-only folded {result!r}")
        return
    import pyarrow.parquet as pq

    table = pq.read_table(out)
    ids = table.column("id").to_numpy()
    if len(ids) != n or not np.array_equal(np.sort(ids), np.arange(n)):
        raise wl.WrongResult(f"W7 write: {lib} wrote {len(ids)} rows, not ids 0..{n - 1} once")
    where = {int(i): j for j, i in enumerate(ids)}
    emb = table.column("emb")
    for i in sorted({0, 1, n // 3, n // 2, n - 1}):
        got = np.asarray(emb[where[i]].as_py(), dtype=np.float32)
        if not np.array_equal(got, embed(i)["emb"]):
            raise wl.WrongResult(f"W7 write: {lib} wrote a wrong embedding for id {i}")


def measure(lib: str, opts: dict[str, str], n: int, workers: int) -> dict[str, Any]:
    """Time one run of W7 write on ``lib``; ``{"seconds", "n", "extra"}`` (checked).

    Raises:
        bench_workloads.WrongResult: the files (or the fold) are wrong.
    """
    work = tempfile.mkdtemp(prefix="w7-write-")
    ray_up = False
    try:
        if lib == "raydata":
            import ray

            quiet = {"logging_level": "ERROR", "log_to_driver": False}
            ray.init(num_cpus=workers, include_dashboard=False, **quiet)
            ray_up = True
            ctx = ray.data.DataContext.get_current()
            ctx.enable_progress_bars = False
        if lib == "datasets":
            os.environ["HF_DATASETS_CACHE"] = os.path.join(work, "hf-cache")
            import datasets

            datasets.disable_progress_bars()
            datasets.disable_caching()
        run = RUNS[lib]
        run(max(4 * workers, n // 20), os.path.join(work, "warm"), workers, opts)  # warm-up
        out = os.path.join(work, "out")
        gc.collect()
        t0 = time.perf_counter()
        result = run(n, out, workers, opts)
        seconds = time.perf_counter() - t0
        files = [f for f in os.listdir(out) if f.endswith(".parquet")] if os.path.isdir(out) else []
        _check(lib, n, out, result, opts)
        return {"seconds": seconds, "n": n, "extra": {"files": len(files)}}
    finally:
        if ray_up:
            import ray

            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
