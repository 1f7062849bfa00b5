"""easycore.common.parallel / easycore.torch.parallel: 0.4's runner classes on the executor."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import easycore
import easycore.common.parallel as common_parallel
import easycore.torch.parallel as torch_parallel
from easycore import WorkerError
from easycore.common.config import CfgNode as CN
from easycore.common.parallel import BaseRunner, OrderedRunner, UnorderedRunner


class Counting(UnorderedRunner):
    """Each worker counts the items it saw in its own cfg copy."""

    @staticmethod
    def producer_init(device, cfg):
        cfg.count = 0

    @staticmethod
    def producer_work(device, cfg, data):
        cfg.count += 1
        own = isinstance(cfg, CN) and not cfg.is_frozen()
        return os.getpid(), cfg.count, own, device

    @staticmethod
    def consumer_init(cfg):
        cfg.fresh = "seen" not in cfg  # a key left by an earlier call would show here
        cfg.seen = []

    @staticmethod
    def consumer_work(cfg, data):
        cfg.seen.append(data)

    @staticmethod
    def consumer_end(cfg):
        return cfg.fresh, cfg.seen


class Power(UnorderedRunner):
    @staticmethod
    def producer_work(device, cfg, data):
        return data**cfg.exponent

    @staticmethod
    def consumer_init(cfg):
        cfg.sum = 0

    @staticmethod
    def consumer_work(cfg, data):
        cfg.sum += data

    @staticmethod
    def consumer_end(cfg):
        return cfg.sum


class SlowFirst(OrderedRunner):
    """Item 0 takes longest: order shows whether the consumer waits for it."""

    @staticmethod
    def producer_work(device, cfg, data):
        if data == 0:
            time.sleep(0.5)
        return data

    @staticmethod
    def consumer_init(cfg):
        cfg.out = []

    @staticmethod
    def consumer_work(cfg, data):
        cfg.out.append(data)

    @staticmethod
    def consumer_end(cfg):
        return cfg.out


class SlowFirstUnordered(UnorderedRunner):
    producer_work = SlowFirst.producer_work
    consumer_init = SlowFirst.consumer_init
    consumer_work = SlowFirst.consumer_work
    consumer_end = SlowFirst.consumer_end


class Ending(UnorderedRunner):
    """producer_end writes how many items its worker saw into cfg.out_dir."""

    @staticmethod
    def producer_init(device, cfg):
        cfg.count = 0

    @staticmethod
    def producer_work(device, cfg, data):
        cfg.count += 1
        return data

    @staticmethod
    def producer_end(device, cfg):
        Path(cfg.out_dir, str(os.getpid())).write_text(str(cfg.count))


class FailingWork(UnorderedRunner):
    @staticmethod
    def producer_work(device, cfg, data):
        return 1 // (data - 3)


class FailingInit(UnorderedRunner):
    @staticmethod
    def producer_init(device, cfg):
        raise RuntimeError("no model file")


class FailingEnd(UnorderedRunner):
    @staticmethod
    def producer_end(device, cfg):
        raise OSError("disk full")


class FailingConsumer(UnorderedRunner):
    @staticmethod
    def consumer_work(cfg, data):
        raise KeyError(data)


def _child_env():
    """The environment for a fresh interpreter that imports easycore as this one does."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def counts_by_worker(rows):
    out = {}
    for pid, count, _own, _device in rows:
        out.setdefault(pid, []).append(count)
    return {pid: sorted(counts) for pid, counts in out.items()}


class TestModules:
    def test_torch_parallel_is_common_parallel(self):
        """Both 0.4 paths give the same three classes."""
        for name in ("BaseRunner", "UnorderedRunner", "OrderedRunner"):
            assert getattr(torch_parallel, name) is getattr(common_parallel, name)
        assert common_parallel.__all__ == ["BaseRunner", "OrderedRunner", "UnorderedRunner"]

    def test_import_does_not_load_torch(self):
        """Importing the 0.4 paths keeps `import easycore` light: no torch."""
        code = (
            "import sys, easycore.common.parallel, easycore.torch.parallel, "
            "easycore.common.config, easycore.common.registry; print('torch' in sys.modules)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=_child_env(),
            check=True,
            timeout=60,
        )
        assert out.stdout.strip() == "False"


class TestLifecycle:
    def test_close_activate(self):
        """is_activate follows close() and activate(); close() is idempotent."""
        runner = Power(devices=2, cfg=CN({"exponent": 2}))
        assert runner.is_activate
        assert runner(range(4)) == 14
        runner.close()
        runner.close()
        assert not runner.is_activate
        with pytest.raises(RuntimeError, match="activate"):
            runner(range(4))
        runner.activate()
        assert runner.is_activate
        assert runner(range(4)) == 14
        runner.close()

    def test_activate_takes_a_fresh_copy_of_cfg(self):
        """As in 0.4, activate() copies the runner's cfg again, changes included."""
        cfg = CN()
        cfg.exponent = 2
        runner = Power(devices=2, cfg=cfg)
        assert runner(range(4)) == 14
        runner.close()
        cfg.exponent = 3
        runner.activate()
        assert runner(range(4)) == 36
        runner.close()

    def test_base_runner_defaults(self):
        """The default six methods: producer_work passes items on, consumer_end returns None."""
        runner = BaseRunner(devices=1)
        assert runner(range(3)) is None
        runner.close()

    def test_queue_scale_accepted(self):
        """queue_scale is accepted; results do not depend on it."""
        runner = Power(devices=2, cfg={"exponent": 1}, queue_scale=0.5)
        assert runner.queue_scale == 0.5
        assert runner(iter(range(1000))) == sum(range(1000))
        runner.close()

    def test_inline_devices(self):
        """devices="inline" runs everything in the calling process, for debugging."""
        runner = Counting(devices="inline")
        fresh, rows = runner(range(5))
        assert fresh and [r[:3] for r in rows] == [(os.getpid(), i, True) for i in range(1, 6)]
        runner.close()

    def test_impossible_device_fails_before_start(self):
        """A device that cannot exist is a ValueError and starts no process."""
        with pytest.raises(ValueError, match="tpu"):
            Power(devices=["tpu"])
        with pytest.raises(ValueError):
            Power(devices=0)

    def test_interpreter_exit_closes(self, tmp_path):
        """A runner never closed runs producer_end at interpreter exit, as 0.4's atexit did."""
        code = f"""
import os
from pathlib import Path
from easycore.common.parallel import UnorderedRunner

class Ending(UnorderedRunner):
    @staticmethod
    def producer_work(device, cfg, data):
        return data

    @staticmethod
    def producer_end(device, cfg):
        Path(cfg.out_dir, str(os.getpid())).write_text("ended")

runner = Ending(devices=2, cfg={{"out_dir": {str(tmp_path)!r}}})
runner(range(10))
"""
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=_child_env(),
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert [p.read_text() for p in tmp_path.iterdir()] == ["ended", "ended"]

    def test_garbage_collection_closes(self, tmp_path):
        """A runner dropped without close() runs producer_end, as 0.4's __del__ did."""
        runner = Ending(devices=2, cfg={"out_dir": str(tmp_path)})
        runner(range(10))
        del runner
        gc.collect()
        assert sum(int(p.read_text()) for p in tmp_path.iterdir()) == 10


class TestCfgCopies:
    def test_each_worker_keeps_state_in_its_own_copy(self, two_devices):
        """Every worker counts in its own mutable copy, kept from call to call."""
        runner = Counting(devices=two_devices)
        fresh1, first = runner(range(30))
        fresh2, second = runner(range(30))
        runner.close()
        assert fresh1 and fresh2  # the consumer's copy is new for every call
        rows = first + second
        assert all(own for _, _, own, _ in rows)
        assert {device for *_, device in rows} <= set(two_devices)
        for counts in counts_by_worker(rows).values():
            assert counts == list(range(1, len(counts) + 1))  # one counter per worker
        assert sum(len(c) for c in counts_by_worker(rows).values()) == 60

    def test_callers_cfg_is_not_changed(self):
        """The workers' and the consumer's changes stay in their copies."""
        cfg = CN({"base": 1})
        runner = Counting(devices=2, cfg=cfg)
        runner(range(5))
        runner.close()
        assert cfg == {"base": 1}

    def test_frozen_cfg_still_gives_mutable_copies(self):
        """A frozen easycore.CfgNode works as cfg: the copies are mutable."""
        cfg = easycore.CfgNode({"exponent": 2})
        runner = Counting(devices=1, cfg=cfg)
        fresh, rows = runner(range(3))
        runner.close()
        assert fresh and all(own for _, _, own, _ in rows)

    def test_producer_end_sees_the_state(self, tmp_path):
        """producer_end runs at close() in every worker, with that worker's copy."""
        runner = Ending(devices=["cpu", "cpu"], cfg={"out_dir": str(tmp_path)})
        assert runner(range(10)) is None
        assert list(tmp_path.iterdir()) == []
        runner.close()
        files = list(tmp_path.iterdir())
        assert len(files) == 2
        assert sum(int(p.read_text()) for p in files) == 10


class TestOrder:
    def test_ordered_runner_keeps_input_order(self):
        """OrderedRunner's consumer sees results in input order."""
        runner = SlowFirst(devices=2)
        assert runner(range(20)) == list(range(20))
        runner.close()

    def test_unordered_runner_delivers_as_finished(self):
        """UnorderedRunner's consumer sees results as they finish."""
        runner = SlowFirstUnordered(devices=2)
        out = runner(range(20))
        runner.close()
        assert sorted(out) == list(range(20))
        assert out[0] != 0


class TestErrors:
    def test_failing_producer_work_raises_instead_of_hanging(self, two_devices):
        """A raising producer_work is a WorkerError (0.4 hung); activate() recovers."""
        runner = FailingWork(devices=two_devices)
        with pytest.raises(WorkerError, match=r"FailingWork\.producer") as info:
            runner(range(10))
        assert isinstance(info.value.__cause__, ZeroDivisionError)
        assert not runner.is_activate
        runner.activate()
        assert runner(range(3)) is None
        runner.close()

    def test_failing_producer_init(self):
        """A raising producer_init fails the construction with WorkerError."""
        with pytest.raises(WorkerError, match="no model file") as info:
            FailingInit(devices=2)
        assert isinstance(info.value.__cause__, RuntimeError)

    def test_failing_producer_end(self):
        """A raising producer_end makes close() raise WorkerError; the workers are gone."""
        runner = FailingEnd(devices=1)
        runner(range(3))
        with pytest.raises(WorkerError, match="disk full"):
            runner.close()
        assert not runner.is_activate

    def test_failing_consumer(self):
        """A raising consumer_work is a WorkerError naming the consumer."""
        runner = FailingConsumer(devices=1)
        with pytest.raises(WorkerError, match=r"FailingConsumer\.consumer") as info:
            runner(range(3))
        assert isinstance(info.value.__cause__, KeyError)
        runner.close()
