"""``resume=path``: a run's finished units kept in an SQLite file, so a run killed half-way
computes only what is missing when called again.

The ledger lives in the calling process (``sqlite3``, WAL mode) and works on *output units*:
what the last hop makes of ``align`` consecutive first-hop items (an item; a batch with
``batch_size``). Per unit it keeps a key (its index in the input, or ``key(item)``), a
digest of its items (:func:`~easycore._exec.digest.item_digest`: equal items have equal
digests in any process), and its pickled result, or the error it was set aside with
(``errors="skip"``). Two pieces wrap a run:

* :meth:`RunLedger.source` reads the input: a unit the ledger holds is replaced by
  ``CACHED`` markers, which workers pass on without running anything, so every other item
  keeps its index (and its seed, its place in the order); a unit whose digest differs from
  the ledger's is a ``ValueError`` (the input changed), and so is a ``key=`` that names two
  units of one run (keys are str, int or tuples of them: :func:`key_text`);
* :meth:`RunLedger.record` reads the results: it puts stored results back in place of the
  markers and writes what was computed, one transaction per chunk of results.

SQLite commits are atomic: a caller killed at any moment leaves the file as it was after
the last whole chunk.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import cloudpickle

from easycore._errors import WorkerError, short_repr
from easycore._exec.digest import item_digest
from easycore._exec.run import Failed
from easycore._options import RunOptions
from easycore._protocol import CACHED

__all__ = ["RunLedger", "check_ledger", "key_text"]

_SCHEMA = """
CREATE TABLE units (
    key TEXT PRIMARY KEY,    -- 'i:<index>' or 'k:<key_text(key(item))>'
    digest BLOB NOT NULL,    -- digest.item_digest of the unit's items (canonical)
    error TEXT,              -- set aside (errors='skip'): the error's text; else NULL
    stage TEXT,
    result BLOB              -- the pickled result (NULL when set aside)
)
"""
# The keys this run has taken so far (key=): a temporary table, so that a run of millions
# of items does not hold them all in memory. Gone when the connection closes.
_SEEN = "CREATE TEMP TABLE IF NOT EXISTS seen (key TEXT PRIMARY KEY, unit INTEGER NOT NULL)"
_LOOKUP = 256  # units looked up in the file at once
_UNIT_COLUMNS = ("key", "digest", "error", "stage", "result")
_SQLITE_MAGIC = b"SQLite format 3\x00"


def _refuse(path: str, why: str) -> ValueError:
    return ValueError(f"resume={path!r} cannot be a run ledger: {why}")


def _check_place(path: str) -> None:
    """Raises ValueError unless ``path`` can hold a ledger: a new file in a folder that
    exists, an empty file, or an SQLite file (what is in it is :func:`_read_tables`'s)."""
    if path in ("", ":memory:"):
        raise _refuse(path, "the ledger must be a file, to outlive this process")
    if os.path.isdir(path):
        raise _refuse(path, "it is a directory; name a file, such as run.db, in it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise _refuse(path, f"the folder {folder} does not exist")
    if not os.path.exists(path):
        if not os.access(folder, os.W_OK | os.X_OK):
            raise _refuse(path, f"the folder {folder} is not writable")
        return
    if not os.path.isfile(path):
        raise _refuse(path, "it is not a regular file")
    if not os.access(path, os.R_OK | os.W_OK):
        raise _refuse(path, "it cannot be read and written")
    with open(path, "rb") as f:
        head = f.read(len(_SQLITE_MAGIC))
    if head and head != _SQLITE_MAGIC:
        raise _refuse(path, "it is not an SQLite file (is it another file of yours?)")


def _read_tables(path: str, db: sqlite3.Connection) -> bool:
    """Whether ``db`` holds a ledger (False: it is empty, a new ledger may start there).

    Raises:
        ValueError: it holds something else.
    """
    try:
        tables = {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        columns = tuple(row[1] for row in db.execute("PRAGMA table_info(units)"))
    except sqlite3.DatabaseError as exc:
        raise _refuse(path, f"it is not an SQLite file easycore can read ({exc})") from exc
    if not tables:
        return False
    if "units" not in tables or columns != _UNIT_COLUMNS:
        raise _refuse(path, f"it is an SQLite file but not an easycore run ledger ({tables=})")
    return True


def check_ledger(path: str | os.PathLike[str]) -> None:
    """Raises ValueError naming ``path`` when it cannot be a run ledger: a directory, a file
    in a missing folder, a file that is not SQLite, an SQLite file of another program.

    Reads only (nothing is created), so that ``map`` can ask before any worker starts.
    """
    path = os.fspath(path)
    _check_place(path)
    if not os.path.exists(path):
        return
    with contextlib.closing(sqlite3.connect(path)) as db:
        _read_tables(path, db)


def key_text(value: Any, where: str = "an item") -> str:
    """The text a ``key=`` value is kept under: its repr, once it is known to be a str, an
    int or a tuple of them (bools count as the ints they equal; subclasses as their base).

    Anything else could not name an item across runs: a plain object's repr holds its
    address (another in every run, and equal keys for different items are possible too), a
    float's or a list's equality is not what a repr shows.

    >>> key_text(("a", 1)), key_text(True)
    ("('a', 1)", '1')

    Raises:
        TypeError: ``value`` is not such a key.
    """

    def plain(v: Any) -> Any:
        if isinstance(v, str):
            return str.__str__(v)
        if isinstance(v, int):
            return int(v)
        if isinstance(v, tuple):
            return tuple(plain(x) for x in v)
        msg = (
            f"key= must return a str, an int or a tuple of them; for {where} it returned "
            f"{short_repr(value)} (of type {type(value).__name__}), which cannot name an "
            "item across runs"
        )
        raise TypeError(msg)

    return repr(plain(value))


class RunLedger:
    """The finished units of one run (and of the runs before it) in an SQLite file."""

    def __init__(self, path: str | os.PathLike[str], options: RunOptions, align: int) -> None:
        self.path = os.fspath(path)
        self.options = options
        self.align = align
        self.key_fn: Callable[[Any], Any] | None = options.key
        _check_place(self.path)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        if self.key_fn is not None:
            self.db.execute(_SEEN)
        # per output unit taken from the input and not yet delivered: (key, digest, state,
        # items) with state "new", "done" (the result is in the file) or "failed"
        self.pending: dict[int, tuple[str, bytes, str, Any]] = {}

    def _open(self) -> None:
        """Make the file a ledger when it is new, else check that it is one; one transaction,
        so that a caller killed here leaves a file that is either empty or a whole ledger."""
        try:
            if not _read_tables(self.path, self.db):  # (before WAL: never change others' files)
                self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")  # atomic across a crash of this process
            self.db.execute("BEGIN IMMEDIATE")
            try:
                if not _read_tables(self.path, self.db):  # (another process may have been first)
                    self.db.execute(_SCHEMA)
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
        except sqlite3.Error as exc:
            raise _refuse(self.path, str(exc)) from exc

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.db.close()

    # -- the input ---------------------------------------------------------------------------
    def _key(self, index: int, items: Any) -> str:
        if self.key_fn is None:
            return f"i:{self.options.global_index(index)}"
        return f"k:{key_text(self.key_fn(items), self.options.label(index))}"

    def _check_unique(self, keyed: list[tuple[int, str]]) -> None:
        """Raises ValueError when a key of ``keyed`` ((unit, key) pairs) came before in this
        run: the ledger keeps one result per key, so the second item would get the first's."""
        first: dict[str, int] = {}
        twice = None
        for j, key in keyed:
            if key in first:
                twice = (key, first[key], j)
                break
            first[key] = j
        if twice is None:
            marks = ",".join("?" * len(first))
            for key, j in self.db.execute(
                f"SELECT key, unit FROM seen WHERE key IN ({marks})", list(first)
            ):
                twice = (key, j, first[key])
                break
        if twice is not None:
            key, a, b = twice
            msg = (
                f"key {key[2:]} comes twice in this run, for {self.options.label(a)} and "
                f"{self.options.label(b)}: key= must name each item once (the ledger "
                "keeps one result per key)"
            )
            raise ValueError(msg)
        self.db.executemany("INSERT INTO seen VALUES (?, ?)", first.items())

    def source(self, units: Iterable[Any]) -> Iterator[Any]:
        """The first-hop items of ``units`` (items, or batches), with ``CACHED`` markers in
        place of every unit the ledger holds.

        Raises:
            ValueError: a unit's items differ from what the ledger recorded under its key,
                or two units of this run have one ``key=``.
            TypeError: ``key=`` returned something else than a str, an int or a tuple.
        """
        it = iter(units)
        index = itertools.count()
        while True:
            block = []
            for _ in range(_LOOKUP):
                items = list(itertools.islice(it, self.align))
                if not items:
                    break
                block.append((next(index), items))
            if not block:
                return
            keyed = []
            for j, items in block:
                unit = items[0] if self.align == 1 else items
                digest = item_digest(unit)  # the same in any process (sets included)
                keyed.append((j, items, unit, self._key(j, unit), digest))
            if self.key_fn is not None:
                self._check_unique([(j, key) for j, _, _, key, _ in keyed])
            marks = ",".join("?" * len(keyed))
            rows = {
                k: (d, e)
                for k, d, e in self.db.execute(
                    f"SELECT key, digest, error FROM units WHERE key IN ({marks})",
                    [k for *_, k, _ in keyed],
                )
            }
            for j, items, unit, key, digest in keyed:
                row = rows.get(key)
                if row is not None and row[0] != digest:
                    msg = (
                        f"{self.options.label(j)} ({short_repr(unit)}) differs from the one "
                        f"{self.path} recorded under key {key[2:]}: the input changed since "
                        "that run; use another file, or the same input"
                    )
                    raise ValueError(msg)
                if row is None or (row[1] is not None and self.options.retry_failed):
                    cached, state = False, "new"
                else:
                    cached, state = True, ("done" if row[1] is None else "failed")
                self.pending[j] = (key, digest, state, unit)
                if cached:
                    yield from [CACHED] * len(items)
                else:
                    yield from items

    # -- the results -------------------------------------------------------------------------
    def record(self, stream: Iterator[Any]) -> Iterator[Any]:
        """Pass ``stream``'s segments on with stored results in place of ``CACHED``, writing
        each segment's new results (or failures) in one transaction."""
        try:
            yield next(stream)  # PRIMED
            for start, values in stream:
                yield start, self._settle(start // self.align, values)
        finally:
            self.close()

    def _settle(self, first: int, values: list[Any]) -> list[Any]:
        rows: list[tuple[str, bytes, str | None, str | None, bytes | None]] = []
        stored: list[tuple[int, str, Any]] = []
        for k, value in enumerate(values):
            key, digest, state, unit = self.pending.pop(first + k)
            if state != "new":
                stored.append((k, key, unit))
            elif isinstance(value, Failed):
                error = str(value.exc).split("\n", 1)[0]
                rows.append((key, digest, error or type(value.exc).__name__, value.stage, None))
            else:
                rows.append((key, digest, None, None, cloudpickle.dumps(value)))
        if stored:
            values = list(values)
            marks = ",".join("?" * len(stored))
            found = {
                key: (error, stage, blob)
                for key, error, stage, blob in self.db.execute(
                    f"SELECT key, error, stage, result FROM units WHERE key IN ({marks})",
                    [key for _, key, _ in stored],
                )
            }
            for k, key, unit in stored:
                error, stage, blob = found[key]
                if error is None:
                    values[k] = pickle.loads(blob)
                    continue
                index = self.options.global_index(first + k)
                msg = f"{self.options.label(first + k)} was set aside by an earlier run: {error}"
                exc = WorkerError(msg, stage, None, None, index)
                if not self.options.skip:
                    raise exc
                values[k] = Failed(exc, unit, stage or "")
        if rows:  # one transaction per chunk of results, never one per item
            self.db.execute("BEGIN")
            try:
                self.db.executemany("INSERT OR REPLACE INTO units VALUES (?, ?, ?, ?, ?)", rows)
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
        return values
