"""W10: a real image pipeline: JPEG decode, random resized crop to 224, flip, float tensor.

``n`` JPEGs (320-640 px a side, made once with Pillow and kept under the temporary folder,
before any clock) go through the same transform for every candidate (:func:`load`: Pillow
decodes, crops a random box of 8-100% of the area at an aspect ratio of 3/4-4/3 and resizes
it to 224 x 224 bilinear, flips half of them, then a ``3 x 224 x 224`` float tensor in
[0, 1], as torchvision's ``RandomResizedCrop(224)``, ``RandomHorizontalFlip()``,
``ToTensor()``; the randomness is drawn from ``random.Random(index)``, so every candidate
makes the same tensors), stacked into batches of 32 in the workers (:func:`load_batch`); the
caller's loop sums each batch. One-shot: the clock covers starting the workers, the epoch and
shutting them down (imports and the images before it), one candidate per fresh process.
The transform pins torch to one thread in whichever process runs it (DataLoader's and
easycore's workers do that anyway): the small per-image tensor operations on torch's 2
threads took 6x as long on the busy 2-core machine here, in the caller (one process, SPDL's
threads) and in SPDL's process-pool workers alike.

Rows: the in-process loop; easycore ``producer(load_batch).imap(range(n), devices=2,
batch_size=32)``; ``DataLoader(dataset, batch_size=32, num_workers=2)`` (its default
collate stacks the batch in the worker); SPDL with the batch function on a
``ProcessPoolExecutor(2)`` (``threads=1``: on its default thread pool instead, SPDL's MT
model, Pillow releasing the GIL while it decodes and resizes; ``loader=1``: SPDL's
drop-in ``spdl.dataloader.get_pytorch_dataloader(dataset, batch_size=32, num_workers=2)``,
batches as they finish).
"""

from __future__ import annotations

import gc
import math
import random
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import bench_workloads as wl

BATCH = 32
SIDE = 224
_FOLDER = Path(tempfile.gettempdir()) / "easycore-bench-w10-v1"
_ONE_THREAD = False


def folder(n: int) -> Path:
    """The folder of ``n`` JPEGs, made the first time (0.jpg ... n-1.jpg)."""
    import numpy as np
    from PIL import Image

    out = _FOLDER / str(n)
    done = out / "done"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        rng = random.Random(i)
        w, h = rng.randint(320, 640), rng.randint(320, 640)
        ys, xs = np.mgrid[0:h, 0:w]
        noise = np.random.default_rng(i).integers(0, 24, (h, w, 3))
        rgb = np.stack([xs * 255 // w, ys * 255 // h, (xs + ys + 16 * i) % 256], axis=-1)
        Image.fromarray((rgb + noise).clip(0, 255).astype(np.uint8)).save(
            out / f"{i}.jpg", quality=90
        )
    done.touch()
    return out


def _crop_box(rng: random.Random, w: int, h: int) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box: 8-100% of the area, log-uniform aspect ratio 3/4-4/3, ten
    tries, then the whole image's centre at the nearest allowed ratio."""
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
            return x, y, x + cw, y + ch
    cw, ch = w, h
    if w / h < 3 / 4:
        ch = round(w / (3 / 4))
    elif w / h > 4 / 3:
        cw = round(h * 4 / 3)
    x, y = (w - cw) // 2, (h - ch) // 2
    return x, y, x + cw, y + ch


def load(path: str, index: int) -> Any:
    """One image: decode, random resized crop to 224, random flip, float tensor (C, H, W)."""
    import numpy as np
    import torch
    from PIL import Image

    global _ONE_THREAD
    if not _ONE_THREAD:  # one torch thread wherever the transform runs (see above)
        torch.set_num_threads(1)
        _ONE_THREAD = True
    rng = random.Random(index)
    with Image.open(path) as img:
        img = img.convert("RGB")
        img = img.resize((SIDE, SIDE), Image.Resampling.BILINEAR, box=_crop_box(rng, *img.size))
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    t = torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous()
    return t.to(torch.float32).div_(255)


class Loader:
    """The work every candidate runs: image ``i`` of a folder, or a stacked batch of them."""

    __name__ = "load_batch"

    def __init__(self, where: Path, n: int) -> None:
        self.where, self.n = str(where), n

    def __len__(self) -> int:  # (DataLoader's map-style dataset)
        return self.n

    def __getitem__(self, i: int) -> Any:
        return load(f"{self.where}/{i}.jpg", i)

    def __call__(self, indices: Sequence[int]) -> Any:
        """A batch: the images of ``indices`` stacked (what DataLoader's collate does)."""
        import torch

        return torch.stack([self[i] for i in indices])


def batches(n: int) -> list[list[int]]:
    return [list(range(i, min(i + BATCH, n))) for i in range(0, n, BATCH)]


def _spdl(work: Loader, n: int, workers: int, threads: bool) -> Iterator[Any]:
    from concurrent.futures import ProcessPoolExecutor

    from spdl.pipeline import PipelineBuilder

    # (work.__call__: SPDL reads an op with __getitem__ as a container to index)
    ex = None if threads else ProcessPoolExecutor(workers)
    try:
        pipeline = (
            PipelineBuilder()
            .add_source(batches(n))
            .pipe(work.__call__, concurrency=workers, executor=ex, output_order="input")
            .add_sink(2)
            .build(num_threads=workers if threads else 1)
        )
        with pipeline.auto_stop():
            yield from pipeline.get_iterator()
    finally:
        if ex is not None:
            ex.shutdown()


def measure(lib: str, opts: dict[str, str], n: int, workers: int) -> dict[str, Any]:
    """One one-shot epoch of W10 on ``lib``; ``{"seconds", "n", "extra"}`` (checked)."""
    import PIL.Image
    import torch

    PIL.Image.init()  # Pillow's format plugins, imported before the clock (forks inherit them)

    work = Loader(folder(n), n)
    sums: list[float] = []
    gc.collect()  # (as bench_libs._settle does for every other workload)
    t0 = time.perf_counter()
    if lib == "sequential":
        stream: Any = (work(b) for b in batches(n))
    elif lib == "easycore":
        from easycore import producer

        stream = producer(work).imap(range(n), devices=workers, batch_size=BATCH)
    elif lib == "dataloader":
        stream = torch.utils.data.DataLoader(work, batch_size=BATCH, num_workers=workers)
    elif lib == "spdl" and "loader" in opts:  # SPDL's drop-in for DataLoader (processes)
        from spdl.dataloader import get_pytorch_dataloader

        stream = get_pytorch_dataloader(work, batch_size=BATCH, num_workers=workers)
    elif lib == "spdl":
        stream = _spdl(work, n, workers, "threads" in opts)
    else:
        msg = f"W10 has no library {lib!r}"
        raise ValueError(msg)
    for batch in stream:  # the training loop: sum each batch
        sums.append(float(batch.sum()))
        if len(sums) == 1 and tuple(batch.shape) != (BATCH, 3, SIDE, SIDE):
            raise wl.WrongResult(f"W10: {lib}'s first batch has shape {tuple(batch.shape)}")
    del stream
    seconds = time.perf_counter() - t0
    want = batches(n)
    if len(sums) != len(want):
        raise wl.WrongResult(f"W10: {lib} gave {len(sums)} batches, expected {len(want)}")
    for k in sorted({0, len(want) // 2, len(want) - 1}):  # (in any order: SPDL's loader
        expect = float(work(want[k]).sum())  # yields batches as they finish)
        if not any(abs(got - expect) <= 1e-4 * abs(expect) for got in sums):
            raise wl.WrongResult(f"W10: {lib} gave no batch summing to {expect} (batch {k})")
    return {"seconds": seconds, "n": n, "extra": {}}
