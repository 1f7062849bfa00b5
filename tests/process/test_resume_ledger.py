"""The run ledger (contract section 8, ``resume=``): it knows what run it belongs to, digests
items the same way in any process, takes only keys it can keep apart, and refuses a path
that cannot be a ledger before any worker starts."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from easycore import CfgNode, consumer, producer

pytestmark = pytest.mark.timeout(120)

DEVICES = [2, "inline"]


def counting(tmp_path: Path, fn):
    """``fn`` as a producer that logs every item it computes; returns (stage, count)."""
    log = tmp_path / f"computed-{fn.__name__}"

    def work(x):
        with open(log, "a") as f:
            f.write("x\n")
        return fn(x)

    work.__name__ = work.__qualname__ = fn.__name__

    def count() -> int:
        return len(log.read_text().split()) if log.exists() else 0

    return producer(work), count


def square(x):
    return x * x


def cube(x):
    return x * x * x


def offset(x):
    return x + 1


def offset_by_two(x):
    return x + 2


def add_offset(x):
    return offset(x)


def scaled(k: int):
    """A producer whose closure holds ``k``: the same code, another computation."""

    @producer
    def times(x):
        return x * k

    return times


def marked(tmp_path: Path):
    """A producer whose ``init`` leaves a marker: tells whether any worker started."""
    marker = tmp_path / "worker-started"

    def start():
        marker.touch()

    @producer(init=start)
    def work(x):
        return x

    return work, marker


class TestRunIdentity:
    @pytest.mark.parametrize("devices", DEVICES)
    def test_another_function_is_a_value_error(self, tmp_path, devices):
        """cube over a ledger of square is a ValueError naming both, never the squares."""
        db = tmp_path / "run.db"
        assert producer(square).map(range(6), devices=devices, resume=db) == [
            x * x for x in range(6)
        ]
        with pytest.raises(ValueError, match=r"stages: square -> cube") as err:
            producer(cube).map(range(6), devices=devices, resume=db)
        assert str(db) in str(err.value)

    @pytest.mark.parametrize("devices", DEVICES)
    def test_the_same_name_with_other_code_is_a_value_error(self, tmp_path, devices):
        """Two functions of one name and different bodies are different stages."""

        def make(power):
            if power == 2:

                def work(x):
                    return x**2

            else:

                def work(x):
                    return x**3

            return producer(work)

        db = tmp_path / "run.db"
        make(2).map(range(6), devices=devices, resume=db)
        with pytest.raises(ValueError, match=r"stage 'work': its function changed"):
            make(3).map(range(6), devices=devices, resume=db)

    @pytest.mark.parametrize("devices", DEVICES)
    def test_a_closure_value_is_part_of_the_function(self, tmp_path, devices):
        """The same code closing over another value is another function; the same value
        resumes."""
        db = tmp_path / "run.db"
        assert scaled(2).map(range(6), devices=devices, resume=db) == [2 * x for x in range(6)]
        assert scaled(2).map(range(6), devices=devices, resume=db) == [2 * x for x in range(6)]
        with pytest.raises(ValueError, match=r"stage 'times': its function changed"):
            scaled(3).map(range(6), devices=devices, resume=db)

    def test_a_default_and_a_helper_are_part_of_the_function(self, tmp_path, monkeypatch):
        """A default argument's value and a helper function the stage calls count too."""
        db = tmp_path / "run.db"
        shifted = producer(add_offset)
        shifted.map(range(4), devices="inline", resume=db)
        monkeypatch.setattr(sys.modules[__name__], "offset", offset_by_two)
        with pytest.raises(ValueError, match=r"stage 'add_offset': its function changed"):
            shifted.map(range(4), devices="inline", resume=db)
        db = tmp_path / "run2.db"

        def with_default(offset):
            def shift(x, bias=offset):
                return x + bias

            return producer(shift)

        with_default(1).map(range(4), devices="inline", resume=db)
        with pytest.raises(ValueError, match=r"stage 'shift': its function changed"):
            with_default(2).map(range(4), devices="inline", resume=db)

    def test_a_function_its_closure_holds_again(self, tmp_path):
        """A stage whose closure holds a registry holding the stage's function has one
        identity, however deep the stack it is called from."""

        def make():
            registry = {}

            def walk(x):
                return registry["walk"](x - 1) + 1 if x else 0

            registry["walk"] = walk
            return producer(walk)

        def deep(n, call):
            return call() if n == 0 else deep(n - 1, call)

        db = tmp_path / "run.db"
        assert make().map(range(5), devices="inline", resume=db) == list(range(5))
        for depth in (40, 300):
            again = deep(depth, lambda: make().map(range(5), devices="inline", resume=db))
            assert again == list(range(5))

    @pytest.mark.parametrize("devices", DEVICES)
    def test_a_changed_seed_is_a_value_error(self, tmp_path, devices):
        """Another seed names both seeds."""
        db = tmp_path / "run.db"
        producer(square).map(range(6), devices=devices, seed=0, resume=db)
        with pytest.raises(ValueError, match=r"seed: 0 -> 1"):
            producer(square).map(range(6), devices=devices, seed=1, resume=db)
        with pytest.raises(ValueError, match=r"seed: 0 -> None"):
            producer(square).map(range(6), devices=devices, resume=db)

    @pytest.mark.parametrize("devices", DEVICES)
    def test_a_changed_cfg_is_a_value_error(self, tmp_path, devices):
        """Another cfg names the keys that differ; an equal cfg (a CfgNode or a dict, keys in
        any order) resumes."""

        @producer
        def width(x, cfg):
            return x * cfg.MODEL.WIDTH

        db = tmp_path / "run.db"
        cfg = {"MODEL": {"WIDTH": 2, "DEPTH": 3}, "LR": 0.1}
        width.map(range(6), devices=devices, cfg=cfg, resume=db)
        same = CfgNode({"LR": 0.1, "MODEL": {"DEPTH": 3, "WIDTH": 2}})
        assert width.map(range(6), devices=devices, cfg=same, resume=db) == [
            2 * x for x in range(6)
        ]
        other = {"MODEL": {"WIDTH": 3, "DEPTH": 3}, "LR": 0.1, "NEW": 1}
        with pytest.raises(ValueError, match=r"cfg: MODEL\.WIDTH changed, NEW added"):
            width.map(range(6), devices=devices, cfg=other, resume=db)

    @pytest.mark.parametrize("devices", DEVICES)
    def test_a_changed_batch_size_is_a_value_error(self, tmp_path, devices):
        """map's batch_size is part of the run, named as such (not "the input changed")."""

        @producer
        def total(batch):
            return sum(batch)

        db = tmp_path / "run.db"
        total.map(range(12), devices=devices, batch_size=2, resume=db)
        with pytest.raises(ValueError, match=r"batch_size: 2 -> 3"):
            total.map(range(12), devices=devices, batch_size=3, resume=db)

    def test_a_pool_batch_size_is_part_of_the_run(self, tmp_path):
        """A later pool's .on(batch_size=) too."""

        @producer
        def total(batch):
            return sum(batch)

        inc = producer(lambda x: x + 1)
        db = tmp_path / "run.db"
        (inc.on(1) >> total.on(1, batch_size=3)).map(range(12), resume=db)
        with pytest.raises(ValueError, match=r"stage 'total': batch_size 3 -> 4"):
            (inc.on(1) >> total.on(1, batch_size=4)).map(range(12), resume=db)

    @pytest.mark.parametrize("devices", DEVICES)
    def test_a_changed_init_is_a_value_error(self, tmp_path, devices):
        """init makes the state work uses: another init is another computation."""

        def make(k):
            def load():
                return k

            @producer(init=load)
            def work(x, state):
                return x * state

            return work

        db = tmp_path / "run.db"
        make(2).map(range(6), devices=devices, resume=db)
        with pytest.raises(ValueError, match=r"stage 'work': its init changed"):
            make(3).map(range(6), devices=devices, resume=db)

    @pytest.mark.parametrize("devices", DEVICES)
    def test_the_consumer_may_change(self, tmp_path, devices):
        """The ledger holds the producers' results: another consumer folds them, nothing
        runs again."""
        work, count = counting(tmp_path, square)

        @consumer(init=0)
        def total(acc, y):
            return acc + y

        @consumer(init=list)
        def listed(acc, y):
            acc.append(y)

        db = tmp_path / "run.db"
        assert (work >> total).map(range(8), devices=devices, resume=db) == 140
        assert (work >> listed).map(range(8), devices=devices, resume=db) == [
            x * x for x in range(8)
        ]
        assert count() == 8

    def test_how_and_where_may_change(self, tmp_path):
        """Devices, ordering, retries and errors= are not part of the run: a run on two
        workers resumes inline, unordered, with nothing computed again."""
        work, count = counting(tmp_path, square)
        db = tmp_path / "run.db"
        assert work.map(range(8), devices=2, resume=db) == [x * x for x in range(8)]
        out = work.map(
            range(8), devices="inline", ordered=False, retries=2, errors="skip", resume=db
        )
        assert sorted(out) == [x * x for x in range(8)]
        assert count() == 8

    def test_the_error_comes_before_any_worker_starts(self, tmp_path):
        """A ledger of another run is refused before any init runs."""
        db = tmp_path / "run.db"
        producer(square).map(range(4), devices=2, resume=db)
        work, marker = marked(tmp_path)
        with pytest.raises(ValueError, match="stages: square -> work"):
            work.map(range(4), devices=2, resume=db)
        assert not marker.exists()

    def test_an_open_runner_checks_too(self, tmp_path):
        """runner.map(resume=) on a runner of another pipeline is the same ValueError."""
        db = tmp_path / "run.db"
        producer(square).map(range(4), devices=2, resume=db)
        with (
            producer(cube).open(devices=2) as runner,
            pytest.raises(ValueError, match="stages: square -> cube"),
        ):
            runner.map(range(4), resume=db)

    def test_a_new_path_starts_afresh(self, tmp_path):
        """Another run with another path simply runs."""
        producer(square).map(range(4), devices="inline", resume=tmp_path / "a.db")
        assert producer(cube).map(range(4), devices="inline", resume=tmp_path / "b.db") == [
            x**3 for x in range(4)
        ]


NEW_PROCESS_JOB = textwrap.dedent(
    """
    import dataclasses, json, sys
    import torch
    from easycore import producer

    db, log, devices = sys.argv[1], sys.argv[2], sys.argv[3]
    devices = devices if devices == "inline" else int(devices)
    scale = 3

    @dataclasses.dataclass
    class Sample:
        ids: set
        pixels: torch.Tensor

    def helper(n):
        return n * scale

    def make(model):
        @producer
        def work(item):
            with open(log, "a") as f:
                f.write("x\\n")
            tags, sample = item["tags"], item["sample"]
            hit = sum(1 for t in tags if t in {"t0", "t3", "t5", "t7"})
            with torch.no_grad():
                y = float(model(sample.pixels).sum())
            return [helper(hit), sorted(tags), sorted(sample.ids), round(y, 4), item["n"]]

        return work

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)   # held by work's closure: its weights are part of work
    items = [
        {"n": i, "tags": frozenset(f"t{j}" for j in range(i, i + 8)),
         "sample": Sample({f"id-{i}-{j}" for j in range(6)}, torch.full((3,), float(i)))}
        for i in range(6)
    ]
    out = make(model).map(items, devices=devices, resume=db)
    print("RESULT", json.dumps(out), flush=True)
    """
)


@dataclasses.dataclass
class Sample:
    """An item that is an object: its tensor pickles with its storage's address."""

    tags: frozenset
    pixels: torch.Tensor


def run_job(tmp_path: Path, hash_seed: str, devices: str) -> list:
    script = tmp_path / "job.py"
    script.write_text(NEW_PROCESS_JOB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONHASHSEED": hash_seed}
    args = [str(tmp_path / "run.db"), str(tmp_path / "log"), devices]
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=90
    )
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return list(json.loads(line.split(" ", 1)[1]))


class TestItemDigests:
    @pytest.mark.parametrize("devices", ["2", "inline"])
    def test_sets_resume_in_a_new_process(self, tmp_path, devices):
        """Items holding sets, frozensets and objects holding tensors, and a stage whose code
        holds a set and whose closure holds a model, resume in a new process with another
        PYTHONHASHSEED: nothing runs again."""
        first = run_job(tmp_path, "1", devices)
        assert run_job(tmp_path, "2", devices) == first
        assert run_job(tmp_path, "3", devices) == first
        assert len((tmp_path / "log").read_text().split()) == 6

    @pytest.mark.parametrize("devices", DEVICES)
    def test_equal_items_resume(self, tmp_path, devices):
        """Equal items are the same input: dicts in another key order, copies of arrays and
        tensors, sets built in another order, objects holding copies of tensors."""
        work, count = counting(tmp_path, repr)

        def items(flip: bool):
            keys = ["b", "a", "c"] if flip else ["a", "b", "c"]
            return [
                {k: i for i in range(1) for k in keys},
                np.arange(6, dtype=np.float32).reshape(2, 3) + 0,
                torch.arange(4, dtype=torch.int64) * 1,
                set(reversed(range(40))) if flip else set(range(40)),
                (1, "x", None, 2.5, b"raw", range(3), frozenset({("p", 1), ("q", 2)})),
                Sample(frozenset({"a", "b", "c"}), torch.ones(3) * 2),
            ]

        db = tmp_path / "run.db"
        work.map(items(False), devices=devices, resume=db)
        work.map(items(True), devices=devices, resume=db)
        assert count() == 6

    @pytest.mark.parametrize(
        ("before", "after"),
        [
            (np.zeros(4), np.ones(4)),
            (np.zeros(4), np.zeros(4, dtype=np.float32)),
            (np.zeros(4), np.zeros((2, 2))),
            (torch.zeros(3), torch.ones(3)),
            ({"a": 1}, {"a": 1.0}),
            ({1, 2}, {1, 3}),
            ((1, 2), [1, 2]),
            (Sample(frozenset(), torch.zeros(2)), Sample(frozenset(), torch.ones(2))),
        ],
    )
    def test_different_items_still_differ(self, tmp_path, before, after):
        """Values, dtypes, shapes and types that differ are a changed input."""
        work = producer(repr)
        db = tmp_path / "run.db"
        work.map([before], devices="inline", resume=db)
        with pytest.raises(ValueError, match="input changed"):
            work.map([after], devices="inline", resume=db)


class TestKeys:
    @pytest.mark.parametrize("devices", DEVICES)
    def test_a_repeated_key_is_a_value_error(self, tmp_path, devices):
        """Two items of one key in a run: a ValueError naming the key, on the first run."""
        db = tmp_path / "run.db"
        with pytest.raises(ValueError, match=r"key 0 .*twice|twice.*key 0"):
            producer(square).map(range(6), devices=devices, resume=db, key=lambda x: x % 3)

    @pytest.mark.parametrize("devices", DEVICES)
    @pytest.mark.parametrize(
        "key", [lambda x: object(), lambda x: [x], lambda x: 1.5 * x, lambda x: (x, None)]
    )
    def test_a_key_of_another_type_is_a_type_error(self, tmp_path, devices, key):
        """Keys are str, int or tuples of them; objects (whose repr may hold an address),
        lists, floats and None are a TypeError."""
        db = tmp_path / "run.db"
        with pytest.raises(TypeError, match=r"key"):
            producer(square).map(range(6), devices=devices, resume=db, key=key)

    @pytest.mark.parametrize("devices", DEVICES)
    def test_str_int_and_tuples_of_them_are_keys(self, tmp_path, devices):
        """Such keys resume in any order, and 1 and '1' are different keys."""
        work, count = counting(tmp_path, str)
        db = tmp_path / "run.db"

        def key(x):
            return (x % 2, str(x)) if x < 10 else x if x < 20 else str(x - 10)

        items = list(range(30))
        assert work.map(items, devices=devices, resume=db, key=key) == [str(x) for x in items]
        assert work.map(items[::-1], devices=devices, resume=db, key=key) == [
            str(x) for x in items[::-1]
        ]
        assert count() == 30


class TestLedgerPath:
    def _refused(self, tmp_path: Path, path: Path, match: str) -> None:
        work, marker = marked(tmp_path)
        with pytest.raises(ValueError, match=match) as err:
            work.map(range(4), devices=2, resume=path)
        assert str(path) in str(err.value)
        assert not marker.exists(), "a worker started"

    def test_a_directory(self, tmp_path):
        """A directory is refused, naming it, before any worker starts."""
        self._refused(tmp_path, tmp_path, "directory")

    def test_a_missing_folder(self, tmp_path):
        """A file in a folder that does not exist is refused."""
        self._refused(tmp_path, tmp_path / "nope" / "run.db", "does not exist")

    def test_a_file_that_is_not_sqlite(self, tmp_path):
        """A text file is not a ledger (and is left as it was)."""
        path = tmp_path / "notes.txt"
        path.write_text("my notes\n" * 100)
        self._refused(tmp_path, path, "not an SQLite")
        assert path.read_text() == "my notes\n" * 100

    def test_sqlite_without_a_ledger(self, tmp_path):
        """An SQLite file of another program is not a ledger (and is left as it was)."""
        path = tmp_path / "other.db"
        with sqlite3.connect(path) as con:
            con.execute("CREATE TABLE users (name TEXT)")
        con.close()
        self._refused(tmp_path, path, "not an easycore run ledger")
        with sqlite3.connect(path) as con:
            tables = {n for (n,) in con.execute("SELECT name FROM sqlite_master")}
        con.close()
        assert tables == {"users"}

    def test_a_ledger_that_does_not_say_whose_it_is(self, tmp_path):
        """A ledger of an earlier easycore (no record of its run) is refused: its results
        could be another computation's."""
        path = tmp_path / "old.db"
        with sqlite3.connect(path) as con:
            con.execute(
                "CREATE TABLE units (key TEXT PRIMARY KEY, digest BLOB NOT NULL, error TEXT, "
                "stage TEXT, result BLOB)"
            )
        con.close()
        self._refused(tmp_path, path, "earlier easycore")

    def test_an_open_runner_stays_usable(self, tmp_path):
        """runner.map with such a path is the same ValueError, and the runner goes on."""
        with producer(square).open(devices=2) as runner:
            with pytest.raises(ValueError, match="directory"):
                runner.map(range(4), resume=tmp_path)
            assert runner.map(range(4), resume=tmp_path / "run.db") == [0, 1, 4, 9]

    @pytest.mark.parametrize("devices", DEVICES)
    def test_an_empty_file_is_a_new_ledger(self, tmp_path, devices):
        """An empty file (made by mktemp, say) is fine: the ledger starts there."""
        path = tmp_path / "run.db"
        path.touch()
        assert producer(square).map(range(4), devices=devices, resume=path) == [0, 1, 4, 9]
        assert producer(square).map(range(4), devices=devices, resume=path) == [0, 1, 4, 9]
