"""numpy 2 imports numpy.random on first use (about 10 ms): a worker seeds it only once
something imports it, with the seed it would have had, so a worker that never draws from
numpy does not pay for it (a forked worker's start-up)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

PKG = str(Path(__file__).resolve().parents[2] / "pkg")


def test_numpy_random_is_seeded_when_imported_not_before():
    code = textwrap.dedent(
        """
        import sys
        import numpy
        sys.modules.pop("numpy.random", None)  # (as numpy 2 leaves it until first use)
        from easycore import seed_everything
        seed_everything(7)
        print("numpy.random" in sys.modules)
        print(numpy.random.random())
        seed_everything(7)
        print(numpy.random.random())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": PKG},
    )
    assert out.returncode == 0, out.stderr
    imported, first, again = out.stdout.split()
    assert imported == "False"
    assert first == again
