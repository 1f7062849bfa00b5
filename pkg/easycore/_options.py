"""How one ``map``/``imap`` runs: its options as one frozen value, validated once.

Made where the user's call arrives (before any process starts) and handed down whole, so a
new option is one field here rather than one more argument in every signature.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import attrs

from easycore._errors import close_matches, item_label, short_repr
from easycore._seeding import check_epoch, epoch_seed

__all__ = [
    "DEFAULT_PREFETCH",
    "Numbering",
    "RunKwargs",
    "RunOptions",
    "check_concurrency",
    "check_count",
    "parse_bytes",
    "run_options",
]

# prefetch: chunks each worker may hold, queued, running, or finished and waiting for the
# caller (a chunk: about 50 ms of work, at most about 1 MiB of results or one unit's; a
# worker with concurrency=k counts k units as one chunk); the run takes about prefetch + 1
# chunks per worker from the input (2 x prefetch of single units) before the caller takes
# results (docs/guide/performance.md gives the memory this bounds).
DEFAULT_PREFETCH = 2


@attrs.frozen
class Numbering:
    """Which unit of the whole input unit ``i`` of this stream is: ``first + i * step``.

    A plain run is the identity. A rank of a distributed run gets every ``step``-th unit
    from ``first``: its seeds and error messages then name the unit of the whole input, as a
    single-process run would. ``batch`` is how many input items a unit holds, for messages.
    """

    first: int = 0
    step: int = 1
    batch: int | None = None


def _check_bool(_: Any, attr: Any, value: Any) -> None:
    # Truthiness would read ordered="no" as yes: only True and False say what they mean.
    if not isinstance(value, bool):
        msg = f"{attr.name} must be True or False, got {short_repr(value)}"
        raise TypeError(msg)


def check_count(name: str, value: Any, minimum: int | None = 1, optional: bool = True) -> None:
    """Raises ValueError unless ``value`` is an int >= ``minimum`` (a bool is not), or None
    when ``optional``; the message names the option ``name``."""
    if value is None and optional:
        return
    low = minimum is not None and isinstance(value, int) and value < minimum
    if isinstance(value, bool) or not isinstance(value, int) or low:
        floor = "" if minimum is None else f" >= {minimum}"
        msg = f"{name} must be an int{floor}{' or None' if optional else ''}, got {value!r}"
        raise ValueError(msg)


def _count(minimum: int | None = 1, optional: bool = True) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: :func:`check_count` of the field."""
    return lambda _, attr, value: check_count(attr.name, value, minimum, optional)


def _check_timeout(_: Any, __: Any, value: Any) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
    ):
        msg = f"timeout must be a positive number of seconds or None, got {value!r}"
        raise ValueError(msg)


def check_concurrency(value: Any) -> None:
    """Checks ``concurrency=``: the items each worker of a pool may hold at once.

    Raises:
        TypeError: not an int (a bool, a float or a string included).
        ValueError: an int below 1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"concurrency must be a positive int, got {short_repr(value)}"
        raise TypeError(msg)
    check_count("concurrency", value, optional=False)


# "kb", "mb"...: powers of 1000; "kib", "mib"...: powers of 1024
_UNITS = {"": 1, "b": 1} | {f"{p}b": 1000**k for k, p in enumerate("kmgt", 1)}
_UNITS |= {f"{p}ib": 1024**k for k, p in enumerate("kmgt", 1)}


def parse_bytes(value: Any, what: str = "a size") -> int:
    """A size in bytes: a positive int, or a string with a unit (``"4GiB"``, ``"500 MB"``);
    ``what`` names the option in the error.

    >>> parse_bytes("4GiB"), parse_bytes("1.5 kB"), parse_bytes(7)
    (4294967296, 1500, 7)

    Raises:
        ValueError: not a positive size.
    """
    size = 0
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", value)
        if m is not None and m.group(2).lower() in _UNITS:
            size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    elif isinstance(value, int) and not isinstance(value, bool):
        size = value
    if size <= 0:
        msg = (
            f"{what} must be a size: a positive number of bytes or a string such as '4GiB' "
            f"or '500MB', got {value!r}"
        )
        raise ValueError(msg)
    return size


def _memory(value: Any) -> int | None:
    return None if value is None else parse_bytes(value, "max_worker_memory")


def _check_state(_: Any, __: Any, value: Any) -> None:
    if value is not None and not isinstance(value, Mapping):
        msg = (
            "state must be the dict an imap iterator's state_dict() returned, or None; got "
            f"{short_repr(value)}"
        )
        raise ValueError(msg)


_callable = attrs.validators.optional(attrs.validators.is_callable())  # a TypeError


def _check_on_error(inst: Any, attr: Any, value: Any) -> None:
    if value is not None and inst.errors != "skip":
        msg = (
            f"on_error={value!r} is called with each item set aside, and only errors='skip' "
            f"sets items aside (errors={inst.errors!r} raises the first failure): add "
            "errors='skip', or leave on_error out"
        )
        raise ValueError(msg)


def _check_path(_: Any, __: Any, value: Any) -> None:
    if value is not None and not isinstance(value, str | os.PathLike):
        msg = f"resume must be a path to an SQLite file (str or PathLike), got {value!r}"
        raise TypeError(msg)


@attrs.frozen
class RunOptions:
    """The options of one run (``map``/``imap``), as the user gave them, checked.

    Raises:
        ValueError: a value out of range or of the wrong type; ``on_error`` without
            ``errors="skip"``.
        TypeError: ``ordered``, ``progress``, ``retry_failed`` or ``accept_changed_code``
            not a bool; ``on_error`` or ``key`` not callable; ``resume`` not a path.

    >>> RunOptions(retries=2).retries
    2
    """

    ordered: bool = attrs.field(default=True, validator=_check_bool)
    batch_size: int | None = attrs.field(default=None, validator=_count())
    progress: bool = attrs.field(default=False, validator=_check_bool)
    timeout: float | None = attrs.field(default=None, validator=_check_timeout)
    retries: int = attrs.field(default=0, validator=_count(0, optional=False))
    seed: int | None = attrs.field(default=None, validator=_count(None))
    # chunks each worker may hold (see DEFAULT_PREFETCH; None: the runner's)
    prefetch: int | None = attrs.field(default=None, validator=_count())
    numbering: Numbering | None = None  # None: the stream is the input (see Numbering)
    # long jobs (contract section 8)
    errors: str = attrs.field(default="raise", validator=attrs.validators.in_(("raise", "skip")))
    on_error: Callable[[Any], Any] | None = attrs.field(
        default=None, validator=[_callable, _check_on_error]
    )
    resume: str | os.PathLike[str] | None = attrs.field(default=None, validator=_check_path)
    key: Callable[[Any], Any] | None = attrs.field(default=None, validator=_callable)
    retry_failed: bool = attrs.field(default=False, validator=_check_bool)
    accept_changed_code: bool = attrs.field(default=False, validator=_check_bool)
    max_items_per_worker: int | None = attrs.field(default=None, validator=_count())
    max_worker_memory: int | None = attrs.field(default=None, converter=_memory)
    # training that resumes (docs/contract.md section 12)
    epoch: int = attrs.field(default=0, validator=lambda _, __, value: check_epoch(value))
    state: Mapping[str, Any] | None = attrs.field(default=None, validator=_check_state)
    # set by the runner from ``state``: the stream begins at first-hop unit ``first``, and
    # the output units starting at ``passed`` (beyond ``first``) were received already
    first: int = 0
    passed: frozenset[int] = frozenset()

    @property
    def skip(self) -> bool:
        """Failures are set aside (``errors="skip"``) rather than raised."""
        return self.errors == "skip"

    @property
    def run_seed(self) -> int | None:
        """The seed the workers derive per-item seeds from: ``seed``, made another for
        every ``epoch`` but 0 (see :func:`easycore.derive_seed`)."""
        return None if self.seed is None else epoch_seed(self.seed, self.epoch)

    @property
    def markers(self) -> bool:
        """Units may come as ``CACHED`` markers (``resume=``, or a resumed position)."""
        return self.resume is not None or bool(self.passed)

    def label(self, index: int, size: int | None = None) -> str:
        """Name unit ``index`` of the first hop in messages (``size``: the items of a
        batch, when known)."""
        batch = self.batch_size if self.numbering is None else self.numbering.batch
        return item_label(self.global_index(index), batch, size)

    def global_index(self, index: int) -> int:
        """Which unit of the whole input unit ``index`` of this stream is (see ``Numbering``)."""
        n = self.numbering
        return index if n is None else n.first + index * n.step


class RunKwargs(TypedDict, total=False):
    """The options of one run, spelled once: the keyword arguments ``map`` and ``imap`` take.

    ``Pipeline.map``/``imap``, ``Stage.map``/``imap`` and ``Runner.map``/``imap`` all accept
    exactly these (typed ``**options: Unpack[RunKwargs]``, so a type checker knows each);
    they are checked, before any process starts, in this one place. A wrapper of one's own
    can pass them on: ``def run(data, **options: Unpack[easycore.RunKwargs])``.

    Attributes:
        ordered: results (and the consumer's items) in input order (default); False: as
            they finish.
        batch_size: hand the first pool lists of up to this many items.
        progress: show a tqdm bar per pool.
        seed: seed ``random``, numpy and torch per item from ``(seed, index)``.
        timeout: seconds an item may run in its worker; past it the worker is killed.
        retries: how many times a failed item (or a dead worker's items) runs again.
        prefetch: chunks each worker may hold, queued, running or finished and waiting for
            the caller (default 2; a worker with ``concurrency=k`` counts ``k`` items as
            one chunk).
        errors: ``"raise"`` (default: the first failure in input order is raised once the
            results before it are delivered) or ``"skip"`` (set failed items aside).
        on_error: with ``errors="skip"``, called in this process with each ``Failure``.
        resume: path of an SQLite run ledger that makes the call resumable.
        key: a function of an item giving its ledger key (default: its index).
        retry_failed: on resume, run the items set aside before again.
        accept_changed_code: on resume, keep the results of a ledger whose stage code
            (functions, ``init``, the constants they read) changed, run what it lacks with
            the new code, and warn naming each change (default: a ``ValueError``).
        max_items_per_worker: replace a worker after this many items.
        max_worker_memory: replace a worker whose resident memory passed this (bytes, or a
            string such as ``"4GiB"``).
        epoch: with ``seed``, every item gets another seed in every epoch (default 0, or
            the one an open runner was given).
        state: (``imap`` only) an imap iterator's ``state_dict()``: continue from there.
    """

    ordered: bool
    batch_size: int | None
    progress: bool
    seed: int | None
    timeout: float | None
    retries: int
    prefetch: int | None
    errors: str
    on_error: Callable[[Any], Any] | None
    resume: str | os.PathLike[str] | None
    key: Callable[[Any], Any] | None
    retry_failed: bool
    accept_changed_code: bool
    max_items_per_worker: int | None
    max_worker_memory: int | str | None
    epoch: int | None
    state: Mapping[str, Any] | None


# Options that may also be given by position, after ``data`` (and ``devices``, ``cfg``), in
# the order docs/contract.md section 2 lists them: ``summer.map(data, "inline", None, False)``.
POSITIONAL = ("ordered", "batch_size", "progress", "seed", "timeout", "retries")


def run_options(
    caller: str, positional: tuple[Any, ...], named: Mapping[str, Any], epoch: int = 0
) -> RunOptions:
    """The checked :class:`RunOptions` of a ``map``/``imap`` call, built in this one place.

    Args:
        caller: the method's name, for messages (``"map"``).
        positional: options given by position, in :data:`POSITIONAL`'s order.
        named: options given by keyword (:class:`RunKwargs`); ``state`` only for ``imap``
            (it continues an imap iterator).
        epoch: the epoch when ``named`` gives none (or None): an open runner's.

    Raises:
        TypeError: too many positional options, one given twice, or an unknown keyword (the
            message names the closest known option).
        ValueError: a value out of range (see :class:`RunOptions`).
    """
    if len(positional) > len(POSITIONAL):
        msg = (
            f"{caller}() takes at most {len(POSITIONAL)} options by position "
            f"({', '.join(POSITIONAL)}), got {len(positional)}"
        )
        raise TypeError(msg)
    if unknown := [name for name in named if name not in RunKwargs.__optional_keys__]:
        hint = close_matches(unknown[0], sorted(RunKwargs.__optional_keys__), n=1)
        msg = f"{caller}() got an unexpected keyword argument {unknown[0]!r}{hint}"
        raise TypeError(msg)
    if caller != "imap" and "state" in named:
        msg = f"{caller}() got an unexpected keyword argument 'state' (it continues an imap)"
        raise TypeError(msg)
    options = dict(zip(POSITIONAL, positional, strict=False))
    for name in options.keys() & named.keys():
        msg = f"{caller}() got multiple values for argument {name!r}"
        raise TypeError(msg)
    if named.get("epoch") is None:
        named = {**named, "epoch": epoch}
    return RunOptions(**options, **named)
