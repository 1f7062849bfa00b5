"""map against a sequential reference, on real workers (one shared runner per module)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from easycore import producer


@producer
def affine(x):
    if isinstance(x, list):  # a batch
        return [3 * v - 1 for v in x]
    return 3 * x - 1


@pytest.fixture(scope="module")
def runner():
    with affine.open(devices=2) as r:
        yield r


items = st.lists(st.integers(-(10**6), 10**6), max_size=300)


@settings(max_examples=25)
@given(data=items)
def test_ordered_map_equals_sequential(runner, data):
    """Ordered map equals the sequential computation."""
    assert runner.map(data) == [3 * x - 1 for x in data]


@settings(max_examples=25)
@given(data=items, batch=st.integers(1, 7))
def test_unordered_map_is_permutation(runner, data, batch):
    """ordered=False gives a permutation of the sequential results (batched too)."""
    size = None if batch == 1 else batch
    out = runner.map(data, ordered=False, batch_size=size)
    flat = out if size is None else [y for chunk in out for y in chunk]
    assert sorted(flat) == sorted(3 * x - 1 for x in data)


@settings(max_examples=15)
@given(data=items)
def test_inline_equals_workers(data):
    """devices='inline' and worker processes agree."""
    assert affine.map(data, devices="inline") == [3 * x - 1 for x in data]
