"""The conformance suite: generated pipelines on every engine, against a reference.

``reference.py`` is the contract as sequential code; ``generated.py`` draws cases and runs
them. CI runs a sample (``HYPOTHESIS_PROFILE=ci``); ``just conformance`` runs many more.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `import reference`, `import generated`

# Cases per test: 30 on the local engines in CI, EASYCORE_CONFORMANCE=1000 for `just
# conformance`. A Ray case starts its actors (~2 s on 2 cores): 4 per Ray test in CI (each
# resume case runs twice on Ray), EASYCORE_CONFORMANCE_RAY for more.
EXAMPLES = int(os.environ.get("EASYCORE_CONFORMANCE", "30"))
RAY_EXAMPLES = int(os.environ.get("EASYCORE_CONFORMANCE_RAY", "4"))


@pytest.fixture(autouse=True)
def forced_resizes(monkeypatch):
    """Self-sizing pools change their sizes at random every few tens of milliseconds, so
    that workers come and go in the middle of runs (``sizing.Balancer.churn``)."""
    from easycore._exec.core import sizing

    monkeypatch.setattr(sizing, "CHURN", random.Random(0))
    monkeypatch.setattr(sizing, "CHURN_EVERY", 0.03)
