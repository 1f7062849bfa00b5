"""Generated cases (hypothesis), built into real pipelines and run on one engine.

:func:`cases` draws a :class:`~reference.Case`; :func:`build` turns it into easycore stages
and pools; :func:`run_case` runs it on ``"inline"``, ``"processes"`` or ``"ray"`` and returns
what a user observes, as an :class:`~reference.Outcome` (with the raised error itself);
:func:`check` compares that with the reference interpreter.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import shutil
import sys
import tempfile
import uuid
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import attrs
import pyarrow.parquet as pq
from hypothesis import strategies as st
from reference import (
    MODULUS,
    Case,
    ConsumerSpec,
    Outcome,
    PoolSpec,
    Raised,
    StageSpec,
    reference,
    sink_row,
)

from easycore import WorkerError, compose, consumer, item_seed, producer, write

ENGINES = ("inline", "processes", "ray")
MAX_WORKERS = 6  # over all pools (the suite's Ray has 8 CPUs)


# -- drawing cases -----------------------------------------------------------------------------
@st.composite
def cases(draw: Any, resume: bool = False) -> Case:
    """A pipeline of 1-4 stages in 1-3 pools, an input, and options."""
    n_stages = draw(st.integers(1, 4))
    seed = draw(st.none() | st.integers(0, 2**31))
    names = iter(f"s{k}" for k in itertools.count())

    def stage(first: bool) -> StageSpec:
        return StageSpec(
            next(names),
            a=draw(st.integers(1, 3)),
            b=draw(st.integers(-5, 5)),
            poison=draw(st.none() | st.none() | st.integers(0, MODULUS - 1)),
            transient=first and draw(st.booleans()),
            seeded=seed is not None and draw(st.booleans()),
            kept=draw(st.booleans()),
        )

    stages = [stage(k == 0) for k in range(n_stages)]
    cuts = sorted(draw(st.sets(st.integers(1, n_stages - 1), max_size=2)) if n_stages > 1 else [])
    groups = [stages[a:b] for a, b in itertools.pairwise([0, *cuts, n_stages])]
    pools = []
    used = 0
    for h, group in enumerate(groups):
        own = h > 0 or draw(st.booleans())  # the first pool: .on, or the run's devices
        # within MAX_WORKERS over all pools, one left for each pool after this one
        most = max(1, min(3, MAX_WORKERS - used - (len(groups) - h - 1)))
        workers = draw(st.integers(1, most)) if own else None
        used += workers or 0
        pools.append(
            PoolSpec(
                tuple(group),
                workers=workers,
                batch_size=draw(st.none() | st.integers(1, 3)),
                concurrency=draw(st.sampled_from([1, 1, 4])),
                asynchronous=draw(st.booleans()),
                sizes=own and draw(st.sampled_from([False, False, True])),
            )
        )
    budget = MAX_WORKERS - sum(p.workers or 0 for p in pools)
    devices = draw(st.integers(1, max(1, min(3, budget))))
    if pools[0].workers is None and sum(p.workers or 0 for p in pools) + devices > MAX_WORKERS:
        pools[0] = attrs.evolve(pools[0], workers=1)
    ordered = draw(st.booleans())
    consumer_spec = None
    if not resume and draw(st.booleans()):
        kind = draw(st.sampled_from(["sum", "list"])) if ordered else "sum"
        fails_at = draw(st.none() | st.integers(0, 5)) if ordered else None
        consumer_spec = ConsumerSpec(kind, fails_at)
    sink = consumer_spec is None and draw(st.sampled_from([False, False, True]))
    sink_kind = draw(st.sampled_from(["jsonl", "parquet"])) if sink else "jsonl"
    items = draw(st.lists(st.integers(0, 200), unique=True, max_size=40))
    return Case(
        pools=tuple(pools),
        items=tuple(items),
        devices=devices,
        ordered=ordered,
        seed=seed,
        errors=draw(st.sampled_from(["raise", "skip"])),
        retries=draw(st.integers(0, 2)),
        consumer=consumer_spec,
        sink=sink,
        sink_kind=sink_kind,
        interrupt_after=draw(st.integers(0, 12)) if resume else None,
    )


# -- building pipelines ------------------------------------------------------------------------
def _attempts() -> dict[tuple[str, str], int]:
    """Attempts per (stage, input) in this process (a transient stage's memory; a worker's
    lasts as long as the worker, the calling process's is cleared between runs)."""
    book = getattr(sys, "_easycore_conformance_attempts", None)
    if book is None:
        book = {}
        sys._easycore_conformance_attempts = book  # type: ignore[attr-defined]
    return book


# A unit's own generator, in a pool whose worker holds several units at once (their draws
# from the global random would interleave): made from item_seed() at its first stage.
UNIT_RNG: ContextVar[random.Random | None] = ContextVar("conformance_rng", default=None)


def unit_rng(first: bool) -> Any:
    """The unit's own generator: a new one at its first stage (a module function, so that
    stages reach the context variable by reference, not pickled)."""
    if first:
        UNIT_RNG.set(random.Random(item_seed()))
    return UNIT_RNG.get()


def make_stage(
    spec: StageSpec, token: str, calls: Path | None, pool: PoolSpec | None = None, k: int = 0
) -> Any:
    """A producer doing what ``spec`` says, stage ``k`` of ``pool`` (``async def`` in an
    asynchronous pool); ``calls``: a folder where every call of the first stage leaves a
    file (to see what a resumed run computed)."""
    own_rng = pool is not None and pool.concurrency > 1

    def work(x: Any) -> int:
        # A transient fault strikes the first attempt in a worker's run: a resumed run's
        # workers may live in processes that ran the first (Ray tasks), so it is counted
        # per run, the number check_resumed writes beside ``calls``.
        run = _run_number(calls).read_text() if calls is not None else ""
        key = (f"{token}:{spec.name}:{run}", repr(x))
        book = _attempts()
        book[key] = book.get(key, 0) + 1
        if calls is not None:
            (calls / f"{uuid.uuid4().hex}.call").write_text(repr(x))
        rng: Any = random
        if own_rng:
            rng = unit_rng(k == 0)
        return spec.apply(x, first_attempt=book[key] == 1, rng=rng)

    async def awork(x: Any) -> int:
        await asyncio.sleep(0)  # let the worker's other units run in between
        y = work(x)
        await asyncio.sleep(0)
        return y

    fn = awork if pool is not None and pool.asynchronous else work
    fn.__name__ = fn.__qualname__ = spec.name
    return producer(init=dict)(fn) if spec.kept else producer(fn)


def _run_number(calls: Path) -> Path:
    return calls.with_name(calls.name + ".run")


def build(case: Case, calls: Path | None = None, out: Path | None = None) -> Any:
    """The easycore pipeline of ``case`` (``out``: the folder of its sink, if it has one)."""
    token = uuid.uuid4().hex
    parts: list[Any] = []
    for h, pool in enumerate(case.pools):
        stages = [
            make_stage(s, token, calls if h == 0 and k == 0 else None, pool, k)
            for k, s in enumerate(pool.stages)
        ]
        if case.sink and h == len(case.pools) - 1:

            def row(y: int) -> dict[str, Any]:  # (a closure: it travels by value)
                import numpy as np  # (reference.sink_row, with an array of varying length)

                seq = np.arange(y % 4, dtype=np.int64) + y
                return {"y": y, "seq": seq, "note": None if y % 3 else f"n{y}"}

            stages.append(producer(row))  # a sink writes mappings
        p = compose(*stages)
        if pool.workers is not None:
            where = (1, pool.workers) if pool.sizes else pool.workers
            p = p.on(where, batch_size=pool.batch_size, concurrency=pool.concurrency)
        parts.append(p)
    spec = case.consumer
    if spec is not None:
        parts.append(make_consumer(spec))
    if case.sink:
        assert out is not None
        parts.append(write.parquet(out) if case.sink_kind == "parquet" else write.jsonl(out))
    return compose(*parts)


def read_back(out: Path, written: Any = None) -> list[int]:
    """The values a sink's files hold, in the order of the files' names (input order), after
    checking that no file is left half-written, that (given ``map``'s ``Written``) the
    committed files are the ones on disk, and that each row is ``sink_row`` of its value
    (Parquet: read as one dataset, with ``pyarrow.parquet.read_table(dir)``)."""
    names = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert not [n for n in names if n.startswith(".")], names
    if written is not None:
        assert sorted(Path(f).name for f in written.files) == names, (written.files, names)
    if names and names[0].endswith(".parquet"):
        rows = pq.read_table(out).to_pylist()
    else:
        rows = [json.loads(line) for n in names for line in (out / n).read_text().splitlines()]
    values = [row["y"] for row in rows]
    assert rows == [sink_row(y) for y in values], rows
    if written is not None:
        assert written.rows == len(values)
    return values


def make_consumer(spec: ConsumerSpec) -> Any:
    def fold(acc: Any, y: int) -> Any:
        if spec.fails_at is not None and acc[1] == spec.fails_at:
            msg = f"the consumer refuses value {acc[1]}"
            raise RuntimeError(msg)
        if spec.kind == "sum":
            return (acc[0] + y, acc[1] + 1)
        return ([*acc[0], y], acc[1] + 1)

    fold.__name__ = fold.__qualname__ = "fold"
    start = (0, 0) if spec.kind == "sum" else ([], 0)
    return consumer(init=start, end=lambda acc: acc[0])(fold)


# -- running -----------------------------------------------------------------------------------
def run_options(case: Case, engine: str) -> dict[str, Any]:
    """``map``'s arguments for ``case`` on ``engine``."""
    kw: dict[str, Any] = {
        "ordered": case.ordered,
        "seed": case.seed,
        "errors": case.errors,
        "retries": case.retries,
    }
    if case.pools[0].workers is None and case.pools[0].batch_size is not None:
        kw["batch_size"] = case.pools[0].batch_size
    if case.pools[0].workers is None and case.pools[0].concurrency > 1:
        kw["concurrency"] = case.pools[0].concurrency
    if engine == "inline":
        kw["devices"] = "inline"
    elif case.pools[0].workers is None:  # (devices= describes the pool without .on)
        kw["devices"] = case.devices
    if engine == "ray":
        kw["engine"] = "ray"
    if engine != "inline" and any(p.sizes for p in case.pools):
        kw["cpus"] = MAX_WORKERS  # (every pool's lo fits; sizes forced: conftest.py)
    return kw


def _on_error(case: Case, report: Any) -> dict[str, Any]:
    """``on_error=report`` where the case sets failures aside (errors="skip"), else nothing."""
    return {"on_error": report} if case.errors == "skip" else {}


def _raised(exc: BaseException) -> Raised:
    cls = type(exc.__cause__) if exc.__cause__ is not None else type(exc)
    return Raised(cls, getattr(exc, "index", None), getattr(exc, "stage", None), None)


def run_case(case: Case, engine: str) -> tuple[Outcome, BaseException | None, list[Any]]:
    """Run ``case`` on ``engine`` on an open runner: (what came back, the error raised,
    the runner's stats)."""
    out = Path(tempfile.mkdtemp(prefix="conformance-")) / "out" if case.sink else None
    pipeline = build(case, out=out)
    kw = run_options(case, engine)
    failures: list[Any] = []
    open_kw = {k: kw.pop(k) for k in ("devices", "engine", "concurrency", "cpus") if k in kw}
    try:
        with pipeline.open(**open_kw) as runner:
            try:
                value = runner.map(list(case.items), **_on_error(case, failures.append), **kw)
            except WorkerError as exc:
                return Outcome(raised=(_raised(exc),)), exc, []
            stats = runner.stats()
        if out is not None:
            value = read_back(out, value)
    finally:
        if out is not None:
            shutil.rmtree(out.parent)
    got = tuple((f.index, f.item, f.stage) for f in failures)
    return Outcome(value, got), None, stats


# -- comparing ---------------------------------------------------------------------------------
def _sorted(values: Any) -> Any:
    return sorted(values, key=repr)


def check(case: Case, engine: str) -> None:
    """Run ``case`` on ``engine`` and compare every observable with the reference."""
    want = reference(case)
    got, error, stats = run_case(case, engine)
    check_outcome(case, engine, want, got, error)
    if error is None and not any(s.transient for s in _stages(case)):
        # (a unit that failed in an earlier pool is passed on, not run: not done there)
        assert tuple(s.done for s in stats) == want.done, (stats, want.done)


def _stages(case: Case) -> list[StageSpec]:
    return [s for pool in case.pools for s in pool.stages]


def check_outcome(
    case: Case, engine: str, want: Outcome, got: Outcome, error: BaseException | None
) -> None:
    if want.raised:
        assert error is not None, f"expected one of {want.raised}, got {got}"
        (raised,) = got.raised
        expected = {(r.cls, r.index, r.stage) for r in want.raised}
        assert (raised.cls, raised.index, raised.stage) in expected, (raised, want.raised)
        pool = next(
            r.pool for r in want.raised if (r.index, r.stage) == (raised.index, raised.stage)
        )
        if pool is not None:  # the worker named is one of that pool's
            n = 1 if engine == "inline" else case.pools[pool].workers or case.devices
            assert 0 <= error.worker < n, (error.worker, n)  # type: ignore[attr-defined]
        return
    assert error is None, f"expected {want}, got {error!r}"
    if case.ordered:
        assert got.value == want.value
        assert got.failures == want.failures
    else:
        value = want.value if isinstance(want.value, int) else _sorted(want.value)
        assert (got.value if isinstance(got.value, int) else _sorted(got.value)) == value
        assert _sorted(got.failures) == _sorted(want.failures)


# -- interrupted and resumed -------------------------------------------------------------------
def check_resumed(case: Case, first: str, then: str, tmp: Path) -> None:
    """Take ``case.interrupt_after`` results on ``first`` and stop; run the same call with the
    same ledger on ``then``: the outcome is the reference's, and nothing delivered before the
    stop is computed again."""
    calls = tmp / f"calls-{uuid.uuid4().hex}"
    calls.mkdir()
    _run_number(calls).write_text("1")
    db = tmp / f"{uuid.uuid4().hex}.db"
    out = tmp / f"out-{uuid.uuid4().hex}" if case.sink else None
    pipeline = build(case, calls, out)
    taken: list[Any] = []
    it = pipeline.imap(
        list(case.items), resume=db, **_on_error(case, lambda f: None), **run_options(case, first)
    )
    try:
        for value in it:
            if len(taken) >= (case.interrupt_after or 0):
                break
            taken.append(value)
    except WorkerError:
        pass
    finally:
        it.close()
    before = {p.name for p in calls.iterdir()}
    _attempts().clear()  # a new run: transient faults strike again (inline: here)
    _run_number(calls).write_text("2")  # (in workers that ran the first run)
    want = reference(case)
    failures: list[Any] = []
    error = None
    try:
        value = pipeline.map(
            list(case.items),
            resume=db,
            **_on_error(case, failures.append),
            **run_options(case, then),
        )
        if out is not None:  # every file of the job, those of the first run included
            value = read_back(out, value)
        got = Outcome(value, tuple((f.index, f.item, f.stage) for f in failures))
    except WorkerError as exc:
        error, got = exc, Outcome(raised=(_raised(exc),))
    check_outcome(case, then, want, got, error)
    if case.ordered and not want.raised and not case.sink:
        # the first len(taken) output units were delivered, so recorded: not run again
        align, first_batch = case.align, case.pools[0].batch_size or 1
        delivered = set()
        for o in range(len(taken) + len([f for f in want.failures if f[0] < len(taken)])):
            for u in range(o * align, (o + 1) * align):
                delivered.update(case.items[u * first_batch : (u + 1) * first_batch])
        again = [(calls / name).read_text() for name in {p.name for p in calls.iterdir()} - before]
        recomputed = {v for text in again for v in _ints(text)} & delivered
        assert not recomputed, f"computed again after resume: {sorted(recomputed)}"


def _ints(text: str) -> list[int]:
    value = eval(text)  # a repr written by make_stage: an int or a list of ints
    return value if isinstance(value, list) else [value]
