"""easycore.common.config.CfgNode: 0.4's config tutorial, and 0.4's mutable-until-freeze rules."""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path

import pytest

import easycore
from easycore import FrozenError
from easycore.common.config import CfgNode as CN

HERE = Path(__file__).parent

# 0.4's own test/config/example.yaml: its `scale` entry asks the loader to run eval().
UNSAFE_YAML = """\
app:
  server:
    host: 127.0.0.1
    port: 8080
  client:
    version: '0.1.0'
    user_number_range: (0, 100)
    default_user: ['root', 'admin']
  scale: !!python/object/apply:eval [2 ** 0, 2 ** (1 / 3), 2 ** (2 / 3)]

docs:
  path: https://XXXXXX.com/docs
"""


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Work in a temporary directory holding the tutorial's example.yaml."""
    shutil.copy(HERE / "example.yaml", tmp_path / "example.yaml")
    monkeypatch.chdir(tmp_path)
    return tmp_path


class TestConfigTutorial:
    """The code of 0.4's docs/source/tutorials/config.md, section by section."""

    def test_load_config_from_yaml_file(self, in_tmp):
        """Both ways of opening example.yaml give the same mutable tree, INPUT_SIZE a tuple."""
        cfg = CN.open("example.yaml")

        # or
        with open("example.yaml", "r", encoding="utf-8") as f:  # noqa: UP015 - as documented
            cfg2 = CN.open(f)

        assert cfg == cfg2
        assert cfg.MODEL.INPUT_SIZE == (224, 224)
        assert isinstance(cfg.MODEL.INPUT_SIZE, tuple)
        assert cfg.MODEL.IN_FEAUTRES == ["res3", "res4", "res5"]
        assert cfg.MODEL.NUM_CLASSES == 100
        assert cfg.NAME == "YuxinZhaozyx"
        assert isinstance(cfg, CN) and isinstance(cfg.MODEL, CN)
        assert not cfg.is_frozen() and not cfg2.MODEL.is_frozen()

    def test_get_an_empty_config(self):
        """CN() is an empty, mutable config."""
        cfg = CN()
        assert cfg == {} and not cfg.is_frozen()

    def test_config_from_dict_and_use_it(self):
        """A config built from a dict keeps Python types; new values and nodes can be added."""
        init_dict = {
            "MODEL": {
                "IN_FEATURES": ["res3", "res4", "res5"],
                "INPUT_SIZE": (224, 224),
                "NUM_CLASSES": 100,
            },
            "NAME": "YuxinZhaozyx",
        }
        cfg = CN(init_dict)

        # get value from config
        # the config has been automatically transform into python data type.
        in_features = cfg.MODEL.IN_FEATURES  # list
        input_size = cfg.MODEL.INPUT_SIZE  # tuple
        num_classes = cfg.MODEL.NUM_CLASSES  # int
        name = cfg.NAME  # str

        # add new value to config
        cfg.LICENSE = "MIT"

        # add a new CfgNode to config
        cfg.SOLVER = CN()
        cfg.SOLVER.LEARNING_RATE = 0.001
        cfg.SOLVER.BATCH_SIZE = 128

        assert in_features == ["res3", "res4", "res5"]
        assert input_size == (224, 224) and isinstance(input_size, tuple)
        assert num_classes == 100
        assert name == "YuxinZhaozyx"
        assert cfg.LICENSE == "MIT"
        assert cfg.SOLVER == {"LEARNING_RATE": 0.001, "BATCH_SIZE": 128}
        assert isinstance(cfg.SOLVER, CN)
        assert init_dict["MODEL"]["NUM_CLASSES"] == 100 and "LICENSE" not in init_dict

    def test_merge_two_config(self):
        """merge overrides in place (the tutorial's `cfg_c.key3` typo read as `cfg_b.key3`)."""
        cfg_a = CN()
        cfg_a.key1 = 1
        cfg_a.key2 = 2

        cfg_b = CN()
        cfg_b.key2 = 3
        cfg_b.key3 = 4  # the tutorial writes `cfg_c.key3 = 4`, a NameError there and here

        # merge two config
        cfg_a.merge(cfg_b)  # now cfg_a.key2 is 3

        assert cfg_a == {"key1": 1, "key2": 3, "key3": 4}
        assert cfg_b == {"key2": 3, "key3": 4}

    def test_copy_a_config(self):
        """copy() is a deep copy."""
        cfg = CN({"MODEL": {"IN_FEATURES": ["res3"]}})
        cfg_copy = cfg.copy()  # get a deepcopy of cfg
        cfg_copy.MODEL.IN_FEATURES.append("res4")
        assert cfg.MODEL.IN_FEATURES == ["res3"]
        assert isinstance(cfg_copy, CN) and isinstance(cfg_copy.MODEL, CN)

    def test_save_config_to_yaml_file(self, in_tmp):
        """save() takes a path or an open file; both read back equal, tuples included."""
        cfg = CN.open("example.yaml")
        cfg.save("example-save.yaml")
        assert CN.open("example-save.yaml") == cfg

        # or
        with open("example-save.yaml", "w", encoding="utf-8") as f:
            cfg.save(f)
        again = CN.open("example-save.yaml")
        assert again == cfg and isinstance(again.MODEL.INPUT_SIZE, tuple)


class TestCfgNode04:
    """0.4's CfgNode rules on top of easycore.CfgNode."""

    def test_is_an_easycore_cfgnode(self):
        """The 0.4 class is a subclass of easycore.CfgNode."""
        assert issubclass(CN, easycore.CfgNode)
        assert isinstance(CN(), easycore.CfgNode)

    def test_mutable_until_freeze(self):
        """Assignment works until freeze(); then every change raises FrozenError."""
        cfg = CN({"A": {"B": 1}})
        cfg.x = 1
        cfg.A.B = 2
        assert not cfg.is_frozen()
        cfg.freeze()
        assert cfg.is_frozen() and cfg.A.is_frozen()
        with pytest.raises(FrozenError):
            cfg.x = 2
        with pytest.raises(AttributeError):  # as in 0.4, where this was an AttributeError
            cfg.A.B = 3
        with pytest.raises(FrozenError):
            cfg.merge(CN({"x": 3}))
        cfg.freeze(False)
        cfg.x = 2
        assert cfg == {"A": {"B": 2}, "x": 2}

    def test_nested_nodes_keep_the_class(self):
        """Nested dicts, loaded YAML and copies are 0.4 nodes, mutable too."""
        cfg = CN({"A": {"B": {"C": 1}}})
        assert type(cfg.A.B) is CN
        assert type(CN.load("A: {B: 1}").A) is CN
        assert type(cfg.copy().A) is CN
        cfg.A.B.D = 2
        assert cfg.A.B == {"C": 1, "D": 2}

    def test_copy_keeps_frozen_state(self):
        """copy() of a frozen node is frozen, of a mutable node mutable."""
        cfg = CN({"A": 1})
        assert not cfg.copy().is_frozen()
        cfg.freeze()
        assert cfg.copy().is_frozen()

    def test_dump_load_roundtrip(self):
        """CN.dump(cfg) gives YAML text that CN.load reads back equal, tuples included."""
        cfg = CN({"SIZE": (224, 224), "ID": "123", "NAMES": ["a", "b"], "LR": 0.001})
        text = CN.dump(cfg)
        assert isinstance(text, str) and "SIZE: (224, 224)" in text
        assert cfg.dump() == text
        back = CN.load(text)
        assert back == cfg and isinstance(back, CN) and not back.is_frozen()
        out = io.StringIO()
        CN.dump(cfg, out)
        assert out.getvalue() == text

    def test_merge_replaces_a_value_with_a_node(self):
        """0.4's merge test: a node in the other config replaces a plain value."""
        cfg_a = CN()
        cfg_b = CN()
        cfg_a.A = 1
        cfg_a.B = 2
        cfg_b.B = CN()
        cfg_b.B.C = 3

        cfg_a.merge(cfg_b)
        assert cfg_a.A == 1
        assert isinstance(cfg_a.B, CN)
        assert cfg_a.B.C == 3

    def test_loading_stays_safe(self):
        """Unlike 0.4, a YAML tag that would run Python code is refused, not evaluated."""
        with pytest.raises(ValueError, match="python/object/apply:eval"):
            CN.load(UNSAFE_YAML)
        safe = UNSAFE_YAML.replace("  scale: !!python/object/apply:eval", "  scale:")
        cfg = CN.load(safe)
        assert cfg.app.client.user_number_range == (0, 100)
        assert cfg.app.client.version == "0.1.0"
        assert cfg.app.server.port == 8080

    def test_pickle_keeps_class_and_state(self):
        """Pickling keeps the 0.4 class, the content and the frozen state."""
        cfg = CN({"A": {"B": (1, 2)}})
        back = pickle.loads(pickle.dumps(cfg))
        assert type(back) is CN and back == cfg and not back.is_frozen()
        cfg.freeze()
        assert pickle.loads(pickle.dumps(cfg)).is_frozen()


class TestCfgNode042:
    """What 0.4.2 added to 0.4's CfgNode: dict(), str() as a dict, HierarchicalCfgNode."""

    def test_dict_is_plain_and_nested(self):
        """dict() gives plain dicts all the way down (0.4.2's own test_to_dict)."""
        cfg = CN()
        cfg.A = 1
        cfg.B = CN()
        cfg.B.C = 3
        out = cfg.dict()
        assert out == {"A": 1, "B": {"C": 3}}
        assert type(out) is dict and type(out["B"]) is dict

    def test_str_is_the_dict(self):
        """print(cfg) shows a dict, as in 0.4.2."""
        assert str(CN({"A": 1, "B": {"C": (1, 2)}})) == "{'A': 1, 'B': {'C': (1, 2)}}"

    def test_hierarchical_open_overrides_the_base(self, tmp_path):
        """A file's keys override its __BASE__'s, recursively, through a chain of bases."""
        from easycore.common.config import HierarchicalCfgNode

        (tmp_path / "sub").mkdir()
        (tmp_path / "c.yaml").write_text("C: from c\nD: {X: 1, Y: 2}\n")
        (tmp_path / "sub" / "b.yaml").write_text("__BASE__: ../c.yaml\nB: from b\nD: {Y: 3}\n")
        (tmp_path / "a.yaml").write_text("__BASE__: sub/b.yaml\nA: from a\nB: from a\n")
        cfg = HierarchicalCfgNode.open(str(tmp_path / "a.yaml"))
        assert cfg.dict() == {
            "C": "from c",
            "D": {"X": 1, "Y": 3},
            "B": "from a",
            "A": "from a",
        }
        assert isinstance(cfg, CN) and not cfg.is_frozen()

    def test_hierarchical_loop_and_missing_base(self, tmp_path):
        """A loop of bases is FileExistsError; a base that is not there, FileNotFoundError."""
        from easycore.common.config import HierarchicalCfgNode

        (tmp_path / "a.yaml").write_text("__BASE__: b.yaml\nA: 1\n")
        (tmp_path / "b.yaml").write_text("__BASE__: a.yaml\nB: 1\n")
        (tmp_path / "c.yaml").write_text("__BASE__: nowhere.yaml\n")
        with pytest.raises(FileExistsError):
            HierarchicalCfgNode.open(str(tmp_path / "a.yaml"))
        with pytest.raises(FileNotFoundError, match="nowhere"):
            HierarchicalCfgNode.open(str(tmp_path / "c.yaml"))

    def test_hierarchical_save_keeps_only_the_difference(self, tmp_path):
        """save(base_cfg_path=...) writes what differs from the base and a relative __BASE__,
        and opening it again gives the whole config."""
        from easycore.common.config import HierarchicalCfgNode

        (tmp_path / "base.yaml").write_text("A: 1\nB: {C: 2, D: 3}\n")
        cfg = CN({"A": 1, "B": {"C": 2, "D": 4}, "E": 5})
        (tmp_path / "out").mkdir()
        HierarchicalCfgNode.save(cfg, str(tmp_path / "out" / "x.yaml"), str(tmp_path / "base.yaml"))
        saved = CN.open(str(tmp_path / "out" / "x.yaml"))
        assert saved.dict() == {"B": {"D": 4}, "E": 5, "__BASE__": "../base.yaml"}
        assert HierarchicalCfgNode.open(str(tmp_path / "out" / "x.yaml")).dict() == cfg.dict()
