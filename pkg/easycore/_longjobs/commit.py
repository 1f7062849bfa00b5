"""The caller's side of a sink: one run at a time writes its directory, and the files the
workers wrote are committed as their units arrive.

A worker of the last pool writes a chunk's rows under temporary ``.``-names and replies
with counts and the shards' names only (``easycore._longjobs.sinks``). Here, in the calling process,
each shard is committed (renamed to its final name) when the segment holding its units is
delivered: after the run ledger recorded the units and the shard in one transaction, with
``resume=`` (``RunLedger.record`` runs before this). Whatever is left under a temporary
name when the run ends (a dead worker's file, a reply that was dropped) is removed.

The directory is the run's while it writes: :func:`committing` takes the lock
(:class:`DirLock`, a ``.``-file in the directory naming the run) before any work goes out
and lets go of it when the run ends, however it ends. :func:`check_sink` asks, before any
worker starts, what does not depend on the items: can the workers reach the directory, can
it be written, does another run hold it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from easycore._errors import some
from easycore._longjobs.sinks import (
    RunSchema,
    Sink,
    SinkFiles,
    Written,
    Wrote,
    check_fresh,
    commit_shard,
    recover,
    sweep,
)
from easycore._reaping import start_time

__all__ = ["alive", "check_sink", "commit_written", "committing", "sink_of", "total_written"]

LOCK_NAME = ".easycore-lock"  # a "."-file: the directory still reads back as a dataset


def sink_of(stages: Sequence[Any]) -> Sink | None:
    """The sink a pool's stages end in (``easycore.write``), or None."""
    return stages[-1] if stages and isinstance(stages[-1], Sink) else None


# -- one run at a time ---------------------------------------------------------------------
class DirLock:
    """A run's hold on its sink's directory: the file :data:`LOCK_NAME` in it, holding the
    run's pid, host, start time and a token, created only where none is (``O_EXCL``: a
    hard link of a file already written, so that it is never seen half-written).

    A lock whose process is dead (same host, pid gone) is taken over. On an fsspec
    filesystem the lock is created with mode ``"xb"`` where the filesystem has it, else
    after looking whether one is there (two runs starting in the same instant may then both
    write); a lock of another host is never taken over (its process cannot be asked).
    """

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.files = SinkFiles(sink)
        self.path = self.files.join(LOCK_NAME)
        self.text = json.dumps(
            {
                "pid": os.getpid(),
                "since": start_time(os.getpid()),  # (tells a reused pid from this run's)
                "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "token": os.urandom(8).hex(),
            }
        )
        self.held = False

    def take(self) -> None:
        """Hold the directory, or raise.

        Raises:
            ValueError: a live run holds it (naming the directory and that run), or the
                directory cannot be written.
        """
        for _ in range(5):
            stale = self.check()
            if stale is not None and not self.files.local:
                self.files.remove(LOCK_NAME)
            elif stale is not None:  # a dead run's lock, unless another run took it over
                aside = f"{self.path}.{os.urandom(4).hex()}"
                with contextlib.suppress(FileNotFoundError):
                    os.rename(self.path, aside)
                    # a live lock, made after the dead one was read: put it back
                    if pathlib.Path(aside).read_text() != stale:
                        with contextlib.suppress(FileExistsError):
                            os.link(aside, self.path)
                    os.unlink(aside)
            try:
                if self._create():
                    self.held = True
                    return
            except OSError as exc:
                msg = f"{self.sink!r}: cannot write in {self.sink.path!r} ({exc})"
                raise ValueError(msg) from exc
        msg = f"{self.sink!r}: could not lock {self.path} (runs keep taking it over)"
        raise ValueError(msg)

    def check(self) -> str | None:
        """Create the directory when it is missing; the text of the lock in it when that
        is a dead run's (to take over), else None.

        Raises:
            ValueError: the path is a file, the directory cannot be made or written, or a
                live run holds it (naming it), or the lock cannot be read.
        """
        sink, root, fs = self.sink, self.files.root, self.files.fs
        try:
            if fs.exists(root) and not fs.isdir(root):
                msg = f"{sink!r}: {root} is a file; a sink writes into a directory"
                raise ValueError(msg)
            self.files.makedirs()
        except OSError as exc:
            msg = f"{sink!r}: the directory {root} cannot be made ({exc})"
            raise ValueError(msg) from exc
        if self.files.local and not os.access(root, os.W_OK | os.X_OK):
            msg = f"{sink!r}: the directory {root} cannot be written"
            raise ValueError(msg)
        if (other := self.read()) is None:
            return None
        try:
            run = json.loads(other)
            pid, host, started = int(run["pid"]), str(run["host"]), run["started"]
        except (ValueError, KeyError, TypeError):
            msg = (
                f"{self.sink.path!r} holds a lock file that cannot be read ({self.path}: "
                f"{'empty' if not other.strip() else 'not a lock easycore wrote'}), so "
                "whether a run is writing the directory is unknown: if no run is writing it, "
                "remove that file"
            )
            raise ValueError(msg) from None
        if host == socket.gethostname() and not alive(pid, run.get("since")):
            return other  # (a dead run's: taken over)
        who = "this process" if pid == os.getpid() and host == socket.gethostname() else "it"
        msg = (
            f"{self.sink.path!r} is being written by another run (pid {pid} on {host}, "
            f"started {started}; {who} holds {self.path}): one run at a time writes a "
            "directory. Wait for that run to end, or write into another directory; if that "
            "run is over and left its lock behind, remove the lock file"
        )
        raise ValueError(msg)

    def end(self) -> None:
        """The run is over: remove its temporary files, then let go of the directory
        (idempotent; the lock is removed only while it is still this run's)."""
        if not self.held:
            return
        self.held = False
        try:
            sweep(self.files)
        finally:
            if self.read() == self.text:
                self.files.remove(LOCK_NAME)

    def read(self) -> str | None:
        """The text of the lock in the directory, or None when there is none."""
        try:
            self.files.fs.invalidate_cache(self.files.root)
            return bytes(self.files.fs.cat_file(self.path)).decode(errors="replace")
        except (FileNotFoundError, NotADirectoryError):
            return None
        except IsADirectoryError:
            return "(a directory)"  # (refused as a lock easycore did not write)

    def _create(self) -> bool:
        data, fs = self.text.encode(), self.files.fs
        if self.files.local:
            temp = f"{self.path}.{os.getpid()}-{os.urandom(4).hex()}"
            pathlib.Path(temp).write_bytes(data)
            try:
                os.link(temp, self.path)  # (fails where a lock is: O_EXCL with its text)
            except FileExistsError:
                return False
            finally:
                os.unlink(temp)
            return True
        try:
            with fs.open(self.path, "xb") as f:
                f.write(data)
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError):  # no exclusive create: look, then write
            if self.files.exists(LOCK_NAME):
                return False
            fs.pipe_file(self.path, data)
        return True


def alive(pid: int, since: int | None = None) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, killed and not yet reaped,
    does not; nor does another process that got its pid, when ``since``, the start time
    the lock recorded, says otherwise)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process)
        return True
    if since is not None and start_time(pid) not in (None, since):
        return False
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # (no /proc: macOS)
        return True


def check_sink(sink: Sink, in_caller: bool) -> None:
    """Before any worker starts: refuse a sink the run could not write into, whatever the
    items. The directory is created.

    Raises:
        ValueError: a ``memory://`` URL with workers in other processes (``in_caller``
            False: each has a memory of its own), a path that is a file, a directory that
            cannot be made or written, or one another live run is writing.
    """
    lock = DirLock(sink)
    protocol = getattr(lock.files.fs, "protocol", "")
    if not in_caller and "memory" in (protocol if isinstance(protocol, tuple) else (protocol,)):
        msg = (
            f"{sink!r}: a memory:// filesystem lives in one process, and the workers (other "
            "processes, or Ray actors) cannot reach this one's; use devices='inline', or a "
            "directory or URL every worker reaches"
        )
        raise ValueError(msg)
    lock.check()


# -- commits -------------------------------------------------------------------------------
def committing(stream: Iterator[Any], sink: Sink, ledger: Any = None) -> Iterator[Any]:
    """``stream`` (a run's segments, ``PRIMED`` first) with each :class:`Wrote`'s shards
    committed and replaced by a :class:`Written` per file, the run holding the directory.

    When primed, before anything of ``stream`` runs: the directory is locked, the commits
    a crash cut short are finished (``ledger``: the run ledger, whose files they are), the
    temporary files removed, and a directory holding another run's files refused. When the
    run ends, however it ends (an error, an early close, the stream dropped), its temporary
    files are removed, the lock let go of and ``ledger`` closed.

    Raises:
        ValueError: another run holds the directory, the directory holds files of another
            run, or files ``ledger`` records are gone (their rows would be counted).
        FileNotFoundError: a file to commit is not there.
    """
    lock = DirLock(sink)
    schema: RunSchema | None = None
    rejected: set[str] = set()  # files whose commit failed (a schema refused): not finished
    early = False
    try:
        lock.take()
        known = ledger.committed_shards() if ledger is not None else []
        if gone := recover(sink, known):
            msg = (
                f"{len(gone)} file(s) that resume={ledger.path!r} records as written are gone "
                f"from {sink.path!r}: {some(sorted(gone), 3)}. Restore them, or "
                "start afresh: a new resume= path, and a directory without that run's files"
            )
            raise ValueError(msg)
        check_fresh(sink, known)
        schema = RunSchema(sink)  # (Parquet: the directory reads back as one dataset)
        yield next(stream)  # PRIMED
        rows = [0, 0]  # the rows of the units delivered, and of the files delivered
        delivered: set[str] = set()
        for start, values in stream:
            written = []
            if ledger is not None:  # (only a resumed run's units and files may disagree)
                rows[0] += sum(v.rows for v in values if type(v) is Wrote)
            shards = [shard for v in values if type(v) is Wrote for shard in v.shards]
            rejected = {shard.name for shard in shards}  # (each, until it is committed)
            for shard in shards:
                schema.admit(shard)  # (before the file takes its name: a conflict fails)
                written.append(Written((commit_shard(sink, shard),), shard.rows, shard.nbytes))
                rejected.discard(shard.name)
                rows[1] += shard.rows
                delivered.add(shard.name)
            yield start, written
        if ledger is not None and rows[0] != rows[1]:
            raise _input_changed(ledger, delivered, *rows)
        if grew := schema.settle():  # (files rewritten in the run's schema: their new sizes)
            yield None, [Written((), 0, grew)]
        schema = None  # (settled)
    except GeneratorExit:
        early = True  # (an imap closed early)
        raise
    finally:
        try:
            stream.close()  # type: ignore[attr-defined]
        finally:
            try:
                _wind_up(sink, lock, ledger, schema, rejected, early)
            finally:
                lock.end()
                if ledger is not None:  # (the stream closes it once it ran; not before)
                    ledger.close()


def _wind_up(
    sink: Sink,
    lock: DirLock,
    ledger: Any,
    schema: RunSchema | None,
    rejected: set[str],
    early: bool,
) -> None:
    """However a run ended: the commits ``ledger`` recorded that an error after its
    transaction cut short (an ``on_error`` that raised, Ctrl-C in it) are finished, not
    swept away, but for files whose commit failed (``rejected``: a schema refused one);
    then an ``imap`` closed ``early`` settles its files' schema, so that they read back as
    one dataset (else its resume does). Best effort: an error here must not hide the run's
    own."""
    if ledger is not None and lock.held:
        with contextlib.suppress(Exception):
            recover(sink, [s for s in ledger.committed_shards() if s.name not in rejected])
    if early and schema is not None:
        with contextlib.suppress(Exception):
            schema.settle()


def _input_changed(ledger: Any, delivered: set[str], unit_rows: int, file_rows: int) -> ValueError:
    """A resumed run whose units and files disagree (``unit_rows`` rows of this input's
    items, ``file_rows`` in the files delivered): an earlier run's files hold items this
    input lacks (it is shorter, or misses some), so no ``Written`` is both whole and true."""
    others = sorted({s.name for s in ledger.committed_shards()} - delivered)
    named = some(others or sorted(delivered), 3)
    msg = (
        f"resume={ledger.path!r}: the files of the run it records hold other items than this "
        f"input's ({unit_rows} row(s) of this input's items, {file_rows} in the files this "
        f"run reaches; {named}): the input changed since that run (it is shorter, or lacks "
        "items). Give the same input, or start afresh: a new resume= path and directory"
    )
    return ValueError(msg)


def commit_written(stream: Iterator[Any]) -> Iterator[Written]:
    """The :class:`Written` of each committed file in ``stream`` (:func:`committing`'s
    segments); closing it closes ``stream``."""
    with contextlib.closing(stream):  # type: ignore[type-var]
        for _, written in stream:
            yield from written


def total_written(parts: Iterable[Written]) -> Written:
    """The files, rows and bytes of ``parts`` together (files sorted)."""
    parts = list(parts)
    files = sorted(name for part in parts for name in part.files)
    return Written(files, sum(p.rows for p in parts), sum(p.bytes for p in parts))
