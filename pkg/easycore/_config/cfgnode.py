"""CfgNode: a config tree with attribute access, frozen by default, saved as YAML.

A ``CfgNode`` is a ``dict`` whose nested dicts (also those inside lists and tuples) are
``CfgNode`` s too. ``freeze()`` and ``unfrozen()`` set every node of the tree at once; a
frozen node refuses every mutation with :class:`~easycore.FrozenError`, so a config handed to
workers cannot drift. (Lists in the tree stay plain lists: only the nodes are guarded.)

YAML is read and written by :mod:`easycore._config.yaml_io` (safe, tuples as ``(224, 224)``, a key
given twice refused).
"""

from __future__ import annotations

import contextlib
import copy as _copy
import difflib
import functools
import reprlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from easycore._config.yaml_io import YamlIO, python_literal
from easycore._errors import FrozenError, close_matches, did_you_mean, short_repr

__all__ = ["CfgNode"]

_N = TypeVar("_N", bound="CfgNode")

# Leaf types that are immutable: never deep-copied, never walked.
_ATOMIC = frozenset({str, int, float, bool, type(None), bytes, complex})
_MISSING: Any = object()


# ``repr`` for messages: a few items of a few levels. Bounded in time as well as in length,
# unlike cutting a full ``repr``: a tree built from YAML aliases can be far too big to print.
_brief = reprlib.Repr()
_brief.maxlevel = 3
_brief.maxdict = _brief.maxlist = _brief.maxtuple = _brief.maxset = _brief.maxfrozenset = 4
_brief.maxstring = _brief.maxother = _brief.maxlong = 60
_brief.repr_CfgNode = _brief.repr_dict  # type: ignore[attr-defined]  # (by the class's name)
# A short repr of a value for an error message, at most 80 characters.
_show = functools.partial(short_repr, as_text=_brief.repr)


def _restore(cls: type[_N], items: dict[str, Any], frozen: bool) -> _N:
    """A node holding ``items``, made without ``__init__`` and ``__setitem__`` (which a frozen
    node refuses): for pickling and copying."""
    node = cls.__new__(cls)
    object.__setattr__(node, "_frozen", frozen)
    dict.update(node, items)
    return node


def _plain(value: Any) -> Any:
    """The tree as builtin dicts, lists and tuples (for ``repr``)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    return value


def _convert(cls: type[CfgNode], value: Any, copy: bool, frozen: bool, memo: dict[int, Any]) -> Any:
    """Rebuild ``value`` with dicts turned into nodes of ``cls``.

    ``memo`` maps ids of already converted containers to their result (as in
    ``copy.deepcopy``), so a container shared through YAML aliases is converted once.
    """
    kind = type(value)
    if kind in _ATOMIC:
        return value
    done = memo.get(id(value), _MISSING)
    if done is not _MISSING:
        return done
    # Keep the source alive while its id is a memo key (copy.deepcopy does the same).
    memo.setdefault(id(memo), []).append(value)
    if isinstance(value, dict):
        node = memo[id(value)] = _restore(cls, {}, frozen)
        for k, v in value.items():
            dict.__setitem__(node, k, _convert(cls, v, copy, frozen, memo))
        return node
    if kind is list:
        out: list[Any] = []
        memo[id(value)] = out
        out.extend(_convert(cls, v, copy, frozen, memo) for v in value)
        return out
    if kind is tuple:
        tup = memo[id(value)] = tuple(_convert(cls, v, copy, frozen, memo) for v in value)
        return tup
    return _copy.deepcopy(value, memo) if copy else value


def _set(node: CfgNode, items: Iterable[tuple[Any, Any]], copy: bool, frozen: bool) -> None:
    """Set ``items`` in ``node`` (already checked mutable), their dicts made nodes."""
    memo: dict[int, Any] = {}
    for key, value in items:
        dict.__setitem__(node, key, _convert(type(node), value, copy, frozen, memo))


def _set_frozen(tree: CfgNode, frozen: bool) -> None:
    """Freeze or unfreeze every node of ``tree`` (also those inside lists and tuples)."""
    stack: list[Any] = [tree]
    seen: set[int] = set()
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, CfgNode):
            object.__setattr__(value, "_frozen", frozen)
            value = dict.values(value)
        stack.extend(c for c in value if isinstance(c, (dict, list, tuple)))


def _merge(node: CfgNode, other: Mapping[str, Any]) -> None:
    """Override ``node`` with ``other``, recursively (sub-nodes on both sides merge)."""
    node._check_mutable("merge into")
    for key, value in other.items():
        current = dict.get(node, key, _MISSING)
        if isinstance(current, CfgNode) and isinstance(value, Mapping):
            _merge(current, value)
        else:
            _set(node, [(key, value)], True, node._frozen)


def _merged(node: _N, base: Any, top: Any) -> _N:
    """A new tree of ``node``'s class and frozen state: a deep copy of ``base`` merged with
    ``top`` (NotImplemented when either is not a mapping)."""
    if not isinstance(base, Mapping) or not isinstance(top, Mapping):
        return NotImplemented  # type: ignore[no-any-return]  # (for | and its reflection)
    result: _N = _convert(type(node), dict(base), True, False, {})
    _merge(result, top)
    _set_frozen(result, node._frozen)
    return result


class CfgNode(dict[str, Any], YamlIO):
    """A config tree: a ``dict`` with attribute access, frozen by default.

    Args:
        init_dict: a possibly nested mapping; nested dicts (also inside lists and tuples)
            become ``CfgNode`` s.
        copy: deep-copy the leaf values of ``init_dict`` (the tree structure is always new).
            ``False`` shares leaves, e.g. large arrays.
        frozen: whether the new tree refuses changes.

    >>> cfg = CfgNode({"MODEL": {"DEPTH": 50}, "INPUT_SIZE": (224, 224)})
    >>> cfg.MODEL.DEPTH
    50
    >>> cfg.is_frozen()
    True
    >>> with cfg.unfrozen():
    ...     cfg.MODEL.DEPTH = 101
    >>> cfg["MODEL"]["DEPTH"]
    101
    """

    __slots__ = ("_frozen",)
    _frozen: bool

    def __init__(
        self, init_dict: Mapping[str, Any] | None = None, copy: bool = True, frozen: bool = True
    ) -> None:
        object.__setattr__(self, "_frozen", frozen)  # (dict's own __init__ adds nothing here)
        if init_dict is None:
            return
        if not isinstance(init_dict, Mapping):
            msg = f"CfgNode needs a mapping, got {type(init_dict).__name__}: {_show(init_dict)}"
            raise TypeError(msg)
        _set(self, init_dict.items(), copy, frozen)

    def freeze(self, frozen: bool = True) -> None:
        """Freeze (or, with ``frozen=False``, unfreeze) this node and every node below it.

        Args:
            frozen: the new state.

        >>> cfg = CfgNode({"A": [{"B": 1}]}, frozen=False)
        >>> cfg.freeze()
        >>> cfg.A[0].is_frozen()
        True
        """
        _set_frozen(self, frozen)

    def is_frozen(self) -> bool:
        """Whether this node refuses changes.

        Returns:
            True when frozen.

        >>> CfgNode().is_frozen(), CfgNode(frozen=False).is_frozen()
        (True, False)
        """
        return self._frozen

    @contextlib.contextmanager
    def unfrozen(self: _N) -> Iterator[_N]:
        """Make the tree mutable inside a ``with`` block; restore its previous state after.

        The state is restored even when the block raises.

        Yields:
            This node, mutable.

        >>> cfg = CfgNode({"LR": 0.1})
        >>> with cfg.unfrozen():
        ...     cfg.LR = 0.01
        >>> cfg.LR, cfg.is_frozen()
        (0.01, True)
        """
        previous = self._frozen
        self.freeze(False)
        try:
            yield self
        finally:
            self.freeze(previous)

    def _check_mutable(self, action: str) -> None:
        if self._frozen:
            msg = (
                f"cannot {action}: this CfgNode is frozen; change it inside "
                "`with cfg.unfrozen():` or call `cfg.freeze(False)` first"
            )
            raise FrozenError(msg)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails. Dunders must fail fast so copy, pickle and
        # friends probing for __deepcopy__, __getstate__... see a plain AttributeError.
        if name[:2] == "__" and name[-2:] == "__":
            raise AttributeError(name)
        if name in self:
            return self[name]
        msg = f"{type(self).__name__} has no key or attribute {name!r}{close_matches(name, self)}"
        raise AttributeError(msg)

    def __setattr__(self, name: str, value: Any) -> None:
        self._check_mutable(f"set {name!r}")
        if hasattr(type(self), name):
            msg = (
                f"{name!r} is a {type(self).__name__} attribute and cannot be set as a key "
                f"this way; use cfg[{name!r}] = ..."
            )
            raise AttributeError(msg)
        self[name] = value

    def __delattr__(self, name: str) -> None:
        self._check_mutable(f"delete {name!r}")
        if name not in self:
            msg = f"{type(self).__name__} has no key {name!r}{close_matches(name, self)}"
            raise AttributeError(msg)
        del self[name]

    def __dir__(self) -> list[str]:
        keys = {k for k in self if isinstance(k, str) and k.isidentifier()}
        return sorted(set(super().__dir__()) | keys)

    def __setitem__(self, key: str, value: Any) -> None:
        self._check_mutable(f"set {key!r}")
        _set(self, [(key, value)], False, False)

    def __delitem__(self, key: str) -> None:
        self._check_mutable(f"delete {key!r}")
        dict.__delitem__(self, key)

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Set keys like ``dict.update`` (not recursive; see :meth:`merge`).

        Args:
            *args: a mapping or an iterable of ``(key, value)`` pairs, as for ``dict``.
            **kwargs: more keys and values.

        Raises:
            FrozenError: the node is frozen.

        >>> cfg = CfgNode(frozen=False)
        >>> cfg.update({"A": {"B": 1}})
        >>> cfg.A.B
        1
        """
        self._check_mutable("update")
        _set(self, dict(*args, **kwargs).items(), False, False)

    def pop(self, *args: Any) -> Any:
        """Remove a key and return its value, like ``dict.pop``.

        Args:
            *args: the key, and optionally a default returned when it is missing.

        Returns:
            The value removed (or the default).

        Raises:
            FrozenError: the node is frozen.
            KeyError: the key is missing and no default was given.

        >>> CfgNode({"A": 1}, frozen=False).pop("A")
        1
        """
        self._check_mutable("pop")
        return dict.pop(self, *args)

    def popitem(self) -> tuple[str, Any]:
        """Remove and return the last ``(key, value)`` pair, like ``dict.popitem``.

        Returns:
            The pair removed.

        Raises:
            FrozenError: the node is frozen.
            KeyError: the node is empty.

        >>> CfgNode({"A": 1}, frozen=False).popitem()
        ('A', 1)
        """
        self._check_mutable("popitem")
        return dict.popitem(self)

    def setdefault(self, key: str, default: Any = None) -> Any:
        """Return ``self[key]``, setting it to ``default`` first if missing.

        Refused on a frozen node even when the key exists: it is a writing method.

        Args:
            key: the key.
            default: the value to set when ``key`` is missing (dicts become nodes).

        Returns:
            The value now under ``key``.

        Raises:
            FrozenError: the node is frozen.

        >>> CfgNode(frozen=False).setdefault("A", {"B": 1})
        CfgNode({'B': 1}, frozen=False)
        """
        self._check_mutable("setdefault")
        if key not in self:
            _set(self, [(key, default)], False, False)
        return self[key]

    def clear(self) -> None:
        """Remove every key.

        Raises:
            FrozenError: the node is frozen.

        >>> cfg = CfgNode({"A": 1}, frozen=False)
        >>> cfg.clear()
        >>> cfg
        CfgNode({}, frozen=False)
        """
        self._check_mutable("clear")
        dict.clear(self)

    def __ior__(self, other: Any) -> CfgNode:  # type: ignore[override]
        self._check_mutable("merge into (|=)")
        if not isinstance(other, Mapping):
            return NotImplemented
        _merge(self, other)
        return self

    @classmethod
    def fromkeys(cls, iterable: Iterable[Any], value: Any = None) -> Any:
        """A new node with keys from ``iterable``, each set to ``value``.

        Args:
            iterable: the keys.
            value: the value of every key.

        Returns:
            A new (frozen) node.

        >>> CfgNode.fromkeys(["A", "B"], 0)
        CfgNode({'A': 0, 'B': 0}, frozen=True)
        """
        return cls(dict.fromkeys(iterable, value))

    def copy(self: _N) -> _N:
        """Deep copy, keeping the frozen state.

        Returns:
            A new tree sharing nothing mutable with this one.

        >>> cfg = CfgNode({"A": {"B": [1]}})
        >>> other = cfg.copy()
        >>> other == cfg and other.A is not cfg.A and other.is_frozen()
        True
        """
        return _copy.deepcopy(self)

    def __deepcopy__(self: _N, memo: dict[int, Any]) -> _N:
        node: _N = _convert(type(self), self, True, self._frozen, memo)
        return node

    def __reduce__(self) -> tuple[Any, ...]:  # (copy.copy too: a node sharing the children)
        return (_restore, (type(self), dict(self), self._frozen))

    def merge(self, other: Mapping[str, Any]) -> None:
        """Override this node in place with ``other``, recursively.

        Sub-nodes present on both sides are merged; any other value of ``other`` replaces
        (a deep copy of it). New keys are added.

        Args:
            other: a mapping (``CfgNode`` or plain dict).

        Raises:
            FrozenError: this node is frozen.

        >>> cfg = CfgNode({"MODEL": {"DEPTH": 50, "WIDTH": 64}}, frozen=False)
        >>> cfg.merge({"MODEL": {"DEPTH": 101}})
        >>> cfg.MODEL
        CfgNode({'DEPTH': 101, 'WIDTH': 64}, frozen=False)
        """
        if not isinstance(other, Mapping):
            msg = f"merge needs a mapping, got {type(other).__name__}"
            raise TypeError(msg)
        _merge(self, other)

    def __or__(self: _N, other: Any) -> _N:  # type: ignore[override]
        return _merged(self, self, other)

    def __ror__(self: _N, other: Any) -> _N:  # type: ignore[override]
        return _merged(self, other, self)

    def merge_from_list(self, overrides: Sequence[Any]) -> None:
        """Apply ``["KEY.PATH", "value", ...]`` overrides, as given on a command line.

        Values are parsed with ``ast.literal_eval`` (text that does not parse stays a
        string). A value must keep the key's type, except that ``None`` may replace or be
        replaced by anything, an int may go into a float key (converted), a list and a tuple
        may replace each other (converted to the current type), ``true``/``false`` work for
        bool keys, and a string key takes the text as given. Nothing changes unless every
        pair is valid.

        A key may itself hold dots (``{"lr.base": 0.1}``): at each level the longest run of
        the override's parts that names a key is taken first, then shorter ones, so
        ``"lr.base"`` sets the key ``"lr.base"`` where the node has one and ``lr`` -> ``base``
        where it has not (a nested path is used only when the whole key leads somewhere).

        Args:
            overrides: alternating dotted keys and values.

        Raises:
            ValueError: an odd number of items.
            KeyError: a key that does not exist (the message names close matches among the
                keys of the node addressed).
            TypeError: a value of another type than the current one.
            FrozenError: this node is frozen.

        >>> cfg = CfgNode({"MODEL": {"DEPTH": 50}, "LR": 0.1}, frozen=False)
        >>> cfg.merge_from_list(["MODEL.DEPTH", "101", "LR", "1"])
        >>> cfg.MODEL.DEPTH, cfg.LR
        (101, 1.0)
        >>> cfg = CfgNode({"OPT": {"lr.base": 0.1}}, frozen=False)
        >>> cfg.merge_from_list(["OPT.lr.base", "0.5"])
        >>> cfg.OPT["lr.base"]
        0.5
        """
        if isinstance(overrides, (str, bytes)) or len(overrides) % 2:
            msg = (
                "merge_from_list needs a list of KEY, VALUE pairs "
                f"(an even number of items), got {_show(overrides)}"
            )
            raise ValueError(msg)
        self._check_mutable("merge_from_list")
        plan: list[tuple[CfgNode, str, Any]] = []
        for key, raw in zip(overrides[0::2], overrides[1::2], strict=True):
            node, leaf = _find(self, key)
            plan.append((node, leaf, _coerce(key, node[leaf], raw)))
        for node, leaf, value in plan:
            _merge(node, {leaf: value})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_plain(self)!r}, frozen={self._frozen})"

    def __str__(self) -> str:
        try:
            return str(self.dump())
        except TypeError:
            return repr(self)


def _find(root: CfgNode, key: Any) -> tuple[CfgNode, str]:
    """The node holding dotted ``key`` and the last part of it."""
    if not isinstance(key, str):
        msg = f"config keys are dotted strings like 'MODEL.DEPTH', got {_show(key)}"
        raise TypeError(msg)
    parts = key.split(".")
    found = _resolve(root, parts)
    if found is not None:
        return found
    node: Any = root  # not found: walk it part by part to say where it fails
    depth = 0  # (the walk stops short of the end: _resolve would have found that path)
    while isinstance(node, CfgNode) and parts[depth] in node:
        node, depth = dict.get(node, parts[depth]), depth + 1
    if isinstance(node, CfgNode):
        where = _show(".".join(parts[: depth + 1]))
        msg = f"unknown config key {_show(key)}: {where} does not exist"
        raise KeyError(msg + _suggest(node, parts[:depth], parts[depth], parts[depth + 1 :]))
    where = _show(".".join(parts[:depth]))
    msg = f"unknown config key {_show(key)}: {where} is not a config node, it holds {_show(node)}"
    raise KeyError(msg)


def _resolve(node: CfgNode, parts: list[str]) -> tuple[CfgNode, str] | None:
    """The node and key that the dotted ``parts`` name, or None: at each level the longest
    run of parts that is a key (keys may hold dots) is tried first, then shorter ones."""
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        if name not in node:
            continue
        if cut == len(parts):
            return node, name
        child = dict.get(node, name)
        found = _resolve(child, parts[cut:]) if isinstance(child, CfgNode) else None
        if found is not None:
            return found
    return None


def _suggest(node: CfgNode, parents: list[str], part: str, rest: list[str]) -> str:
    """``"; did you mean 'A.B.C'?"`` for ``part``, missing from ``node`` (at ``parents``).

    Only ``node``'s own keys are compared: a tree built from YAML aliases can have more
    dotted keys than memory holds. A match under which ``rest`` (the key's remaining parts)
    exists is shown with it, so ``MODLE.DEPTH`` suggests ``'MODEL.DEPTH'``; a key holding
    dots is compared with all of ``part`` and ``rest``, so ``lr.bas`` suggests ``'lr.base'``.
    """
    names = [k for k in node if isinstance(k, str)]
    whole = difflib.get_close_matches(".".join([part, *rest]), [k for k in names if "." in k])
    found = [".".join([*parents, match]) for match in whole]
    for match in difflib.get_close_matches(part, names):
        below: Any = dict.get(node, match)
        for name in rest:
            below = dict.get(below, name, _MISSING) if isinstance(below, CfgNode) else _MISSING
        found.append(".".join([*parents, match, *(rest if below is not _MISSING else [])]))
    return did_you_mean(found)


def _coerce(key: str, current: Any, raw: Any) -> Any:
    """Parse an override and check it against the key's current value."""
    value = python_literal(raw, raw) if isinstance(raw, str) else raw
    if current is None or value is None or type(value) is type(current):
        return value
    if isinstance(current, str) and isinstance(raw, str):
        return raw  # a string key takes the text as typed: NAME 123 means "123"
    if type(current) is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if type(current) is float and type(value) is int:
        return float(value)
    if isinstance(current, (list, tuple)) and isinstance(value, (list, tuple)):
        return type(current)(value)
    if isinstance(current, dict) and isinstance(value, dict):
        return value
    msg = (
        f"cannot override {_show(key)} with {_show(raw)}: that is of type "
        f"{type(value).__name__}, the key holds {_show(current)} of type {type(current).__name__}"
    )
    raise TypeError(msg)
