"""Where a run's items come from: an iterable, a range, a map-style dataset, or items
submitted one at a time.

A run takes items from its source in chunks (:meth:`Source.take`), never more than the
window allows: this is where backpressure meets the user's input. :func:`items_of` says
what the items of the user's input are, for every kind of run (``map``, ``imap``, ``open``,
``state=``, ``distributed=True``).
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import sys
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

__all__ = [
    "Indexed",
    "IterSource",
    "LiveSource",
    "Source",
    "batched",
    "items_of",
    "source_of",
]


def items_of(data: Any) -> Any:
    """The items of ``data`` as a run reads them: a map-style dataset (``__len__`` and
    ``__getitem__`` with no ``__iter__`` of its own, as a ``torch.utils.data.Dataset``) is
    read as DataLoader reads it, ``data[i]`` for ``i`` in ``range(len(data))``, whatever its
    ``__getitem__`` does past the end (Python's own iteration would go on until an
    ``IndexError``); anything else is iterated as it iterates (a dict yields its keys).
    """
    kind = type(data)
    if not (hasattr(kind, "__getitem__") and hasattr(kind, "__len__")):
        return data
    torch_data = sys.modules.get("torch.utils.data")  # (torch is not imported here)
    if torch_data is not None and isinstance(data, torch_data.Dataset):  # as DataLoader does
        return data if isinstance(data, torch_data.IterableDataset) else Indexed(data)
    return data if hasattr(kind, "__iter__") else Indexed(data)


class Indexed:
    """``data`` from item ``start`` on, sized: ``data[i]`` for ``i`` in ``range(start,
    len(data))``, or (``tail``) what ``data.iter_from(start)`` yields; ``iter_from`` resumes
    it."""

    def __init__(self, data: Any, start: int = 0, tail: bool = False) -> None:
        self.data = data
        self.start = start
        self.tail = tail

    def __len__(self) -> int:
        return max(len(self.data) - self.start, 0)

    def __iter__(self) -> Iterator[Any]:
        data = self.data
        if self.tail:
            return iter(data.iter_from(self.start))
        return (data[i] for i in range(self.start, len(data)))

    def iter_from(self, index: int) -> Iterator[Any]:
        """The items from item ``index`` of this view on."""
        return iter(Indexed(self.data, self.start + index, self.tail))


def batched(data: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Lists of ``size`` consecutive items of ``data`` (the last may be shorter)."""
    it = iter(data)
    while batch := list(itertools.islice(it, size)):
        yield batch


class Source:
    """Items for one run, taken lazily in chunks."""

    total: int | None = None  # how many items, when known (chunks shrink as they run out)
    exhausted: bool = False  # nothing more will come

    def take(self, n: int) -> Sequence[Any]:
        """Up to ``n`` items (fewer only at the end, or when a live source has fewer)."""
        raise NotImplementedError

    def wakeup(self) -> Any:
        """A socket readable when new items arrive (live sources), else None."""
        return None

    def should_end(self, settled: bool) -> bool:
        """A live source can end a run before it is exhausted (``settled``: nothing pending)."""
        return False

    def drain_wakeups(self) -> None:
        """Empty the wake-up socket (live sources)."""


class IterSource(Source):
    """An iterable's items; a ``range`` is cut into sub-ranges: three ints on the wire per
    chunk, not every item."""

    def __init__(self, data: Iterable[Any]) -> None:
        with contextlib.suppress(TypeError):
            self.total = len(data)  # type: ignore[arg-type]
        self.rest = data if type(data) is range else None
        self.it: Iterator[Any] = iter(data)

    def take(self, n: int) -> Sequence[Any]:
        if self.rest is None:
            items: Sequence[Any] = list(itertools.islice(self.it, n))
        else:
            items, self.rest = self.rest[:n], self.rest[n:]
        if len(items) < n:
            self.exhausted = True
        return items


def source_of(data: Iterable[Any] | Source) -> Source:
    return data if isinstance(data, Source) else IterSource(data)


class LiveSource(Source):
    """Items submitted one at a time (``Runner.submit``): taken as they come, never waited for.

    ``lock`` guards ``items`` and ``closed`` (the submitting threads append under it); a byte
    on the wake-up socket tells the run loop that something arrived.
    """

    def __init__(self, lock: threading.RLock) -> None:
        self.items: deque[Any] = deque()
        self.lock = lock
        self.closed = False  # no more items: finish what is queued, then end
        self.aborted = False  # end now (the runner is being torn down)
        self.rx, self.tx = socket.socketpair()
        self.rx.setblocking(False)
        self.tx.setblocking(False)
        self.on_idle: Any = None  # called (under the lock) when the run ends for lack of items

    def take(self, n: int) -> Sequence[Any]:
        with self.lock:
            items = [self.items.popleft() for _ in range(min(n, len(self.items)))]
            if self.closed and not self.items:
                self.exhausted = True
        return items

    def wakeup(self) -> Any:
        return self.rx

    def should_end(self, settled: bool) -> bool:
        if self.aborted or not settled:  # (aborted: now; else not while work is pending)
            return self.aborted
        with self.lock:
            if self.items:
                return False
            self.closed = True  # a later submit starts a new run
            if self.on_idle is not None:
                self.on_idle()
            return True

    def put(self, item: Any) -> bool:
        """Queue an item (under the lock); False once this source is closed."""
        if self.closed:
            return False
        self.items.append(item)
        return True

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            self.tx.send(b"\0")

    def drain_wakeups(self) -> None:
        with contextlib.suppress(OSError):
            while self.rx.recv(4096):
                pass

    def close(self) -> None:
        """Close the wake-up socket pair (the feeder does, when its run is over)."""
        for end in (self.rx, self.tx):
            with contextlib.suppress(OSError):
                end.close()
