"""Bad arguments to the helpers (API.md sections 9 and 12) are TypeError/ValueError naming
them; numpy ints count as ints. merge_from_list reaches keys that hold dots (section 4)."""

from __future__ import annotations

import hashlib
import random
import sys

import numpy as np
import pytest

import easycore
from easycore import CfgNode, derive_seed, distributed, permutation


class TestDeriveSeed:
    @pytest.mark.parametrize(
        ("args", "kwargs", "error", "name"),
        [
            ((None, 1), {}, TypeError, "seed"),
            (("a", 1), {}, TypeError, "seed"),
            ((1.0, 1), {}, TypeError, "seed"),
            ((True, 1), {}, TypeError, "seed"),
            ((np.bool_(True), 1), {}, TypeError, "seed"),
            ((0, None), {}, TypeError, "index"),
            ((0, "3"), {}, TypeError, "index"),
            ((0, 1, "x"), {}, TypeError, "pool"),
            ((0, 1, -1), {}, ValueError, "pool"),
            ((0, 1), {"epoch": None}, TypeError, "epoch"),
            ((0, 1), {"epoch": 1.5}, TypeError, "epoch"),
            ((0, 1), {"epoch": False}, TypeError, "epoch"),
            ((0, 1), {"epoch": -1}, ValueError, "epoch"),
        ],
    )
    def test_bad_arguments(self, args, kwargs, error, name):
        """Every bad argument is refused, naming it."""
        with pytest.raises(error, match=name):
            derive_seed(*args, **kwargs)

    def test_numpy_ints_are_ints(self):
        """numpy ints give the seeds of the same Python ints."""
        want = derive_seed(3, 5, 1, epoch=2)
        assert derive_seed(np.int64(3), np.int32(5), np.uint8(1), epoch=np.int64(2)) == want
        assert derive_seed(3, 5, epoch=np.int64(0)) == derive_seed(3, 5)


class TestPermutation:
    @pytest.mark.parametrize(
        ("args", "kwargs", "error", "name"),
        [
            ((10, None), {}, TypeError, "seed"),
            ((10, "a"), {}, TypeError, "seed"),
            ((None, 0), {}, TypeError, "n"),
            ((10.0, 0), {}, TypeError, "n"),
            ((True, 0), {}, TypeError, "n"),
            ((-1, 0), {}, ValueError, "n"),
            ((10, 0), {"epoch": None}, TypeError, "epoch"),
            ((10, 0), {"epoch": "1"}, TypeError, "epoch"),
            ((10, 0), {"epoch": -2}, ValueError, "epoch"),
        ],
    )
    def test_bad_arguments(self, args, kwargs, error, name):
        """Every bad argument is refused, naming it."""
        with pytest.raises(error, match=name):
            permutation(*args, **kwargs)

    def test_numpy_ints_are_ints(self):
        assert permutation(np.int64(20), np.int32(4), np.int8(1)) == permutation(20, 4, 1)


def shuffled(n, seed, epoch=0):
    """What permutation always was: random.shuffle of range(n), seeded by derive_seed."""
    order = list(range(n))
    random.Random(derive_seed(seed, -1, epoch=epoch)).shuffle(order)
    return order


class TestPermutationValues:
    def test_the_values_of_earlier_versions(self):
        """Pinned values (from 0.5's random.shuffle): a resumed run keeps its order."""
        assert permutation(10, 0) == [4, 3, 0, 5, 9, 1, 2, 7, 6, 8]
        assert permutation(10, 0, epoch=1) == [2, 3, 9, 1, 7, 0, 8, 5, 6, 4]
        assert permutation(12, 5, epoch=3) == [0, 4, 5, 11, 8, 10, 3, 7, 2, 1, 9, 6]
        big = permutation(100_000, 3, epoch=2)
        digest = hashlib.sha256(",".join(map(str, big)).encode()).hexdigest()
        assert digest[:16] == "ca12cfa29cf287a7" and big[:2] == [17157, 17095]

    @pytest.mark.parametrize("n", [65_535, 65_536, 65_537, 70_001, 1 << 17, 300_007])
    @pytest.mark.parametrize(("seed", "epoch"), [(0, 0), (-7, 1), (2**70, 5)])
    def test_equals_random_shuffle(self, n, seed, epoch):
        """Every length, below and above where numpy takes over, gives shuffle's list."""
        got = permutation(n, seed, epoch)
        assert type(got) is list and type(got[0]) is int
        assert got == shuffled(n, seed, epoch)

    def test_long_ones_do_not_shuffle_item_by_item(self, monkeypatch):
        """A long permutation does not run random.shuffle's Python loop (seconds for
        10**7 items); without numpy it does, with the same result."""
        want = shuffled(200_000, 1)

        def refuse(*args):
            raise AssertionError("random.shuffle called")

        monkeypatch.setattr(random.Random, "shuffle", refuse)
        assert permutation(200_000, 1) == want
        monkeypatch.undo()
        monkeypatch.setitem(sys.modules, "numpy", None)  # as if numpy were not installed
        assert permutation(200_000, 1) == want


class TestRankShare:
    def test_a_mapping_is_not_a_sequence(self):
        """A dict (indexed by key, not position) is a TypeError, not a raw KeyError."""
        with pytest.raises(TypeError, match=r"sized sequence.*dict"):
            distributed.rank_share({"a": 1, "b": 2}, 0, 1)

    @pytest.mark.parametrize("pad", ["no", 0, 1, None, np.bool_(True)])
    def test_pad_must_be_a_bool(self, pad):
        """pad="no" is not taken as true: only True and False are accepted."""
        with pytest.raises(TypeError, match="pad"):
            distributed.rank_share(range(5), 0, 2, pad=pad)

    @pytest.mark.parametrize(
        ("rank", "world", "error", "name"),
        [
            ("0", 2, TypeError, "rank"),
            (0, 2.0, TypeError, "world_size"),
            (True, 2, TypeError, "rank"),
            (0, 0, ValueError, "world_size"),
            (-1, 2, ValueError, "rank"),
        ],
    )
    def test_bad_rank_or_world(self, rank, world, error, name):
        with pytest.raises(error, match=name):
            distributed.rank_share(range(5), rank, world)

    def test_numpy_ints_and_sequences(self):
        """numpy ints as rank and world size; a numpy array as the items."""
        share = distributed.rank_share(np.arange(7), np.int64(1), np.int64(3), pad=False)
        assert [int(x) for x in share] == [1, 4]


class TestDottedKeys:
    def test_a_key_holding_a_dot(self):
        """merge_from_list reaches a key named "lr.base", at the top or below."""
        cfg = CfgNode({"lr.base": 0.1, "OPT": {"lr.base": 1, "wd": 0}}, frozen=False)
        cfg.merge_from_list(["lr.base", "0.5", "OPT.lr.base", "2"])
        assert cfg["lr.base"] == 0.5 and cfg.OPT["lr.base"] == 2

    def test_the_whole_key_wins_then_nesting(self):
        """Where both a key "lr.base" and a path lr -> base exist, the key holding the dot
        is set; where only the path leads to a key, the path is used."""
        cfg = CfgNode({"lr.base": 0.1, "lr": {"base": 0.2, "min": 0.0}}, frozen=False)
        cfg.merge_from_list(["lr.base", "0.5", "lr.min", "0.01"])
        assert cfg["lr.base"] == 0.5 and cfg.lr.base == 0.2 and cfg.lr.min == 0.01

    def test_a_shorter_run_when_the_longer_leads_nowhere(self):
        """Override "a.b.c" with keys "a.b" (no c below it) and a -> b -> c: the path."""
        cfg = CfgNode({"a.b": {"x": 1}, "a": {"b": {"c": 1}}}, frozen=False)
        cfg.merge_from_list(["a.b.c", "5"])
        assert cfg.a.b.c == 5 and cfg["a.b"] == {"x": 1}

    def test_unknown_keys_still_name_close_matches(self):
        cfg = CfgNode({"OPT": {"lr.base": 0.1}}, frozen=False)
        with pytest.raises(KeyError, match=r"did you mean.*'OPT\.lr\.base'"):
            cfg.merge_from_list(["OPT.lr.bas", "1"])

    def test_exported(self):
        assert easycore.CfgNode is CfgNode
