"""What a run delivers, engine-neutral: its results in :class:`Segment` values, a failed
output unit as a :class:`Failed` in its place (under the ``skip`` policy), and
:func:`without`, which takes values out of a segment. The runner's wrappers (``resume=``,
``errors="skip"``, an imap's position, ``submit``) read these and nothing else of a run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import attrs

__all__ = ["Failed", "Segment", "without"]


@attrs.define(eq=False)
class Failed:
    """An output unit that failed, delivered in place of its result when the policy keeps
    the run going: the error ``raise`` would have raised, its first-hop item(s) and its
    stage.

    When several units of one output unit fail (a batching pool's batch), the output unit's
    failure is the one at the earliest hop, the first in input order among those: every
    engine reports that one (a chunk holds whole output units, so the process engine learns
    of the earliest hop's failures first, together; where a chunk does not stop between
    hops, ``protocol.settled`` picks it).
    """

    exc: BaseException
    item: Any = None
    stage: str = ""


class Segment(NamedTuple):
    """Results of consecutive output units; the first begins at first-hop unit ``start``."""

    start: int
    values: list[Any]


def without(
    start: int,
    values: list[Any],
    align: int,
    out: Callable[[Any], bool],
    left: Callable[[int, Any], None] | None = None,
) -> Iterator[Segment]:
    """Segment ``(start, values)`` as the runs of its values that are not ``out``;
    ``left(unit, value)`` is told of each value taken out (``unit``: its output unit), after
    the run before it is yielded."""
    kept: list[Any] = []
    at = start
    for k, value in enumerate(values):
        if not out(value):
            kept.append(value)
            continue
        if kept:
            yield Segment(at, kept)
            kept = []
        at = start + (k + 1) * align
        if left is not None:
            left(start // align + k, value)
    if kept:
        yield Segment(at, kept)
