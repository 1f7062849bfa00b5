"""Sinks: the end of a pipeline that writes results to sharded files (``easycore.write``).

A :class:`Sink` describes where and how (format, directory or fsspec URL, limits per file);
it rides in the last pool's stages to its workers, where :class:`ShardWriter` turns each
chunk's results into rows and writes them under a temporary name (a ``.``-file). What goes
back to the caller is small: a :class:`Wrote` per unit (its row count), the chunk's last
written unit also carrying the :class:`Shard` s it wrote (temporary name, final name, rows,
bytes). The caller commits a shard by renaming it (:func:`commit_shard`); with ``resume=``
the run ledger records the shard with its units first, in one transaction, and a later run
finishes any rename a crash cut short (:func:`recover`).

A Parquet run's files share its types (:class:`RunSchema`): each shard carries its schema,
and the files written before a worker knew a column's type are written again as the run
ends, so that the directory reads back as one dataset.

A file holds units of one chunk only (one reply of one worker), so it is committed exactly
when its units are: a worker that dies mid-chunk leaves a ``.``-file nobody commits (its
units run again elsewhere, into a file of their own), and :func:`sweep` removes such files.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import json
import os
import pathlib
import posixpath
import re
import types
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import attrs

from easycore._errors import short_repr, some
from easycore._exec.core.protocol import Broken, is_cached
from easycore._options import check_count, parse_bytes

__all__ = [
    "RunSchema",
    "Shard",
    "ShardWriter",
    "Sink",
    "SinkError",
    "SinkFiles",
    "Written",
    "Wrote",
    "check_fresh",
    "commit_shard",
    "recover",
    "renamed_clear_of",
    "sweep",
]

_TEMP_PREFIX = ".part-"  # a file being written; a committed one starts "part-"
# the temporary files easycore writes (sweep removes these only: not a user's own ".part-x")
_TEMP = re.compile(
    r"\.part-(part-)?\d{12,}-\d{6,}(-r\d+)?(-[0-9a-f]+)?\.(parquet|jsonl|jsonl\.gz|tar)\Z"
)
_EXTENSIONS = (".parquet", ".jsonl.gz", ".jsonl", ".tar")  # (a committed file's)
# what webdataset adds to each sample it reads (a member so named makes a shard unreadable)
_READ_FIELDS = ("__url__", "__local_path__")
_ROWS = "easycore.rows"  # a Parquet file of rows with no columns: their count
Errors = list[tuple[int, BaseException]]  # units that could not be written: (position, why)


class Shard(NamedTuple):
    """A file a worker wrote: ``temp`` while being written, ``name`` once committed (both
    relative to the sink's directory)."""

    temp: str
    name: str
    rows: int
    nbytes: int
    schema: bytes | None = None  # a Parquet file's Arrow schema, serialized (None: unknown)


class Wrote(NamedTuple):
    """What a written unit's result becomes: its row count, and for the last written unit of
    a chunk, the shards that hold the chunk's rows."""

    rows: int
    shards: tuple[Shard, ...] = ()


@attrs.frozen
class Written:
    """What a sink wrote: ``map`` returns one for the whole run, ``imap`` one per file.

    Attributes:
        files: the committed files (paths or URLs), sorted; they sort in input order.
        rows: the rows they hold.
        bytes: their size on disk.
    """

    files: tuple[str, ...] = attrs.field(converter=tuple, default=())
    rows: int = 0
    bytes: int = 0


def _check_key_column(_: Any, __: Any, name: Any) -> None:
    if name is not None and (not isinstance(name, str) or not name):
        msg = f"key_column must be a column name (a non-empty str) or None, got {name!r}"
        raise (ValueError if name == "" else TypeError)(msg)


def _as_path(value: Any) -> str:
    """A directory as a str: a ``pathlib.Path`` (any ``os.PathLike``) is taken as its path."""
    value = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(value, str) or not value:
        msg = f"path must be a directory (a str or pathlib.Path) or an fsspec URL, got {value!r}"
        raise TypeError(msg)
    return value


@attrs.frozen(repr=False)
class Sink:
    """Where a pipeline's results go: made by ``easycore.write.parquet`` / ``jsonl`` /
    ``webdataset``. It ends a pipeline in place of a consumer."""

    kind: str
    path: str = attrs.field(converter=_as_path)
    rows_per_file: int | None = attrs.field(
        default=None, validator=lambda _, a, value: check_count(a.name, value)
    )
    bytes_per_file: int = attrs.field(
        default=256 << 20, converter=lambda value: parse_bytes(value, "bytes_per_file")
    )
    compression: str | None = None
    schema: Any = None
    key_column: str | None = attrs.field(default=None, validator=_check_key_column)
    align: int = 1  # first-hop units per unit of the writing pool (set when planned)

    @property
    def name(self) -> str:
        return f"write.{self.kind}"

    @property
    def ext(self) -> str:
        ext = {"parquet": ".parquet", "jsonl": ".jsonl", "webdataset": ".tar"}[self.kind]
        return ext + ".gz" if self.kind == "jsonl" and self.compression == "gzip" else ext

    is_sink = True  # (what the stages of a pool tell apart from producers by)

    def __repr__(self) -> str:
        return f"{self.name}({self.path!r})"

    def __rshift__(self, other: object) -> Any:
        msg = (
            f"nothing can follow the sink {self!r}, but {other!r} does: a sink ends a "
            "pipeline, in place of a consumer"
        )
        raise TypeError(msg)

    def identity(self) -> dict[str, Any]:
        """What a run ledger keeps of this sink: resuming into another place or format
        would leave the results of the first run where the second does not look."""
        fields = attrs.asdict(self, recurse=False, filter=lambda a, _: a.name != "align")
        return {**fields, "schema": None if self.schema is None else str(self.schema)}

    def location(self, name: str) -> str:
        """The path or URL of file ``name`` as :class:`Written` names it."""
        return posixpath.join(self.path if "://" in self.path else os.path.abspath(self.path), name)


# -- the caller's side: commit, recover, sweep ---------------------------------------------
# the calls a sink makes of an fsspec filesystem, on a local directory (without fsspec: it is
# optional; a local directory's listings are not cached)
_LOCAL = types.SimpleNamespace(
    open=open,
    exists=os.path.exists,
    isdir=os.path.isdir,
    mv=os.replace,
    rm=os.unlink,
    makedirs=os.makedirs,
    ls=lambda path, detail=False: os.listdir(path),
    cat_file=lambda path: pathlib.Path(path).read_bytes(),
    invalidate_cache=lambda path: None,
)


class SinkFiles:
    """The files of a sink's directory, local (``local``) or on an fsspec filesystem
    (``fs``), by name."""

    def __init__(self, sink: Sink) -> None:
        self.local = "://" not in sink.path
        self.fs: Any = _LOCAL
        self.root = os.path.abspath(sink.path)
        if not self.local:
            try:
                import fsspec
            except ImportError as exc:  # pragma: no cover - fsspec is installed in tests
                msg = f"writing to {sink.path!r} needs fsspec: pip install 'easycore[fsspec]'"
                raise ImportError(msg) from exc
            self.fs, self.root = fsspec.core.url_to_fs(sink.path)

    def join(self, name: str) -> str:
        return posixpath.join(self.root, name)

    def makedirs(self) -> None:
        self.fs.makedirs(self.root, exist_ok=True)

    def exists(self, name: str) -> bool:
        self.fs.invalidate_cache(self.root)  # (listings cached before the workers wrote)
        return bool(self.fs.exists(self.join(name)))

    def rename(self, a: str, b: str) -> None:
        self.fs.mv(self.join(a), self.join(b))

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.join(name))

    def names(self) -> list[str]:
        self.fs.invalidate_cache(self.root)
        if not self.fs.exists(self.root):
            return []
        return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root, detail=False)]

    def open(self, name: str, mode: str = "wb") -> Any:
        try:
            return self.fs.open(self.join(name), mode)
        except OSError as exc:  # the directory's fault, not an item's: the run fails
            msg = f"cannot open {self.join(name)} ({exc}): the sink's directory must be writable"
            raise SinkError(msg) from exc


def commit_shard(sink: Sink, shard: Shard) -> str:
    """Make ``shard`` visible under its final name (idempotent: a shard committed before,
    by an earlier run, is left as it is); returns its path or URL.

    Raises:
        FileNotFoundError: neither name is there (the run must not count its rows).
    """
    files = SinkFiles(sink)
    if files.exists(shard.temp):
        files.rename(shard.temp, shard.name)
    elif not files.exists(shard.name):
        msg = (
            f"{sink.location(shard.name)} cannot be committed: the file a worker wrote "
            f"({shard.temp}) is not there (removed meanwhile, or written where this process "
            "does not see it)"
        )
        raise FileNotFoundError(msg)
    return sink.location(shard.name)


def renamed_clear_of(shard: Shard, taken: Container[str]) -> Shard:
    """``shard``, to be committed under a name no file of ``taken`` has: a file is named
    after the input position it begins at, and a resumed run with ``key=`` may hold other
    items at the positions of an earlier run's files (its input in another order, or in
    parts), so such a file is ``part-<position>-<row>-r<n>.<ext>`` instead."""
    if shard.name not in taken:
        return shard
    ext = next(e for e in _EXTENSIONS if shard.name.endswith(e))
    stem, n = shard.name.removesuffix(ext), 1
    while f"{stem}-r{n}{ext}" in taken:
        n += 1
    return shard._replace(name=f"{stem}-r{n}{ext}")


def recover(sink: Sink, committed: Iterable[Shard]) -> list[str]:
    """Before a resumed run writes: finish the commits a crash cut short (a ledger holds
    them), then remove every other temporary file. Returns the names of the committed
    files that are gone (under neither name)."""
    files = SinkFiles(sink)
    names = set(files.names())
    gone = []
    for shard in committed:
        if shard.temp in names:
            files.rename(shard.temp, shard.name)
        elif shard.name not in names:
            gone.append(shard.name)
    sweep(files)
    return gone


def check_fresh(sink: Sink, known: Iterable[Shard] = ()) -> None:
    """Raises ValueError when the sink's directory holds committed files that are not this
    run's (``known``: those its ledger recorded): a run would replace them by name."""
    ours = {shard.name for shard in known}
    foreign = sorted({n for n in SinkFiles(sink).names() if n.startswith("part-")} - ours)
    if foreign:
        msg = (
            f"{sink.path!r} already holds files of another run ({some(foreign, 3)}): a "
            "sink writes into a directory of its own. Use another directory, "
            "remove those files, or resume= the run that wrote them"
        )
        raise ValueError(msg)


def sweep(files: SinkFiles) -> None:
    """Remove the temporary files left in a sink's directory (a dead worker's, or those of
    chunks whose results were not kept)."""
    for name in files.names():
        if _TEMP.match(name):
            files.remove(name)


class RunSchema:
    """The caller's view of a Parquet run's files, so that the directory reads back as one
    dataset (``pyarrow.parquet.read_table(dir)`` takes the first file's schema and casts the
    others to it): each file's schema is merged into the run's as it is committed (a column
    of nulls takes the type another file has; arrays of several lengths are variable-length
    lists), and when the run ends, the files written before their worker knew a column's
    type are written again in the run's schema. A true conflict fails the run.

    The common case costs nothing: the workers send their schemas serialized, and files of
    one schema compare as bytes, with no ``pyarrow`` in the calling process.
    """

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.files: dict[str, bytes] = {}  # committed file -> its schema, serialized
        self.kinds: dict[bytes, None] = {}  # the schemas seen, in order
        self.schema: Any = None  # the run's, once files of several schemas were seen

    def admit(self, shard: Shard) -> None:
        """Merge ``shard``'s schema into the run's, before it is committed.

        Raises:
            ValueError: a column's type in ``shard`` conflicts with another file's.
        """
        if shard.schema is not None:
            self.files[shard.name] = shard.schema
        if not shard.schema or shard.schema in self.kinds:  # (b"": rows of no columns)
            return
        self.kinds[shard.schema] = None
        if len(self.kinds) > 1:
            run = self.schema if self.schema is not None else _schema_of(next(iter(self.kinds)))
            try:
                self.schema = _unify([run, _schema_of(shard.schema)])
            except SinkError as exc:
                msg = f"{self.sink!r}: {shard.name} does not read with the run's other files: {exc}"
                raise ValueError(msg) from None

    def settle(self) -> int:
        """When the run has written everything: write again, in the run's schema, each file
        whose schema differs (the files of an earlier run, with ``resume=``, included).
        Returns by how many bytes the files rewritten grew (``Written.bytes`` counts them)."""
        if self.sink.kind != "parquet":
            return 0
        files = SinkFiles(self.sink)
        for name in files.names():
            if name.startswith("part-") and name.endswith(self.sink.ext) and name not in self.files:
                import pyarrow.parquet as pq

                with files.open(name, "rb") as f:
                    schema = pq.read_schema(f)
                self.admit(Shard("", name, 0, 0, _serialized(schema)))
        bare = b"" in self.files.values()  # files of rows with no columns (results {})
        if bare and not self.kinds:
            msg = (
                f"{self.sink!r}: every row of the run is empty (results {{}}), and a Parquet "
                "file cannot hold rows with no columns: give the rows a column, or write "
                "them with write.jsonl"
            )
            raise ValueError(msg)
        if self.schema is None and not bare:
            return 0
        run = self.schema if self.schema is not None else _schema_of(next(iter(self.kinds)))
        stale = {b for b in self.kinds if not _schema_of(b).equals(run)} | {b""}
        return sum(
            _rewrite(files, self.sink, name, run)
            for name, kind in self.files.items()
            if kind in stale
        )


# -- the worker's side: results to rows, rows to files ---------------------------------------
class RowError(Exception):
    """A result that cannot become rows of this sink (named with its item by the caller)."""


class SinkError(ValueError):
    """What no item of the run can be written with, whatever the item (a key column the
    results hold, a key that cannot name a tar member, a directory that cannot be
    written): the run fails at its first occurrence, under ``errors="skip"`` too."""


def _named(row: Mapping[Any, Any]) -> dict[str, Any]:
    """``row`` with its column names as strings, as every format keeps them.

    Raises:
        SinkError: two of its names are one string (``1`` and ``"1"``).
    """
    named = {k if type(k) is str else str(k): v for k, v in row.items()}
    if len(named) < len(row):
        name = next(n for n in named if sum(str(k) == n for k in row) > 1)
        msg = (
            f"the results have columns {[k for k in row if str(k) == name]}, all named "
            f"{name!r} (column names are strings): rename all but one of them"
        )
        raise SinkError(msg)
    return named


def _to_numpy(value: Any) -> Any:
    """An array that is a tensor (it has ``detach``) as a numpy array, on the CPU; any other
    array as it is (duck-typed: torch is not imported for it)."""
    return value.detach().cpu().numpy() if hasattr(value, "detach") else value


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "tolist")


def _is_column(value: Any) -> bool:
    if _is_array(value):  # (a tensor too)
        return len(value.shape) >= 1
    return isinstance(value, list | tuple) or hasattr(value, "to_pylist")  # (pyarrow arrays)


def _py(value: Any) -> Any:
    """A value as plain Python (for JSON): arrays and tensors as lists."""
    if _is_array(value) or hasattr(value, "as_py"):
        return value.tolist() if _is_array(value) else value.as_py()
    if isinstance(value, Mapping):
        return {str(k): _py(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_py(v) for v in value]
    return value


def rows_of(value: Any, batched: bool) -> tuple[dict[str, list[Any]], int]:
    """One result as columns ``({name: values}, n_rows)``.

    A mapping is one row, unless the pool was given a batch and every value is a column
    (a list, tuple, array or tensor) of one length: then it is that many rows. A list of
    mappings, a ``pyarrow`` Table or RecordBatch is many rows; ``None`` is none.

    Raises:
        RowError: anything else, or columns of different lengths.
    """
    if value is None:
        return {}, 0
    if hasattr(value, "to_pydict") and hasattr(value, "num_rows"):  # pyarrow Table/RecordBatch
        return {name: value.column(name) for name in value.schema.names}, int(value.num_rows)
    if isinstance(value, Mapping):
        value = _named(value)
        if batched and value and all(_is_column(v) for v in value.values()):
            lengths = {len(v) for v in value.values()}
            if len(lengths) != 1:
                msg = f"its columns have different lengths ({sorted(lengths)})"
                raise RowError(msg)
            return value, lengths.pop()
        return {k: [v] for k, v in value.items()}, 1
    if isinstance(value, list | tuple) and all(isinstance(r, Mapping) for r in value):
        rows = [_named(row) for row in value]
        names = dict.fromkeys(k for row in rows for k in row)  # (in the order first seen)
        return {k: [row.get(k) for row in rows] for k in names}, len(rows)
    msg = (
        "a result written by a sink must be a mapping (one row), a list of mappings, a "
        f"mapping of columns or a pyarrow Table; got {short_repr(value)} (of type "
        f"{type(value).__name__})"
    )
    raise RowError(msg)


def _arrow_column(values: Any) -> Any:
    """A column as a pyarrow array: arrays of one shape become fixed-size lists."""
    import numpy as np
    import pyarrow as pa

    if isinstance(values, pa.Array | pa.ChunkedArray):
        return values
    if isinstance(values, list | tuple) and values:
        kinds = {type(v) for v in values}  # (one pass, no attribute looked up per value)
        if kinds == {np.ndarray} or all(_is_array(v) for v in values):
            shapes = {v.shape for v in values}
            if len(shapes) == 1:  # (np.array: the same as np.stack here, 2.5x as fast)
                plain = kinds == {np.ndarray}  # (else tensors too: on the CPU, as numpy)
                values = np.array(values) if plain else np.stack([_to_numpy(v) for v in values])
            elif len({len(s) for s in shapes}) == 1 and len({v.dtype for v in values}) == 1:
                # arrays of one dtype whose lengths differ: each row as a file of it alone
                # would hold it, in the type that holds them all (a variable-length list
                # where lengths differ, fixed-size lists inside where they do not)
                rows = [pa.table({"_": _arrow_column(v[None])}) for v in values]
                return pa.concat_tables(rows, promote_options="permissive")["_"]
    if _is_array(values) and len(values.shape) >= 1:
        arr = np.ascontiguousarray(_to_numpy(values))
        out = _flat(arr.reshape(-1))
        for depth in range(arr.ndim - 1, 0, -1):
            if arr.shape[depth]:
                out = pa.FixedSizeListArray.from_arrays(out, int(arr.shape[depth]))
            else:  # (a fixed-size list may not be empty: lists of no values)
                offsets = np.zeros(int(np.prod(arr.shape[:depth])) + 1, np.int32)
                out = pa.ListArray.from_arrays(_flat(offsets), out)
        return out
    if (plain := _plain_column(values)) is not None:
        return plain
    try:
        return pa.array([_to_numpy(v) for v in values])  # (tensors as numpy, as above)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
        return pa.array([_py(v) for v in values])


# Columns of numbers, bools and strings are built from their buffers, not with pa.array:
# that call imports pandas when it is installed (its first call costs a worker ~0.2 s, as
# much as writing 20,000 rows), and a numpy array's values are not copied.
def _flat(arr: Any) -> Any:
    """A 1-D contiguous numpy array as a pyarrow array (numbers and bools: their buffer)."""
    import numpy as np
    import pyarrow as pa

    kind, native = arr.dtype.kind, arr.dtype.byteorder in "=|"
    if kind in "iuf" and native:
        typ = pa.from_numpy_dtype(arr.dtype)
        return pa.Array.from_buffers(typ, len(arr), [None, pa.py_buffer(arr)])
    if kind == "b":
        bits = np.packbits(arr, bitorder="little")
        return pa.Array.from_buffers(pa.bool_(), len(arr), [None, pa.py_buffer(bits)])
    return pa.array(arr)


def _plain_column(values: Any) -> Any:
    """A list of Python ints, floats, bools, strs or bytes, with or without None, as a
    pyarrow array, the same as ``pa.array`` makes; None for anything else."""
    import numpy as np
    import pyarrow as pa

    if not isinstance(values, list | tuple) or not values:
        return None
    kinds = {type(v) for v in values}
    missing = type(None) in kinds
    kinds.discard(type(None))
    if not kinds:
        return pa.nulls(len(values))
    kind: Any = float if kinds == {int, float} else kinds.pop() if len(kinds) == 1 else None
    if kind not in (str, bytes, bool, int, float):
        return None
    full = [kind() if v is None else v for v in values] if missing else values  # ("", 0...)
    if kind in (str, bytes):
        raw = [v.encode() for v in full] if kind is str else full
        offsets = np.zeros(len(raw) + 1, np.int64)
        np.cumsum([len(d) for d in raw], out=offsets[1:])
        buffers = [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(raw))]
        large = pa.large_string() if kind is str else pa.large_binary()
        out = pa.Array.from_buffers(large, len(raw), buffers)
        if offsets[-1] < 1 << 31:  # (as pa.array makes it: 32-bit offsets where they do)
            out = out.cast(pa.string() if kind is str else pa.binary())
    else:
        try:
            out = _flat(np.array(full, {bool: np.bool_, int: np.int64, float: np.float64}[kind]))
        except OverflowError:  # an int beyond int64: pa.array's business
            return None
    if not missing:
        return out
    valid = _flat(np.array([v is not None for v in values])).buffers()[1]
    return pa.Array.from_buffers(out.type, len(values), [valid, *out.buffers()[1:]])


def _table(cols: Mapping[str, Any], n: int) -> Any:
    import pyarrow as pa

    if not cols:
        return pa.table({"_": pa.nulls(n)}).select([])
    arrays = [_arrow_column(v) for v in cols.values()]
    # (Parquet holds no struct of no fields: a column of nulls)
    arrays = [pa.nulls(len(a)) if a.type == pa.struct([]) else a for a in arrays]
    return pa.Table.from_arrays(arrays, names=list(cols))


def _together(units: list[_Unit]) -> Any:
    """The units' rows as one table: columns joined first when every unit has the same
    names and every column a list of values (one conversion for the chunk), else a table per
    unit (a batch's arrays: no copy)."""
    names = list(units[0].cols)
    merged: dict[str, Any] = {}
    for name in names if all(list(u.cols) == names for u in units) else ():
        pieces = [u.cols[name] for u in units]
        if all(type(p) is list for p in pieces):
            merged[name] = [v for p in pieces for v in p]
    if len(merged) == len(names):
        return _table(merged, sum(u.n for u in units))
    return _concat([_table(u.cols, u.n) for u in units])


def _concat(tables: list[Any]) -> Any:
    """Tables of one schema as one (rows of no columns too: ``pa.concat_tables`` drops
    those)."""
    import pyarrow as pa

    if not tables[0].num_columns:
        return _table({}, sum(t.num_rows for t in tables))
    return pa.concat_tables(tables)


class _Unit(NamedTuple):
    pos: int  # position in the chunk
    key: int  # the first-hop unit whose key rows carry (before a per-row offset)
    cols: dict[str, Any]
    n: int
    keys: list[Any]  # each row's item key


class ShardWriter:
    """A sink in a worker: writes a chunk's rows to temporary files of the sink's format."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.files = SinkFiles(sink)  # (the caller made the directory: commit.DirLock)
        self.schema = sink.schema  # fixed by the first rows written when not given
        if sink.kind == "parquet":
            # loaded here, as the worker starts, not in its first chunk: that chunk's time
            # sizes the next ones (a file each), and ~50 ms of imports in one item's time
            # made a run's first ten files a few rows each
            import pyarrow.parquet  # noqa: F401

    def write(
        self, base: int, values: list[Any], keys: tuple[bool, Sequence[Any] | None] | None = None
    ) -> Errors:
        """Write units ``base + k`` (``values[k]``) that did not fail (a failed one's value
        is passed over): each is replaced by a :class:`Wrote`, the last written one carrying
        the shards. Returns the ``(position, error)`` of the units that could not be written
        (their value: None).

        ``keys``: ``(batched, keys)`` from the run (None: ``(False, None)``): whether the
        units are batches (the pool's ``batch_size``: a mapping of columns is then many rows,
        whatever the units' types), and the ``key=`` value of each first-hop unit of the
        chunk (from its first) when the run has one; rows are keyed by their item's index
        otherwise.

        The cyclic garbage collector is paused meanwhile: turning a chunk into columns makes
        a few small containers per row and no cycles, and the collections their count
        triggers (walking every result of the chunk) cost a third of the write."""
        collect = gc.isenabled()
        gc.disable()
        try:
            batched, by = keys or (False, None)
            parquet = self.sink.kind == "parquet"
            if parquet and not batched and self._single_rows(base, values, by):
                return []
            units, errors = self._units(base, values, by, batched)
            shards, bad = self._parquet(units) if parquet else self._row_files(units)
            errors += bad
            for k, _ in errors:
                values[k] = None
            failed = {k for k, _ in bad}
            kept = [u for u in units if u.pos not in failed]
            _mark(values, [u.pos for u in kept], [u.n for u in kept], shards)
            return sorted(errors, key=lambda e: e[0])
        finally:
            if collect:
                gc.enable()

    def _units(
        self, base: int, values: list[Any], keys: Sequence[Any] | None, batched: bool
    ) -> tuple[list[_Unit], Errors]:
        """The rows of each unit to write (their key column added), or its error."""
        from easycore._exec.core.outcomes import Failed  # (here: _exec imports this module)

        units: list[_Unit] = []
        errors: Errors = []
        for k, value in enumerate(values):
            # not written: the run ledger holds it (CACHED), or it failed (a worker's None
            # with an error, a Ray actor's Broken, an inline Failed)
            if is_cached(value) or isinstance(value, Broken | Failed):
                continue
            try:
                cols, n = rows_of(value, batched)
            except Exception as exc:
                errors.append((k, exc))
                continue
            first, align = (base + k) * self.sink.align, self.sink.align
            # each row's item: one each when the rows are as many as those, else the first
            firsts = range(first, first + n) if align > 1 and n == align else [first] * n
            index = self._item_keys(base, list(firsts), keys)
            self._add_keys(cols, index)
            units.append(_Unit(k, first, cols, n, index))
        return units, errors

    def _single_rows(self, base: int, values: list[Any], keys: Sequence[Any] | None) -> bool:
        """Parquet, when every unit written is one row (a dict, for an item) with the same
        columns, which is most chunks: the columns are taken from the rows at once, with no
        object per row. False (nothing done) when a unit is anything else, or the rows do not
        fit the file's schema: the general path then names the units at fault."""
        names = values[0].keys() if values and type(values[0]) is dict else ()
        if not names or any(type(row) is not dict or row.keys() != names for row in values):
            return False
        at = range(len(values))
        cols = _named({name: [row[name] for row in values] for name in names})
        firsts = [(base + k) * self.sink.align for k in at]
        try:
            if self.sink.key_column is not None:  # (no keys looked up for nothing)
                self._add_keys(cols, self._item_keys(base, firsts, keys))
            table = self._fit(_table(cols, len(values)))
        except Exception:
            return False
        ones = [1] * len(at)
        _mark(values, at, ones, self._parquet_files(table, firsts, ones))
        return True

    def _item_keys(self, base: int, firsts: list[int], keys: Sequence[Any] | None) -> list[Any]:
        """The item key of each first-hop unit of ``firsts``: its index, or its ``key=``
        value (``keys``: the chunk's, from its first unit)."""
        if keys is None:
            return firsts
        return [keys[f - base * self.sink.align] for f in firsts]

    def _add_keys(self, cols: dict[str, Any], keys: list[Any]) -> None:
        """``keys`` (each row's item key) as the column ``key_column`` of ``cols``, when the
        sink has one. In Parquet, tuple keys (``key=``'s str and int tuples) are structs of
        fields ``"0"``, ``"1"``, ... (a list column would need one type; a key of fewer
        places is null in the others).

        Raises:
            SinkError: the results hold a column so named; or keys whose places hold
                different types (the run's keys conflict, whichever item came first).
        """
        name = self.sink.key_column
        if name is None:
            return
        if name in cols:
            msg = (
                f"key_column={name!r} names a column the results hold: the item keys would "
                "replace it. Give key_column another name, or rename that column"
            )
            raise SinkError(msg)
        cols[name] = keys
        if self.sink.kind != "parquet" or not any(type(k) is tuple for k in keys):
            return
        import pyarrow as pa

        try:
            cols[name] = pa.array([{str(i): v for i, v in enumerate(k)} for k in keys])
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, AttributeError) as exc:
            msg = (
                f"key_column {name!r}: the keys {short_repr(keys)} hold different types in "
                f"one place ({exc}): key= must give tuples of the same types at each place"
            )
            raise SinkError(msg) from None

    def _names(self, key: int, offset: int) -> tuple[str, str]:
        stem, ext = f"{key:012d}-{offset:06d}", self.sink.ext
        tag = os.urandom(6).hex()  # (not uuid: importing it costs every worker ~5 ms)
        return f"{_TEMP_PREFIX}{stem}-{tag}{ext}", f"part-{stem}{ext}"

    # -- formats ---------------------------------------------------------------------------
    def _parquet(self, units: list[_Unit]) -> tuple[list[Shard], Errors]:
        units = [u for u in units if u.n]
        bad: Errors = []
        try:
            table = self._fit(_together(units)) if units else None
        except Exception:
            good, tables = [], []
            for u in units:  # find the units that do not fit, naming each
                try:
                    tables.append(self._fit(_table(u.cols, u.n)))
                    good.append(u)
                except Exception as exc:
                    bad.append((u.pos, _unit_error(exc, "its rows do not fit the file's schema")))
            units = good  # (tables in the schema the last one widened, if one did)
            table = _concat([_conform(t, self.schema) for t in tables]) if tables else None
        if table is None:
            return [], bad
        return self._parquet_files(table, [u.key for u in units], [u.n for u in units]), bad

    def _parquet_files(self, table: Any, keys: list[int], counts: list[int]) -> list[Shard]:
        """``table``'s rows written to files of at most ``rows_per_file`` rows and about
        ``bytes_per_file`` bytes; its rows are ``counts[i]`` rows of each unit ``keys[i]``
        in turn (a file is named after the unit and row it begins with)."""
        total, sink = table.num_rows, self.sink
        per = sink.rows_per_file or total
        if table.nbytes:
            per = min(per, max(1, int(sink.bytes_per_file // max(table.nbytes / total, 1))))
        starts = list(itertools.accumulate(counts, initial=0))
        shards = []
        schema = _serialized(table.schema)
        for first in range(0, total, per):
            n = min(per, total - first)
            at = bisect.bisect_right(starts, first) - 1  # (the unit the file begins in)
            temp, name = self._names(keys[at], first - starts[at])
            part = table.slice(first, n)
            if not table.num_columns:  # (Parquet keeps no count of rows of no columns)
                part = _table({}, n).replace_schema_metadata({_ROWS: str(n)})
            with self.files.open(temp) as f:
                _write_parquet(part, f, sink.compression)
                shards.append(Shard(temp, name, n, f.tell(), schema))
        return shards

    def _fit(self, table: Any) -> Any:
        """``table`` in the worker's schema: ``schema=``, else that of the rows it wrote so
        far, widened to hold these (a column of nulls so far takes a type, arrays of another
        length make a variable-length list column, a new column is added; the caller writes
        the files written before again, see :class:`RunSchema`)."""
        if self.schema is None or table.schema.equals(self.schema):
            self.schema = table.schema
            return table
        given = self.sink.schema is not None
        schema = self.schema if given else _unify([self.schema, table.schema])
        table = _conform(table, schema, given)
        self.schema = schema
        return table

    def _split(
        self, encoded: list[tuple[_Unit, list[Any]]]
    ) -> tuple[list[tuple[int, int, list[bytes]]], Errors]:
        """Encoded rows cut into files ``(key, offset, rows)``, and the units whose rows
        repeat a name (WebDataset's ``__key__``; None: not checked) in their file: those are
        left out, and the others cut again."""
        bad: Errors = []
        while True:
            files: list[tuple[int, int, list[bytes]]] = []
            size, seen, repeated = 0, set(), {}
            for u, rows in encoded:
                for j, (name, row) in enumerate(rows):
                    full = files and len(files[-1][2]) == self.sink.rows_per_file
                    if full or not files or size + len(row) > self.sink.bytes_per_file:
                        files.append((u.key, j, []))
                        size, seen = 0, set()
                    files[-1][2].append(row)
                    size += len(row)
                    if name is not None and name in seen:
                        repeated.setdefault(u.pos, name)
                    seen.add(name)
            if not repeated:
                return files, bad
            for pos, name in repeated.items():
                msg = (
                    f"its __key__ {name!r} is repeated in its shard (webdataset would merge "
                    "or drop those samples): give each sample a __key__ of its own"
                )
                bad.append((pos, RowError(msg)))
            encoded = [(u, rows) for u, rows in encoded if u.pos not in repeated]

    def _row_files(self, units: list[_Unit]) -> tuple[list[Shard], Errors]:
        """JSON lines or WebDataset files: each unit's rows encoded (``(name, bytes)`` each),
        cut into files, each file's rows joined and finished (gzip; a tar's end), written."""
        encode = _sample if self.sink.kind == "webdataset" else _line
        encoded = []
        bad: Errors = []
        for u in units:
            try:
                cells = (_py({k: v[j] for k, v in u.cols.items()}) for j in range(u.n))
                encoded.append((u, [encode(u, j, row) for j, row in enumerate(cells)]))
            except Exception as exc:
                bad.append((u.pos, _unit_error(exc, "its rows cannot be written")))
        files, repeated = self._split(encoded)
        shards = []
        for key, offset, rows in files:
            temp, name = self._names(key, offset)
            data = b"".join(rows)
            if self.sink.kind == "webdataset":  # the end-of-archive blocks, the record's padding
                import tarfile

                data += b"\0" * (2 * tarfile.BLOCKSIZE)
                data += b"\0" * (-len(data) % tarfile.RECORDSIZE)
            elif self.sink.compression == "gzip":
                import gzip

                data = gzip.compress(data, mtime=0)
            with self.files.open(temp) as f:
                f.write(data)
            shards.append(Shard(temp, name, len(rows), len(data)))
        return shards, bad + repeated


def _line(_: _Unit, __: int, row: dict[str, Any]) -> tuple[None, bytes]:
    """A JSON line."""
    return None, (_json(row) + "\n").encode()


def _sample(u: _Unit, j: int, row: dict[str, Any]) -> tuple[str, bytes]:
    """Row ``j`` of unit ``u`` as a WebDataset sample: its key, and its tar members."""
    import tarfile  # (here: only a WebDataset sink pays for it)

    key = row.pop("__key__", None)
    for name in _READ_FIELDS:  # (a sample read back: webdataset adds them again)
        row.pop(name, None)
    if not row:
        msg = (
            "its sample has no entries (a tar holds a sample as its files: one with "
            "none is not there when read back): give it a field besides __key__"
        )
        raise RowError(msg)
    if key is None:  # (a unit's rows of one item: <key>_<row>)
        key = f"{u.keys[j]}_{j}" if u.n > 1 and len(set(u.keys)) == 1 else u.keys[j]
    key = str(key)
    if not key or "." in key or "/" in key:
        msg = (
            f"a __key__ must be a name with no '.' or '/' (webdataset splits member "
            f"names on them), got {key!r}"
        )
        raise (SinkError if key else RowError)(msg)  # (empty: that item's error)
    members = []  # one sample's members; the end blocks come once per file
    for field, value in row.items():
        if "/" in field:
            msg = f"a field name may not hold '/' (webdataset drops it): {field!r}"
            raise RowError(msg)
        if isinstance(value, bytes | bytearray | memoryview):
            data = bytes(value)
        else:  # (text as it is, anything else as JSON)
            data = (value if isinstance(value, str) else _json(value)).encode()
        info = tarfile.TarInfo(f"{key}.{field}")
        info.size, info.mode = len(data), 0o644
        pad = b"\0" * (-len(data) % tarfile.BLOCKSIZE)
        members += [info.tobuf(tarfile.USTAR_FORMAT), data, pad]
    return key, b"".join(members)


def _mark(values: list[Any], at: Sequence[int], rows: list[int], shards: list[Shard]) -> None:
    """The units at positions ``at`` (``rows[i]`` rows each) written: each value a
    :class:`Wrote`, the last one carrying the chunk's ``shards``."""
    one = Wrote(1)  # (shared: a chunk of single rows makes no object per row)
    for k, n in zip(at, rows, strict=True):
        values[k] = one if n == 1 else Wrote(n)
    if at:
        values[at[-1]] = Wrote(rows[-1], tuple(shards))


def _unit_error(exc: Exception, what: str) -> Exception:
    """A unit's error as the sink reports it: a :class:`SinkError` as it is (it fails the
    run), anything else a :class:`RowError` saying ``what``."""
    return exc if isinstance(exc, SinkError) else RowError(f"{what}: {exc}")


def _unify(schemas: Sequence[Any]) -> Any:
    """One schema holding the rows of every schema in ``schemas`` (columns in the order
    first seen; a column some lack is nullable).

    Raises:
        SinkError: a column's types conflict, naming it and both types (the run's own rows:
            which of them came first decides nothing, so the run fails rather than one item).
    """
    import pyarrow as pa

    fields: dict[str, Any] = {}
    for field in (field for schema in schemas for field in schema):
        have = fields.setdefault(field.name, field)
        try:  # (pyarrow's permissive promotion: a null type gives way, numbers widen, lists
            # of several lengths are variable-length lists, structs merge field by field)
            pair = [pa.schema([have]), pa.schema([field])]
            merged = pa.unify_schemas(pair, promote_options="permissive").field(0)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            msg = (
                f"column {field.name!r} holds {field.type} where other rows have {have.type}: "
                "give the sink a schema= that fits every row "
                "(write.parquet(..., schema=pyarrow.schema(...)))"
            )
            raise SinkError(msg) from None
        lacking = any(field.name not in schema.names for schema in schemas)
        fields[field.name] = merged.with_nullable(merged.nullable or lacking)
    return pa.schema(list(fields.values()), metadata=schemas[0].metadata)


def _serialized(schema: Any) -> bytes:
    """A Parquet file's schema as workers send it (b"": no columns)."""
    return schema.serialize().to_pybytes() if len(schema) else b""


def _schema_of(serialized: bytes) -> Any:
    import pyarrow as pa

    return pa.ipc.read_schema(pa.py_buffer(serialized))


def _conform(table: Any, schema: Any, given: bool = False) -> Any:
    """``table`` cast to ``schema``: a column it lacks is nulls where the schema lets it be
    (else an error), one the schema lacks is an error (``given``: the user's ``schema=``).

    Raises:
        RowError: naming the column and both types, where the rows do not fit ``schema=``.
        SinkError: the same, where the run's own rows conflict (no ``schema=``): which of
            them came first decides nothing, so the run fails rather than one item.
    """
    import pyarrow as pa

    extra = [n for n in table.schema.names if n not in schema.names]
    if extra:
        msg = f"columns {extra} are not in the schema= given (its columns: {schema.names})"
        raise RowError(msg)
    cols = []
    for field in schema:
        have = field.name in table.schema.names
        if not have and not field.nullable:
            msg = f"column {field.name!r} is missing, and the schema says it is not nullable"
            raise RowError(msg)
        col = table.column(field.name) if have else pa.nulls(table.num_rows)
        try:
            cols.append(col.cast(field.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            where = "the schema= given has" if given else "the run's other rows have"
            msg = (
                f"column {field.name!r} holds {col.type} where {where} {field.type} "
                f"({exc}): give the sink a schema= that fits every row"
            )
            raise (RowError if given else SinkError)(msg) from None
    return pa.Table.from_arrays(cols, schema=schema)


def _rewrite(files: SinkFiles, sink: Sink, name: str, schema: Any) -> int:
    """Write committed file ``name`` again in ``schema`` (under a temporary name first: a
    crash meanwhile leaves the file as it was); returns by how many bytes it grew."""
    import pyarrow.parquet as pq

    with files.open(name, "rb") as f:
        old = f.seek(0, 2)  # (its size; pyarrow reads at the positions it needs)
        table = pq.read_table(f)
        if not table.num_columns:  # (rows of no columns: read back as none)
            table = _table({}, int((table.schema.metadata or {}).get(_ROWS.encode(), 0)))
        table = _conform(table, schema)
    temp = _TEMP_PREFIX + name
    with files.open(temp) as f:
        _write_parquet(table, f, sink.compression)
        new = f.tell()
    files.rename(temp, name)
    return int(new - old)


def _leaves(name: str, typ: Any) -> Iterator[tuple[str, Any]]:
    """The Parquet column paths under a field, with their types (a list's values are
    ``name.list.element``, a map's ``name.key_value.key`` and ``.value``, a struct's fields
    ``name.field``)."""
    import pyarrow as pa

    if pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
        yield from _leaves(f"{name}.list.element", typ.value_type)
    elif pa.types.is_map(typ):
        yield from _leaves(f"{name}.key_value.key", typ.key_type)
        yield from _leaves(f"{name}.key_value.value", typ.item_type)
    elif pa.types.is_struct(typ):
        for i in range(typ.num_fields):
            yield from _leaves(f"{name}.{typ.field(i).name}", typ.field(i).type)
    else:
        yield name, typ


def _write_parquet(table: Any, f: Any, compression: str | None) -> None:
    """``table`` as a Parquet file: dictionary encoding for the columns it can shrink (not
    floating point: an embedding's values are all distinct, and trying a dictionary on them
    costs ~40% of the write), and statistics for the columns a reader can filter on (not
    those inside lists)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = [leaf for field in table.schema for leaf in _leaves(field.name, field.type)]
    pq.write_table(
        table,
        f,
        compression=compression or "none",
        use_dictionary=[p for p, t in paths if not pa.types.is_floating(t)],
        write_statistics=[p for p, _ in paths if ".list." not in p],
    )


def _json(value: Any) -> str:
    """``value`` as strict JSON: NaN and infinities as null (``json.dumps`` writes them as
    ``NaN`` and ``Infinity``, which JSON readers refuse)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:  # (read back, each NaN or infinity is None)
        text = json.loads(json.dumps(value), parse_constant=lambda _: None)
        return json.dumps(text, ensure_ascii=False, allow_nan=False)
