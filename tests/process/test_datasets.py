"""Map-style datasets (API.md section 2): an object with ``__len__`` and ``__getitem__`` (a
``torch.utils.data.Dataset``, a Hugging Face ``datasets.Dataset``) is read as DataLoader
reads it, ``data[i]`` for ``i`` in ``range(len(data))``, whatever its ``__getitem__`` does
past the end, on ``map``, ``imap``, ``open``, ``state=`` and ``distributed=True`` alike."""

from __future__ import annotations

import itertools

import pytest
import torch

from easycore import consumer, producer

pytestmark = pytest.mark.timeout(120)

N = 10


class Endless(torch.utils.data.Dataset):
    """Ten samples; ``__getitem__`` never raises (``ds[i % n]``, as generated samples do)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return i % N


class Rows:
    """Not torch's: rows in a dict by index (the ``df.loc[idx]`` pattern); past the end is a
    ``KeyError``, not the ``IndexError`` that stops Python's own iteration."""

    def __init__(self):
        self.rows = {i: 100 + i for i in range(6)}

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, idx):
        return self.rows[idx]


@producer
def double(x):
    return 2 * x


@producer
def total(batch):
    return sum(batch)


@consumer(init=0)
def summer(acc, x):
    return acc + x


EXPECTED = [2 * i for i in range(N)]


@pytest.mark.parametrize("devices", ["inline", 2])
def test_a_dataset_that_never_raises_gives_len_items(devices):
    assert double.map(Endless(), devices=devices) == EXPECTED
    assert total.map(Endless(), devices=devices, batch_size=4) == [6, 22, 17]
    assert (double >> summer).map(Endless(), devices=devices) == sum(EXPECTED)
    assert list(itertools.islice(double.imap(Endless(), devices=devices), 15)) == EXPECTED
    unordered = double.imap(Endless(), devices=devices, ordered=False)
    assert sorted(itertools.islice(unordered, 15)) == EXPECTED


def test_on_an_open_runner_and_resumed_from_a_state():
    with double.open(devices=2) as runner:
        assert runner.map(Endless()) == EXPECTED
        it = runner.imap(Endless(), seed=3)
        first = [next(it) for _ in range(4)]
        state = it.state_dict()
        it.close()
        assert state["total"] == N
        rest = list(itertools.islice(runner.imap(Endless(), seed=3, state=state), 15))
    assert first + rest == EXPECTED
    one_shot = double.imap(Endless(), devices=2, seed=3, state=state)
    assert list(itertools.islice(one_shot, 15)) == EXPECTED[4:]


def test_batches_resume_by_index():
    it = total.imap(Endless(), devices="inline", batch_size=4)
    assert next(it) == 6
    state = it.state_dict()
    assert list(total.imap(Endless(), devices="inline", batch_size=4, state=state)) == [22, 17]


def test_a_dataset_whose_getitem_raises_keyerror_past_the_end():
    assert double.map(Rows(), devices=2) == [2 * (100 + i) for i in range(6)]
    it = double.imap(Rows(), devices="inline")
    next(it)
    rest = list(double.imap(Rows(), devices="inline", state=it.state_dict()))
    assert rest == [2 * (100 + i) for i in range(1, 6)]


def test_distributed_reads_it_by_index(monkeypatch):
    """A world of one (no launcher): the rank's share is read by index too."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert double.map(Endless(), devices=2, distributed=True) == EXPECTED
    assert total.map(Endless(), devices=2, batch_size=4, distributed=True) == [6, 22, 17]


def test_progress_total_is_the_length(capsys):
    assert double.map(Endless(), devices="inline", progress=True) == EXPECTED
    assert "10/10" in capsys.readouterr().err


def test_other_containers_iterate_as_python_iterates_them():
    """A dict is a mapping (its keys), not a dataset; strings, lists, ranges, tuples and
    arrays iterate as they always do."""
    import numpy as np

    assert sorted(double.map({"a": 1, "b": 2}, devices="inline")) == ["aa", "bb"]
    assert double.map("ab", devices="inline") == ["aa", "bb"]
    assert double.map((1, 2), devices="inline") == [2, 4]
    for array in (np.arange(3), torch.arange(3)):
        assert [int(v) for v in double.map(array, devices="inline")] == [0, 2, 4]


class TestHuggingFace:
    """A ``datasets.Dataset`` (length, integer indexing, iteration that yields ``ds[i]``)
    runs, and resumes from a state by index."""

    @pytest.fixture
    def ds(self):
        datasets = pytest.importorskip("datasets")
        return datasets.Dataset.from_dict({"x": list(range(N))})

    def test_map_and_imap(self, ds):
        row_x = producer(lambda row: row["x"] * 2)
        assert row_x.map(ds, devices=2) == EXPECTED
        assert list(row_x.imap(ds, devices=2)) == EXPECTED

    @pytest.mark.parametrize("devices", ["inline", 2])
    def test_resumes_from_a_state(self, ds, devices):
        row_x = producer(lambda row: row["x"] * 2)
        it = row_x.imap(ds, devices=devices, seed=0)
        first = [next(it) for _ in range(3)]
        state = it.state_dict()
        it.close()
        rest = list(row_x.imap(ds, devices=devices, seed=0, state=state))
        assert first + rest == EXPECTED


def test_a_torch_dataset_with_an_iter_of_its_own_is_still_indexed():
    """DataLoader indexes every torch Dataset that is not an IterableDataset, whatever its
    ``__iter__`` does; so does easycore."""

    class WithIter(torch.utils.data.Dataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return i * 10

        def __iter__(self):  # what DataLoader never calls on a map-style dataset
            return iter(range(100))

    assert producer(lambda x: x).map(WithIter(), devices="inline") == [0, 10, 20, 30, 40]


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(5))


def test_a_len_that_raises_runs_without_a_total():
    """A DataLoader over an IterableDataset has a ``__len__`` that raises TypeError: the run
    goes on without a progress total, as for any input without a length."""
    loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
    assert double.map(loader, devices="inline", progress=True) == [0, 2, 4, 6, 8]
