"""How one ``map``/``imap`` runs: its options as one frozen value, validated once.

Made where the user's call arrives (before any process starts) and handed down whole, so a
new option is one field here rather than one more argument in every signature.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import attrs

from easycore._errors import item_label, short_repr

__all__ = [
    "DEFAULT_PREFETCH",
    "Numbering",
    "RunOptions",
    "check_concurrency",
    "check_prefetch",
    "parse_bytes",
]

# Chunks each worker may hold: queued, running, or finished and waiting for the caller.
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

    def index(self, i: int) -> int:
        return self.first + i * self.step

    def label(self, i: int) -> str:
        return item_label(self.index(i), self.batch)


def _check_bool(_: Any, attr: Any, value: Any) -> None:
    # Truthiness would read ordered="no" as yes: only True and False say what they mean.
    if not isinstance(value, bool):
        msg = f"{attr.name} must be True or False, got {short_repr(value)}"
        raise TypeError(msg)


def _check_batch_size(_: Any, __: Any, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        msg = f"batch_size must be a positive int or None, got {value!r}"
        raise ValueError(msg)


def _check_timeout(_: Any, __: Any, value: Any) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
    ):
        msg = f"timeout must be a positive number of seconds or None, got {value!r}"
        raise ValueError(msg)


def _check_retries(_: Any, __: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        msg = f"retries must be an int >= 0, got {value!r}"
        raise ValueError(msg)


def check_prefetch(value: Any) -> None:
    """Raises ValueError unless ``value`` is None or an int >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        msg = f"prefetch must be an int >= 1 or None, got {value!r}"
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
    if value < 1:
        msg = f"concurrency must be a positive int (1 or more), got {value!r}"
        raise ValueError(msg)


def _check_prefetch(_: Any, __: Any, value: Any) -> None:
    check_prefetch(value)


def _check_seed(_: Any, __: Any, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        msg = f"seed must be an int or None, got {value!r}"
        raise ValueError(msg)


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: Any) -> int | None:
    """A size in bytes: an int, or a string with a unit (``"4GiB"``, ``"500 MB"``).

    >>> parse_bytes("4GiB"), parse_bytes("1.5 kB"), parse_bytes(None)
    (4294967296, 1500, None)

    Raises:
        ValueError: not a positive size.
    """
    if value is None:
        return None
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            msg = f"a size must be bytes or a string like '4GiB' or '500MB', got {value!r}"
            raise ValueError(msg)
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    elif isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        msg = f"a size must be bytes or a string like '4GiB' or '500MB', got {value!r}"
        raise ValueError(msg)
    if size <= 0:
        msg = f"a size must be positive, got {value!r}"
        raise ValueError(msg)
    return size


def _check_errors(_: Any, __: Any, value: Any) -> None:
    if value not in ("raise", "skip"):
        msg = f"errors must be 'raise' or 'skip', got {value!r}"
        raise ValueError(msg)


def _check_callable(_: Any, attr: Any, value: Any) -> None:
    if value is not None and not callable(value):
        msg = f"{attr.name} must be callable or None, got {value!r}"
        raise TypeError(msg)


def _check_path(_: Any, __: Any, value: Any) -> None:
    if value is not None and not isinstance(value, str | os.PathLike):
        msg = f"resume must be a path to an SQLite file (str or PathLike), got {value!r}"
        raise TypeError(msg)


def _check_positive(_: Any, attr: Any, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        msg = f"{attr.name} must be an int >= 1 or None, got {value!r}"
        raise ValueError(msg)


@attrs.frozen
class RunOptions:
    """The options of one run (``map``/``imap``), as the user gave them, checked.

    Raises:
        ValueError: a value out of range or of the wrong type.
        TypeError: ``ordered``, ``progress`` or ``retry_failed`` not a bool; ``on_error``
            or ``key`` not callable; ``resume`` not a path.

    >>> RunOptions(retries=2).retries
    2
    """

    ordered: bool = attrs.field(default=True, validator=_check_bool)
    batch_size: int | None = attrs.field(default=None, validator=_check_batch_size)
    progress: bool = attrs.field(default=False, validator=_check_bool)
    timeout: float | None = attrs.field(default=None, validator=_check_timeout)
    retries: int = attrs.field(default=0, validator=_check_retries)
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    # chunks each worker may hold, queued, running or done and waiting (None: the runner's)
    prefetch: int | None = attrs.field(default=None, validator=_check_prefetch)
    numbering: Numbering | None = None  # None: the stream is the input (see Numbering)
    # long jobs (API.md section 8)
    errors: str = attrs.field(default="raise", validator=_check_errors)
    on_error: Callable[[Any], Any] | None = attrs.field(default=None, validator=_check_callable)
    resume: str | os.PathLike[str] | None = attrs.field(default=None, validator=_check_path)
    key: Callable[[Any], Any] | None = attrs.field(default=None, validator=_check_callable)
    retry_failed: bool = attrs.field(default=False, validator=_check_bool)
    max_items_per_worker: int | None = attrs.field(default=None, validator=_check_positive)
    max_worker_memory: int | None = attrs.field(default=None, converter=parse_bytes)

    @property
    def skip(self) -> bool:
        """Failures are set aside (``errors="skip"``) rather than raised."""
        return self.errors == "skip"

    def label(self, index: int) -> str:
        """Name unit ``index`` of the first hop in messages."""
        if self.numbering is not None:
            return self.numbering.label(index)
        return item_label(index, self.batch_size)

    def global_index(self, index: int) -> int:
        return index if self.numbering is None else self.numbering.index(index)
