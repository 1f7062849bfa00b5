"""An ``imap`` state that no ``imap`` could have given is refused, naming the field; a
sink's ``imap`` has no position of its own (API.md section 12)."""

from __future__ import annotations

import pytest

from easycore import producer, write


@producer
def double(x):
    return 2 * x


@producer
def total(batch):
    return sum(batch)


def state_after(run, data, n, **kw):
    it = run.imap(data, devices="inline", **kw)
    for _ in range(n):
        next(it)
    return it.state_dict()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("position", 11, "'position'.* from 0 to 10"),
        ("position", -1, "'position'"),
        ("position", True, "'position'.*True.*not an int"),
        ("position", 2.0, "'position'.*not an int"),
        ("position", "2", "'position'.*not an int"),
        ("received", [10**9], "'received'.*before 10"),
        ("received", [1], "'received'.*after 2"),
        ("received", [True], "'received'.*not a list of ints"),
        ("received", None, "'received'.*not a list of ints"),
        ("seed", True, "'seed'.*not an int or None"),
        ("epoch", None, "'epoch'.*not an int"),
        ("total", "10", "'total'.*not an int or None"),
    ],
)
def test_a_tampered_state_is_refused_naming_the_field(field, value, match):
    state = {**state_after(double, range(10), 2, seed=0), field: value}
    with pytest.raises(ValueError, match=match):
        double.imap(range(10), devices="inline", seed=0, state=state)


def test_the_positions_a_run_can_give_are_accepted():
    """The end (every result received) and units received beyond the position, in batches
    (10 items in batches of 4: units 0, 1, 2)."""
    end = state_after(double, range(10), 10)
    assert end["position"] == 10
    assert list(double.imap(range(10), devices="inline", state=end)) == []
    state = {**state_after(total, range(10), 0, batch_size=4), "received": [2]}
    assert list(total.imap(range(10), devices="inline", batch_size=4, state=state)) == [6, 22]
    past = {**state, "received": [3]}
    with pytest.raises(ValueError, match=r"'received'.*before 3"):
        total.imap(range(10), devices="inline", batch_size=4, state=past)


def test_a_sinks_imap_points_to_resume(tmp_path):
    rows = producer(lambda x: {"x": x})
    it = (rows >> write.jsonl(tmp_path / "one-shot")).imap(range(4), devices="inline")
    with pytest.raises(TypeError, match="resume="):
        it.state_dict()
    assert sum(w.rows for w in it) == 4
    with (rows >> write.jsonl(tmp_path / "open")).open(devices="inline") as runner:
        it = runner.imap(range(4, 8))
        with pytest.raises(TypeError, match="resume="):
            it.state_dict()
        assert sum(w.rows for w in it) == 4


def test_a_sinks_imap_refuses_a_state_before_any_worker_starts(tmp_path):
    """A state taken from an imap without a sink is not a sink's position: given to a sink's
    imap it would skip the items before it and leave them unwritten."""
    state = state_after(double, range(6), 3)
    started = []
    rows = producer(lambda x: {"x": x}, init=lambda: started.append(1))
    with pytest.raises(TypeError, match=r"sink's imap.*resume="):
        (rows >> write.jsonl(tmp_path / "one-shot")).imap(range(6), devices="inline", state=state)
    assert started == []
    assert not (tmp_path / "one-shot").exists() or not any((tmp_path / "one-shot").iterdir())
    with (rows >> write.jsonl(tmp_path / "open")).open(devices="inline") as runner:
        with pytest.raises(TypeError, match=r"sink's imap.*resume="):
            runner.imap(range(6), state=state)
        assert sum(w.rows for w in runner.imap(range(6))) == 6
