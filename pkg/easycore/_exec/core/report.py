"""Where a run's time goes: what each pool did over time, the run's
:class:`Report` (a few sentences a person reads), and its Chrome Trace Event file.

The scheduler samples each pool as the run goes (workers, those with nothing to do, results
waiting for the next pool): :class:`Recorder` integrates them over time. The books add each
chunk as it comes back (a span on its worker) and the caller's wait in ``next()``. With
``trace=``, :class:`Trace` keeps the events (bounded: past ``MAX_EVENTS`` every other chunk
is dropped, and from then on one in two, four...) and writes them when a run ends.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

import attrs

from easycore._exec.core.plan import Chain

__all__ = ["MAX_EVENTS", "PoolReport", "Recorder", "Report", "Trace", "report"]

MAX_EVENTS = 100_000  # a trace keeps about this many events at most
COUNTER_EVERY = 0.05  # seconds between two samples of a pool's counters in the trace


class Trace:
    """The events of a runner's runs, for a Chrome Trace Event file at ``path`` (None: none
    are kept)."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []
        self.stride = 1  # chunks are kept one in `stride`
        self.seen = 0
        self.origin = time.monotonic()

    def __bool__(self) -> bool:
        return self.path is not None

    def us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 1)

    def add(self, event: dict[str, Any], sampled: bool = False) -> None:
        if self.path is None:
            return
        if sampled:
            self.seen += 1
            if self.seen % self.stride:
                return
        self.events.append(event)
        if len(self.events) >= MAX_EVENTS:  # every other event goes (the pools' names stay),
            names = [e for e in self.events if e["ph"] == "M"]  # and from now on one in two
            self.events = names + [e for e in self.events[::2] if e["ph"] != "M"]
            self.stride *= 2

    def name_pools(self, chain: Chain) -> None:
        """Each pool a process of the trace, named."""
        for h in chain.hops:
            args = {"name": f"pool {h.index}: {h.name}"}
            self.add({"name": "process_name", "ph": "M", "pid": h.index + 1, "args": args})

    def write(self) -> None:
        """Write the file (atomically: a reader never sees half of it)."""
        if self.path is None:
            return
        path = os.fspath(self.path)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": self.events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)


class Recorder:
    """What the pools of one run did over time, integrated from the scheduler's samples."""

    def __init__(self, chain: Chain, trace: Trace, sizes: Sequence[int], started: float) -> None:
        n = len(chain.hops)
        self.chain = chain
        self.trace = trace
        self.worker_s = [0.0] * n  # worker-seconds each pool had
        self.idle_s = [0.0] * n  # ...of them with nothing to do (waiting for input)
        self.held_s = [0.0] * n  # seconds each pool had results waiting for the next one
        self.now = (list(sizes), [0] * n, [0] * n)  # the last sample: workers, idle, held
        self.last = started
        self.last_counter = 0.0
        self.caller_s: float | None = None  # the caller's time waiting in next() (imap)
        self.control_s = 0.0  # the caller's time sampling and sizing the pools
        if trace:
            trace.name_pools(chain)

    def sample(
        self,
        now: float,
        workers: Sequence[int],
        idle: Sequence[int],
        held: Sequence[int],
        queued: Sequence[int] = (),
    ) -> None:
        """The pools at ``now``: their workers, those idle, results held for the next pool
        (and units queued at them, for the trace's counters)."""
        dt = max(0.0, now - self.last)
        for h, (w, i, held_) in enumerate(zip(*self.now, strict=True)):
            self.worker_s[h] += dt * w
            self.idle_s[h] += dt * i
            self.held_s[h] += dt * (held_ > 0)
        self.last = now
        self.now = (list(workers), list(idle), list(held))
        if self.trace and now - self.last_counter >= COUNTER_EVERY:
            self.last_counter = now
            for h in range(len(workers)):
                waiting = {"queued": queued[h] if queued else 0, "held": held[h]}
                self._event("workers", "C", now, h, args={"workers": workers[h]})
                self._event("items waiting", "C", now, h, args=waiting)

    def span(self, hop: int, worker: int, end: float, seconds: float, n: int) -> None:
        """A chunk of ``n`` units that worker ``worker`` of pool ``hop`` ran for ``seconds``,
        answered at ``end``."""
        if self.trace:
            dur = round(seconds * 1e6, 1)
            self._event(f"{n} item(s)", "X", end - seconds, hop, dur=dur, tid=worker)

    def resized(self, at: float, hop: int, before: int, after: int, why: str) -> None:
        if self.trace:
            args = {"from": before, "to": after, "why": why}
            self._event(f"resize {before} -> {after}: {why}", "i", at, hop, s="p", args=args)

    def _event(self, name: str, ph: str, t: float, hop: int, **fields: Any) -> None:
        event = {"name": name, "ph": ph, "ts": self.trace.us(t), "pid": hop + 1, **fields}
        self.trace.add(event, sampled=ph != "M")


@attrs.frozen
class PoolReport:
    """One pool in a :class:`Report`.

    Attributes:
        name: the pool's name (its stages', joined by ``" >> "``).
        workers: its workers (a self-sizing pool's: on average over the run so far).
        items_per_s: its units (items; batches for a pool with ``batch_size``) a second.
        busy: the share of its workers' time spent running items.
        waits_input: the share of its workers' time with nothing to do.
        waits_next: the share of the run's time its results waited for the next pool (0 on
            ``engine="ray"``, where a result goes to the next pool's actor by reference).
        sizes_itself: whether it is a pool made with ``.on((lo, hi))``.
    """

    name: str
    workers: int
    items_per_s: float
    busy: float
    waits_input: float
    waits_next: float
    sizes_itself: bool = False


@attrs.frozen
class Report:
    """Where a run's time went: ``runner.report()``, or ``it.report()`` of a one-shot
    ``imap``. ``str()`` of it is a few sentences.

    Attributes:
        pools: one :class:`PoolReport` per pool, in pipeline order.
        items_per_s: input items (batches, with ``batch_size``) the run finished a second.
        seconds: the run's time so far.
        limited_by: the name of the pool that limits the run, or ``"your loop"`` when the
            caller's own work does (its workers wait for it), None before any work.
        caller_wait: for an ``imap``, the share of the caller's time spent waiting in
            ``next()``; None otherwise.
    """

    pools: tuple[PoolReport, ...]
    items_per_s: float
    seconds: float
    limited_by: str | None
    caller_wait: float | None = None

    def __str__(self) -> str:
        if self.limited_by is None:
            return "Nothing has run yet."
        text = f"{self.items_per_s:,.0f} items/s over {self.seconds:.1f} s"
        pools = {p.name: p for p in self.pools}
        top = pools.get(self.limited_by)
        if top is None:
            text += ", limited by your loop: the pools waited for it"
        else:
            text += f", limited by {top.name!r} ({_workers(top)}, busy {top.busy:.0%})"
        lines = [text + "."]
        for k, p in enumerate(self.pools):
            if p is top:
                continue
            nxt = self.pools[k + 1].name if k + 1 < len(self.pools) else None
            if nxt is not None and p.waits_next >= 0.25:
                text = (
                    f"{p.name!r} ({_workers(p)}) waited for {nxt!r} {p.waits_next:.0%} of its time"
                )
                lines.append(text + ("." if p.sizes_itself else ": it needs fewer workers."))
            elif p.waits_input >= 0.5:
                lines.append(
                    f"{p.name!r} ({_workers(p)}) had nothing to do {p.waits_input:.0%} of its time."
                )
        if self.caller_wait is not None:
            lines.append(f"Your loop waited for data {self.caller_wait:.0%} of its time.")
        return " ".join(lines)


def _workers(p: PoolReport) -> str:
    return f"{p.workers} worker{'s' if p.workers != 1 else ''}"


def report(
    chain: Chain,
    recorder: Recorder | None,
    done: Sequence[int],
    busy_s: Sequence[float],
    workers: Sequence[int],
    seconds: float,
    imap: bool = False,
) -> Report:
    """The :class:`Report` of a run: ``done`` units and ``busy_s`` slot-seconds per pool,
    ``workers`` each has now, after ``seconds`` (``imap``: the caller's wait is its loop's)."""
    seconds = max(seconds, 1e-9)
    pools = []
    for h, hop in enumerate(chain.hops):
        have = recorder.worker_s[h] if recorder is not None else 0.0
        have = have if have > 0 else seconds * max(1, workers[h])
        idle = recorder.idle_s[h] / have if recorder is not None else 0.0
        last = h + 1 == len(chain.hops)
        held = 0.0 if recorder is None or last else recorder.held_s[h] / seconds
        busy = min(1.0, busy_s[h] / (have * hop.concurrency))
        sizes = hop.bounds is not None  # (what it had on average: it ends at its lo)
        n = max(1, round(have / seconds)) if sizes and recorder is not None else workers[h]
        pools.append(
            PoolReport(hop.name, n, done[h] / seconds, busy, min(1.0, idle), min(1.0, held), sizes)
        )
    caller = None
    if imap and recorder is not None and recorder.caller_s is not None:
        caller = min(1.0, recorder.caller_s / seconds)
    limited = None
    if any(done):
        top = max(reversed(pools), key=lambda p: p.busy)
        limited = top.name
        if top.busy < 0.5 and caller is not None and caller < 0.2:
            limited = "your loop"
    rate = done[-1] * chain.last.unit / seconds
    return Report(tuple(pools), rate, seconds, limited, caller)
