"""Unit tests for CfgNode (contract section 4)."""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import yaml

from easycore import CfgNode, EasycoreError, FrozenError


def sample() -> dict[str, Any]:
    return {
        "MODEL": {"DEPTH": 50, "NAME": "resnet", "HEAD": {"DROPOUT": 0.1}},
        "INPUT_SIZE": (224, 224),
        "STAGES": [{"CHANNELS": 64}, {"CHANNELS": 128}],
        "PAIRS": ({"A": 1}, 2),
        "LR": 0.1,
        "TAGS": ["a", "b"],
        "SEED": None,
        "DEBUG": False,
    }


def alias_tree() -> CfgNode:
    """Nine levels of nine YAML aliases: small in memory, 9**9 dotted keys to walk."""
    lines = ["L0: &L0 {" + ", ".join(f"K{j}: {j}" for j in range(9)) + "}"]
    for i in range(1, 9):
        refs = ", ".join(f"K{j}: *L{i - 1}" for j in range(9))
        lines.append(f"L{i}: &L{i} {{{refs}}}")
    lines.append("MODEL: {DEPTH: 50, TREE: *L8}")
    return CfgNode.load("\n".join(lines)).copy()


class TestConstruction:
    def test_frozen_by_default(self) -> None:
        """A new CfgNode is frozen unless frozen=False is given."""
        assert CfgNode().is_frozen()
        assert CfgNode(sample()).is_frozen()
        assert not CfgNode(sample(), frozen=False).is_frozen()

    def test_nested_dicts_become_nodes(self) -> None:
        """Dicts at any depth, also inside lists and tuples, become CfgNodes."""
        cfg = CfgNode(sample())
        assert type(cfg.MODEL) is CfgNode
        assert type(cfg.MODEL.HEAD) is CfgNode
        assert all(type(stage) is CfgNode for stage in cfg.STAGES)
        assert type(cfg.PAIRS) is tuple
        assert type(cfg.PAIRS[0]) is CfgNode

    def test_attribute_and_item_access(self) -> None:
        """cfg.A.B and cfg["A"]["B"] read the same value."""
        cfg = CfgNode(sample())
        assert cfg.MODEL.DEPTH == cfg["MODEL"]["DEPTH"] == 50
        assert cfg.STAGES[1].CHANNELS == 128

    def test_is_a_dict_equal_to_its_source(self) -> None:
        """A CfgNode is a dict and compares equal to the plain dict it came from."""
        cfg = CfgNode(sample())
        assert isinstance(cfg, dict)
        assert cfg == sample()
        assert list(cfg) == list(sample())

    def test_missing_attribute_names_close_matches(self) -> None:
        """A missing attribute is an AttributeError that suggests close keys."""
        cfg = CfgNode(sample())
        with pytest.raises(AttributeError, match=r"'DEPHT'.*did you mean 'DEPTH'"):
            _ = cfg.MODEL.DEPHT
        assert not hasattr(cfg, "NOPE")
        assert getattr(cfg, "NOPE", 7) == 7

    def test_dunder_lookup_fails_fast(self) -> None:
        """Unknown dunder names are plain AttributeErrors (pickle/copy protocol probes)."""
        cfg = CfgNode({"__secret__": 1})
        with pytest.raises(AttributeError):
            _ = cfg.__secret__
        assert cfg["__secret__"] == 1

    def test_copy_true_is_independent_of_input(self) -> None:
        """With copy=True (the default) later changes to the input do not show."""
        source = {"A": {"B": [1, 2]}, "OBJ": bytearray(b"x")}
        cfg = CfgNode(source)
        source["A"]["B"].append(3)
        source["OBJ"].append(0)
        assert cfg.A.B == [1, 2]
        assert cfg.OBJ == b"x"

    def test_copy_false_shares_leaves(self) -> None:
        """With copy=False leaf objects are shared; the tree structure is still new."""
        leaf = bytearray(b"x")
        source = {"A": {"OBJ": leaf}}
        cfg = CfgNode(source, copy=False)
        assert cfg.A.OBJ is leaf
        assert type(source["A"]) is dict  # the input is not converted in place

    def test_input_not_changed(self) -> None:
        """Building a node leaves the input mapping as it was."""
        source = sample()
        CfgNode(source)
        assert source == sample()
        assert type(source["MODEL"]) is dict

    def test_non_mapping_refused(self) -> None:
        """Building from something that is not a mapping is a TypeError."""
        with pytest.raises(TypeError, match="mapping"):
            CfgNode([("A", 1)])  # type: ignore[arg-type]

    def test_repr_is_readable_and_evaluable(self) -> None:
        """repr shows plain dicts and the frozen state, and evaluates back to an equal node."""
        cfg = CfgNode({"A": {"B": 1}})
        assert repr(cfg) == "CfgNode({'A': {'B': 1}}, frozen=True)"
        again = eval(repr(cfg), {"CfgNode": CfgNode})
        assert again == cfg and again.is_frozen()

    def test_str_is_yaml(self) -> None:
        """str(cfg) is the YAML dump."""
        cfg = CfgNode({"A": {"B": 1}})
        assert str(cfg) == "A:\n  B: 1\n"

    def test_key_named_like_a_method(self) -> None:
        """A key named like a method is reachable by item; setting it as attribute is refused."""
        cfg = CfgNode({"copy": 1, "items": 2}, frozen=False)
        assert cfg["copy"] == 1
        assert callable(cfg.copy)
        with pytest.raises(AttributeError, match=r"cfg\['items'\]"):
            cfg.items = 3
        cfg["items"] = 3
        assert cfg["items"] == 3

    def test_dir_lists_keys(self) -> None:
        """dir() includes the keys, for tab completion."""
        assert {"MODEL", "LR", "freeze"} <= set(dir(CfgNode(sample())))

    def test_fromkeys(self) -> None:
        """CfgNode.fromkeys builds a (frozen) node."""
        cfg = CfgNode.fromkeys(["A", "B"], 0)
        assert cfg == {"A": 0, "B": 0}
        assert type(cfg) is CfgNode and cfg.is_frozen()


def _locations(cfg: CfgNode) -> dict[str, CfgNode]:
    return {
        "top": cfg,
        "depth": cfg.MODEL.HEAD,
        "in_list": cfg.STAGES[0],
        "in_tuple": cfg.PAIRS[0],
    }


# (name, mutation) for every way to change a node; each gets a node and one of its keys.
MUTATORS = [
    ("setattr", lambda n, k: setattr(n, k, 1)),
    ("setattr_new", lambda n, k: setattr(n, "NEW", 1)),
    ("setitem", lambda n, k: n.__setitem__(k, 1)),
    ("setitem_new", lambda n, k: n.__setitem__("NEW", 1)),
    ("delattr", lambda n, k: delattr(n, k)),
    ("delitem", lambda n, k: n.__delitem__(k)),
    ("update", lambda n, k: n.update({k: 1})),
    ("update_kwargs", lambda n, k: n.update(NEW=1)),
    ("update_empty", lambda n, k: n.update()),
    ("pop", lambda n, k: n.pop(k)),
    ("pop_default", lambda n, k: n.pop("MISSING", None)),
    ("popitem", lambda n, k: n.popitem()),
    ("setdefault_new", lambda n, k: n.setdefault("NEW", 1)),
    ("setdefault_existing", lambda n, k: n.setdefault(k, 1)),
    ("clear", lambda n, k: n.clear()),
    ("ior", lambda n, k: n.__ior__({k: 1})),
    ("merge", lambda n, k: n.merge({k: 1})),
    ("merge_from_list", lambda n, k: n.merge_from_list([k, "1"])),
]


class TestFrozen:
    @pytest.mark.parametrize("where", ["top", "depth", "in_list", "in_tuple"])
    @pytest.mark.parametrize(("name", "mutate"), MUTATORS, ids=[m[0] for m in MUTATORS])
    def test_mutator_refused(self, name: str, mutate: Any, where: str) -> None:
        """Every mutator raises on a frozen tree, at the top, at depth, inside lists and tuples."""
        cfg = CfgNode(sample())
        node = _locations(cfg)[where]
        key = next(iter(node))
        with pytest.raises(FrozenError, match="frozen"):
            mutate(node, key)
        assert cfg == sample()

    def test_augmented_or_refused(self) -> None:
        """cfg |= other raises FrozenError and leaves cfg unchanged."""
        cfg = CfgNode(sample())
        with pytest.raises(FrozenError):
            cfg |= {"LR": 1.0}
        assert cfg.LR == 0.1

    def test_frozen_error_is_attribute_and_easycore_error(self) -> None:
        """FrozenError is both an AttributeError and an EasycoreError, and says how to unfreeze."""
        cfg = CfgNode(sample())
        with pytest.raises(FrozenError) as info:
            cfg.LR = 1.0
        assert isinstance(info.value, AttributeError)
        assert isinstance(info.value, EasycoreError)
        assert "unfrozen()" in str(info.value) and "freeze(False)" in str(info.value)
        assert "'LR'" in str(info.value)

    def test_freeze_acts_on_whole_tree(self) -> None:
        """freeze(False) and freeze() reach every node, also those inside lists and tuples."""
        cfg = CfgNode(sample())
        cfg.freeze(False)
        assert not any(n.is_frozen() for n in _locations(cfg).values())
        cfg.freeze()
        assert all(n.is_frozen() for n in _locations(cfg).values())

    def test_unfrozen_allows_changes_then_refreezes(self) -> None:
        """Inside unfrozen() the tree changes; after it, it is frozen again."""
        cfg = CfgNode(sample())
        with cfg.unfrozen() as same:
            assert same is cfg
            cfg.MODEL.DEPTH = 101
            cfg.STAGES[0].CHANNELS = 32
            cfg.NEW = {"X": 1}
        assert cfg.MODEL.DEPTH == 101 and cfg.STAGES[0].CHANNELS == 32
        assert cfg.is_frozen() and cfg.NEW.is_frozen()
        with pytest.raises(FrozenError):
            cfg.NEW.X = 2

    def test_unfrozen_restores_on_exception(self) -> None:
        """The frozen state comes back even when the block raises."""
        cfg = CfgNode(sample())
        with pytest.raises(RuntimeError), cfg.unfrozen():
            cfg.LR = 1.0
            raise RuntimeError("boom")
        assert cfg.is_frozen() and cfg.MODEL.HEAD.is_frozen()

    def test_unfrozen_restores_unfrozen_state(self) -> None:
        """On an unfrozen tree, unfrozen() leaves it unfrozen."""
        cfg = CfgNode(sample(), frozen=False)
        with cfg.unfrozen():
            pass
        assert not cfg.is_frozen() and not cfg.MODEL.is_frozen()

    def test_nested_unfrozen_blocks(self) -> None:
        """Nested unfrozen() blocks restore the outer state step by step."""
        cfg = CfgNode(sample())
        with cfg.unfrozen():
            with cfg.MODEL.unfrozen():
                cfg.MODEL.DEPTH = 1
            assert not cfg.MODEL.is_frozen()
        assert cfg.MODEL.is_frozen()

    def test_mutators_work_when_unfrozen(self) -> None:
        """All dict mutators work on an unfrozen node, and new dicts become nodes."""
        cfg = CfgNode({"A": 1, "B": 2, "C": 3}, frozen=False)
        cfg.D = {"X": 1}
        cfg["E"] = [{"Y": 2}]
        cfg.update({"F": {"Z": 3}}, G=4)
        assert type(cfg.D) is CfgNode and type(cfg.E[0]) is CfgNode and type(cfg.F) is CfgNode
        assert cfg.setdefault("H", {"W": 0}).W == 0
        assert cfg.setdefault("A", 9) == 1
        assert cfg.pop("B") == 2
        del cfg.C
        del cfg["D"]
        assert cfg.popitem() == ("H", {"W": 0})
        cfg |= {"F": {"Q": 1}}
        assert cfg.F == {"Z": 3, "Q": 1}
        cfg.clear()
        assert cfg == {}

    def test_delattr_missing_key(self) -> None:
        """Deleting a missing attribute is an AttributeError naming close matches."""
        cfg = CfgNode({"DEPTH": 1}, frozen=False)
        with pytest.raises(AttributeError, match="did you mean 'DEPTH'"):
            del cfg.DEPHT

    def test_assigned_node_takes_the_tree_state(self) -> None:
        """A frozen node assigned into an unfrozen tree is stored as an unfrozen copy."""
        inner = CfgNode({"X": 1})
        cfg = CfgNode(frozen=False)
        cfg.INNER = inner
        assert not cfg.INNER.is_frozen() and inner.is_frozen()
        cfg.INNER.X = 2
        assert inner.X == 1


class TestCopyAndPickle:
    @pytest.mark.parametrize("frozen", [True, False])
    def test_copy_is_deep_and_keeps_state(self, frozen: bool) -> None:
        """copy() is equal, independent, and has the same frozen state."""
        cfg = CfgNode(sample(), frozen=frozen)
        other = cfg.copy()
        assert other == cfg and type(other) is CfgNode
        assert other.is_frozen() is frozen and other.MODEL.is_frozen() is frozen
        assert other.MODEL is not cfg.MODEL and other.TAGS is not cfg.TAGS
        with other.unfrozen():
            other.MODEL.DEPTH = 1
            other.TAGS.append("c")
        assert cfg == sample()

    @pytest.mark.parametrize("frozen", [True, False])
    def test_copy_module(self, frozen: bool) -> None:
        """copy.copy (shallow) and copy.deepcopy work on frozen and unfrozen nodes."""
        cfg = CfgNode(sample(), frozen=frozen)
        shallow = copy.copy(cfg)
        deep = copy.deepcopy(cfg)
        assert shallow == cfg == deep
        assert shallow.is_frozen() is deep.is_frozen() is frozen
        assert shallow.MODEL is cfg.MODEL
        assert deep.MODEL is not cfg.MODEL and deep.MODEL.is_frozen() is frozen

    @pytest.mark.parametrize("frozen", [True, False])
    @pytest.mark.parametrize("module", [pickle, cloudpickle], ids=["pickle", "cloudpickle"])
    def test_pickle_keeps_content_and_state(self, module: Any, frozen: bool) -> None:
        """(cloud)pickle keeps the content and the frozen state of every node."""
        cfg = CfgNode(sample(), frozen=frozen)
        back = module.loads(module.dumps(cfg))
        assert back == cfg and type(back.INPUT_SIZE) is tuple
        assert all(n.is_frozen() is frozen for n in _locations(back).values())


class TestMerge:
    def test_merge_is_recursive(self) -> None:
        """merge overrides leaves, merges sub-nodes and adds new keys."""
        cfg = CfgNode(sample(), frozen=False)
        cfg.merge({"MODEL": {"DEPTH": 101, "HEAD": {"NEW": 1}}, "EXTRA": {"A": 1}})
        assert cfg.MODEL.DEPTH == 101 and cfg.MODEL.NAME == "resnet"
        assert cfg.MODEL.HEAD == {"DROPOUT": 0.1, "NEW": 1}
        assert type(cfg.EXTRA) is CfgNode

    def test_merge_copies_values(self) -> None:
        """Values merged in are copies: changing the source later does not show."""
        source = {"L": [1]}
        cfg = CfgNode(frozen=False)
        cfg.merge(source)
        source["L"].append(2)
        assert cfg.L == [1]

    def test_merge_needs_unfrozen(self) -> None:
        """merge on a frozen node raises FrozenError."""
        with pytest.raises(FrozenError):
            CfgNode(sample()).merge({"LR": 1.0})

    def test_merge_non_mapping(self) -> None:
        """merge of something that is not a mapping is a TypeError."""
        with pytest.raises(TypeError, match="mapping"):
            CfgNode(frozen=False).merge([("A", 1)])  # type: ignore[arg-type]

    @pytest.mark.parametrize("frozen", [True, False])
    def test_or_returns_new_node(self, frozen: bool) -> None:
        """a | b is a new merged node with a's frozen state; a and b are unchanged."""
        a = CfgNode(sample(), frozen=frozen)
        b = CfgNode({"MODEL": {"DEPTH": 101}, "NEW": 1})
        merged = a | b
        assert merged.MODEL.DEPTH == 101 and merged.MODEL.NAME == "resnet" and merged.NEW == 1
        assert merged.is_frozen() is frozen and merged.MODEL.is_frozen() is frozen
        assert a == sample() and b == {"MODEL": {"DEPTH": 101}, "NEW": 1}

    def test_or_with_plain_dicts(self) -> None:
        """cfg | dict and dict | cfg both give CfgNodes, right side winning."""
        cfg = CfgNode({"A": {"B": 1, "C": 2}})
        assert (cfg | {"A": {"B": 3}}) == {"A": {"B": 3, "C": 2}}
        left = {"A": {"B": 3, "D": 4}} | cfg
        assert type(left) is CfgNode and left == {"A": {"B": 1, "C": 2, "D": 4}}

    def test_or_non_mapping(self) -> None:
        """cfg | 1 is a TypeError."""
        with pytest.raises(TypeError):
            _ = CfgNode() | 1


class TestMergeFromList:
    def test_parses_literals(self) -> None:
        """Values are parsed as Python literals, per the current type."""
        cfg = CfgNode(sample(), frozen=False)
        cfg.merge_from_list(
            [
                "MODEL.DEPTH", "101",
                "MODEL.HEAD.DROPOUT", "0.5",
                "INPUT_SIZE", "(320, 320)",
                "TAGS", "['x']",
                "DEBUG", "True",
                "SEED", "7",
            ]
        )  # fmt: skip
        assert cfg.MODEL.DEPTH == 101 and cfg.MODEL.HEAD.DROPOUT == 0.5
        assert cfg.INPUT_SIZE == (320, 320) and cfg.TAGS == ["x"]
        assert cfg.DEBUG is True and cfg.SEED == 7

    def test_allowed_conversions(self) -> None:
        """int -> float, list <-> tuple (to the current type), None <-> any, true/false."""
        cfg = CfgNode(sample(), frozen=False)
        cfg.merge_from_list(["LR", "1", "INPUT_SIZE", "[1, 2]", "TAGS", "('t',)"])
        assert cfg.LR == 1.0 and type(cfg.LR) is float
        assert cfg.INPUT_SIZE == (1, 2) and cfg.TAGS == ["t"]
        cfg.merge_from_list(["MODEL.DEPTH", "None", "SEED", "'abc'", "DEBUG", "true"])
        assert cfg.MODEL.DEPTH is None and cfg.SEED == "abc" and cfg.DEBUG is True

    def test_string_key_keeps_text(self) -> None:
        """A string key takes the text: '123' stays '123', unparsable text stays as is."""
        cfg = CfgNode(sample(), frozen=False)
        cfg.merge_from_list(["MODEL.NAME", "123"])
        assert cfg.MODEL.NAME == "123"
        cfg.merge_from_list(["MODEL.NAME", "vgg16"])
        assert cfg.MODEL.NAME == "vgg16"
        cfg.merge_from_list(["MODEL.NAME", "'quoted'"])
        assert cfg.MODEL.NAME == "quoted"

    def test_unparsable_value_is_text(self) -> None:
        """Text that is no Python literal stays a string (accepted where None was)."""
        cfg = CfgNode(sample(), frozen=False)
        cfg.merge_from_list(["SEED", "not a literal"])
        assert cfg.SEED == "not a literal"

    @pytest.mark.parametrize(
        ("key", "value"),
        [("MODEL.DEPTH", "1.5"), ("LR", "'fast'"), ("DEBUG", "1"), ("TAGS", "{'a': 1}"),
         ("MODEL.DEPTH", "True"), ("MODEL", "3")],
    )  # fmt: skip
    def test_type_mismatch(self, key: str, value: str) -> None:
        """A value of another type is a TypeError naming the key."""
        cfg = CfgNode(sample(), frozen=False)
        with pytest.raises(TypeError, match=key.replace(".", r"\.")):
            cfg.merge_from_list([key, value])
        assert cfg == sample()

    def test_unknown_key_suggests(self) -> None:
        """An unknown key is a KeyError that names close matches."""
        cfg = CfgNode(sample(), frozen=False)
        with pytest.raises(KeyError, match=r"did you mean 'MODEL\.DEPTH'"):
            cfg.merge_from_list(["MODEL.DEPHT", "1"])
        with pytest.raises(KeyError, match=r"'MODLE' does not exist.*did you mean 'MODEL"):
            cfg.merge_from_list(["MODLE.DEPTH", "1"])
        with pytest.raises(KeyError, match="'LR' is not a config node"):
            cfg.merge_from_list(["LR.X", "1"])

    @pytest.mark.timeout(20)
    def test_typo_in_an_alias_tree_answers_at_once(self) -> None:
        """In a tree of YAML aliases too big to walk, a typo is a KeyError naming matches."""
        cfg = alias_tree()
        with cfg.unfrozen(), pytest.raises(KeyError, match=r"did you mean 'MODEL\.DEPTH'"):
            cfg.merge_from_list(["MODEL.DEPHT", "101"])
        with cfg.unfrozen(), pytest.raises(KeyError, match=r"did you mean 'MODEL\.TREE\.K1'"):
            cfg.merge_from_list(["MODEL.TREE.KK1", "1"])
        with cfg.unfrozen(), pytest.raises(KeyError, match=r"did you mean 'MODEL\.DEPTH'"):
            cfg.merge_from_list(["MODLE.DEPTH", "1"])
        with pytest.raises(AttributeError, match="did you mean 'K1'"):
            cfg.MODEL.TREE.K1.KK1  # noqa: B018

    @pytest.mark.parametrize(
        ("key", "value", "error", "named"),
        [("BIG.X", "1", KeyError, "'BIG'"), ("BIG", "{'X': 1}", TypeError, "'BIG'"),
         ("DEPTH", "x" * 200_000, TypeError, "'DEPTH'"), ("MODEL.DEPTH.X", "1", KeyError, "50")],
    )  # fmt: skip
    def test_messages_show_values_short(
        self, key: str, value: str, error: type[Exception], named: str
    ) -> None:
        """Error messages show the values they echo, of any size, briefly."""
        cfg = CfgNode({"BIG": list(range(50_000)), "DEPTH": 50, "MODEL": {"DEPTH": 50}})
        with cfg.unfrozen(), pytest.raises(error) as info:
            cfg.merge_from_list([key, value])
        assert named in str(info.value) and len(str(info.value)) < 400

    @pytest.mark.timeout(20)
    def test_alias_tree_node_in_a_message_is_shown_short(self) -> None:
        """A node of a YAML alias tree too big to print is echoed briefly, at once."""
        cfg = alias_tree()
        with cfg.unfrozen(), pytest.raises(TypeError, match=r"'MODEL\.TREE'.*'K0'") as info:
            cfg.merge_from_list(["MODEL.TREE", "3"])
        assert len(str(info.value)) < 400

    def test_odd_length(self) -> None:
        """An odd number of items is a ValueError."""
        with pytest.raises(ValueError, match="pairs"):
            CfgNode(sample(), frozen=False).merge_from_list(["LR"])

    def test_all_or_nothing(self) -> None:
        """When one pair is bad, none is applied."""
        cfg = CfgNode(sample(), frozen=False)
        with pytest.raises(KeyError):
            cfg.merge_from_list(["LR", "0.5", "NOPE", "1"])
        assert cfg.LR == 0.1

    def test_frozen(self) -> None:
        """merge_from_list on a frozen node raises FrozenError."""
        with pytest.raises(FrozenError):
            CfgNode(sample()).merge_from_list(["LR", "0.5"])

    def test_dict_value_merges_into_node(self) -> None:
        """A dict value for a node key is merged into that node."""
        cfg = CfgNode(sample(), frozen=False)
        cfg.merge_from_list(["MODEL.HEAD", "{'DROPOUT': 0.2, 'BIAS': True}"])
        assert cfg.MODEL.HEAD == {"DROPOUT": 0.2, "BIAS": True}
        assert type(cfg.MODEL.HEAD) is CfgNode


class TestYaml:
    def test_load_nested(self) -> None:
        """YAML mappings load as nested CfgNodes, frozen."""
        cfg = CfgNode.load("MODEL:\n  DEPTH: 50\nSTAGES:\n- {C: 1}\n")
        assert cfg.MODEL.DEPTH == 50 and type(cfg.STAGES[0]) is CfgNode
        assert cfg.is_frozen() and cfg.STAGES[0].is_frozen()

    def test_unquoted_tuple(self) -> None:
        """An unquoted (224, 224) loads as a tuple."""
        cfg = CfgNode.load("INPUT_SIZE: (224, 224)\nONE: (1,)\nEMPTY: ()\nNEST: ((1, 2), 'a')")
        assert cfg.INPUT_SIZE == (224, 224) and type(cfg.INPUT_SIZE) is tuple
        assert cfg.ONE == (1,) and cfg.EMPTY == () and cfg.NEST == ((1, 2), "a")

    def test_quoted_stays_string(self) -> None:
        """Quoted "(1, 2)" and "123" stay strings."""
        cfg = CfgNode.load("A: \"(1, 2)\"\nB: '(1, 2)'\nC: \"123\"\nD: '123'")
        assert cfg == {"A": "(1, 2)", "B": "(1, 2)", "C": "123", "D": "123"}

    def test_non_tuple_parentheses_stay_string(self) -> None:
        """Parenthesised text that is no tuple literal stays a string."""
        cfg = CfgNode.load("A: (a, b)\nB: (1)\nC: (hello world)")
        assert cfg == {"A": "(a, b)", "B": "(1)", "C": "(hello world)"}

    def test_exponent_floats(self) -> None:
        """1e-3 and 1E5 load as floats (YAML 1.1 alone reads strings)."""
        cfg = CfgNode.load("LR: 1e-3\nBIG: 1E5\nQ: '1e-3'")
        assert cfg.LR == 0.001 and cfg.BIG == 100000.0 and cfg.Q == "1e-3"

    @pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n"])
    def test_empty_document(self, text: str) -> None:
        """An empty document loads as an empty, frozen CfgNode."""
        cfg = CfgNode.load(text)
        assert cfg == {} and type(cfg) is CfgNode and cfg.is_frozen()

    def test_python_tags_refused_nothing_runs(self, tmp_path: Path) -> None:
        """!!python/object/apply:os.system is refused, and nothing is executed."""
        marker = tmp_path / "pwned"
        text = f"A: 1\nB: !!python/object/apply:os.system ['touch {marker}']\n"
        with pytest.raises(ValueError, match=r"<string>:2:.*python/object/apply:os\.system"):
            CfgNode.load(text)
        assert not marker.exists()

    @pytest.mark.parametrize(
        "tag", ["!!python/object:collections.OrderedDict {}", "!!python/name:os.system ''"]
    )
    def test_other_python_tags_refused(self, tag: str) -> None:
        """Other Python object tags are refused with a clear message."""
        with pytest.raises(ValueError, match="refused"):
            CfgNode.load(f"A: {tag}")

    @pytest.mark.parametrize(
        ("text", "key", "line", "first"),
        [("A: 1\nB: 2\nA: 3\n", "'A'", 3, 1),
         ("M:\n  D: 1\n  W: 2\n  D: 3\n", "'D'", 4, 2),
         ("L:\n- {X: 1,\n   X: 2}\n", "'X'", 3, 2),
         ("A: 1\n'A': 2\n", "'A'", 2, 1),
         ("S:\n  (1, 2): a\n  (1,2): b\n", r"\(1, 2\)", 3, 2)],
    )  # fmt: skip
    def test_duplicate_key_refused(self, text: str, key: str, line: int, first: int) -> None:
        """A key given twice in one mapping, at any depth, is a ValueError naming it and lines."""
        with pytest.raises(ValueError, match=rf"^<string>:{line}:\d+: duplicate key {key}") as info:
            CfgNode.load(text)
        assert f"line {first}" in str(info.value)

    def test_duplicate_key_in_a_file_names_it(self, tmp_path: Path) -> None:
        """CfgNode.open refuses a repeated key, naming the file, line and key."""
        path = tmp_path / "dup.yaml"
        path.write_text("MODEL:\n  DEPTH: 50\nMODEL:\n  DEPTH: 101\n", encoding="utf-8")
        with pytest.raises(ValueError, match=r"dup\.yaml:3:\d+: duplicate key 'MODEL'"):
            CfgNode.open(path)

    def test_unhashable_tuple_key_names_line(self) -> None:
        """A tuple key holding a list is a ValueError naming the line, not a bare TypeError."""
        with pytest.raises(ValueError, match=r"^<string>:2:\d+: .*unhashable"):
            CfgNode.load("A: 1\n(1, [2]): b\n")

    def test_same_key_in_other_mappings_and_merge_keys_allowed(self) -> None:
        """A key may repeat across mappings, and override a key brought in by a << merge."""
        cfg = CfgNode.load("B: &b {X: 1, Y: 2}\nC: {<<: *b, X: 3}\nD: {X: 4}\n")
        assert cfg.C == {"X": 3, "Y": 2} and cfg.B.X == 1 and cfg.D.X == 4

    def test_dump_quotes_misleading_strings(self) -> None:
        """Strings that look like tuples, numbers, bools or null are written quoted."""
        cfg = CfgNode({"A": "(1, 2)", "B": "123", "C": "true", "D": "null", "E": "1e-3"})
        text = CfgNode.dump(cfg)
        assert "'(1, 2)'" in text and "'123'" in text and "'true'" in text
        assert "'null'" in text and "'1e-3'" in text
        assert CfgNode.load(text) == cfg

    def test_dump_tuples_plain(self) -> None:
        """Tuples are written in (a, b) form, and read back as tuples."""
        cfg = CfgNode({"SIZE": (224, 224), "ONE": ("a",), "L": [(1, 2)]})
        text = CfgNode.dump(cfg)
        assert "SIZE: (224, 224)\n" in text and "ONE: ('a',)\n" in text
        assert CfgNode.load(text) == cfg and type(CfgNode.load(text).L[0]) is tuple

    def test_dump_keeps_order(self) -> None:
        """Keys are written in insertion order unless sort_keys=True."""
        cfg = CfgNode({"b": 1, "a": 2})
        assert CfgNode.dump(cfg) == "b: 1\na: 2\n"
        assert CfgNode.dump(cfg, sort_keys=True) == "a: 2\nb: 1\n"

    def test_dump_loads_with_safe_load(self) -> None:
        """Dumped YAML loads with yaml.safe_load (tuples come back as strings)."""
        cfg = CfgNode(sample())
        plain = yaml.safe_load(CfgNode.dump(cfg))
        assert plain["MODEL"] == {"DEPTH": 50, "NAME": "resnet", "HEAD": {"DROPOUT": 0.1}}
        assert plain["INPUT_SIZE"] == "(224, 224)"

    def test_round_trip(self) -> None:
        """load(dump(cfg)) == cfg, tuples and lists kept apart."""
        cfg = CfgNode(sample())
        back = CfgNode.load(CfgNode.dump(cfg))
        assert back == cfg
        assert type(back.INPUT_SIZE) is tuple and type(back.TAGS) is list
        assert type(back.PAIRS) is tuple and type(back.PAIRS[0]) is CfgNode

    def test_dump_forms(self) -> None:
        """dump works as CfgNode.dump(cfg), cfg.dump(), on plain dicts and into a stream."""
        cfg = CfgNode({"A": 1})
        assert CfgNode.dump(cfg) == cfg.dump() == CfgNode.dump({"A": 1}) == "A: 1\n"  # type: ignore[arg-type]
        stream = io.StringIO()
        assert CfgNode.dump(cfg, stream) is None
        assert stream.getvalue() == "A: 1\n"

    def test_dump_unsupported_value(self) -> None:
        """A value YAML cannot hold is a TypeError naming it."""
        with pytest.raises(TypeError, match="object"):
            CfgNode.dump(CfgNode({"A": object()}))

    @pytest.mark.parametrize("as_path", [str, Path])
    def test_save_and_open(self, tmp_path: Path, as_path: Any) -> None:
        """save then open (str or Path) gives an equal, frozen config."""
        cfg = CfgNode(sample())
        path = as_path(tmp_path / "cfg.yaml")
        cfg.save(path)
        back = CfgNode.open(path)
        assert back == cfg and back.is_frozen()

    def test_save_and_open_file_objects(self, tmp_path: Path) -> None:
        """save and open accept open text files."""
        cfg = CfgNode(sample())
        path = tmp_path / "cfg.yaml"
        with path.open("w", encoding="utf-8") as f:
            cfg.save(f)
        with path.open(encoding="utf-8") as f:
            assert CfgNode.open(f) == cfg

    def test_save_unicode(self, tmp_path: Path) -> None:
        """Non-ASCII text is written as UTF-8 and read back."""
        cfg = CfgNode({"NAME": "héllo wörld ✓"})
        cfg.save(tmp_path / "u.yaml")
        assert CfgNode.open(tmp_path / "u.yaml") == cfg

    def test_missing_file(self, tmp_path: Path) -> None:
        """A missing file is a FileNotFoundError naming the path."""
        path = tmp_path / "nope.yaml"
        with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
            CfgNode.open(path)

    def test_malformed_yaml_names_file_and_line(self, tmp_path: Path) -> None:
        """Malformed YAML is a ValueError naming the file and the line."""
        path = tmp_path / "bad.yaml"
        path.write_text("A: 1\nB: [1, 2\nC: 3\n", encoding="utf-8")
        with pytest.raises(ValueError, match=r"bad\.yaml:\d+:") as info:
            CfgNode.open(path)
        assert str(path) in str(info.value)
        assert isinstance(info.value.__cause__, yaml.YAMLError)

    def test_malformed_string_names_line(self) -> None:
        """Malformed YAML text names <string> and the line."""
        with pytest.raises(ValueError, match=r"^<string>:3:"):
            CfgNode.load("A: 1\nB: 2\n  C: 3\n")

    @pytest.mark.parametrize(
        ("text", "line", "kind"), [("- 1\n- 2\n", 1, "a list"), ("# x\n\n42\n", 3, "a scalar")]
    )
    def test_top_level_not_mapping(self, tmp_path: Path, text: str, line: int, kind: str) -> None:
        """A top level that is not a mapping is a ValueError naming file, line and kind."""
        path = tmp_path / "top.yaml"
        path.write_text(text, encoding="utf-8")
        with pytest.raises(ValueError, match=rf"top\.yaml:{line}: .*mapping.*{kind}"):
            CfgNode.open(path)

    def test_several_documents(self) -> None:
        """A stream with several documents is refused."""
        with pytest.raises(ValueError, match="<string>:"):
            CfgNode.load("A: 1\n---\nB: 2\n")

    def test_control_character_names_source(self) -> None:
        """A control character in the text is a ValueError naming the source."""
        with pytest.raises(ValueError, match=r"^<string>: .*unacceptable character"):
            CfgNode.load("A: \x00")

    def test_bad_value_names_source(self) -> None:
        """A value YAML cannot build (an impossible date) names the source."""
        with pytest.raises(ValueError, match=r"^<string>: "):
            CfgNode.load("DAY: 2024-13-45")
