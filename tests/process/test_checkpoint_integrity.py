"""Checkpoints (API.md section 12): the newest is the one saved last, whatever its step, also
after a restart; a damaged checkpoint is a ValueError naming the file, and a directory falls
back to the checkpoint saved before it with a warning."""

from __future__ import annotations

import fractions
import os
import pickle
import subprocess
import sys
import time
import warnings

import pytest

from easycore import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.timeout(120)


def age(path, seconds):
    """Set a file's modification time ``seconds`` from now (negative: in the past)."""
    when = time.time_ns() + int(seconds * 1e9)
    os.utime(path, ns=(when, when))


@pytest.fixture
def old_run(tmp_path):
    """A directory holding checkpoint-100 and checkpoint-200 of an earlier run."""
    for step in (100, 200):
        save_checkpoint(tmp_path, step, x=step)
    return tmp_path


class TestSavedLast:
    def test_a_lower_step_is_kept_and_loaded(self, old_run):
        """A new run saving step 5 with keep=2 where steps 100 and 200 are: its file stays,
        it is what load_checkpoint returns, and only the first save warns."""
        with pytest.warns(UserWarning, match="checkpoint-200") as caught:
            path = save_checkpoint(old_run, 5, keep=2, x=5)
        assert len(caught) == 1 and str(old_run) in str(caught[0].message)
        assert os.path.isfile(path)
        assert sorted(os.listdir(old_run)) == ["checkpoint-200", "checkpoint-5"]
        assert load_checkpoint(old_run)["x"] == 5
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per directory
            save_checkpoint(old_run, 6, keep=2, x=6)
        assert sorted(os.listdir(old_run)) == ["checkpoint-5", "checkpoint-6"]
        assert load_checkpoint(old_run)["x"] == 6

    def test_keep_one_keeps_the_save_just_made(self, old_run):
        """keep=1 after a lower step leaves that step's file alone."""
        with pytest.warns(UserWarning):
            save_checkpoint(old_run, 3, keep=1, x=3)
        assert os.listdir(old_run) == ["checkpoint-3"]

    def test_saved_last_even_when_older_files_look_newer(self, old_run):
        """Older checkpoints with later times (a clock set back, a coarse file system that
        gave them the same second) do not outrank the checkpoint saved last."""
        for name in os.listdir(old_run):
            age(old_run / name, 3600)
        with pytest.warns(UserWarning):
            save_checkpoint(old_run, 7, x=7)
        assert load_checkpoint(old_run)["x"] == 7

    def test_equal_times_break_ties_by_step(self, tmp_path):
        """Checkpoints with the same modification time (copied with their times, say):
        the higher step is the newest, the same on every call."""
        with pytest.warns(UserWarning):
            for step in (30, 4, 12):
                save_checkpoint(tmp_path, step, x=step)
        when = time.time_ns()
        for name in os.listdir(tmp_path):
            os.utime(tmp_path / name, ns=(when, when))
        assert load_checkpoint(tmp_path)["x"] == 30

    def test_saved_last_survives_a_restart(self, old_run):
        """A fresh process loads the checkpoint saved last, not the highest step."""
        with pytest.warns(UserWarning):
            save_checkpoint(old_run, 5, x=5)
        code = "import sys, easycore; print(easycore.load_checkpoint(sys.argv[1])['step'])"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run(
            [sys.executable, "-c", code, str(old_run)],
            capture_output=True,
            text=True,
            env=env,
            timeout=100,
            check=True,
        )
        assert out.stdout.split() == ["5"]


def good_bytes(tmp_path):
    save_checkpoint(tmp_path / "good", 1, x=1)
    return (tmp_path / "good" / "checkpoint-1").read_bytes()


DAMAGE = {
    "empty": lambda blob: b"",
    "cut in half": lambda blob: blob[: len(blob) // 2],
    "first 10 bytes": lambda blob: blob[:10],
    "last byte missing": lambda blob: blob[:-1],
    "random bytes": lambda blob: os.urandom(600),
    "text": lambda blob: b"hello, not a checkpoint\n" * 3,
}


class TestDamaged:
    @pytest.mark.parametrize("damage", DAMAGE)
    def test_a_damaged_file_is_a_value_error_naming_it(self, tmp_path, damage):
        """Loading a damaged file raises ValueError naming the file and what is wrong."""
        path = tmp_path / "checkpoint-9"
        path.write_bytes(DAMAGE[damage](good_bytes(tmp_path)))
        with pytest.raises(ValueError, match="checkpoint-9 is damaged") as caught:
            load_checkpoint(path)
        if damage == "empty":
            assert "empty" in str(caught.value)

    @pytest.mark.parametrize("damage", DAMAGE)
    def test_a_directory_falls_back_with_a_warning(self, tmp_path, damage):
        """The newest checkpoint damaged: the one saved before it loads, and a warning
        names the damaged file."""
        blob = good_bytes(tmp_path)
        run = tmp_path / "run"
        save_checkpoint(run, 10, x=10)
        (run / "checkpoint-20").write_bytes(DAMAGE[damage](blob))
        age(run / "checkpoint-20", 1)
        with pytest.warns(UserWarning, match="checkpoint-20 is damaged.*loading checkpoint-10"):
            assert load_checkpoint(run)["x"] == 10

    def test_every_checkpoint_damaged(self, tmp_path):
        """Nothing to fall back to: a ValueError (after a warning for the newer one)."""
        for step in (1, 2):
            (tmp_path / f"checkpoint-{step}").write_bytes(b"")
        with pytest.warns(UserWarning, match="damaged"), pytest.raises(ValueError, match="dama"):
            load_checkpoint(tmp_path)

    def test_a_refused_object_is_not_damage(self, tmp_path):
        """A sound checkpoint the safe loader refuses keeps torch's UnpicklingError (and
        a directory does not fall back past it to an older checkpoint)."""
        save_checkpoint(tmp_path, 1, x=1)
        time.sleep(0.01)
        save_checkpoint(tmp_path, 2, thing=fractions.Fraction(1, 3))
        with pytest.raises(pickle.UnpicklingError, match="weights_only"):
            load_checkpoint(tmp_path)

    def test_a_bad_map_location_is_not_damage(self, tmp_path):
        """torch's own error for a map_location it cannot use passes through unchanged."""
        import torch

        save_checkpoint(tmp_path, 1, w=torch.zeros(2))
        with pytest.raises(RuntimeError, match="bogus"):
            load_checkpoint(tmp_path, map_location="bogus")

    def test_a_file_that_is_not_a_dict(self, tmp_path):
        """A torch file holding something else than a checkpoint's dict is a ValueError."""
        import torch

        torch.save([1, 2], tmp_path / "checkpoint-3")
        with pytest.raises(ValueError, match="checkpoint-3 is not a checkpoint"):
            load_checkpoint(tmp_path / "checkpoint-3")


def local_function():
    def inner():
        return 1

    return inner


class TestUnsavable:
    @pytest.mark.parametrize(
        "thing",
        [lambda: 1, {"inner": local_function()}, (i for i in [1])],
        ids=["lambda", "local function inside", "generator"],
    )
    def test_an_object_that_cannot_be_saved_is_a_type_error_naming_it(self, tmp_path, thing):
        """The error names the keyword; no file is left behind, and the checkpoint saved
        before is still the newest and loads."""
        save_checkpoint(tmp_path, 10, x=10)
        before = sorted(os.listdir(tmp_path))
        with pytest.raises(TypeError, match=r"'bad'.*cannot be saved") as caught:
            save_checkpoint(tmp_path, 20, ok=1, bad=thing)
        assert "'ok'" not in str(caught.value)
        assert sorted(os.listdir(tmp_path)) == before
        assert load_checkpoint(tmp_path) == {"x": 10, "step": 10}
