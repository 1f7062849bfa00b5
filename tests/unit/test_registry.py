"""Unit tests for Registry (contract section 5)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from easycore import CfgNode, Registry


class ResNet50:
    def __init__(self, depth: int = 50, head: Any = None) -> None:
        self.depth = depth
        self.head = head


class VGG:
    pass


@pytest.fixture
def models() -> Registry:
    return Registry("MODEL")


class TestRegister:
    def test_decorator_uses_name(self, models: Registry) -> None:
        """@REG.register() registers under __name__ and returns the object unchanged."""

        @models.register()
        class Net:
            pass

        assert isinstance(Net, type) and Net.__name__ == "Net"
        assert models.get("Net") is Net

    def test_decorator_with_name(self, models: Registry) -> None:
        """@REG.register("name") registers under the given name."""

        @models.register("tiny")
        def build_tiny() -> str:
            return "tiny"

        assert models.get("tiny") is build_tiny and build_tiny() == "tiny"

    def test_bare_decorator(self, models: Registry) -> None:
        """@REG.register without parentheses works too."""

        @models.register
        def fn() -> None:
            pass

        assert models.get("fn") is fn

    def test_call_forms(self, models: Registry) -> None:
        """register(name, obj) and register(obj=obj) return the object."""
        assert models.register("resnet", ResNet50) is ResNet50
        assert models.register(obj=VGG) is VGG
        assert models.get("resnet") is ResNet50 and models.get("VGG") is VGG

    def test_registered_names_in_order(self, models: Registry) -> None:
        """registered_names() lists names in registration order."""
        models.register("b", 2)
        models.register("a", 1)
        models.register(obj=VGG)
        assert models.registered_names() == ["b", "a", "VGG"]

    def test_taken_name(self, models: Registry) -> None:
        """Registering a taken name is a KeyError naming the registry and the name."""
        models.register("resnet", ResNet50)
        with pytest.raises(KeyError, match=r"'resnet'.*'MODEL' registry"):
            models.register("resnet", VGG)
        with pytest.raises(KeyError, match=r"'resnet'.*'MODEL'"):
            models.register("resnet")(VGG)
        assert models.get("resnet") is ResNet50

    def test_object_without_name(self, models: Registry) -> None:
        """An object without __name__ needs an explicit name (TypeError)."""
        with pytest.raises(TypeError, match="__name__"):
            models.register(obj=42)
        assert models.register("answer", 42) == 42

    def test_name_must_be_str(self, models: Registry) -> None:
        """A non-string name is a TypeError."""
        with pytest.raises(TypeError, match="strings"):
            models.register(3, VGG)


class TestGet:
    def test_unknown_name_lists_close_matches(self, models: Registry) -> None:
        """get of an unknown name is a KeyError naming the registry and close matches."""
        models.register("resnet", ResNet50)
        models.register(obj=VGG)
        with pytest.raises(KeyError, match=r"'resnt'.*'MODEL'.*did you mean 'resnet'") as info:
            models.get("resnt")
        assert "'VGG'" in str(info.value)  # few names: all are listed

    def test_many_names_not_all_listed(self, models: Registry) -> None:
        """With many names only the close matches are listed."""
        for i in range(50):
            models.register(f"model_{i}", i)
        with pytest.raises(KeyError, match="did you mean 'model_1'") as info:
            models.get("model_1x")
        assert "model_42" not in str(info.value)

    def test_empty_registry(self, models: Registry) -> None:
        """get on an empty registry says it is empty."""
        with pytest.raises(KeyError, match="empty"):
            models.get("x")


class TestBuild:
    def test_build_calls_with_other_keys(self, models: Registry) -> None:
        """build calls the registered object with the keys other than 'type'."""
        models.register("resnet", ResNet50)
        model = models.build({"type": "resnet", "depth": 101})
        assert isinstance(model, ResNet50) and model.depth == 101

    @pytest.mark.parametrize("frozen", [True, False])
    def test_build_from_cfgnode_unchanged(self, models: Registry, frozen: bool) -> None:
        """build accepts a (frozen or not) CfgNode and does not change it."""
        models.register("resnet", ResNet50)
        cfg = CfgNode({"type": "resnet", "depth": 18, "head": {"classes": 10}}, frozen=frozen)
        model = models.build(cfg)
        assert model.depth == 18 and model.head == {"classes": 10}
        assert cfg == {"type": "resnet", "depth": 18, "head": {"classes": 10}}
        assert cfg.is_frozen() is frozen

    def test_build_does_not_change_dict(self, models: Registry) -> None:
        """build leaves a plain dict as it was."""
        models.register("resnet", ResNet50)
        spec = {"type": "resnet", "depth": 34}
        models.build(spec)
        assert spec == {"type": "resnet", "depth": 34}

    def test_build_without_type(self, models: Registry) -> None:
        """A config without 'type' is a KeyError saying so."""
        with pytest.raises(KeyError, match=r"no 'type' key.*depth"):
            models.build({"depth": 50})

    def test_build_unknown_type(self, models: Registry) -> None:
        """An unknown 'type' is the KeyError of get, with close matches."""
        models.register("resnet", ResNet50)
        with pytest.raises(KeyError, match="did you mean 'resnet'"):
            models.build({"type": "resnet_"})

    def test_build_bad_input(self, models: Registry) -> None:
        """A non-mapping config or a non-string type is a TypeError."""
        with pytest.raises(TypeError, match="mapping"):
            models.build(["resnet"])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="registered name"):
            models.build({"type": ResNet50})


class TestProtocols:
    def test_contains_len_iter(self, models: Registry) -> None:
        """in, len and iteration work on names."""
        models.register("resnet", ResNet50)
        models.register(obj=VGG)
        assert "resnet" in models and "nope" not in models
        assert len(models) == 2
        assert list(models) == ["resnet", "VGG"]

    def test_iteration_is_a_snapshot(self, models: Registry) -> None:
        """Registering while iterating does not break the iteration."""
        models.register("a", 1)
        for name in models:
            models.register(name + "_copy", 2)
        assert models.registered_names() == ["a", "a_copy"]

    def test_repr_and_name(self, models: Registry) -> None:
        """repr shows the name and the registered names; .name is the name."""
        models.register("resnet", ResNet50)
        assert repr(models) == "Registry('MODEL', names=['resnet'])"
        assert models.name == "MODEL"

    def test_pickle(self, models: Registry) -> None:
        """A registry of importable objects pickles."""
        models.register("resnet", ResNet50)
        back = pickle.loads(pickle.dumps(models))
        assert back.get("resnet") is ResNet50 and back.name == "MODEL"
