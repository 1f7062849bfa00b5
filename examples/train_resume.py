"""A training loop killed in the middle of an epoch (SIGKILL) and resumed from its checkpoint.

    python examples/train_resume.py [EPOCHS]

Each epoch shuffles the data set with ``easycore.permutation(n, seed, epoch)``, and
``runner.imap`` hands batches of indices to two workers, which build the batches with
seeded random noise (``seed`` and ``epoch``: every item another draw each epoch, the same on
every run). Every 10 steps the loop saves a checkpoint (model, optimizer, epoch, the
iterator's position and the history so far) with ``easycore.save_checkpoint``.

The script runs the loop three times, each in a fresh process: once without interruption;
once killed with SIGKILL at step 45 (mid-epoch, 5 steps after its last checkpoint); then
again, resuming from ``easycore.load_checkpoint``. It prints whether the resumed run saw
the same batches and the same loss at every step as the uninterrupted one, and whether the
final weights are equal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import torch

import easycore
from easycore import producer

N, BATCH, SEED, EVERY = 512, 16, 7, 10


@producer
def make_batch(indices):
    """A batch: features from each index plus noise drawn from the worker's seeded state."""
    idx = torch.tensor(indices)
    x = torch.stack([torch.sin(idx * 0.1), torch.cos(idx * 0.37), (idx % 5) / 5.0], 1)
    x = x + 0.05 * torch.randn(len(indices), 3)  # seeded: the same on every run
    y = (idx % 2).float()
    return idx, x, y


def train(epochs: int, ckpt_dir: str, crash_at: int | None) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    history = {"batches": [], "losses": []}
    start_epoch, data_state = 0, None
    ckpt = easycore.load_checkpoint(ckpt_dir)  # the newest, or None on a first run
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start_epoch, data_state, history = ckpt["epoch"], ckpt["data"], ckpt["history"]
        print(f"resumed at step {ckpt['step']} (epoch {start_epoch})", flush=True)
    with make_batch.open(devices=2) as runner:
        for epoch in range(start_epoch, epochs):
            order = easycore.permutation(N, SEED, epoch)
            it = runner.imap(order, batch_size=BATCH, seed=SEED, epoch=epoch, state=data_state)
            data_state = None  # only the first epoch after a restart resumes mid-way
            for idx, x, y in it:
                loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(1), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                history["batches"].append(idx.tolist()[:3])
                history["losses"].append(loss.item())
                step = len(history["losses"])
                if step % EVERY == 0:
                    easycore.save_checkpoint(
                        ckpt_dir, step, keep=2, model=model, optimizer=opt, epoch=epoch,
                        data=it, history=history,
                    )  # fmt: skip
                if step == crash_at:
                    os.kill(os.getpid(), signal.SIGKILL)  # pre-empted, mid-epoch
    history["weights"] = [round(v, 10) for v in model.weight.flatten().tolist()]
    return history


def run_child(epochs: int, ckpt_dir: str, crash_at: int | None) -> tuple[int, dict | None]:
    cmd = [sys.executable, __file__, "--child", str(epochs), ckpt_dir, str(crash_at or 0)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    for line in out.stdout.splitlines():
        if line.startswith("resumed"):
            print("  ", line)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("HISTORY ")]
    return out.returncode, json.loads(lines[0][8:]) if lines else None


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        epochs, ckpt_dir, crash = int(sys.argv[2]), sys.argv[3], int(sys.argv[4]) or None
        print("HISTORY " + json.dumps(train(epochs, ckpt_dir, crash)), flush=True)
        return
    epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with tempfile.TemporaryDirectory() as tmp:
        code, straight = run_child(epochs, os.path.join(tmp, "a"), None)
        assert code == 0 and straight is not None
        crash_at = N // BATCH + 13  # step 45: mid-epoch 1, 5 steps after a checkpoint
        code, _ = run_child(epochs, os.path.join(tmp, "b"), crash_at)
        print(f"killed at step {crash_at}: exit code {code} (SIGKILL is -9)")
        code, resumed = run_child(epochs, os.path.join(tmp, "b"), None)
        assert code == 0 and resumed is not None
    steps = len(straight["losses"])
    print(f"{steps} steps; losses: first {straight['losses'][0]:.4f}, last "
          f"{straight['losses'][-1]:.4f}")  # fmt: skip
    same = all(straight[k] == resumed[k] for k in ("batches", "losses", "weights"))
    print("same batches, losses and weights as the uninterrupted run:", "OK" if same else "NO")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
