"""Properties of CfgNode: YAML and (cloud)pickle round trips, copy, merge, frozen trees."""

from __future__ import annotations

import pickle
from typing import Any

import cloudpickle
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from easycore import CfgNode, FrozenError
from strategies import cfg_nodes, cfg_trees, follow, paths, shaped_dicts

# Scaled from the active hypothesis profile (tests/conftest.py: ci 60, dev 20, thorough 500),
# so the whole file stays a few seconds under "ci" and goes deep under "thorough".
_PROFILE = settings().max_examples


def budget(share: float) -> settings:
    """Settings running ``share`` of the profile's examples, without a deadline."""
    return settings(max_examples=max(5, int(_PROFILE * share)), deadline=None)


FAST = budget(2 / 3)


def same_types(a: Any, b: Any) -> bool:
    """Equal *and* of the same container types all the way down (tuple != list here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_types(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_types(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class TestYamlRoundTrip:
    @FAST
    @given(cfg_trees)
    def test_dump_load(self, tree: dict[str, Any]) -> None:
        """load(dump(c)) equals c, with the same types (tuples, lists, nodes) and key order."""
        cfg = CfgNode(tree)
        back = CfgNode.load(CfgNode.dump(cfg))
        assert back == cfg
        assert same_types(back, cfg)

    @FAST
    @given(cfg_trees)
    def test_dump_loads_with_safe_load(self, tree: dict[str, Any]) -> None:
        """Dumped YAML is plain YAML: yaml.safe_load reads it without error."""
        loaded = yaml.safe_load(CfgNode.dump(CfgNode(tree)))
        assert isinstance(loaded, dict) or (not tree and loaded is None)

    @budget(0.4)
    @given(cfg_trees, st.sampled_from([None, True, False]), st.sampled_from([20, 80]))
    def test_dump_options(self, tree: dict[str, Any], flow: bool | None, width: int) -> None:
        """The round trip survives other flow styles and line widths."""
        cfg = CfgNode(tree)
        text = CfgNode.dump(cfg, default_flow_style=flow, width=width)
        assert same_types(CfgNode.load(text), cfg)


class TestPickleRoundTrip:
    @FAST
    @given(cfg_nodes())
    @pytest.mark.parametrize("module", [pickle, cloudpickle], ids=["pickle", "cloudpickle"])
    def test_pickle(self, module: Any, cfg: CfgNode) -> None:
        """(cloud)pickle keeps content, types and the frozen state of every node."""
        back = module.loads(module.dumps(cfg))
        assert same_types(back, cfg)
        assert [follow(back, p).is_frozen() for p in paths(back)] == [
            follow(cfg, p).is_frozen() for p in paths(cfg)
        ]


class TestCopy:
    @FAST
    @given(cfg_nodes())
    def test_copy_equal_and_independent(self, cfg: CfgNode) -> None:
        """copy() is equal, keeps the frozen state, and changing it leaves the original alone."""
        before = CfgNode.dump(cfg)
        other = cfg.copy()
        assert same_types(other, cfg)
        assert other.is_frozen() == cfg.is_frozen()
        with other.unfrozen():
            for node in [follow(other, p) for p in paths(other)]:
                for key in list(node):
                    node[key] = "changed"
                node["NEW_KEY"] = 1
        assert CfgNode.dump(cfg) == before


class TestMerge:
    @FAST
    @given(cfg_trees)
    def test_or_self(self, tree: dict[str, Any]) -> None:
        """a | a == a."""
        a = CfgNode(tree)
        assert same_types(a | a, a)

    @FAST
    @given(shaped_dicts, shaped_dicts, shaped_dicts)
    def test_associative(self, x: dict[str, Any], y: dict[str, Any], z: dict[str, Any]) -> None:
        """(a | b) | c == a | (b | c) when a key holds the same kind of value everywhere."""
        a, b, c = CfgNode(x), CfgNode(y), CfgNode(z)
        assert same_types((a | b) | c, a | (b | c))

    @FAST
    @given(cfg_trees, cfg_trees)
    def test_or_leaves_operands(self, x: dict[str, Any], y: dict[str, Any]) -> None:
        """a | b changes neither operand, holds every key of both, and b's leaves win."""
        a, b = CfgNode(x), CfgNode(y)
        a_text, b_text = CfgNode.dump(a), CfgNode.dump(b)
        merged = a | b
        assert CfgNode.dump(a) == a_text and CfgNode.dump(b) == b_text
        assert set(merged) == set(a) | set(b)
        for key, value in b.items():
            if not (isinstance(value, dict) and isinstance(a.get(key), dict)):
                assert same_types(merged[key], value)


def _mutators(key: str) -> list[Any]:
    return [
        lambda n: n.__setitem__(key, 1),
        lambda n: n.__setitem__("NEW_KEY", 1),
        lambda n: setattr(n, "NEW_KEY", 1),
        lambda n: n.__delitem__(key),
        lambda n: delattr(n, key),
        lambda n: n.update({key: 1}),
        lambda n: n.pop(key, None),
        lambda n: n.popitem(),
        lambda n: n.setdefault(key, 1),
        lambda n: n.clear(),
        lambda n: n.__ior__({key: 1}),
        lambda n: n.merge({key: 1}),
        lambda n: n.merge_from_list([key, "1"]),
    ]


class TestFrozenEverywhere:
    @budget(1)
    @given(cfg_trees, st.data())
    def test_every_mutator_refused_at_every_depth(self, tree: dict[str, Any], data: Any) -> None:
        """On a frozen tree, any node (also inside lists) refuses every mutator, unchanged."""
        cfg = CfgNode(tree)
        before = CfgNode.dump(cfg)
        path = data.draw(st.sampled_from(paths(cfg)), label="path")
        node = follow(cfg, path)
        key = data.draw(st.sampled_from(list(node) or ["MISSING"]), label="key")
        for mutate in _mutators(key):
            with pytest.raises(FrozenError):
                mutate(node)
        assert CfgNode.dump(cfg) == before

    @budget(0.5)
    @given(cfg_trees)
    def test_freeze_whole_tree(self, tree: dict[str, Any]) -> None:
        """freeze(False) / freeze() reach every node; unfrozen() restores the state."""
        cfg = CfgNode(tree)
        with cfg.unfrozen():
            assert not any(follow(cfg, p).is_frozen() for p in paths(cfg))
        assert all(follow(cfg, p).is_frozen() for p in paths(cfg))
        cfg.freeze(False)
        assert not any(follow(cfg, p).is_frozen() for p in paths(cfg))
