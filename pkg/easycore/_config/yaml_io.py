"""YAML for :class:`~easycore.CfgNode`: its ``load``, ``open``, ``dump`` and ``save``
(:class:`YamlIO`).

Loading goes through a ``SafeLoader`` subclass (no Python objects are ever built from tags)
that refuses a key given twice in one mapping (PyYAML would keep the last one silently) and
adds two resolvers for plain (unquoted) scalars only:

* ``(224, 224)`` is a tuple (parsed with ``ast.literal_eval``), and tuples are written back in
  that form, so ``CfgNode.load(CfgNode.dump(c)) == c``;
* ``1e-3`` is a float (YAML 1.1 would read a string), the usual learning-rate surprise.

The dumper uses the same resolvers, so any string that would read back as something else
(``"(1, 2)"``, ``"123"``, ``"true"``, ``"1e-3"``, ``"null"``) is written quoted.
"""

from __future__ import annotations

import ast
import math
import os
import re
from collections.abc import Mapping
from typing import IO, Any, TypeVar

import yaml

from easycore._errors import short_repr

__all__ = ["YamlIO", "python_literal"]

_M = TypeVar("_M", bound="YamlIO")

_TUPLE_TAG = "tag:easycore,2020:python/tuple"
_TUPLE_RE = re.compile(r"^\(.*\)$", re.DOTALL)
# YAML 1.1 needs a dot in a float: without this `1e-3` would be the string "1e-3".
_EXP_FLOAT_RE = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")

# Built with type() and typed Any: subclassing an untyped yaml class (no types-PyYAML) would
# fail mypy --strict, and a `type: ignore` would be reported unused where the stubs exist.
# libyaml's parser when PyYAML has it (several times faster); the resolvers and
# constructors stay Python either way, so the result is the same.
_Loader: Any = type(
    "_Loader", (getattr(yaml, "CSafeLoader", yaml.SafeLoader),), {"__doc__": "SafeLoader + tuples."}
)
_Dumper: Any = type("_Dumper", (yaml.SafeDumper,), {"__doc__": "SafeDumper + tuples."})

for _cls in (_Loader, _Dumper):
    # Implicit resolvers only ever see plain scalars: quoted text always stays a string.
    _cls.add_implicit_resolver(_TUPLE_TAG, _TUPLE_RE, ["("])
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT_RE, list("-+.0123456789"))


def python_literal(text: str, default: Any) -> Any:
    """The Python literal ``text`` holds (``ast.literal_eval``), or ``default`` if none."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return default


def _construct_tuple(loader: Any, node: Any) -> Any:
    text = loader.construct_scalar(node)
    value = python_literal(text, text)
    return value if isinstance(value, tuple) else text


_Loader.add_constructor(_TUPLE_TAG, _construct_tuple)

_MERGE_TAG = "tag:yaml.org,2002:merge"


def _construct_mapping(loader: Any, node: Any, deep: bool = False) -> Any:
    """``SafeConstructor.construct_mapping``, refusing a key given twice in one mapping.

    PyYAML keeps the last of repeated keys without a word, so a setting written twice (two
    ``MODEL:`` blocks in a long file) would lose the first silently. Keys brought in by a
    ``<<`` merge may still be overridden: that is what a merge is for.
    """
    if isinstance(node, yaml.MappingNode):
        first: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                continue  # a collection key is unhashable: the constructor says so
            key = loader.construct_object(key_node)
            error = yaml.constructor.ConstructorError
            try:
                seen = first.setdefault(key, key_node)
            except TypeError:  # a tuple holding a list: (1, [2])
                problem = f"the key {short_repr(key)} is unhashable"
                raise error(None, None, problem, key_node.start_mark) from None
            if seen is not key_node:
                problem = (
                    f"duplicate key {short_repr(key)} (first on line {seen.start_mark.line + 1})"
                )
                problem += "; a key may appear once in a mapping"
                raise error(None, None, problem, key_node.start_mark)
    return yaml.constructor.SafeConstructor.construct_mapping(loader, node, deep=deep)


_Loader.construct_mapping = _construct_mapping


def _literal(value: Any) -> str:
    """Python literal text for ``value``; ValueError when it has none (a nan, an object).

    The text is ASCII, has no ``": "`` and no ``" #"``, so YAML can hold it as a plain scalar.
    """
    kind = type(value)
    if value is None or kind is bool or kind is int or (kind is float and not math.isnan(value)):
        return repr(value).replace("inf", "1e999")  # (literal_eval reads no "inf")
    if kind is str:  # ASCII (the rest escaped); the space of ": " and " #" escaped too
        return ascii(value).replace(": ", ":\\x20").replace(" #", "\\x20#")
    if kind is tuple or kind is list:
        body = ", ".join(_literal(v) for v in value)
        if kind is list:
            return f"[{body}]"
        return f"({body},)" if len(value) == 1 else f"({body})"
    if isinstance(value, dict):
        # "k:v" without a space: ": " would end a plain YAML scalar.
        return "{" + ", ".join(f"{_literal(k)}:{_literal(v)}" for k, v in value.items()) + "}"
    raise ValueError(value)


def _represent_tuple(dumper: Any, data: tuple[Any, ...]) -> Any:
    try:
        return dumper.represent_scalar(_TUPLE_TAG, _literal(data))
    except ValueError:  # e.g. holds a nan: written as a YAML list
        return dumper.represent_list(data)


def _block_around_tuples(represent: Any) -> Any:
    """``represent`` (of a sequence or a mapping), making block style every collection that
    holds a tuple scalar, or a collection made block for one: a plain ``(a, b)`` cannot sit
    inside a flow collection (its commas would split it)."""

    def represent_collection(dumper: Any, tag: str, value: Any, flow_style: Any = None) -> Any:
        node = represent(dumper, tag, value, flow_style)
        pairs = node.value if isinstance(node, yaml.MappingNode) else [(c,) for c in node.value]
        children = [c for pair in pairs for c in pair]
        if any(c.tag == _TUPLE_TAG or getattr(c, "flow_style", None) is False for c in children):
            node.flow_style = False
        return node

    return represent_collection


def _represent_str(dumper: Any, data: str) -> Any:
    # YAML 1.1 line breaks besides "\n": PyYAML writes them raw (allow_unicode) in plain or
    # single-quoted text, where reading folds them into spaces; double quotes escape them.
    if re.search("[\x85\u2028\u2029]", data):
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style='"')
    return dumper.represent_str(data)


_Dumper.represent_sequence = _block_around_tuples(yaml.SafeDumper.represent_sequence)
_Dumper.represent_mapping = _block_around_tuples(yaml.SafeDumper.represent_mapping)
_Dumper.add_representer(str, _represent_str)
_Dumper.add_representer(tuple, _represent_tuple)
_Dumper.add_multi_representer(dict, yaml.SafeDumper.represent_dict)  # (CfgNode)
# Subclasses of the builtin scalars (numpy.float64, IntEnum, str enums) as their base value.
_Dumper.add_multi_representer(float, lambda d, x: d.represent_float(float(x)))
_Dumper.add_multi_representer(int, lambda d, x: d.represent_int(int(x)))
_Dumper.add_multi_representer(str, lambda d, x: _represent_str(d, str(x)))


def _read(stream: str | bytes | IO[Any], name: str) -> Any:
    """The mapping of the YAML document in ``stream`` (an empty dict for an empty document).

    Raises:
        ValueError: malformed YAML, a refused tag, a key given twice in one mapping or a top
            level that is not a mapping; the message starts with ``NAME:LINE:COLUMN``.
    """
    loader = None
    try:
        loader = _Loader(stream)
        node = loader.get_single_node()
        if node is None or node.tag == "tag:yaml.org,2002:null":  # "", "---", "~"
            data: Any = {}
        elif isinstance(node, yaml.MappingNode):
            data = loader.construct_document(node)
        else:
            data = node
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark  # NAME:LINE:COLUMN: what went wrong
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else name
        context = err.context
        if context and err.context_mark is not None and err.context_mark is not mark:
            context += f" (line {err.context_mark.line + 1})"
        text = "; ".join(str(part) for part in (context, err.problem) if part)
        if isinstance(err, yaml.constructor.ConstructorError) and "for the tag" in text:
            text += " (CfgNode loads plain YAML only: tags that build Python objects are refused)"
        raise ValueError(f"{where}: {text}") from err
    except (yaml.YAMLError, ValueError, OverflowError) as err:
        # ReaderError (a control character), or a constructor failing on a value such
        # as the date 2024-13-45: no line is known.
        msg = f"{name}: invalid YAML: {' '.join(str(err).split())}"
        raise ValueError(msg) from err
    finally:
        if loader is not None:
            loader.dispose()
    if isinstance(data, yaml.Node):
        kind = "a list" if isinstance(data, yaml.SequenceNode) else "a scalar"
        msg = (
            f"{name}:{data.start_mark.line + 1}: the top level of a config must be a "
            f"mapping of KEY: value lines, got {kind}"
        )
        raise ValueError(msg)
    return data


class YamlIO:
    """``load``, ``open``, ``dump`` and ``save`` of :class:`~easycore.CfgNode`: a mapping
    class built from a loaded document as ``cls(mapping, copy=False)``."""

    __slots__ = ()

    @classmethod
    def load(cls: type[_M], yaml_str: str | bytes) -> _M:
        """Build a config from YAML text.

        Safe: tags that build Python objects are refused. An unquoted ``(1, 2)`` is a tuple;
        an empty document is an empty config.

        Args:
            yaml_str: the YAML text.

        Returns:
            A new frozen node.

        Raises:
            ValueError: malformed YAML, a refused tag, a key given twice in one mapping or a
                top level that is not a mapping; the message starts with
                ``<string>:LINE:COLUMN``.

        >>> from easycore import CfgNode
        >>> CfgNode.load("INPUT_SIZE: (224, 224)\\nNAME: '(1, 2)'")
        CfgNode({'INPUT_SIZE': (224, 224), 'NAME': '(1, 2)'}, frozen=True)
        """
        return cls(_read(yaml_str, "<string>"), copy=False)  # type: ignore[call-arg]

    @classmethod
    def open(
        cls: type[_M], path_or_file: str | os.PathLike[str] | IO[Any], encoding: str = "utf-8"
    ) -> _M:
        """Load a config from a YAML file (a path or an open file).

        Args:
            path_or_file: a path, or a file object opened for reading.
            encoding: the encoding of a file opened from a path.

        Returns:
            A new frozen node.

        Raises:
            FileNotFoundError: no file at that path.
            ValueError: as for :meth:`load`, the message starting with ``PATH:LINE:COLUMN``.

        >>> import io
        >>> from easycore import CfgNode
        >>> CfgNode.open(io.StringIO("A: {B: 1}")).A.B
        1
        """
        if isinstance(path_or_file, (str, os.PathLike)):
            with open(os.fspath(path_or_file), encoding=encoding) as file:
                return cls.open(file)  # (named by its path)
        name = str(getattr(path_or_file, "name", "<stream>"))
        return cls(_read(path_or_file, name), copy=False)  # type: ignore[call-arg]

    def dump(self, stream: IO[Any] | None = None, **yaml_kwargs: Any) -> Any:
        """Write the config as YAML; return it as a string when ``stream`` is None.

        Also callable as ``CfgNode.dump(cfg, stream=None, **yaml_kwargs)``. Keys keep their
        order, tuples are written ``(a, b)``, strings that would read back as another type
        are quoted. The output also loads with plain ``yaml.safe_load`` (tuples then come
        back as strings).

        Args:
            stream: a text file to write to, or None.
            **yaml_kwargs: options for ``yaml.dump`` (``sort_keys``, ``indent``, ``width``...).

        Returns:
            The YAML text when ``stream`` is None (bytes if ``encoding`` is given), else None.

        Raises:
            TypeError: a value YAML cannot represent (only str, int, float, bool, None,
                lists, tuples, dicts and the other YAML safe types can).

        >>> from easycore import CfgNode
        >>> print(CfgNode.dump(CfgNode({"SIZE": (224, 224), "ID": "123"})), end="")
        SIZE: (224, 224)
        ID: '123'
        """
        if not isinstance(self, Mapping):
            msg = f"dump needs a config (a mapping), got {type(self).__name__}: {short_repr(self)}"
            raise TypeError(msg)
        options = {"sort_keys": False, "allow_unicode": True, "default_flow_style": False}
        data = self if isinstance(self, dict) else dict(self)
        try:
            return yaml.dump(data, stream, Dumper=_Dumper, **{**options, **yaml_kwargs})
        except yaml.representer.RepresenterError as err:
            value = err.args[1] if len(err.args) > 1 else None
            msg = (
                f"cannot write {short_repr(value)} (type {type(value).__name__}) as YAML; a config "
                "holds str, int, float, bool, None, lists, tuples and dicts"
            )
            raise TypeError(msg) from err

    def save(
        self,
        path_or_file: str | os.PathLike[str] | IO[Any],
        encoding: str = "utf-8",
        **yaml_kwargs: Any,
    ) -> None:
        """Write the config as YAML to a path or an open text file.

        Args:
            path_or_file: where to write.
            encoding: the encoding of a file opened from a path.
            **yaml_kwargs: options for :meth:`dump`.

        >>> import io
        >>> from easycore import CfgNode
        >>> out = io.StringIO()
        >>> CfgNode({"A": 1}).save(out)
        >>> out.getvalue()
        'A: 1\\n'
        """
        if isinstance(path_or_file, (str, os.PathLike)):
            with open(os.fspath(path_or_file), "w", encoding=encoding) as file:
                self.dump(file, **yaml_kwargs)
        else:
            self.dump(path_or_file, **yaml_kwargs)
