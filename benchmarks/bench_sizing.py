"""W9: pools that size themselves, against fixed splits and Ray Data's autoscaling.

Stages sleep (no CPU), so a budget of 8-16 "CPUs" can be tested on 2 cores; one case is
CPU-bound with a budget of 2. The cases (``case=``):

* ``two``: two stages at 0.17 s and 0.21 s an item (the shape of ray-project/ray#65540),
  budget 16, 160 items;
* ``skew``: three stages at 20, 100 and 40 ms, budget 16, 240 items;
* ``phase``: two stages at 20 ms, the second 3x slower from the middle of the input on,
  budget 12, 1,440 items;
* ``init``: two stages at 30 and 90 ms, the second with a 2 s ``init``, budget 8, 480 items
  (a run long enough to have a steady state after the workers added start);
* ``cpu``: two CPU-bound stages of 4 and 8 ms, budget 2, 400 items.

Rows (``how=``): easycore self-sizing (``.on((1, B))`` each, ``cpus=B``); the oracle, the
best fixed split (every split of the budget is tried on the stages' known costs, for the
phase change over the whole run, and the best one is run); an even split; ``devices=B``
fused; Ray Data with ``ActorPoolStrategy(min_size=1, max_size=B)`` per stage on a local Ray
with B CPUs; Ray Data with the oracle's split. Each checks its results (``x`` through every
stage gives ``x``, in order). The easycore rows report their steady throughput (items a
second over the middle half of the results) too; the self-sizing row also its controller's
time (sampling the pools and deciding their sizes) and the caller's whole CPU (the transport
too), each over the run's time. The open runner's start is timed too (as a one-shot run).
"""

from __future__ import annotations

import itertools
import math
import os
import resource
import time
from collections.abc import Sequence
from typing import Any

CASES: dict[str, dict[str, Any]] = {
    "two": {"costs": (0.17, 0.21), "budget": 16, "n": 160},
    "skew": {"costs": (0.02, 0.10, 0.04), "budget": 16, "n": 240},
    "phase": {"costs": (0.02, 0.02), "budget": 12, "n": 1440, "slower": (1, 3.0)},
    "init": {"costs": (0.03, 0.09), "budget": 8, "n": 480, "init": (1, 2.0)},
    "cpu": {"costs": (0.004, 0.008), "budget": 2, "n": 400, "cpu": True},
}


def _cost(case: dict[str, Any], k: int, x: int) -> float:
    cost = case["costs"][k]
    slower = case.get("slower")
    if slower and slower[0] == k and x >= case["n"] // 2:
        cost *= slower[1]
    return float(cost)


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def stage_fn(case_name: str, k: int) -> Any:
    """Stage ``k`` of a case: ``x -> x`` after its cost (a sleep, or CPU work)."""
    case = CASES[case_name]

    def work(x: int) -> int:
        (_spin if case.get("cpu") else time.sleep)(_cost(case, k, x))
        return x

    work.__name__ = f"stage{k}"
    return work


def stage_init(case_name: str, k: int) -> Any:
    case = CASES[case_name]
    wait = case["init"][1] if case.get("init") and case["init"][0] == k else 0.0

    def init() -> None:
        time.sleep(wait)

    return init


def oracle(case_name: str) -> tuple[int, ...]:
    """The fixed split of the budget that runs the case fastest, from the stages' costs (all
    splits tried; a phase change: the split whose whole run is shortest)."""
    case = CASES[case_name]
    k, budget, n = len(case["costs"]), case["budget"], case["n"]
    best, best_t = None, math.inf
    for split in itertools.product(range(1, budget + 1), repeat=k):
        if sum(split) != budget:
            continue
        t = sum(max(_cost(case, h, x) / split[h] for h in range(k)) for x in range(n))
        if t < best_t:
            best, best_t = split, t
    assert best is not None
    return best


def even(case_name: str) -> tuple[int, ...]:
    case = CASES[case_name]
    k, budget = len(case["costs"]), case["budget"]
    return tuple(budget // k + (1 if h < budget % k else 0) for h in range(k))


def _easycore(case_name: str, how: str) -> tuple[list[int], tuple[float, float, float]]:
    from easycore import producer

    case = CASES[case_name]
    k, budget, n = len(case["costs"]), case["budget"], case["n"]
    stages = [producer(init=stage_init(case_name, h))(stage_fn(case_name, h)) for h in range(k)]
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    if how == "fused":
        pipeline = stages[0]
        for s in stages[1:]:
            pipeline = pipeline >> s
        return list(pipeline.map(range(n), devices=budget)), (0.0, 0.0, 0.0)
    if how == "auto":
        sizes: Sequence[Any] = [(1, budget)] * k
    else:
        sizes = oracle(case_name) if how == "oracle" else even(case_name)
    pipeline = stages[0].on(sizes[0])
    for s, size in zip(stages[1:], sizes[1:], strict=True):
        pipeline = pipeline >> s.on(size)
    t0 = time.perf_counter()
    out, stamps = [], []
    with pipeline.open(cpus=budget) as runner:
        for y in runner.imap(range(n)):
            out.append(y)
            stamps.append(time.perf_counter())
        control = runner._engine.books.record.control_s  # (sampling and sizing the pools)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    caller = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    # steady throughput: the middle half of the results (the start and the tail left out)
    steady = (n // 2) / (stamps[3 * n // 4] - stamps[n // 4])
    return out, (control / wall, caller / wall, steady)


def _raydata(case_name: str, how: str) -> list[int]:
    import ray
    from ray.data import ActorPoolStrategy

    case = CASES[case_name]
    k, budget, n = len(case["costs"]), case["budget"], case["n"]
    split = oracle(case_name) if how == "oracle" else None
    ds = ray.data.from_items(list(range(n)))  # (blocks made here: no read task needs a CPU)
    for h in range(k):
        fn, init = stage_fn(case_name, h), stage_init(case_name, h)

        class Stage:
            def __init__(self, fn: Any = fn, init: Any = init) -> None:
                init()
                self.fn = fn

            def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
                batch["item"] = [self.fn(int(x)) for x in batch["item"]]
                return batch

        size = split[h] if split else None
        strategy = (
            ActorPoolStrategy(size=size) if size else ActorPoolStrategy(min_size=1, max_size=budget)
        )
        ds = ds.map_batches(Stage, batch_size=1, compute=strategy, num_cpus=1)
    return [int(r["item"]) for r in ds.iter_rows()]


def measure(lib: str, opts: dict[str, str], n: int, workers: int) -> dict[str, Any]:
    """Time one run of case ``opts["case"]`` with ``opts["how"]`` on ``lib``."""
    del n, workers
    name, how = opts["case"], opts.get("how", "auto")
    case = CASES[name]
    extra: dict[str, Any] = {}
    if lib == "raydata":
        import ray

        ray.init(
            num_cpus=case["budget"],
            include_dashboard=False,
            logging_level="ERROR",
            log_to_driver=False,
        )
        ray.data.DataContext.get_current().execution_options.preserve_order = True
        try:
            t0 = time.perf_counter()
            out = _raydata(name, how)
            seconds = time.perf_counter() - t0
        finally:
            ray.shutdown()
    else:
        t0 = time.perf_counter()
        out, (control, caller, steady) = _easycore(name, how)
        seconds = time.perf_counter() - t0
        extra["steady_items_per_s"] = round(steady, 2)
        if how == "auto":
            extra["control_share"] = round(control, 5)
            extra["caller_cpu_share"] = round(caller, 4)
    if out != list(range(case["n"])):
        import bench_workloads as wl

        raise wl.WrongResult(f"W9 {name}: results differ from the input")
    extra["split"] = {"oracle": oracle(name), "even": even(name)}.get(how)
    extra["pid"] = os.getpid()
    return {"seconds": seconds, "n": case["n"], "extra": extra}
