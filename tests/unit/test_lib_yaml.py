"""CfgNode's YAML (``easycore._config.yaml_io``): tuples of awkward strings keep their plain
``(a, b)`` form and read back equal (no processes here)."""

from __future__ import annotations

import pytest

from easycore import CfgNode

AWKWARD = [
    "a: b",
    "x #y",
    "#",
    "a:",
    "it's",
    'say "hi"',
    "back\\slash",
    "tab\there",
    "line\nbreak",
    "odd\u2028break",
    "\x7f\x00",
    "é ü 漢字 🙂",
    " lead",
    "trail ",
    "",
    "(1, 2)",
    "{a: 1}",
]


@pytest.mark.parametrize("text", AWKWARD)
def test_a_tuple_of_a_string_reads_back_as_written(text):
    cfg = CfgNode({"T": (text, 1, {"k": text}), "D": {"K": [(text,)]}})
    dumped = CfgNode.dump(cfg)
    assert dumped.startswith("T: (") and dumped.isascii()
    back = CfgNode.load(dumped)
    assert back == cfg and type(back.T) is tuple and type(back.D.K[0]) is tuple


def test_a_key_given_twice_names_it_and_its_first_line():
    with pytest.raises(ValueError, match=r"<string>:3:1: .*duplicate key 'A' \(first on line 1\)"):
        CfgNode.load("A: 1\nB: 2\nA: 3\n")
