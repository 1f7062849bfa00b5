"""Checkpoints and rank shares (API.md section 12): atomic saves that a SIGKILL cannot tear,
the newest of a directory, keep=k, main rank only; rank shares disjoint, covering, equal."""

from __future__ import annotations

import fractions
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import easycore
from easycore import distributed, load_checkpoint, producer, save_checkpoint

pytestmark = pytest.mark.timeout(120)


class TestCheckpoints:
    def test_save_and_load_state_dicts_and_values(self, tmp_path):
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        it = producer(lambda x: x).imap(range(10), devices="inline")
        next(it)
        path = save_checkpoint(tmp_path, 40, model=model, optimizer=opt, data=it, epoch=3)
        assert path == os.path.join(tmp_path, "checkpoint-40")
        ckpt = load_checkpoint(tmp_path, map_location="cpu")
        assert ckpt["step"] == 40 and ckpt["epoch"] == 3
        assert ckpt["data"] == it.state_dict()
        assert ckpt["optimizer"] == opt.state_dict()
        twin = torch.nn.Linear(3, 2)
        twin.load_state_dict(ckpt["model"])
        assert torch.equal(twin.weight, model.weight)
        assert load_checkpoint(path)["step"] == 40

    def test_newest_and_keep(self, tmp_path):
        assert load_checkpoint(tmp_path) is None
        assert load_checkpoint(tmp_path / "not-yet") is None
        for step in (5, 100):
            save_checkpoint(tmp_path, step, keep=2, x=step)
        with pytest.warns(UserWarning, match="checkpoint-100"):  # newest: saved last
            for step in (20, 7):
                save_checkpoint(tmp_path, step, keep=2, x=step)
        assert sorted(os.listdir(tmp_path)) == ["checkpoint-20", "checkpoint-7"]
        assert load_checkpoint(tmp_path)["x"] == 7
        with pytest.raises(FileNotFoundError):
            load_checkpoint(tmp_path / "checkpoint-5")

    def test_other_ranks_do_not_write(self, tmp_path, monkeypatch):
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert save_checkpoint(tmp_path, 1, x=1) is None
        assert os.listdir(tmp_path) == []

    def test_bad_arguments(self, tmp_path):
        with pytest.raises(ValueError, match="step"):
            save_checkpoint(tmp_path, -1)
        with pytest.raises(ValueError, match="keep"):
            save_checkpoint(tmp_path, 1, keep=0)

    def test_unsafe_objects_need_weights_only_false(self, tmp_path):
        save_checkpoint(tmp_path, 1, thing=fractions.Fraction(1, 3))
        with pytest.raises(Exception, match="weights_only"):
            load_checkpoint(tmp_path)
        assert load_checkpoint(tmp_path, weights_only=False)["thing"] == fractions.Fraction(1, 3)

    def test_numpy_arrays_scalars_and_random_states_load_with_the_safe_loader(self, tmp_path):
        import numpy as np

        state = np.random.default_rng(3).bit_generator.state
        legacy = np.random.RandomState(5).get_state()
        save_checkpoint(tmp_path, 1, a=np.arange(3.0), s=np.float32(1.5), rng=legacy, gen=state)
        loaded = load_checkpoint(tmp_path)  # (weights_only=True)
        np.testing.assert_array_equal(loaded["a"], np.arange(3.0))
        assert loaded["s"] == np.float32(1.5) and type(loaded["s"]) is np.float32
        np.testing.assert_array_equal(loaded["rng"][1], legacy[1])
        assert loaded["gen"] == state


SAVER = textwrap.dedent(
    """
    import sys, torch
    from easycore import save_checkpoint
    directory = sys.argv[1]
    step = 0
    while True:
        step += 1
        # ~16 MB: a save takes long enough to be killed in the middle of one
        save_checkpoint(directory, step, keep=2, big=torch.full((4_000_000,), float(step)))
        print(step, flush=True)
    """
)


@pytest.mark.timeout(180)
def test_sigkill_while_saving_leaves_a_loadable_checkpoint(tmp_path):
    """A process saving big checkpoints in a loop, SIGKILLed at random moments: the newest
    checkpoint always loads whole, no torn file has a checkpoint's name, and the next save
    clears the dead process's temporary file."""
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
    @given(delay=st.floats(0.0, 0.4))
    def check(delay):
        ckpt = tmp_path / f"ckpt-{time.monotonic_ns()}"
        proc = subprocess.Popen(
            [sys.executable, str(script), str(ckpt)], stdout=subprocess.PIPE, text=True, env=env
        )
        try:
            assert proc.stdout.readline().strip() == "1"  # one checkpoint is complete
            time.sleep(delay)
        finally:
            proc.kill()
            proc.communicate(timeout=30)
        newest = load_checkpoint(ckpt)
        assert newest is not None
        assert torch.equal(newest["big"], torch.full((4_000_000,), float(newest["step"])))
        for name in os.listdir(ckpt):
            if not name.startswith("."):
                assert load_checkpoint(ckpt / name)["step"] == int(name.split("-")[1])
        save_checkpoint(ckpt, 10_000, x=1)
        assert [n for n in os.listdir(ckpt) if n.startswith(".")] == []
        assert load_checkpoint(ckpt)["step"] == 10_000

    check()


@given(n=st.integers(0, 200), world=st.integers(1, 9), pad=st.booleans())
@settings(max_examples=200, deadline=None)
def test_rank_shares_disjoint_cover_equal(n, world, pad):
    items = [f"item{i}" for i in range(n)]
    shares = [distributed.rank_share(items, r, world, pad=pad) for r in range(world)]
    assert len({len(s) for s in shares}) == 1  # every rank the same length
    flat = [x for s in shares for x in s]
    if pad:
        assert set(flat) == set(items)  # covers every item
        assert len(flat) == (-(-n // world) * world if n else 0)
        # disjoint apart from padding: the first n taken (in rank-major rounds) are all distinct
        rounds = [shares[r][k] for k in range(len(shares[0])) for r in range(world)]
        assert rounds[:n] == items
    else:
        assert len(flat) == len(set(flat)) == n // world * world
        assert set(flat) <= set(items)


def test_rank_share_defaults_to_the_launcher(monkeypatch):
    assert distributed.rank_share(range(5)) == [0, 1, 2, 3, 4]  # a world of one
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert distributed.rank_share(range(10)) == [2, 5, 8, 1]  # padded: 0..9, 0, 1
    with pytest.raises(ValueError, match="rank=3"):
        distributed.rank_share(range(10), rank=3, world_size=3)
    with pytest.raises(TypeError, match="sized sequence"):
        distributed.rank_share(iter(range(3)), 0, 1)
    assert easycore.distributed.rank_share is distributed.rank_share


def test_the_safe_loader_never_allows_numpy_classes_that_are_no_dtype(tmp_path, monkeypatch):
    """The allow-list takes dtype classes only, whatever numpy.dtypes holds (numpy < 1.25
    has none: falling back to numpy's namespace would allow np.memmap, which, called with a
    file's arguments, writes any file)."""
    import pickle
    import types

    import numpy as np

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n" * 10)

    class Overwrite:
        def __reduce__(self):
            return (np.memmap, (str(victim), np.uint8, "w+", 0, (1,)))

    save_checkpoint(tmp_path / "ckpt", 1, x=Overwrite())
    mixed = types.SimpleNamespace(memmap=np.memmap, Int64DType=type(np.dtype("int64")))
    monkeypatch.setattr(np, "dtypes", mixed)
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(tmp_path / "ckpt")
    assert victim.read_text() == "precious\n" * 10
