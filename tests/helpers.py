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


def ledger_rows(db: Path) -> int:
    """How many units a run ledger (``resume=``) holds; 0 before it exists."""
    import contextlib
    import sqlite3

    if not db.exists():
        return 0
    with contextlib.closing(sqlite3.connect(db)) as con:
        try:
            return int(con.execute("SELECT count(*) FROM units").fetchone()[0])
        except sqlite3.OperationalError:  # the table is not created yet
            return 0
