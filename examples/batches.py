"""0.4 Example 3, functional: the same predictor fed batches of 10 (batch_size does the batching).

Run: python examples/batches.py [DEVICE ...]
"""

from __future__ import annotations

import sys

import torch
from network import Net

from easycore import consumer, producer


def load(device):
    torch.manual_seed(0)
    return Net().to(device).eval()


@producer(init=load)
@torch.no_grad()
def predict(batch, *, state, device):
    return state(torch.tensor(batch, dtype=torch.float32, device=device).view(-1, 1)).cpu()


@consumer(init=list, end=lambda outs: torch.cat(outs, dim=0))
def collect(outs, y):
    outs.append(y)


if __name__ == "__main__":
    devices = sys.argv[1:] or ["cpu", "cpu"]
    result = (predict >> collect).map(range(100), devices=devices, batch_size=10)
    print(result.shape)
    assert result.shape == (100, 3)
