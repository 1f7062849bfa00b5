"""How one ``map``/``imap`` runs: its options as one frozen value, validated once.

Made where the user's call arrives (before any process starts) and handed down whole, so a
new option is one field here rather than one more argument in every signature.
"""

from __future__ import annotations

from typing import Any

import attrs

from easycore._errors import item_label

__all__ = ["DEFAULT_PREFETCH", "Numbering", "RunOptions", "check_prefetch"]

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


def _check_prefetch(_: Any, __: Any, value: Any) -> None:
    check_prefetch(value)


def _check_seed(_: Any, __: Any, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        msg = f"seed must be an int or None, got {value!r}"
        raise ValueError(msg)


@attrs.frozen
class RunOptions:
    """The options of one run (``map``/``imap``), as the user gave them, checked.

    Raises:
        ValueError: a value out of range or of the wrong type.

    >>> RunOptions(retries=2).retries
    2
    """

    ordered: bool = True
    batch_size: int | None = attrs.field(default=None, validator=_check_batch_size)
    progress: bool = False
    timeout: float | None = attrs.field(default=None, validator=_check_timeout)
    retries: int = attrs.field(default=0, validator=_check_retries)
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    # chunks each worker may hold, queued, running or done and waiting (None: the runner's)
    prefetch: int | None = attrs.field(default=None, validator=_check_prefetch)
    numbering: Numbering | None = None  # None: the stream is the input (see Numbering)

    def label(self, index: int) -> str:
        """Name unit ``index`` of the first hop in messages."""
        if self.numbering is not None:
            return self.numbering.label(index)
        return item_label(index, self.batch_size)

    def global_index(self, index: int) -> int:
        return index if self.numbering is None else self.numbering.index(index)
