"""0.4 Example 2, functional: an nn.Linear predictor, one model per device.

Run: python examples/predictor.py [DEVICE ...]     e.g. cuda:0 cuda:1 (default: cpu cpu)
"""

from __future__ import annotations

import sys

import torch
from network import Net

from easycore import consumer, producer


def load(device):
    torch.manual_seed(0)  # same weights everywhere, so the result does not depend on devices
    return Net().to(device).eval()


@producer(init=load)
@torch.no_grad()
def predict(x, *, state, device):
    return state(torch.tensor([[float(x)]], device=device)).cpu()


@consumer(init=list, end=lambda outs: torch.cat(outs, dim=0))
def collect(outs, y):
    outs.append(y)


if __name__ == "__main__":
    devices = sys.argv[1:] or ["cpu", "cpu"]
    result = (predict >> collect).map(range(100), devices=devices)
    print(result.shape)
    assert result.shape == (100, 3)
