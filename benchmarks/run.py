"""easycore against sequential, multiprocessing.Pool, concurrent.futures, joblib and mpire.

Usage (``just bench`` runs it with the ``bench`` extra installed)::

    python benchmarks/run.py                      # everything, 5 repeats, 2 workers
    python benchmarks/run.py --quick              # 1 repeat, small sizes: a smoke test
    python benchmarks/run.py --only W1,W3 --repeats 3 --json bench.json
    python benchmarks/run.py --mode warm          # pools created before the clock starts

Every (library, workload, variant) measurement runs in a fresh Python process
(``run.py --one LIB WORKLOAD VARIANT``), repeated ``--repeats`` times with the cases of a
workload interleaved, so slow drift in background load spreads over all libraries alike. The
parent prints, per workload, the median and min-max of each case and its ratio to the best
peer, then a table of the targets with PASS/MISS. Every run checks its result (the sum, or
every array's contents), so a broken fast path cannot look good.

Workloads (see ``bench_workloads.py``): W1 200,000 ints ``x*x`` summed; W2 400 items of 5 ms
pure Python; W3 200 float32 tensors of 4 MiB returned by the workers; W3b the same as numpy
arrays; W4 create 2 workers, run 1 item, shut down, cold (first time in a fresh process) and
warm (second time); W5 two unbalanced stages (Python decode, then a model) fused on 3
processes against a pool per stage on the same 3 processes; W10 a real JPEG pipeline
(``bench_images.py``) against DataLoader, SPDL and one process. Peers run with their defaults
and with the tuning a careful user would apply (chunk sizes, one torch thread per worker);
easycore runs untuned. ``bench_libs.py``
says exactly what each library runs and what is timed.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import bench_workloads as wl

HERE = Path(__file__).resolve().parent
RESULT_TAG = "BENCH_RESULT "
EXIT_WRONG = 3  # a child's exit status when the library returned a wrong result


# ---------------------------------------------------------------------------------------------
# what is measured
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    """One table: a workload (W4 splits into cold and warm) and how its figure is computed."""

    name: str
    workload: str
    title: str
    unit: str
    higher_is_better: bool = True


@dataclass(frozen=True)
class Case:
    """One row: a library with a variant, measured ``repeats`` times in fresh processes.

    ``role`` is ``easycore``, ``peer`` (competes for "best peer"), ``baseline`` (the
    in-process loop), ``reference`` (a physical reference: in-process copy, import torch) or
    ``context`` (a peer under an easycore row's conditions, e.g. a caller that imported
    torch: shown beside that row, not a competitor).
    """

    group: str
    lib: str
    variant: str
    role: str
    label: str
    n: int | None = None  # items, when not the workload's size


@dataclass
class Row:
    """A case's results: seconds per repeat, the derived figures, failures."""

    case: Case
    n: int
    seconds: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wrong: bool = False
    extra: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """At least one good sample, and never a wrong result."""
        return bool(self.seconds) and not self.wrong

    @property
    def median(self) -> float:
        return statistics.median(self.values)


GROUPS: dict[str, Group] = {
    g.name: g
    for g in [
        Group("W1", "W1", "ints, x*x, summed", "items/s"),
        Group("W2", "W2", "items x 5 ms pure Python", "x seq"),
        Group("W3", "W3", "x 4 MiB float32 torch tensors returned", "GB/s"),
        Group("W3b", "W3b", "x 4 MiB float32 numpy arrays returned", "GB/s"),
        Group("W3 stream", "W3", "x 4 MiB torch tensors returned, folded and dropped", "GB/s"),
        Group("W3b stream", "W3b", "x 4 MiB numpy arrays returned, folded and dropped", "GB/s"),
        Group("W4 cold", "W4", "create 2 workers, 1 item, shut down: fresh process", "s", False),
        Group("W4 warm", "W4", "create 2 workers, 1 item, shut down: second time", "s", False),
        Group("W5", "W5", "items: 0.6 ms decode, then a 16 MiB model; 3 processes", "items/s"),
        Group("W2 ray", "W2", "items x 5 ms pure Python, on a local Ray", "x seq"),
        Group("W5 ray", "W5", "items: 0.6 ms decode, then a 16 MiB model, on Ray", "items/s"),
        Group("W6 fast", "W6", "100 steps of 15 ms, batches of 10 ms", "x ideal", False),
        Group("W6 slow", "W6", "100 steps of 10 ms, batches of 40 ms", "x ideal", False),
        Group(
            "W6 pause",
            "W6",
            "150 steps of 12 ms, 1 s pauses after 50 and 100, batches of 30 ms",
            "x ideal",
            False,
        ),
        Group(
            "W7",
            "W7",
            "items (batches of 64, 50 us each): first batch at 90% of the epoch",
            "s",
            False,
        ),
        Group("W7 write", "W7", "results of 256 float32 written to Parquet", "items/s"),
        Group("W8", "W8", "requests answered after 20 ms, then 1 ms of CPU each", "items/s"),
        Group(
            "W8 uneven",
            "W8",
            "requests answered after exponential waits (mean 20 ms), nothing else",
            "items/s",
        ),
        Group("W9 two", "W9", "items, 2 stages of 0.17/0.21 s (ray#65540), budget 16", "s", False),
        Group("W9 skew", "W9", "items, 3 stages of 20/100/40 ms, budget 16", "s", False),
        Group("W9 phase", "W9", "items, 2 stages of 20 ms, the 2nd 3x slower halfway", "s", False),
        Group("W9 init", "W9", "items, 2 stages of 30/90 ms, the 2nd with a 2 s init", "s", False),
        Group("W9 cpu", "W9", "items, 2 CPU-bound stages of 4/8 ms, budget 2", "s", False),
        Group("W10 1k", "W10", "JPEGs: decode, crop 224, flip, float; batches of 32", "items/s"),
        Group("W10 4k", "W10", "JPEGs: decode, crop 224, flip, float; batches of 32", "items/s"),
    ]
}


def size(workload: str, quick: bool) -> int:
    """Items per run of a workload."""
    return wl.SIZES[workload][1 if quick else 0]


def build_cases(quick: bool, workers: int, mode: str) -> list[Case]:
    """Every row of the benchmark, in table order."""
    ec = f"easycore .map(devices={workers})"
    if mode == "warm":
        ec = f"easycore .open(devices={workers}) runner.map"
    cases: list[Case] = []

    n = size("W1", quick)
    sweep = [n // 100, n // 20, n // 4]  # 2,000 / 10,000 / 50,000 items per chunk
    tuned = n // 20
    slow = n // 10  # concurrent.futures' chunksize=1 runs ~4,000 items/s: a tenth of W1
    cases += [
        Case("W1", "sequential", "default", "baseline", "in-process loop sum(map(square, ...))"),
        Case("W1", "pool", "default", "peer", "multiprocessing.Pool, default chunksize"),
        *[
            Case("W1", "pool", f"chunksize={c}", "peer", f"multiprocessing.Pool, chunksize={c}")
            for c in sweep
        ],
        Case(
            "W1",
            "futures",
            "default",
            "peer",
            f"concurrent.futures, default chunksize=1 ({slow:,} items)",
            n=slow,
        ),
        Case(
            "W1", "futures", f"chunksize={tuned}", "peer", f"concurrent.futures, chunksize={tuned}"
        ),
        Case("W1", "joblib", "default", "peer", "joblib.Parallel (loky), batch_size=auto"),
        Case("W1", "mpire", "default", "peer", "mpire.WorkerPool, default chunk_size"),
        Case("W1", "mpire", f"chunksize={tuned}", "peer", f"mpire.WorkerPool, chunk_size={tuned}"),
        Case("W1", "easycore", "default", "easycore", f"{ec}, a consumer sums"),
        Case("W1", "easycore", "fold=sum", "easycore", f"{ec}, then sum() of its list"),
    ]

    cases += [
        Case("W2", "sequential", "default", "baseline", "in-process loop (the 1.00x reference)"),
        Case("W2", "pool", "default", "peer", "multiprocessing.Pool, default chunksize"),
        Case("W2", "pool", "chunksize=1", "peer", "multiprocessing.Pool, chunksize=1"),
        Case("W2", "futures", "default", "peer", "concurrent.futures, default chunksize=1"),
        Case("W2", "joblib", "default", "peer", "joblib.Parallel (loky), batch_size=auto"),
        Case("W2", "mpire", "default", "peer", "mpire.WorkerPool, default chunk_size"),
        Case("W2", "spdl", "default", "peer", f"SPDL pipe, ProcessPoolExecutor({workers})"),
        Case("W2", "torchdata", "default", "peer", f"torchdata ParallelMapper(process, {workers})"),
        Case("W2", "easycore", "default", "easycore", ec),
        Case("W2", "easycore", "resume=1", "easycore", f"{ec}, resume= (a run ledger)"),
    ]

    for w, kind in (("W3", ", 1 torch thread/worker"), ("W3b", "")):
        clone = "t.clone(), faster of default / 1 thread" if w == "W3" else "np.copy(a)"
        cases += [
            Case(w, "reference", "what=copy", "reference", f"in-process copy ({clone})"),
            Case(w, "sequential", "default", "baseline", "in-process loop (creating the arrays)"),
            Case(w, "pool", "default", "peer", f"multiprocessing.Pool, default chunksize{kind}"),
            Case(w, "futures", "default", "peer", f"concurrent.futures, chunksize=1{kind}"),
            Case(w, "joblib", "default", "peer", f"joblib.Parallel (loky){kind}"),
            Case(w, "mpire", "default", "peer", f"mpire.WorkerPool, default chunk_size{kind}"),
            Case(w, "easycore", "default", "easycore", ec),
        ]
    # the same results consumed as they arrive (each folded by the caller, then dropped); the
    # in-process copy reference is the keep-all group's
    for w, kind in (("W3", ", 1 torch thread/worker"), ("W3b", "")):
        g = f"{w} stream"
        mpire = f"mpire imap, default chunk_size{kind}"
        cases += [
            Case(g, "sequential", "stream=1", "baseline", "in-process loop (create, fold)"),
            Case(g, "pool", "stream=1", "peer", f"multiprocessing.Pool imap, chunksize=1{kind}"),
            Case(g, "futures", "stream=1", "peer", f"concurrent.futures map, chunksize=1{kind}"),
            Case(g, "joblib", "stream=1", "peer", f"joblib.Parallel generator (loky){kind}"),
            Case(g, "mpire", "stream=1", "peer", mpire),
            Case(g, "easycore", "stream=1", "easycore", f"{ec} >> consumer folding them"),
        ]

    for phase in ("cold", "warm"):
        g = f"W4 {phase}"
        if phase == "cold":
            cases.append(
                Case(
                    g,
                    "reference",
                    "what=import-torch",
                    "reference",
                    "`import torch` in a fresh process",
                )
            )
        cases += [
            Case(
                g,
                "pool",
                f"context=fork,phase={phase}",
                "peer",
                "multiprocessing.Pool, fork context",
            ),
            Case(
                g,
                "futures",
                f"context=fork,phase={phase}",
                "peer",
                "concurrent.futures, fork context",
            ),
            Case(g, "mpire", f"context=fork,phase={phase}", "peer", "mpire.WorkerPool (fork)"),
            Case(
                g,
                "easycore",
                f"phase={phase}",
                "easycore",
                f"easycore .map([0], devices={workers})",
            ),
            # the same after the caller imported torch: easycore's workers come from the
            # torch forkserver, Pool forks a caller that holds torch
            Case(
                g,
                "pool",
                f"context=fork,phase={phase},caller=torch",
                "context",
                "multiprocessing.Pool, fork context, caller imported torch",
            ),
            Case(
                g,
                "easycore",
                f"phase={phase},caller=torch",
                "easycore",
                f"easycore .map([0], devices={workers}), caller imported torch",
            ),
        ]
    # W5: the same work fused (every process decodes and runs the model per item) against a
    # pool per stage (decode on `workers`, the model on 1 worker, batches of 64).
    procs = workers + 1
    cases += [
        Case("W5", "sequential", "default", "baseline", "in-process loop (decode, model per item)"),
        Case(
            "W5",
            "pool",
            f"procs={procs}",
            "peer",
            f"multiprocessing.Pool({procs}) fused, 1 torch thread/worker",
        ),
        Case("W5", "easycore", f"procs={procs}", "peer", f"easycore fused .map(devices={procs})"),
        Case(
            "W5",
            "spdl",
            "stages=1",
            "peer",
            f"SPDL batches of 64 -> decode ProcessPoolExecutor({workers}) -> model",
        ),
        Case(
            "W5",
            "torchdata",
            "stages=1",
            "peer",
            f"torchdata Batcher(64) -> ParallelMapper(decode, {workers}) -> model",
        ),
        Case(
            "W5",
            "easycore",
            f"pools={workers}+1",
            "easycore",
            f"easycore decode.on({workers}) >> model.on(1, batch_size=64)",
        ),
        Case(
            "W5",
            "easycore",
            f"pools={workers}+1,resume=1",
            "easycore",
            f"easycore decode.on({workers}) >> model.on(1, ...), resume= (a run ledger)",
        ),
    ]
    # W2/W5 on a local Ray with `workers` CPUs: easycore's Ray engine against Ray Data's
    # map_batches on actor pools (bench_ray.py), and against easycore's local engine
    rd = f"Ray Data map_batches, {workers} actors"
    cases += [
        Case("W2 ray", "sequential", "default", "baseline", "in-process loop (1.00x)"),
        Case("W2 ray", "raydata", "default", "peer", f"{rd}, default batch_size"),
        Case("W2 ray", "raydata", "batch_size=10", "peer", f"{rd}, batch_size=10 (~50 ms)"),
        Case("W2 ray", "raytasks", "default", "context", "plain Ray tasks, one per item"),
        Case("W2 ray", "easycore", "engine=ray", "easycore", f"{ec}, engine='ray'"),
        Case("W2 ray", "easycore", "default", "local", f"{ec}, local engine"),
    ]
    two = f"decode.on({max(1, workers - 1)}) >> model.on(1, batch_size=64)"
    rd5 = f"Ray Data decode ({max(1, workers - 1)} actor) then model (1 actor, batches of 64)"
    cases += [
        Case("W5 ray", "raydata", "default", "peer", f"{rd5}, default batch_size"),
        Case("W5 ray", "raydata", "batch_size=64", "peer", f"{rd5}, decode batch_size=64"),
        Case("W5 ray", "easycore", "engine=ray", "easycore", f"easycore {two}, engine='ray'"),
        Case(
            "W5 ray",
            "easycore",
            f"pools={max(1, workers - 1)}+1",
            "local",
            f"easycore {two}, local engine",
        ),
    ]
    # W6: a training loop fed by easycore's imap on an open runner against DataLoader
    # (batch_size=None, persistent workers), each at its default prefetch and a deeper one.
    for g in ("W6 fast", "W6 slow", "W6 pause"):
        case = g.split()[1]
        cases += [
            Case(
                g, "dataloader", f"case={case}", "peer", "DataLoader, prefetch_factor=2 (default)"
            ),
            Case(
                g, "dataloader", f"case={case},prefetch=8", "peer", "DataLoader, prefetch_factor=8"
            ),
            Case(
                g,
                "dataloader",
                f"case={case},prefetch=32",
                "peer",
                "DataLoader, prefetch_factor=32",
            ),
            Case(g, "spdl", f"case={case}", "peer", "SPDL, ProcessPoolExecutor, sink 3 (default)"),
            Case(
                g, "spdl", f"case={case},prefetch=32", "peer", "SPDL, ProcessPoolExecutor, sink 64"
            ),
            Case(g, "torchdata", f"case={case}", "peer", "torchdata ParallelMapper, Prefetcher(4)"),
            Case(
                g,
                "torchdata",
                f"case={case},prefetch=32",
                "peer",
                "torchdata ParallelMapper, Prefetcher(64)",
            ),
            Case(g, "easycore", f"case={case}", "easycore", "easycore imap, prefetch=2 (default)"),
            Case(
                g, "easycore", f"case={case},prefetch=32", "easycore", "easycore imap, prefetch=32"
            ),
        ]
    # W7: resuming an epoch at 90% from imap's state_dict, against taking and dropping the
    # first 90% of batches (what a loop without a saved position does), and a fresh start
    cases += [
        Case("W7", "easycore", "how=resume", "easycore", "easycore imap(state=...) at 90%"),
        Case("W7", "easycore", "how=skip", "context", "easycore imap, first 90% taken, dropped"),
        Case(
            "W7", "easycore", "how=scratch", "reference", "easycore imap, first batch (epoch start)"
        ),
    ]
    # W7 write: results written to Parquet by the workers (bench_write.py), against the same
    # work without writing (compute only), Ray Data on a local Ray and HF datasets
    nw = size("W7 write", quick)
    ecw = f"easycore embed >> write.parquet(out), .map(devices={workers})"
    cases += [
        Case("W7 write", "easycore", "write=parquet", "easycore", ecw, n=nw),
        Case(
            "W7 write",
            "easycore",
            "write=none",
            "baseline",
            f"easycore embed >> consumer (compute only, no files), devices={workers}",
            n=nw,
        ),
        Case(
            "W7 write",
            "easycore",
            "write=parquet,resume=1",
            "context",
            f"{ecw}, resume= (a run ledger)",
            n=nw,
        ),
        Case(
            "W7 write",
            "raydata",
            "write=parquet",
            "peer",
            f"Ray Data map_batches + write_parquet, {workers} CPUs, default batch",
            n=nw,
        ),
        Case(
            "W7 write",
            "raydata",
            "write=parquet,batch_size=1000",
            "peer",
            f"Ray Data map_batches(batch_size=1000) + write_parquet, {workers} CPUs",
            n=nw,
        ),
        Case(
            "W7 write",
            "datasets",
            "write=parquet",
            "peer",
            f"HF datasets map(batched, num_proc={workers}) + to_parquet",
            n=nw,
        ),
    ]
    # W8: a stage that waits, then a CPU step (bench_waiting.py); fixed layout, 3 processes
    ec8 = "easycore fetch.on(2, concurrency={}) >> step.on(1)"
    cases += [
        Case("W8", "limit", "default", "reference", "limit: asyncio.gather (semaphore 128), step"),
        Case("W8", "threads", "default", "peer", "ThreadPoolExecutor(128): request, step"),
        Case("W8", "easycore", "concurrency=64", "easycore", ec8.format(64)),
        Case(
            "W8",
            "easycore",
            "concurrency=1,part=10",
            "context",
            ec8.format(1) + " (1/10 of it, open runner, x10)",
        ),
        Case(
            "W8",
            "easycore",
            "concurrency=64,stage=fetch,runner=1",
            "context",
            "fetch stage alone, c=64 (open runner)",
        ),
        Case(
            "W8",
            "easycore",
            "concurrency=1,stage=fetch,part=10",
            "context",
            "fetch stage alone, c=1 (1/10 of it, open runner, x10)",
        ),
        Case("W8", "spdl", "default", "peer", "SPDL async fetch (concurrency 128), step"),
        Case("W8", "torchdata", "default", "peer", "torchdata ParallelMapper(thread, 128)"),
        Case("W8", "raydata", "batch_size=64", "peer", "Ray Data async class, 2+1 actors"),
        Case("W8", "easycore", "concurrency=64,engine=ray", "context", ec8.format(64) + ", Ray"),
    ]
    # W8 uneven: the fetch stage alone over waits of uneven length, on an open runner
    u8 = "uneven=1"
    ecu = "easycore fetch.on(2, concurrency=64), open runner"
    cases += [
        Case("W8 uneven", "limit", u8, "reference", "limit: asyncio.gather (sem. 128)", n=4000),
        Case("W8 uneven", "threads", u8, "peer", "ThreadPoolExecutor(128)", n=4000),
        Case("W8 uneven", "spdl", u8, "peer", "SPDL async fetch (concurrency 128)", n=4000),
        Case("W8 uneven", "torchdata", u8, "peer", "torchdata ParallelMapper(thread, 128)", n=4000),
        Case("W8 uneven", "easycore", f"{u8},concurrency=64,runner=1", "easycore", ecu, n=4000),
        Case(
            "W8 uneven",
            "easycore",
            f"{u8},concurrency=64,runner=1,prefetch=8",
            "easycore",
            ecu + ", prefetch=8",
            n=4000,
        ),
    ]
    # W9: pools that size themselves against fixed splits and Ray Data (bench_sizing.py)
    import bench_sizing

    for case9, spec in bench_sizing.CASES.items():
        g, b9, n9 = f"W9 {case9}", spec["budget"], spec["n"]
        o9, e9 = bench_sizing.oracle(case9), bench_sizing.even(case9)
        split = lambda s: " + ".join(map(str, s))  # noqa: E731
        cases += [
            Case(
                g,
                "easycore",
                f"case={case9},how=auto",
                "easycore",
                f"easycore .on((1, {b9})) each, cpus={b9}",
                n=n9,
            ),
            Case(
                g,
                "easycore",
                f"case={case9},how=oracle",
                "reference",
                f"easycore, best fixed split {split(o9)} (oracle)",
                n=n9,
            ),
            Case(
                g,
                "easycore",
                f"case={case9},how=even",
                "context",
                f"easycore, even split {split(e9)}",
                n=n9,
            ),
            Case(
                g,
                "easycore",
                f"case={case9},how=fused",
                "context",
                f"easycore, fused, devices={b9}",
                n=n9,
            ),
            Case(
                g,
                "raydata",
                f"case={case9},how=auto",
                "peer",
                f"Ray Data ActorPoolStrategy(1, {b9}) per stage",
                n=n9,
            ),
            Case(
                g,
                "raydata",
                f"case={case9},how=oracle",
                "peer",
                f"Ray Data, the oracle's split {split(o9)}",
                n=n9,
            ),
        ]
    # W10: a real image pipeline, one-shot, each row in a fresh process (bench_images.py)
    for g, n10 in (("W10 1k", 1024), ("W10 4k", 4096)):
        n10 = n10 // 8 if quick else n10
        cases += [
            Case(g, "sequential", "default", "baseline", "one process (in-process loop)", n=n10),
            Case(g, "dataloader", "default", "peer", f"DataLoader(num_workers={workers})", n=n10),
            Case(g, "spdl", "default", "peer", f"SPDL, ProcessPoolExecutor({workers})", n=n10),
            Case(g, "spdl", "threads=1", "peer", f"SPDL, {workers} threads (MT)", n=n10),
            Case(
                g,
                "spdl",
                "loader=1",
                "peer",
                f"SPDL get_pytorch_dataloader(num_workers={workers})",
                n=n10,
            ),
            Case(g, "easycore", "default", "easycore", f"easycore imap(devices={workers})", n=n10),
        ]
    return cases


def select(cases: list[Case], only: str | None) -> list[Case]:
    """Keep the cases of the groups named in ``--only``.

    A group's exact name selects that group (``W3`` is the keep-all group alone, ``W3
    stream`` the streamed one); a workload that names no group selects all of its groups
    (``W4``: cold and warm). A streamed group also brings the in-process copy reference of
    its workload's keep-all group, which its targets use.
    """
    if not only:
        return cases
    wanted = {w.strip().lower() for w in only.split(",") if w.strip()}
    names = {g.lower() for g in GROUPS}
    unknown = wanted - names - {g.workload.lower() for g in GROUPS.values()}
    if unknown:
        sys.exit(f"--only: unknown workload(s) {sorted(unknown)}; choose from {list(GROUPS)}")
    groups = {g for g in GROUPS if g.lower() in wanted}
    groups |= {g for g, grp in GROUPS.items() if grp.workload.lower() in wanted - names}
    refs = {GROUPS[g].workload for g in groups if g.endswith(" stream")}
    return [c for c in cases if c.group in groups or (c.group in refs and c.role == "reference")]


# ---------------------------------------------------------------------------------------------
# running the children
# ---------------------------------------------------------------------------------------------
def child_env(w2_iters: int) -> dict[str, str]:
    """The environment of every measurement: W2's work size, benchmarks/ importable."""
    env = dict(os.environ)
    env[wl.W2_ENV] = str(w2_iters)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), path) if p)
    return env


def run_child(case: Case, n: int, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """Measure ``case`` once in a fresh interpreter; ``{"seconds": ...}`` or ``{"error": ...}``."""
    workload = GROUPS[case.group].workload
    cmd = [
        sys.executable,
        str(HERE / "run.py"),
        "--one",
        case.lib,
        workload,
        case.variant,
        "--n",
        str(n),
        "--workers",
        str(args.workers),
        "--mode",
        args.mode,
    ]
    try:
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG) and proc.returncode == 0:
            return dict(json.loads(line[len(RESULT_TAG) :]))
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
    kind = "wrong result" if proc.returncode == EXIT_WRONG else f"exit {proc.returncode}"
    return {"error": f"{kind}: {tail[0][:200]}", "wrong": proc.returncode == EXIT_WRONG}


def figure(group: Group, n: int, seconds: float) -> float:
    """The reported figure of one sample (W2's speed-up is computed later)."""
    if group.unit == "items/s":
        return n / seconds
    if group.unit == "GB/s":
        return n * wl.W3_BYTES / seconds / 1e9
    return seconds


def measure_all(cases: list[Case], args: argparse.Namespace, env: dict[str, str]) -> list[Row]:
    """Run every case ``repeats`` times, workload by workload, cases interleaved."""
    rows = [Row(c, c.n or size(GROUPS[c.group].workload, args.quick)) for c in cases]
    for gname in GROUPS:
        group_rows = [r for r in rows if r.case.group == gname]
        if not group_rows:
            continue
        t0 = time.perf_counter()
        for rep in range(args.repeats):
            for row in group_rows:
                t_child = time.perf_counter()
                res = run_child(row.case, row.n, args, env)
                wall = time.perf_counter() - t_child
                note = f"{res['seconds']:.4f} s" if "seconds" in res else res["error"]
                note += f"  (process: {wall:.1f} s)"
                print(
                    f"  [{gname} {rep + 1}/{args.repeats}] {row.case.label}: {note}",
                    file=sys.stderr,
                    flush=True,
                )
                if "seconds" in res:
                    row.seconds.append(float(res["seconds"]))
                    row.extra.append(res.get("extra", {}))
                else:
                    row.errors.append(res["error"])
                    row.wrong = row.wrong or bool(res.get("wrong"))
        finish_group(GROUPS[gname], group_rows)
        print_group(GROUPS[gname], group_rows, args, time.perf_counter() - t0)
    return rows


def finish_group(group: Group, rows: list[Row]) -> None:
    """Turn seconds into the group's figures (W2: speed-up over the sequential median)."""
    if group.unit == "x ideal":  # W6: the epoch against the best any feeder could do
        for r in rows:
            r.values = [s / e["ideal"] for s, e in zip(r.seconds, r.extra, strict=True)]
        return
    if group.unit == "x seq":
        base = [r for r in rows if r.case.role == "baseline" and r.ok]
        if not base:
            for r in rows:
                r.errors.append("no sequential baseline")
                r.seconds.clear()
            return
        seq = statistics.median(base[0].seconds)
        for r in rows:
            r.values = [seq / s for s in r.seconds]
        return
    for r in rows:
        r.values = [figure(group, r.n, s) for s in r.seconds]


# ---------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------
def fmt(group: Group, v: float) -> str:
    """A figure in the group's unit, compactly."""
    if group.unit == "items/s":
        if v >= 1e5:
            return f"{v / 1e6:.2f} M"
        return f"{v / 1e3:.1f} k" if v >= 1e4 else f"{v:,.0f}"
    if group.unit == "GB/s":
        return f"{v:.3f}" if v < 1 else f"{v:.2f}"
    if group.unit in ("x seq", "x ideal"):
        return f"{v:.2f}x"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}"


def best_peer(group: Group, rows: list[Row]) -> Row | None:
    """The peer row with the best median (tuned variants included)."""
    peers = [r for r in rows if r.case.role == "peer" and r.ok]
    if not peers:
        return None
    pick: Callable[..., Row] = max if group.higher_is_better else min
    return pick(peers, key=lambda r: r.median)


def ratio(group: Group, row: Row, best: Row | None) -> float | None:
    """How many times better than the best peer (< 1: worse), whatever the unit's direction."""
    if best is None or not row.ok:
        return None
    return row.median / best.median if group.higher_is_better else best.median / row.median


def print_group(group: Group, rows: list[Row], args: argparse.Namespace, elapsed: float) -> None:
    """One workload's table."""
    n = rows[0].n if rows else size(group.workload, args.quick)
    unit = {"x seq": "speed-up over sequential", "s": "seconds"}.get(group.unit, group.unit)
    head = (
        f"{group.name}: {n:,} {group.title}"
        if group.workload not in ("W4", "W6")
        else (f"{group.name}: {group.title}")
    )
    print(f"\n{head}  [{unit}; {args.repeats} fresh process(es) per row; {elapsed:.0f} s]")
    print(f"  {'library / variant':<62} {'median':>9} {'min - max':>19} {'vs best peer':>13}")
    best = best_peer(group, rows)
    for r in rows:
        mark = "*" if r.case.role == "easycore" else ("+" if r is best else " ")
        label = r.case.label[:62]
        if not r.ok:
            why = r.errors[0] if r.errors else "no result"
            print(f"{mark} {label:<62} {'FAILED':>9}  {why}")
            continue
        lo, hi = min(r.values), max(r.values)
        rat = ratio(group, r, best)
        rtxt = f"{rat:.2f}x" if rat is not None else "-"
        fails = f"  ({len(r.errors)} failed: {r.errors[0]})" if r.errors else ""
        if group.unit == "x ideal":
            fails = f"  {_waits(r)}{fails}"
        print(
            f"{mark} {label:<62} {fmt(group, r.median):>9} "
            f"{fmt(group, lo) + ' - ' + fmt(group, hi):>19} {rtxt:>13}{fails}"
        )
    if best is not None:
        print(f"  (+ best peer: {best.case.label}; * easycore; 'vs best peer' > 1 is better)")
    sys.stdout.flush()


def _waits(r: Row) -> str:
    """W6: the median share of the epoch the loop waited for data, and after pauses."""
    share = statistics.median(e["wait"] / s for s, e in zip(r.seconds, r.extra, strict=True))
    text = f"waited {share:.0%}"
    if any(e["after_pause"] or "pause" in r.case.variant for e in r.extra):
        after = statistics.median(e["after_pause"] for e in r.extra)
        text += f", {after * 1000:.0f} ms in the 10 steps after pauses"
    return text


@dataclass
class Target:
    """One line of the verdict."""

    group: str
    what: str
    value: float | None
    bound: float
    at_least: bool
    shown: str = ""

    @property
    def passed(self) -> bool:
        if self.value is None:
            return False
        return self.value >= self.bound if self.at_least else self.value <= self.bound


def targets(rows: list[Row]) -> list[Target]:
    """The issue's targets, computed from the rows that ran.

    W3/W3b's two bounds apply to their streamed groups too (the same workload, its results
    consumed instead of kept), and W4 warm's 2x bound also to easycore against Pool when both
    callers imported torch: lines added here, not in the issue.
    """
    by_group: dict[str, list[Row]] = {}
    for r in rows:
        by_group.setdefault(r.case.group, []).append(r)

    def role(g: str, name: str) -> Row | None:
        hits = [r for r in by_group.get(g, []) if r.case.role == name]
        return hits[0] if hits and hits[0].ok else None

    out: list[Target] = []
    for g, rs in by_group.items():
        if not any(r.case.role == "easycore" for r in rs):
            continue  # e.g. W3's copy reference, run only for its streamed group
        group = GROUPS[g]
        best = best_peer(group, rs)
        ec = role(g, "easycore")
        rat = ratio(group, ec, best) if ec else None
        # workloads with several easycore rows get one line per row, named by its variant
        ecs = [r for r in rs if r.case.role == "easycore" and r.ok]
        if g == "W1":
            for r in ecs:
                how = "sum()" if "fold=sum" in r.case.variant else "consumer"
                what = f"easycore ({how}) / best peer, items/s"
                out.append(Target(g, what, ratio(group, r, best), 1.3, True))  # (#43's bound)
        elif g == "W2":
            plain = next((r for r in ecs if "resume" not in r.case.variant), None)
            out.append(
                Target(
                    g,
                    "easycore speed-up over sequential",
                    plain.median if plain else None,
                    1.9,
                    True,
                )
            )
            if plain is not None:  # (#43: at least as fast as every peer)
                out.append(Target(g, "easycore / best peer", ratio(group, plain, best), 1.0, True))
            out += _ledger_targets(g, ecs)
        elif g in ("W3", "W3b", "W3 stream", "W3b stream"):
            ref = role(group.workload, "reference")  # the streamed groups share it
            out.append(Target(g, "easycore / best peer, GB/s", rat, 10.0, True))
            frac = ec.median / ref.median if ec and ref else None
            out.append(Target(g, "easycore / in-process copy, GB/s", frac, 0.30, True))
        elif g == "W4 warm":
            for r in ecs:
                r_rat = ratio(group, r, best)
                how = "torch caller" if "caller=torch" in r.case.variant else "no torch"
                what = f"easycore ({how}) time / fastest fork peer"
                out.append(Target(g, what, 1 / r_rat if r_rat else None, 2.0, False))
            # and a torch program against the same program on Pool (which forks torch too)
            same = role(g, "context")
            torch_ec = next((r for r in ecs if "caller=torch" in r.case.variant), None)
            if same and torch_ec:
                what = "easycore / Pool fork, both callers with torch"
                out.append(Target(g, what, torch_ec.median / same.median, 2.0, False))
        elif g == "W4 cold":
            # the bound is about paying `import torch` once: the run whose caller has torch
            ref = role(g, "reference")
            row = next((r for r in ecs if "caller=torch" in r.case.variant), None)
            extra = row.median - ref.median if row and ref else None
            what = "easycore (torch caller) - `import torch` (s)"
            out.append(Target(g, what, extra, 0.5, False))
        elif g == "W5":
            pools = next((r for r in ecs if "resume" not in r.case.variant), None)
            fused = best_peer(group, [r for r in rs if "procs=" in r.case.variant])
            rat = ratio(group, pools, fused) if pools else None
            out.append(Target(g, "pools / best fused run, items/s", rat, 1.0, True))
            out += _ledger_targets(g, ecs)
        elif g == "W8":
            by = {r.case.variant: r for r in rs if r.ok}
            c64 = by.get("concurrency=64")
            on_ray, rd = by.get("concurrency=64,engine=ray"), by.get("batch_size=64")
            f64 = by.get("concurrency=64,stage=fetch,runner=1")
            f1 = by.get("concurrency=1,stage=fetch,part=10")
            ref = role(g, "reference")
            out.append(
                Target(
                    g,
                    "easycore c=64 / the limit (asyncio), items/s",
                    c64.median / ref.median if c64 and ref else None,
                    0.8,
                    True,
                )
            )
            # (c=64 against c=1 with the step is shown, not a target: the step's 2 s on one
            # worker against 20 s of one-at-a-time waiting caps that ratio at 10x)
            out.append(
                Target(
                    g,
                    "fetch stage alone: c=64 / c=1, items/s",
                    f64.median / f1.median if f64 and f1 else None,
                    20.0,
                    True,
                )
            )
            out.append(
                Target(
                    g,
                    "easycore on Ray / Ray Data (async class), items/s",
                    on_ray.median / rd.median if on_ray and rd else None,
                    1.0,
                    True,
                )
            )
        elif g == "W8 uneven":
            by = {r.case.variant: r for r in ecs if r.ok}
            c64 = by.get("uneven=1,concurrency=64,runner=1")
            ref = role(g, "reference")
            out.append(
                Target(
                    g,
                    "easycore c=64 / the limit (asyncio), items/s",
                    c64.median / ref.median if c64 and ref else None,
                    0.8,
                    True,
                )
            )
        elif g in ("W2 ray", "W5 ray"):
            unit = "speed-up" if g == "W2 ray" else "items/s"
            out.append(Target(g, f"easycore on Ray / best Ray Data, {unit}", rat, 1.0, True))
            tasks = role(g, "context")
            if g == "W2 ray" and ec and tasks:  # within 1.1x of plain Ray tasks' time
                what = "easycore on Ray / plain Ray tasks, speed-up"
                out.append(Target(g, what, ec.median / tasks.median, 1 / 1.1, True))
        elif g == "W7":  # resuming costs no more than skipping (here: far less)
            skip = role(g, "context")
            frac = ec.median / skip.median if ec and skip else None
            out.append(Target(g, "resume time to first batch / skipping's", frac, 1.0, False))
        elif g == "W7 write":
            by = {r.case.variant: r for r in rs if r.case.lib == "easycore" and r.ok}
            wr, compute = by.get("write=parquet"), by.get("write=none")
            rds = [r for r in rs if r.case.lib == "raydata" and r.ok]
            rd = max(rds, key=lambda r: r.median, default=None)
            what = "easycore write / best Ray Data, items/s"
            out.append(Target(g, what, wr.median / rd.median if wr and rd else None, 1.5, True))
            # the same work's time with writing against without (medians of items/s)
            frac = compute.median / wr.median if wr and compute else None
            out.append(Target(g, "easycore write time / compute-only time", frac, 1.15, False))
        elif g.startswith("W6"):
            best_ec = min(ecs, key=lambda r: r.median, default=None)
            out.append(
                Target(
                    g,
                    "best easycore epoch / best peer's",
                    (best_ec.median / best.median if best_ec and best else None),
                    1.0,
                    False,
                )
            )
            for r in ecs:
                what = f"easycore ({r.case.label.split(', ')[1]}) epoch / ideal"
                out.append(Target(g, what, r.median, 1.10, False))
            deep = next((r for r in ecs if "prefetch=" in r.case.variant), None)
            if g == "W6 pause" and deep is not None:
                after = statistics.median(e["after_pause"] for e in deep.extra)
                what = "easycore (prefetch=32) wait after pauses (s)"
                out.append(Target(g, what, after, 0.005, False))
        elif g.startswith("W9") and ec is not None:
            out += _sizing_targets(g, rs, ec)
    return out


def _sizing_targets(g: str, rs: list[Row], ec: Row) -> list[Target]:
    """W9: self-sizing against the oracle (and the best fixed split on the phase change),
    Ray Data's autoscaling on ray#65540's shape, and the controller's own CPU."""
    by = {
        r.case.variant.split("how=")[1] + ("-ray" if r.case.lib == "raydata" else ""): r
        for r in rs
        if r.ok
    }
    out = []
    oracle, ray_auto = by.get("oracle"), by.get("auto-ray")
    if oracle is not None:
        steady = [statistics.median(e["steady_items_per_s"] for e in r.extra) for r in (ec, oracle)]
        if g != "W9 phase":  # (a phase change has no one steady state)
            what = "easycore steady items/s / the oracle's"
            out.append(Target(g, what, steady[0] / steady[1], 0.95, True))
        frac = ec.median / oracle.median
        if g == "W9 phase":
            out.append(Target(g, "easycore time / best fixed split's", frac, 1 / 1.15, False))
        else:
            out.append(Target(g, "easycore time / the oracle's (whole run)", frac, 1.15, False))
    if g == "W9 two" and ray_auto is not None:
        out.append(
            Target(
                g, "easycore / Ray Data autoscaling, speed", ray_auto.median / ec.median, 2.0, True
            )
        )
    shares = [e.get("control_share") for e in ec.extra if e.get("control_share") is not None]
    if shares:
        what = "controller time / run time"
        out.append(Target(g, what, statistics.median(shares), 0.01, False))
    return out


def _ledger_targets(g: str, ecs: list[Row]) -> list[Target]:
    """A run ledger (resume=) costs at most 10%: its row against the same row without."""
    ledger = next((r for r in ecs if "resume=1" in r.case.variant), None)
    if ledger is None:
        return []
    base = ledger.case.variant.replace(",resume=1", "").replace("resume=1", "default")
    plain = next((r for r in ecs if r.case.variant == base), None)
    frac = ledger.median / plain.median if plain else None
    return [Target(g, "easycore with a run ledger / without, same work", frac, 0.90, True)]


def print_targets(ts: list[Target], quick: bool) -> None:
    """The verdict table."""
    print("\nTargets" + ("  (--quick: reduced sizes, 1 repeat; not a verdict)" if quick else ""))
    for t in ts:
        if t.group.startswith("W3") and "copy" in t.what:
            val = f"{t.value:.0%}" if t.value is not None else "n/a"
            bound = f"{t.bound:.0%}"
        elif t.what.endswith("(s)"):
            val = f"{t.value:+.3f}" if t.value is not None else "n/a"
            bound = f"{t.bound:g}"
        else:
            val = f"{t.value:.2f}x" if t.value is not None else "n/a"
            bound = f"{t.bound:g}x"
        op = ">=" if t.at_least else "<="
        t.shown = f"{val} {op} {bound}"
        why = "" if t.value is not None else "  (easycore or its reference failed)"
        print(
            f"  {t.group:<10} {t.what:<50} {val:>8} {op} {bound:<6} "
            f"{'PASS' if t.passed else 'MISS'}{why}"
        )


def write_bytecode() -> None:
    """Write the bytecode caches of easycore and ``benchmarks/``.

    A user's Python writes ``__pycache__`` on the first import, and pip compiles every
    package it installs (the peers here), but an editable checkout under
    ``PYTHONDONTWRITEBYTECODE=1`` (as on some CI machines) has none: every fresh process,
    and every spawned or forkserver worker that imports the work functions' module, would
    compile the sources again (~3 ms per worker for ``bench_workloads`` alone, measured),
    a cost no installed library pays. Imports read caches whatever that variable says.
    """
    spec = importlib.util.find_spec("easycore")
    found = (spec.submodule_search_locations or []) if spec is not None else []
    folders = [HERE, *(Path(p) for p in found)]
    for folder in folders:
        compileall.compile_dir(folder, quiet=1)


def machine(w2_iters: int, args: argparse.Namespace) -> dict[str, Any]:
    """What the numbers were measured on."""

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    cpu = "unknown"
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        import easycore

        ec_version = getattr(easycore, "__version__", "?")
        ec_path = str(Path(easycore.__file__).parent)
    except Exception as exc:  # a broken checkout still gets its failures reported
        ec_version, ec_path = f"import failed: {exc}", ""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count() or 0
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": affinity,
        "load_average": os.getloadavg(),
        "platform": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "torch": version("torch"),
        "numpy": version("numpy"),
        "joblib": version("joblib"),
        "mpire": version("mpire"),
        "easycore": ec_version,
        "easycore_path": ec_path,
        "workers": args.workers,
        "repeats": args.repeats,
        "mode": args.mode,
        "quick": args.quick,
        "w2_iters": w2_iters,
        "w2_item_ms": wl.w2_item_seconds(w2_iters) * 1e3,
    }


def print_machine(m: dict[str, Any]) -> None:
    """The header."""
    load = ", ".join(f"{x:.2f}" for x in m["load_average"])
    print(
        f"easycore benchmarks — {m['workers']} workers, {m['repeats']} repeat(s), "
        f"mode={m['mode']}{', QUICK' if m['quick'] else ''}"
    )
    print(
        f"  machine: {m['cpu']}, {m['cores']} cores ({m['cores_usable']} usable), "
        f"load {load}; {m['platform']}"
    )
    print(
        f"  python {m['python']}, torch {m['torch']}, numpy {m['numpy']}, "
        f"joblib {m['joblib']}, mpire {m['mpire']}, easycore {m['easycore']} "
        f"({m['easycore_path']})"
    )
    print(f"  W2 item: {m['w2_iters']:,} iterations = {m['w2_item_ms']:.2f} ms here")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------
def child(lib: str, workload: str, variant: str, n: int, workers: int, mode: str) -> int:
    """``--one``: one measurement in this (fresh) process; prints one tagged JSON line."""
    import bench_libs

    try:
        res = bench_libs.measure(lib, workload, variant, n, workers, mode)
    except Exception as exc:
        traceback.print_exc()
        # a check that failed inside a library (easycore's consumer wraps what its fold
        # raised in a WorkerError) is still a wrong result
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, wl.WrongResult):
            cause = cause.__cause__
        return EXIT_WRONG if cause is not None else 1
    print(RESULT_TAG + json.dumps(res), flush=True)
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=None, help="fresh processes per row (5)")
    p.add_argument("--workers", type=int, default=2, help="processes per pool (2)")
    p.add_argument("--quick", action="store_true", help="1 repeat, small sizes: a smoke test")
    p.add_argument(
        "--only",
        help="comma-separated groups or workloads: W1,W2,W3,W3b,'W3 stream',W4,'W4 warm',W5,"
        "W6 ('W6 fast', 'W6 slow', 'W6 pause'), W7, 'W7 write', W8, 'W8 uneven', "
        "W10 ('W10 1k', 'W10 4k')",
    )
    p.add_argument("--json", type=Path, help="also write every sample and the verdict here")
    p.add_argument(
        "--mode",
        choices=("call", "warm"),
        default="call",
        help="call: time pool creation + run + shutdown (default); "
        "warm: pools up before the clock starts",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    p.add_argument("--w2-iters", type=int, help="W2 work per item (default: calibrated to 5 ms)")
    p.add_argument("--one", nargs=3, metavar=("LIB", "WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.repeats < 1 or args.workers < 1:
        p.error("--repeats and --workers must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--one``, a single measurement)."""
    args = parse_args(argv)
    if args.one:
        lib, workload, variant = args.one
        n = args.n or size(workload, args.quick)
        return child(lib, workload, variant, n, args.workers, args.mode)

    cases = select(build_cases(args.quick, args.workers, args.mode), args.only)
    write_bytecode()
    w2_iters = args.w2_iters or wl.calibrate_w2()
    info = machine(w2_iters, args)
    print_machine(info)
    t0 = time.perf_counter()
    rows = measure_all(cases, args, child_env(w2_iters))
    ts = targets(rows)
    print_targets(ts, args.quick)
    total = time.perf_counter() - t0
    info["load_average_after"] = os.getloadavg()
    print(
        f"\n{len(cases)} rows, {sum(len(r.seconds) + len(r.errors) for r in rows)} processes, "
        f"{total:.0f} s; load average now {info['load_average_after'][0]:.2f}"
    )
    if args.json:
        doc = {
            "machine": info,
            "rows": [
                {
                    **asdict(r.case),
                    "n": r.n,
                    "seconds": r.seconds,
                    "values": r.values,
                    "unit": GROUPS[r.case.group].unit,
                    "median": r.median if r.ok else None,
                    "min": min(r.values) if r.ok else None,
                    "max": max(r.values) if r.ok else None,
                    "errors": r.errors,
                    "wrong": r.wrong,
                    "extra": r.extra,
                }
                for r in rows
            ],
            "best_peer": {
                g: b.case.label
                for g in GROUPS
                if (b := best_peer(GROUPS[g], [r for r in rows if r.case.group == g]))
            },
            "targets": [{**asdict(t), "passed": t.passed} for t in ts],
            "seconds": total,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
