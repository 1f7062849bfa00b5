"""The process executor: results, ordering, injection, runners, devices, backpressure."""

from __future__ import annotations

import itertools
import os
import random
import time

import pytest

from easycore import CfgNode, WorkerError, consumer, producer

CPUS = len(os.sched_getaffinity(0))


@producer
def square(x):
    return x * x


@consumer(init=0)
def summer(total, x):
    return total + x


@producer
def whoami(x, *, device, worker):
    return (x, device, worker, os.getpid())


class TestMap:
    def test_headline(self):
        """The contract's example (docs/contract.md): sum of squares on 4 CPU workers."""
        assert (square >> summer).map(range(100), devices=4) == 328350

    def test_ordered_equals_sequential(self, two_devices):
        """Ordered map returns exactly the sequential results, in input order."""
        data = list(range(500))
        assert square.map(data, devices=two_devices) == [x * x for x in data]

    def test_unordered_is_permutation(self):
        """ordered=False gives the same results in some order."""
        out = square.map(range(300), devices=2, ordered=False)
        assert sorted(out) == [x * x for x in range(300)]

    def test_fused_producers(self):
        """Consecutive producers run fused, item by item."""
        inc = producer(lambda x: x + 1)
        neg = producer(lambda x: -x)
        assert (inc >> neg >> square).map(range(5), devices=2) == [1, 4, 9, 16, 25]

    def test_lambdas_and_closures_from_test_body(self):
        """Functions defined here travel by cloudpickle."""
        offset = 1000

        def add(x):
            return x + offset

        p = (
            producer(add)
            >> producer(lambda y: y * 2)
            >> consumer(init=list)(lambda a, y: a.append(y))
        )
        assert p.map([1, 2, 3], devices=2) == [2002, 2004, 2006]

    def test_generators_and_empty_input(self):
        """Any iterable works, including generators and empty ones."""
        assert square.map((i for i in range(5)), devices=2) == [0, 1, 4, 9, 16]
        assert square.map([], devices=2) == []
        assert (square >> summer).map(iter(()), devices=2) == 0

    def test_batch_size(self):
        """batch_size hands lists of up to k items; the last may be shorter."""
        sizes = producer(lambda batch: list(batch))
        assert sizes.map(range(7), devices=2, batch_size=3) == [[0, 1, 2], [3, 4, 5], [6]]

    def test_consumer_sees_items_in_order(self):
        """With ordered=True the consumer folds in input order."""
        collect = consumer(init=list)(lambda acc, y: acc.append(y))
        assert (square >> collect).map(range(50), devices=2) == [x * x for x in range(50)]

    def test_injection(self):
        """device and worker are injected; every worker index appears once per worker."""
        out = whoami.map(range(40), devices=2)
        assert [x for x, *_ in out] == list(range(40))
        assert {d for _, d, _, _ in out} == {"cpu"}
        workers = {(w, pid) for _, _, w, pid in out}
        assert {w for w, _ in workers} <= {0, 1}
        assert os.getpid() not in {pid for _, pid in workers}

    def test_cfg_frozen_in_workers(self):
        """Workers receive cfg as a frozen CfgNode."""

        def probe(x, *, cfg):
            try:
                cfg.A.B = 2
            except AttributeError as exc:
                return (type(cfg).__name__, cfg.A.B, type(exc).__name__)
            return "mutable!"

        out = producer(probe).map([0], devices=1, cfg={"A": {"B": 1}})
        assert out == [("CfgNode", 1, "FrozenError")]

    def test_cfg_node_accepted(self):
        """A CfgNode (frozen or not) works as cfg."""
        cfg = CfgNode({"K": 3})
        assert producer(lambda x, cfg: x * cfg.K).map([1, 2], devices=1, cfg=cfg) == [3, 6]

    def test_torch_tensors(self):
        """Tensors go in and come back with values, dtype and shape."""
        import torch

        data = [torch.arange(6, dtype=torch.float64).reshape(2, 3) + i for i in range(4)]
        out = producer(lambda t: t * 2).map(data, devices=2)
        for a, b in zip(data, out, strict=True):
            assert b.dtype == torch.float64
            assert torch.equal(a * 2, b)

    def test_thread_budget(self):
        """Workers limit torch's intra-op threads so workers x threads <= cores."""
        if "OMP_NUM_THREADS" in os.environ or "MKL_NUM_THREADS" in os.environ:
            pytest.skip("the user set a thread count")

        def threads(x):
            import torch

            return torch.get_num_threads()

        assert producer(threads).map([0, 1], devices=2) == [max(1, CPUS // 2)] * 2

    def test_progress_bar(self, capsys):
        """progress=True shows a tqdm bar with the total when len(data) exists."""
        assert square.map(range(20), devices=2, progress=True) == [x * x for x in range(20)]
        err = capsys.readouterr().err
        assert "20/20" in err


class TestSeed:
    def test_seeded_same_whatever_workers(self):
        """A seeded run gives the same output with 1 and 2 workers and any finishing order."""
        import numpy as np
        import torch

        def draw(x):
            return (random.random(), float(np.random.rand()), float(torch.rand(1)))

        one = producer(draw).map(range(30), devices=1, seed=123)
        two = producer(draw).map(range(30), devices=2, seed=123)
        assert one == two
        assert len(set(one)) == 30
        other = producer(draw).map(range(30), devices=2, seed=124)
        assert other != one

    def test_unseeded_workers_differ(self):
        """Without seed, workers never share a random stream."""

        def first_draws(worker):
            import torch

            return (float(torch.rand(1)), random.random())

        stage = producer(init=first_draws)(lambda x, *, state, worker: (worker, state))
        with stage.open(devices=2) as runner:
            seen = {}
            deadline = time.monotonic() + 30
            while len(seen) < 2 and time.monotonic() < deadline:
                for w, draws in runner.map(range(8)):
                    seen[w] = draws
        assert sorted(seen) == [0, 1]
        (t0, r0), (t1, r1) = seen[0], seen[1]
        assert t0 != t1 and r0 != r1


class TestRunner:
    def test_init_once_per_worker_across_maps(self, tmp_path):
        """init runs once per worker per activation, not per map; end at close."""
        log = tmp_path / "log"

        def init(worker):
            with open(log, "a") as f:
                f.write(f"init {worker}\n")
            return worker * 100

        def end(state, worker):
            with open(log, "a") as f:
                f.write(f"end {worker} {state}\n")

        stage = producer(init=init, end=end)(lambda x, *, state: x + state)
        with stage.open(devices=2) as runner:
            a = runner.map(range(10))
            b = runner.map(range(10))
            assert runner.is_active
        assert not runner.is_active
        for out in (a, b):
            assert all(y - x in (0, 100) for x, y in zip(range(10), out, strict=True))
        lines = sorted(log.read_text().splitlines())
        assert lines == ["end 0 0", "end 1 100", "init 0", "init 1"]

    def test_closed_runner_refuses_then_reactivates(self):
        """map on a closed runner is a RuntimeError saying to call activate()."""
        runner = square.open(devices=1)
        runner.close()
        runner.close()  # idempotent
        with pytest.raises(RuntimeError, match=r"activate\(\)"):
            runner.map([1])
        runner.activate()
        try:
            assert runner.map([3]) == [9]
        finally:
            runner.close()

    def test_imap_on_runner_and_early_break(self):
        """Breaking out of runner.imap leaves the runner usable."""
        with square.open(devices=2) as runner:
            it = runner.imap(range(10_000))
            assert [next(it) for _ in range(5)] == [0, 1, 4, 9, 16]
            it.close()
            assert runner.map(range(4)) == [0, 1, 4, 9]

    def test_consumer_on_runner(self):
        """runner.map folds with the pipeline's consumer."""
        with (square >> summer).open(devices=2) as runner:
            assert runner.map(range(10)) == 285
            assert runner.map(range(3)) == 5

    def test_repr(self):
        """A runner says what it runs and where."""
        with square.open(devices=1) as runner:
            assert "square" in repr(runner) and "active" in repr(runner)
        assert "closed" in repr(runner)


class TestBackpressure:
    def test_endless_generator_with_islice(self):
        """imap over an endless generator ends under islice; input is pulled lazily."""
        pulled = itertools.count()

        def source():
            for i in itertools.count():
                next(pulled)
                yield i

        out = list(itertools.islice(square.imap(source(), devices=2), 2000))
        assert out == [x * x for x in range(2000)]
        ahead = next(pulled) - 2000
        assert ahead < 120_000, f"pulled {ahead} items ahead of the consumer"

    def test_slow_item_stalls_ordered_stream(self):
        """A slow item stalls an ordered stream instead of letting the buffer grow."""
        pulled = []

        def source():
            for i in range(1_000_000):
                pulled.append(i)
                yield i

        def work(x):
            if x == 0:
                time.sleep(1.0)
            return x

        it = producer(work).imap(source(), devices=2)
        try:
            assert next(it) == 0
            assert len(pulled) < 120_000
        finally:
            it.close()


class TestDevices:
    @pytest.mark.parametrize(
        "devices",
        [0, -1, True, "tpu", "cuda:7", "cuda:x", [], ["cpu", "gpu"], 2.5, None, "cuda"],
    )
    def test_impossible_devices(self, devices):
        """An impossible device is a ValueError before any process starts."""
        if devices == "cuda":
            from helpers import HAS_CUDA

            if HAS_CUDA:
                pytest.skip("this machine has a GPU")
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match="device"):
            square.map([1], devices=devices)
        assert time.perf_counter() - t0 < 5

    def test_device_forms(self):
        """int, strings, torch.device and lists (with repeats) are accepted."""
        import torch

        assert whoami.map([1], devices="cpu")[0][1] == "cpu"
        assert whoami.map([1], devices=torch.device("cpu"))[0][1] == "cpu"
        assert (
            len({w for *_, w, _ in whoami.map(range(8), devices=["cpu", torch.device("cpu")])}) >= 1
        )

    def test_auto(self):
        """'auto' without GPUs gives one CPU worker per core."""
        from helpers import HAS_CUDA

        if HAS_CUDA:
            pytest.skip("GPU machine")
        with square.open(devices="auto") as runner:
            assert runner.devices == ("cpu",) * CPUS

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"batch_size": 0},
            {"batch_size": "2"},
            {"timeout": 0},
            {"timeout": -1},
            {"retries": -1},
            {"retries": 1.5},
            {"seed": "x"},
            {"prefetch": 0},
            {"prefetch": True},
            {"prefetch": "2"},
        ],
    )
    def test_bad_run_arguments(self, kwargs):
        """Bad per-run arguments are ValueErrors before any process starts."""
        with pytest.raises(ValueError):
            square.map([1], devices=2, **kwargs)

    def test_more_workers_than_the_machine_can_start(self):
        """A worker count beyond the open-file limit is a ValueError naming the limit, before
        any process starts."""
        import resource

        files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match=r"ulimit -n"):
            square.map([1], devices=10**6)
        with pytest.raises(ValueError, match=r"open files"):
            square.open(devices=files)
        assert time.perf_counter() - t0 < 5

    def test_many_more_workers_than_cores_is_allowed(self):
        """Counts far above the cores are fine (I/O-bound work)."""
        assert square.map(range(40), devices=4 * CPUS + 1) == [x * x for x in range(40)]


class TestStartMethods:
    @pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
    def test_each_start_method(self, method):
        """Workers start with spawn, forkserver (the default on Linux) or fork."""
        assert (square >> summer).map(range(10), devices=2, start_method=method) == 285

    def test_unknown_start_method(self):
        """An unknown start method is a ValueError before any process starts."""
        with pytest.raises(ValueError, match="start_method"):
            square.map([1], devices=1, start_method="teleport")

    def test_unguarded_script(self, tmp_path):
        """A script without `if __name__ == "__main__"` works: workers never re-run it."""
        import subprocess
        import sys

        script = tmp_path / "unguarded.py"
        script.write_text(
            "from easycore import producer\n"
            "print('top level ran')\n"
            "print(producer(lambda x: x + 1).map([1, 2], devices=2, start_method='spawn'))\n"
        )
        pkg = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "pkg")
        out = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": pkg},
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("top level ran") == 1
        assert "[2, 3]" in out.stdout


class TestInline:
    def test_same_semantics(self):
        """inline gives the same results, injection, cfg, seed and errors."""

        def draw(x, *, device, worker, cfg):
            return (x * cfg.K, device, worker, random.random())

        a = producer(draw).map(range(5), devices="inline", cfg={"K": 2}, seed=7)
        b = producer(draw).map(range(5), devices=2, cfg={"K": 2}, seed=7)
        assert [r[0] for r in a] == [0, 2, 4, 6, 8]
        assert {r[1] for r in a} == {"cpu"} and {r[2] for r in a} == {0}
        assert [r[3] for r in a] == [r[3] for r in b]

    def test_inline_no_processes(self):
        """inline starts no process at all."""
        pid = producer(lambda x: os.getpid()).map([1], devices="inline")
        assert pid == [os.getpid()]

    def test_inline_error(self):
        """An error inline is the same WorkerError with the original as __cause__."""

        def boom_at_two(x):
            if x == 2:
                raise KeyError(x)
            return x

        with pytest.raises(WorkerError, match="item 2") as info:
            (producer(lambda x: x) >> producer(boom_at_two)).map([0, 1, 2], devices="inline")
        assert isinstance(info.value.__cause__, KeyError)
        assert info.value.stage == "boom_at_two"


def _count_lines(path) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _wait_for_lines(path, n: int, deadline: float = 30.0) -> int:
    end = time.monotonic() + deadline
    while _count_lines(path) < n and time.monotonic() < end:
        time.sleep(0.02)
    return _count_lines(path)


def _wait_until_still(path, still: float = 0.3, deadline: float = 30.0) -> int:
    """The count of lines once it has not changed for ``still`` seconds (at most ``deadline``)."""
    end = time.monotonic() + deadline
    n, since = _count_lines(path), time.monotonic()
    while time.monotonic() - since < still and time.monotonic() < end:
        time.sleep(0.02)
        if (m := _count_lines(path)) != n:
            n, since = m, time.monotonic()
    return n


def _logged(path):
    @producer
    def slow(x):
        time.sleep(0.02)
        with open(path, "a") as f:
            f.write(f"{x}\n")
        return x * x

    return slow


class TestPrefetch:
    @pytest.mark.parametrize("prefetch", [None, 5])
    def test_workers_run_ahead_by_prefetch_while_the_caller_is_away(self, tmp_path, prefetch):
        """Work starts when imap is called; with the caller away, each worker finishes
        `prefetch` items (2 by default) and then waits: no more."""
        log = tmp_path / "done"
        k = prefetch or 2
        with _logged(log).open(devices=2) as runner:
            results = runner.imap(range(60), prefetch=prefetch)  # no next() yet
            assert _wait_for_lines(log, 2 * k) == 2 * k
            time.sleep(0.5)  # would be ~40 more items if nothing held the workers back
            assert _count_lines(log) == 2 * k
            assert list(results) == [x * x for x in range(60)]

    def test_the_workers_are_refilled_while_the_caller_takes_their_stock(self, tmp_path):
        """Back from a pause, the caller finds a stock of results; each one it takes makes
        room, and new work goes out as it takes them, not once the stock is gone (the
        workers sat idle through the stock: a training loop lost ~0.7 s after each pause)."""
        log = tmp_path / "done"
        with _logged(log).open(devices=2, prefetch=5) as runner:
            results = runner.imap(range(60))
            assert _wait_for_lines(log, 10) == 10  # the stock: 5 results a worker
            got = [next(results)]  # (this call reads the stock, and sends what fits)
            stocked = _wait_until_still(log)  # what that call sent, done
            got += [next(results), next(results)]  # both from the stock
            assert _wait_for_lines(log, stocked + 1, deadline=10) > stocked
            assert got + list(results) == [x * x for x in range(60)]

    def test_a_deep_prefetch_feeds_an_ordered_stream_from_every_worker(self):
        """Consecutive items go to different workers, however deep the prefetch: were the
        first `prefetch` items all queued at one worker, an ordered stream would get them at
        one worker's pace while the other's results waited behind them."""

        @producer
        def where(x):
            time.sleep(0.02)
            return os.getpid()

        with where.open(devices=2) as runner:
            pids = runner.map(range(16), prefetch=8)
        assert len(set(pids[0:16:2])) == 1
        assert len(set(pids[1:16:2])) == 1
        assert pids[0] != pids[1]

    def test_open_sets_the_default(self, tmp_path):
        """open(prefetch=k) is the default of the runner's runs."""
        log = tmp_path / "done"
        with _logged(log).open(devices=2, prefetch=4) as runner:
            results = runner.imap(range(30))
            assert _wait_for_lines(log, 8) == 8
            time.sleep(0.3)
            assert _count_lines(log) == 8
            assert list(results) == [x * x for x in range(30)]

    def test_one_shot_imap_starts_at_the_call(self, tmp_path):
        """Pipeline.imap starts workers and work when called, not at the first next()."""
        log = tmp_path / "done"
        results = _logged(log).imap(range(20), devices=2, prefetch=3)
        try:
            assert _wait_for_lines(log, 6) == 6
        finally:
            results.close()

    def test_an_imap_never_iterated_leaves_the_runner_usable(self, tmp_path):
        """Chunks sent when imap was called are waited for and dropped if the iterator is
        dropped unused; the next run gets its own results."""
        import gc

        with _logged(tmp_path / "done").open(devices=2) as runner:
            results = runner.imap(range(10))
            del results
            gc.collect()
            assert runner.map(range(5)) == [0, 1, 4, 9, 16]

    def test_waiting_results_stay_in_shared_memory(self):
        """A big array that waited for the caller is a view of the worker's shared-memory
        segment: taking it copies nothing."""
        import numpy as np

        @producer
        def big(x):
            return np.full(64 * 1024, x, dtype=np.float32)  # 256 KiB

        with big.open(devices=1) as runner:
            results = runner.imap(range(4), prefetch=4)
            time.sleep(0.3)
            arrays = list(results)
            mappings = list(runner._engine.workers.workers[0].chan.peer.values())
            for x, a in enumerate(arrays):
                assert a[0] == x
                addr = a.ctypes.data
                assert any(m.addr <= addr < m.addr + m.size for m in mappings)
