"""easycore.write (API.md section 10): rows are written as a user reads them back, with each
format's own reader (pyarrow.parquet.read_table on the directory, json, webdataset)."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from easycore import Failure, WorkerError, producer, write

pytestmark = pytest.mark.timeout(120)


def schemas(written) -> set[str]:
    return {str(pq.read_schema(f)) for f in written.files}


def lines(written) -> list[str]:
    out = []
    for f in written.files:
        with open(f) as fh:
            out.extend(fh)
    return out


def strict_json(line: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=refuse)


@producer
def late_text(x):
    """A column of None in the first rows, text in a few later ones."""
    return {"x": x, "note": f"n{x}" if x % 50 == 49 else None}


class TestOneDataset:
    @pytest.mark.parametrize("devices", ["inline", 1, 2])
    def test_a_column_null_at_first_reads_back_as_one_dataset(self, tmp_path, devices):
        """None in the first rows (and in whole files), strings later: read_table(dir) reads
        every row, and every file has the run's types (none is null where another is
        string)."""
        out = tmp_path / "out"
        sink = write.parquet(str(out), rows_per_file=20)
        written = (late_text >> sink).map(range(200), devices=devices)
        table = pq.read_table(out)
        assert table.schema.field("note").type == pa.string()
        rows = sorted(table.to_pylist(), key=lambda r: r["x"])
        assert rows == [late_text.fn(x) for x in range(200)]
        assert len(written.files) >= 10 and len(schemas(written)) == 1
        # files written again in the run's schema are counted at their size on disk
        assert written.bytes == sum(os.path.getsize(f) for f in written.files)

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_arrays_of_varying_length_are_variable_length_lists(self, tmp_path, devices):
        """Token sequences: the first rows all of one length, later ones not (some empty);
        every row is written (none set aside under errors='skip'), as a variable-length
        list."""

        @producer
        def tokens(x):
            n = 4 if x < 30 else x % 7  # (0 included: an empty list)
            return {"x": x, "ids": torch.arange(n) + x, "mask": np.ones(n, np.int8)}

        failed: list[Failure] = []
        out = tmp_path / "out"
        written = (tokens >> write.parquet(str(out), rows_per_file=16)).map(
            range(80), devices=devices, errors="skip", on_error=failed.append
        )
        assert failed == [] and written.rows == 80
        table = pq.read_table(out)
        assert pa.types.is_list(table.schema.field("ids").type)
        by_x = {r["x"]: r for r in table.to_pylist()}
        for x in range(80):
            n = 4 if x < 30 else x % 7
            assert by_x[x]["ids"] == [x + i for i in range(n)]
            assert by_x[x]["mask"] == [1] * n
        assert len(schemas(written)) == 1

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_ints_then_floats_make_a_float_column(self, tmp_path, devices):
        @producer
        def score(x):
            return {"x": x, "s": x if x < 30 else x / 2}

        out = tmp_path / "out"
        written = (score >> write.parquet(str(out), rows_per_file=10)).map(
            range(60), devices=devices
        )
        table = pq.read_table(out)
        assert table.schema.field("s").type == pa.float64()
        assert {r["x"]: r["s"] for r in table.to_pylist()} == {
            x: score.fn(x)["s"] for x in range(60)
        }
        assert len(schemas(written)) == 1

    def test_a_resumed_run_gives_the_first_runs_files_its_types(self, tmp_path):
        """The first run wrote only None in a column; the run that resumes it writes strings
        there: the whole directory reads back as one dataset."""
        out, db, go = tmp_path / "out", tmp_path / "run.db", tmp_path / "go"

        @producer
        def late(x):
            if x == 30 and not go.exists():
                raise RuntimeError("stop here")
            return {"x": x, "note": f"n{x}" if x >= 30 else None}

        pipeline = late >> write.parquet(str(out), rows_per_file=4)
        with pytest.raises(WorkerError):
            pipeline.map(range(40), devices="inline", resume=str(db))
        go.touch()
        written = pipeline.map(range(40), devices="inline", resume=str(db))
        table = pq.read_table(out)
        assert sorted(table.to_pylist(), key=lambda r: r["x"]) == [late.fn(x) for x in range(40)]
        assert len(schemas(written)) == 1

    def test_arrays_of_one_length_stay_fixed_size(self, tmp_path):
        @producer
        def emb(x):
            return {"x": x, "emb": np.full(3, x, np.float32)}

        out = tmp_path / "out"
        (emb >> write.parquet(str(out), rows_per_file=5)).map(range(20), devices=2)
        assert pa.types.is_fixed_size_list(pq.read_table(out).schema.field("emb").type)

    def test_a_true_conflict_names_the_column_and_both_types(self, tmp_path):
        @producer
        def typed(x):
            return {"v": "text" if x == 5 else x}

        with pytest.raises(WorkerError, match=r"'v' holds string .*int64.*schema=") as info:
            (typed >> write.parquet(str(tmp_path / "out"))).map(range(10), devices="inline")
        assert info.value.index == 5

    def test_a_conflict_between_runs_files_fails_the_run(self, tmp_path):
        """A resumed run whose rows have another type than the files of the run it resumes:
        an error naming the column and both types, not a directory that does not read."""
        out, db, flag = tmp_path / "out", tmp_path / "run.db", tmp_path / "as-text"

        @producer
        def typed(x):
            if x == 30 and not flag.exists():
                raise RuntimeError("stop here")
            return {"v": str(x) if flag.exists() else x}

        pipeline = typed >> write.parquet(str(out), rows_per_file=4)
        with pytest.raises(WorkerError):
            pipeline.map(range(40), devices="inline", resume=str(db))
        flag.touch()
        with pytest.raises(
            ValueError, match=r"'v' holds .*(string|int64).*(int64|string).*schema="
        ):
            pipeline.map(range(40), devices="inline", resume=str(db))

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_a_nullable_schema_column_may_be_missing(self, tmp_path, devices):
        schema = pa.schema([("x", pa.int64(), False), ("note", pa.string())])

        @producer
        def sparse(x):
            return {"x": x, "note": "n"} if x % 2 else {"x": x}

        failed: list[Failure] = []
        out = tmp_path / "out"
        written = (sparse >> write.parquet(str(out), schema=schema)).map(
            range(20), devices=devices, errors="skip", on_error=failed.append
        )
        assert failed == [] and written.rows == 20
        table = pq.read_table(out)
        assert table.schema == schema
        notes = {r["x"]: r["note"] for r in table.to_pylist()}
        assert notes == {x: "n" if x % 2 else None for x in range(20)}

    def test_a_column_that_is_not_nullable_may_not_be_missing(self, tmp_path):
        schema = pa.schema([("x", pa.int64()), ("y", pa.int64(), False)])

        @producer
        def sparse(x):
            return {"x": x, "y": x} if x != 3 else {"x": x}

        failed: list[Failure] = []
        written = (sparse >> write.parquet(str(tmp_path / "o"), schema=schema)).map(
            range(6), devices="inline", errors="skip", on_error=failed.append
        )
        assert [f.index for f in failed] == [3] and written.rows == 5


def test_the_caller_of_a_parquet_run_loads_no_pyarrow(tmp_path):
    """Files of one schema are committed without pyarrow in the calling process (importing
    it costs ~0.2 s: the workers send their schemas as bytes, compared as bytes)."""
    code = (
        "import sys\n"
        "from easycore import producer, write\n"
        "@producer\n"
        "def r(x):\n"
        "    return {'x': x, 'note': None}\n"
        f"w = (r >> write.parquet({str(tmp_path / 'o')!r})).map(range(50), devices=2)\n"
        "assert w.rows == 50\n"
        "print(sorted(m for m in sys.modules if m.startswith('pyarrow')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


class TestRowsPerFile:
    def test_files_hold_the_rows_asked_for(self, tmp_path):
        """rows_per_file=2000 over 20,000 rows: about 10 files, not ~40 of a few rows."""

        @producer
        def tiny(x):
            return {"x": x}

        out = tmp_path / "out"
        written = (tiny >> write.parquet(str(out), rows_per_file=2000)).map(
            range(20_000), devices=2
        )
        sizes = [pq.ParquetFile(f).metadata.num_rows for f in written.files]
        assert sum(sizes) == 20_000 and max(sizes) <= 2000
        assert len(sizes) <= 14 and sizes[0] == 2000


class TestKeysAndJson:
    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_tuple_keys_with_key_column(self, tmp_path, devices):
        @producer
        def double(x):
            return {"v": 2 * x}

        def key(x):
            return (f"shard{x % 3}", x)

        pq_out, js_out = tmp_path / "pq", tmp_path / "js"
        written = (double >> write.parquet(str(pq_out), key_column="key")).map(
            range(12), devices=devices, key=key
        )
        assert written.rows == 12
        rows = pq.read_table(pq_out).to_pylist()
        assert [(r["key"], r["v"]) for r in rows] == [
            ({"0": f"shard{x % 3}", "1": x}, 2 * x) for x in range(12)
        ]
        written = (double >> write.jsonl(str(js_out), key_column="key")).map(
            range(12), devices=devices, key=key
        )
        assert [json.loads(ln) for ln in lines(written)] == [
            {"v": 2 * x, "key": [f"shard{x % 3}", x]} for x in range(12)
        ]

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_jsonl_writes_nan_and_infinities_as_null(self, tmp_path, devices):
        @producer
        def odd(x):
            return {
                "x": x,
                "f": float("nan") if x % 2 else 0.5,
                "g": [1.0, math.inf, -math.inf],
                "a": np.array([np.nan, 2.0], np.float32),
                "t": torch.tensor([float("inf")]),
            }

        written = (odd >> write.jsonl(str(tmp_path / "o"))).map(range(6), devices=devices)
        rows = [strict_json(ln) for ln in lines(written)]
        assert rows == [
            {
                "x": x,
                "f": None if x % 2 else 0.5,
                "g": [1.0, None, None],
                "a": [None, 2.0],
                "t": [None],
            }
            for x in range(6)
        ]


# (webdataset leaves its shard's file object to the garbage collector)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
class TestWebDataset:
    @staticmethod
    def read(written) -> list[tuple[str, bytes]]:
        wds = pytest.importorskip("webdataset")
        ds = wds.WebDataset(list(written.files), shardshuffle=False, empty_check=False)
        got = [(s["__key__"], s["txt"]) for s in ds]
        del ds
        gc.collect()
        return got

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_an_empty_or_repeated_key_or_a_field_with_a_slash_is_its_items_error(
        self, tmp_path, devices
    ):
        """Every shard reads back with webdataset, holding every other sample."""

        @producer
        def sample(x):
            if x == 2:
                return {"__key__": "", "txt": "empty"}
            if x == 5:  # two samples of one key in one shard
                return [{"__key__": "k5", "txt": "a"}, {"__key__": "k5", "txt": "b"}]
            if x == 7:
                return {"__key__": f"k{x}", "txt": "t", "a/b": "slash"}
            return {"__key__": f"k{x}", "txt": f"t{x}"}

        failed: list[Failure] = []
        written = (sample >> write.webdataset(str(tmp_path / "o"))).map(
            range(10), devices=devices, errors="skip", on_error=failed.append
        )
        assert sorted(f.index for f in failed) == [2, 5, 7]
        got = self.read(written)
        want = [(f"k{x}", f"t{x}".encode()) for x in range(10) if x not in (2, 5, 7)]
        assert sorted(got) == sorted(want)
        with pytest.raises(WorkerError, match="__key__") as info:
            (sample >> write.webdataset(str(tmp_path / "r"))).map(range(4), devices=devices)
        assert info.value.index == 2

    def test_a_key_repeated_in_other_shards_is_written(self, tmp_path):
        @producer
        def same(x):
            return {"__key__": "same", "txt": f"t{x}"}

        written = (same >> write.webdataset(str(tmp_path / "o"), samples_per_file=1)).map(
            range(4), devices="inline"
        )
        assert len(written.files) == 4
        assert self.read(written) == [("same", f"t{x}".encode()) for x in range(4)]


def read_webdataset(written) -> list[dict]:
    import webdataset as wds

    ds = wds.WebDataset(list(written.files), shardshuffle=False)
    got = list(ds)
    del ds
    gc.collect()
    return got


# (webdataset leaves its shard's file object to the garbage collector)
webdataset_reads = [
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]


class TestEnginesAgree:
    """What a result becomes is the same on worker processes and inline, and Written.rows is
    what the format's own reader reads back."""

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_a_list_item_without_batch_size_is_one_row(self, tmp_path, devices):
        """Whether a result is a batch's comes from batch_size, never from the item's type:
        an item that is a list, and a result mapping to an array, is one row."""
        embed = producer(lambda words: {"vec": np.ones(4, dtype=np.float32)})
        written = (embed >> write.parquet(str(tmp_path))).map([["a", "b"], ["c"]], devices=devices)
        table = pq.read_table(tmp_path)
        assert written.rows == table.num_rows == 2
        assert table.column("vec").to_pylist() == [[1.0] * 4] * 2

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_with_batch_size_a_mapping_of_columns_is_that_many_rows(self, tmp_path, devices):
        batch = producer(lambda b: {"x": b})
        written = (batch >> write.parquet(str(tmp_path))).map(
            range(5), devices=devices, batch_size=2
        )
        table = pq.read_table(tmp_path)
        assert written.rows == table.num_rows == 5
        assert sorted(table.column("x").to_pylist()) == [0, 1, 2, 3, 4]

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_float32_tensors_of_varying_shape_keep_one_type(self, tmp_path, devices):
        """2-D tensors whose first length varies: one type in every file, float32 kept."""
        one = producer(lambda x: {"t": torch.zeros(x + 1, 2)})
        many = producer(lambda x: [{"t": torch.zeros(x + 1, 2)}, {"t": torch.zeros(x + 3, 2)}])
        want = pa.list_(pa.list_(pa.float32(), 2))
        for i, stage in enumerate((one, many)):
            out = tmp_path / str(i)
            written = (stage >> write.parquet(str(out))).map(range(3), devices=devices)
            table = pq.read_table(out)
            assert written.rows == table.num_rows
            assert table.schema.field("t").type == want

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_an_empty_result_is_a_row_of_nulls(self, tmp_path, devices):
        odd = producer(lambda x: {} if x % 2 else {"v": x})
        written = (odd >> write.parquet(str(tmp_path))).map(range(4), devices=devices)
        table = pq.read_table(tmp_path)
        assert written.rows == table.num_rows == 4
        assert sorted(table.column("v").to_pylist(), key=str) == [0, 2, None, None]

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_a_parquet_run_of_empty_results_only_fails(self, tmp_path, devices):
        """Parquet cannot hold rows with no columns: the run says so (no Written counting
        rows that read back as none)."""
        with pytest.raises((ValueError, WorkerError), match="no columns"):
            (producer(lambda x: {}) >> write.parquet(str(tmp_path))).map(range(3), devices=devices)

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_an_empty_struct_merges_with_a_later_struct(self, tmp_path, devices):
        fn = producer(lambda x: {"s": {}} if x == 0 else {"s": {"a": x}})
        written = (fn >> write.parquet(str(tmp_path))).map(range(3), devices=devices)
        table = pq.read_table(tmp_path)
        assert written.rows == table.num_rows == 3
        assert table.schema.field("s").type == pa.struct([("a", pa.int64())])

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_tuple_keys_of_different_lengths_are_one_struct(self, tmp_path, devices):
        """A key of fewer places is null in the others: every file has the one type."""
        one = producer(lambda x: {"v": 1})
        sink = write.parquet(str(tmp_path), key_column="k")
        written = (one >> sink).map([(1,), (1, 2)], devices=devices, key=lambda x: x)
        table = pq.read_table(tmp_path)
        assert written.rows == table.num_rows == 2
        assert sorted(table.column("k").to_pylist(), key=str) == [
            {"0": 1, "1": 2},
            {"0": 1, "1": None},
        ]

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_a_batch_rows_carry_the_batch_tuple_key(self, tmp_path, devices):
        """With batch_size, key= is given the batch, and its rows carry that key."""
        rows = producer(lambda b: [{"v": 1} for _ in b])
        sink = write.parquet(str(tmp_path), key_column="k")
        written = (rows >> sink).map(
            [(1, "a"), (2, "b"), (3, "c")], devices=devices, key=lambda b: b[0], batch_size=2
        )
        table = pq.read_table(tmp_path)
        assert written.rows == table.num_rows == 3
        assert sorted(table.column("k").to_pylist(), key=str) == [
            {"0": 1, "1": "a"},
            {"0": 1, "1": "a"},
            {"0": 3, "1": "c"},
        ]

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_tuple_keys_whose_types_differ_name_the_column(self, tmp_path, devices):
        one = producer(lambda x: {"v": 1})
        sink = write.parquet(str(tmp_path), key_column="k")
        with pytest.raises((ValueError, WorkerError)) as info:
            (one >> sink).map([(1, "a"), ("x", 2)], devices=devices, key=lambda x: x)
        text = str(info.value) + str(info.value.__cause__)
        assert "'k'" in text and "ArrowInvalid" not in type(info.value.__cause__).__name__

    @pytest.mark.parametrize("devices", ["inline", 2])
    @pytest.mark.parametrize("key", [(1, (2, "a")), (), True])
    def test_a_key_that_is_no_str_int_or_flat_tuple_is_a_type_error(self, tmp_path, devices, key):
        one = producer(lambda x: {"v": 1})
        sink = write.parquet(str(tmp_path), key_column="k")
        with pytest.raises(TypeError, match="key="):
            (one >> sink).map([1], devices=devices, key=lambda x: key)

    @webdataset_reads[0]
    @webdataset_reads[1]
    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_webdataset_read_side_fields_are_not_written(self, tmp_path, devices):
        """__url__ and __local_path__ are what webdataset adds on read: a sample read back
        and written again leaves them out (a member so named made the shard unreadable)."""
        fn = producer(lambda x: {"__url__": "s3://x", "__local_path__": "/x", "txt": "a"})
        written = (fn >> write.webdataset(str(tmp_path))).map(range(2), devices=devices)
        samples = read_webdataset(written)
        assert written.rows == len(samples) == 2
        assert all(s["txt"] == b"a" and s["__url__"] != "s3://x" for s in samples)

    @webdataset_reads[0]
    @webdataset_reads[1]
    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_a_webdataset_sample_with_no_entries_is_its_items_error(self, tmp_path, devices):
        """No empty shard is committed, and Written.rows counts the samples read back."""
        fn = producer(
            lambda x: {"__key__": f"k{x}"} if x == 1 else ({} if x == 2 else {"txt": "a"})
        )
        failed: list[Failure] = []
        written = (fn >> write.webdataset(str(tmp_path))).map(
            range(3), devices=devices, errors="skip", on_error=failed.append
        )
        assert sorted(f.index for f in failed) == [1, 2]
        assert written.rows == len(read_webdataset(written)) == 1
        assert len(written.files) == 1


@pytest.mark.parametrize("devices", ["inline", 1])
@pytest.mark.parametrize("later", [1, True, 2.5])
def test_text_then_another_kind_is_a_conflict_not_a_conversion(tmp_path, devices, later):
    """A column of text whose later rows hold numbers or bools is a conflict naming the
    column and both types, as the other order is: never 1 written as "1"."""
    rows = producer(lambda x: {"a": "s"} if x == 0 else {"a": later})
    with pytest.raises(WorkerError, match=r"column 'a' holds .* where .*string.*schema="):
        (rows >> write.parquet(str(tmp_path / "out"))).map(range(3), devices=devices)


@pytest.mark.parametrize("devices", ["inline", 2])
@pytest.mark.parametrize("case", ["values", "keys"])
def test_a_type_conflict_fails_the_run_under_skip_on_every_engine(tmp_path, devices, case):
    """Which item came first decides nothing in a conflict of the run's own types (values
    of a column, or key= places): the run fails, under errors='skip' too, wherever the
    conflicting rows land (one worker's file, or two workers' files)."""
    failed: list[Failure] = []
    if case == "values":
        rows = producer(lambda x: {"a": "s" if x % 2 else x})
        sink, key = write.parquet(str(tmp_path / "out")), None
    else:
        rows = producer(lambda x: {"a": x})
        sink = write.parquet(str(tmp_path / "out"), key_column="k")

        def key(x):
            return (x,) if x % 2 else (str(x),)

    # (a WorkerError caused by the sink's SinkError where one worker met both types; the
    # commit's ValueError where two workers' files did)
    with pytest.raises(
        (WorkerError, ValueError), match=r"give the sink a schema=|same types at each place"
    ):
        (rows >> sink).map(
            range(8), devices=devices, errors="skip", on_error=failed.append, key=key
        )
    assert failed == []
