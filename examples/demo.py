"""The headline demo: a model on every worker, a fold in the caller, with timings.

Run: python examples/demo.py   (or `just demo`)
"""

from __future__ import annotations

import os
import time

import torch

from easycore import CfgNode, consumer, producer

CFG = CfgNode.load(
    """
MODEL:
  IN: 64
  OUT: 8
DATA:
  N: 4000
  BATCH: 50
"""
)


def load_model(device, cfg):
    torch.manual_seed(0)  # the same weights in every worker
    return torch.nn.Linear(cfg.MODEL.IN, cfg.MODEL.OUT).to(device).eval()


@producer(init=load_model)
@torch.no_grad()
def predict(batch, *, state, device):
    x = torch.stack(batch).to(device)
    return state(x).argmax(dim=1).cpu()


@consumer(init=lambda: torch.zeros(8, dtype=torch.long))
def histogram(counts, labels):
    return counts + torch.bincount(labels, minlength=len(counts))


def main() -> None:
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(CFG.MODEL.IN, generator=g) for _ in range(CFG.DATA.N)]
    n_workers = min(2, len(os.sched_getaffinity(0)))
    pipeline = predict >> histogram
    print(f"pipeline: {pipeline}")
    print(f"config:\n{CfgNode.dump(CFG)}")

    with pipeline.open(devices=n_workers, cfg=CFG) as runner:
        print(f"{n_workers} workers started (init included) in {runner.startup_seconds:.2f} s")
        t0 = time.perf_counter()
        counts = runner.map(data, batch_size=CFG.DATA.BATCH)
        took = time.perf_counter() - t0
    print(f"class histogram: {counts.tolist()}  (sum {int(counts.sum())})")
    print(f"throughput: {len(data) / took:,.0f} items/s ({took:.3f} s for {len(data)} items)")
    inline = pipeline.map(data, devices="inline", cfg=CFG, batch_size=CFG.DATA.BATCH)
    assert torch.equal(inline, counts), "parallel and inline runs disagree"
    print("inline run agrees: OK")


if __name__ == "__main__":
    main()
