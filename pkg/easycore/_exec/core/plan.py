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
from easycore._devices import INLINE, cpu_count, parse_devices
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
        workers: its workers now (a self-sizing pool's change as the run goes; its
            ``devices`` are then those of its workers now).
        resizes: a self-sizing pool's changes in this run (``easycore.Resize``: when, from,
            to, why), oldest first.
    """

    name: str
    devices: tuple[str, ...]
    done: int = 0
    busy: float = 0.0
    queued: int = 0
    waiting: int = 0
    in_flight: int = 0
    concurrency: int = 1
    workers: int = -1
    resizes: tuple[Any, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.workers < 0:
            self.workers = len(self.devices)

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
    # a pool that sizes itself: (lo, hi) workers, ``devices`` its hi places (``.on((lo, hi))``)
    bounds: tuple[int, int] | None = None
    # its workers at the start (a fixed pool's: all; a self-sizing one's: see first_split)
    size: int = attrs.Factory(lambda hop: len(hop.devices), takes_self=True)

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
    budget: int = 0  # workers the self-sizing pools may hold together (``cpus=``, less the rest)

    @property
    def sizing(self) -> bool:
        """Whether a pool sizes itself."""
        return any(h.bounds is not None for h in self.hops)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for h in self.hops for d in h.devices)

    @property
    def peak(self) -> tuple[str, ...]:
        """The devices of the most workers alive at once: every fixed pool's, and as many
        CPUs as the self-sizing pools may hold together."""
        fixed = tuple(d for h in self.hops if h.bounds is None for d in h.devices)
        return fixed + ("cpu",) * min(self.budget, len(self.devices) - len(fixed))

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
        StageStats(
            h.name,
            ("cpu",) * h.size if h.bounds else h.devices,
            concurrency=h.concurrency if concurrent else 1,
        )
        for h in chain.hops
    ]


def plan_chain(
    pipeline: PipelineDef,
    devices: Any,
    parse: Callable[[Any], list[str]] = parse_devices,
    concurrency: int = 1,
    cpus: int | None = None,
) -> Chain:
    """Cut the producers into hops and give each its devices (raises ValueError early).

    ``parse`` turns a ``devices`` argument into device strings (an engine's own meaning);
    ``concurrency`` is the run's, for the pool of ``devices`` (an ``.on`` pool has its own);
    ``cpus`` the budget of the pools that size themselves (None: this machine's cores).

    Raises:
        ValueError: a device that cannot be; ``devices`` given (other than ``"auto"``, or
            ``"inline"``), or ``concurrency`` other than 1, where every pool has its own
            ``.on(...)``: it would describe none;
            self-sizing pools whose lower bounds do not fit in ``cpus``.
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
    if all(binding is not None for _, binding in groups) and concurrency != 1 and not inline:
        msg = (
            f"concurrency={concurrency} describes no pool: every pool of this pipeline has "
            f"its own .on(...); give it there (.on(n, concurrency={concurrency})) to the pool "
            "that waits"
        )
        raise ValueError(msg)
    hops: list[Hop] = []
    slot, unit = 0, 1
    for i, (stages, binding) in enumerate(groups):
        bounds = None if inline or binding is None else binding.bounds
        if inline or binding is None:  # (inline: an .on pool's devices are not parsed)
            devs = (INLINE,) if inline else run_devices()
        else:
            devs = ("cpu",) * bounds[1] if bounds else tuple(parse(binding.devices))
        batch = binding.batch_size if binding is not None and i > 0 else None
        unit *= batch or 1
        k = concurrency if binding is None else binding.concurrency
        hops.append(Hop(i, tuple(stages), devs, batch, unit, slot, concurrency=k, bounds=bounds))
        slot += len(devs)
    budget = first_split(hops, cpu_count() if cpus is None else cpus)
    if sink is not None:  # the last pool's workers write: the sink runs after its stages
        last = hops[-1]
        last.stages = (*last.stages, attrs.evolve(sink, align=last.unit))
    return Chain(tuple(hops), budget)


def first_split(hops: list[Hop], cpus: int) -> int:
    """Give each self-sizing pool its first size (each ``hop.size``): its ``lo``, then one
    worker more at a time, in turn, up to its ``hi``, while ``cpus`` has room after the
    fixed pools' workers; returns what they may hold together (0 without one).

    Raises:
        ValueError: their lower bounds do not fit (naming them and the numbers).
    """
    sizing = [h for h in hops if h.bounds is not None]
    if not sizing:
        return 0
    fixed = sum(len(h.devices) for h in hops if h.bounds is None)
    budget = cpus - fixed
    lows = sum(h.bounds[0] for h in sizing if h.bounds)
    if lows > budget:
        names = ", ".join(f"{h.name!r} at least {h.bounds[0]}" for h in sizing if h.bounds)
        msg = (
            f"the pools that size themselves need {lows} CPU workers at least ({names}), but "
            f"cpus={cpus} leaves {max(budget, 0)} after the {fixed} worker(s) of fixed pools; "
            "lower their bounds or give a larger cpus="
        )
        raise ValueError(msg)
    for h in sizing:
        h.size = h.bounds[0] if h.bounds else 0
    left = budget - lows
    while left > 0:
        room = [h for h in sizing if h.bounds and h.size < h.bounds[1]]
        for h in room[:left]:
            h.size += 1
        left -= min(left, len(room))
        if not room:
            break
    return budget


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
