"""easycore.write to ``s3://`` (fsspec + s3fs) against a local S3 server (moto in server
mode) started by the test: the workers write there, the caller commits there."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

pytestmark = pytest.mark.timeout(120)

JOB = textwrap.dedent(
    """
    import json, os
    from easycore import producer, write

    @producer
    def row(x):
        return {"x": x, "pid": os.getpid()}

    w = (row >> write.parquet("s3://bucket/out", rows_per_file=10)).map(
        range(45), devices=2, resume=os.environ["DB"])
    print("RESULT", json.dumps({"files": list(w.files), "rows": w.rows}), flush=True)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def s3(monkeypatch):
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    try:
        yield env
    finally:
        server.stop()


def test_parquet_to_s3_from_the_workers(s3, tmp_path):
    import pyarrow.parquet as pq
    import s3fs

    fs = s3fs.S3FileSystem(
        key="testing", secret="testing", endpoint_url=s3["FSSPEC_S3_ENDPOINT_URL"]
    )
    fs.mkdir("bucket")
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**os.environ, **s3, "DB": str(tmp_path / "run.db")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))[7:])
    assert got["rows"] == 45 and all(f.startswith("s3://bucket/out/part-") for f in got["files"])
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls("bucket/out", detail=False))
    assert names == sorted(f.rsplit("/", 1)[1] for f in got["files"])  # no temporary file
    rows = [r for f in got["files"] for r in pq.read_table(f[5:], filesystem=fs).to_pylist()]
    assert sorted(r["x"] for r in rows) == list(range(45))
