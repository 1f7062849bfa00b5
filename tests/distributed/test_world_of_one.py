"""easycore.distributed without a launcher (a world of one), and launcher detection."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from easycore import WorkerError, consumer, distributed, producer

PKG = str(Path(__file__).resolve().parents[2] / "pkg")
LAUNCHER_VARS = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
]


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """The test process is a plain `python`: no launcher variables."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


@producer
def square(x):
    return x * x


@producer
def total(batch):
    return sum(batch)


@producer
def fail_at_5(x):
    if x == 5:
        raise ValueError(f"bad item {x}")
    return x


@consumer(init=0)
def summer(total, x):
    return total + x


class TestWorldOfOne:
    def test_where_am_i(self):
        """Without a launcher: rank 0 of 1, local rank 0, the main rank."""
        distributed.init()
        info = distributed.detect_launcher()
        assert info.launcher == "none"
        assert (distributed.rank(), distributed.world_size()) == (0, 1)
        assert (distributed.local_rank(), distributed.local_world_size()) == (0, 1)
        assert distributed.is_main()
        assert distributed.is_distributed() is False
        assert distributed.get_dist_info() == (0, 1)

    def test_init_twice_is_harmless(self):
        """init() needs no MASTER_ADDR here and may be called again."""
        assert distributed.init() is None
        assert distributed.init(timeout=5) is None
        assert distributed.world_size() == 1

    def test_collectives_are_identity(self):
        """all_gather/gather give [obj], broadcast gives obj, barrier returns."""
        obj = {"loss": 0.25, "fn": lambda: 7}
        gathered = distributed.all_gather(obj)
        assert len(gathered) == 1
        assert gathered[0]["loss"] == 0.25
        assert gathered[0]["fn"]() == 7
        assert distributed.gather("x") == ["x"]
        assert distributed.broadcast([1, 2]) == [1, 2]
        assert distributed.barrier() is None

    @pytest.mark.parametrize(("call", "arg"), [("gather", "dst"), ("broadcast", "src")])
    @pytest.mark.parametrize("bad", [1, -1, True])
    def test_bad_rank_is_value_error(self, call, arg, bad):
        """A dst/src that is not a rank of the job is a ValueError naming it."""
        with pytest.raises(ValueError, match=f"{arg}={bad!r} is not a rank"):
            getattr(distributed, call)("x", **{arg: bad})

    def test_main_only_runs_on_main(self):
        """main_only calls the function on rank 0 and keeps its name."""

        @distributed.main_only
        def save(x):
            """Save x."""
            return x + 1

        assert save(1) == 2
        assert save.__name__ == "save"
        assert save.__doc__ == "Save x."

    def test_map_equals_plain_map(self):
        """distributed=True in a world of one gives the ordinary result."""
        data = range(10)
        assert square.map(data, devices="inline", distributed=True) == [x * x for x in data]
        assert (square >> summer).map(data, devices="inline", distributed=True) == 285
        assert total.map(data, devices="inline", batch_size=3, distributed=True) == (
            total.map(data, devices="inline", batch_size=3)
        )

    def test_stage_map_forwards_distributed(self):
        """Stage.map accepts distributed=True too, generators included."""
        assert square.map((i for i in range(4)), devices="inline", distributed=True) == [0, 1, 4, 9]

    def test_error_is_worker_error_naming_rank(self):
        """An error becomes WorkerError naming rank 0, with the original as __cause__."""
        with pytest.raises(WorkerError, match=r"^rank 0 of 1 failed: fail_at_5 raised") as info:
            fail_at_5.map(range(8), devices="inline", distributed=True)
        assert isinstance(info.value.__cause__, ValueError)
        assert info.value.index == 5
        assert info.value.stage == "fail_at_5"

    def test_bad_arguments_fail_before_running(self):
        """Arguments are checked as in an ordinary map."""
        with pytest.raises(ValueError, match="batch_size"):
            square.map(range(3), devices="inline", batch_size=0, distributed=True)

    @pytest.mark.parametrize("option", [{"errors": "skip"}, {"resume": "run.db"}])
    def test_long_job_ledgers_are_refused(self, option, tmp_path, monkeypatch):
        """errors="skip" and resume= are not there yet with distributed=True: a clear
        ValueError, nothing run and no ledger written."""
        monkeypatch.chdir(tmp_path)
        with pytest.raises(ValueError, match="not supported with distributed=True"):
            square.map(range(3), devices="inline", distributed=True, **option)
        assert not (tmp_path / "run.db").exists()

    def test_workers_are_replaced_on_every_rank(self, tmp_path):
        """max_items_per_worker reaches each rank's workers: 12 items, one worker replaced
        every 3, so 4 worker processes ran them."""

        @producer
        def pid_of(x):
            return os.getpid()

        pids = pid_of.map(range(12), devices=1, distributed=True, max_items_per_worker=3)
        assert len(pids) == 12
        assert len(set(pids)) == 4

    def test_local_devices_share_the_cores(self, monkeypatch):
        """devices="local" without GPUs: cores // local_world_size CPU workers, at least 1."""
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "4")
        monkeypatch.setenv("LOCAL_RANK", "1")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        cores = len(os.sched_getaffinity(0))
        assert distributed.local_devices() == ["cpu"] * max(1, cores // 2)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(10 * cores))
        assert distributed.local_devices() == ["cpu"]

    def test_no_torch_without_a_launcher(self):
        """A world of one never imports torch: init, collectives and map stay light."""
        code = (
            "import sys\n"
            "from easycore import distributed, producer\n"
            "distributed.init(); distributed.barrier()\n"
            "assert distributed.all_gather(1) == [1] and distributed.broadcast(2) == 2\n"
            "inc = producer(lambda x: x + 1)\n"
            "assert inc.map([1], devices='inline', distributed=True) == [2]\n"
            "print('torch' in sys.modules)\n"
        )
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        env["PYTHONPATH"] = PKG + os.pathsep + os.environ.get("PYTHONPATH", "")
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
        )
        assert out.stdout.strip() == "False"


TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "1234",
}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}


class TestDetectLauncher:
    def test_none(self):
        """No launcher variables: a world of one, no rendezvous address."""
        info = distributed.detect_launcher({})
        assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("none", 0, 1, 0)
        assert (info.master_addr, info.master_port) == (None, None)

    def test_torchrun(self):
        """torchrun's variables give rank, sizes and the rendezvous address."""
        info = distributed.detect_launcher(TORCHRUN)
        assert info == distributed.LaunchInfo("torchrun", 3, 4, 1, 2, "10.0.0.1", 1234)

    def test_torchrun_wins_over_slurm(self):
        """torchrun inside a Slurm allocation: torchrun's variables count."""
        assert distributed.detect_launcher({**SLURM, **TORCHRUN}).launcher == "torchrun"

    def test_slurm(self):
        """Slurm's variables: rank, world, local rank, first host of the node list."""
        env = {**SLURM, "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NTASKS_PER_NODE": "4"}
        info = distributed.detect_launcher(env)
        assert info == distributed.LaunchInfo("slurm", 5, 8, 1, 4, "node01", 29500)

    def test_slurm_from_process_env(self, monkeypatch):
        """rank(), world_size() and local_rank() read Slurm's variables before init."""
        for k, v in SLURM.items():
            monkeypatch.setenv(k, v)
        assert (distributed.rank(), distributed.world_size(), distributed.local_rank()) == (5, 8, 1)
        assert not distributed.is_main()

    @pytest.mark.parametrize(
        ("nodelist", "host"),
        [
            ("node[01-02]", "node01"),
            ("gpu7", "gpu7"),
            ("gpu[3,5-7],cpu1", "gpu3"),
            ("n1,n2", "n1"),
            ("rack[2-3]-node[04-05]", "rack2-node04"),
        ],
    )
    def test_slurm_first_host(self, nodelist, host):
        """Rank 0 runs on the first host of SLURM_JOB_NODELIST, zero-padding kept."""
        info = distributed.detect_launcher({**SLURM, "SLURM_JOB_NODELIST": nodelist})
        assert info.master_addr == host

    def test_slurm_nodelist_fallback_and_overrides(self):
        """SLURM_NODELIST is read when SLURM_JOB_NODELIST is absent; MASTER_* win over both."""
        info = distributed.detect_launcher({**SLURM, "SLURM_NODELIST": "a[7-9]"})
        assert info.master_addr == "a7"
        env = {**SLURM, "SLURM_NODELIST": "a[7-9]", "MASTER_ADDR": "h", "MASTER_PORT": "999"}
        info = distributed.detect_launcher(env)
        assert (info.master_addr, info.master_port) == ("h", 999)

    def test_slurm_port_from_job_id(self):
        """Without MASTER_PORT the port is 29500 + job id % 10000."""
        info = distributed.detect_launcher({**SLURM, "SLURM_JOB_ID": "123456"})
        assert info.master_port == 29500 + 3456

    @pytest.mark.parametrize(
        ("tasks", "node", "per_node"), [("4(x2)", 1, 4), ("3(x2),1", 2, 1), ("2", 0, 2)]
    )
    def test_slurm_tasks_per_node(self, tasks, node, per_node):
        """SLURM_TASKS_PER_NODE ("3(x2),1") gives this node's number of ranks."""
        env = {**SLURM, "SLURM_TASKS_PER_NODE": tasks, "SLURM_NODEID": str(node)}
        assert distributed.detect_launcher(env).local_world_size == per_node
