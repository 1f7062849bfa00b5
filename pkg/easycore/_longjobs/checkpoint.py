"""Checkpoints of a training loop: written atomically on the main rank, loaded on every rank.

A checkpoint is one file, ``checkpoint-<step>`` in a directory, written with ``torch.save``:
a dict of what was given (objects with a ``state_dict()`` saved as it) plus ``step``. It is
written to a hidden temporary file in the same directory (``.checkpoint-<step>.<pid>.tmp``),
flushed to disk (``fsync``) and renamed over its final name (``os.replace``, atomic on a
POSIX file system), and the directory is synced: a process killed at any moment leaves
either the previous checkpoints alone or the new one complete, never a torn file under a
checkpoint's name. ``torch`` is imported only when a checkpoint is saved or loaded.

"Newest" is the one saved last, by the file's modification time (``st_mtime_ns``): a save
that lands within the clock's resolution of the previous one moves its own time past it,
so the order survives a restart; equal times (a file system that keeps whole seconds)
fall back to the step.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import struct
import zipfile
from typing import Any

from easycore._errors import warn
from easycore._longjobs.commit import alive
from easycore._options import check_count

__all__ = ["load_checkpoint", "save_checkpoint"]

_NAME = re.compile(r"checkpoint-(\d+)")
_TEMP = re.compile(r"\.checkpoint-\d+\.(\d+)\.tmp")
_WARNED: set[str] = set()  # directories warned of a step lower than one they hold


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

    The checkpoint saved last is the newest, whatever its step: a new run that starts at a
    low step in an old directory is loaded next, never deleted by ``keep`` in favour of the
    old run's higher steps (a step lower than one the directory holds warns, once per
    directory).

    Args:
        directory: where checkpoints go (created when missing).
        step: the step (an int >= 0), part of the file's name and saved as ``step``.
        keep: keep only the ``keep`` checkpoints of ``directory`` saved last (this one
            included), deleting older ones after this one is saved; None keeps all.
        **objects: what to save (any name but ``step``).

    Returns:
        The path of the checkpoint written, or None on a rank other than the main one.

    Raises:
        ValueError: ``step`` or ``keep`` is not an int >= 0 (>= 1 for ``keep``).
        TypeError: an object cannot be saved (pickled): the message names its keyword.
        OSError: the directory or file cannot be written (no partial file is left).

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> path = save_checkpoint(d, 7, epoch=1, data={"position": 3})
    >>> load_checkpoint(d)["data"], load_checkpoint(d)["step"]
    ({'position': 3}, 7)
    """
    check_count("step", step, minimum=0, optional=False)
    check_count("keep", keep)
    from easycore.distributed import is_main

    if not is_main():
        return None
    import torch

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    for entry in os.scandir(directory):  # temporary files of saves killed here: removed
        m = _TEMP.fullmatch(entry.name)
        pid = m and int(m.group(1))  # (this process's: an earlier save that failed)
        if pid and (pid == os.getpid() or not alive(pid)):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
    path = os.path.join(directory, f"checkpoint-{step}")
    others = [found for found in _checkpoints(directory) if found[2] != path]
    higher = max((found[1] for found in others), default=-1)
    if higher > step and os.path.realpath(directory) not in _WARNED:  # (once per directory)
        _WARNED.add(os.path.realpath(directory))
        msg = (
            f"saving checkpoint-{step} in {directory}, which holds checkpoint-{higher} (of an "
            "earlier run?): the newest checkpoint is the one saved last, and keep= deletes "
            "the ones saved first, whatever their steps; give each run its own directory to "
            "keep them apart"
        )
        warn(msg)
    states = {
        k: v.state_dict() for k, v in objects.items() if callable(getattr(v, "state_dict", None))
    }
    payload = objects | states | {"step": step}
    temp = os.path.join(directory, f".checkpoint-{step}.{os.getpid()}.tmp")
    try:
        with open(temp, "wb") as f:
            try:
                torch.save(payload, f)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                for name, obj in payload.items():  # (the object pickle refuses, named)
                    try:
                        torch.save(obj, io.BytesIO())
                    except (pickle.PicklingError, TypeError, AttributeError):
                        msg = (
                            f"save_checkpoint: the object {name!r} (a {type(obj).__name__}) "
                            f"cannot be saved ({exc}); save what it holds instead: tensors, "
                            "state dicts, numbers, strings, and lists, tuples and dicts of them"
                        )
                        raise TypeError(msg) from exc
                raise
            f.flush()
            os.fsync(f.fileno())
        # before it takes its name, a modification time after the newest other's: two saves
        # within the clock's resolution (or a clock set back) would tie or reverse
        latest = others[-1][0] if others else -1
        for later in (latest + 1, latest + 2 * 10**9):  # ns; seconds where the fs rounds
            stat = os.stat(temp)
            if stat.st_mtime_ns > latest:
                break
            os.utime(temp, ns=(stat.st_atime_ns, later))
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    with contextlib.suppress(OSError):  # the rename made durable, where the OS allows
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if keep is not None:
        for *_, old in others[: max(0, len(others) - keep + 1)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old)
    return path


def load_checkpoint(
    path: str | os.PathLike[str], map_location: Any = None, *, weights_only: bool = True
) -> dict[str, Any] | None:
    """Load a checkpoint file, or the newest (saved last) checkpoint of a directory.

    A damaged file (empty, cut short, overwritten) is a ``ValueError`` naming it; from a
    directory, the checkpoint saved before it is loaded instead, with a warning naming the
    damaged one.

    Args:
        path: a checkpoint file, or a directory of them.
        map_location: where tensors go, as for ``torch.load`` (e.g. ``"cpu"``, or
            ``f"cuda:{local_rank}"`` on every rank).
        weights_only: torch's safe loader (the default): tensors, state dicts of models
            and optimizers, imap positions, numpy arrays and scalars (a random state; with
            torch >= 2.5), numbers, strings, lists, dicts and tuples load;
            a checkpoint holding other objects needs ``weights_only=False`` (which runs the
            pickle's code: only for files you trust).

    Returns:
        The dict that was saved (``step`` included), or None when ``path`` is a directory
        without a checkpoint, or does not exist yet (the first run of a training script).

    Raises:
        FileNotFoundError: ``path`` names a checkpoint file (``checkpoint-<step>``) that
            does not exist.
        ValueError: the file is damaged or not a checkpoint (from a directory: every
            checkpoint in it is).
        pickle.UnpicklingError: an object the safe loader refuses (see ``weights_only``).
    """
    path = os.fspath(path)
    if not os.path.exists(path) and _NAME.fullmatch(os.path.basename(path)) is not None:
        msg = f"no checkpoint file {path}"
        raise FileNotFoundError(msg)
    if os.path.isfile(path):
        return _load(path, map_location, weights_only)
    found = _checkpoints(path) if os.path.isdir(path) else []
    for left, (*_, candidate) in reversed(list(enumerate(found))):
        try:
            return _load(candidate, map_location, weights_only)
        except ValueError as err:
            if not left:
                raise
            warn(f"{err}; loading {os.path.basename(found[left - 1][2])}, saved before it")
    return None  # a directory without a checkpoint yet (or not made yet)


def _load(path: str, map_location: Any, weights_only: bool) -> dict[str, Any]:
    """``torch.load`` one checkpoint file; a damaged one is a ValueError naming it."""
    import torch

    allowed = _numpy_globals() if weights_only else []
    safe = getattr(torch.serialization, "safe_globals", None)  # (torch >= 2.5)
    try:
        with safe(allowed) if safe is not None and allowed else contextlib.nullcontext():
            loaded = torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as err:
        if not _torn(path, err):
            raise  # a sound file refused (weights_only), a bad map_location, an OSError...
        lines = str(err).strip().splitlines() or [""]
        what = f"{type(err).__name__}: {lines[0][:200]}".rstrip(": ")
        if os.path.getsize(path) == 0:
            what = "the file is empty"
        msg = f"checkpoint {path} is damaged ({what}); delete it or load another checkpoint"
        raise ValueError(msg) from err
    if not isinstance(loaded, dict):
        msg = f"{path} is not a checkpoint: it holds a {type(loaded).__name__}, not a dict"
        raise ValueError(msg)
    return loaded


def _numpy_globals() -> list[Any]:
    """What the safe loader needs to rebuild numpy arrays, scalars and dtypes (a random
    state, a metric kept as an array): constructors of data, no code. Empty without numpy."""
    try:
        import numpy as np  # (torch's loader imports it for such a file all the same)
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core  # (numpy 2, numpy 1)
    # the dtype classes, from numpy.dtypes only (numpy >= 1.25), never numpy's other classes:
    # np.memmap, called with a file's arguments, would write files
    kinds = vars(np.dtypes).values() if hasattr(np, "dtypes") else ()
    dtypes = [v for v in kinds if isinstance(v, type) and issubclass(v, np.dtype)]
    return [np.ndarray, np.dtype, core.multiarray._reconstruct, core.multiarray.scalar, *dtypes]


def _torn(path: str, err: Exception) -> bool:
    """Whether ``torch.load``'s ``err`` says the file is damaged (cut short, overwritten)."""
    if isinstance(err, OSError) or "Unsupported global" in str(err):
        return False
    if isinstance(err, (EOFError, KeyError, pickle.UnpicklingError, struct.error)):
        return True  # what pickle says of bytes that are not (all) a pickle
    # torch.save writes a zip file: one that is not, or that its reader fails on, is torn
    return "PytorchStreamReader" in str(err) or not zipfile.is_zipfile(path)


def _checkpoints(directory: str) -> list[tuple[int, int, str]]:
    """``(mtime_ns, step, path)`` of every complete checkpoint in ``directory``, the one
    saved last last (equal times, from a coarse clock: by step)."""
    found = []
    for entry in os.scandir(directory):
        with contextlib.suppress(FileNotFoundError):  # deleted meanwhile (keep= elsewhere)
            if (m := _NAME.fullmatch(entry.name)) is not None and entry.is_file():
                found.append((entry.stat().st_mtime_ns, int(m.group(1)), entry.path))
    return sorted(found)
