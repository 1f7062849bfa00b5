"""Workers that hold several GPUs (API.md section 10): ``devices=[("cuda:0", "cuda:1"), ...]``.

Without a GPU here, the machine's GPU count is faked in the caller (where devices are
checked) and the environment a group's worker sets up is checked in a fresh interpreter;
the ``gpu`` test runs real workers where GPUs are visible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from easycore import producer

FOUR_GPUS = "easycore._devices.gpu_count"  # (monkeypatched: the machine has 4 GPUs)


@producer
def where(x, *, device):
    return device


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(FOUR_GPUS, lambda: 4)


def test_groups_are_checked_before_any_worker_starts(four_gpus):
    with pytest.raises(ValueError, match="does not exist"):
        where.map([1], devices=[("cuda:0", "cuda:7")])  # a GPU the machine lacks
    with pytest.raises(ValueError, match="twice"):
        where.map([1], devices=[("cuda:1", "cuda:1")])
    with pytest.raises(ValueError, match="GPUs only"):
        where.map([1], devices=[("cuda:0", "cpu")])
    with pytest.raises(ValueError, match="empty device group"):
        where.map([1], devices=[()])
    with pytest.raises(ValueError, match="does not exist"):
        where.on([("cuda:2", "cuda:5")]).map([1])


def test_a_group_without_gpus_is_a_value_error():
    if os.path.exists("/proc/driver/nvidia"):
        pytest.skip("this machine has an NVIDIA driver")
    with pytest.raises(ValueError, match="0 visible GPU"):
        where.map([1], devices=[("cuda:0", "cuda:1")])


BIND = """
import json, os, sys
from importlib import import_module
bind = import_module("easycore._devices").bind_gpus
device = bind(sys.argv[1])
print(json.dumps([device, os.environ.get("CUDA_VISIBLE_DEVICES"), "torch" in sys.modules]))
"""


@pytest.mark.parametrize(
    ("device", "inherited", "visible"),
    [("cuda:2,3", None, "2,3"), ("cuda:0,1", "4,5,6,7", "4,5"), ("cuda:1,3", "a,b,c,d", "b,d")],
)
def test_a_group_worker_sees_only_its_gpus_as_cuda_0(device, inherited, visible):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    if inherited is not None:
        env["CUDA_VISIBLE_DEVICES"] = inherited
    out = subprocess.run(
        [sys.executable, "-c", BIND, device], capture_output=True, text=True, env=env, check=True
    )
    got_device, got_visible, torch_loaded = json.loads(out.stdout)
    assert (got_device, got_visible) == ("cuda:0", visible)
    assert not torch_loaded  # set before anything could initialise CUDA


@pytest.mark.gpu
def test_group_workers_on_real_gpus():
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip("needs 2 GPUs")

    @producer
    def sees(x, *, device):
        import torch

        return device, torch.cuda.device_count(), os.environ["CUDA_VISIBLE_DEVICES"]

    groups = [tuple(f"cuda:{i}" for i in range(k, k + 2)) for k in range(0, n - 1, 2)]
    got = sees.map(range(len(groups) * 4), devices=groups)
    assert {(d, c) for d, c, _ in got} == {("cuda:0", 2)}
    assert {v for *_, v in got} <= {f"{k},{k + 1}" for k in range(0, n - 1, 2)}
