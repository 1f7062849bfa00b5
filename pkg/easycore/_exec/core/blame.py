"""After a worker dies, or a chunk fails as a whole: which unit to blame, what is charged,
failed and run again.

Every transport describes a death the same way: who died (:class:`Dead`), what it had (the
chunks it lost, oldest first) and what it was doing (:class:`Blame`: the unit in hand, the
results being sent, or a chunk whose unit at fault is not known). :func:`settle_death`
then charges the blamed units one run each (against ``retries``), fails those out of
retries through the run's error policy, and returns what runs again. The process engine
reads what its worker was doing from the worker's shared slot (:func:`assign_blame`); Ray
from the order of an actor's queue (:func:`blame_in_order`).

A chunk that did not pickle or unpickle on its way names no unit: :func:`isolate` fails the
units whose items do not pickle here and runs the others again one by one, so that only the
one at fault fails (:func:`unpicklable`: a chunk or a result that did not pickle).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from easycore._errors import (
    ItemTimeout,
    SerializationError,
    WorkerDied,
    after_retries,
    item_label,
    short_repr,
    some,
)
from easycore._exec.core.books import RunBooks, Work
from easycore._exec.core.protocol import UNPICKLING, Slots, pickling_error
from easycore._exec.core.scheduler import Chunk

__all__ = [
    "Blame",
    "Dead",
    "assign_blame",
    "blame_in_order",
    "isolate",
    "settle_death",
    "unpicklable",
]


@attrs.frozen
class Dead:
    """Who died, as its transport names it in messages."""

    hop: int
    index: int  # its place in its pool (WorkerError.worker)
    device: str
    who: str  # "worker 1 of stage 'f'", "Ray actor 0", ...
    how: str  # why it is gone: "exit code 1", Ray's first line
    code: int | None = None  # its exit code, where there is one
    timed_out: bool = False  # killed for running past ``timeout``
    where: str = ""  # more of where it ran (", Ray node ...")
    kind: str = "worker"  # what was killed: a worker, an actor


@attrs.frozen
class Blame:
    """What a dead worker is charged with (unit indices are within its hop)."""

    culprit: int | None  # the unit it was running (or that ran past the timeout)
    holder: Work | None  # the chunk that unit belongs to
    suspect: Work | None  # the chunk whose results it was pickling or sending
    charged: tuple[int, ...]  # units charged one run each; none: nothing of ours to blame
    # the chunk in hand when which of its units is at fault is not known, and what was
    # being done with it
    unknown: Work | None = None
    doing: str = "running"
    # chunks that run again one output unit per chunk, charged nothing, which pins the unit
    # at fault down (see _splits)
    split: tuple[Work, ...] = ()
    # chunks after ``unknown`` that may have been in hand instead (charged too)
    later: tuple[Work, ...] = ()
    alone: bool = False  # the ``split`` units run each alone on its worker (solo)


def assign_blame(
    books: RunBooks, w: Any, slots: Slots, running: Sequence[Chunk], lost: Sequence[Chunk]
) -> Blame:
    """A worker process's death: blame the unit in hand (its shared slot says which), and
    results being sent; else the oldest chunk it had. ``w``: the dead worker process (its
    ``hop``, its ``slot`` in ``slots``, and the unit it was killed for, ``timed_out``).

    A worker that died (or ran past the timeout) unpickling a chunk was at the one after
    those its slot says it had taken ahead (it takes them in the order sent): a chunk of
    one unit names that unit. That chunk, and one whose results it was pickling or sending,
    when bigger, is split or charged whole, as :func:`blame_in_order` does (:func:`_splits`).
    ``running``: the chunks it ran, oldest first (``Scheduler.died``); ``lost``: all it had.
    """
    unit = books.hops[w.hop].unit
    busy = slots.started(w.slot) > 0
    culprit: int | None = w.timed_out
    if culprit is None and busy and slots.in_flight(w.slot) > 1 and running:
        return _side_by_side(books, unit, running)
    if culprit is None and busy:
        culprit = int(slots.index(w.slot))
    unpickling = None
    if culprit == int(UNPICKLING):
        # the chunk after those it had taken ahead (a hop that waits takes the next chunk
        # while units of the ones before run; else none are ahead: its oldest)
        unpickling = running[min(slots.ahead(w.slot), len(running) - 1)] if running else None
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
    chunks = [c for c in (unpickling, suspect) if c is not None]
    if running and not (chunks or busy) and culprit is None and w.timed_out is None:
        # Died between units: what it was about to reply for (its oldest chunk) is suspect,
        # split or charged whole as above. (Busy with something we no longer track, a chunk
        # re-run elsewhere after its sender died, nothing of ours is to blame.)
        chunks = [running[0]]
    split = [c for c in chunks if culprit is None and _splits(books, c)]
    charged = set() if culprit is None else {culprit}
    charged = charged.union(*(_units(c, unit) for c in chunks if c not in split))
    doing = "running" if unpickling is None else "unpickling"
    return Blame(culprit, holder, suspect, tuple(sorted(charged)), unpickling, doing, tuple(split))


def _side_by_side(books: RunBooks, unit: int, running: Sequence[Chunk]) -> Blame:
    """A worker that ran several units side by side (``concurrency``) died, not for a
    timeout: any of them may have killed it (the slot names only the oldest). When the books
    pin units down, every chunk it ran runs again one output unit per chunk, each alone on
    its worker, charged nothing: a death then names its unit, and the others are spared.
    Else they are all charged, and the error names them."""
    if books.pins_down():
        return Blame(None, None, None, (), running[0], split=tuple(running), alone=True)
    units = tuple(sorted(set().union(*(_units(c, unit) for c in running))))
    return Blame(None, None, None, units, running[0], later=tuple(running[1:]))


def blame_in_order(books: RunBooks, hop: int, lost: Sequence[Work], culprit: int | None) -> Blame:
    """A death of a worker of ``hop`` known from the order of what it had (a Ray actor runs
    its chunks in order): blame the unit in hand, ``culprit`` (known from a timeout;
    ``UNPICKLING``: its chunk's items were being unpickled), else the oldest chunk
    ``lost[0]``: its one unit, or every unit of it; or, when the books pin units down and it
    holds several output units, none: it runs again one output unit per chunk, where a
    death of one alone names it.

    With units not pinned down and no unit known (none, or ``UNPICKLING``), a later chunk
    may have been in hand (the replies of those finished before it can die with the
    worker): every chunk is charged, and the error names them all."""
    unit = books.hops[hop].unit
    work = lost[0]
    doing = "unpickling" if culprit == int(UNPICKLING) else "running"
    if (culprit is None or doing == "unpickling") and len(lost) > 1 and not books.pins_down():
        units = tuple(sorted(set().union(*(_units(w, unit) for w in lost))))
        return Blame(None, None, None, units, work, doing, later=tuple(lost[1:]))
    if culprit is not None and culprit >= 0:  # (in a later chunk of an actor that waits)
        work = next((w for w in lost if w.start <= culprit * unit < w.end), work)
    units = tuple(range(work.start // unit, -(-work.end // unit)))
    if doing == "unpickling" or culprit is None:
        culprit = units[0] if len(units) == 1 else None
    if culprit is not None:
        return Blame(culprit, work, None, (culprit,), None, doing)
    split = (work,) if _splits(books, work) else ()
    return Blame(None, None, None, () if split else units, work, doing, split)


def _units(chunk: Work, unit: int) -> set[int]:
    """The units (of a hop of ``unit`` first-hop units each) that ``chunk`` holds."""
    return {(chunk.start + k) // unit for k in range(len(chunk.items))}


def _splits(books: RunBooks, work: Work) -> bool:
    """Whether ``work``, in hand at a death whose unit at fault is not known, runs again one
    output unit per chunk, charged nothing (the books pin units down and it holds several);
    else all its units are charged."""
    return books.pins_down() and len(work.items) > books.align  # (chunks: whole output units)


def settle_death(
    books: RunBooks, dead: Dead, blame: Blame, lost: Sequence[Work], idle_runs: int = 0
) -> list[Work]:
    """Charge the blamed units, fail those out of retries (a ``Failed`` in their place,
    which delivery raises under ``raise``), and return what runs again, in input order.

    ``idle_runs``: with nothing charged, deaths in a row that charged nothing (bounded by
    ``retries`` too).
    """
    hop = books.hops[dead.hop]
    runs = [books.charges.charge(dead.hop, i) for i in blame.charged] or [idle_runs]
    spared: set[int] = set()  # output units failed instead of re-run
    if max(runs) > books.options.retries:
        error = _error(books, dead, blame, sum(len(c.items) for c in lost))
        failed = [blame.culprit] if blame.culprit is not None else blame.charged
        spared = {index * hop.unit // books.align for index in failed}
        for out in sorted(spared):
            chunk = next(c for c in lost if c.start <= out * books.align < c.end)
            books.fail(out, error, books.unit_items(chunk.items, chunk.start, out), hop.name)
        if not spared:  # nothing of ours to blame: raise, or go on
            books.policy.unplaced(error)
    # What runs again, in input order: every lost chunk, the culprit's output unit alone (so
    # it is pinned down), without the output units ``spared``; a chunk of ``blame.split``
    # (or, once something is spared, every chunk) one output unit per chunk.
    align = books.align
    again: list[Work] = []
    for chunk in sorted(lost, key=lambda c: c.start):
        start, items = chunk.start, chunk.items
        if spared or any(chunk is c for c in blame.split):
            again.extend(books.rerun(Work(start, items, blame.alone), spared))
        elif chunk is blame.holder and blame.culprit is not None:
            a = (blame.culprit * hop.unit) // align * align
            cuts = itertools.pairwise((start, a, a + align, chunk.end))
            again += [Work(x, items[x - start : y - start]) for x, y in cuts if y > x]
        else:
            again.append(Work(start, items))
    return again


def _error(books: RunBooks, dead: Dead, blame: Blame, held: int) -> WorkerDied | ItemTimeout:
    """The error for a death whose charged units are out of retries."""
    options, hop = books.options, books.hops[dead.hop]
    tries = after_retries(options.retries)

    def span(chunk: Work) -> str:
        first, last = chunk.start // hop.unit, (chunk.end - 1) // hop.unit
        return books.label(dead.hop, first, last, within=chunk)

    def died(doing: str, index: int | None, shown: str = "") -> WorkerDied:
        msg = f"{dead.who} on {dead.device}{dead.where} died ({dead.how}){doing}{tries}{shown}"
        return WorkerDied(msg, dead.device, dead.index, dead.code, index, hop.name)

    def timed_out(what: str, index: int, being: str = "", shown: str = "") -> ItemTimeout:
        msg = (
            f"{what} ran past timeout={options.timeout}s on {dead.device} ({dead.who}"
            f"{dead.where}){being}; the {dead.kind} was killed{tries}{shown}"
        )
        return ItemTimeout(msg, hop.name, dead.device, dead.index, index)

    also = "" if blame.suspect is None else f"the results of {span(blame.suspect)}"
    culprit = blame.culprit
    if culprit is not None:
        size = None if blame.holder is None else books.size(dead.hop, culprit, blame.holder)
        label = (
            options.label(culprit, size) if dead.hop == 0 else item_label(culprit, hop.batch, size)
        )
        shown = ""
        if dead.hop == 0 and blame.holder is not None:
            shown = f" (item: {short_repr(blame.holder.items[culprit - blame.holder.start])})"
        if also:
            shown += f" while sending {also}"
        index = books.index(dead.hop, culprit)
        if dead.timed_out:
            being = "" if blame.doing == "running" else f", {blame.doing} it included"
            return timed_out(label, index, being, shown)
        return died(f" while {blame.doing} {label}", index, shown)
    if blame.unknown is not None:  # a chunk of several units: which one is not known
        what = f"{blame.doing} {span(blame.unknown)}"
        if blame.later:  # (a pool that waits may hold many: the first few)
            what += f" or a later chunk it had ({some([span(c) for c in blame.later], 8)})"
        first = books.index(dead.hop, blame.unknown.start // hop.unit)
        return timed_out(what, first) if dead.timed_out else died(f" while {what}", first)
    if blame.suspect is not None:
        index = books.index(dead.hop, blame.suspect.start // hop.unit)
        return died(f" while sending {also}", index)
    return died(f" holding {held} item(s)" if held else "", None)


# -- a chunk that failed as a whole, no unit named ---------------------------------------
def unpicklable(
    books: RunBooks, work: Work, exc: BaseException, at: tuple[int, str, int] | None = None
) -> None:
    """``work`` would not pickle on its way to a worker (on Ray, or a result of it would
    not): see :func:`isolate`; a lone unit fails as a whole, naming ``exc`` and, when
    known, ``at``: the hop, device and worker index of the failed result."""

    def lone(out: int) -> BaseException:
        hop, device, worker = at if at is not None else (len(books.hops) - 1, None, None)
        unit = out * books.align // books.hops[hop].unit
        where = f" on {device} (worker {worker})" if at is not None else ""
        label = books.label(hop, unit, within=work)
        msg = f"{label} or its result cannot be pickled (or unpickled here){where}: {exc}"
        error = SerializationError(msg, "<result pickling>", device, worker, books.index(hop, unit))
        error.__cause__ = exc
        return error

    isolate(books, work, lone, 0 if at is None else at[0])


def isolate(
    books: RunBooks, work: Work, lone: Callable[[int], BaseException], hop: int = 0
) -> None:
    """``work`` failed as a whole with no unit named (it did not pickle or unpickle on
    its way; at ``hop``): each output unit with an item that does not pickle here fails,
    naming the item; the others run again, one per chunk, so that only the one at fault
    fails (``lone(output unit)``: the error of a lone unit that fails as a whole)."""
    parts = books.rerun(work)
    again = []
    for part in parts:
        out = part.start // books.align
        bad = next(((k, e) for k, x in enumerate(part.items) if (e := pickling_error(x))), None)
        if bad is None and len(parts) > 1:
            again.append(part)
            continue
        if bad is None:
            error = lone(out)
        else:
            at = part.start + bad[0]
            msg = (
                f"{books.options.label(at)} cannot be pickled to reach a worker: {bad[1]} "
                f"(item: {short_repr(part.items[bad[0]])})"
            )
            error = SerializationError(msg, "<item pickling>", None, None, books.index(0, at))
            error.__cause__ = bad[1]
        stage = books.hops[hop if bad is None else 0].name
        books.fail(out, error, books.unit_items(part.items, part.start, out), stage)
    books.again(again)
