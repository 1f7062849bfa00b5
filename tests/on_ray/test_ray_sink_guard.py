"""easycore.write guards on engine="ray" (API.md section 10): a URL the actors cannot reach
is refused before any actor starts; what fails every item (a key column the results hold)
fails the run under errors="skip", never item by item; one run at a time writes a
directory."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

from easycore import WorkerError, producer, write
from helpers import our_actors

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("local_ray")]


@producer
def with_id(x):
    return {"id": f"own{x}", "x": x}


def test_memory_url_is_refused_before_any_actor_starts():
    pytest.importorskip("fsspec")
    with pytest.raises(ValueError, match="memory://"):
        (with_id >> write.parquet("memory://guard/ray")).map(range(4), devices=2, engine="ray")
    assert our_actors() == []


def test_a_key_column_clash_fails_the_run_under_skip(tmp_path):
    failed = []
    sink = write.parquet(str(tmp_path / "out"), key_column="id")
    with pytest.raises(WorkerError, match="'id'"):
        (with_id >> sink).map(
            range(12), devices=2, engine="ray", errors="skip", on_error=failed.append
        )
    assert failed == []
    assert not [n for n in os.listdir(tmp_path / "out") if n.startswith(".")]


def test_a_second_run_into_the_directory_is_refused_while_the_first_writes(tmp_path):
    out = tmp_path / "out"
    first = (with_id >> write.parquet(str(out), rows_per_file=3)).imap(
        range(12), devices=1, engine="ray"
    )
    try:
        with pytest.raises(ValueError, match="another run"):
            (with_id >> write.parquet(str(out))).map(range(3), devices=1, engine="ray")
        assert sum(part.rows for part in first) == 12
    finally:
        first.close()
    assert len(pq.read_table(out)) == 12  # the lock, a "."-file, is gone and never read
    assert not [n for n in os.listdir(out) if n.startswith(".")]
