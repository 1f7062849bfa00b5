"""On Ray, as on the local engines (tests/process/test_first_hour_more.py): an uncaught run
error shows the user's line and at most one frame of easycore, and an async item past its
timeout has no internal class as its cause. The scripts join this folder's Ray (starting
one of their own costs ~5 s a script)."""

from __future__ import annotations

import os

import pytest

import easycore
from helpers import run_error_script

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def env(local_ray):
    import ray

    return {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}


def test_an_uncaught_error_shows_one_frame_of_easycore(tmp_path, env):
    script, out = run_error_script(tmp_path, "map", "ray", env)
    assert out.count(f'File "{script}", line 10, in predict') == 1, out
    assert out.count(f'File "{os.path.dirname(easycore.__file__)}') <= 1, out


def test_an_uncaught_async_timeout_shows_no_internal_cause(tmp_path, env):
    _, out = run_error_script(tmp_path, "timeout", "ray", env)
    assert "ItemTimeout: waits ran past timeout=0.5s" in out, out
    assert "TimedOutItem" not in out and "direct cause" not in out, out
    assert out.count(f'File "{os.path.dirname(easycore.__file__)}') <= 1, out
