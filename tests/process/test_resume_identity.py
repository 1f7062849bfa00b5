"""What a ``resume=`` ledger's run is (contract section 8): the module constants a stage
reads are named when they change, the ``key=`` function belongs to the run, and
``accept_changed_code=True`` continues a ledger after a fix, loudly."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from contextlib import closing

import pytest

from easycore import producer, write

pytestmark = pytest.mark.timeout(120)

SOURCE = """
OUT_DIR = {out_dir!r}
LIMIT = {limit!r}

def clip(x):
    return min(x, LIMIT)

def work(x):
    return OUT_DIR + "/" + str(clip(x))
"""


def reading(out_dir: str, limit: int = 100):
    """A producer ``work`` whose module holds the constants ``OUT_DIR`` and ``LIMIT`` (read
    by ``work`` and by its helper ``clip``): a module of its own, so that the workers get
    these values too (its functions travel by value)."""
    namespace = {"__name__": "resume_identity_case"}
    exec(SOURCE.format(out_dir=out_dir, limit=limit), namespace)
    return producer(namespace["work"])


def versioned(version: int):
    """Two versions of one stage ``work``: the first fails on 3 (the bug), the second is
    fixed and also marks its results (+1), so a test sees which version computed what."""
    if version == 1:

        def work(x):
            if x == 3:
                raise ValueError("the bug")
            return x * 10

    else:

        def work(x):
            return x * 10 + 1

    return producer(work)


def by_value(x):
    return x


def by_text(x):
    return str(x)


class TestModuleConstants:
    def test_a_changed_constant_is_named_with_both_values(self, tmp_path):
        db = tmp_path / "run.db"
        assert reading("a").map(range(4), devices=2, resume=db) == [f"a/{x}" for x in range(4)]
        assert reading("a").map(range(4), devices=2, resume=db) == [f"a/{x}" for x in range(4)]
        with pytest.raises(
            ValueError, match=r"stage 'work': the global OUT_DIR it reads changed"
        ) as err:
            reading("b").map(range(4), devices=2, resume=db)
        assert "('a' -> 'b')" in str(err.value)
        assert "its function changed" not in str(err.value)

    def test_a_constant_a_helper_reads_is_named(self, tmp_path):
        db = tmp_path / "run.db"
        reading("a", limit=2).map(range(4), devices="inline", resume=db)
        with pytest.raises(ValueError, match=r"the global LIMIT it reads changed \(2 -> 3\)"):
            reading("a", limit=3).map(range(4), devices="inline", resume=db)

    def test_changed_code_is_still_a_changed_function(self, tmp_path):
        db = tmp_path / "run.db"
        versioned(1).map(range(2), devices="inline", resume=db)
        with pytest.raises(ValueError, match=r"stage 'work': its function changed"):
            versioned(2).map(range(2), devices="inline", resume=db)


DATA_SOURCE = """
import numpy as np

L = {items!r}
D = {table!r}
A = np.arange(4) * {scale!r}

class C:
    K = {k!r}
    NAMES = ("a", "b")

    @staticmethod
    def bump(x):
        return x + {bump!r}

def work(x):
    return [L[x % 2], D["k"], int(A[x % 4]), C.K, C.bump(x)]
"""
DEFAULTS = {"items": [1, 2], "table": {"k": 2}, "scale": 1, "k": 2, "bump": 0}


def reading_data(**changed):
    """A producer ``work`` reading a list ``L``, a dict ``D``, an array ``A`` and a class
    ``C`` (its attribute ``K`` and its method ``bump``) of its module."""
    namespace = {"__name__": "resume_identity_data"}
    exec(DATA_SOURCE.format(**{**DEFAULTS, **changed}), namespace)
    return producer(namespace["work"])


class TestModuleData:
    """Module-level data a stage reads (containers, arrays, the attributes and methods of a
    class of its module) is part of its identity: a change is refused, naming it."""

    @pytest.mark.parametrize(
        ("changed", "named"),
        [
            ({"items": [1, 5]}, r"the global L it reads changed \(\[1, 2\] -> \[1, 5\]\)"),
            ({"table": {"k": 5}}, r"the global D it reads changed \(\{'k': 2\} -> \{'k': 5\}\)"),
            ({"table": {"k": [5]}}, r"the global D it reads changed"),
            ({"scale": 3}, r"the global A it reads changed"),
            ({"k": 5}, r"the global C.K it reads changed \(2 -> 5\)"),
            ({"bump": 1}, r"stage 'work': its function changed"),
        ],
        ids=["list", "dict", "nested", "array", "class attribute", "method"],
    )
    def test_a_change_is_refused_naming_it(self, tmp_path, changed, named):
        db = tmp_path / "run.db"
        assert reading_data().map(range(2), devices="inline", resume=db) == [
            [1, 2, 0, 2, 0],
            [2, 2, 1, 2, 1],
        ]
        assert reading_data().map(range(2), devices="inline", resume=db)[0] == [1, 2, 0, 2, 0]
        with pytest.raises(ValueError, match=named):
            reading_data(**changed).map(range(2), devices="inline", resume=db)

    def test_main_module_data_is_covered(self, tmp_path):
        """A script's ``OPTS["mode"]`` (in ``__main__``) changed between two runs."""
        script = tmp_path / "job.py"
        script.write_text(
            "import sys\n"
            "from easycore import producer\n"
            "OPTS = {'mode': sys.argv[1]}\n"
            "@producer\n"
            "def work(x):\n"
            "    return OPTS['mode'] + str(x)\n"
            "if __name__ == '__main__':\n"
            "    print(work.map(range(2), devices='inline', resume=sys.argv[2]))\n"
        )

        def run(mode):
            db = str(tmp_path / "run.db")
            cmd = [sys.executable, str(script), mode, db]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

        assert run("a").stdout.strip() == "['a0', 'a1']"
        assert run("a").stdout.strip() == "['a0', 'a1']"
        failed = run("b")
        assert failed.returncode != 0
        assert "the global OPTS it reads changed ({'mode': 'a'} -> {'mode': 'b'})" in failed.stderr


class TestKeyFunction:
    def test_another_key_function_is_another_run(self, tmp_path):
        db = tmp_path / "run.db"
        square = producer(lambda x: x * x)
        assert square.map(range(4), devices=2, resume=db, key=by_value) == [0, 1, 4, 9]
        with pytest.raises(ValueError, match=r"key=: .*by_value -> .*by_text"):
            square.map(range(4), devices=2, resume=db, key=by_text)
        with pytest.raises(ValueError, match=r"key=: .*by_value -> \(none\)"):
            square.map(range(4), devices=2, resume=db)
        assert square.map(range(4), devices=2, resume=db, key=by_value) == [0, 1, 4, 9]

    def test_a_key_function_with_other_code_is_another_run(self, tmp_path):
        def make(k):
            def key(x):
                return x * k

            return key

        db = tmp_path / "run.db"
        producer(by_value).map(range(3), devices="inline", resume=db, key=make(1))
        with pytest.raises(ValueError, match=r"key=: the function .*key changed"):
            producer(by_value).map(range(3), devices="inline", resume=db, key=make(2))

    def test_a_sink_keeps_its_committed_files(self, tmp_path):
        """Another key= over a sink's ledger is refused before any file is written again."""
        db, out = tmp_path / "run.db", tmp_path / "out"
        rows = producer(lambda x: {"x": x})
        (rows >> write.jsonl(str(out))).map(range(6), devices=2, resume=db, key=by_value)
        before = {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out)}
        with pytest.raises(ValueError, match=r"key="):
            (rows >> write.jsonl(str(out))).map(range(6), devices=2, resume=db, key=by_text)
        assert {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out)} == before


class TestAcceptChangedCode:
    def test_a_fixed_stage_continues_the_ledger(self, tmp_path):
        """The stored results stay, the failed and the missing items run with the new code,
        a warning names what changed; the ledger is the new code's from then on."""
        db = tmp_path / "run.db"
        first = versioned(1).map(range(4), devices=2, resume=db, errors="skip", on_error=print)
        assert first == [0, 10, 20]
        with pytest.raises(ValueError, match=r"accept_changed_code=True"):
            versioned(2).map(range(6), devices=2, resume=db, retry_failed=True)
        with pytest.warns(UserWarning, match=r"stage 'work': its function changed") as caught:
            fixed = versioned(2).map(
                range(6), devices=2, resume=db, retry_failed=True, accept_changed_code=True
            )
        assert len(caught) == 1 and str(db) in str(caught[0].message)
        assert fixed == [0, 10, 20, 31, 41, 51]
        assert versioned(2).map(range(6), devices=2, resume=db) == fixed  # no warning now

    def test_a_changed_constant_is_named_in_the_warning(self, tmp_path):
        db = tmp_path / "run.db"
        reading("a").map(range(2), devices="inline", resume=db)
        with pytest.warns(UserWarning, match=r"the global OUT_DIR it reads changed \('a' -> 'b'\)"):
            again = reading("b").map(
                range(3), devices="inline", resume=db, accept_changed_code=True
            )
        assert again == ["a/0", "a/1", "b/2"]

    def test_what_results_mean_is_still_refused(self, tmp_path):
        """cfg, seed, batch sizes, key= and the stages themselves are not code to accept."""
        db = tmp_path / "run.db"
        versioned(1).map(range(2), devices="inline", resume=db, seed=1)
        for other in ({"seed": 2}, {"key": by_value}, {"batch_size": 2}):
            with pytest.raises(ValueError, match="another run"):
                versioned(2).map(
                    range(2),
                    devices="inline",
                    resume=db,
                    accept_changed_code=True,
                    **{"seed": 1, **other},
                )
        with pytest.raises(ValueError, match=r"stages: work -> by_value"):
            producer(by_value).map(
                range(2), devices="inline", resume=db, seed=1, accept_changed_code=True
            )
        with closing(sqlite3.connect(db)) as conn:  # nothing refused touched its identity
            (seed,) = conn.execute("SELECT value FROM meta WHERE name = 'seed'").fetchone()
        assert seed == "1"

    def test_the_option_is_a_bool(self):
        with pytest.raises(TypeError, match="accept_changed_code must be True or False"):
            producer(by_value).map([1], devices="inline", accept_changed_code="yes")


class TestOlderLedgers:
    def test_a_ledger_without_the_new_parts_is_refused_by_its_format(self, tmp_path):
        """A ledger written before code, reads and key= were recorded (format 3) is refused
        by its format, naming it, before anything of it is compared or resumed."""
        db = tmp_path / "run.db"
        reading("a").map(range(3), devices="inline", resume=db)
        with closing(sqlite3.connect(db)) as conn, conn:
            (text,) = conn.execute("SELECT value FROM meta WHERE name = 'stages'").fetchone()
            stages = [
                {k: v for k, v in s.items() if k not in ("code", "reads")} for s in json.loads(text)
            ]
            conn.execute("UPDATE meta SET value = ? WHERE name = 'stages'", (json.dumps(stages),))
            conn.execute("UPDATE meta SET value = '3' WHERE name = 'format'")
            conn.execute("DELETE FROM meta WHERE name = 'key'")
        with pytest.raises(
            ValueError, match=r"ledger format: 3 -> 6 \(another easycore wrote it\)"
        ):
            reading("a").map(range(3), devices="inline", resume=db)
