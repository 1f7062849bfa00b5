"""easycore.write guards (API.md section 10): one run at a time writes a directory, a commit
whose file is gone fails the run, a resumed run never counts rows that are gone, and what
does not depend on the item is refused before any worker starts or fails the whole run
(under errors="skip" too), never item by item."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from easycore import WorkerError, producer, write
from helpers import wait_for

pytestmark = pytest.mark.timeout(120)


@producer
def row(x):
    return {"x": x}


def rows_of(written) -> list[int]:
    return sorted(r["x"] for f in written.files for r in pq.read_table(f).to_pylist())


def started(marker: Path):
    """A producer whose workers leave ``marker`` when they start (init)."""

    def init():
        marker.touch()

    @producer(init=init)
    def mark(x, state):
        return {"x": x}

    return mark


# -- 1. one run at a time ------------------------------------------------------------------
@pytest.mark.parametrize("devices", ["inline", 2])
def test_a_second_run_of_this_process_is_refused_while_the_first_writes(tmp_path, devices):
    out = tmp_path / "out"
    first = (row >> write.parquet(str(out), rows_per_file=2)).imap(range(10), devices="inline")
    part = next(first)  # the first run holds the directory, a file committed
    assert [n for n in os.listdir(out) if n.startswith(".")]  # its lock: a "."-file
    assert pq.read_table(out).column("x").to_pylist() == [0, 1]  # not read as a dataset file
    assert part.rows == 2
    marker = tmp_path / "started"
    with pytest.raises(ValueError, match="another run") as info:
        (started(marker) >> write.parquet(str(out))).map(range(5), devices=devices)
    assert str(out) in str(info.value) and str(os.getpid()) in str(info.value)
    assert not marker.exists()  # refused before any worker started
    first.close()  # a run that ends, however it ends, lets go of the directory
    assert not [n for n in os.listdir(out) if n.startswith(".")]


def test_another_runner_of_this_process_is_refused(tmp_path):
    out = tmp_path / "out"
    pipeline = row >> write.jsonl(str(out))
    with pipeline.open(devices="inline") as a, pipeline.open(devices="inline") as b:
        it = a.imap(range(4))
        with pytest.raises(ValueError, match="another run"):
            b.map(range(4))
        assert sum(p.rows for p in it) == 4
        assert b.is_active  # a refused run leaves the runner as it was


def test_an_fsspec_directory_is_locked_too():
    fsspec = pytest.importorskip("fsspec")
    url = "memory://guard/locked"
    first = (row >> write.jsonl(url, rows_per_file=2)).imap(range(6), devices="inline")
    assert next(first).rows == 2
    with pytest.raises(ValueError, match="another run"):
        (row >> write.jsonl(url)).map(range(3), devices="inline")
    assert sum(part.rows for part in first) == 4
    names = [
        p.rsplit("/", 1)[-1] for p in fsspec.filesystem("memory").ls("/guard/locked", detail=False)
    ]
    assert len(names) == 3 and not [n for n in names if n.startswith(".")]


JOB = textwrap.dedent(
    """
    import os, sys, time
    from easycore import producer, write

    @producer
    def hang(x):
        open(sys.argv[2], "w").close()
        time.sleep(600)
        return {"x": x}

    (hang >> write.parquet(sys.argv[1])).map(range(3), devices="inline")
    """
)


def test_another_process_is_refused_and_its_lock_taken_over_once_it_died(tmp_path):
    out, ready = tmp_path / "out", tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    other = subprocess.Popen([sys.executable, "-c", JOB, str(out), str(ready)], env=env)
    try:
        assert wait_for(ready.exists, 60)
        with pytest.raises(ValueError, match=f"pid {other.pid}") as info:
            (row >> write.parquet(str(out))).map(range(5), devices=2)
        assert str(out) in str(info.value)
        other.send_signal(signal.SIGKILL)  # dead, not yet reaped (a zombie): its lock stays
        assert wait_for(lambda: psutil.Process(other.pid).status() == psutil.STATUS_ZOMBIE)
        assert [n for n in os.listdir(out) if n.startswith(".")]
        written = (row >> write.parquet(str(out))).map(range(5), devices=2)  # taken over
    finally:
        other.kill()
        other.wait()
    assert rows_of(written) == list(range(5))
    assert not [n for n in os.listdir(out) if n.startswith(".")]


# -- 2. URLs the workers cannot reach, files that are gone ---------------------------------
def test_memory_url_with_worker_processes_is_refused_before_they_start(tmp_path):
    pytest.importorskip("fsspec")
    marker = tmp_path / "started"
    with pytest.raises(ValueError, match="memory://"):
        (started(marker) >> write.parquet("memory://guard/out")).map(range(4), devices=2)
    assert not marker.exists()


def test_a_commit_whose_file_is_gone_fails_the_run(tmp_path):
    """(The commit step alone: a worker's file vanishing between its write and its commit
    cannot be timed from outside.)"""
    from easycore._exec.core.books import PRIMED
    from easycore._longjobs.commit import commit_written, committing
    from easycore._longjobs.sinks import Shard, Wrote

    gone = Shard(
        ".part-000000000000-000000-0a0b0c.parquet", "part-000000000000-000000.parquet", 3, 9
    )

    def segments():
        yield PRIMED
        yield 0, [Wrote(3, (gone,))]

    os.makedirs(tmp_path / "out")
    stream = committing(segments(), write.parquet(str(tmp_path / "out")))
    assert next(stream) is PRIMED
    with pytest.raises(FileNotFoundError, match=r"part-000000000000-000000\.parquet"):
        list(commit_written(stream))
    assert os.listdir(tmp_path / "out") == []  # (the lock let go of)


# -- 3. a resumed run whose committed files are gone ---------------------------------------
@pytest.mark.parametrize("devices", ["inline", 2])
def test_resume_names_the_committed_files_that_are_gone(tmp_path, devices):
    out, db = tmp_path / "out", tmp_path / "run.db"
    pipeline = row >> write.parquet(str(out), rows_per_file=3)
    first = pipeline.map(range(10), devices=devices, resume=str(db))
    gone = Path(first.files[1])
    gone.unlink()
    with pytest.raises(ValueError, match=gone.name) as info:
        pipeline.map(range(10), devices=devices, resume=str(db))
    assert str(db) in str(info.value)
    gone.write_bytes(Path(first.files[0]).read_bytes())  # (any file: now it is there)
    assert pipeline.map(range(10), devices=devices, resume=str(db)).rows == 10


# -- 6. the key column ---------------------------------------------------------------------
@producer
def with_id(x):
    return {"id": f"own{x}", "x": x}


@pytest.mark.parametrize("devices", ["inline", 2])
def test_a_key_column_the_results_hold_fails_the_run_under_skip(tmp_path, devices):
    failed = []
    sink = write.parquet(str(tmp_path / "out"), key_column="id")
    with pytest.raises(WorkerError, match="'id'"):
        (with_id >> sink).map(range(20), devices=devices, errors="skip", on_error=failed.append)
    assert failed == []  # the run failed: no item set aside one by one
    assert not [n for n in os.listdir(tmp_path / "out") if n.startswith(".")]


def test_column_names_are_strings_two_that_are_one_string_clash(tmp_path):
    @producer
    def both(x):
        return {1: x, "1": -x}

    with pytest.raises(WorkerError, match="'1'"):
        (both >> write.jsonl(str(tmp_path / "a"))).map(range(4), devices="inline", errors="skip")

    @producer
    def numbered(x):
        return {1: x}

    with pytest.raises(WorkerError, match="'1'"):  # key_column "1" is column 1 of the results
        (numbered >> write.jsonl(str(tmp_path / "b"), key_column="1")).map(
            range(4), devices="inline"
        )


def test_key_column_must_be_a_str():
    with pytest.raises(TypeError, match="key_column"):
        write.parquet("out", key_column=5)
    with pytest.raises(TypeError, match="key_column"):
        write.jsonl("out", key_column=("a",))


def test_key_column_must_name_a_column():
    for make in (write.parquet, write.jsonl):
        with pytest.raises(ValueError, match="key_column"):
            make("out", key_column="")


@pytest.mark.parametrize("text", ["", "garbled{", '{"pid": 1}'])
def test_a_lock_that_cannot_be_read_is_named_with_what_to_do(tmp_path, text):
    (tmp_path / ".easycore-lock").write_text(text)
    with pytest.raises(ValueError) as info:
        (row >> write.parquet(str(tmp_path))).map(range(2), devices="inline")
    message = str(info.value)
    assert ".easycore-lock" in message and "cannot be read" in message
    assert "remove" in message and "pid None" not in message


# -- 11. directories that cannot be written, keys that cannot name a member ----------------
def test_a_sink_path_that_is_a_file_is_refused_before_any_worker_starts(tmp_path):
    marker = tmp_path / "started"
    (tmp_path / "file").write_text("mine")
    for path in (tmp_path / "file", tmp_path / "file" / "out"):
        with pytest.raises(ValueError, match=str(path)):
            (started(marker) >> write.jsonl(str(path))).map(range(4), devices=2, errors="skip")
    assert not marker.exists()
    assert (tmp_path / "file").read_text() == "mine"


def test_an_open_runner_makes_its_directory_again_for_its_next_run(tmp_path):
    out = tmp_path / "out"
    with (row >> write.parquet(str(out))).open(devices=2) as runner:
        assert rows_of(runner.map(range(3))) == [0, 1, 2]
        shutil.rmtree(out)  # (the workers made it when they started)
        assert rows_of(runner.map(range(3, 6))) == [3, 4, 5]


@pytest.mark.parametrize("devices", ["inline", 2])
def test_a_webdataset_key_with_an_extension_fails_the_run_under_skip(tmp_path, devices):
    failed = []

    @producer
    def sample(x):
        return {"cls": x}

    with pytest.raises(WorkerError, match=r"img0\.jpg"):
        (sample >> write.webdataset(str(tmp_path / "out"))).map(
            range(6),
            devices=devices,
            key=lambda x: f"img{x}.jpg",
            errors="skip",
            on_error=failed.append,
        )
    assert failed == []


# -- 16. limits, other people's files, the ledger's place ----------------------------------
def test_samples_per_file_is_named_in_its_error():
    with pytest.raises(ValueError, match="samples_per_file"):
        write.webdataset("out", samples_per_file=0)


def test_cleanup_keeps_files_of_ones_own_that_start_with_dot_part(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    mine = [out / ".part-notes.txt", out / ".part-1.parquet"]
    for f in mine:
        f.write_text("mine")
    written = (row >> write.parquet(str(out))).map(range(5), devices=2)
    assert rows_of(written) == list(range(5))
    assert all(f.read_text() == "mine" for f in mine)


def test_a_ledger_inside_the_sink_directory_is_refused(tmp_path):
    out = tmp_path / "out"
    marker = tmp_path / "started"
    db = out / "run.db"
    with pytest.raises(ValueError, match=r"run\.db") as info:
        (started(marker) >> write.parquet(str(out))).map(range(3), devices=2, resume=str(db))
    assert str(out) in str(info.value)
    assert not marker.exists() and not db.exists()
    with (
        (row >> write.parquet(str(out))).open(devices="inline") as runner,
        pytest.raises(ValueError, match="beside"),
    ):
        runner.map(range(3), resume=str(db))
    assert not db.exists()


@pytest.mark.parametrize("what", ["binary", "directory"])
def test_a_lock_of_binary_garbage_or_a_directory_is_named(tmp_path, what):
    """Whatever stands at the lock's name, the error names it (no UnicodeDecodeError)."""
    out = tmp_path / "out"
    out.mkdir()
    if what == "binary":
        (out / ".easycore-lock").write_bytes(b"\xff\xfe garbage")
    else:
        (out / ".easycore-lock").mkdir()
    with pytest.raises(ValueError, match=r"lock file that cannot be read.*remove that file"):
        (producer(lambda x: {"x": x}) >> write.parquet(str(out))).map(range(3), devices="inline")


def test_a_lock_whose_pid_another_process_reused_is_taken_over(tmp_path):
    """After a crash the dead run's pid may belong to another process by now: the lock
    records when its process started, so a live pid of another start time is not a run."""
    out = tmp_path / "out"
    out.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"pid": other.pid, "since": 1, "host": socket.gethostname(), "started": "?"}
        (out / ".easycore-lock").write_text(json.dumps(lock))
        written = (row >> write.parquet(str(out))).map(range(5), devices="inline")
        assert rows_of(written) == list(range(5))
        del lock["since"]  # (a lock that does not say: a live pid may be a run)
        (tmp_path / "again").mkdir()
        (tmp_path / "again" / ".easycore-lock").write_text(json.dumps(lock))
        with pytest.raises(ValueError, match=f"pid {other.pid}"):
            (row >> write.parquet(str(tmp_path / "again"))).map(range(5), devices="inline")
    finally:
        other.kill()
        other.wait()
