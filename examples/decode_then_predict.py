"""Decode on CPU workers, predict on the GPUs (or one CPU worker), each stage its own pool.

Run: python examples/decode_then_predict.py [N_ITEMS]

``decode`` turns each record into an image tensor (pure Python and numpy: CPU work that
does not batch); ``predict`` runs a small CNN on batches of 32 decoded images. With
``.on`` each gets its own workers: decoded images go straight from a decode worker to a
predict worker through shared memory (never through this process), the predict pool sees
batches made from what decode yields item by item, and ``runner.stats()`` shows which stage
is the bottleneck.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

from easycore import consumer, producer

SIZE = 64  # images are 3 x SIZE x SIZE
CLASSES = 10


@producer
def decode(record: int) -> torch.Tensor:
    """A stand-in for JPEG decoding and augmentation: deterministic per record."""
    rng = np.random.default_rng(record)
    img = rng.random((SIZE, SIZE, 3), dtype=np.float32)
    img = (img - img.mean(axis=(0, 1))) / (img.std(axis=(0, 1)) + 1e-6)  # normalise
    if record % 2:
        img = img[:, ::-1]  # "augment": flip every other image
    return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))


def load_model(device):
    torch.manual_seed(0)  # the same weights in every worker
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, CLASSES),
    )
    return model.to(device).eval()


@producer(init=load_model)
@torch.no_grad()
def predict(images: list[torch.Tensor], *, state, device) -> torch.Tensor:
    return state(torch.stack(images).to(device)).argmax(dim=1).cpu()


@consumer(init=lambda: torch.zeros(CLASSES, dtype=torch.long))
def histogram(counts, labels):
    return counts + torch.bincount(labels, minlength=CLASSES)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    cpus = len(os.sched_getaffinity(0))
    decoders = max(1, cpus - (0 if gpus else 1))
    pipeline = decode.on(decoders) >> predict.on(gpus or ["cpu"], batch_size=32) >> histogram
    print(f"pipeline: {pipeline}")
    with pipeline.open() as runner:
        t0 = time.perf_counter()
        counts = runner.map(range(n))
        took = time.perf_counter() - t0
        stats = runner.stats()
    print(f"class histogram: {counts.tolist()}  (sum {int(counts.sum())})")
    print(f"throughput: {n / took:,.0f} images/s ({took:.2f} s for {n} images)")
    for s in stats:
        print(f"  stage {s.name:<8} on {list(s.devices)}: {s.done} done, busy {s.busy:.0%}")
    inline = pipeline.map(range(n), devices="inline")
    assert torch.equal(inline, counts), "the pooled and the inline runs disagree"
    print("inline run agrees: OK")


if __name__ == "__main__":
    main()
