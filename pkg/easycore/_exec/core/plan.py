"""A pipeline cut into hops: pools of workers, each running a run of fused producers.

``a >> b`` on ``map``'s devices is one hop; ``a.on(2) >> b.on(1, batch_size=8)`` is a chain of
two. Everything downstream (workers, the chunk ledger, the run loop) treats one pool as a
chain of one hop: there is no separate single-pool path.
"""

from __future__ import annotations

import functools
import io
import linecache
import os
import types
from collections import ChainMap
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
import cloudpickle

from easycore._config.cfgnode import CfgNode
from easycore._devices import INLINE, parse_devices
from easycore._errors import item_label
from easycore._exec.core.protocol import PROTOCOL
from easycore._exec.core.stages import StageDef, code_in
from easycore._options import RunOptions

__all__ = [
    "Chain",
    "Hop",
    "PipelineDef",
    "StageStats",
    "frozen_cfg",
    "idle_stats",
    "pack_payload",
    "plan_chain",
]


class PipelineDef(Protocol):
    """What running needs of a pipeline (``easycore.Pipeline`` is one)."""

    @property
    def producers(self) -> tuple[Any, ...]: ...
    @property
    def consumer(self) -> Any: ...
    @property
    def pools(self) -> tuple[tuple[tuple[Any, ...], Any], ...]: ...


@attrs.define
class StageStats:
    """What one pool of a runner did in the run under way (or the last run).

    Items are counted as the pool takes them: batches, for a pool with ``batch_size``.
    An item sent to the pool's workers is first ``queued``, then ``in_flight``, then
    ``done``; ``queued + in_flight`` is what its workers hold and have not finished.

    Attributes:
        name: the pool's name: its stages' names joined by ``" >> "``.
        devices: the pool's devices, one per worker.
        concurrency: items each of its workers runs at once (``concurrency=k``; 1 inline,
            where ``concurrency`` does not apply).
        done: items it finished.
        busy: the fraction of its slots' time (``slots`` times the run's wall time so far)
            spent running items since the run started. An item holds a slot from its start
            to its end, its waits (an ``await``, a blocking call on a thread) included; a
            worker's time on a chunk outside its items (unpickling, writing) holds one slot.
            With ``concurrency=1`` it is the fraction of its workers' time spent computing.
        in_flight: items its workers are running at this moment (started and not finished;
            at most ``slots``). Read from the workers as the run goes, without a message;
            on ``engine="ray"`` the driver cannot ask an actor mid-chunk, so it counts the
            items of the chunk each actor is on, up to its concurrency.
        queued: items sent to its workers that are not done and not in flight: waiting in
            a worker to start, or finished within a chunk the worker is still on.
        waiting: items it finished that wait for room in the next pool (a pool with many
            waiting items feeds a bottleneck).
    """

    name: str
    devices: tuple[str, ...]
    done: int = 0
    busy: float = 0.0
    queued: int = 0
    waiting: int = 0
    in_flight: int = 0
    concurrency: int = 1

    @property
    def slots(self) -> int:
        """Items the pool can run at once: its workers times ``concurrency``."""
        return len(self.devices) * self.concurrency


def _code_reduce(code: types.CodeType) -> tuple[Any, ...]:
    """cloudpickle's reduction of a code object, keeping the file it was defined in."""
    make, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    where = code.co_filename
    lines = [] if os.path.exists(where) else linecache.getlines(where)
    return code_in, (make, args, where, lines)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, but a function sent by value keeps its file name (see ``code_in``)."""

    dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


def pack_payload(stages: tuple[StageDef, ...], cfg: Any) -> bytes:
    """A hop's producers and ``cfg``, pickled once for its workers: functions defined in the
    user's script or notebook travel by value and keep their file and line for tracebacks.

    Raises:
        Exception: what pickling them raised.
    """
    out = io.BytesIO()
    _Pickler(out, protocol=PROTOCOL).dump((stages, cfg))
    return out.getvalue()


@attrs.define(eq=False)
class Hop:
    """One pool of a chain: its fused producers and one worker per device."""

    index: int
    stages: tuple[StageDef, ...]
    devices: tuple[str, ...]
    batch: int | None  # groups the previous hop's results into one unit (hops after the first)
    unit: int  # first-hop items per unit of this hop
    first_slot: int = 0  # global slot of its first worker
    payload: bytes = b""  # (stages, cfg) cloudpickled, once per activation
    concurrency: int = 1  # units each of its workers holds at once

    @property
    def name(self) -> str:
        return " >> ".join(s.name for s in self.stages)

    def units(self, items: int) -> int:
        """This hop's units in ``items`` consecutive first-hop units (a chunk's)."""
        return -(-items // self.unit)


@attrs.define(eq=False)
class Chain:
    """The hops of a pipeline, in order; chunks travel them first to last."""

    hops: tuple[Hop, ...]

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for h in self.hops for d in h.devices)

    @property
    def last(self) -> Hop:
        return self.hops[-1]

    @property
    def align(self) -> int:
        """First-hop items per unit of the last hop: chunks hold whole units of every hop."""
        return self.hops[-1].unit

    @property
    def named(self) -> bool:
        """Messages name the stage of a unit when there is more than one hop."""
        return len(self.hops) > 1

    def name_output(
        self, unit: int, options: RunOptions, total: int | None = None
    ) -> tuple[str, int]:
        """Output unit ``unit`` as the consumer's errors name it: (label, index); ``total``,
        the input's length when known, names the items of its last batch exactly."""
        size = None
        if total is not None and options.batch_size is not None and self.last.index == 0:
            size = min(options.batch_size, total - unit * options.batch_size)
        elif total is not None and self.last.index > 0:
            units = total if options.batch_size is None else -(-total // options.batch_size)
            first, per = unit * self.last.unit, self.hops[-2].unit
            size = -(-(min(first + self.last.unit, units) - first) // per)
        if self.last.index == 0:
            return options.label(unit, size), options.global_index(unit)
        return item_label(unit, self.last.batch, size), unit

    def who(self, hop: int, index: int) -> str:
        """Name a worker in messages: ``"worker 1"``, with its stage when there are hops."""
        text = f"worker {index}"
        if self.named:
            text += f" of stage {self.hops[hop].name!r}"
        return text


def idle_stats(chain: Chain, concurrent: bool = True) -> list[StageStats]:
    """Per hop, stats before any run (``concurrent``: False where units run one at a time)."""
    return [
        StageStats(h.name, h.devices, concurrency=h.concurrency if concurrent else 1)
        for h in chain.hops
    ]


def plan_chain(
    pipeline: PipelineDef,
    devices: Any,
    parse: Callable[[Any], list[str]] = parse_devices,
    concurrency: int = 1,
) -> Chain:
    """Cut the producers into hops and give each its devices (raises ValueError early).

    ``parse`` turns a ``devices`` argument into device strings (an engine's own meaning);
    ``concurrency`` is the run's, for the pool of ``devices`` (an ``.on`` pool has its own).

    Raises:
        ValueError: a device that cannot be; ``devices`` given (other than ``"auto"``, or
            ``"inline"``) where every pool has its own ``.on(...)``: it would describe none.
    """
    run_devices = functools.cache(lambda: tuple(parse(devices)))  # (once, where it is needed)
    sink = getattr(pipeline, "sink", None)
    groups = pipeline.pools
    if not groups:
        return Chain((Hop(0, () if sink is None else (sink,), run_devices(), None, 1),))
    named = devices if isinstance(devices, str) else None
    inline = named == INLINE
    if all(binding is not None for _, binding in groups) and named not in (INLINE, "auto"):
        pools = ", ".join(repr(" >> ".join(s.name for s in stages)) for stages, _ in groups)
        msg = (
            f"devices={devices!r} describes no pool: every pool of this pipeline ({pools}) "
            "has its own .on(...) devices; leave devices out, or remove .on from the pool "
            "it should describe"
        )
        raise ValueError(msg)
    hops: list[Hop] = []
    slot, unit = 0, 1
    for i, (stages, binding) in enumerate(groups):
        if inline or binding is None:  # (inline: an .on pool's devices are not parsed)
            devs = (INLINE,) if inline else run_devices()
        else:
            devs = tuple(parse(binding.devices))
        batch = binding.batch_size if binding is not None and i > 0 else None
        unit *= batch or 1
        k = concurrency if binding is None else binding.concurrency
        hops.append(Hop(i, tuple(stages), devs, batch, unit, slot, concurrency=k))
        slot += len(devs)
    if sink is not None:  # the last pool's workers write: the sink runs after its stages
        last = hops[-1]
        last.stages = (*last.stages, attrs.evolve(sink, align=last.unit))
    return Chain(tuple(hops))


def frozen_cfg(cfg: Mapping[str, Any] | None) -> CfgNode:
    """The run's ``cfg`` as workers see it: a frozen ``CfgNode`` (empty when None)."""
    cfg = {} if cfg is None else cfg
    if not isinstance(cfg, Mapping):
        msg = f"cfg must be a mapping or CfgNode, got {type(cfg).__name__}"
        raise TypeError(msg)
    return CfgNode(dict(cfg), frozen=True)


def first_batch(pipeline: PipelineDef, batch_size: int | None) -> int | None:
    """``map``'s batch_size, or the first pool's ``.on(batch_size=...)``.

    Raises:
        ValueError: both are given and differ.
    """
    groups = pipeline.pools
    bound = groups[0][1] if groups else None
    if bound is None or bound.batch_size is None:
        return batch_size
    if batch_size is not None and batch_size != bound.batch_size:
        msg = (
            f"batch_size={batch_size} conflicts with the first pool's "
            f".on(batch_size={bound.batch_size}); give it once"
        )
        raise ValueError(msg)
    return int(bound.batch_size)
