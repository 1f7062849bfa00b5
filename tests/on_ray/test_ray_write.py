"""easycore.write on engine="ray" (API.md section 10): the actors write, the driver commits;
an actor killed mid-run re-runs its items, each written once."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from easycore import producer, write
from helpers import first_time

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("local_ray")]


def read(written):
    return [r for f in written.files for r in pq.read_table(f).to_pylist()]


def test_actors_write_and_a_killed_actor_writes_once(tmp_path):
    @producer
    def fragile(x):
        if x == 23 and first_time(tmp_path / "once"):
            os.kill(os.getpid(), signal.SIGKILL)
        return {"x": x, "pid": os.getpid()}

    out = tmp_path / "out"
    sink = write.parquet(str(out), rows_per_file=8)
    written = (fragile >> sink).map(range(60), devices=2, engine="ray", retries=1)
    rows = read(written)
    assert (tmp_path / "once").exists()
    assert sorted(r["x"] for r in rows) == list(range(60))  # nothing lost, nothing doubled
    assert os.getpid() not in {r["pid"] for r in rows}  # the actors wrote
    assert not [n for n in os.listdir(out) if n.startswith(".")]


def test_two_pools_resume_on_ray(tmp_path):
    @producer
    def decode(x):
        return x * 2

    @producer
    def embed(xs):
        if 40 in xs and not (tmp_path / "go").exists():
            raise RuntimeError("stop")
        return [{"x": v // 2} for v in xs]

    out, db = tmp_path / "out", tmp_path / "run.db"
    pipeline = decode.on(1) >> embed.on(1, batch_size=4) >> write.jsonl(str(out))
    with pytest.raises(Exception, match="stop"):
        pipeline.map(range(48), engine="ray", resume=str(db))
    (tmp_path / "go").touch()
    written = pipeline.map(range(48), engine="ray", resume=str(db))
    rows = [json.loads(ln) for f in written.files for ln in Path(f).read_text().splitlines()]
    assert sorted(r["x"] for r in rows) == list(range(48))
    assert not [n for n in os.listdir(out) if n.startswith(".")]


def test_a_gpu_group_is_an_actor_with_that_many_gpus_and_is_checked():
    @producer
    def where(x, *, device):
        return device

    with pytest.raises(ValueError, match="2 GPU"):
        where.map([1], devices=[("cuda:0", "cuda:1")], engine="ray")  # this Ray has no GPU
    with pytest.raises(ValueError, match="GPUs only"):
        where.map([1], devices=[("cuda:0", "cpu")], engine="ray")


def test_key_column_with_key_on_two_pools(tmp_path):
    @producer
    def decode(s):
        return len(s)

    @producer
    def rows(ns):
        return [{"n": n} for n in ns]

    names = [f"x{'y' * i}" for i in range(10)]
    pipeline = (
        decode.on(1) >> rows.on(1, batch_size=5) >> write.parquet(str(tmp_path), key_column="k")
    )
    written = pipeline.map(names, engine="ray", key=lambda s: s)
    got = read(written)
    assert [(r["k"], r["n"]) for r in got] == [(s, len(s)) for s in names]


def test_a_pool_that_waits_writes_on_ray_too(tmp_path):
    """An actor holding k items at once (concurrency=k) is still the one that writes."""
    import asyncio

    @producer
    async def arow(x):
        await asyncio.sleep(0.005)
        return {"x": x}

    written = (arow.on(2, concurrency=8) >> write.parquet(tmp_path / "out")).map(
        range(40), engine="ray"
    )
    assert sorted(r["x"] for r in read(written)) == list(range(40))


@producer
def named_row(name):
    if name == "img0060":
        raise ValueError(f"cannot read {name}")
    return {"x": name}


def test_a_resume_with_key_in_another_order_after_an_on_error_that_raised_on_ray(tmp_path):
    """As on worker processes (tests/process/test_sink_resume_misuse.py): an on_error that
    raises stops the run with its files committed, and a resume with key= over the input
    in another order takes no earlier file's name."""
    out, db = tmp_path / "out", str(tmp_path / "run.db")
    names = [f"img{k:04d}" for k in range(120)]
    job = named_row >> write.jsonl(str(out), rows_per_file=10)

    def on_error(failure):
        raise RuntimeError("the logger broke")

    kw = {"engine": "ray", "devices": 2, "resume": db, "key": lambda n: n, "errors": "skip"}
    with pytest.raises(RuntimeError, match="the logger broke"):
        job.map(names, on_error=on_error, **kw)
    failures = []
    written = job.map(names[::-1], on_error=failures.append, **kw)
    expected = sorted(n for n in names if n != "img0060")
    committed = [f for f in out.iterdir() if not f.name.startswith(".")]
    on_disk = sorted(
        json.loads(line)["x"] for f in committed for line in f.read_text().splitlines()
    )
    assert on_disk == expected
    listed = sorted(
        json.loads(line)["x"] for f in written.files for line in Path(f).read_text().splitlines()
    )
    assert listed == expected and written.rows == 119
    assert [f.item for f in failures] == ["img0060"]
