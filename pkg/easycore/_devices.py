"""What ``devices=`` means: one device string per worker, checked before any process starts.

A leaf: it imports torch only to count GPUs, and only where an NVIDIA driver exists.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["INLINE", "bind_gpus", "cpu_count", "gpu_count", "parse_devices"]

INLINE = "inline"  # no worker processes: everything runs in the calling process


def cpu_count() -> int:
    """The CPU cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def gpu_count() -> int:
    """Visible CUDA devices; 0 without loading torch where no NVIDIA driver exists."""
    # Importing torch costs a second or more; skip it where no NVIDIA driver exists at all.
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    if hidden or not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidia0")):
        return 0
    import torch

    return int(torch.cuda.device_count())


def _is_torch_device(value: Any) -> bool:
    torch = sys.modules.get("torch")  # (not imported: no value is a torch.device)
    return torch is not None and isinstance(value, torch.device)


def _one_device(entry: Any, gpus: Callable[[], int]) -> str:
    text = str(entry) if _is_torch_device(entry) else entry
    if not isinstance(text, str):
        msg = f"a device must be a string like 'cpu' or 'cuda:0' or a torch.device, got {entry!r}"
        raise ValueError(msg)
    if text in ("cpu", "cpu:0"):
        return "cpu"
    if text == "cuda" or text.startswith("cuda:"):
        number = text[5:] or "0"
        if not number.isdigit():
            msg = f"bad device {entry!r}: expected 'cuda:N' with N a GPU number"
            raise ValueError(msg)
        count = gpus()
        if int(number) >= count:
            msg = f"device {entry!r} does not exist: this machine has {count} visible GPU(s)" + (
                f" (cuda:0 .. cuda:{count - 1})" if count else ""
            )
            raise ValueError(msg)
        return f"cuda:{int(number)}"
    msg = f"unknown device {entry!r}: use 'cpu', 'cuda:N', 'cuda', 'auto', 'inline' or an int"
    raise ValueError(msg)


def _one_group(entry: tuple[Any, ...], gpus: Callable[[], int]) -> str:
    """A tuple of GPUs for one worker, as ``"cuda:0,1"`` (one GPU: ``"cuda:0"``)."""
    if not entry:
        msg = "an empty device group (); a group is a tuple of GPUs such as ('cuda:0', 'cuda:1')"
        raise ValueError(msg)
    parts = [_one_device(d, gpus) for d in entry]
    if any(not p.startswith("cuda:") for p in parts):
        msg = f"a device group holds GPUs only ('cuda:N'), got {entry!r}"
        raise ValueError(msg)
    numbers = [p[5:] for p in parts]
    if len(set(numbers)) != len(numbers):
        msg = f"a device group names a GPU twice: {entry!r}"
        raise ValueError(msg)
    return "cuda:" + ",".join(numbers)


def bind_gpus(device: str) -> str:
    """In a worker, before anything initialises CUDA: a worker holding a group of GPUs
    (``"cuda:2,3"``) is made to see only those (``CUDA_VISIBLE_DEVICES``, mapped through the
    one it inherited), and its device is then ``"cuda:0"``; any other device is returned as
    it is."""
    if "," not in device:
        return device
    ids = device[5:].split(",")  # (as parse_devices wrote them: "cuda:0,1")
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited:  # (mapped through the GPUs it sees)
        ids = [inherited.split(",")[int(n)].strip() for n in ids]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    return "cuda:0"


def parse_devices(devices: Any) -> list[str]:
    """Turn the ``devices`` argument into one device string per worker, or ``["inline"]``.

    A tuple in a list is a group of GPUs for one worker: ``[("cuda:0", "cuda:1")]`` is one
    worker holding two GPUs, as ``"cuda:0,1"`` (see :func:`bind_gpus`).

    Raises:
        ValueError: an impossible device (``0``, ``-1``, ``"tpu"``, a GPU that is not there,
            a group with something else than GPUs or with a GPU twice).

    >>> parse_devices(2)
    ['cpu', 'cpu']
    >>> parse_devices("inline")
    ['inline']
    """
    gpus = functools.cache(gpu_count)  # counted once, and only when asked for
    if isinstance(devices, int) and not isinstance(devices, bool):  # (a bool: the last error)
        if devices < 1:
            msg = f"devices={devices}: need at least 1 worker (an int means that many CPU workers)"
            raise ValueError(msg)
        return ["cpu"] * devices
    if isinstance(devices, str) and devices in (INLINE, "auto", "cuda"):
        if devices == INLINE:
            return [INLINE]
        if gpus():
            return [f"cuda:{i}" for i in range(gpus())]
        if devices == "cuda":
            msg = "devices='cuda' but no GPU is visible; use an int for CPU workers or 'auto'"
            raise ValueError(msg)
        return ["cpu"] * cpu_count()
    if isinstance(devices, str) or _is_torch_device(devices):
        return [_one_device(devices, gpus)]
    if isinstance(devices, Iterable):
        out = [
            _one_group(d, gpus) if isinstance(d, tuple) else _one_device(d, gpus) for d in devices
        ]
        if not out:
            msg = "devices is an empty list: give at least one device"
            raise ValueError(msg)
        return out
    msg = f"devices must be an int, a list of devices, 'cuda', 'auto' or 'inline', got {devices!r}"
    raise ValueError(msg)
