"""The messages between the caller and its workers, and the shared-slot layout.

Every message is a small named tuple (cheap to pickle, read by name, never by position)::

    caller -> worker (data frames, encoded by the worker's Channel: items may be in shared memory)
        Task            a chunk to run: id, seed, first unit index, units, how to run them
    caller -> worker (control frames, read by the worker's reader thread)
        AddPeer         a pipe from an upstream worker follows (its descriptor with the frame)
        Forward         send held chunk ``chunk_id`` to the downstream peer ``key``
        Drop            forget held chunk ``chunk_id``
    worker -> caller
        Ready / InitFailed          after ``init``
        Done                        a chunk's results (last hop of the chain)
        Held                        a chunk is done and its results wait in the worker (other hops)
        Sent                        a held chunk went to the next hop's worker
        Unreadable                  a task did not unpickle in the worker
        Ended / EndFailed           after ``end``

A worker to the next hop's worker: the same ``Task``, carrying the held results as units.
A unit that failed travels on as a :class:`Broken` marker in its result's place (later hops
pass it on; the caller settles it), on every engine.

Besides messages, each worker has one *slot* of ``SLOT_WIDTH`` doubles in a shared array
(:class:`Slots`): the index of the unit in hand (or that a chunk is being unpickled), when it
started, the chunk whose results are being pickled or sent, how many units it runs now, and
how many chunks it holds ahead of one it is unpickling.
The worker writes them without any message; the caller reads them when the worker dies or
runs late, to know which item to blame (and for ``stats()``: items in flight).
"""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

import cloudpickle

from easycore._errors import (
    ItemTimeout,
    RemoteTraceback,
    SerializationError,
    TimedOutItem,
    WorkerError,
    user_error,
    user_traceback,
)

__all__ = [
    "CACHED",
    "PROTOCOL",
    "SLOT_WIDTH",
    "STOP",
    "UNREADABLE",
    "AddPeer",
    "Broken",
    "Cached",
    "Done",
    "Drop",
    "EndFailed",
    "Ended",
    "ErrorReport",
    "Forward",
    "Held",
    "InitFailed",
    "Ready",
    "Sent",
    "Slots",
    "Task",
    "Unreadable",
    "batches",
    "is_cached",
    "pickling_error",
    "settled",
]

TIMED_OUT = f"{TimedOutItem.__module__}.{TimedOutItem.__qualname__}"  # a cancelled async item
STOP = b"\x00easycore-stop"  # a bare frame: run `end` and exit
PROTOCOL = pickle.HIGHEST_PROTOCOL
UNREADABLE = "<item unpickling>"  # the stage of a chunk whose items did not unpickle in a worker
UNPICKLABLE = ("<result pickling>", "<result unpickling>", UNREADABLE)  # SerializationError's


# ---------------------------------------------------------------------------------------------
# errors on the wire
# ---------------------------------------------------------------------------------------------
def pack_exception(exc: BaseException) -> tuple[bytes | None, str, str]:
    """Return (pickled exception or None, type name, str) for sending to another process."""
    try:
        blob: bytes | None = cloudpickle.dumps(exc, PROTOCOL)
    except Exception:
        blob = None
    return blob, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc)


def unpack_exception(blob: bytes | None, tname: str, text: str, tb: str | None) -> BaseException:
    """The inverse of :func:`pack_exception`, in the receiving process.

    The original exception when it unpickles, else a ``RuntimeError`` naming its type; its
    ``__cause__`` carries the remote traceback ``tb`` unless it already has a cause (None:
    the error it is the cause of shows it).
    """
    try:
        original = None if blob is None else pickle.loads(blob)
    except Exception:
        original = None
    if not isinstance(original, BaseException):
        original = RuntimeError(f"{tname}: {text} (the original exception did not unpickle)")
    if original.__cause__ is None and tb is not None:
        original.__cause__ = RemoteTraceback(tb)
    return original


class ErrorReport(NamedTuple):
    """An exception raised by user code in a worker, as it crosses to the caller."""

    stage: str
    blob: bytes | None
    type_name: str
    text: str
    traceback: str

    @classmethod
    def of(cls, stage: str, exc: BaseException) -> ErrorReport:
        """Describe ``exc``, raised by ``stage``, for the caller."""
        blob, tname, text = pack_exception(exc)
        return cls(stage, blob, tname, text, user_traceback(exc))

    def to_error(
        self,
        *,
        what: str,
        device: str | None,
        worker: int | None,
        index: int | None,
        cls: type[WorkerError] | None = None,
    ) -> WorkerError:
        """The ``WorkerError`` (a ``SerializationError`` for an unpicklable result) to raise,
        with the original exception as ``__cause__``."""
        if cls is None:
            cls = SerializationError if self.stage in UNPICKLABLE else WorkerError
            if self.type_name == TIMED_OUT:
                cls = ItemTimeout
        error = user_error(
            self.stage,
            self.type_name,
            self.text,
            self.traceback,
            what=what,
            device=device,
            worker=worker,
            index=index,
            cls=cls,
        )
        # (its message shows the remote traceback: the cause does not show it again)
        error.__cause__ = unpack_exception(self.blob, self.type_name, self.text, None)
        return error


# ---------------------------------------------------------------------------------------------
# caller -> worker
# ---------------------------------------------------------------------------------------------
class Task(NamedTuple):
    """A chunk of consecutive units for one hop, and how to run them."""

    chunk_id: int
    seed: int | None
    start: int  # first-hop index of the chunk's first item
    units: Any  # the items (a list, or a range cut from a range input)
    timed: bool  # write each unit's start time into the slot (a timeout applies)
    retries: int
    spent: dict[tuple[int, int], int]  # runs already charged by deaths, {(hop, index): n}
    numbering: tuple[int, int] = (0, 1)  # unit i is unit first + i * step of the input
    # units may be markers (CACHED, Broken): passed on without running the stages
    marked: bool = False
    timeout: float | None = None  # the run's timeout (a concurrent hop enforces it itself)
    keys: Any = None  # a sink's rows' keys: key= of each first-hop unit (None: by index)


class Cached:
    """Stands in for the items of a unit whose result the run's ledger holds already
    (``resume=``): workers pass it on untouched, the caller puts the stored result back."""

    __slots__ = ()

    def __reduce__(self) -> str:
        return "CACHED"  # the module's one instance, by reference

    def __repr__(self) -> str:
        return "CACHED"


CACHED = Cached()


def is_cached(unit: Any) -> bool:
    """A CACHED marker, or a batch of them (a later hop groups what came in as markers)."""
    return unit is CACHED or (type(unit) is list and len(unit) > 0 and unit[0] is CACHED)


class Broken(NamedTuple):
    """A unit that failed, in place of its result (later hops pass it on; the caller
    settles it: ``books.RunBooks.outputs``)."""

    hop: int
    unit: int  # the unit's index at that hop
    # an ErrorReport when it crossed processes; in the caller (inline) the
    # stages.StageFailure itself, so that the raised error's cause is the live exception
    failure: Any
    where: str = ""  # the place it failed at (a Ray node and process), for messages


def settled(unit: Any) -> Any:
    """What a unit is instead of being run, or None: ``CACHED`` when the caller has its
    result (``resume=``), or the failure it carries (a batch holding one is one:
    :func:`batches`)."""
    if is_cached(unit):
        return CACHED
    return unit if type(unit) is Broken else None


def pickling_error(value: Any) -> Exception | None:
    """Why ``value`` does not pickle, or None (a probe: a copy, nothing is sent, no
    shared-memory segment is made or released)."""
    try:
        cloudpickle.dumps(value)
    except Exception as exc:
        return exc
    return None


def batches(values: Any, k: int) -> list[Any]:
    """The previous hop's results ``values``, ``k`` at a time (the last batch may be
    shorter), for a hop that takes batches: a batch holding a :class:`Broken` is that
    failure (the earliest hop's, the first in input order among those), as on every engine
    (``outcomes.Failed``)."""
    values = values if type(values) is list else list(values)
    out = []
    for i in range(0, len(values), k):
        batch = values[i : i + k]
        failed = [v for v in batch if type(v) is Broken]
        out.append(min(failed, key=lambda b: b.hop) if failed else batch)
    return out


class AddPeer(NamedTuple):
    key: int


class Forward(NamedTuple):
    chunk_id: int
    key: int


class Drop(NamedTuple):
    chunk_id: int


# ---------------------------------------------------------------------------------------------
# worker -> caller
# ---------------------------------------------------------------------------------------------
class Ready(NamedTuple):
    torch_loaded: bool


class InitFailed(NamedTuple):
    error: ErrorReport


class Done(NamedTuple):
    chunk_id: int
    values: list[Any]  # a failed unit's is a Broken
    n_done: int  # units run (a marker that came in is passed on, not run)
    marked: bool  # some values are Broken
    elapsed: float  # the worker's seconds on the chunk (wall time)
    busy: float  # its slot-seconds: ``elapsed``, with units in flight together counted each


class Held(NamedTuple):
    chunk_id: int
    n_done: int  # as Done's (a unit that failed counts: it travels on as a Broken marker)
    elapsed: float
    busy: float  # as Done's


class Sent(NamedTuple):
    chunk_id: int
    nbytes: int


class Unreadable(NamedTuple):
    error: ErrorReport


class Ended(NamedTuple):
    torch_loaded: bool


class EndFailed(NamedTuple):
    error: ErrorReport


# ---------------------------------------------------------------------------------------------
# the shared slots
# ---------------------------------------------------------------------------------------------
SLOT_WIDTH = 5  # doubles per worker:
AT_INDEX = 0  # the index of the unit in hand (within its hop), or UNPICKLING
AT_STARTED = 1  # its start time when timed; RUNNING while a chunk runs untimed; IDLE
AT_SENDING = 2  # the id of the chunk whose results are being pickled or sent, or NOT_SENDING
AT_FLIGHT = 3  # units the worker is running now (up to its concurrency; 0 between chunks)
# chunks taken ahead of the one being unpickled (a hop that waits takes the next chunk while
# its units run; else 0): which chunk UNPICKLING is about
AT_AHEAD = 4
IDLE = 0.0
RUNNING = 1.0
NOT_SENDING = -1.0
# AT_INDEX while the worker unpickles a chunk (the one after AT_AHEAD chunks it still has: it
# takes them in the order sent);
# AT_STARTED then holds when it began, and stays the chunk's first unit's start time, so that
# a timeout counts an item's unpickling.
UNPICKLING = -1.0


class Slots:
    """The caller's view of the shared array: one slot of ``SLOT_WIDTH`` doubles per worker."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw  # a multiprocessing RawArray("d"), passed to every worker

    def reset(self, slot: int) -> None:
        at = SLOT_WIDTH * slot  # (AT_STARTED, AT_SENDING, AT_FLIGHT, AT_AHEAD: the rest)
        self.raw[at + AT_STARTED : at + SLOT_WIDTH] = [IDLE, NOT_SENDING, 0.0, 0.0]

    def index(self, slot: int) -> float:
        return float(self.raw[SLOT_WIDTH * slot + AT_INDEX])

    def started(self, slot: int) -> float:
        """When the unit in hand started (> RUNNING), RUNNING (untimed) or IDLE."""
        return float(self.raw[SLOT_WIDTH * slot + AT_STARTED])

    def sending(self, slot: int) -> int:
        return int(self.raw[SLOT_WIDTH * slot + AT_SENDING])

    def ahead(self, slot: int) -> int:
        """Chunks the worker had taken, and not answered, when it began unpickling one."""
        return int(self.raw[SLOT_WIDTH * slot + AT_AHEAD])

    def in_flight(self, slot: int) -> int:
        """Units the worker is running now (a snapshot, written without any message)."""
        return int(self.raw[SLOT_WIDTH * slot + AT_FLIGHT])


def worker_view(raw: Any) -> Any:
    """The worker's view of the shared array: a flat memoryview of doubles (fast stores)."""
    return memoryview(raw).cast("B").cast("d")
