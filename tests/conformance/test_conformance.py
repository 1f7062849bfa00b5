"""Every engine gives what the reference interpreter gives, on generated cases."""

from __future__ import annotations

import pytest
from generated import cases, check, check_resumed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES

pytestmark = pytest.mark.timeout(900)

SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


@pytest.mark.parametrize("engine", ["inline", "processes"])
@SETTINGS
@given(case=cases())
def test_local_engines_agree_with_the_reference(engine, case):
    """Results, order, Failure records, the raised error and stats() equal the reference."""
    check(case, engine)


@pytest.mark.parametrize("first", ["inline", "processes"])
@SETTINGS
@given(case=cases(resume=True), then=st.sampled_from(["inline", "processes"]))
def test_a_run_stopped_and_resumed_gives_the_uninterrupted_result(first, then, case, tmp_path):
    """A run stopped after some results and resumed from its ledger, on the same engine or
    another, gives the reference's outcome and computes nothing delivered before again."""
    check_resumed(case, first, then, tmp_path)
