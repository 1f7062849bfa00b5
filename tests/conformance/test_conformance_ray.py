"""engine="ray" gives what the reference interpreter gives, on generated cases (a real local
Ray; 8 logical CPUs, so that every generated pool fits)."""

from __future__ import annotations

import attrs
import pytest
from generated import cases, check, check_resumed
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_conformance import SETTINGS, TWO_POOLS_FAIL

from conftest import RAY_EXAMPLES
from helpers import no_actors_left, running_ray

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    yield from running_ray(8)


@pytest.fixture(autouse=True)
def no_leaks():
    """After every test: no easycore actor alive (Ray's own processes stay for the module)."""
    yield from no_actors_left()


@settings(SETTINGS, max_examples=RAY_EXAMPLES)
@given(case=cases())
@example(case=TWO_POOLS_FAIL)
@example(case=attrs.evolve(TWO_POOLS_FAIL, sink=True, items=(0, 2, 5, 9, 11, 12)))
def test_ray_agrees_with_the_reference(case):
    """Results, order, Failure records, the raised error and stats() equal the reference."""
    check(case, "ray")


@settings(SETTINGS, max_examples=RAY_EXAMPLES)
@given(case=cases(resume=True), then=st.sampled_from(["inline", "processes", "ray"]))
def test_a_run_on_ray_resumes_anywhere(then, case, tmp_path):
    """A run stopped on Ray resumes from its ledger on any engine with the uninterrupted
    result, and one stopped on worker processes resumes on Ray."""
    check_resumed(case, "ray", then, tmp_path)
    check_resumed(case, "processes", "ray", tmp_path)
