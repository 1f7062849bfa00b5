"""The error tree of easycore.

::

    Exception
     └── EasycoreError                      every error easycore raises itself
          ├── FrozenError (+AttributeError)  a frozen CfgNode was asked to change
          └── WorkerError                    a run failed at the user's work: catch this for
               │                             "any failure of my items"
               ├── ItemTimeout               an item ran past ``timeout``; its worker was killed
               │                             (an async item is cancelled instead)
               ├── SerializationError (+TypeError)  an item, result or function would not pickle
               └── WorkerDied                a worker process vanished (signal / exit code)

A ``WorkerError`` itself means the user's code raised: the process is fine and the original
exception is ``__cause__``. Its kinds say what else went wrong: with ``WorkerDied`` the
process itself is gone (SIGKILL, segfault, ``os._exit``, the OOM killer) and there is no
Python exception to report, only an exit code or signal. Each names the ``stage``, ``index``
and ``item`` it concerns where they are known.

Every class here pickles with its message and attributes: errors cross process boundaries.
"""

from __future__ import annotations

import difflib
import functools
import os
import pickle
import signal
import sys
import traceback as tb_module
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import attrs

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = [
    "EasycoreError",
    "Failure",
    "FrozenError",
    "ItemTimeout",
    "RemoteTraceback",
    "SerializationError",
    "SkippedItemsWarning",
    "TimedOutItem",
    "WorkerDied",
    "WorkerError",
    "after_retries",
    "close_matches",
    "describe_exitcode",
    "did_you_mean",
    "item_label",
    "short_repr",
    "some",
    "surfaced",
    "user_error",
    "user_traceback",
    "warn",
]

_LIBRARY = os.path.dirname(os.path.abspath(__file__)) + os.sep  # easycore's own files


class EasycoreError(Exception):
    """Root of every error easycore raises itself; ``except EasycoreError`` catches them all."""


class FrozenError(EasycoreError, AttributeError):
    """A frozen ``CfgNode`` (or a node inside one) was asked to change.

    Also an ``AttributeError``, so code that guards attribute assignment keeps working. Use
    ``with cfg.unfrozen():`` or ``cfg.freeze(False)`` to change a node on purpose.
    """


class RemoteTraceback(Exception):
    """Carries the traceback text of an exception raised in another process.

    Set as ``__cause__`` of the re-raised original exception, so Python prints the remote
    traceback under "The above exception was the direct cause of ...".
    """


class WorkerError(EasycoreError):
    """A run failed at the user's work; as such (not one of its kinds), user code raised: a
    stage's ``init``, work function, ``end``, or the consumer.

    ``except WorkerError`` catches any failure of a run's items: an exception, a timeout
    (:class:`ItemTimeout`), an item or result that would not pickle
    (:class:`SerializationError`), a worker process that died (:class:`WorkerDied`).

    For user code that raised, the worker process itself is healthy; ``__cause__`` is the
    original exception, of its original type whenever it unpickles in the caller. The message
    names the stage, device, worker and item index and carries the remote traceback: the
    user's own frames, each file and line once.

    Attributes:
        message: the text ``str(error)`` gives (also ``args[0]``).
        stage: name of the function that raised (``"predict"``, ``"load (init)"``...), or
            of the pool the failed item was in.
        device: the worker's device string, ``None`` for the consumer.
        worker: the worker index, ``None`` for the consumer.
        index: the item's index in the input (``None`` outside item processing); a batch's
            with ``batch_size``.
        remote_traceback: the formatted traceback text from the worker.
        item: the item (a batch: the list of its items) that failed, where known; else
            ``None`` (its repr, once pickled, when the item itself does not pickle).
    """

    def __init__(
        self,
        message: str,
        stage: str | None = None,
        device: str | None = None,
        worker: int | None = None,
        index: int | None = None,
        remote_traceback: str | None = None,
        item: Any = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.device = device
        self.worker = worker
        self.index = index
        self.remote_traceback = remote_traceback
        self.item = item

    def concerns(self, stage: str, item: Any) -> None:
        """Name the stage and the item of the unit this error failed (the run does, once
        it knows them: a worker knows an item's index, not what the caller gave).

        Args:
            stage: the pool the unit failed in, kept only where no stage is named yet.
            item: the unit's item (a batch: the list of its items); an error that several
                units failed with (a death that names no one of them) keeps the first's,
                which its ``index`` names.
        """
        self.stage = stage if self.stage is None else self.stage
        if not vars(self).get("_item_named"):
            self.item, self._item_named = item, True

    def __reduce__(self) -> Any:
        state = dict(vars(self))
        try:
            pickle.dumps(self.item)
        except Exception:  # (an item that would not pickle: the reason it failed, maybe)
            state["item"] = short_repr(self.item)
        return (type(self), self.args, state)


class ItemTimeout(WorkerError):
    """An item ran longer than ``timeout`` seconds; the worker running it was killed.

    Raised once ``retries`` are used up (a retry runs the item on a fresh worker).
    """


class TimedOutItem(TimeoutError):
    """An async item (``async def`` producer) ran past ``timeout`` and was cancelled; its
    worker went on. The caller gets an :class:`ItemTimeout` (no ``__cause__``, as a killed
    item): nothing of the user's raised."""


class SerializationError(WorkerError, TypeError):
    """An item, a result, a function or ``cfg`` could not be pickled to cross processes.

    Also a ``TypeError`` (what ``pickle`` itself raises). The message names the item index
    (or the function) and ``__cause__`` is the pickling error.
    """


class WorkerDied(WorkerError):
    """A worker process vanished: killed by a signal, segfault, ``os._exit``, OOM killer.

    No Python exception exists to report (contrast a plain :class:`WorkerError`): no
    ``__cause__``, no traceback; the message names the device, worker index, exit code or
    signal, and the item it held when known.

    Attributes:
        message: the text ``str(error)`` gives (also ``args[0]``).
        device: the worker's device string.
        worker: the worker index.
        exitcode: the process exit code; negative ``-N`` means killed by signal ``N``.
        index: the index of an item the worker held when it died, if any.
        stage: the pool (its stages' names) of the item it held, where known.
        item: that item (a batch: the list of its items), where known.
    """

    def __init__(
        self,
        message: str,
        device: str | None = None,
        worker: int | None = None,
        exitcode: int | None = None,
        index: int | None = None,
        stage: str | None = None,
        item: Any = None,
    ) -> None:
        super().__init__(message, stage, device, worker, index, None, item)
        self.exitcode = exitcode


class SkippedItemsWarning(RuntimeWarning):
    """Items failed and were left out of a run with ``errors="skip"`` and no ``on_error``
    (one warning per run, with the count and the first :class:`Failure`)."""


@attrs.define(eq=False, repr=False)
class Failure:
    """An item set aside by ``errors="skip"``: it failed after its retries, and the run went on.

    Attributes:
        index: its index in the input (a batch's index with ``batch_size``).
        item: the item (a batch: the list of its items), as the caller gave it.
        stage: the name of the stage it failed in.
        error: the exception ``errors="raise"`` would have raised (``WorkerError``,
            ``WorkerDied``, ``ItemTimeout``, ``SerializationError``).
    """

    index: int
    item: Any
    stage: str
    error: BaseException

    def __repr__(self) -> str:
        first = str(self.error).split("\n", 1)[0]
        return (
            f"Failure(index={self.index}, item={short_repr(self.item, 60)}, "
            f"stage={self.stage!r}, error={type(self.error).__name__}: {first})"
        )


def describe_exitcode(exitcode: int | None) -> str:
    """Say how a process ended: ``"signal 9 (SIGKILL)"``, ``"exit code 3"``.

    >>> describe_exitcode(-9)
    'signal 9 (SIGKILL)'
    """
    if exitcode is None:
        return "no exit code (still running?)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
        return f"signal {-exitcode} ({name})"
    return f"exit code {exitcode}"


def item_label(index: int, batch_size: int | None, size: int | None = None) -> str:
    """How messages name a unit of the input: ``"item 3"``, or a batch and its items
    (``size``: how many it holds, when known: the input's last batch may hold fewer).

    >>> item_label(1, 4)
    'batch 1 (items 4..7)'
    >>> item_label(3, 8, size=6)
    'batch 3 (items 24..29)'
    """
    if batch_size is None:
        return f"item {index}"
    first = index * batch_size
    return f"batch {index} (items {first}..{first + (size or batch_size) - 1})"


def after_retries(retries: int) -> str:
    """``" after 2 retries"`` for messages, or nothing without retries."""
    return f" after {retries} retr{'y' if retries == 1 else 'ies'}" if retries else ""


def some(names: Sequence[str], shown: int) -> str:
    """The first ``shown`` of ``names`` for a message, and how many more: ``"a, b and 3
    more"``."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def did_you_mean(matches: Sequence[str]) -> str:
    """``"; did you mean 'A', 'B' or 'C'?"`` for messages, or nothing without matches."""
    quoted = [repr(m) for m in matches]
    if len(quoted) > 1:
        quoted[-2:] = [f"{quoted[-2]} or {quoted[-1]}"]
    return f"; did you mean {', '.join(quoted)}?" if quoted else ""


def close_matches(word: Any, candidates: Iterable[Any], n: int = 3) -> str:
    """:func:`did_you_mean` for the (string) candidates close to ``word``."""
    names = [c for c in candidates if isinstance(c, str)]
    return did_you_mean(difflib.get_close_matches(str(word), names, n=n))


def short_repr(obj: Any, limit: int = 80, as_text: Callable[[Any], str] = repr) -> str:
    """``repr(obj)`` (or ``as_text(obj)``) cut to ``limit`` characters, never raising."""
    try:
        text = as_text(obj)
    except Exception:
        text = f"<{type(obj).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def surfaced(method: _F) -> _F:
    """A public entry point (``map``, ``imap``, a results iterator's ``__next__``) that
    raises a run's ``WorkerError`` without easycore's frames below it: the message says what
    they knew (stage, item, the user's traceback), so the caller sees their own line once."""

    @functools.wraps(method)
    def entry(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except WorkerError as exc:
            raise exc.with_traceback(None) from exc.__cause__  # (the message says where)

    return entry  # type: ignore[return-value]


def warn(msg: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` at the user's line: the first frame outside easycore (the
    ``skip_file_prefixes`` of Python 3.12, counted by hand)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY):
        frame, level = frame.f_back, level + 1
    warnings.warn(msg, category, stacklevel=level)


def user_traceback(exc: BaseException) -> str:
    """``exc`` and its traceback as text, from the first frame outside easycore on: the
    user's code, without easycore's frames that called it (all of it when no frame is the
    user's)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_LIBRARY):
        tb = tb.tb_next
    return "".join(tb_module.format_exception(type(exc), exc, tb or exc.__traceback__))


def user_error(
    stage: str,
    type_name: str,
    text: str,
    traceback: str,
    *,
    what: str,
    device: str | None,
    worker: int | None,
    index: int | None,
    remote: bool = True,
    cls: type[WorkerError] = WorkerError,
) -> WorkerError:
    """The one place a ``WorkerError`` message is written: what raised, where, and its
    traceback (the user's frames: :func:`user_traceback`), shown once: the original
    exception, which the caller chains as ``__cause__``, carries no frames of its own.

    ``device=None`` is the calling process (the consumer); ``remote=False`` an inline run,
    whose traceback is local.
    """
    inline = "" if remote else "inline "
    where = "in the calling process" if device is None else f"{inline}on {device} (worker {worker})"
    if issubclass(cls, ItemTimeout):  # (an async item, cancelled: no user code raised)
        return cls(f"{stage} {text}\n  {what} {where}", stage, device, worker, index)
    short = type_name.rsplit(".", 1)[-1]
    heading = "Remote traceback" if remote else "Traceback"
    msg = f"{stage} raised {short}: {text}\n  {what} {where}\n\n{heading}:\n{traceback}"
    return cls(msg, stage, device, worker, index, traceback)
