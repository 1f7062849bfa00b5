"""``Runner.submit``: items fed one at a time, each with its own future.

A :class:`Seat` says who holds a runner (nobody, one ``map``/``imap`` stream, or the submit
feeder), under one lock. The :class:`SubmitFeeder` is a thread running one unordered run
under the skip policy (``books.SKIP``: a failure is delivered, not raised) over a
:class:`~easycore._exec.core.sources.LiveSource`: submitted items join it as they come, each
result or error goes to its own future, and the run (and the feeder) ends as soon as nothing
is queued or running; the next ``submit`` starts a new one.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from easycore._exec.core.outcomes import Failed
from easycore._exec.core.sources import LiveSource

__all__ = ["Seat", "SubmitFeeder"]

# Runs a live source through the runner's engine: yields segments (start, [results]).
_CLOSED = "this runner is closed: call runner.activate() to start its workers again"
_BUSY = "this runner is already running a map/imap; runs go one at a time"

StreamFn = Callable[[LiveSource], Iterator[tuple[int, list[Any]]]]


class SubmitFeeder:
    """The thread behind ``submit``: one unordered run under the skip policy, fed live."""

    def __init__(self, seat: Seat, stream: StreamFn, item: Any, future: Any) -> None:
        # Made under the seat's lock, with the runner free: it takes the runner.
        self.seat = seat
        self.source = LiveSource(seat.lock)
        self.source.on_idle = self._ended
        self.futures: dict[int, concurrent.futures.Future[Any]] = {}
        self.numbers = itertools.count()  # the unit number of each item put
        self.put(item, future)  # before the thread starts: it ends when nothing is queued
        self.finished = threading.Event()  # set as the thread's very last step
        self._stream = stream
        self.thread = threading.Thread(target=self._serve, name="easycore-submit", daemon=True)
        self.thread.start()

    def is_current(self) -> bool:
        return threading.current_thread() is self.thread

    def put(self, item: Any, future: concurrent.futures.Future[Any]) -> bool:
        """Queue an item (under the seat's lock); False when this run has ended."""
        if not self.source.put(item):
            return False
        self.futures[next(self.numbers)] = future
        self.source.wake()
        return True

    def _ended(self) -> None:
        """(under the lock) No more items: free the runner at once; a later submit starts anew."""
        self.source.closed = True
        if self.seat.feeder is self:
            self.seat.feeder = None
        if self.seat.holder is self:
            self.seat.holder = None

    def _serve(self) -> None:
        error: BaseException = RuntimeError("the runner closed before this item ran")
        try:
            for start, values in self._stream(self.source):
                for k, value in enumerate(values):
                    with self.seat.lock:
                        future = self.futures.pop(start + k, None)
                    if future is None or future.done():
                        continue
                    if isinstance(value, Failed):
                        future.set_exception(value.exc)
                    else:
                        future.set_result(value)
        except BaseException as exc:
            error = exc
        finally:
            with self.seat.lock:
                self._ended()
                pending, self.futures = self.futures, {}  # (a closed source takes no more)
            for future in pending.values():  # their callbacks may submit again: the runner is free
                if not future.done():
                    future.set_exception(error)
            self.source.close()
            self.finished.set()

    def stop(self, abort: bool, timeout: float | None = None) -> None:
        """Take no more items; finish the queued ones (or drop them, ``abort``); wait."""
        with self.seat.lock:
            self.source.closed = True
            self.source.aborted = self.source.aborted or abort
        self.source.wake()
        if not self.is_current():
            # Not Thread.join: a Ctrl-C that interrupts it can leave the thread marked as
            # stopped while it still runs (CPython 3.11), and we would stop waiting for it.
            self.finished.wait(timeout)


class Seat:
    """Who holds a runner: nobody, one ``map``/``imap`` stream, or the submit feeder.

    One run at a time: a stream takes the seat for its whole life; the feeder takes it while
    submitted items are queued or running. ``map`` waits for the feeder to finish; ``submit``
    during a stream is refused. The lock is re-entrant: the feeder's source shares it.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.holder: object | None = None  # a stream's token, or the feeder
        self.feeder: SubmitFeeder | None = None
        self.last_feeder: SubmitFeeder | None = None  # the last feeder (it may be ending)
        self.refusing = False  # refuse submits: closing, or a map waits for the feeder

    def claim(self, is_active: Callable[[], bool]) -> object:
        """Take the seat for one stream (a running feeder is waited for); return its token.

        Raises:
            RuntimeError: the runner is closed, or another stream holds it.
        """
        while True:
            with self.lock:
                if not is_active():
                    raise RuntimeError(_CLOSED)
                if self.holder is None:
                    token = self.holder = object()
                    return token
                feeder = self.feeder
            if feeder is None or feeder.is_current():
                raise RuntimeError(_BUSY)
            self.stop_feeder(abort=False, refuse=False)  # let submitted items finish first

    def release(self, token: object) -> None:
        with self.lock:
            if self.holder is token:
                self.holder = None

    def submit(self, item: Any, future: Any, is_active: bool, stream: StreamFn) -> None:
        """Give ``item`` to the running feeder, or start one.

        Raises:
            RuntimeError: the runner is closed or closing, or a stream holds it.
        """
        with self.lock:
            if not is_active:
                raise RuntimeError(_CLOSED)
            if self.refusing:
                msg = "this runner is closing, or a map/imap waits for submitted items"
                raise RuntimeError(msg)
            if self.feeder is not None and self.feeder.put(item, future):
                return
            if self.holder is not None:
                raise RuntimeError(_BUSY)
            self.feeder = self.last_feeder = SubmitFeeder(self, stream, item, future)
            self.holder = self.feeder

    def stop_feeder(self, abort: bool, refuse: bool = True, timeout: float | None = None) -> None:
        """End the submit run: wait for its items (or drop them, ``abort``).

        New submits are refused meanwhile (``refuse=False`` allows them again after). The
        feeder stays registered until its thread ends (``SubmitFeeder._ended``), so an
        interrupted wait can be followed by an abort that still finds it.
        """
        with self.lock:
            self.refusing = True
            feeder = self.feeder
        try:
            if feeder is not None:
                feeder.stop(abort, timeout)  # waits, unless called from the feeder's thread
        finally:
            with self.lock:
                self.refusing = refuse

    def stop_leftover(self, wait: float) -> None:
        """Before a restart: stop a feeder of the previous activation and wait for its thread."""
        leftover = self.last_feeder
        if leftover is not None and not leftover.is_current():
            self.stop_feeder(abort=True)
            leftover.finished.wait(wait)
        self.refusing = False
