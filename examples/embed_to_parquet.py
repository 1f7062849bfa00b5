"""Embed JPEGs to Parquet: decode in one pool, a small torch model in another, written to
files by the model's workers, killed half-way and resumed, read back with pyarrow.

Run: python examples/embed_to_parquet.py [N_IMAGES]

1. makes N small JPEGs with Pillow in a temporary folder;
2. runs ``decode.on(2) >> embed.on(1, batch_size=32) >> write.parquet(out)`` with
   ``resume="run.db"`` in a child process, and SIGKILLs that process half-way;
3. runs the same job again: only what no committed file holds is computed;
4. reads the files back with pyarrow: every image once, 64 floats each, no ``.``-file.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq
import torch
from PIL import Image

from easycore import producer, write

SIZE = 32
DIM = 64


@producer
def decode(path: str) -> dict:
    """A JPEG as a normalised 3 x SIZE x SIZE tensor, with its file name."""
    img = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0
    return {"name": os.path.basename(path), "pixels": torch.from_numpy(img.transpose(2, 0, 1))}


def load_model(device):
    torch.manual_seed(0)  # the same weights in every worker, and in every run
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, DIM),
    )
    return net.to(device).eval()


@producer(init=load_model)
@torch.no_grad()
def embed(batch: list, *, state, device) -> dict:
    """A batch of decoded images -> columns: file names and (batch, DIM) embeddings."""
    time.sleep(0.05)  # (a bigger model: gives the demo time to be killed half-way)
    pixels = torch.stack([b["pixels"] for b in batch]).to(device)
    return {"name": [b["name"] for b in batch], "embedding": state(pixels).cpu()}


def job(paths: list[str], out: str, db: str):
    pipeline = decode.on(2) >> embed.on(1, batch_size=32) >> write.parquet(out, rows_per_file=64)
    return pipeline.map(paths, resume=db)


def make_jpegs(folder: str, n: int) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        path = os.path.join(folder, f"img{i:05d}.jpg")
        Image.fromarray(rng.integers(0, 255, (SIZE, SIZE, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def committed_units(db: str) -> int:
    if not os.path.exists(db):
        return 0
    try:
        with sqlite3.connect(db) as con:
            return int(con.execute("SELECT count(*) FROM units").fetchone()[0])
    except sqlite3.Error:
        return 0


def main(n: int) -> None:
    work = tempfile.mkdtemp(prefix="embed-")
    os.makedirs(os.path.join(work, "images"))
    paths = make_jpegs(os.path.join(work, "images"), n)
    out, db = os.path.join(work, "emb"), os.path.join(work, "run.db")
    child = [sys.executable, __file__, "--job", work, str(n)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    proc = subprocess.Popen(child, env=env)
    half = n // 32 // 2
    while proc.poll() is None and committed_units(db) < half:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    print(f"killed the job with {committed_units(db)} of {-(-n // 32)} batches committed")

    written = job(paths, out, db)  # the same call: only what is missing runs
    table = pq.read_table(out)
    assert sorted(table.column("name").to_pylist()) == [os.path.basename(p) for p in paths]
    assert table.schema.field("embedding").type.list_size == DIM
    assert not [f for f in os.listdir(out) if f.startswith(".")]
    print(f"{written.rows} embeddings in {len(written.files)} files, {written.bytes} bytes")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--job"]:
        work, n = sys.argv[2], int(sys.argv[3])
        files = sorted(os.listdir(os.path.join(work, "images")))
        job(
            [os.path.join(work, "images", f) for f in files],
            os.path.join(work, "emb"),
            os.path.join(work, "run.db"),
        )
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 640)
