"""Small helpers shared by the process tests (importable in workers: conftest puts this
directory on sys.path, and workers receive the caller's sys.path)."""

from __future__ import annotations

import os
from pathlib import Path


def first_time(marker: Path) -> bool:
    """True the first time it is called for `marker` (across processes)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True
