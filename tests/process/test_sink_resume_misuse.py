"""A sink resumed the way a hurried user resumes it (API.md sections 8 and 10): with ``key=``
and the input in another order or in parts, after an ``on_error`` that raised or was
interrupted, or over a shorter input. Each time, the committed files hold every item that
succeeded exactly once, ``Written`` counts only rows on disk, and the same call completes
the job, or the run says why it cannot. And an ``imap`` closed early leaves a directory that
reads back as one dataset."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from easycore import WorkerError, producer, write

pytestmark = pytest.mark.timeout(120)

FAIL_AT = "EASYCORE_TEST_FAIL_AT"  # (the environment is no part of a run's identity)


@producer
def row(x):
    if os.environ.get(FAIL_AT) == str(x):
        raise ValueError(f"failing at {x}")
    return {"x": x}


def on_disk(out: Path) -> Counter:
    """Every row of the committed files, read back with each format's own reader."""
    rows: Counter = Counter()
    for f in sorted(out.iterdir()):
        if f.name.endswith(".parquet") and not f.name.startswith("."):
            rows.update(pq.read_table(f).column("x").to_pylist())
        elif f.name.endswith(".jsonl") and not f.name.startswith("."):
            rows.update(json.loads(line)["x"] for line in f.read_text().splitlines())
    return rows


def rows_listed(written) -> Counter:
    rows: Counter = Counter()
    for f in written.files:
        if f.endswith(".parquet"):
            rows.update(pq.read_table(f).column("x").to_pylist())
        else:
            rows.update(json.loads(line)["x"] for line in Path(f).read_text().splitlines())
    return rows


def no_temp_files(out: Path) -> bool:
    return not [f.name for f in out.iterdir() if f.name.startswith(".part-")]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_the_input_in_parts_with_key_keeps_every_part(tmp_path, fmt):
    out, db = tmp_path / "out", str(tmp_path / "run.db")
    job = row >> getattr(write, fmt)(str(out), rows_per_file=50)
    for part in (range(0, 200), range(200, 400)):
        written = job.map(part, devices=2, resume=db, key=lambda x: x)
        assert written.rows == 200
        assert rows_listed(written) == Counter(part)
    assert on_disk(out) == Counter(range(400))  # (the second part took none of the first's)
    again = job.map(range(0, 200), devices=2, resume=db, key=lambda x: x)
    assert rows_listed(again) == Counter(range(200)) and again.rows == 200
    assert on_disk(out) == Counter(range(400))
    assert no_temp_files(out)


@pytest.mark.parametrize("devices", ["inline", 2])
def test_a_resume_with_key_over_the_input_in_another_order(tmp_path, monkeypatch, devices):
    out, db = tmp_path / "out", str(tmp_path / "run.db")
    names = [f"img{k:04d}" for k in range(300)]
    job = row >> write.parquet(str(out), rows_per_file=25)
    monkeypatch.setenv(FAIL_AT, "img0150")
    with pytest.raises(WorkerError):
        job.map(names, devices=devices, resume=db, key=lambda n: n)
    assert on_disk(out)  # (some files were committed before the failure)
    monkeypatch.delenv(FAIL_AT)
    written = job.map(names[::-1], devices=devices, resume=db, key=lambda n: n)  # (listdir order)
    assert on_disk(out) == Counter(names)
    assert rows_listed(written) == Counter(names) and written.rows == 300
    assert no_temp_files(out)


@pytest.mark.parametrize("devices", ["inline", 2])
@pytest.mark.parametrize("raised", [RuntimeError, KeyboardInterrupt])
def test_an_on_error_that_raises_leaves_a_run_that_resumes(tmp_path, monkeypatch, devices, raised):
    """A logger that breaks, or Ctrl-C while on_error runs: the run stops; the same call
    with the same resume= completes the job."""
    out, db = tmp_path / "out", str(tmp_path / "run.db")
    job = row >> write.jsonl(str(out), rows_per_file=10)

    def on_error(failure):
        raise raised("the logger broke")

    monkeypatch.setenv(FAIL_AT, "3")
    with pytest.raises(raised):
        job.map(range(100), devices=devices, errors="skip", on_error=on_error, resume=db)
    assert no_temp_files(out)
    failures = []
    written = job.map(
        range(100), devices=devices, errors="skip", on_error=failures.append, resume=db
    )
    expected = Counter(x for x in range(100) if x != 3)
    assert on_disk(out) == expected
    assert rows_listed(written) == expected and written.rows == 99
    assert [f.index for f in failures] == [3]  # (set aside by the first run, reported again)


@pytest.mark.parametrize("devices", ["inline", 2])
def test_a_resume_over_a_shorter_input_is_refused(tmp_path, devices):
    """The files of the first run hold items the shorter input lacks: no Written can be
    both complete and true, so the run says the input changed."""
    out, db = tmp_path / "out", str(tmp_path / "run.db")
    job = row >> write.parquet(str(out), rows_per_file=30)
    assert job.map(range(200), devices=devices, resume=db).rows == 200
    with pytest.raises(ValueError, match="input changed") as info:
        job.map(range(100), devices=devices, resume=db)
    assert "part-" in str(info.value)  # (it names a file that holds items beyond the input)
    assert on_disk(out) == Counter(range(200))  # (nothing on disk was touched)
    again = job.map(range(200), devices=devices, resume=db)
    assert again.rows == 200 and rows_listed(again) == Counter(range(200))


@producer
def late_type(x):
    return {"x": x, "v": None if x < 150 else x * 1.5}  # (a column null in the first files)


@pytest.mark.parametrize("resume", [False, True])
def test_an_imap_closed_early_leaves_a_directory_that_reads_as_one_dataset(tmp_path, resume):
    out = tmp_path / "out"
    kw = {"resume": str(tmp_path / "run.db")} if resume else {}
    it = (late_type >> write.parquet(str(out), rows_per_file=20)).imap(range(300), devices=2, **kw)
    rows = 0
    for written in it:
        rows += written.rows
        if rows >= 200:  # (files of both kinds committed: those of x < 150, and after)
            break
    it.close()
    table = pq.read_table(out)  # (the files written before the type was known: rewritten)
    assert str(table.schema.field("v").type) == "double"
    assert table.num_rows == sum(on_disk(out).values()) and no_temp_files(out)


def test_a_resume_with_another_sink_option_names_the_option(tmp_path):
    out, db = str(tmp_path / "out"), str(tmp_path / "run.db")
    (row >> write.parquet(out, rows_per_file=10)).map(range(20), devices="inline", resume=db)
    with pytest.raises(ValueError, match=r"rows_per_file=10 -> 5") as info:
        (row >> write.parquet(out, rows_per_file=5)).map(range(20), devices="inline", resume=db)
    assert "compression" not in str(info.value)  # (only what differs)


@producer
def typed_by_env(x):
    if os.environ.get(FAIL_AT) == "first" and x >= 4:
        raise ValueError("stop")
    return {"a": x if os.environ.get(FAIL_AT) == "first" else f"s{x}"}


def test_a_file_its_schema_refuses_is_never_committed(tmp_path, monkeypatch):
    """A resumed run whose rows conflict with the committed files' types fails naming the
    column; the refused file takes no name (though the ledger recorded it), and the
    directory still reads back as one dataset."""
    out, db = tmp_path / "out", str(tmp_path / "run.db")
    job = typed_by_env >> write.parquet(str(out), rows_per_file=2)
    monkeypatch.setenv(FAIL_AT, "first")
    with pytest.raises(WorkerError):
        job.map(range(8), devices="inline", resume=db)
    monkeypatch.setenv(FAIL_AT, "second")
    for _ in range(2):  # (and again: no run adds a conflicting file)
        with pytest.raises(ValueError):
            job.map(range(8), devices="inline", resume=db)
        assert sorted(pq.read_table(out).column("a").to_pylist()) == [0, 1, 2, 3]
        assert no_temp_files(out)
