"""``errors="skip"``: failures set aside, reported, and left out of the results.

Under the ``skip`` policy (``books.SKIP``) a run delivers a failed output unit as a
:class:`~easycore._exec.core.outcomes.Failed` in its place in the stream; :func:`set_aside` takes
those out (so neither the caller nor the consumer sees them), reports each as an
:class:`easycore.Failure` to ``on_error`` (in the calling process), or, without one, warns
once per run with the count and the first failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from easycore._errors import Failure, SkippedItemsWarning, warn
from easycore._exec.core.outcomes import Failed, without
from easycore._options import RunOptions

__all__ = ["SkippedItemsWarning", "set_aside"]


def set_aside(
    stream: Iterator[Any],
    options: RunOptions,
    align: int,
    passed: Callable[[int], Any] | None = None,
) -> Iterator[Any]:
    """Pass ``stream``'s segments on without their failed units, reporting each.

    ``passed(start)`` is told of each failed output unit (by its first first-hop unit) as
    the stream moves past it, so that an imap position counts it as behind the caller.
    """
    count = 0
    first: Failure | None = None

    def report(unit: int, value: Failed) -> None:
        nonlocal count, first
        if passed is not None:
            passed(unit * align)
        failure = Failure(options.global_index(unit), value.item, value.stage, value.exc)
        count += 1
        if options.on_error is not None:
            options.on_error(failure)
        elif first is None:
            first = failure

    try:
        yield next(stream)  # PRIMED
        for start, values in stream:
            yield from without(start, values, align, lambda v: type(v) is Failed, report)
    finally:
        if count and options.on_error is None:
            msg = (
                f"{count} item(s) failed and were left out of the results (errors='skip'); "
                f"the first: {first!r}. Pass on_error= to see every one."
            )
            warn(msg, SkippedItemsWarning)
