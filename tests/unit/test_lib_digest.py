"""Item digests (``resume=``): a canonical pickle, equal for equal values in any process,
apart for values that differ; a ledger of the previous digests is refused by its format."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sqlite3
import subprocess
import sys

import numpy as np
import pytest
import torch

from easycore import producer
from easycore._longjobs.digest import item_digest


@dataclasses.dataclass
class Holder:
    tags: frozenset
    pixels: torch.Tensor


def local_object(values):
    class Local:  # (a class defined in a function: pickle cannot import it)
        def __init__(self):
            self.values = set(values)

    return Local()


shared = [1, 2]
grid = np.arange(12.0).reshape(3, 4)

EQUAL = [
    ({"a": 1, "b": {1, 2}}, {"b": {2, 1}, "a": 1}),
    ({1: "x", "k": 2, (1, 2): 3}, {(1, 2): 3, "k": 2, 1: "x"}),
    (frozenset({("p", 1), "q", 2.5}), frozenset({2.5, "q", ("p", 1)})),
    (collections.defaultdict(list, a=1, b=2), collections.defaultdict(list, b=2, a=1)),
    ([shared, shared], [[1, 2], [1, 2]]),
    (grid, np.asfortranarray(grid)),
    (grid[:, ::2], grid[:, ::2].copy()),
    (np.arange(3).astype("datetime64[D]"), np.arange(3).astype("datetime64[D]")),
    (np.array([{"a", "b"}, None], dtype=object), np.array([{"b", "a"}, None], dtype=object)),
    (torch.arange(6).reshape(2, 3).t(), torch.arange(6).reshape(2, 3).t().contiguous()),
    (Holder(frozenset("abc"), torch.ones(3) * 2), Holder(frozenset("cba"), torch.full((3,), 2.0))),
    (local_object("xyz"), local_object("zyx")),
    (lambda x: x + 1, lambda x: x + 1),
    (np.ma.masked_array([1.0, 2.0], mask=[0, 1]), np.ma.masked_array([1.0, 2.0], mask=[0, 1])),
]

DIFFERENT = [
    (1, True),
    (1, 1.0),
    (1, "1"),
    ((1, 2), [1, 2]),
    ({1, 2}, frozenset({1, 2})),
    ({"a": 1}, [("a", 1)]),
    (collections.OrderedDict(a=1, b=2), collections.OrderedDict(b=2, a=1)),
    (collections.defaultdict(list, a=1), collections.defaultdict(set, a=1)),
    (np.zeros(4), np.zeros(4, dtype=np.float32)),
    (np.zeros(4), np.zeros((2, 2))),
    (np.zeros(2, dtype="datetime64[D]"), np.zeros(2, dtype="datetime64[s]")),
    (torch.ones(2), torch.nn.Parameter(torch.ones(2))),
    (Holder(frozenset(), torch.zeros(2)), Holder(frozenset(), torch.ones(2))),
    (lambda x: x + 1, lambda x: x + 2),
]


@pytest.mark.parametrize(("a", "b"), EQUAL)
def test_equal_values_have_one_digest(a, b):
    assert item_digest(a) == item_digest(b)


@pytest.mark.parametrize(("a", "b"), DIFFERENT)
def test_values_that_differ_have_two(a, b):
    assert item_digest(a) != item_digest(b)


def test_a_value_that_holds_itself_has_a_digest():
    loop: list = [1]
    loop.append(loop)
    assert len(item_digest(loop)) == 16


SCRIPT = """
import sys
from easycore._longjobs.digest import item_digest
value = {"tags": {f"t{i}" for i in range(30)}, "ids": frozenset(range(30)), b"k": (b"x", 1.5)}
print(item_digest(value).hex())
"""


def test_the_same_in_another_process():
    """Other PYTHONHASHSEEDs (other set orders), one digest."""
    seen = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60
        )
        assert out.returncode == 0, out.stderr
        seen.add(out.stdout.strip())
    assert len(seen) == 1


@producer
def double(x):
    return 2 * x


def test_a_ledger_of_the_earlier_digests_is_refused(tmp_path):
    """A ledger whose format is 2 (digests walked by hand, not a canonical pickle) is not
    read with today's digests: every unit would read as changed input."""
    db = tmp_path / "run.db"
    assert double.map([1, 2], devices="inline", resume=db) == [2, 4]
    with sqlite3.connect(db) as con:
        con.execute("UPDATE meta SET value = ? WHERE name = 'format'", (json.dumps(2),))
    con.close()
    with pytest.raises(ValueError, match=r"ledger format: 2 -> 6 \(another easycore wrote it\)"):
        double.map([1, 2], devices="inline", resume=db)


REBUILT = {"count": 0}  # (plain data that the function building Rebuilt reads)


def rebuild(value):
    REBUILT["count"] += 1
    return Rebuilt(value)


class Rebuilt:
    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return rebuild, (self.value,)


def test_a_function_that_builds_an_object_is_named_not_digested():
    """What the constructor reads (a count, a cache) is not the item: only its name is."""
    before = item_digest(Rebuilt(1))
    REBUILT["count"] += 5
    assert item_digest(Rebuilt(1)) == before != item_digest(Rebuilt(2))


_VEC = (
    """
class Vec:
    def __init__(self, x):
        self.x = x
"""
    + "".join(
        f"    def m{i}(self, o):\n        return Vec(self.x + {i}) if isinstance(o, Vec) else o\n"
        for i in range(10)
    )
    + """

def uses(v):
    return Vec(v).m0(v)
"""
)


def test_a_class_whose_methods_name_it_is_read_once_per_digest(tmp_path, monkeypatch):
    """A stage reading a class of 10 methods that each name the class: each method is
    digested a bounded number of times (it was k! times: minutes for 10 methods), and the
    digest still follows a change in any method."""
    import importlib

    from easycore._longjobs import digest

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "vec_for_digest.py").write_text(_VEC)
    calls = []
    parts = digest._parts
    monkeypatch.setattr(digest, "_parts", lambda fn, *a: calls.append(fn) or parts(fn, *a))
    mod = importlib.import_module("vec_for_digest")
    try:
        first = digest.function_digest(mod.uses)
        assert len(calls) <= 2 * 12  # (uses, __init__ and the 10 methods: each once or so)
        (tmp_path / "vec_for_digest.py").write_text(_VEC.replace("self.x + 7", "self.x + 8"))
        importlib.reload(mod)
        assert digest.function_digest(mod.uses) != first
    finally:
        sys.modules.pop("vec_for_digest", None)
