"""A worker's way to its first item: what the process that starts workers settles once."""

from __future__ import annotations

import subprocess
import sys


def test_the_process_that_starts_workers_finds_the_temporary_directory_once():
    # A worker names its multiprocessing directory after tempfile's, which tempfile finds by
    # writing a probe file into each candidate: settled where the worker module is imported
    # (the forkserver, or a caller that forks), every worker inherits it instead.
    code = "import tempfile, easycore._exec.process.worker_loop; print(tempfile.tempdir)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() not in ("", "None")
