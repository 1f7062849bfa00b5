"""One map across several processes or machines: easycore on torch.distributed.

Every rank runs this same script over the same data; item i runs on rank i % world_size, on
that rank's own devices ("local": its GPU, else its share of the CPU cores). Every rank gets
the same result, equal to a single-process run; rank 0 prints it.

Run (from the repository root; `torchrun` is `python -m torch.distributed.run`):

    # one machine, two processes
    torchrun --nproc-per-node=2 examples/distributed_map.py

    # two machines ("nodes"): one line on each, with rank 0's address; here both on this
    # machine over loopback, each line in its own terminal
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=1 --master-addr=127.0.0.1 \
        --master-port=29500 examples/distributed_map.py
    torchrun --nnodes=2 --node-rank=1 --nproc-per-node=1 --master-addr=127.0.0.1 \
        --master-port=29500 examples/distributed_map.py

    # Slurm: one task per GPU, no torchrun needed
    srun --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 python examples/distributed_map.py

    # no launcher: a world of one
    python examples/distributed_map.py
"""

from __future__ import annotations

import random

import torch

from easycore import WorkerError, consumer, distributed, producer


@producer
def noisy_square(x, *, device):
    # a seeded run gives every item the same random state on any rank, device or worker
    noise = torch.rand(1, device=device).item()
    return x * x + noise + random.random()


@consumer(init=0.0)
def summer(total, y):
    return total + y


@producer
def picky(x):
    if x == 7:
        raise ValueError(f"item {x} is not welcome")
    return x


@distributed.main_only
def report(*lines: str) -> None:
    for line in lines:
        print(line, flush=True)


if __name__ == "__main__":
    distributed.init()
    data = range(1000)
    pipeline = noisy_square >> summer
    total = pipeline.map(data, devices="local", seed=0, distributed=True)
    squares = noisy_square.map(range(10), devices="local", seed=0, distributed=True)

    # every rank holds the same values; check it, and against a single-process run
    assert distributed.all_gather(total) == [total] * distributed.world_size()
    single = pipeline.map(data, devices="inline", seed=0)
    report(
        f"world of {distributed.world_size()} ({distributed.detect_launcher().launcher})",
        f"first squares: {[round(v, 3) for v in squares[:4]]}",
        f"sum: {total:.6f}",
        f"single-process run agrees: {'OK' if total == single else 'NO'}",
    )
    assert total == single

    # an error on one rank reaches every rank, naming the rank where it happened
    try:
        picky.map(range(20), devices="local", distributed=True)
    except WorkerError as exc:
        first_line = str(exc).splitlines()[0]
        print(f"rank {distributed.rank()} got: {first_line}", flush=True)
    distributed.barrier()
