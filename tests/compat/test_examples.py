"""easycore 0.4's multiprocessing tutorial: its four examples, run as the scripts they are.

The scripts in ``examples/`` are the tutorial's code blocks, unchanged (``network.py`` beside
this file is the tutorial's ``network.py``). Each runs as ``__main__``, so its
``if __name__ == '__main__':`` block runs, prints and closes the runner. The only change made
here is to device strings: each ``"cuda:N"`` becomes ``"cpu"`` on a machine without a GPU,
and ``"cuda:N mod GPUs"`` on one with fewer GPUs than the tutorial's four.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).parent / "examples"

DEVICE_KINDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def place_devices(source: str, gpus: int) -> str:
    """Rewrite the tutorial's ``"cuda:N"`` literals for this machine (``gpus=0``: ``"cpu"``)."""

    def one(match: re.Match[str]) -> str:
        return '"cpu"' if gpus == 0 else f'"cuda:{int(match.group(1)) % gpus}"'

    return re.sub(r'"cuda:(\d+)"', one, source)


def run_script(name: str, kind: str = "cpu") -> dict[str, Any]:
    """Run ``examples/NAME`` as ``__main__``; return its globals."""
    gpus = 0
    if kind == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    path = EXAMPLES / name
    source = place_devices(path.read_text(encoding="utf-8"), gpus)
    namespace: dict[str, Any] = {"__name__": "__main__", "__file__": str(path)}
    exec(compile(source, str(path), "exec"), namespace)
    return namespace


class TestPlaceDevices:
    def test_cpu_without_gpu(self):
        """Every "cuda:N" becomes "cpu" when there is no GPU."""
        assert place_devices('d = ["cuda:0", "cuda:3"]', 0) == 'd = ["cpu", "cpu"]'

    def test_wraps_onto_available_gpus(self):
        """With fewer GPUs than the tutorial's, devices wrap around the real ones."""
        wrapped = place_devices('["cuda:0", "cuda:1", "cuda:2"]', 2)
        assert wrapped == '["cuda:0", "cuda:1", "cuda:0"]'


class TestExample1SumOfSquares:
    def test_prints_sum_of_squares(self, capsys):
        """Example 1 prints sum(i * i for i in range(100)) and closes its runner."""
        ns = run_script("sum_of_squares.py")
        assert ns["result"] == sum(i * i for i in range(100)) == 328350
        assert capsys.readouterr().out == "328350\n"
        assert not ns["runner"].is_activate


class TestExample2Predictor:
    @pytest.mark.parametrize("kind", DEVICE_KINDS)
    def test_predicts_every_item(self, kind, capsys):
        """Example 2 returns one ReLU output row per item, in input order, on 4 workers."""
        ns = run_script("predictor.py", kind)
        result = ns["result"]
        assert tuple(result.shape) == (100, 3)
        assert capsys.readouterr().out == "torch.Size([100, 3])\n"
        assert result.device.type == "cpu"
        assert bool((result >= 0).all())
        assert not ns["predictor"].is_activate


class TestExample3BatchPredictor:
    @pytest.mark.parametrize("kind", DEVICE_KINDS)
    def test_predicts_batches(self, kind, capsys):
        """Example 3 (easycore.torch.parallel) turns 10 batches of 10 into a (100, 3) tensor."""
        ns = run_script("batch_predictor.py", kind)
        assert tuple(ns["result"].shape) == (100, 3)
        assert capsys.readouterr().out == "torch.Size([100, 3])\n"
        assert not ns["predictor"].is_activate


class TestExample4SumOfPower:
    def test_exponent_travels_in_cfg(self, capsys):
        """Example 4 reads cfg.exponent in the workers: the sum of cubes of 0..99."""
        ns = run_script("sum_of_power.py")
        assert ns["result"] == sum(i**3 for i in range(100)) == 24502500
        assert capsys.readouterr().out == "24502500\n"
        assert dict(ns["cfg"]) == {"exponent": 3}  # the caller's cfg is left as it was
