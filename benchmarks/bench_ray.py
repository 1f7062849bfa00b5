"""W2 and W5 on a local Ray with ``--workers`` CPUs: easycore's Ray engine against Ray Data.

Each measurement runs in a fresh process that starts its own local Ray
(``ray.init(num_cpus=workers)``, not timed), runs the work once to warm up, then times a
second run. Both libraries start their actors inside the timed run (an easycore ``.map`` and
a Ray Data dataset each make their own actor pool), and both give results in input order.
W2 is also run as plain Ray tasks (``ray.get([f.remote(i) for i in items])``): what Ray
itself costs, which easycore's one-shot run of an init-less pool (on tasks) should match.

* easycore: ``producer(fn).map(items, devices=workers, engine="ray")``; W5 as two pools,
  ``decode.on(workers - 1) >> model.on(1, batch_size=64)`` (the local engine's W5 layout).
* Ray Data: ``ray.data.range(n).map_batches(Class, concurrency=workers, batch_size=b)`` with
  ``preserve_order``; W5 as two actor pools of the same sizes (decode, then the model with
  batches of 64). ``b`` is a careful user's pick: batches of about 50 ms (W2: 10 items, W5:
  64), and Ray Data's default for comparison.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import bench_workloads as wl


def measure(lib: str, workload: str, opts: dict[str, str], n: int, workers: int) -> dict[str, Any]:
    """Time one run of ``workload`` on ``lib`` (``"easycore"``, ``"raydata"``,
    ``"raytasks"``) on Ray."""
    import ray

    ray.init(num_cpus=workers, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        run = {"easycore": _easycore, "raydata": _raydata, "raytasks": _raytasks}[lib]
        items = list(wl.items_for(workload, n))
        run(workload, items[: max(4 * workers, n // 20)], workers, opts)  # warm-up
        t0 = time.perf_counter()
        result = run(workload, items, workers, opts)
        seconds = time.perf_counter() - t0
    finally:
        ray.shutdown()
    wl.CHECKS[workload](result, n)
    return {"seconds": seconds, "n": n, "extra": {}}


def _easycore(workload: str, items: Sequence[int], workers: int, opts: dict[str, str]) -> Any:
    from easycore import producer

    if workload == "W2":
        return producer(wl.busy_5ms).map(items, devices=workers, engine="ray")
    model = producer(init=wl.w5_load)(_w5_model_batch)
    decode = producer(wl.w5_decode)
    pipeline = decode.on(max(1, workers - 1)) >> model.on(1, batch_size=wl.W5_BATCH)
    batches = pipeline.map(items, engine="ray")
    return [y for batch in batches for y in batch]


def _w5_model_batch(vs: Sequence[Any], *, state: Any) -> list[float]:
    return wl.w5_predict_batch(vs, state)


class _Busy:
    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        return {"y": np.array([wl.busy_5ms(int(x)) for x in batch["id"]], dtype=np.int64)}


class _Decode:
    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        return {"v": np.stack([wl.w5_decode(int(x)) for x in batch["id"]])}


class _Model:
    def __init__(self) -> None:
        self.model = wl.w5_load()

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        return {"y": np.array(wl.w5_predict_batch(list(batch["v"]), self.model))}


def _raytasks(workload: str, items: Sequence[int], workers: int, opts: dict[str, str]) -> Any:
    """W2 as plain Ray tasks, one per item, in input order: what Ray itself costs."""
    import ray

    busy = ray.remote(num_cpus=1)(wl.busy_5ms)
    return ray.get([busy.remote(i) for i in items])


def _raydata(workload: str, items: Sequence[int], workers: int, opts: dict[str, str]) -> Any:
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # results in input order, as easycore's
    ctx.enable_progress_bars = False
    size = {"batch_size": int(opts["batch_size"])} if "batch_size" in opts else {}
    ds = ray.data.from_items([{"id": i} for i in items])  # (no read tasks to place)
    if workload == "W2":
        ds = ds.map_batches(_Busy, concurrency=workers, num_cpus=1, **size)
    else:
        ds = ds.map_batches(_Decode, concurrency=max(1, workers - 1), num_cpus=1, **size)
        ds = ds.map_batches(_Model, batch_size=wl.W5_BATCH, concurrency=1, num_cpus=1)
    return [int(r["y"]) if workload == "W2" else float(r["y"]) for r in ds.take_all()]
