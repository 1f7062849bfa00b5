"""An uncaught run error shows the user's line and at most one frame of easycore, on every
engine and entry point; an async item past its timeout has no internal class as its cause,
as a killed item (API.md sections 2, 3 and 11; issue #44.5, #44.6)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

import easycore
from easycore import ItemTimeout, producer

pytestmark = pytest.mark.timeout(120)


@producer
async def waits(x):
    await asyncio.sleep(5 if x == 1 else 0)
    return x


@pytest.mark.parametrize("devices", [2, "inline"])
def test_an_async_timeout_has_no_cause(devices):
    """As a sync item past its timeout (killed: ``__cause__`` None), not TimedOutItem."""
    with pytest.raises(ItemTimeout) as info:
        waits.map(range(3), devices=devices, timeout=0.5)
    assert info.value.__cause__ is None
    assert info.value.index == 1


SCRIPT = """\
import asyncio
import sys

from easycore import producer


@producer
def predict(x):
    if x == 3:
        raise ValueError("bad item")  # the user's line
    return x


@producer
async def waits(x):
    await asyncio.sleep(5 if x == 1 else 0)
    return x


if __name__ == "__main__":
    how, where = sys.argv[1], sys.argv[2]
    options = {"engine": "ray"} if where == "ray" else {}
    if where == "ray":
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    devices = "inline" if where == "inline" else 2
    if how == "timeout":
        waits.map(range(3), devices=devices, timeout=0.5, **options)
    elif how == "map":
        predict.map(range(6), devices=devices, **options)
    elif how == "imap":
        list(predict.imap(range(6), devices=devices, **options))
    elif how == "runner":
        with predict.open(devices, **options) as runner:
            runner.map(range(6))
    else:
        with predict.open(devices, **options) as runner:
            list(runner.imap(range(6)))
"""


def run_script(tmp_path, how, where):
    script = tmp_path / "predict.py"
    script.write_text(SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), how, where],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert run.returncode == 1, run.stderr
    return script, run.stderr


@pytest.mark.parametrize("how", ["map", "imap", "runner", "runner-imap"])
@pytest.mark.parametrize("where", ["2", "inline"])
def test_the_callers_side_shows_one_frame_of_easycore(tmp_path, how, where):
    script, out = run_script(tmp_path, how, where)
    assert out.count(f'File "{script}", line 10, in predict') == 1, out
    library = os.path.dirname(easycore.__file__)
    assert out.count(f'File "{library}') <= 1, out


@pytest.mark.parametrize("where", ["2", "inline", "ray"])
def test_an_uncaught_async_timeout_shows_no_internal_cause(tmp_path, where):
    pytest.importorskip("ray") if where == "ray" else None
    _, out = run_script(tmp_path, "timeout", where)
    assert "ItemTimeout: waits ran past timeout=0.5s" in out, out
    assert "TimedOutItem" not in out and "direct cause" not in out, out
    library = os.path.dirname(easycore.__file__)
    assert out.count(f'File "{library}') <= 1, out


def test_an_uncaught_error_on_ray_shows_one_frame_of_easycore(tmp_path):
    pytest.importorskip("ray")
    script, out = run_script(tmp_path, "map", "ray")
    assert out.count(f'File "{script}", line 10, in predict') == 1, out
    assert out.count(f'File "{os.path.dirname(easycore.__file__)}') <= 1, out
