"""Registry: a name -> object table, filled by a decorator and used to build from configs."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from easycore._errors import close_matches

__all__ = ["Registry"]

_T = TypeVar("_T")

# `get` lists every registered name when there are at most this many.
_LIST_ALL = 20


class Registry:
    """A named table of objects (classes, functions), registered by name.

    Args:
        name: what the registry holds, used in messages (``"MODEL"``).

    >>> MODELS = Registry("MODEL")
    >>> @MODELS.register()
    ... class ResNet:
    ...     def __init__(self, depth=50):
    ...         self.depth = depth
    >>> MODELS.get("ResNet") is ResNet
    True
    >>> MODELS.build({"type": "ResNet", "depth": 101}).depth
    101
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._objects: dict[str, Any] = {}

    @property
    def name(self) -> str:
        """The registry's name.

        >>> Registry("MODEL").name
        'MODEL'
        """
        return self._name

    def register(self, name: Any = None, obj: Any = None) -> Any:
        """Register ``obj`` under ``name`` (default: ``obj.__name__``); a decorator without ``obj``.

        Forms: ``@REG.register()``, ``@REG.register("name")``, bare ``@REG.register``,
        ``REG.register("name", obj)`` and ``REG.register(obj=obj)``. Returns the object (or,
        without one, the decorator), so decorated definitions stay what they were.

        Args:
            name: the name to register under.
            obj: the object; leave it out to get a decorator.

        Returns:
            ``obj``, or without it a decorator that registers and returns its argument.

        Raises:
            KeyError: the name is taken in this registry.
            TypeError: no name given and the object has no ``__name__``.

        >>> REG = Registry("DEMO")
        >>> REG.register("double", lambda x: 2 * x)("x")
        'xx'
        >>> REG.registered_names()
        ['double']
        """
        if obj is None and name is not None and not isinstance(name, str):
            return self._add(None, name)  # bare @REG.register
        return functools.partial(self._add, name) if obj is None else self._add(name, obj)

    def _add(self, name: str | None, obj: _T) -> _T:
        if name is None:
            name = getattr(obj, "__name__", None)
            if not isinstance(name, str):
                msg = f"{obj!r} has no __name__; register it with a name: register('name', obj)"
                raise TypeError(msg)
        elif not isinstance(name, str):
            msg = f"registry names are strings, got {name!r}"
            raise TypeError(msg)
        if name in self._objects:
            msg = (
                f"the name {name!r} is already taken in the {self._name!r} registry "
                f"(by {self._objects[name]!r}); register under another name"
            )
            raise KeyError(msg)
        self._objects[name] = obj
        return obj

    def get(self, name: str) -> Any:
        """The object registered under ``name``.

        Args:
            name: a registered name.

        Returns:
            The object.

        Raises:
            KeyError: no such name; the message lists close matches (and all names when few).

        >>> REG = Registry("DEMO")
        >>> REG.register("one", 1)
        1
        >>> REG.get("one")
        1
        """
        if name in self._objects:
            return self._objects[name]
        msg = f"no object named {name!r} in the {self._name!r} registry"
        msg += close_matches(name, self._objects)
        if not self._objects:
            msg += " (it is empty)"
        elif len(self._objects) <= _LIST_ALL:
            msg += f" (registered: {', '.join(map(repr, self._objects))})"
        raise KeyError(msg)

    def registered_names(self) -> list[str]:
        """Every registered name, in registration order.

        Returns:
            A new list of the names.

        >>> REG = Registry("DEMO")
        >>> _ = REG.register("b", 2), REG.register("a", 1)
        >>> REG.registered_names()
        ['b', 'a']
        """
        return list(self._objects)

    def build(self, cfg: Mapping[str, Any]) -> Any:
        """Call the object named by ``cfg["type"]`` with the other keys as keyword arguments.

        ``cfg`` is not changed (a frozen ``CfgNode`` works); nested nodes are passed as they
        are.

        Args:
            cfg: a mapping with a ``"type"`` key.

        Returns:
            What the registered object returned.

        Raises:
            KeyError: no ``"type"`` key, or an unknown name.
            TypeError: ``cfg`` is not a mapping or its ``"type"`` is not a string.

        >>> REG = Registry("DEMO")
        >>> _ = REG.register("pair", lambda a, b: (a, b))
        >>> REG.build({"type": "pair", "a": 1, "b": 2})
        (1, 2)
        """
        if not isinstance(cfg, Mapping):
            msg = f"build needs a mapping with a 'type' key, got {type(cfg).__name__}"
            raise TypeError(msg)
        if "type" not in cfg:
            msg = (
                f"cannot build from the {self._name!r} registry: the config has no 'type' "
                f"key naming what to build (keys: {list(cfg)!r})"
            )
            raise KeyError(msg)
        kind = cfg["type"]
        if not isinstance(kind, str):
            msg = f"the 'type' of a {self._name!r} config must be a registered name, got {kind!r}"
            raise TypeError(msg)
        factory: Callable[..., Any] = self.get(kind)
        return factory(**{key: value for key, value in cfg.items() if key != "type"})

    def __contains__(self, name: object) -> bool:
        return name in self._objects

    def __len__(self) -> int:
        return len(self._objects)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._objects))

    def __repr__(self) -> str:
        return f"Registry({self._name!r}, names={list(self._objects)!r})"
