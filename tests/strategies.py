"""Hypothesis strategies for config trees.

Imported as ``from strategies import ...`` (``tests/conftest.py`` puts this folder on
``sys.path``).
"""

from __future__ import annotations

import keyword
import string
from typing import Any

from hypothesis import strategies as st

from easycore import CfgNode

# A key must not hide a CfgNode attribute (cfg.copy is the method), nor be a dunder.
RESERVED = frozenset(dir(CfgNode))

# Strings that YAML or Python would read as something else if written unquoted.
TRICKY_STRINGS = (
    "(1, 2)",
    "(224, 224)",
    "()",
    "(1,)",
    "('a', 'b')",
    "(a, b)",
    "(1)",
    "123",
    "-7",
    "0x1F",
    "0o17",
    "010",
    "1_000",
    "1.5",
    "1e-3",
    "1E5",
    ".5",
    ".inf",
    "-.inf",
    ".nan",
    "inf",
    "nan",
    "true",
    "False",
    "yes",
    "No",
    "on",
    "OFF",
    "null",
    "Null",
    "~",
    "",
    " ",
    " leading",
    "trailing ",
    "a: b",
    "a #b",
    "#comment",
    "- item",
    "[1, 2]",
    "{a: 1}",
    "!!python/object/apply:os.system",
    "&anchor",
    "*alias",
    "'quoted'",
    '"double"',
    "multi\nline",
    "tab\there",
    "12:30:00",
    "2024-01-01",
    "<<",
    "=",
    "héllo wörld",
)

_FIRST = string.ascii_letters + "_"
_REST = _FIRST + string.digits
# Mostly a small pool (so merged trees share keys), sometimes any identifier-like key.
_KEY_POOL = ("A", "B", "C", "MODEL", "DEPTH", "INPUT_SIZE", "lr", "name", "x", "y_1", "_p")

key_names = st.one_of(
    st.sampled_from(_KEY_POOL),
    st.builds(str.__add__, st.sampled_from(_FIRST), st.text(_REST, max_size=8)).filter(
        lambda k: (
            k not in RESERVED
            and not (k.startswith("__") and k.endswith("__"))
            and not keyword.iskeyword(k)
        )
    ),
)

texts = st.one_of(
    st.sampled_from(TRICKY_STRINGS),
    st.text(alphabet=string.printable, max_size=20),
    st.text(max_size=12),
)

finite_floats = st.floats(allow_nan=False, allow_infinity=False)

scalars = st.one_of(
    texts,
    st.integers(),
    finite_floats,
    st.sampled_from([float("inf"), float("-inf")]),
    st.booleans(),
    st.none(),
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(key_names, children, max_size=4),
    )


#: Values as found in a config: scalars, lists, tuples, dicts, nested.
values = st.recursive(scalars, _containers, max_leaves=12)


def cfg_dicts(*, max_size: int = 5) -> st.SearchStrategy[dict[str, Any]]:
    """Plain nested dicts with identifier keys (the input a CfgNode is built from)."""
    return st.dictionaries(key_names, values, max_size=max_size)


cfg_trees = cfg_dicts()


def cfg_nodes(*, frozen: bool | None = None) -> st.SearchStrategy[CfgNode]:
    """CfgNodes built from :func:`cfg_dicts`; frozen, unfrozen, or either when None."""
    states = st.booleans() if frozen is None else st.just(frozen)
    return st.builds(lambda d, f: CfgNode(d, frozen=f), cfg_trees, states)


# For merge properties: a key names a sub-tree iff it starts with an upper-case letter, so
# the same key holds the same kind of value in every generated tree. (A deep merge replaces
# a sub-tree by a leaf and vice versa; with both kinds under one key, (a | b) | c and
# a | (b | c) differ, e.g. a={K: {x: 1}}, b={K: 1}, c={K: {y: 2}}.)
_node_keys = key_names.filter(lambda k: k[0].isupper())
_leaf_keys = key_names.filter(lambda k: not k[0].isupper())
_leaf_values = st.recursive(
    scalars, lambda c: st.one_of(st.lists(c, max_size=3), st.lists(c, max_size=3).map(tuple))
)


def _shaped(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        lambda leaves, nodes: {**leaves, **nodes},
        st.dictionaries(_leaf_keys, _leaf_values, max_size=3),
        st.dictionaries(_node_keys, children, max_size=2),
    )


shaped_dicts = st.recursive(
    st.dictionaries(_leaf_keys, _leaf_values, max_size=3), _shaped, max_leaves=6
)


def paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys and list indices) from ``tree`` to a CfgNode inside it, root first."""
    found: list[tuple[Any, ...]] = []
    if isinstance(tree, dict):
        found.append(prefix)
        items: Any = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return found
    for key, value in items:
        found.extend(paths(value, (*prefix, key)))
    return found


def follow(tree: Any, path: tuple[Any, ...]) -> Any:
    """The value at ``path`` in ``tree``."""
    for step in path:
        tree = tree[step]
    return tree
