"""The reference interpreter: contract sections 1-3 and 8 as plain sequential Python.

A case (:class:`Case`) is a pipeline of simple integer stages cut into pools, an input, and
run options. :func:`reference` computes what every engine must return for it, one unit at a
time, with no process, no chunk and no retry machinery:

* the stream is the input, or ``map``'s batches (the first pool's ``batch_size``); pool ``h``
  runs its fused stages over each of its units; a later pool with ``batch_size=k`` takes the
  previous pool's results ``k`` at a time (the last group may be shorter);
* with ``seed``, before each attempt at unit ``i`` of pool ``h`` the random state is
  ``seed_everything(derive_seed(seed, i, h))`` (in a pool whose worker holds several units
  at once, the stages draw from the unit's own ``random.Random(easycore.item_seed())``,
  made at the attempt's first stage: the same numbers);
* a stage that raises is retried, with the whole pool's stages, up to ``retries`` times;
* a unit that still fails fails the output unit (last pool's unit) that contains it: with
  ``errors="raise"`` the run raises a ``WorkerError`` naming a failing pool's unit index
  and stage: with ``ordered=True`` the first failed output unit's (its failure as ``"skip"``
  reports it), once the values before it are delivered (so a consumer that raises on one of
  those raises instead); unordered, any failing unit's (which one an engine meets first is
  its timing); with
  ``"skip"`` the output unit is left out and reported as a ``Failure(index=output unit,
  item=its first-pool unit(s), stage)``, where several of its units failed, the stage of
  the one that failed at the earliest pool (the first in input order among those);
* a sink (``write.jsonl`` or ``write.parquet``, in place of a consumer) writes a row per
  output value ``y``, :func:`sink_row` (a variable-length array, a column mostly None); its
  files, read back in the order of their names (Parquet: the directory as one dataset),
  hold those rows for what a ``map`` without it returns (in input order with
  ``ordered=True``; unordered, the same values);
* the consumer folds the output values in order (or, unordered, in any order: the suite's
  unordered consumers are order-free); a consumer that raises on the k-th value is a
  ``WorkerError`` naming output unit k's index.
"""

from __future__ import annotations

import random
from typing import Any

import attrs

from easycore import derive_seed

MODULUS = 7  # a stage's poison is "its input value modulo 7 equals p"


def sink_row(y: int) -> dict[str, Any]:
    """The row a sink writes for output value ``y``, as it reads back (the pipeline's last
    stage returns ``seq`` as a numpy array: its length varies from row to row)."""
    return {"y": y, "seq": [y + i for i in range(y % 4)], "note": None if y % 3 else f"n{y}"}


def value_of(x: Any) -> int:
    """A stage's input as one int: an int, or the sum of a batch."""
    return sum(x) if isinstance(x, list) else x


@attrs.frozen
class StageSpec:
    """``y = a * v + b (+ a random draw when seeded)``, where ``v`` is the input's value.

    ``poison``: raises ValueError when ``v % MODULUS == poison``; ``transient``: raises on
    the first attempt at each input (only ever on the first stage, whose inputs are
    distinct), so it passes when ``retries >= 1``. ``kept``: the stage has an ``init`` (state
    its workers keep; on Ray its pool runs on actors, else a one-shot run's on tasks), which
    changes nothing here.
    """

    name: str
    a: int
    b: int
    poison: int | None = None
    transient: bool = False
    seeded: bool = False
    kept: bool = False

    def apply(self, x: Any, first_attempt: bool, rng: Any = random) -> int:
        """The stage's result for input ``x``; ``rng``: where a seeded stage draws from (the
        global ``random``, seeded per unit; or the unit's own generator)."""
        v = value_of(x)
        if self.poison is not None and v % MODULUS == self.poison:
            msg = f"{self.name} refuses {v}"
            raise ValueError(msg)
        if self.transient and first_attempt:
            msg = f"{self.name}: a transient fault on {x!r}"
            raise ValueError(msg)
        y = self.a * v + self.b
        if self.seeded:
            y += rng.randrange(1000)
        return y


@attrs.frozen
class PoolSpec:
    """Fused stages; ``workers`` None: the run's ``devices`` (only the first pool).

    ``concurrency``: units each worker holds at once; ``asynchronous``: the stages are
    ``async def``; ``sizes``: the pool sizes itself, ``.on((1, workers))``, with sizes forced
    to change as the run goes (none of them changes what the pool computes).
    """

    stages: tuple[StageSpec, ...]
    workers: int | None
    batch_size: int | None = None
    concurrency: int = 1
    asynchronous: bool = False
    sizes: bool = False


@attrs.frozen
class ConsumerSpec:
    """``kind``: "sum" or "list"; ``fails_at``: raises on the k-th value folded (0-based)."""

    kind: str
    fails_at: int | None = None


@attrs.frozen
class Case:
    pools: tuple[PoolSpec, ...]
    items: tuple[int, ...]
    devices: int = 1
    ordered: bool = True
    seed: int | None = None
    errors: str = "raise"
    retries: int = 0
    consumer: ConsumerSpec | None = None
    sink: bool = False  # ends in a sink (the values, read back from its files)
    sink_kind: str = "jsonl"  # "jsonl" or "parquet"
    interrupt_after: int | None = None  # resume cases: results taken before the stop

    @property
    def align(self) -> int:
        """First-pool units per output unit."""
        n = 1
        for pool in self.pools[1:]:
            n *= pool.batch_size or 1
        return n


@attrs.frozen
class Raised:
    """The error a run raises: its type, and the unit and stage it names."""

    cls: type[BaseException]
    index: int | None
    stage: str | None
    pool: int | None  # the pool whose worker it names; None for the consumer


@attrs.frozen
class Outcome:
    """What a run returns (``value``) and reports (``failures``: (index, item, stage)),
    or the errors it may raise (any one of them, when several units fail)."""

    value: Any = None
    failures: tuple[tuple[int, Any, str], ...] = ()
    raised: tuple[Raised, ...] = ()
    done: tuple[int, ...] = ()  # units each pool ran, for stats()


@attrs.define
class _Unit:
    value: Any
    origin: list[Any]  # its first-pool units
    failure: tuple[int, str, int] | None = None  # (index at its pool, stage, pool)


def _batches(seq: list[Any], k: int) -> list[list[Any]]:
    return [seq[i : i + k] for i in range(0, len(seq), k)]


def run_pool(pool: PoolSpec, h: int, units: list[_Unit], case: Case) -> None:
    """Run pool ``h`` over its units in place (failed units pass through)."""
    for i, unit in enumerate(units):
        if unit.failure is not None:
            continue
        for attempt in range(case.retries + 1):
            if case.seed is not None:
                random.seed(derive_seed(case.seed, i, h))
            value = unit.value
            try:
                for stage in pool.stages:
                    value = stage.apply(value, first_attempt=attempt == 0)
            except ValueError:
                failed = stage.name
                continue
            unit.value = value
            break
        else:
            unit.failure = (i, failed, h)


def reference(case: Case) -> Outcome:
    """What every engine must give for ``case``."""
    first = case.pools[0].batch_size
    stream: list[Any] = list(case.items) if first is None else _batches(list(case.items), first)
    units = [_Unit(u, [u]) for u in stream]
    done = []
    every: list[tuple[int, str, int]] = []  # every unit's failure, at every pool
    for h, pool in enumerate(case.pools):
        if h > 0 and pool.batch_size is not None:
            units = [
                _Unit(
                    [u.value for u in group],
                    [o for u in group for o in u.origin],
                    min(
                        (u.failure for u in group if u.failure is not None),
                        key=lambda f: f[2],  # the earliest pool's, first in order among those
                        default=None,
                    ),
                )
                for group in _batches(units, pool.batch_size)
            ]
        done.append(sum(1 for u in units if u.failure is None))
        ok = [u for u in units if u.failure is None]
        run_pool(pool, h, units, case)
        every += [u.failure for u in ok if u.failure is not None]
    # with errors="raise", unordered: whichever failure an engine meets first is raised
    raised = tuple(Raised(ValueError, i, stage, pool) for i, stage, pool in every)
    spec = case.consumer
    if raised and case.errors == "raise":
        # delivery stops at the first failed output unit; a consumer failing on a value
        # before it raises first (unordered: it may, as the engine's timing goes)
        first_failed = next(o for o, u in enumerate(units) if u.failure is not None)
        fold = None
        if spec is not None and spec.fails_at is not None and spec.fails_at < first_failed:
            fold = Raised(RuntimeError, spec.fails_at, "fold", None)
        if case.ordered:
            failure = units[first_failed].failure
            assert failure is not None
            raised = (fold,) if fold else (Raised(ValueError, *failure),)
        elif fold:
            raised += (fold,)
        return Outcome(raised=raised)
    failures = tuple(
        (o, u.origin[0] if case.align == 1 else u.origin, u.failure[1])
        for o, u in enumerate(units)
        if u.failure is not None
    )
    values = [u.value for u in units if u.failure is None]
    indices = [o for o, u in enumerate(units) if u.failure is None]
    if spec is None:
        return Outcome(values, failures, done=tuple(done))
    if spec.fails_at is not None and spec.fails_at < len(values):
        return Outcome(raised=(Raised(RuntimeError, indices[spec.fails_at], "fold", None),))
    value = sum(values) if spec.kind == "sum" else values
    return Outcome(value, failures, done=tuple(done))
