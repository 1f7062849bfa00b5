"""The caller's side of a sink: commit the files the workers wrote, as their units arrive.

A worker of the last pool writes a chunk's rows under temporary ``.``-names and replies
with counts and the shards' names only (``easycore._sinks``). Here, in the calling process,
each shard is committed (renamed to its final name) when the segment holding its units is
delivered: after the run ledger recorded the units and the shard in one transaction, with
``resume=`` (``RunLedger.record`` runs before this). Whatever is left under a temporary
name when the run ends (a dead worker's file, a reply that was dropped) is removed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from easycore._sinks import (
    Shard,
    Sink,
    Written,
    Wrote,
    check_fresh,
    commit_shard,
    recover,
    sweep,
)

__all__ = ["commit_written", "prepare", "sink_of", "total_written"]


def sink_of(stages: Sequence[Any]) -> Sink | None:
    """The sink a pool's stages end in (``easycore.write``), or None."""
    return stages[-1] if stages and isinstance(stages[-1], Sink) else None


def prepare(sink: Sink, known: Sequence[Shard], ledger: Any = None) -> None:
    """Before a run writes: finish the commits a crash cut short (``known``: the shards the
    ledger recorded), remove temporary files, and refuse a directory holding another run's
    files (a sink never replaces them). On an error, ``ledger`` is closed.

    Raises:
        ValueError: the directory holds files of another run.
    """
    try:
        recover(sink, known)
        check_fresh(sink, known)
    except BaseException:
        if ledger is not None:
            ledger.close()
        raise


def commit_written(stream: Iterator[Any], sink: Sink) -> Iterator[Written]:
    """Commit each shard in ``stream``'s segments; yield one :class:`Written` per file.

    The temporary files left behind are removed when the stream ends, fails, or is closed
    (after it: a closed stream has waited for what was in flight).
    """
    try:
        for _, values in stream:
            for value in values:
                if type(value) is Wrote and value.shards:
                    for shard in value.shards:
                        path = commit_shard(sink, shard)
                        yield Written((path,), shard.rows, shard.nbytes)
    finally:
        try:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        finally:
            sweep(sink)


def total_written(parts: Iterable[Written]) -> Written:
    """The files, rows and bytes of ``parts`` together (files sorted)."""
    files: list[str] = []
    rows = nbytes = 0
    for part in parts:
        files.extend(part.files)
        rows += part.rows
        nbytes += part.bytes
    return Written(tuple(sorted(files)), rows, nbytes)
