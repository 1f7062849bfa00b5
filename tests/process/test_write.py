"""easycore.write (API.md section 10): sinks written by the last pool's workers, committed by
the caller, read back with each format's own reader."""

from __future__ import annotations

import gc
import gzip
import json
import os
import random
import signal
import tarfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from easycore import Failure, WorkerError, Written, consumer, producer, write
from helpers import first_time

pytestmark = pytest.mark.timeout(120)


@producer
def row(x):
    return {"x": x, "y": float(x) / 2, "pid": os.getpid()}


def parquet_rows(written: Written) -> list[dict]:
    out = []
    for f in written.files:
        out.extend(pq.read_table(f).to_pylist())
    return out


def leftovers(directory) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(".")]


class TestComposition:
    def test_a_sink_ends_a_pipeline(self, tmp_path):
        sink = write.parquet(str(tmp_path))
        p = row >> sink
        assert p.sink is sink and p.consumer is None
        assert "write.parquet" in repr(p)

    def test_nothing_follows_a_sink(self, tmp_path):
        sink = write.jsonl(str(tmp_path))
        with pytest.raises(TypeError, match="nothing can follow the sink"):
            sink >> row
        with pytest.raises(TypeError, match="nothing can follow the sink"):
            (row >> sink) >> row

    def test_a_consumer_next_to_a_sink(self, tmp_path):
        @consumer(init=0)
        def total(acc, x):
            return acc + 1

        with pytest.raises(TypeError, match="cannot follow the consumer"):
            row >> total >> write.parquet(str(tmp_path))
        with pytest.raises(TypeError, match="nothing can follow the sink"):
            row >> write.parquet(str(tmp_path)) >> total

    def test_not_with_submit_or_distributed(self, tmp_path):
        p = row >> write.parquet(str(tmp_path))
        with pytest.raises(ValueError, match="distributed"):
            p.map(range(3), devices=1, distributed=True)
        with p.open(devices="inline") as runner, pytest.raises(TypeError, match="sink"):
            runner.submit(1)

    def test_bad_options(self, tmp_path):
        with pytest.raises(ValueError, match="rows_per_file"):
            write.parquet(str(tmp_path), rows_per_file=0)
        with pytest.raises(ValueError, match="bytes_per_file"):
            write.jsonl(str(tmp_path), bytes_per_file="lots")
        with pytest.raises(ValueError, match="compression"):
            write.jsonl(str(tmp_path), compression="zstd")
        assert write.parquet(str(tmp_path), bytes_per_file="1MiB").bytes_per_file == 1 << 20


class TestParquet:
    def test_round_trip_written_by_the_workers(self, tmp_path):
        out = tmp_path / "out"
        written = (row >> write.parquet(str(out), rows_per_file=7)).map(range(50), devices=2)
        assert written.rows == 50
        assert list(written.files) == sorted(written.files)
        assert all(
            Path(f).name.startswith("part-") and f.endswith(".parquet") for f in written.files
        )
        assert written.bytes == sum(os.path.getsize(f) for f in written.files)
        rows = parquet_rows(written)
        assert sorted(r["x"] for r in rows) == list(range(50))  # each item once
        assert [r["x"] for r in rows] == list(range(50))  # files sort in input order
        assert all(r["y"] == r["x"] / 2 for r in rows)
        assert os.getpid() not in {r["pid"] for r in rows}  # the workers wrote, not the caller
        assert all(pq.ParquetFile(f).metadata.num_rows <= 7 for f in written.files)
        assert leftovers(out) == []

    def test_tensors_become_fixed_size_lists_and_batches_many_rows(self, tmp_path):
        @producer
        def embed(xs):
            return {"id": list(xs), "emb": torch.ones(len(xs), 4) * torch.tensor(xs)[:, None]}

        sink = write.parquet(str(tmp_path), key_column="key")
        written = (embed >> sink).map(range(10), devices=1, batch_size=4)
        table = pa.concat_tables([pq.read_table(f) for f in written.files])
        assert pa.types.is_fixed_size_list(table.schema.field("emb").type)
        assert table.column("id").to_pylist() == list(range(10))
        assert table.column("emb").to_pylist()[3] == [3.0] * 4
        assert table.column("key").to_pylist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]  # batch index

    def test_plain_columns_keep_their_types_and_the_workers_load_no_pandas(self, tmp_path):
        """Numbers, bools, strings and bytes, with and without None, read back as pyarrow
        would type them; and writing them did not import pandas into the worker (pyarrow's
        inference does when it is installed: ~0.2 s of a worker's time). With one worker,
        each chunk is written before the next runs: later rows see what writing loaded."""
        pytest.importorskip("pandas")

        @producer
        def kinds(x):
            import sys

            return {
                "i": x,
                "f": x / 4,
                "b": x % 2 == 0,
                "s": "é" * x,
                "raw": bytes([x]),
                "maybe": None if x % 3 else x,
                "text": None if x % 2 else str(x),
                "a": np.full(3, x, np.int16),
                "pandas": "pandas" in sys.modules,
            }

        written = (kinds >> write.parquet(str(tmp_path))).map(range(40), devices=1)
        table = pa.concat_tables([pq.read_table(f) for f in written.files])
        want = pa.table(
            {
                k: pa.array([kinds.fn(x)[k] for x in range(40)])
                for k in ["i", "f", "b", "s", "raw", "maybe", "text"]
            }
        )
        assert table.select(want.column_names).equals(want)
        assert table.column("a").to_pylist()[5] == [5, 5, 5]
        assert len(written.files) > 1  # (more than one chunk: later ones ran after a write)
        assert table.column("pandas").to_pylist() == [False] * 40

    def test_many_small_items_make_few_files(self, tmp_path):
        """A file per chunk, and a writing pool's chunks grow to ~0.5 s of work and shrink
        to no less than ~0.1 s as the input runs out: 20,000 tiny items on 2 workers made
        33-41 files before (a few rows each at the start and the end), 17-19 now on an idle
        or a loaded machine. Chunk sizes follow measured time, so the bound leaves room for
        a slower machine (CI made 25); the sizes themselves are tested with a given clock in
        tests/unit/test_sizing.py."""

        @producer
        def tiny(x):
            return {"x": x, "s": str(x)}

        written = (tiny >> write.parquet(str(tmp_path))).map(range(20_000), devices=2)
        assert written.rows == 20_000
        assert sorted(r["x"] for r in parquet_rows(written)) == list(range(20_000))
        assert len(written.files) <= 32

    def test_lists_of_rows_tables_and_key_column(self, tmp_path):
        @producer
        def many(x):
            if x % 2:
                return pa.table({"v": [x, x]})
            return [{"v": x}, {"v": x}]

        written = (many >> write.parquet(str(tmp_path), key_column="k")).map(
            range(6), devices="inline"
        )
        rows = parquet_rows(written)
        assert [(r["v"], r["k"]) for r in rows] == [(x, x) for x in range(6) for _ in (0, 1)]

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_key_column_holds_the_key_values(self, tmp_path, devices):
        @producer
        def double(name):
            return {"twice": name * 2}

        names = [f"n{i}" for i in range(12)]
        sink = write.parquet(str(tmp_path), key_column="name")
        written = (double >> sink).map(names, devices=devices, key=lambda s: s.upper())
        rows = parquet_rows(written)
        assert [(r["name"], r["twice"]) for r in rows] == [(n.upper(), n * 2) for n in names]

    def test_a_row_that_does_not_fit_names_its_item(self, tmp_path):
        @producer
        def typed(x):
            return {"v": "text" if x == 5 else x}

        with pytest.raises(WorkerError, match="schema") as info:
            (typed >> write.parquet(str(tmp_path))).map(range(10), devices="inline")
        assert info.value.index == 5 and info.value.stage == "write.parquet"
        assert leftovers(tmp_path) == []

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_a_row_that_does_not_fit_is_set_aside_under_skip(self, tmp_path, devices):
        schema = pa.schema([("v", pa.int64())])

        @producer
        def typed(x):
            return {"v": "text" if x == 5 else x}

        failed: list[Failure] = []
        sink = write.parquet(str(tmp_path), schema=schema)
        written = (typed >> sink).map(
            range(10), devices=devices, errors="skip", on_error=failed.append
        )
        assert [f.index for f in failed] == [5] and failed[0].stage == "write.parquet"
        assert sorted(r["v"] for r in parquet_rows(written)) == [x for x in range(10) if x != 5]
        assert written.rows == 9

    def test_imap_yields_each_committed_file(self, tmp_path):
        sink = write.parquet(str(tmp_path), rows_per_file=5)
        seen = []
        for part in (row >> sink).imap(range(20), devices="inline"):
            assert isinstance(part, Written) and len(part.files) == 1
            assert os.path.exists(part.files[0])  # committed when yielded
            seen.append(part)
        assert sum(p.rows for p in seen) == 20 and len(seen) == 4


class TestOtherFormats:
    def test_jsonl_gzip(self, tmp_path):
        @producer
        def caption(x):
            return {"i": x, "text": f"item {x}", "v": np.arange(2) + x}

        sink = write.jsonl(str(tmp_path), compression="gzip", rows_per_file=4, key_column="k")
        written = (caption >> sink).map(range(10), devices=2)
        assert all(f.endswith(".jsonl.gz") for f in written.files)
        rows = []
        for f in written.files:
            with gzip.open(f, "rt") as fh:
                rows.extend(json.loads(line) for line in fh)
        assert rows == [{"i": x, "text": f"item {x}", "v": [x, x + 1], "k": x} for x in range(10)]

    def test_webdataset_tar_shards(self, tmp_path):
        @producer
        def sample(x):
            return {"jpg": bytes([x]) * 3, "txt": f"caption {x}", "json": {"label": x}}

        written = (sample >> write.webdataset(str(tmp_path), samples_per_file=3)).map(
            range(8), devices=2
        )
        assert all(f.endswith(".tar") for f in written.files)
        names, got = [], {}
        for f in written.files:
            with tarfile.open(f) as tar:
                for m in tar.getmembers():
                    names.append(m.name)
                    got[m.name] = tar.extractfile(m).read()
        assert names[:3] == ["0.jpg", "0.txt", "0.json"]
        assert got["5.jpg"] == bytes([5]) * 3 and got["5.txt"] == b"caption 5"
        assert json.loads(got["7.json"]) == {"label": 7}

    # (webdataset leaves its shard's file object to the garbage collector)
    @pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
    @pytest.mark.filterwarnings("ignore::ResourceWarning")
    def test_webdataset_library_reads_the_shards(self, tmp_path):
        wds = pytest.importorskip("webdataset")

        @producer
        def sample(x):
            return {"__key__": f"s{x:03d}", "cls": str(x), "txt": f"t{x}"}

        written = (sample >> write.webdataset(str(tmp_path))).map(range(5), devices="inline")

        @producer
        def unkeyed(x):
            return {"txt": f"t{x}"}

        keyed = (unkeyed >> write.webdataset(str(tmp_path / "k"))).map(
            range(3), devices=2, key=lambda x: f"item{x}"
        )
        members = []
        for f in keyed.files:
            with tarfile.open(f) as tar:
                members += tar.getnames()
        assert members == ["item0.txt", "item1.txt", "item2.txt"]  # __key__: key='s value
        ds = wds.WebDataset(list(written.files), shardshuffle=False)
        got = [(s["__key__"], s["cls"], s["txt"]) for s in ds]
        del ds
        gc.collect()
        assert got == [(f"s{x:03d}", str(x).encode(), f"t{x}".encode()) for x in range(5)]

    def test_fsspec_memory_url(self):
        fsspec = pytest.importorskip("fsspec")
        written = (row >> write.jsonl("memory://easycore-test/out")).map(range(5), devices="inline")
        assert written.files and all(f.startswith("memory://") for f in written.files)
        fs = fsspec.filesystem("memory")
        text = b"".join(fs.cat(f) for f in written.files).decode()
        assert [json.loads(ln)["x"] for ln in text.splitlines()] == list(range(5))
        assert not [p for p in fs.ls("/easycore-test/out", detail=False) if "/." in p]


class TestExactlyOnce:
    def test_a_killed_worker_is_rerun_and_its_items_written_once(self, tmp_path):
        @producer
        def fragile(x):
            if x == 17 and first_time(tmp_path / "once"):
                os.kill(os.getpid(), signal.SIGKILL)
            return {"x": x}

        out = tmp_path / "out"
        written = (fragile >> write.parquet(str(out))).map(range(40), devices=2, retries=1)
        assert (tmp_path / "once").exists()
        assert sorted(r["x"] for r in parquet_rows(written)) == list(range(40))
        assert leftovers(out) == []

    def test_unordered_seeded_and_a_timeout_retried(self, tmp_path):
        """ordered=False: files still sort in input order; seed: the rows equal an inline
        run's; a unit killed for its timeout re-runs and is written once."""

        @producer
        def noisy(x):
            if x == 5 and first_time(tmp_path / "slow"):
                time.sleep(5)
            return {"x": x, "r": random.random()}

        out = tmp_path / "out"
        written = (noisy >> write.parquet(str(out))).map(
            range(30), devices=2, ordered=False, seed=7, timeout=1, retries=1
        )
        rows = parquet_rows(written)
        assert [r["x"] for r in rows] == list(range(30))
        again = (noisy >> write.parquet(str(tmp_path / "inline"))).map(
            range(30), devices="inline", seed=7
        )
        assert rows == parquet_rows(again)
        assert leftovers(out) == []

    def test_resume_skips_committed_items_and_removes_stray_temp_files(self, tmp_path):
        out, db = tmp_path / "out", tmp_path / "run.db"
        calls = tmp_path / "calls"

        @producer
        def counted(x):
            with open(calls, "a") as f:
                f.write(f"{x}\n")
            if x == 30 and not (tmp_path / "go").exists():
                raise RuntimeError("stop here")
            return {"x": x}

        pipeline = counted >> write.parquet(str(out), rows_per_file=4)
        with pytest.raises(WorkerError):
            pipeline.map(range(40), devices="inline", resume=str(db))
        first = set(os.listdir(out))
        assert first and not [n for n in first if n.startswith(".")]
        (out / ".part-000000000999-000000-deadbeef.parquet").write_bytes(b"half")  # a dead worker's
        (tmp_path / "go").touch()
        calls.write_text("")
        written = pipeline.map(range(40), devices="inline", resume=str(db))
        assert sorted(r["x"] for r in parquet_rows(written)) == list(range(40))
        assert written.rows == 40
        assert first <= {Path(f).name for f in written.files}  # committed files never change
        redone = {int(v) for v in calls.read_text().split()}
        assert redone and min(redone) >= 24  # what the first run committed did not run again
        assert leftovers(out) == []

    def test_a_directory_with_another_runs_files_is_refused(self, tmp_path):
        sink = write.parquet(str(tmp_path / "out"))
        with (row >> sink).open(devices=2) as runner:
            first = runner.map(range(5))
            with pytest.raises(ValueError, match="already holds files of another run"):
                runner.map(range(5, 10))  # would replace the first run's files by name
        assert parquet_rows(first) == parquet_rows(Written(first.files))  # untouched
        assert sorted(r["x"] for r in parquet_rows(first)) == list(range(5))

    def test_a_column_of_nulls_first_takes_a_type_later(self, tmp_path):
        @producer
        def late(x):
            return {"x": x, "note": None if x < 3 else f"n{x}"}

        sink = write.parquet(str(tmp_path), rows_per_file=2)
        written = (late >> sink).map(range(6), devices="inline")
        rows = parquet_rows(written)
        assert [r["note"] for r in rows] == [None, None, None, "n3", "n4", "n5"]

    def test_resume_into_another_directory_is_another_run(self, tmp_path):
        db = tmp_path / "run.db"
        (row >> write.parquet(str(tmp_path / "a"))).map(range(3), devices="inline", resume=str(db))
        with pytest.raises(ValueError, match="sink"):
            (row >> write.parquet(str(tmp_path / "b"))).map(
                range(3), devices="inline", resume=str(db)
            )


@producer
async def arow(x):
    import asyncio

    await asyncio.sleep(0.005)
    return {"x": x, "pid": os.getpid()}


@pytest.mark.parametrize("devices", ["inline", 2])
def test_a_pool_that_waits_writes_too(tmp_path, devices):
    """A sink in a pool with concurrency=k (async items in flight together) writes every
    result once, and the results do not come back to the caller instead."""
    pipeline = arow >> write.parquet(tmp_path / "out", key_column="key")
    written = pipeline.map(range(40), devices=devices, concurrency=8)
    rows = parquet_rows(written)
    assert sorted(r["x"] for r in rows) == list(range(40)) == sorted(r["key"] for r in rows)
    assert written.rows == 40
    if devices != "inline":
        assert os.getpid() not in {r["pid"] for r in rows}
