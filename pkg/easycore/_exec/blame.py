"""After a worker dies: which unit to blame, and the error that names it.

A dead worker leaves no exception, only its exit code and its shared slot: the index of the
unit in hand (and, with a timeout, when it started) and the chunk whose results it was
pickling or sending. From those and the chunks it had, :func:`assign_blame` says which
units are charged one run each (against ``retries``); :func:`death_error` is the error
raised once a charged unit is out of retries; :func:`requeue` re-runs the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from easycore._errors import (
    ItemTimeout,
    WorkerDied,
    after_retries,
    describe_exitcode,
    item_label,
    short_repr,
)
from easycore._exec.core import Work
from easycore._exec.ledger import Chunk
from easycore._exec.plan import Chain
from easycore._exec.workers import Worker
from easycore._options import RunOptions
from easycore._protocol import UNPICKLING, Slots

__all__ = ["Blame", "assign_blame", "death_error", "requeue"]


@attrs.frozen
class Blame:
    """What a dead worker is charged with (unit indices are within its hop)."""

    culprit: int | None  # the unit it was running (or that ran past the timeout)
    holder: Chunk | None  # the chunk that unit belongs to
    suspect: Chunk | None  # the chunk whose results it was pickling or sending
    charged: tuple[int, ...]  # units charged one run each; none: nothing of ours to blame
    unpickling: Chunk | None = None  # the chunk it was unpickling (its units are charged)


def assign_blame(
    w: Worker, slots: Slots, running: Sequence[Chunk], lost: Sequence[Chunk], unit: int
) -> Blame:
    """Blame the unit in hand, and results being sent; else the oldest chunk it had.

    A worker that died (or ran past the timeout) unpickling a chunk was at its oldest (it
    takes them in the order sent): a chunk of one unit names that unit; a bigger one has
    all its units charged, and they run again one per chunk, which pins the unit down.
    """
    busy = slots.started(w.slot) > 0
    culprit: int | None = w.timed_out
    if culprit is None and busy:
        culprit = int(slots.index(w.slot))
    unpickling = None
    if culprit == int(UNPICKLING):
        unpickling = min(running, key=lambda c: c.id, default=None)
        culprit = None
        if unpickling is not None and len(unpickling.items) <= unit:
            culprit = unpickling.start // unit
    holder = next((c for c in running if c.start <= (culprit or 0) * unit < c.end), None)
    if holder is None:
        culprit = None
    # Results being pickled or sent when it died are suspects too (a result whose pickling
    # kills the process); with a unit running as well, both are charged.
    sending = slots.sending(w.slot)
    suspect = next((c for c in lost if c.id == sending), None)
    charged = {culprit} if culprit is not None else set()
    if unpickling is not None:
        charged |= {(unpickling.start + k) // unit for k in range(len(unpickling.items))}
    if suspect is not None:
        charged |= {(suspect.start + k) // unit for k in range(len(suspect.items))}
    if not charged and not busy and w.timed_out is None:
        # Died between units: what it was about to reply for (its oldest chunk) is suspect.
        # (Busy with something we no longer track, a chunk re-run elsewhere after its
        # sender died, nothing of ours is to blame.)
        oldest = min(running, key=lambda c: c.id, default=None)
        if oldest is not None:
            charged = {(oldest.start + k) // unit for k in range(len(oldest.items))}
    return Blame(culprit, holder, suspect, tuple(sorted(charged)), unpickling)


def death_error(
    w: Worker, blame: Blame, held: int, chain: Chain, options: RunOptions
) -> WorkerDied | ItemTimeout:
    """The error for a death whose charged units are out of retries."""
    code = w.proc.exitcode
    how = describe_exitcode(code)
    tries = after_retries(options.retries)
    who = chain.who(w.hop, w.index)
    hop = chain.hops[w.hop]

    def plain(index: int) -> str:  # the worker's stage is named already
        return options.label(index) if w.hop == 0 else item_label(index, hop.batch)

    def reported(index: int) -> int:
        return options.global_index(index) if w.hop == 0 else index

    also = ""
    if blame.suspect is not None:
        first = blame.suspect.start // hop.unit
        last = (blame.suspect.end - 1) // hop.unit
        also = f"the results of {chain.label(w.hop, first, options)} .. {item_label(last, None)}"
    culprit = blame.culprit
    doing = "running" if blame.unpickling is None else "unpickling"
    if culprit is not None:
        label = plain(culprit)
        shown = ""
        if w.hop == 0 and blame.holder is not None:
            shown = f" (item: {short_repr(blame.holder.items[culprit - blame.holder.start])})"
        if also:
            shown += f" while sending {also}"
        if w.timed_out is not None:
            being = "" if blame.unpickling is None else ", unpickling it included"
            msg = (
                f"{label} ran past timeout={options.timeout}s on {w.device} ({who}){being}; "
                f"the worker was killed{tries}{shown}"
            )
            return ItemTimeout(msg, "<timeout>", w.device, w.index, reported(culprit))
        msg = f"{who} on {w.device} died ({how}) while {doing} {label}{tries}{shown}"
        return WorkerDied(msg, w.device, w.index, code, reported(culprit))
    if blame.unpickling is not None:  # a chunk of several units: which one is not known
        first = blame.unpickling.start // hop.unit
        last = (blame.unpickling.end - 1) // hop.unit
        span = f"{chain.label(w.hop, first, options)} .. {item_label(last, None)}"
        if w.timed_out is not None:
            msg = (
                f"unpickling {span} ran past timeout={options.timeout}s on {w.device} "
                f"({who}); the worker was killed{tries}"
            )
            return ItemTimeout(msg, "<timeout>", w.device, w.index, reported(first))
        msg = f"{who} on {w.device} died ({how}) while unpickling {span}{tries}"
        return WorkerDied(msg, w.device, w.index, code, reported(first))
    if blame.suspect is not None:
        msg = f"{who} on {w.device} died ({how}) while sending {also}{tries}"
        index = reported(blame.suspect.start // hop.unit)
        return WorkerDied(msg, w.device, w.index, code, index)
    holding = f" holding {held} item(s)" if held else ""
    msg = f"{who} on {w.device} died ({how}){holding}{tries}"
    return WorkerDied(msg, w.device, w.index, code)


def requeue(
    lost: Sequence[Chunk], blame: Blame, unit: int, align: int, spared: set[int]
) -> list[Work]:
    """What to run again, in input order: every lost chunk, the culprit's units alone (so
    it is pinned down), without the output units ``spared`` (failed instead, when the run
    goes on; an output unit is ``align`` first-hop units), the others one per chunk. A chunk
    that was being unpickled, its culprit unknown, runs again one output unit per chunk."""
    out: list[Work] = []
    for chunk in sorted(lost, key=lambda c: c.start):
        start, items = chunk.start, chunk.items
        if spared or (chunk is blame.unpickling and blame.culprit is None):
            out.extend(
                Work(start + a, items[a : a + align])
                for a in range(0, len(items), align)
                if (start + a) // align not in spared
            )
        elif chunk is blame.holder and blame.culprit is not None:
            a = (blame.culprit * unit) // align * align
            b = a + align
            parts = [
                Work(start, items[: a - start]),
                Work(a, items[a - start : b - start]),
                Work(b, items[b - start :]),
            ]
            out.extend(part for part in parts if len(part.items))
        else:
            out.append(Work(start, items))
    return out
