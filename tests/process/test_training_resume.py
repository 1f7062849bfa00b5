"""Training that resumes (API.md section 12): an imap stopped anywhere and resumed from its
``state_dict()`` gives the uninterrupted stream, item for item, on worker processes and
inline, with ``.on`` pools, batching and ``errors="skip"``; items before the position are
not computed again; epochs give other seeds, the same on every run and worker count."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import easycore
from easycore import producer

pytestmark = pytest.mark.timeout(120)

N = 120


@producer
def noisy(x):
    """The item and a draw from the seeded random state; items 3, 10, 17, ... fail."""
    if isinstance(x, int) and x % 7 == 3:
        raise ValueError(f"poison {x}")
    return (x, random.random())


@producer
def pair_sums(batch):
    """A batching pool's work: one result per batch, with its own seeded draw."""
    return (tuple(x for x, _ in batch), round(sum(r for _, r in batch), 12), random.random())


def resumed_stream(run, data, stop, **kw):
    """The results of ``run(data)`` stopped after ``stop`` results and resumed from the
    state (through JSON), and the state."""
    it = run(data, **kw)
    first = [next(it) for _ in range(stop)]
    state = json.loads(json.dumps(it.state_dict()))  # JSON-serialisable, and read back
    it.close()
    rest = list(run(data, state=state, **kw))
    return first, rest, state


def check_resumes(runner, data, stop, ordered, batch_size, skip, epoch):
    kw = {"seed": 5, "epoch": epoch, "ordered": ordered, "batch_size": batch_size}
    if skip:
        kw["errors"] = "skip"
        kw["on_error"] = lambda f: None
    full = list(runner.imap(data, **kw))
    stop = min(stop, len(full))
    first, rest, state = resumed_stream(runner.imap, data, stop, **kw)
    if ordered:
        assert first + rest == full
    else:  # results as they finish: the same results, none twice, none lost
        assert sorted(first + rest, key=repr) == sorted(full, key=repr)
        assert len(first + rest) == len(full)
    assert state["position"] >= 0 and state["received"] == sorted(state["received"])
    assert len(json.dumps(state)) < 2000  # positions, not data


@pytest.mark.parametrize("devices", ["inline", 2])
def test_one_pool_resumes_anywhere(devices):
    """One pool (2 workers, and inline), map-level batching, skip: random stop points."""
    with noisy.open(devices=devices, prefetch=2) as runner:

        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
        @given(
            stop=st.integers(0, N),
            ordered=st.booleans(),
            batch_size=st.sampled_from([None, 4]),
            epoch=st.sampled_from([0, 3]),
        )
        def check(stop, ordered, batch_size, epoch):
            skip = batch_size is None  # (a batch holds a list: never poison)
            check_resumes(runner, range(N), stop, ordered, batch_size, skip, epoch)

        check()


@pytest.mark.parametrize("devices", ["inline", 2])
def test_pools_with_batching_resume_anywhere(devices):
    """``noisy.on(2) >> pair_sums.on(1, batch_size=3)``: output units are batches of 3
    items; poison items fail their batch, set aside under errors='skip'."""
    pipeline = noisy.on(1 if devices == "inline" else 2) >> pair_sums.on(1, batch_size=3)
    opened = pipeline.open(devices="inline") if devices == "inline" else pipeline.open()
    with opened as runner:

        @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
        @given(stop=st.integers(0, N // 3), ordered=st.booleans(), skip=st.booleans())
        def check(stop, ordered, skip):
            data = list(range(N)) if skip else [x for x in range(N) if x % 7 != 3]
            check_resumes(runner, data, stop, ordered, None, skip, 1)

        check()


class CountingSequence:
    """A sequence that records which indices were read (a map-style dataset)."""

    def __init__(self, n):
        self.n = n
        self.read = []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.read.append(i)
        return i


class Reader:
    """A reader of one's own: ``iter_from(index)`` is the documented resume protocol."""

    def __init__(self, n):
        self.n = n
        self.starts = []

    def __iter__(self):
        return self.iter_from(0)

    def iter_from(self, index):
        self.starts.append(index)
        return iter(range(index, self.n))


def test_items_before_the_position_are_not_read_or_computed(tmp_path):
    """Resuming at 150 of 200: the input is read from 150 on, and the workers compute only
    from there (each computed item leaves a file behind)."""
    marks = tmp_path / "marks"
    marks.mkdir()

    @producer
    def mark(x):
        (marks / str(x)).touch()
        return x * 2

    with mark.open(devices=2) as runner:
        it = runner.imap(range(200))
        got = [next(it) for _ in range(150)]
        state = it.state_dict()
        it.close()
        assert state["position"] == 150
        for f in marks.iterdir():
            f.unlink()
        data = CountingSequence(200)
        rest = list(runner.imap(data, state=state))
        assert got + rest == [x * 2 for x in range(200)]
        assert min(data.read) == 150
        assert sorted(int(p.name) for p in marks.iterdir()) == list(range(150, 200))
        reader = Reader(200)
        assert list(runner.imap(reader, state=state)) == rest
        assert reader.starts == [150]


@pytest.mark.parametrize("devices", ["inline", 2])
def test_units_received_beyond_the_position_are_not_run_again(tmp_path, devices):
    """An unordered run's state lists output units received beyond its position: a resumed
    run neither computes nor delivers them (batches of 3 at the second pool)."""
    marks = tmp_path / "marks"
    marks.mkdir()

    @producer
    def mark(x):
        (marks / str(x)).touch()
        return (x, 0.0)

    pipeline = mark.on(1 if devices == "inline" else 2) >> pair_sums.on(1, batch_size=3)
    with pipeline.open(devices="inline") if devices == "inline" else pipeline.open() as runner:
        it = runner.imap(range(30), seed=4)
        next(it)
        state = it.state_dict()  # position 3 (one batch of 3 received)
        it.close()
        full = list(runner.imap(range(30), seed=4))
        state["received"] = [9, 18]  # as if an unordered run had received these batches
        for f in marks.iterdir():
            f.unlink()
        rest = list(runner.imap(range(30), seed=4, state=state, ordered=False))
    assert sorted(rest) == sorted(full[1:3] + full[4:6] + full[7:])
    computed = sorted(int(p.name) for p in marks.iterdir())
    assert computed == [x for x in range(3, 30) if x // 3 not in (3, 6)]


def test_arrays_and_tensors_resume_by_index():
    import numpy as np
    import torch

    for data in (np.arange(1, 60, 7), torch.arange(1, 60, 7)):
        it = producer(lambda x: int(x) * 2).imap(data, devices="inline")
        first = [next(it) for _ in range(3)]
        state = it.state_dict()
        rest = list(producer(lambda x: int(x) * 2).imap(data, devices="inline", state=state))
        assert first + rest == [x * 2 for x in range(1, 60, 7)]


def test_prefetched_results_not_received_come_again():
    """Results fetched ahead (prefetch) but never returned by next() are produced again:
    the position counts what the caller received."""
    with noisy.open(devices=2, prefetch=4) as runner:
        it = runner.imap(range(1, 300, 7), seed=1)  # no poison (x % 7 == 1)
        first = [next(it) for _ in range(5)]
        state = it.state_dict()
        it.close()
        assert state["position"] == 5
        rest = list(runner.imap(range(1, 300, 7), seed=1, state=state))
        assert first + rest == list(noisy.imap(range(1, 300, 7), devices="inline", seed=1))


def test_one_shot_imap_resumes():
    """pipeline.imap (one-shot, owning its workers) has state_dict too."""
    it = noisy.imap(range(1, 100, 7), devices=2, seed=2)
    first = [next(it) for _ in range(4)]
    state = it.state_dict()
    it.close()
    rest = list(noisy.imap(range(1, 100, 7), devices=2, seed=2, state=state))
    assert first + rest == noisy.map(range(1, 100, 7), devices="inline", seed=2)


class TestRefusals:
    def test_a_generator_cannot_resume(self):
        state = noisy.imap([1], devices="inline").state_dict()
        with pytest.raises(ValueError, match="cannot start in the middle"):
            noisy.imap((x for x in [1, 8]), devices="inline", state=state)

    @pytest.mark.parametrize(
        ("change", "named"),
        [
            ({"seed": 2}, "seed 1 -> 2"),
            ({"epoch": 1}, "epoch 0 -> 1"),
            ({"batch_size": 2}, "batch_size None -> 2"),
        ],
    )
    def test_another_runs_state_is_refused(self, change, named):
        it = noisy.imap(range(1, 50, 7), devices="inline", seed=1)
        next(it)
        state = it.state_dict()
        with pytest.raises(ValueError, match=named):
            noisy.imap(range(1, 50, 7), devices="inline", **{"seed": 1, **change}, state=state)

    def test_a_class_iterating_its_own_way_needs_iter_from(self):
        class Columns:  # indexing and iterating disagree (as a DataFrame's do)
            def __len__(self):
                return 2

            def __getitem__(self, i):
                return [1, 8][i]

            def __iter__(self):
                return iter(["a", "b"])

        state = noisy.imap([1, 8], devices="inline").state_dict()
        with pytest.raises(ValueError, match="iter_from"):
            noisy.imap(Columns(), devices="inline", state=state)

    def test_another_input_length_is_refused(self):
        it = noisy.imap(range(1, 50, 7), devices="inline")
        next(it)
        with pytest.raises(ValueError, match="total 7 -> 8"):
            noisy.imap(range(1, 57, 7), devices="inline", state=it.state_dict())

    def test_not_a_state(self):
        with pytest.raises(ValueError, match="state_dict"):
            noisy.imap(range(3), devices="inline", state={"position": 1})
        with pytest.raises(ValueError, match="state_dict"):
            noisy.imap(range(3), devices="inline", state=[1])

    def test_state_with_resume_is_refused(self, tmp_path):
        state = noisy.imap([1], devices="inline").state_dict()
        with pytest.raises(ValueError, match="give one of them"):
            noisy.imap([1], devices="inline", state=state, resume=str(tmp_path / "r.db"))


@producer
def draw(x):
    return random.random()


class TestEpochs:
    def test_epoch_seeds_differ_and_agree_across_runs_and_workers(self):
        """Every epoch gives other draws; the same draws whatever the worker count; epoch 0
        is a run without epoch; derive_seed(seed, i, epoch=e) is the worker's seed."""
        e0 = draw.map(range(40), devices=2, seed=3)
        assert draw.map(range(40), devices=2, seed=3, epoch=0) == e0
        e1 = draw.map(range(40), devices=3, seed=3, epoch=1)
        assert draw.map(range(40), devices="inline", seed=3, epoch=1) == e1
        assert draw.map(range(40), devices=2, seed=3, epoch=1) == e1
        e2 = draw.map(range(40), devices=2, seed=3, epoch=2)
        assert len({*e0, *e1, *e2}) == 120
        for i in (0, 17, 39):
            easycore.seed_everything(easycore.derive_seed(3, i, epoch=1))
            assert random.random() == e1[i]

    def test_open_sets_the_runners_epoch(self):
        with draw.open(devices="inline", epoch=2) as runner:
            assert runner.map(range(5), seed=1) == draw.map(range(5), "inline", seed=1, epoch=2)
            assert runner.map(range(5), seed=1, epoch=0) == draw.map(range(5), "inline", seed=1)

    def test_bad_epoch(self):
        with pytest.raises(ValueError, match="epoch"):
            draw.map(range(2), devices="inline", epoch=-1)

    def test_permutation(self):
        p0, p1 = easycore.permutation(50, 7), easycore.permutation(50, 7, epoch=1)
        assert sorted(p0) == sorted(p1) == list(range(50))
        assert p0 != p1
        assert easycore.permutation(50, 7, epoch=1) == p1
        assert easycore.permutation(0, 7) == []
