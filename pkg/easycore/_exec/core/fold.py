"""The consumer: a fold over the results, run in the calling process as they arrive."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

from easycore._config.cfgnode import CfgNode
from easycore._exec.core.plan import Chain
from easycore._exec.core.stages import StageFailure
from easycore._inject import call_with, injected
from easycore._options import RunOptions

__all__ = ["collect", "fold"]

Segments = Iterator[tuple[int, list[Any]]]


def collect(stream: Segments) -> list[Any]:
    """Without a consumer: every result, in the stream's order, in one list."""
    out: list[Any] = []
    for _, values in stream:
        out += values  # (a list's items at once, not one at a time through an iterator)
    return out


def fold(
    stream: Segments,
    consumer: Any,
    cfg: CfgNode,
    options: RunOptions,
    chain: Chain,
    abort: Callable[[], None],
    total: int | None = None,
) -> Any:
    """Fold ``stream`` with ``consumer`` (``init``, the fold, ``end``) and return the result
    (``total``: the input's length when known, to name the items of a failing last batch).

    A failure of the consumer closes the runner (``abort``) before its error is raised.

    Raises:
        WorkerError: the consumer's ``init``, fold or ``end`` raised (``device`` None: it
            ran in the calling process).
    """
    context = {"cfg": cfg}
    if callable(consumer.init):  # (init() or init(cfg) makes the first accumulator)
        try:
            acc = call_with(consumer.init, consumer.init_names, context)
        except Exception as exc:
            failed = StageFailure(f"{consumer.name} (init)", exc)
            raise failed.to_error("while starting", None, device=None) from exc
    else:
        acc = copy.deepcopy(consumer.init)
    fn = consumer.fn
    kw = injected(consumer.fn_names, context)
    if kw:
        fn = functools.partial(fn, **kw)
    try:
        for start, values in stream:
            folded = iter(values)
            try:
                for y in folded:
                    new = fn(acc, y)
                    if new is not None:
                        acc = new
            except Exception as exc:
                # `folded` stopped just after the failing result: what is left names it
                unit = start // chain.align + len(values) - 1 - sum(1 for _ in folded)
                abort()
                stream.close()  # type: ignore[attr-defined]
                label, index = chain.name_output(unit, options, total)
                failed = StageFailure(consumer.name, exc)
                raise failed.to_error(f"while folding {label}", index, device=None) from exc
    except Exception:
        raise  # the run's own error (the runner is closed), the input's, or the fold's
    except BaseException:
        abort()
        stream.close()  # type: ignore[attr-defined]
        raise
    if consumer.end is None:
        return acc
    try:
        return call_with(consumer.end, consumer.end_names, context, acc)
    except Exception as exc:
        failed = StageFailure(f"{consumer.name} (end)", exc)
        raise failed.to_error("while finishing", None, device=None) from exc
