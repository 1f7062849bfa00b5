"""Feed a training loop: JPEGs decoded and augmented in easycore workers, a CNN in the caller.

    python examples/train_loop.py [STEPS]

At start-up it writes a small data set of JPEG images with Pillow (two classes: horizontal
or vertical stripes, random colours and noise; nothing is downloaded). Each epoch, the caller
shuffles the file list and ``runner.imap`` hands batches of 32 paths to two workers, which
decode, randomly flip and crop them and return tensors; the caller trains a small CNN on
them. Work starts when ``imap`` is called and each worker keeps ``prefetch`` batches ready,
so the loop rarely waits. It prints the loss going down and how long the loop waited for
data.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from easycore import producer

SIZE = 32
BATCH = 32


def make_images(folder: Path, n: int, seed: int = 0) -> list[tuple[str, int]]:
    """Write ``n`` JPEGs: label 0 has horizontal stripes, label 1 vertical ones."""
    rng = np.random.default_rng(seed)
    files = []
    for i in range(n):
        label = i % 2
        period = int(rng.integers(3, 7))
        stripes = (np.arange(SIZE) // period) % 2
        mask = stripes[:, None] if label == 0 else stripes[None, :]
        mask = np.broadcast_to(mask, (SIZE, SIZE))
        base = rng.integers(60, 196, 3)  # faint stripes under heavy noise: a few hundred
        light, dark = base + 12, base - 12  # steps of training to tell them apart
        pixels = np.where(mask[..., None] == 1, light, dark) + rng.normal(0, 40, (SIZE, SIZE, 3))
        path = folder / f"{i:05d}.jpg"
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=85)
        files.append((str(path), label))
    return files


@producer
def load_batch(batch: list[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode a batch of JPEGs and augment them (random flip, random 28x28 crop, padded back).

    Runs in a worker; with ``seed=`` every batch gets the same augmentation whatever worker
    makes it.
    """
    images = []
    for path, _ in batch:
        with Image.open(path) as img:
            x = torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0)
        x = x.permute(2, 0, 1)  # CHW
        if random.random() < 0.5:
            x = x.flip(2 if random.random() < 0.5 else 1)  # stripes stay stripes
        top, left = random.randint(0, 4), random.randint(0, 4)
        crop = x[:, top : top + SIZE - 4, left : left + SIZE - 4]
        images.append(torch.nn.functional.pad(crop, (2, 2, 2, 2)))
    labels = torch.tensor([label for _, label in batch])
    return torch.stack(images), labels


def cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 8 * 8, 2),
    )


def main(steps: int = 300) -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        files = make_images(Path(tmp), 640)
        per_epoch = len(files) // BATCH
        model = cnn()
        optim = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses: list[float] = []
        waited = 0.0
        t0 = time.perf_counter()
        with load_batch.open(devices=2, prefetch=4) as runner:
            epoch = 0
            while len(losses) < steps:
                order = files[:]
                random.Random(epoch).shuffle(order)
                batches = [order[k * BATCH : (k + 1) * BATCH] for k in range(per_epoch)]
                stream = runner.imap(batches, seed=epoch)  # the workers start on it now
                while len(losses) < steps:
                    w0 = time.perf_counter()
                    item = next(stream, None)
                    waited += time.perf_counter() - w0
                    if item is None:
                        break
                    x, y = item
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    optim.zero_grad()
                    loss.backward()
                    optim.step()
                    losses.append(loss.item())
                    if len(losses) % 50 == 0:
                        recent = sum(losses[-50:]) / 50
                        print(f"step {len(losses):4d}  loss {recent:.3f}", flush=True)
                stream.close()  # an epoch cut short: what is in flight is dropped
                epoch += 1
        total = time.perf_counter() - t0
    first, last = sum(losses[:50]) / 50, sum(losses[-50:]) / 50
    print(f"{len(losses)} steps in {total:.1f} s; the loop waited {waited / total:.0%} for data")
    print(
        f"loss {first:.3f} -> {last:.3f}: "
        + ("going down: OK" if last < 0.75 * first else "NOT going down")
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
