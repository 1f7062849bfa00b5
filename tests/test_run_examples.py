"""Every example runs as `python examples/NAME.py` and prints what it promises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

CASES = [
    ("sum_of_squares.py", [], "328350"),
    ("predictor.py", [], "torch.Size([100, 3])"),
    ("batches.py", [], "torch.Size([100, 3])"),
    ("sum_of_power.py", [], "24502500"),
    ("cpu_speedup.py", ["20"], "speed-up"),
    ("demo.py", [], "inline run agrees: OK"),
    ("decode_then_predict.py", ["300"], "inline run agrees: OK"),
    ("train_loop.py", ["300"], "going down: OK"),
    ("train_resume.py", [], "weights as the uninterrupted run: OK"),
    ("download_then_embed.py", ["200"], "inline run agrees: OK"),
    ("embed_to_parquet.py", ["192"], "192 embeddings in"),
    ("self_sizing.py", ["300"], "the same results as a fixed split: OK"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "args", "expect"), CASES, ids=[c[0] for c in CASES])
def test_example_runs(name, args, expect):
    """The example exits 0 and prints its result."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "pkg") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=EXAMPLES,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr
    assert expect in out.stdout
