"""Checkpoints of a training loop: written atomically on the main rank, loaded on every rank.

A checkpoint is one file, ``checkpoint-<step>`` in a directory, written with ``torch.save``:
a dict of what was given (objects with a ``state_dict()`` saved as it) plus ``step``. It is
written to a hidden temporary file in the same directory (``.checkpoint-<step>.<pid>.tmp``),
flushed to disk (``fsync``) and renamed over its final name (``os.replace``, atomic on a
POSIX file system), and the directory is synced: a process killed at any moment leaves
either the previous checkpoints alone or the new one complete, never a torn file under a
checkpoint's name. ``torch`` is imported only when a checkpoint is saved or loaded.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

__all__ = ["load_checkpoint", "save_checkpoint"]

_NAME = re.compile(r"checkpoint-(\d+)")
_TEMP = re.compile(r"\.checkpoint-\d+\.(\d+)\.tmp")


def save_checkpoint(
    directory: str | os.PathLike[str], step: int, keep: int | None = None, **objects: Any
) -> str | None:
    """Save a checkpoint ``checkpoint-<step>`` in ``directory`` atomically, on the main rank.

    Each keyword is saved under its name: an object with a ``state_dict()`` method (a model,
    an optimizer, a scheduler, an imap iterator) as what that returns, anything else as it
    is. A crash while saving (even SIGKILL) leaves the previous checkpoints loadable and no
    file under a checkpoint's name but complete ones. Under ``torchrun``/Slurm only rank 0
    writes (the others return None at once; no collective is involved, so call it on every
    rank alike).

    Args:
        directory: where checkpoints go (created when missing).
        step: the step (an int >= 0), part of the file's name and saved as ``step``.
        keep: keep only the newest ``keep`` checkpoints of ``directory`` (by step), deleting
            older ones after this one is saved; None keeps all.
        **objects: what to save (any name but ``step``).

    Returns:
        The path of the checkpoint written, or None on a rank other than the main one.

    Raises:
        ValueError: ``step`` or ``keep`` is not an int >= 0 (>= 1 for ``keep``).
        OSError: the directory or file cannot be written (no partial file is left).

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> path = save_checkpoint(d, 7, epoch=1, data={"position": 3})
    >>> load_checkpoint(d)["data"], load_checkpoint(d)["step"]
    ({'position': 3}, 7)
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        msg = f"step must be an int >= 0, got {step!r}"
        raise ValueError(msg)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        msg = f"keep must be an int >= 1 or None, got {keep!r}"
        raise ValueError(msg)
    from easycore.distributed import is_main

    if not is_main():
        return None
    import torch

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    _remove_stale_temps(directory)
    payload: dict[str, Any] = {}
    for name, obj in objects.items():
        state_dict = getattr(obj, "state_dict", None)
        payload[name] = state_dict() if callable(state_dict) else obj
    payload["step"] = step
    path = os.path.join(directory, f"checkpoint-{step}")
    temp = os.path.join(directory, f".checkpoint-{step}.{os.getpid()}.tmp")
    try:
        with open(temp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _sync_dir(directory)
    if keep is not None:
        for _, old in _checkpoints(directory)[:-keep]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old)
    return path


def load_checkpoint(
    path: str | os.PathLike[str], map_location: Any = None, *, weights_only: bool = True
) -> dict[str, Any] | None:
    """Load a checkpoint file, or the newest (highest step) checkpoint of a directory.

    Args:
        path: a checkpoint file, or a directory of them.
        map_location: where tensors go, as for ``torch.load`` (e.g. ``"cpu"``, or
            ``f"cuda:{local_rank}"`` on every rank).
        weights_only: torch's safe loader (the default): tensors, state dicts of models
            and optimizers, imap positions, numbers, strings, lists, dicts and tuples load;
            a checkpoint holding other objects needs ``weights_only=False`` (which runs the
            pickle's code: only for files you trust).

    Returns:
        The dict that was saved (``step`` included), or None when ``path`` is a directory
        without a checkpoint, or does not exist yet (the first run of a training script).

    Raises:
        FileNotFoundError: ``path`` names a checkpoint file (``checkpoint-<step>``) that
            does not exist.
        pickle.UnpicklingError: an object the safe loader refuses (see ``weights_only``).
    """
    import torch

    path = os.fspath(path)
    if not os.path.exists(path) and _NAME.fullmatch(os.path.basename(path)) is not None:
        msg = f"no checkpoint file {path}"
        raise FileNotFoundError(msg)
    if not os.path.isfile(path):
        found = _checkpoints(path) if os.path.isdir(path) else []
        if not found:
            return None  # a directory without a checkpoint yet (or not made yet)
        path = found[-1][1]
    loaded: dict[str, Any] = torch.load(path, map_location=map_location, weights_only=weights_only)
    return loaded


def _checkpoints(directory: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint in ``directory``, oldest first."""
    found = []
    for entry in os.scandir(directory):
        m = _NAME.fullmatch(entry.name)
        if m is not None and entry.is_file():
            found.append((int(m.group(1)), entry.path))
    return sorted(found)


def _remove_stale_temps(directory: str) -> None:
    """Delete temporary files left by saves killed in this directory (their process gone)."""
    for entry in os.scandir(directory):
        m = _TEMP.fullmatch(entry.name)
        if m is None or _alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError):
            os.unlink(entry.path)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # (an earlier save of this process that failed)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sync_dir(directory: str) -> None:
    """Make the rename durable: fsync the directory (where the OS allows)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
