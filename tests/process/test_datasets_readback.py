"""What easycore.write writes reads back as one dataset with the readers users reach for:
Hugging Face ``datasets.load_dataset``, pandas, and DuckDB and Polars where installed."""

from __future__ import annotations

import pytest

from easycore import producer, write

pytestmark = pytest.mark.timeout(120)


@producer
def row(x):
    return {"x": x, "name": f"item {x}", "vec": [float(x), -float(x)]}


ROWS = [{"x": x, "name": f"item {x}", "vec": [float(x), -float(x)]} for x in range(40)]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("parquet") / "out"
    result = (row >> write.parquet(str(out), rows_per_file=15)).map(range(40), devices=2)
    assert result.rows == 40 and len(result.files) > 1  # several files, one dataset
    return out, result.files


def by_x(rows):
    return sorted(rows, key=lambda r: r["x"])


def test_hugging_face_load_dataset(written, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    out, _ = written
    ds = datasets.load_dataset(
        "parquet", data_files=str(out / "*.parquet"), split="train", cache_dir=str(tmp_path)
    )
    assert by_x(ds) == ROWS


def test_pandas(written):
    pd = pytest.importorskip("pandas")
    out, _ = written
    frame = pd.read_parquet(out)
    rows = [
        {"x": int(r.x), "name": r.name, "vec": [float(v) for v in r.vec]}
        for r in frame.itertuples(index=False)
    ]
    assert by_x(rows) == ROWS


def test_duckdb(written):
    duckdb = pytest.importorskip("duckdb")
    out, _ = written
    got = duckdb.sql(f"select x, name from read_parquet('{out}/*.parquet') order by x").fetchall()
    assert got == [(r["x"], r["name"]) for r in ROWS]


def test_polars(written):
    pl = pytest.importorskip("polars")
    out, _ = written
    assert by_x(pl.read_parquet(out / "*.parquet").to_dicts()) == ROWS
