"""Bad arguments to the helpers (API.md sections 9 and 12) are TypeError/ValueError naming
them; numpy ints count as ints. merge_from_list reaches keys that hold dots (section 4)."""

from __future__ import annotations

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


class TestRankShare:
    def test_a_mapping_is_not_a_sequence(self):
        """A dict (indexed by key, not position) is a TypeError, not a raw KeyError."""
        with pytest.raises(TypeError, match="sized sequence.*dict"):
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
        """"a.b.c" with keys "a.b" (no c below it) and a -> b -> c: the path is used."""
        cfg = CfgNode({"a.b": {"x": 1}, "a": {"b": {"c": 1}}}, frozen=False)
        cfg.merge_from_list(["a.b.c", "5"])
        assert cfg.a.b.c == 5 and cfg["a.b"] == {"x": 1}

    def test_unknown_keys_still_name_close_matches(self):
        cfg = CfgNode({"OPT": {"lr.base": 0.1}}, frozen=False)
        with pytest.raises(KeyError, match="lr.base"):
            cfg.merge_from_list(["OPT.lr.bas", "1"])

    def test_exported(self):
        assert easycore.CfgNode is CfgNode
