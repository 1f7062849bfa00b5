"""W7: 200,000 results of 256 float32 each written to Parquet from 2 workers.

Run: python benchmarks/bench_write.py [N] [--ray]

Rows (seconds, items/s), each in a fresh temporary directory:

* easycore compute only: ``producer(embed) >> consumer`` that drops each result (the same
  work, the results crossing to the caller instead of being written);
* easycore write: ``producer(embed) >> write.parquet(out)`` (the workers write);
* easycore write + resume: the same with ``resume=`` a fresh ledger;
* with ``--ray``: Ray Data ``range(N).map_batches(embed_batch).write_parquet(out)`` on a
  local Ray with 2 CPUs (started before the clock).

Not a timed test: figures for the notes. HF ``datasets`` is left out where it is not
installed.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import numpy as np

from easycore import consumer, producer, write

DIM = 256


@producer
def embed(i):
    rng = np.random.default_rng(i)
    return {"id": i, "emb": rng.random(DIM, dtype=np.float32)}


@producer
def embed_batch(ids):
    return {"id": np.asarray(ids), "emb": np.stack([embed.fn(i)["emb"] for i in ids])}


@consumer(init=0)
def drop(n, row):
    return n + 1


def timed(label: str, n: int, fn) -> float:
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    print(f"{label:<42} {dt:7.2f} s {n / dt:10,.0f} items/s", flush=True)
    return dt


def main() -> None:
    n = int(next((a for a in sys.argv[1:] if a.isdigit()), 200_000))
    work = tempfile.mkdtemp(prefix="w7-")
    try:
        timed(
            "easycore compute only (results to caller)",
            n,
            lambda: (embed >> drop).map(range(n), devices=2),
        )
        timed(
            "easycore write.parquet",
            n,
            lambda: (embed >> write.parquet(os.path.join(work, "a"))).map(range(n), devices=2),
        )
        timed(
            "easycore write.parquet + resume=",
            n,
            lambda: (embed >> write.parquet(os.path.join(work, "b"))).map(
                range(n), devices=2, resume=os.path.join(work, "run.db")
            ),
        )
        timed(
            "easycore write.parquet, batches of 1000",
            n,
            lambda: (embed_batch >> write.parquet(os.path.join(work, "c"))).map(
                range(n), devices=2, batch_size=1000
            ),
        )
        if "--ray" in sys.argv:
            import ray

            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

            def ray_batch(batch):
                ids = batch["id"]
                return {"id": ids, "emb": np.stack([embed.fn(int(i))["emb"] for i in ids])}

            def ray_job():
                ds = ray.data.range(n).map_batches(ray_batch, batch_size=1000)
                ds.write_parquet(os.path.join(work, "ray"))

            timed("Ray Data map_batches + write_parquet", n, ray_job)
            ray.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
