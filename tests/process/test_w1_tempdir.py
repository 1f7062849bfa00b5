"""A worker's temporary directory follows the caller's environment of the run."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from easycore import producer


@producer
def temp_dir(x: int) -> str:
    return tempfile.gettempdir()


def test_a_forkserver_worker_uses_the_callers_temporary_directory_of_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp_dir.map([0], devices=1, start_method="forkserver")  # the forkserver is up
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert temp_dir.map([0], devices=1, start_method="forkserver") == [str(tmp_path)]
