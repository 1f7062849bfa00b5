"""``resume=path``: a run's finished units kept in an SQLite file, so a run killed half-way
computes only what is missing when called again.

The ledger lives in the calling process (``sqlite3``, WAL mode) and works on *output units*:
what the last hop makes of ``align`` consecutive first-hop items (an item; a batch with
``batch_size``). Per unit it keeps a key (its index in the input, or ``key(item)``), a
digest of its items (:func:`~easycore._longjobs.digest.item_digest`: equal items have equal
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

A ledger knows what run it belongs to: its ``meta`` table holds the :class:`RunIdentity`
(each producer's function and ``init``, ``cfg``, ``seed``, batch sizes), written when the
file becomes a ledger; a run with another identity is a ``ValueError`` naming what
differs, never the results of another computation. :func:`check_ledger` asks that, and
whether the path can be a ledger at all, without writing, before any worker starts.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pathlib
import pickle
import sqlite3
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs
import cloudpickle

from easycore._errors import WorkerError, short_repr, some, warn
from easycore._exec.core.outcomes import Failed
from easycore._exec.core.plan import PipelineDef, first_batch, frozen_cfg
from easycore._exec.core.protocol import CACHED
from easycore._exec.core.stages import call_key
from easycore._longjobs.digest import cfg_digests, code_digest, function_digest, item_digest
from easycore._longjobs.sinks import Shard, Wrote, renamed_clear_of
from easycore._options import RunOptions

__all__ = ["RunIdentity", "RunLedger", "check_ledger", "key_of", "key_text"]

# units: per output unit, its key ('i:<index>' or 'k:<key_text(key(item))>'), the digest of
# its items (digest.item_digest), and its pickled result, or (set aside by errors="skip") the
# error's text and stage; files: the committed files of a sink (easycore.write), by their
# final names, with the names they were written under; meta: the run's identity
# (RunIdentity.parts), each part as JSON
_TABLES = (
    "CREATE TABLE units (key TEXT PRIMARY KEY, digest BLOB NOT NULL, error TEXT, stage TEXT,"
    " result BLOB)",
    "CREATE TABLE files (name TEXT PRIMARY KEY, temp TEXT NOT NULL, rows INTEGER NOT NULL,"
    " bytes INTEGER NOT NULL)",
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
)
# The keys this run has taken so far (key=): a temporary table, so that a run of millions
# of items does not hold them all in memory. Gone when the connection closes.
_SEEN = "CREATE TEMP TABLE IF NOT EXISTS seen (key TEXT PRIMARY KEY, unit INTEGER NOT NULL)"
_LOOKUP = 256  # units looked up in the file at once
_UNIT_COLUMNS = ("key", "digest", "error", "stage", "result")
_SQLITE_MAGIC = b"SQLite format 3\x00"
_FORMAT = 6  # the ledger's layout; RunIdentity's "format"


def _refuse(path: str, why: str) -> ValueError:
    return ValueError(f"resume={path!r} cannot be a run ledger: {why}")


def _check_place(path: str, identity: RunIdentity) -> None:
    """Raises ValueError unless ``path`` can hold a ledger of ``identity``: a new file in a
    folder that exists, an empty file, or an SQLite file (what is in it is
    :func:`_read_ledger`'s), not inside the directory the run's sink writes (which must read
    back as a dataset, without a file of another kind in it)."""
    sink = identity.parts.get("sink")
    folder = sink and "://" not in sink["path"] and os.path.realpath(sink["path"])
    if folder and os.path.commonpath([folder, os.path.realpath(path)]) == folder:
        msg = (
            f"resume={path!r} is inside the directory {_sink_text(sink)} writes, which "
            f"must read back as a dataset: keep the ledger beside the output (such as "
            f"{folder}.db)"
        )
        raise ValueError(msg)
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


def _read_ledger(path: str, db: sqlite3.Connection) -> dict[str, Any] | None:
    """The identity of the run whose ledger ``db`` holds (:attr:`RunIdentity.parts`), or
    None when it is empty (a new ledger may start there).

    Raises:
        ValueError: it holds something else, or a ledger that does not say whose it is.
    """
    try:
        tables = {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        columns = tuple(row[1] for row in db.execute("PRAGMA table_info(units)"))
        if not tables:
            return None
        if "units" not in tables or columns != _UNIT_COLUMNS:
            msg = f"it is an SQLite file but not an easycore run ledger ({tables=})"
            raise _refuse(path, msg)
        if "meta" not in tables:
            msg = (
                "it was written by an earlier easycore, which did not record what run it "
                "belongs to; give a new path to start afresh"
            )
            raise _refuse(path, msg)
        return {name: json.loads(value) for name, value in db.execute("SELECT * FROM meta")}
    except sqlite3.DatabaseError as exc:
        raise _refuse(path, f"it is not an SQLite file easycore can read ({exc})") from exc
    except json.JSONDecodeError as exc:
        raise _refuse(path, f"its meta table is damaged ({exc})") from exc


def check_ledger(path: str | os.PathLike[str], identity: RunIdentity) -> None:
    """Raises ValueError naming ``path`` when it cannot be a run ledger (a directory, a file
    in a missing folder, a file that is not SQLite, an SQLite file of another program) or
    is the ledger of another run than ``identity``.

    Reads only (nothing is created), so that ``map`` can ask before any worker starts.
    """
    path = os.fspath(path)
    _check_place(path, identity)
    if not os.path.exists(path):
        return
    with contextlib.closing(sqlite3.connect(path)) as db:
        stored = _read_ledger(path, db)
    if stored is not None:
        identity.check(path, stored)


@attrs.frozen
class RunIdentity:
    """What computation a ledger's results are the results of, so that a ledger never hands
    one run the results of another (contract section 8). Kept in the ledger's ``meta`` table,
    written when the file becomes a ledger and compared whenever a run resumes from it.

    Its parts (:attr:`parts`, each stored as JSON):

    * ``format``: the ledger's layout (6: as 5, a function's digest one canonical pickle
      of what it computes with, a stage's identity its code and the data it reads; 5: as
      4, a function's digest without tags for what holds it, values by their item digests;
      4: as 3, types digested under their module paths of the layout by layer; 3: item
      digests of a canonical pickle, checked keys, this table);
    * ``stages``: every producer in order: its name, ``code``: the digests of its function
      and of its ``init`` (the state ``init`` makes is an input of every item) without the
      module constants they read, ``reads``: those constants (digest and short repr by
      name, so that a message names them), and the ``batch_size`` of the pool it starts
      (pools after the first; the first pool's is ``batch_size``);
    * ``key``: the ``key=`` function's name and digest (another one names other units:
      their results, and a sink's files, would be computed and written again);
    * ``cfg``: a digest of every leaf by its dotted key (so a message can name the keys);
    * ``seed``, and ``batch_size`` (``map``'s, or the first pool's).

    Left out on purpose: the consumer (the ledger keeps the producers' results; every run
    folds stored and new results alike, so another consumer is another fold of the same
    results, and may change freely), a producer's ``end`` (its value is dropped), and how
    and where results are computed (devices, engine, ``ordered``, ``retries``,
    ``timeout``, ``errors``).

    ``accept_changed_code`` (the option; not a part): changed stage code (functions,
    ``init``, the constants they read) is accepted rather than refused (:meth:`check`).
    """

    parts: Mapping[str, Any]
    accept_changed_code: bool = False

    @classmethod
    def of(
        cls, pipeline: PipelineDef, cfg: Mapping[str, Any] | None, options: RunOptions
    ) -> RunIdentity:
        """The identity of running ``pipeline`` with this ``cfg`` and these options."""
        stages = []
        for i, (group, binding) in enumerate(pipeline.pools):
            for k, stage in enumerate(group):
                fn, init = stage.fn, getattr(stage, "init", None)
                reads: dict[str, Any] = {}
                code = [code_digest(fn, reads), None if init is None else code_digest(init, reads)]
                stages.append(
                    {
                        "name": stage.name,
                        "batch_size": binding.batch_size if binding and i > 0 and k == 0 else None,
                        "code": code,
                        "reads": {
                            name: [item_digest(value).hex(), short_repr(value, 60)]
                            for name, value in reads.items()
                        },
                    }
                )
        sink = getattr(pipeline, "sink", None)
        key = options.key
        parts = {
            "sink": None if sink is None else sink.identity(),
            "key": None if key is None else {"name": _name(key), "fn": function_digest(key)},
            "format": _FORMAT,
            "stages": stages,
            "cfg": cfg_digests(frozen_cfg(cfg)),
            "seed": options.seed,
            "batch_size": first_batch(pipeline, options.batch_size),
            "epoch": options.epoch,
        }
        # (parts as they read back from the file)
        return cls(json.loads(json.dumps(parts)), options.accept_changed_code)

    def differences(self, stored: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        """What differs between a ledger's identity ``stored`` and this one, in words: the
        stages' code (functions, ``init``, constants they read), and everything else."""
        new = self.parts
        if stored.get("format") != new["format"]:
            old = stored.get("format")
            return [], [f"ledger format: {old} -> {new['format']} (another easycore wrote it)"]
        out: list[str] = []
        code: list[str] = []
        before, now = stored["stages"], new["stages"]
        names = [s["name"] for s in now]
        if [s["name"] for s in before] != names:
            old_text = " >> ".join(s["name"] for s in before) or "(none)"
            out.append(f"stages: {old_text} -> {' >> '.join(names) or '(none)'}")
        else:
            for i, (a, b) in enumerate(zip(before, now, strict=True)):
                where = f"stage {b['name']!r}" + (
                    f" (#{i + 1})" if names.count(b["name"]) > 1 else ""
                )
                ra, rb = a["reads"], b["reads"]
                parts = zip(("function", "init"), a["code"], b["code"], strict=True)
                code += [f"{where}: its {what} changed" for what, x, y in parts if x != y]
                code += [  # (constants by name, with both values)
                    f"{where}: the global {name} it reads changed ({ra[name][1]} -> {rb[name][1]})"
                    for name in sorted(ra.keys() & rb.keys())
                    if ra[name][0] != rb[name][0]
                ]
                if a["batch_size"] != b["batch_size"]:
                    out.append(f"{where}: batch_size {a['batch_size']} -> {b['batch_size']}")
        cfg_a, cfg_b = stored["cfg"], new["cfg"]
        keys = [f"{k} changed" for k in sorted(cfg_a.keys() & cfg_b.keys()) if cfg_a[k] != cfg_b[k]]
        keys += [f"{k} added" for k in sorted(cfg_b.keys() - cfg_a.keys())]
        keys += [f"{k} removed" for k in sorted(cfg_a.keys() - cfg_b.keys())]
        if keys:
            out.append(f"cfg: {some(keys, 6)}")
        if stored["sink"] != new["sink"]:
            out.append(_sink_change(stored["sink"], new["sink"]))
        if stored["key"] != new["key"]:
            old, now = (k["name"] if k else "(none)" for k in (stored["key"], new["key"]))
            change = f"the function {now} changed" if old == now else f"{old} -> {now}"
            out.append(f"key=: {change}")
        out += [
            f"{k}: {stored[k]} -> {new[k]}"
            for k in ("seed", "batch_size", "epoch")
            if stored[k] != new[k]
        ]
        return code, out

    def check(self, path: str, stored: Mapping[str, Any]) -> list[str]:
        """Raises ValueError naming what differs when ``stored`` is not this identity; with
        ``accept_changed_code``, returns the changes of stage code it accepts instead.
        """
        code, other = self.differences(stored)
        if other or (code and not self.accept_changed_code):
            hint = (
                "; or, to keep its results and run what it lacks with the new code, pass "
                "accept_changed_code=True (with retry_failed=True to run its failures again)"
                if not other
                else ""
            )
            msg = (
                f"resume={path!r} is the ledger of another run ({'; '.join(code + other)}); "
                "its results are not this run's. Resume with the same stage functions, key=, "
                f"cfg, seed and batch sizes, or give a new path to start afresh{hint}"
            )
            raise ValueError(msg)
        return code


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _sink_text(sink: Any) -> str:
    return f"write.{sink['kind']}({sink['path']!r})" if sink else "(none)"


def _sink_change(before: Any, after: Any) -> str:
    """What differs between two sinks' identities, named: the sink, or its options."""
    text = f"sink: {_sink_text(before)} -> {_sink_text(after)}"
    if not before or not after or _sink_text(before) != _sink_text(after):
        return text
    changed = [
        f"{k}={before.get(k)!r} -> {after.get(k)!r}"
        for k in sorted(before.keys() | after.keys())
        if before.get(k) != after.get(k)
    ]
    return f"sink {_sink_text(after)}: {', '.join(changed)}"


def key_text(value: Any, where: str = "an item") -> str:
    """The text a ``key=`` value is kept under: its repr, once it is known to be a str, an
    int or a non-empty tuple of them (subclasses as their base; not a bool, nor a tuple in
    a tuple).

    Anything else could not name an item across runs: a plain object's repr holds its
    address (another in every run, and equal keys for different items are possible too), a
    float's or a list's equality is not what a repr shows.

    >>> key_text(("a", 1)), key_text(1)
    ("('a', 1)", '1')

    Raises:
        TypeError: ``value`` is not such a key.
    """

    parts = value if isinstance(value, tuple) and value else (value,)
    if not all(isinstance(v, str) or (type(v) is not bool and isinstance(v, int)) for v in parts):
        msg = (
            f"key= must return a str, an int or a non-empty tuple of them; for {where} it "
            f"returned {short_repr(value)} (of type {type(value).__name__}), which cannot name an "
            "item across runs"
        )
        raise TypeError(msg)
    plain = tuple(str.__str__(v) if isinstance(v, str) else int(v) for v in parts)
    return repr(plain if isinstance(value, tuple) else plain[0])


def key_of(options: RunOptions, key: Any, unit: Any, index: int) -> tuple[Any, str]:
    """``key=``'s value for unit ``index`` of the stream (``unit``: its items), and the text
    it is kept under (:func:`key_text`).

    Raises:
        TypeError: ``key`` returned something else than a str, an int or a tuple.
        WorkerError: ``key`` raised (stage ``"key="``, naming the unit).
    """
    label = options.label(index)
    value = call_key(key, unit, options.global_index(index), label)
    return value, key_text(value, label)


class RunLedger:
    """The finished units of one run (and of the runs before it) in an SQLite file."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        options: RunOptions,
        align: int,
        identity: RunIdentity,
    ) -> None:
        self.path = os.fspath(path)
        self.where = os.path.abspath(self.path)  # (to read it again: the cwd may change)
        self.options = options
        self.align = align
        # per output unit taken from the input and not yet delivered: (key, digest, whether
        # it runs, items)
        self.pending: dict[int, tuple[str, bytes, bool, Any]] = {}
        self.files: set[str] | None = None  # the names of the files recorded (once read)
        _check_place(self.path, identity)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        # The file becomes a ledger of this run when it is new, else is checked to be one of
        # this run: one transaction, so that a caller killed here leaves a file that is either
        # empty or a whole ledger that says whose it is.
        try:
            self.db.execute("PRAGMA synchronous=NORMAL")  # atomic across a crash of this process
            with self.db:  # (commits, or rolls back on any error)
                self.db.execute("BEGIN IMMEDIATE")
                stored = _read_ledger(self.path, self.db)  # (another process may have been first)
                for table in _TABLES if stored is None else ():
                    self.db.execute(table)
                changed = [] if stored is None else identity.check(self.path, stored)
                if stored is None or changed:  # a new ledger, or changed code accepted: now ours
                    rows = [(name, json.dumps(value)) for name, value in identity.parts.items()]
                    self.db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", rows)
                if changed:
                    msg = (
                        f"resume={self.path!r}: its results so far were computed with other "
                        f"code ({'; '.join(changed)}); they are kept (accept_changed_code=True), "
                        "and what it lacks runs with the new code"
                    )
                    warn(msg)
            if stored is None:  # (WAL once the file is a ledger: others' files stay as they are)
                self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute(_SEEN)
        except BaseException as exc:
            self.close()
            if isinstance(exc, sqlite3.Error):
                raise _refuse(self.path, str(exc)) from exc
            raise

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.db.close()

    def committed_shards(self) -> list[Shard]:
        """The files of a sink this ledger's runs committed (a crash, or an error after the
        transaction, may have cut their rename short: ``easycore._longjobs.sinks.recover``
        finishes it); read from the file again once the ledger is closed."""
        query = "SELECT temp, name, rows, bytes FROM files"
        try:
            return [Shard(*row) for row in self.db.execute(query)]
        except sqlite3.ProgrammingError:  # (closed: the run's stream ended before)
            uri = f"{pathlib.Path(self.where).as_uri()}?mode=ro"  # (never a new empty file)
            with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
                return [Shard(*row) for row in db.execute(query)]

    # -- the input ---------------------------------------------------------------------------
    def _key(self, index: int, items: Any) -> str:
        if self.options.key is None:
            return f"i:{self.options.global_index(index)}"
        return f"k:{key_of(self.options, self.options.key, items, index)[1]}"

    def _select(self, query: str, keys: list[str]) -> list[Any]:
        """The rows ``query`` (a SELECT without WHERE) finds whose key is one of ``keys``."""
        where = f" WHERE key IN ({','.join('?' * len(keys))})"
        return self.db.execute(query + where, keys).fetchall()

    def source(self, units: Iterable[Any]) -> Iterator[Any]:
        """The first-hop items of ``units`` (items, or batches), with ``CACHED`` markers in
        place of every unit the ledger holds.

        Raises:
            ValueError: a unit's items differ from what the ledger recorded under its key,
                or two units of this run have one ``key=``.
            TypeError: ``key=`` returned something else than a str, an int or a tuple.
        """
        it = iter(units)
        numbered = enumerate(iter(lambda: list(itertools.islice(it, self.align)), []))
        while block := list(itertools.islice(numbered, _LOOKUP)):
            keyed = []
            for j, items in block:
                unit = items[0] if self.align == 1 else items
                digest = item_digest(unit)  # the same in any process (sets included)
                keyed.append((j, items, unit, self._key(j, unit), digest))
            # a key= value is taken once per run (the ledger keeps one result per key): checked
            # once every key of the block is made (key='s own errors first)
            for j, *_, key, _ in keyed if self.options.key is not None else ():
                try:
                    self.db.execute("INSERT INTO seen VALUES (?, ?)", (key, j))
                except sqlite3.IntegrityError:
                    (a,) = self.db.execute("SELECT unit FROM seen WHERE key = ?", (key,)).fetchone()
                    msg = (
                        f"key {key[2:]} comes twice in this run, for {self.options.label(a)} "
                        f"and {self.options.label(j)}: key= must name each item once (the "
                        "ledger keeps one result per key)"
                    )
                    raise ValueError(msg) from None
            query = "SELECT key, digest, error FROM units"
            rows = {k: (d, e) for k, d, e in self._select(query, [k for *_, k, _ in keyed])}
            for j, items, unit, key, digest in keyed:
                recorded, error = rows.get(key, (digest, None))
                if recorded != digest:
                    msg = (
                        f"{self.options.label(j)} ({short_repr(unit)}) differs from the one "
                        f"{self.path} recorded under key {key[2:]}: the input changed since "
                        "that run; use another file, or the same input"
                    )
                    raise ValueError(msg)
                new = key not in rows or (error is not None and self.options.retry_failed)
                self.pending[j] = (key, digest, new, unit)
                yield from items if new else [CACHED] * len(items)

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
        files: list[tuple[str, str, int, int]] = []
        stored: list[tuple[int, str, Any]] = []
        # a sink's chunk of single rows shares one Wrote: pickled once, not once per unit
        blobs: dict[int, bytes] = {}
        values = self._clear_of_earlier_files(values)
        for k, value in enumerate(values):
            key, digest, new, unit = self.pending.pop(first + k)
            if not new:
                stored.append((k, key, unit))
            elif isinstance(value, Failed):
                error = str(value.exc).split("\n", 1)[0]
                rows.append((key, digest, error or type(value.exc).__name__, value.stage, None))
            else:
                if id(value) not in blobs:
                    blobs[id(value)] = cloudpickle.dumps(value)
                rows.append((key, digest, None, None, blobs[id(value)]))
                if type(value) is Wrote:  # a sink's files: recorded with their units
                    files.extend((s.name, s.temp, s.rows, s.nbytes) for s in value.shards)
        if stored:
            values = list(values)  # (the stream's own list is not changed under it)
            query = "SELECT key, error, stage, result FROM units"
            found = {key: rest for key, *rest in self._select(query, [k for _, k, _ in stored])}
            for k, key, unit in stored:
                error, stage, blob = found[key]
                if error is None:
                    values[k] = pickle.loads(blob)
                    continue
                msg = f"{self.options.label(first + k)} was set aside by an earlier run: {error}"
                exc = WorkerError(msg, stage, None, None, self.options.global_index(first + k))
                if not self.options.skip:
                    raise exc
                values[k] = Failed(exc, unit, stage or "")
        if rows:  # one transaction per chunk of results, never one per item
            with self.db:
                self.db.execute("BEGIN")
                self.db.executemany("INSERT OR REPLACE INTO units VALUES (?, ?, ?, ?, ?)", rows)
                # one transaction with the units: a file is committed exactly with its units
                self.db.executemany("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?)", files)
        return values

    def _clear_of_earlier_files(self, values: list[Any]) -> list[Any]:
        """``values`` with every file written named clear of the files recorded so far
        (:func:`~easycore._longjobs.sinks.renamed_clear_of`): a name, once committed, is
        never taken by another file (a copy only when one is renamed)."""
        if self.files is None:
            self.files = {name for (name,) in self.db.execute("SELECT name FROM files")}
        out = values
        for k, value in enumerate(values):
            if type(value) is Wrote and value.shards:
                shards = tuple(renamed_clear_of(s, self.files) for s in value.shards)
                self.files.update(s.name for s in shards)
                if shards != value.shards:
                    out = list(out) if out is values else out
                    out[k] = value._replace(shards=shards)
        return out
