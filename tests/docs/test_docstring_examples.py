"""The ``>>>`` examples of the public docstrings (the reference shows them) run as written.

They run in a fresh interpreter: some seed the global random generators or initialise
``easycore.distributed``, which must not leak into other tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from typing import Any

from docs_audit import ROOT, public_objects

RUNNER = """
import doctest, importlib, sys
failed = tried = 0
for name in sys.argv[1:]:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    failed += result.failed
    tried += result.attempted
print(f"{tried} examples, {failed} failed")
sys.exit(1 if failed or not tried else 0)
"""


def _module_of(obj: Any) -> str | None:
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(obj, property):
        return obj.fget.__module__ if obj.fget else None
    return getattr(obj, "__module__", None)


def test_docstring_examples_run(tmp_path):
    """Every example in the docstrings of the modules that define a public name passes."""
    modules = sorted({_module_of(obj) or "" for _, obj in public_objects()})
    modules = [m for m in modules if m.startswith("easycore")]
    assert "easycore._pipeline" in modules
    out = subprocess.run(
        [sys.executable, "-c", RUNNER, *modules],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT / "pkg")},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    tried = int(out.stdout.split()[0])
    assert tried >= 100, out.stdout
