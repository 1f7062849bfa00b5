"""``pipeline.map(..., distributed=True)``: every rank of a torchrun/Slurm job runs a share.

::

    every rank iterates the same data ──> units: items, or batches of batch_size (global)
      unit i goes to rank i % world_size, numbered i there (its seed: derive_seed(seed, i))
    rank r: a Runner over its units on its own devices         (the ordinary executor)
      ├─ ok    -> ("ok", results)         ┐  gather to rank 0: rank 0 merges, folds once
      └─ error -> ("error", description)  ┘  (a consumer), broadcasts ("ok", result) or error
    every rank returns the same value, or every rank raises WorkerError naming the rank

A failing rank still takes part in the exchange, with a description of its error instead of
results, so no rank is left waiting in a collective. Because the rank's run numbers its
units as units of the whole input (``Numbering``), its seeds and error messages are those of
a single-process run.
"""

from __future__ import annotations

import itertools
import traceback
from collections.abc import Iterable, Iterator
from typing import Any

import attrs
import cloudpickle

from easycore import distributed
from easycore._errors import WorkerDied, WorkerError
from easycore._exec.core.protocol import pack_exception, unpack_exception
from easycore._exec.core.sources import batched, items_of
from easycore._exec.runner import Runner, count_units
from easycore._options import Numbering, RunOptions

__all__ = ["sharded_map"]


class _Sized:
    """An iterable with a known length, so the main rank's progress bar shows a total."""

    def __init__(self, it: Iterable[Any], n: int) -> None:
        self._it = it
        self._n = n

    def __iter__(self) -> Iterator[Any]:
        return iter(self._it)

    def __len__(self) -> int:
        return self._n


_WHERE = ("stage", "device", "worker", "index")  # where a failure was, as WorkerError takes it


def _describe(exc: BaseException, me: int) -> dict[str, Any]:
    """A picklable account of a rank's failure, enough to raise it again on another rank."""
    cause = exc.__cause__ if isinstance(exc, WorkerError) and exc.__cause__ else exc
    text = str(exc) if isinstance(exc, WorkerError) else f"{type(exc).__name__}: {exc}"
    tb = getattr(exc, "remote_traceback", None) or "".join(traceback.format_exception(cause))
    return {
        "rank": me,
        "message": text,
        "traceback": tb,
        "cause": pack_exception(cause),
        **{name: getattr(exc, name, None) for name in _WHERE},
    }


def _raise_failure(
    failures: list[dict[str, Any]], me: int, world: int, own: BaseException | None
) -> None:
    """Raise the same ``WorkerError`` on every rank; a failing rank reports its own error."""
    info = next((f for f in failures if f["rank"] == me), failures[0])  # ours, if we failed
    msg = f"rank {info['rank']} of {world} failed: {info['message']}"
    others = [str(f["rank"]) for f in failures if f is not info]
    if others:
        msg += f"\n(rank{'s' if len(others) > 1 else ''} {', '.join(others)} failed too)"
    if info["rank"] == me and own is not None:
        cause = own.__cause__ if isinstance(own, WorkerError) and own.__cause__ else own
    else:
        blob, tname, text = info["cause"]
        cause = unpack_exception(blob, tname, text, info["traceback"])
    raise WorkerError(msg, *[info[name] for name in (*_WHERE, "traceback")]) from cause


def _exchange(collective: Any, what: str, me: int, *args: Any) -> Any:
    try:
        return collective(*args)
    except RuntimeError as exc:
        msg = (
            f"rank {me}: the collective exchanging {what} failed, most likely because another "
            f"rank died or stopped answering within the process group's timeout: {exc}"
        )
        raise WorkerDied(msg) from exc


def sharded_map(
    pipeline: Any, data: Iterable[Any], options: RunOptions, devices: Any, engine: str, **where: Any
) -> Any:
    """Share the units of ``pipeline`` (an ``easycore.Pipeline``) out between ranks, run
    each share, merge in order, fold once (``where``: the rest of :class:`Runner`'s keyword
    arguments, ``cfg`` among them)."""
    # Refused before anything starts: what a distributed map does not do (yet).
    if engine != "local":
        msg = f"distributed=True runs under torchrun on the local engine, not engine={engine!r}"
        raise ValueError(msg)
    if options.skip or options.resume is not None:
        msg = "errors='skip' and resume= are not supported with distributed=True yet"
        raise ValueError(msg)
    if getattr(pipeline, "sink", None) is not None:
        msg = "a sink (easycore.write) is not supported with distributed=True yet"
        raise ValueError(msg)
    if any(binding is not None for _, binding in pipeline.pools):
        msg = (
            "distributed=True runs each rank's share on one pool; a pipeline with "
            ".on pools is not supported there yet (drop .on, or run it per rank)"
        )
        raise ValueError(msg)
    distributed.init()
    me, world = distributed.rank(), distributed.world_size()
    size = options.batch_size
    own: BaseException | None = None
    try:
        data = items_of(data)  # a map-style dataset: by index, as DataLoader reads it
        units: Iterable[Any] = batched(data, size) if size else data
        share: Iterable[Any] = itertools.islice(units, me, None, world)
        if (count := count_units(data, size)) is not None:
            share = _Sized(share, len(range(me, count, world)))
        # The caller's options, but for what a rank does differently: units already
        # batched here, kept in order (the shares interleave back), numbered globally.
        mine = attrs.evolve(
            options,
            ordered=True,
            batch_size=None,
            progress=options.progress and me == 0,
            numbering=Numbering(me, world, size),
        )
        if isinstance(devices, str) and devices == "local":
            devices = distributed.local_devices()
        with Runner(attrs.evolve(pipeline, consumer=None), devices, **where, _wait=False) as run:
            local = run.run_map(share, mine)
        status = cloudpickle.dumps(("ok", local))
    except Exception as exc:
        own = exc
        status = cloudpickle.dumps(("error", _describe(exc, me)))

    gathered = _exchange(distributed.gather, "results", me, status, 0)
    verdict: bytes | None = None
    if gathered is not None:  # rank 0: merge, fold once, then tell everyone
        unpacked = [cloudpickle.loads(b) for b in gathered]
        failures = [v for tag, v in unpacked if tag != "ok"]
        if failures:
            verdict = cloudpickle.dumps(("error", failures))
        else:
            try:
                # undo the round robin: unit i is element i // world of rank i % world's share
                result: Any = [None] * sum(len(share) for _, share in unpacked)
                for rank, (_, share) in enumerate(unpacked):
                    result[rank::world] = share
                if pipeline.consumer is not None:
                    fold_only = attrs.evolve(pipeline, producers=(), placement=())
                    with Runner(fold_only, "inline", cfg=where["cfg"]) as run:
                        result = run.run_map(result, RunOptions(numbering=Numbering(batch=size)))
                verdict = cloudpickle.dumps(("ok", result))
            except Exception as exc:
                own = exc
                verdict = cloudpickle.dumps(("error", [_describe(exc, me)]))
    tag, value = cloudpickle.loads(_exchange(distributed.broadcast, "the result", me, verdict, 0))
    if tag == "error":
        _raise_failure(value, me, world, own)
    return value
