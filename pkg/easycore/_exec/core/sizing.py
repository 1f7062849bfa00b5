"""Adaptive sizes, measured as the run goes: how many items go in one chunk (per hop, so
tiny items do not drown in messages), and how many workers a self-sizing pool has.

Pools that size themselves (``.on((lo, hi))``): how many workers each
should have, decided from what the run measures. No I/O and no processes: the scheduler asks
it and moves places; the engine starts and ends them.

Each pool's *cost* is the worker-seconds one input item takes in it (busy time per item,
divided by ``concurrency``), smoothed over its last chunks. A pool of ``w`` workers then
keeps up with ``w / cost`` items a second, its *capacity*; the run goes as fast as its
smallest. Every half second the budget is water-filled: each pool starts at its ``lo`` and
the next worker always goes to the pool of least capacity, up to its ``hi`` (or until a fixed
pool limits the run instead). A new split is taken when it promises at least 25% more
throughput than the current one, or at least 5% in two decisions in a row (noise does not
propose the same split twice: no swinging back and forth); a pool that grew and did not speed
up is held at its size before (``"no gain when it grew"``) for a while. A pool whose input
is exhausted gives its idle workers back at once, down to its ``lo``
(``"input exhausted"``).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence

import attrs

from easycore._exec.core.plan import Chain

__all__ = [
    "MAX_CHUNK",
    "PERIOD",
    "TAIL_CHUNK_SECONDS",
    "TARGET_CHUNK_BYTES",
    "TARGET_CHUNK_SECONDS",
    "WRITE_CHUNK_SECONDS",
    "WRITE_TAIL_SECONDS",
    "Balancer",
    "ChunkSizer",
    "Resize",
]

MAX_CHUNK = 16384  # items per chunk, at most
TARGET_CHUNK_SECONDS = 0.05  # grow chunks until one takes about this long...
TAIL_CHUNK_SECONDS = 0.001  # ...and, as a sized input runs out, shrink them no further
TARGET_CHUNK_BYTES = 1 << 20  # ...or carries about this many pickled bytes
WRITE_CHUNK_SECONDS = 0.5  # a run whose last pool writes files: a file per chunk, so bigger
WRITE_TAIL_SECONDS = 0.1  # ...and its tail shrinks to no less: a file of 50 rows is no use


class ChunkSizer:
    """Grow chunks of small items until one takes ~50 ms or carries ~1 MiB; shrink for slow
    or big ones. One per hop: a run's chunks are as big as its slowest hop allows."""

    __slots__ = ("bytes_per_item", "per_item", "seconds", "size", "tail")

    def __init__(self, seconds: float = TARGET_CHUNK_SECONDS) -> None:
        self.seconds = seconds  # the work a chunk should hold
        # the least work a chunk holds as a sized input runs out: a millisecond, or for the
        # bigger chunks of a writing pool (each is a file) a fifth of their time, so the
        # last files are not tens of rows each, for at most ~0.1 s of one worker idle
        self.tail = WRITE_TAIL_SECONDS if seconds >= WRITE_CHUNK_SECONDS else TAIL_CHUNK_SECONDS
        self.size = 1
        self.per_item: float | None = None
        self.bytes_per_item = 0.0

    def limit_bytes(self, n: int, nbytes: int) -> None:
        """Results measured after the fact (a middle hop's, when sent on)."""
        if n > 0:
            self.bytes_per_item = max(self.bytes_per_item, nbytes / n)
            self.size = max(1, min(self.size, int(TARGET_CHUNK_BYTES / self.bytes_per_item)))

    def floor(self) -> int:
        """The smallest chunk worth a message: about a millisecond of work."""
        if self.per_item is None:
            return 1
        return max(1, min(self.size, int(self.tail / self.per_item)))

    def update(self, n: int, elapsed: float, nbytes: int) -> None:
        """A chunk of ``n`` items took ``elapsed`` seconds and replied ``nbytes``."""
        if n <= 0:
            return
        t = max(elapsed / n, 1e-7)
        self.per_item = t if self.per_item is None else 0.5 * self.per_item + 0.5 * t
        by_time = self.seconds / self.per_item
        by_bytes = TARGET_CHUNK_BYTES / max(nbytes / n, self.bytes_per_item, 1)
        target = max(1, min(MAX_CHUNK, int(min(by_time, by_bytes))))
        # Grow at most 16x per reply so one fast outlier does not make a huge chunk.
        self.size = min(target, self.size * 16)


PERIOD = 0.5  # seconds between two decisions
GAIN = 1.05  # a new split must promise this much more throughput: twice in a row...
CLEAR = 1.25  # ...or this much, once
JUDGE = 1.5  # seconds after a pool grew before its gain is judged
HOLD = 10.0  # seconds a pool that did not speed up stays at its size before
HEADROOM = 1.3  # a pool that waits keeps workers for this many times the run's pace
SMOOTH = 0.3  # weight of a chunk's cost in the pool's smoothed cost
# tests' forced resizes: sizes drawn at random every period (see Balancer.churn)
CHURN_EVERY = PERIOD
CHURN = random.Random(os.environ["EASYCORE_CHURN"]) if os.environ.get("EASYCORE_CHURN") else None


@attrs.frozen
class Resize:
    """One change of a self-sizing pool's workers (``stats()[k].resizes``).

    Attributes:
        at: seconds since the run started.
        pool: the pool's name.
        before: its workers before.
        after: its workers after.
        why: ``"busiest pool"``, ``"waits for input"``, ``"input exhausted"``, ``"no gain
            when it grew"`` or ``"a new run starts"`` (an earlier run's end had shrunk it).
    """

    at: float
    pool: str
    before: int
    after: int
    why: str


class Balancer:
    """The sizes the self-sizing pools of a runner should have (its costs are kept from run
    to run; each run starts from the first split, :meth:`begin`).

    Args:
        chain: the hops (``bounds`` and first ``size`` of those that size themselves).
    """

    def __init__(self, chain: Chain) -> None:
        self.hops = chain.hops
        self.budget = chain.budget
        self.sizing = [h.index for h in self.hops if h.bounds is not None]
        self.cost: list[float | None] = [None] * len(self.hops)
        self.begin(0.0, [h.size for h in self.hops])

    def begin(self, started: float, sizes: Sequence[int]) -> None:
        """A run starts at ``started`` with pools of ``sizes`` workers: each goes back to
        its first split (``"a new run starts"``: an earlier run's end shrank it)."""
        self.target = list(sizes)
        self.held: dict[int, tuple[int, float]] = {}  # pool -> (size it is held at, until)
        # pool that grew -> (when, its capacity before, its size before)
        self.trial: dict[int, tuple[float, float, int]] = {}
        self.finished = [False] * len(self.hops)
        self.proposed: list[int] | None = None  # the split a small gain proposed last time
        self.started = started
        self.last = started - PERIOD  # (the first decision as soon as every pool is measured)
        self.resizes: list[tuple[int, Resize]] = []  # (pool, resize), this run's
        for h in self.sizing:
            self._set(h, self.hops[h].size, "a new run starts", started)

    def measure(self, hop: int, busy: float, items: int) -> None:
        """A chunk of ``items`` input items took ``busy`` slot-seconds in pool ``hop``."""
        if items <= 0 or busy <= 0:
            return
        cost = busy / items / self.hops[hop].concurrency
        old = self.cost[hop]
        self.cost[hop] = cost if old is None else (1 - SMOOTH) * old + SMOOTH * cost

    def capacity(self, hop: int, workers: int) -> float:
        """Items a second pool ``hop`` keeps up with on ``workers`` workers."""
        cost = self.cost[hop]
        return math.inf if cost is None else workers / cost

    def churn(self, now: float) -> bool:
        """Tests' forced resizes (``EASYCORE_CHURN=<seed>``): every period, each pool a
        size drawn between its bounds, within the budget (workers come and go mid-run)."""
        draw = CHURN
        if draw is None or now - self.last < CHURN_EVERY:
            return False
        self.last = now
        left = self.budget - sum(self.target[h] for h in self.sizing)
        changed = False
        for h in draw.sample(self.sizing, len(self.sizing)):
            lo, hi = self.hops[h].bounds  # type: ignore[misc]
            size = draw.randint(lo, max(lo, min(hi, self.target[h] + left)))
            left -= size - self.target[h]
            changed |= self._set(h, size, "busiest pool", now)
        return changed

    def decide(self, now: float, exhausted: Sequence[bool], holding: Sequence[int]) -> bool:
        """Update :attr:`target` (at most every :data:`PERIOD` s but at once when a pool's
        input runs out); whether it changed.

        ``exhausted[h]``: pool ``h`` will get no more input in this run; ``holding[h]``:
        its workers that still have work (queued, running or held results).
        """
        if CHURN is not None:
            return self.churn(now)
        changed = False
        self.finished = list(exhausted)  # (a death downstream may bring input back)
        for h in self.sizing:
            keep = max(self.hops[h].bounds[0], holding[h])  # type: ignore[index]
            if exhausted[h] and keep < self.target[h]:
                changed |= self._set(h, keep, "input exhausted", now)
        live = [h for h in self.sizing if not self.finished[h]]
        if now - self.last < PERIOD or not live or any(self.cost[h] is None for h in live):
            return changed
        self.last = now
        self._judge(now)
        split = self._fill(live)
        # the run's pace now and with the new split; fixed pools bound both (a pool whose
        # input is exhausted bounds nothing: the others have its work to finish)
        going = [h for h in range(len(self.hops)) if not self.finished[h]]

        def pace(sizes: list[int]) -> float:
            return min(self.capacity(h, sizes[h]) for h in going)

        now_pace = pace(self.target)
        # a clear gain moves at once, a small one when the next decision proposes it again
        # (noise does not propose the same split twice in a row)
        gain = pace(split) / now_pace
        small = GAIN <= gain < CLEAR and split != self.proposed
        self.proposed = split if GAIN <= gain < CLEAR else None
        if gain < GAIN or small:  # not (yet) worth a move: only give back what waits
            split = [
                min(t, max(s, math.ceil(HEADROOM * now_pace * (self.cost[h] or 0))))
                if h in live
                else t
                for h, (s, t) in enumerate(zip(split, self.target, strict=True))
            ]
        for h in live:
            if split[h] != self.target[h]:
                grew = split[h] > self.target[h]
                if grew:
                    self.trial[h] = (now, self.capacity(h, self.target[h]), self.target[h])
                changed |= self._set(
                    h, split[h], "busiest pool" if grew else "waits for input", now
                )
        return changed

    def _fill(self, live: list[int]) -> list[int]:
        """Water-fill the budget left by finished pools over the ``live`` ones."""
        split = list(self.target)
        left = self.budget - sum(split[h] for h in self.sizing if h not in live)
        for h in live:
            split[h] = self.hops[h].bounds[0]  # type: ignore[index]
            left -= split[h]
        fixed = min(
            (
                self.capacity(h, len(hop.devices))
                for h, hop in enumerate(self.hops)
                if not hop.bounds and not self.finished[h]
            ),
            default=math.inf,
        )
        while left > 0:
            room = [h for h in live if split[h] < self._most(h)]
            if not room:
                break
            h = min(room, key=lambda h: self.capacity(h, split[h]))
            if self.capacity(h, split[h]) >= fixed:
                break  # a fixed pool limits the run: more workers here would wait
            split[h] += 1
            left -= 1
        return split

    def _most(self, h: int) -> int:
        hi = self.hops[h].bounds[1]  # type: ignore[index]
        size, until = self.held.get(h, (hi, 0.0))
        return hi if self.last >= until else min(hi, size)

    def _judge(self, now: float) -> None:
        """A pool that grew and is not faster by at least 5% goes back to its size before
        and stays there a while."""
        for h, (when, before, size) in list(self.trial.items()):
            if now - when < JUDGE:
                continue
            del self.trial[h]
            if self.capacity(h, self.target[h]) < 1.05 * before and size < self.target[h]:
                self.held[h] = (size, now + HOLD)
                self._set(h, size, "no gain when it grew", now)

    def _set(self, h: int, size: int, why: str, now: float) -> bool:
        if size == self.target[h]:
            return False
        hop = self.hops[h]
        self.resizes.append((h, Resize(now - self.started, hop.name, self.target[h], size, why)))
        self.target[h] = size
        return True
