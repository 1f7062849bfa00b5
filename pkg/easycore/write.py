"""Sinks: end a pipeline by writing its results to sharded files, exactly once.

>>> import tempfile, pyarrow.parquet as pq
>>> from easycore import producer, write
>>> @producer
... def square(x):
...     return {"x": x, "y": x * x}
>>> out = tempfile.mkdtemp()
>>> written = (square >> write.parquet(out)).map(range(5), devices="inline")
>>> written.rows, pq.read_table(written.files[0]).column("y").to_pylist()
(5, [0, 1, 4, 9, 16])

A sink takes the place of a consumer. The workers of the last pool write the files (the
calling process never holds the rows); each file is written under a name starting with
``.`` and renamed to its final name (``part-<first item>-<row>.<ext>``, sorting in input
order; ``-r<n>`` before the extension when a resumed run's file would take the name of an
earlier run's) when the calling process commits it. ``map`` returns an :class:`easycore.Written`
(the files, sorted, their rows and bytes); ``imap`` yields one per committed file. With
``resume=``, a file is committed together with its items in the run ledger: after a crash,
the same call writes each item that succeeded exactly once over all the files. One run at
a time writes a directory (a second is refused before any worker starts; the lock, a
``.``-file in the directory, is let go of when the run ends, and a dead process's is taken
over).

What a result becomes: a mapping is one row (with ``batch_size``, a mapping whose values are
all lists, arrays or tensors of one length is that many rows); a list of mappings or a
``pyarrow.Table``/``RecordBatch`` is many rows; ``None`` is none. Tensors and arrays become
lists (fixed-size list columns in Parquet; variable-length lists where the length differs
from row to row).
"""

from __future__ import annotations

from typing import Any

from easycore._longjobs.sinks import Sink, Written
from easycore._options import check_count

__all__ = ["Sink", "Written", "jsonl", "parquet", "webdataset"]


def parquet(
    path: str,
    *,
    rows_per_file: int | None = None,
    bytes_per_file: int | str = "256MiB",
    compression: str | None = "zstd",
    schema: Any = None,
    key_column: str | None = None,
) -> Sink:
    """A sink that writes Parquet files (``part-*.parquet``) into ``path``.

    Args:
        path: a directory (created when missing) or, with ``fsspec`` installed, an fsspec
            URL (``s3://bucket/out``, ``memory://out``).
        rows_per_file: at most this many rows per file (None: no limit).
        bytes_per_file: about this many bytes of (uncompressed) rows per file at most; an
            int or a string such as ``"256MiB"``.
        compression: a Parquet codec (``"zstd"``, ``"snappy"``, ``"gzip"``), or None.
        schema: a ``pyarrow.Schema`` the rows are cast to (a nullable column may be
            missing from a row); None: the rows' own types, the same in every file of the
            run (a column of nulls takes the type of its values; types that conflict are
            an error naming the column).
        key_column: a column to add holding each row's item key: its index in the input
            (with ``batch_size``, the batch's), or ``key=``'s value for it when the run
            has a ``key=``.

    Returns:
        A sink: end a pipeline with it (``pipeline >> write.parquet("out")``).

    Raises:
        ValueError: a limit that is not positive, an unknown compression, or
            ``key_column=""``.
        TypeError: ``path`` is not a string, or ``key_column`` not a str.

    A result whose rows do not fit the schema fails its item (``errors="skip"`` sets it
    aside, as any failure). A ``key_column`` the results hold fails the run (under
    ``errors="skip"`` too): the keys would replace that column.
    """
    if compression not in (None, "zstd", "snappy", "gzip", "brotli", "lz4", "none"):
        msg = f"compression must be zstd, snappy, gzip, brotli, lz4 or None, got {compression!r}"
        raise ValueError(msg)
    if schema is not None and not hasattr(schema, "names"):
        msg = f"schema must be a pyarrow.Schema, got {type(schema).__name__}"
        raise TypeError(msg)
    return Sink("parquet", path, rows_per_file, bytes_per_file, compression, schema, key_column)


def jsonl(
    path: str,
    *,
    rows_per_file: int | None = None,
    bytes_per_file: int | str = "256MiB",
    compression: str | None = None,
    key_column: str | None = None,
) -> Sink:
    """A sink that writes JSON Lines files (``part-*.jsonl``, or ``.jsonl.gz``) into ``path``.

    Args:
        path: a directory (created when missing) or an fsspec URL (with ``fsspec``).
        rows_per_file: at most this many rows per file (None: no limit).
        bytes_per_file: at most this many bytes of JSON per file (before compression; a
            row larger than that gets a file of its own).
        compression: None, or ``"gzip"`` (files end in ``.jsonl.gz``).
        key_column: a field to add holding each row's item key (index, or ``key=``'s value).

    Returns:
        A sink: end a pipeline with it.

    Raises:
        ValueError: a limit that is not positive, a compression other than gzip, or
            ``key_column=""``.
        TypeError: ``key_column`` is not a str.
    """
    if compression not in (None, "gzip"):
        msg = f"compression must be None or 'gzip', got {compression!r}"
        raise ValueError(msg)
    return Sink("jsonl", path, rows_per_file, bytes_per_file, compression, key_column=key_column)


def webdataset(
    path: str,
    *,
    samples_per_file: int | None = None,
    bytes_per_file: int | str = "256MiB",
) -> Sink:
    """A sink that writes WebDataset tar shards (``part-*.tar``) into ``path``.

    Each row is a sample: its entries are ``<__key__>.<field>``, one per field; ``bytes``
    and ``str`` values are written as they are, other values as JSON. ``__key__`` is the
    row's own when it has one, else its item key (the item's index, or ``key=``'s value;
    a result of several rows gets ``<key>_<row>``). A key holding ``.`` or ``/`` cannot name
    a member: it fails the run (under ``errors="skip"`` too).

    Args:
        path: a directory (created when missing) or an fsspec URL (with ``fsspec``).
        samples_per_file: at most this many samples per shard (None: no limit).
        bytes_per_file: at most about this many bytes per shard.

    Returns:
        A sink: end a pipeline with it.

    Raises:
        ValueError: a limit that is not positive.
    """
    check_count("samples_per_file", samples_per_file)
    return Sink("webdataset", path, samples_per_file, bytes_per_file)
