"""easycore.common.registry.Registry: 0.4's registry tutorial and 0.4's method names."""

from __future__ import annotations

import pytest

import easycore
from easycore.common.registry import Registry


@pytest.fixture
def MODEL_REGISTRY():
    """A fresh registry for each test: the tutorial's alternatives register the same names."""
    MODEL_REGISTRY = Registry("MODEL")
    return MODEL_REGISTRY


class TestRegistryTutorial:
    """The code of 0.4's docs/source/tutorials/registry.md; each "or" runs on its own."""

    def test_register_with_its_name_by_decorator(self, MODEL_REGISTRY):
        """@register() registers a class under its __name__."""

        @MODEL_REGISTRY.register()
        class ResNet50:
            pass

        model_class = MODEL_REGISTRY.get("ResNet50")
        assert model_class is ResNet50

    def test_register_with_its_name_by_call(self, MODEL_REGISTRY):
        """register(obj=...) registers an object under its __name__."""

        class ResNet50:
            pass

        MODEL_REGISTRY.register(obj=ResNet50)
        assert MODEL_REGISTRY.get("ResNet50") is ResNet50

    def test_register_with_a_name_by_decorator(self, MODEL_REGISTRY):
        """@register("resnet") registers under the given name."""

        @MODEL_REGISTRY.register("resnet")
        class RestNet50:
            pass

        model_class = MODEL_REGISTRY.get("resnet")
        assert model_class is RestNet50

    def test_register_with_a_name_by_call(self, MODEL_REGISTRY):
        """register("resnet", obj) registers under the given name."""

        class ResNet50:
            pass

        MODEL_REGISTRY.register("resnet", ResNet50)
        assert MODEL_REGISTRY.get("resnet") is ResNet50


class TestRegistry04:
    def test_is_the_new_registry(self):
        """The 0.4 path gives an easycore.Registry, with build and the rest."""
        reg = Registry("MODEL")
        assert isinstance(reg, easycore.Registry)
        reg.register("pair", lambda a, b: (a, b))
        assert reg.build({"type": "pair", "a": 1, "b": 2}) == (1, 2)

    def test_get_registered_names(self):
        """0.4's get_registered_names lists every name, in registration order."""
        FUNC_REGISTRY = Registry("func")

        @FUNC_REGISTRY.register()
        def A():
            pass

        @FUNC_REGISTRY.register("B")
        def B_impl():
            pass

        def C():
            pass

        FUNC_REGISTRY.register(obj=C)
        FUNC_REGISTRY.register("D", C)

        assert FUNC_REGISTRY.get_registered_names() == ["A", "B", "C", "D"]
        assert FUNC_REGISTRY.get_registered_names() == FUNC_REGISTRY.registered_names()

    def test_taken_and_unknown_names_are_key_errors(self):
        """As in 0.4, registering a taken name and getting an unknown one raise KeyError."""
        reg = Registry("MODEL")
        reg.register("resnet", object)
        with pytest.raises(KeyError, match="resnet"):
            reg.register("resnet", int)
        with pytest.raises(KeyError, match="vgg"):
            reg.get("vgg")
