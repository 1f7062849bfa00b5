"""Where an ``imap`` stream stands: what the caller has received, as a small dict, and a
stream that starts from there (docs/contract.md section 12).

Engine-neutral, like the run core: positions are counted in *first-hop units* (items, or
``batch_size`` batches), the numbering every engine already shares, so a resumed run's
indices, seeds and messages are those of the uninterrupted run on any engine.

* :class:`Position` counts what the caller *received*: a result is counted when ``next()``
  returns it (one fetched ahead but not yet returned is produced again after a resume), a
  failure set aside by ``errors="skip"`` when the stream moves past it. With
  ``ordered=False`` results arrive out of order: the position is a contiguous prefix plus
  the few output units received beyond it (at most a window's worth).
* :func:`start_at` is where an ``imap`` begins: the position it will count, and with
  ``state=`` the options and input that resume there.
* :func:`_read_state` checks a state against the run it is given to (seed, epoch, batch
  sizes, length of the input) and says where to begin.
* :func:`_resumable_tail` is the input from a given item on, without reading what is before
  it: a ``range`` is sliced, a sequence or a map-style dataset indexed, a reader with
  ``iter_from(index)`` asked; anything else (a generator) cannot resume and is a
  ``ValueError``.
* :func:`mark_passed` puts ``CACHED`` markers in place of units received beyond the prefix
  (workers pass markers on without running anything) and :func:`drop_passed` takes them
  out of the results, so that those units are neither computed nor delivered again.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import attrs

from easycore._errors import short_repr
from easycore._exec.core.outcomes import without
from easycore._exec.core.protocol import CACHED, is_cached
from easycore._exec.core.sources import Indexed, items_of
from easycore._options import RunOptions

__all__ = ["Position", "check_state", "drop_passed", "mark_passed", "start_at"]

_KIND = "easycore.imap"
_VERSION = 1
# what a position is a position in (a state given to another run is refused), ints all
_IDENTITY = ("seed", "epoch", "batch_size", "align", "total")
_OPTIONAL = ("seed", "batch_size", "total")  # (these may be None)


def check_state(options: RunOptions, sink: Any) -> None:
    """Refuses ``state=`` for a run that writes to a sink (``sink`` not None): its files are
    its position, and a state would skip the items before it, leaving them unwritten.

    Raises:
        TypeError: ``state`` with a sink, pointing to ``resume=``.
    """
    if options.state is not None and sink is not None:
        msg = (
            "state= continues an imap's position, but a sink's imap has no position of its "
            "own: its committed files are; to resume it after a crash, run it with "
            "resume='run.db' (a ledger beside the output) and give the same resume= again"
        )
        raise TypeError(msg)


def start_at(
    options: RunOptions, data: Iterable[Any], align: int, sink: Any = None
) -> tuple[RunOptions, Iterable[Any], Position]:
    """An ``imap``'s beginning: its options (with ``first``/``passed`` from ``state``), its
    input (from the position on) and the :class:`Position` that will count what it yields.

    Raises:
        TypeError: ``state`` with a ``sink`` (see :func:`check_state`).
        ValueError: ``state`` with ``resume``, a state of another run, or an input that
            cannot start in the middle.
    """
    check_state(options, sink)
    data = items_of(data)
    total = None
    with contextlib.suppress(TypeError):
        total = len(data)
    values = (options.seed, options.epoch, options.batch_size, align, total)
    identity = dict(zip(_IDENTITY, values, strict=True))
    if options.state is None:
        return options, data, Position(identity, align)
    if options.resume is not None:
        msg = "state= and resume= are two ways to resume: give one of them"
        raise ValueError(msg)
    first, passed = _read_state(options.state, identity)
    data = _resumable_tail(data, first * (options.batch_size or 1))
    position = Position(identity, align, first, passed)
    return attrs.evolve(options, first=first, passed=passed), data, position


@attrs.define
class Position:
    """The first-hop units whose results the caller has received (or that were set aside).

    ``prefix``: every unit before it; ``beyond``: the first units of output units past the
    prefix that were received too (``ordered=False``).
    """

    identity: dict[str, Any]
    align: int
    prefix: int = 0
    beyond: set[int] = attrs.field(factory=set, converter=set)

    def passed(self, start: int) -> None:
        """The output unit that begins at first-hop unit ``start`` is behind the caller."""
        self.beyond.add(start)
        while self.prefix in self.beyond:
            self.beyond.remove(self.prefix)
            self.prefix += self.align

    def state(self) -> dict[str, Any]:
        """The position as a small JSON-serialisable dict (see :func:`_read_state`)."""
        return {
            "kind": _KIND,
            "version": _VERSION,
            **self.identity,
            "position": self.prefix,
            "received": sorted(self.beyond),
        }


def _read_state(state: Mapping[str, Any], identity: dict[str, Any]) -> tuple[int, frozenset[int]]:
    """Where a stream resumed from ``state`` begins: ``(first, passed)``, first-hop units.

    Raises:
        ValueError: ``state`` is not one an imap could have given (a field of the wrong
            type, a position negative or past the end), or is one of another run (another
            seed, epoch, batch size, or length of the input), naming the field.
    """
    if state.get("kind") != _KIND or state.get("version") != _VERSION:
        msg = (
            "state= must be a dict that an imap iterator's state_dict() returned (version "
            f"{_VERSION}); got {short_repr(dict(state))}"
        )
        raise ValueError(msg)
    for name in (*_IDENTITY, "position"):
        value = state.get(name)
        if not (_is_int(value) or (name in _OPTIONAL and value is None)):
            what = "an int or None" if name in _OPTIONAL else "an int"
            _refuse(state, name, f"is {short_repr(value)}, not {what}")
    received = state.get("received")
    if not (isinstance(received, list) and all(_is_int(s) for s in received)):
        _refuse(state, "received", f"is {short_repr(received)}, not a list of ints")
    unknown = None in (state["total"], identity["total"])  # (a length one run did not know)
    diffs = [
        f"{name} {state[name]!r} -> {identity[name]!r}"
        for name in _IDENTITY
        if state[name] != identity[name] and not (name == "total" and unknown)
    ]
    if diffs:
        msg = (
            f"state= is the position of another run ({'; '.join(diffs)}): resume with the "
            "same input, seed, epoch and batch sizes as the run it was taken from"
        )
        raise ValueError(msg)
    first, align, total = state["position"], identity["align"], identity["total"]
    units = None if total is None else -(-total // (identity["batch_size"] or 1))
    end = None if units is None else -(-units // align) * align  # after the last output unit
    if first < 0 or first % align or (end is not None and first > end):
        where = "" if end is None else f" from 0 to {end}"
        _refuse(state, "position", f"is {first}: it must be a multiple of {align}{where}")
    for s in received:
        if s <= first or s % align or (units is not None and s >= units):
            before = "" if units is None else f" and before {units}"
            why = f"holds {s}: each must be a multiple of {align} after {first}{before}"
            _refuse(state, "received", why)
    return first, frozenset(received)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _refuse(state: Mapping[str, Any], name: str, why: str) -> NoReturn:
    msg = (
        f"state['{name}'] {why}; a state that no imap could have given (of "
        f"{short_repr(dict(state))}): give the dict that the iterator's state_dict() returned"
    )
    raise ValueError(msg)


def _resumable_tail(data: Any, start: int) -> Iterable[Any]:
    """The items of ``data`` from item ``start`` on, reading none of those before it.

    A ``range`` is sliced (still a range), an object with ``iter_from(index)`` (the protocol
    for readers of one's own, and of a map-style dataset's :class:`Indexed` view) is asked
    for an iterator, a sequence (a ``Sequence``, a numpy array or torch tensor, a Hugging
    Face ``datasets.Dataset``: iterating it yields ``data[i]`` in order) is indexed from
    ``start``.

    Raises:
        ValueError: ``data`` cannot start in the middle (a generator, an iterator, a set).
    """
    if type(data) is range:
        return data[start:]
    if callable(getattr(data, "iter_from", None)):
        return Indexed(data, start, tail=True)
    # item i of iterating a Sequence (not a str or bytes), an array, tensor or Hugging Face
    # dataset (along its first axis, or row by row) is data[i]; a class with an __iter__ of
    # its own may iterate something else (a DataFrame's columns, a DatasetDict's splits): it
    # says how to resume with iter_from
    module = type(data).__module__.split(".")[0]
    by_index = module in ("numpy", "torch", "datasets") and hasattr(data, "shape")
    if not isinstance(data, str | bytes | Mapping) and (isinstance(data, Sequence) or by_index):
        return Indexed(data, start)
    msg = (
        f"state= resumes an input by index, but {short_repr(data)} (of type "
        f"{type(data).__name__}) cannot start in the middle: give a sequence or range, or an "
        "object with iter_from(index) returning an iterator from that item on (see the "
        "guide, 'Training that resumes')"
    )
    raise ValueError(msg)


def mark_passed(
    units: Iterable[Any], first: int, passed: frozenset[int], align: int
) -> Iterator[Any]:
    """``units`` (the stream from first-hop unit ``first``) with a ``CACHED`` marker in place
    of each unit of an output unit that starts at one of ``passed``."""
    last = max(passed) + align
    it = iter(units)
    for i, unit in zip(itertools.count(first), it, strict=False):
        yield CACHED if i - i % align in passed else unit
        if i + 1 >= last:
            break
    yield from it


def drop_passed(stream: Iterator[Any], align: int) -> Iterator[Any]:
    """``stream``'s segments without the values of units passed as markers."""
    yield next(stream)  # PRIMED
    for start, values in stream:
        yield from without(start, values, align, is_cached)
