"""engine="ray" on a real local Ray with 2 CPUs: contract section 7, with sections 2, 3 and 8
holding as on the local engine."""

from __future__ import annotations

import gc
import itertools
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import ray

from easycore import (
    Failure,
    ItemTimeout,
    SerializationError,
    SkippedItemsWarning,
    WorkerDied,
    WorkerError,
    consumer,
    producer,
)
from helpers import HomeSick, SlowToLoad, first_time, one_unloadable, our_actors, wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("local_ray")]


@producer
def square(x):
    return x * x


@producer
def noisy(x):
    """A seeded result: random, numpy and torch streams as the worker seeded them."""
    import torch

    return (x, random.random(), float(np.random.rand()), float(torch.rand(1)))


@consumer(init=0)
def total(acc, y):
    return acc + y


class TestResults:
    def test_map_ordered_unordered_and_batches(self):
        data = list(range(200))
        assert square.map(data, devices=2, engine="ray") == [x * x for x in data]
        got = square.map(data, devices=2, engine="ray", ordered=False)
        assert sorted(got) == [x * x for x in data]

        @producer
        def size(batch):
            return len(batch), sum(batch)

        got = size.map(range(10), devices=2, engine="ray", batch_size=4)
        assert got == [(4, 6), (4, 22), (2, 17)]

    def test_a_ray_the_user_started_is_left_running(self):
        assert square.map(range(5), devices=1, engine="ray") == [0, 1, 4, 9, 16]
        assert ray.is_initialized()
        assert ray.get(ray.put(7)) == 7

    def test_submit(self):
        @producer
        def picky(x):
            if x == 3:
                raise ValueError("three")
            return x * x

        with picky.open(devices=2, engine="ray") as runner:
            futures = [runner.submit(i) for i in range(6)]
            assert [f.result(timeout=60) for f in futures if f is not futures[3]] == [
                0,
                1,
                4,
                16,
                25,
            ]
            with pytest.raises(WorkerError, match="three"):
                futures[3].result(timeout=60)

    @pytest.mark.gpu
    def test_a_gpu_entry_is_an_actor_holding_one_gpu(self):
        @producer
        def where(x, *, device):
            import torch

            return device, torch.cuda.current_device(), os.environ["CUDA_VISIBLE_DEVICES"]

        got = where.map([0, 1], devices=["cuda"], engine="ray")
        assert got[0][:2] == ("cuda:0", 0) and got[0] == got[1]

    def test_consumer_fold_and_imap(self):
        assert (square >> total).map(range(100), devices=2, engine="ray") == sum(
            x * x for x in range(100)
        )
        assert list(square.imap(range(30), devices=1, engine="ray")) == [x * x for x in range(30)]

    def test_a_consumer_that_raises_at_once_gives_its_error(self):
        """The consumer's error, also when it stops the run before any actor answered (the
        run's books are cleared after the engine has let go of its actors)."""

        @consumer(init=0)
        def fails(acc, y):
            raise ValueError("the consumer said no")

        with pytest.raises(WorkerError, match="the consumer said no"):
            (square >> fails).map([0], devices=1, engine="ray")

    def test_a_seeded_run_equals_the_local_one(self):
        """The same seed gives the same results on Ray as locally, whatever the counts."""
        local = noisy.map(range(24), devices=2, seed=7)
        assert noisy.map(range(24), devices=1, engine="ray", seed=7) == local
        assert noisy.map(range(24), devices=2, engine="ray", seed=7, ordered=True) == local

    def test_injection_and_init_once_per_actor_end_at_close(self, tmp_path):
        def load(worker, device):
            (tmp_path / f"init-{os.getpid()}").touch()
            return (worker, device)

        def bye(state):
            (tmp_path / f"end-{os.getpid()}").touch()

        @producer(init=load, end=bye)
        def where(x, *, state, worker, device):
            assert state == (worker, device)
            return device

        with where.open(devices=2, engine="ray") as runner:
            assert runner.n_workers == 2
            assert runner.map(range(10)) == ["cpu"] * 10
            assert runner.map(range(10)) == ["cpu"] * 10
            inits = sorted(p.name for p in tmp_path.glob("init-*"))
            assert len(inits) == 2  # once per actor, not per map
            stats = runner.stats()
            assert stats[0].done == 10 and stats[0].devices == ("cpu", "cpu")
        assert len(list(tmp_path.glob("end-*"))) == 2

    def test_big_arrays_come_back_through_the_object_store(self):
        @producer
        def make(n):
            return np.full((512, 1024), n, dtype=np.float32)  # 2 MiB each

        got = make.map(range(6), devices=2, engine="ray")
        assert [float(a[0, 0]) for a in got] == list(range(6))
        assert all(a.shape == (512, 1024) for a in got)

    def test_progress_bar(self, capsys):
        assert square.map(range(20), devices=1, engine="ray", progress=True)[-1] == 361
        assert "20/20" in capsys.readouterr().err


class _Spy:
    """An intermediate result that logs the pid of every process that unpickles it."""

    def __init__(self, value: int, log: str) -> None:
        self.value = value
        self.log = log

    def __reduce__(self):
        return (_spy_arrives, (self.value, self.log))


def _spy_arrives(value: int, log: str) -> _Spy:
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    return _Spy(value, log)


def _runs_in(x, worker):
    """What runs an item: Ray titles a task's process ``ray::run_task``, an actor's
    ``ray::StageActor...``."""
    with open("/proc/self/cmdline", "rb") as f:
        title = f.read().split(b"\0")[0].decode()
    return ("task" if title.startswith("ray::run_task") else "actor", worker)


class TestTasksOrActors:
    """A one-shot run of an init-less pool needs no actor (Ray starts tasks on its warm
    workers in milliseconds); an init, a timeout, recycling or an open runner keep actors."""

    def test_an_init_less_one_shot_pool_runs_on_tasks(self):
        got = producer(_runs_in).map(range(12), devices=2, engine="ray")
        assert {kind for kind, _ in got} == {"task"}
        assert {w for _, w in got} <= {0, 1}  # `worker`: the slot within the pool

    @pytest.mark.parametrize(
        "how", ["init", "timeout", "max_items_per_worker", "max_worker_memory", "open"]
    )
    def test_what_keeps_worker_state_runs_on_actors(self, how):
        stage = producer(init=dict)(_runs_in) if how == "init" else producer(_runs_in)
        options = {"timeout": {"timeout": 60}, "max_items_per_worker": {"max_items_per_worker": 50}}
        options["max_worker_memory"] = {"max_worker_memory": "64GiB"}
        if how == "open":
            with stage.open(devices=2, engine="ray") as runner:
                got = runner.map(range(12))
        else:
            got = stage.map(range(12), devices=2, engine="ray", **options.get(how, {}))
        assert {kind for kind, _ in got} == {"actor"}

    def test_a_pool_of_tasks_feeds_a_pool_of_actors(self):
        first = producer(_runs_in)
        second = producer(init=dict)(lambda pair, *, state: (pair[0], _runs_in(0, 0)[0]))
        got = (first.on(1) >> second.on(1)).map(range(10), engine="ray")
        assert got == [("task", "actor")] * 10


class TestPools:
    def test_two_pools_pass_object_references_not_through_the_driver(self, tmp_path):
        log = str(tmp_path / "unpickled")

        @producer
        def decode(x):
            return _Spy(x, log)

        @producer
        def predict(batch):
            return sum(s.value for s in batch)

        pipeline = decode.on(1) >> predict.on(1, batch_size=3)
        assert pipeline.map(range(10), engine="ray") == [3, 12, 21, 9]
        pids = {int(p) for p in Path(log).read_text().split()}
        assert pids, "the second pool never received the first pool's results"
        assert os.getpid() not in pids  # the driver never unpickled an intermediate result

    def test_pools_of_tasks_read_classes_only_the_drivers_sys_path_finds(
        self, tmp_path, monkeypatch
    ):
        # A module no Ray worker has on its path (a fresh directory per test): the items of
        # the first pool and the results passed to the second are instances of its class.
        # A Ray task unpickles its arguments before it runs; easycore must add the driver's
        # sys.path first, as an actor does in start.
        name = f"boxes_{os.getpid()}_{time.monotonic_ns()}"
        (tmp_path / f"{name}.py").write_text(
            "class Box:\n    def __init__(self, v):\n        self.v = v\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        box = __import__(name).Box

        @producer
        def unbox(b):
            return b.v

        @producer
        def rebox(x):
            return box(x + 1)

        @producer
        def total_of(batch):
            return sum(b.v for b in batch)

        assert unbox.map([box(i) for i in range(7)], devices=2, engine="ray") == list(range(7))
        pipeline = rebox.on(1) >> total_of.on(1, batch_size=3)
        assert pipeline.map(range(7), engine="ray") == [6, 15, 7]

    def test_deaths_in_either_pool_rerun_within_retries(self, tmp_path):
        @producer
        def first(x):
            if x == 13 and first_time(tmp_path / "first"):
                os._exit(1)
            return x + 1

        @producer
        def second(xs):
            if 40 in xs and first_time(tmp_path / "second"):
                os._exit(1)
            return sum(xs)

        want = [sum(range(i * 4 + 1, min(i * 4 + 4, 60) + 1)) for i in range(15)]
        got = (first.on(1) >> second.on(1, batch_size=4)).map(range(60), engine="ray", retries=1)
        assert got == want
        assert (tmp_path / "first").exists() and (tmp_path / "second").exists()

    def test_a_failure_in_the_first_pool_names_its_stage(self):
        @producer
        def decode(x):
            if x == 4:
                raise ValueError("bad frame")
            return x

        @producer
        def predict(x):
            return x

        with pytest.raises(WorkerError, match="bad frame") as info:
            (decode.on(1) >> predict.on(1)).map(range(8), engine="ray")
        assert info.value.stage == "decode" and info.value.index == 4


CONTROL = "_control_reads"


@ray.remote(max_retries=0)
def _control_dies():
    os._exit(3)


@ray.remote
def _control_reads(x):
    return x


class TestErrors:
    def test_an_exception_is_a_worker_error_naming_stage_item_and_node(self):
        @producer
        def boom(x):
            if x == 3:
                raise KeyError("nope")
            return x

        with pytest.raises(WorkerError) as info:
            boom.map(range(6), devices=2, engine="ray")
        err = info.value
        assert err.stage == "boom" and err.index == 3
        assert isinstance(err.__cause__, KeyError)
        assert "item 3" in str(err) and "Ray node" in str(err)

    @pytest.mark.parametrize("fault", ["death", "unpicklable"])
    def test_a_failed_pool_leaves_no_unhandled_error_in_the_log(self, tmp_path, fault):
        """A death, or a result that cannot be pickled, in the first of two pools fails the
        second pool's call on that chunk too: the run reads every reference it drops, so
        Ray logs no "Unhandled error" (two per failed chunk, on the driver's console)."""

        @producer(init=lambda: None)
        def fragile(x, *, state):
            if x == 30 and first_time(tmp_path / "once"):
                if fault == "death":
                    os._exit(3)
                return threading.Lock()
            return x

        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        ray_log = logging.getLogger("ray._private.worker")
        ray_log.addHandler(handler)

        def unhandled() -> list[str]:
            return [r.getMessage() for r in records if "Unhandled" in r.getMessage()]

        try:
            got = (fragile.on(1) >> square.on(1)).map(
                range(300), engine="ray", retries=1, errors="skip"
            )
            # Ray reports an unread error once it has failed and its last reference is gone
            # (waiting on it counts as reading it). A control of the same shape, dropped
            # after the run (a call whose input died with its process), shows when Ray has
            # reported what the run dropped.
            _control_reads.remote(_control_dies.remote())
            gc.collect()
            assert wait_for(lambda: any(CONTROL in m for m in unhandled()), timeout=60)
        finally:
            ray_log.removeHandler(handler)
        assert got == [x * x for x in range(300)]  # (item 30 failed once: retried)
        assert [m for m in unhandled() if CONTROL not in m] == []

    def test_retries_rerun_an_item_that_raised(self, tmp_path):
        @producer
        def flaky(x):
            if x == 5 and first_time(tmp_path / "once"):
                raise RuntimeError("transient")
            return x * 2

        assert flaky.map(range(10), devices=2, engine="ray", retries=1) == [
            x * 2 for x in range(10)
        ]

    @pytest.mark.parametrize("how", ["exit", "sigkill"])
    def test_a_dead_actor_is_replaced_and_its_items_rerun(self, tmp_path, how):
        """Nothing lost or doubled: each item's result appears once, equal to fault-free."""

        @producer
        def fragile(x):
            if x == 7 and first_time(tmp_path / "once"):
                if how == "exit":
                    os._exit(3)
                os.kill(os.getpid(), signal.SIGKILL)
            return x + 100

        data = list(range(40))
        got = fragile.map(data, devices=2, engine="ray", retries=1)
        assert got == [x + 100 for x in data]

    @pytest.mark.parametrize(("init", "kind"), [(dict, "Ray actor"), (None, "Ray task")])
    def test_out_of_retries_a_dead_actor_is_worker_died(self, init, kind):
        """A pool with an init runs on actors; one without, in a one-shot run, on plain
        tasks: a death past the retries is the same WorkerDied naming the item."""

        def poison(x):
            if x == 2:
                os._exit(1)
            return x

        with pytest.raises(WorkerDied, match=kind) as info:
            producer(init=init)(poison).map(range(6), devices=1, engine="ray", retries=1)
        assert info.value.index == 2
        assert "item 2" in str(info.value)

    def test_a_death_is_charged_to_the_item_that_caused_it(self):
        """An actor that dies right after finishing items may take their replies with it
        (os._exit before Ray sent them): the blame still falls on the poison item, never on
        an innocent one finished just before it. Several runs, as the race is timing's."""

        @producer
        def poison(x):
            if x == 7:
                os._exit(1)
            return x

        for _ in range(3):
            failed = []
            got = poison.map(
                range(20), devices=1, engine="ray", retries=1, errors="skip", on_error=failed.append
            )
            assert got == [x for x in range(20) if x != 7]
            assert [f.index for f in failed] == [7]
            with pytest.raises(WorkerDied, match="item 7") as info:
                poison.map(range(12), devices=1, engine="ray", retries=1)
            assert info.value.index == 7

    @pytest.mark.parametrize("init", [dict, None], ids=["actor", "task"])
    def test_with_no_retries_a_death_names_the_items_of_its_chunk(self, init):
        """Ray does not say which item a dead actor or task was running: raising at once
        (no retries, errors="raise"), the error names the items of every chunk it had (the
        oldest, and those after it: the one it ran may be a later one, the replies of those
        it finished having died with it), so the poison item is among them, and its index
        is the first of them (docs/guide/failures.md)."""

        def poison(x):
            if x == 100:
                os._exit(1)
            return x

        with pytest.raises(WorkerDied) as info:
            producer(init=init)(poison).map(range(200), devices=1, engine="ray")
        error = info.value
        text = str(error)
        assert re.search(r"while running item \d+", text), text
        spans = re.findall(r"item (\d+)(?: \.\. item (\d+))?", text.rsplit(" while running ", 1)[1])
        named = [(int(a), int(b or a)) for a, b in spans]
        assert any(a <= 100 <= b for a, b in named), text
        assert error.index == named[0][0] == min(a for a, _ in named)
        assert (error.worker, error.device) == (0, "cpu")

    def test_timeout_kills_the_actor(self, tmp_path):
        @producer
        def stuck(x):
            if x == 1:
                time.sleep(60)
            return x

        t0 = time.monotonic()
        with pytest.raises(ItemTimeout) as info:
            stuck.map(range(4), devices=1, engine="ray", timeout=1.0)
        assert time.monotonic() - t0 < 30
        assert info.value.index == 1

        @producer
        def slow_once(x):
            if x == 1 and first_time(tmp_path / "once"):
                time.sleep(60)
            return x

        assert slow_once.map(range(4), devices=1, engine="ray", timeout=1.0, retries=1) == [
            0,
            1,
            2,
            3,
        ]

    def test_an_init_error_is_a_worker_error_and_no_actor_is_left(self):
        def load():
            raise OSError("no weights")

        @producer(init=load)
        def predict(x, *, state):
            return x

        with pytest.raises(WorkerError, match="no weights") as info:
            predict.map([1], devices=1, engine="ray")
        assert info.value.stage == "predict (init)"

    def test_an_item_that_cannot_be_pickled_is_named(self):
        with pytest.raises(SerializationError, match="item 1"):
            square.map([1, threading.Lock(), 3], devices=1, engine="ray")
        seen: list[Failure] = []
        got = square.map(
            [1, threading.Lock(), 3], devices=1, engine="ray", errors="skip", on_error=seen.append
        )
        assert got == [1, 9] and [f.index for f in seen] == [1]

    @pytest.mark.parametrize("timeout", [None, 30.0])
    def test_an_item_that_does_not_unpickle_fails_alone(self, timeout):
        """As on processes: only that item is set aside (with a timeout, the actor unpickles
        the chunk itself, and each of its units failed), and the raised error names it."""
        data = one_unloadable(20_000, 15_000)
        seen: list[Failure] = []
        got = square.map(
            data, devices=2, engine="ray", timeout=timeout, errors="skip", on_error=seen.append
        )
        assert got == [x * x for x in range(20_000) if x != 15_000]
        assert [f.index for f in seen] == [15_000]
        with pytest.raises(SerializationError, match="item 15000") as info:
            square.map(data, devices=2, engine="ray", timeout=timeout)
        assert info.value.index == 15_000

    def test_a_result_that_does_not_unpickle_in_the_caller_is_named(self):
        """A result that unpickles in an actor but not in the driver is a SerializationError
        naming its item, set aside alone with errors="skip" (it was re-run without end)."""
        here = os.getpid()
        make = producer(lambda x: HomeSick(here, x) if x == 3 else x)
        with pytest.raises(SerializationError, match="item 3") as info:
            make.map(range(6), devices=2, engine="ray")
        assert info.value.index == 3
        seen: list[Failure] = []
        got = make.map(range(6), devices=2, engine="ray", errors="skip", on_error=seen.append)
        assert got == [0, 1, 2, 4, 5] and [(f.index, f.item) for f in seen] == [(3, 3)]

    def test_bad_arguments_fail_before_any_actor_starts(self):
        with pytest.raises(ValueError, match="Ray cluster has 2 CPU"):
            square.map([1], devices=3, engine="ray")
        with pytest.raises(ValueError, match="engine"):
            square.map([1], devices=1, engine="spark")
        with pytest.raises(ValueError, match="inline"):
            square.map([1], devices="inline", engine="ray")
        with pytest.raises(ValueError, match="no GPU"):
            square.map([1], devices="cuda", engine="ray")


class TestLongJobs:
    def test_errors_skip_sets_aside_only_the_bad_items(self, tmp_path):
        @producer
        def picky(x):
            if x == 3:
                raise ValueError("three")
            if x == 6:
                os._exit(2)
            return x

        seen: list[Failure] = []
        got = picky.map(
            range(10), devices=2, engine="ray", errors="skip", on_error=seen.append, retries=1
        )
        assert got == [0, 1, 2, 4, 5, 7, 8, 9]
        assert sorted(f.index for f in seen) == [3, 6]
        assert {type(f.error) for f in seen} == {WorkerError, WorkerDied}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            picky.map([3, 4], devices=1, engine="ray", errors="skip")
        assert any(issubclass(w.category, SkippedItemsWarning) for w in caught)

    def test_resume_runs_only_what_the_ledger_lacks(self, tmp_path):
        db = tmp_path / "run.db"
        calls = tmp_path / "calls"
        calls.mkdir()

        @producer
        def counted(x):
            (calls / f"{x}-{time.monotonic_ns()}").touch()
            return x * 3

        first = counted.map(range(12), devices=2, engine="ray", resume=db)
        n_first = len(list(calls.iterdir()))
        again = counted.map(range(12), devices=2, engine="ray", resume=db)
        assert first == again == [x * 3 for x in range(12)]
        assert n_first == 12 and len(list(calls.iterdir())) == 12  # nothing recomputed

    def test_max_items_per_worker_replaces_actors(self, tmp_path):
        @producer(init=lambda: (tmp_path / f"init-{time.monotonic_ns()}").touch())
        def pid(x, *, state):
            return os.getpid()

        got = pid.map(range(12), devices=1, engine="ray", max_items_per_worker=4)
        assert len(got) == 12 and len(set(got)) >= 3
        assert len(list(tmp_path.glob("init-*"))) >= 3
        # a bound every actor passes at once: each is replaced after its chunk
        got = pid.map(range(4), devices=1, engine="ray", max_worker_memory=1)
        assert len(got) == 4 and len(set(got)) >= 2


class TestSignals:
    def test_a_producer_may_install_signal_handlers(self):
        """signal.signal in a producer's init and in its work (a per-item alarm) works as on
        the local engine: an actor runs the user's code on its main thread."""

        def init():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # e.g. a library's exit hook
            return 2

        @producer(init=init)
        def alarmed(x, *, state):
            def too_long(signum, frame):
                raise TimeoutError(f"item {x}")

            old = signal.signal(signal.SIGALRM, too_long)
            signal.alarm(30)
            try:
                return x * state
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)

        local = alarmed.map(range(6), devices=1)
        assert alarmed.map(range(6), devices=2, engine="ray") == local == [0, 2, 4, 6, 8, 10]


class TestStreaming:
    def test_imap_over_an_endless_generator_pulls_a_bounded_number(self):
        pulled = itertools.count()

        def endless():
            for i in itertools.count():
                next(pulled)
                yield i

        results = square.imap(endless(), devices=2, engine="ray")
        first = [next(results) for _ in range(2000)]
        results.close()
        assert first == [x * x for x in range(2000)]
        ahead = next(pulled) - 2000
        assert ahead < 120_000, f"pulled {ahead} items ahead of the consumer"  # the window

    def test_results_come_back_as_they_finish(self):
        @producer
        def slow_first(x):
            time.sleep(3 if x == 0 else 0.01)
            return x

        t0 = time.monotonic()
        it = slow_first.imap(range(10), devices=2, engine="ray", ordered=False)
        first = next(it)
        assert first != 0 and time.monotonic() - t0 < 2.5
        assert sorted([first, *it]) == list(range(10))


@pytest.mark.parametrize("init", ["dict", "None"])
def test_ctrl_c_stops_every_actor_and_the_ray_it_started(tmp_path, init):
    """Ctrl-C in a script that let easycore start Ray: KeyboardInterrupt, nothing left
    (a pool with an init on actors, one without on plain tasks)."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from easycore import producer

            @producer(init={init})
            def slow(x):
                time.sleep(0.2)
                return x

            try:
                for i, _ in enumerate(slow.imap(range(10_000), devices=2, engine="ray")):
                    if i == 3:
                        print("running", flush=True)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
                sys.exit(0)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    ours = ray_services()  # the module's own Ray
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "running"
        actors = {p.pid for p in our_actors()}
        theirs = ray_services() - ours  # the Ray easycore started for the script
        assert theirs, "the script's Ray should be running"
        assert bool(actors) == (init == "dict"), "actors for a pool with an init, else tasks"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:  # (a script still running would hold its Ray, and every later test see it)
        proc.kill()
        proc.communicate()
    assert "interrupted" in out
    # (Ray's services end after the script, on their own: slowly on a loaded machine)
    assert wait_for(lambda: not ({p.pid for p in our_actors()} & actors), 60)
    assert wait_for(lambda: not (ray_services() & theirs), 60), "the script's Ray is still up"
    # the module's Ray is untouched (it still answers; the services seen at the start may
    # have included another Ray's, ending then)
    assert ray.is_initialized() and ray.get(ray.put(1), timeout=60) == 1


def ray_services() -> set[int]:
    """Pids of Ray's per-cluster services (raylet, GCS) on this machine."""
    import psutil

    out = set()
    for p in psutil.process_iter(["name"]):
        if p.info["name"] in ("raylet", "gcs_server"):
            out.add(p.pid)
    return out


def test_a_ray_started_for_the_run_is_shut_down_after_it():
    """No Ray running and no RAY_ADDRESS: map starts a local Ray and stops it afterwards."""
    code = textwrap.dedent(
        """
        import ray
        from easycore import producer

        inc = producer(lambda x: x + 1)
        print(inc.map([1, 2], devices=1, engine="ray"), ray.is_initialized())
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.stdout.strip().splitlines()[-1] == "[2, 3] False", out.stderr[-2000:]


@pytest.mark.timeout(120)
def test_a_ray_address_where_nothing_answers_is_a_connection_error():
    """RAY_ADDRESS where nothing listens: a ConnectionError naming it, not minutes of retries."""
    with socket.socket() as sock:  # a free port, closed again: nothing answers there
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    code = textwrap.dedent(
        """
        from easycore import producer

        inc = producer(lambda x: x + 1)
        try:
            inc.map([1, 2], devices=1, engine="ray")
        except ConnectionError as err:
            print("ConnectionError:", err)
        """
    )
    env = {**os.environ, "RAY_ADDRESS": address}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.stdout.startswith("ConnectionError:"), out.stderr[-2000:]
    assert address in out.stdout


class TestTimeoutCountsUnpickling:
    def test_an_item_slow_to_unpickle_is_an_item_timeout(self):
        """An item whose unpickling in the actor takes 30 s is an ItemTimeout with
        timeout=2 (Ray unpickled a task's arguments before the actor's clock started)."""
        t0 = time.monotonic()
        with pytest.raises(ItemTimeout, match=r"item 2\b.*ran past timeout") as info:
            square.map([0, 1, SlowToLoad(2, seconds=30), 3], devices=1, engine="ray", timeout=2)
        assert time.monotonic() - t0 < 25  # (the 30 s would have run out)
        assert info.value.index == 2


def _start_session_child(path):
    """Start a daemon: `sleep` in a session of its own whose parent exits at once (out of
    the actor's process group, and not its child); note its pid in `path`, and hang the
    first time (a timeout then kills the actor)."""
    out = subprocess.run(
        ["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"],
        start_new_session=True,
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(out.stdout)
    marker = Path(f"{path}.hung")
    with open(path, "a") as f:
        f.write(f"{pid}\n")
    if first_time(marker):
        time.sleep(120)
    return pid


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] == "Z"
    except OSError:
        return True


class TestActorsChildren:
    def test_a_session_child_ends_with_the_runner(self, tmp_path):
        """A producer's child in a session of its own ends when the runner closes."""
        path = tmp_path / "pid"
        (tmp_path / "pid.hung").touch()  # (no hang)
        with producer(_start_session_child).open(devices=1, engine="ray") as runner:
            (pid,) = runner.map([str(path)])
            assert not _gone(pid)
        assert wait_for(lambda: _gone(pid), 10), "a closed actor's session child lives"

    def test_a_session_child_ends_with_an_actor_killed_for_a_timeout(self, tmp_path):
        """An actor killed for a timeout takes its work's session child with it."""
        path = tmp_path / "pid"
        (second,) = producer(_start_session_child).map(
            [str(path)], devices=1, engine="ray", timeout=3, retries=1
        )
        first, again = (int(p) for p in path.read_text().split())
        assert again == second != first
        assert wait_for(lambda: _gone(first), 10), "a killed actor's session child lives"
        assert wait_for(lambda: _gone(second), 10), "a closed actor's session child lives"


def test_ctrl_c_does_not_wait_for_an_actor_deaf_to_signals(tmp_path):
    """Ctrl-C while an actor is in a long unit that ignores SIGINT and SIGTERM: its `end`
    could only run after the unit, so it is not waited for (2 s before): the caller is out
    well within that grace, and the actor is gone."""
    script = tmp_path / "deaf.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, signal, sys, time
            from pathlib import Path
            from easycore import producer

            @producer
            def deaf(x):
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                Path({str(tmp_path / "inside")!r}).touch()
                time.sleep(60)
                return x

            try:
                deaf.map([1], devices=1, engine="ray")
            except KeyboardInterrupt:
                print("interrupted", flush=True)
                sys.exit(0)
            """
        )
    )
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert wait_for((tmp_path / "inside").exists, 60)
        actors = {p.pid for p in our_actors()}
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "interrupted"
        took = time.monotonic() - t0
    finally:
        proc.kill()
        proc.communicate()
    assert wait_for(lambda: not ({p.pid for p in our_actors()} & actors), 20)
    # (the grace alone was 2 s; what remains is disconnecting from Ray)
    assert took < 2.0, f"the caller took {took:.1f} s to stop after Ctrl-C"


def test_only_a_runs_first_pool_of_plain_stages_runs_as_tasks():
    """In a one-shot run, a first pool of plain CPU stages runs as Ray tasks (no actor to
    start); a pool fed by another runs on actors, which queue chunks still being made
    upstream (a slot of tasks takes one at a time, idle while the driver hears of each)."""
    from easycore._config.cfgnode import CfgNode
    from easycore._exec.ray.engine import RayEngine

    engine = RayEngine(square.on(1) >> square.on(1), "auto", CfgNode(), tasks=True)
    try:
        assert engine.as_tasks == [True, False]
    finally:
        engine.stop(grace=0.0, report=False)
    assert (square.on(1) >> square.on(1)).map(range(5), engine="ray") == [x**4 for x in range(5)]


def test_task_pools_of_different_runs_never_mix_their_stages():
    """Ray reuses its worker processes, and a task finds the stages an earlier task of its
    pool prepared there: runs one after another (engines freed and made again, perhaps at
    the same address) each get their own functions' results."""
    import gc

    for k in range(6):
        f = producer(lambda x, k=k: (k, x))
        assert f.map(range(6), devices=2, engine="ray") == [(k, x) for x in range(6)]
        gc.collect()
