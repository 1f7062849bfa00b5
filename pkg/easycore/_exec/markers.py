"""A chunk's units through one hop on a Ray actor or inline (a worker process runs them with
``PreparedStages.run_chunk``, which keeps its hot path and the slot the caller reads): a
unit that fails travels on as a :class:`~easycore._protocol.Broken` marker in its result's
place, which later hops pass on, and the caller settles at the end
(``core.RunBooks.outputs``), as on worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from easycore._protocol import Broken, settled
from easycore._stages import PreparedStages, StageFailure

__all__ = ["broken", "run_units", "write_units"]


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
    (None: none). ``timeout``: fails an async unit past it (a plain one is a watchdog's).

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
