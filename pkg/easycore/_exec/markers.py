"""A chunk's units through one hop where the chunk does not stop between hops (a Ray actor
hands its results to the next hop's actor; ``"inline"`` runs every hop in turn): a unit that
fails travels on as a :class:`Broken` marker in its result's place, which later hops pass
on, and the driver settles at the end (``core.RunBooks.outputs``).

Worker processes need none of this: a chunk stops at the caller between hops, which takes
failed units out there (``run.Run``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from easycore._protocol import CACHED, ErrorReport, is_cached
from easycore._stages import PreparedStages, StageFailure

__all__ = ["Broken", "broken", "run_units", "settled", "write_units"]


class Broken(NamedTuple):
    """A unit that failed, in place of its result (later hops pass it on)."""

    hop: int
    unit: int  # the unit's index at that hop
    # an ErrorReport when it crossed processes (a Ray actor's); in the caller (inline) the
    # StageFailure itself, so that the raised error's cause is the live exception
    failure: ErrorReport | StageFailure
    where: str = ""  # the place it failed at (a Ray node and process), for messages


def settled(unit: Any) -> Any:
    """What a unit is instead of being run, or None: ``CACHED`` when the driver has its
    result (``resume=``), or the failure it carries: itself, or a batch's member that failed
    at the earliest hop (the first in input order among those), as on every engine
    (``outcomes.Failed``)."""
    if is_cached(unit):
        return CACHED
    if type(unit) is Broken:
        return unit
    if type(unit) is list:
        return min((v for v in unit if type(v) is Broken), key=lambda b: b.hop, default=None)
    return None


def broken(stages: PreparedStages, index: int, failed: StageFailure, where: str = "") -> Broken:
    """Unit ``index`` of ``stages``' hop failed: its marker (the failure as a report, except
    in the caller)."""
    return Broken(stages.hop, index, failed if stages.in_caller else failed.report(), where)


def _nothing(index: int | None) -> None:
    return None


def run_units(
    stages: PreparedStages,
    units: Sequence[Any],
    base: int,
    *,
    seed: int | None,
    retries: int,
    spent: Mapping[int, int],
    numbering: tuple[int, int],
    timeout: float | None = None,
    where: str = "",
    in_hand: Callable[[int | None], None] = _nothing,
) -> tuple[list[Any], int]:
    """Run unit ``base + k`` for each ``units[k]``, one at a time, each retried while it
    fails and ``retries`` minus what ``spent`` charged it remain. A settled unit
    (:func:`settled`) passes as it is; one that still fails becomes a :class:`Broken`
    (its failure a report, except in the caller). ``in_hand`` hears of the unit in hand
    (None: none). ``timeout``: cancels an async unit (a plain one is a watchdog's).

    Returns:
        The values, and how many units ran.
    """
    out: list[Any] = []
    n = 0
    for k, unit in enumerate(units):
        index = base + k
        done = settled(unit)
        if done is not None:
            out.append(done)
            continue
        in_hand(index)
        try:
            allowed = max(retries - spent.get(index, 0), 0)
            value, failed = stages.run_retrying(unit, index, seed, allowed, numbering, timeout)
        finally:
            in_hand(None)
        n += 1
        out.append(value if failed is None else broken(stages, index, failed, where))
    return out, n


def write_units(
    stages: PreparedStages,
    base: int,
    out: list[Any],
    units: Sequence[Any],
    keys: Sequence[Any] | None,
    where: str = "",
) -> None:
    """The last pool writes (a sink): files for ``out``'s values, which become small counts;
    a unit that could not be written becomes a :class:`Broken`."""
    if stages.sink is not None:
        for k, failed in stages.write(base, out, units, (), keys):
            out[k] = broken(stages, base + k, failed, where)
