"""easycore.distributed on real launches: torchrun on one node, two "nodes", a Slurm-like job.

Each topology runs ``scripts/run_job.py`` on two ranks over loopback (gloo); every rank
pickles what it saw, and the tests compare that with the single-process run computed here.
Two more launches run ``scripts/dead_rank.py`` (a rank dies outright) and the example with
the one-node line of docs/guide/beyond-one-machine.md. All launches run side by side, each
bounded by a deadline; every process they start carries a token in its environment, so
leftovers are found and killed.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.timeout(240)

HERE = Path(__file__).resolve().parent
PKG = str(HERE.parents[1] / "pkg")
SCRIPT = str(HERE / "scripts" / "run_job.py")
DEAD_RANK = str(HERE / "scripts" / "dead_rank.py")
EXAMPLE = str(HERE.parents[1] / "examples" / "distributed_map.py")
sys.path.insert(0, str(HERE / "scripts"))

import jobs  # noqa: E402

LAUNCH_SECONDS = 180  # every launch, side by side; they take ~40 s on 2 cores
TOKEN_VAR = "EASYCORE_TEST_JOB"  # marks every process of a launch, to find leftovers
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
LAUNCHER_VARS += ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
TOPOLOGIES = ["one_node", "two_nodes", "slurm_like"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(token: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))
    }
    env["PYTHONPATH"] = PKG + os.pathsep + os.environ.get("PYTHONPATH", "")
    env[TOKEN_VAR] = token
    env["OMP_NUM_THREADS"] = "1"
    return env


def commands(
    topology: str, port: int, script: str, args: list[str]
) -> list[tuple[list[str], dict[str, str]]]:
    """The processes one launch starts, each with the environment variables it adds."""
    run = [sys.executable, "-m", "torch.distributed.run"]
    where = ["--master-addr=127.0.0.1", f"--master-port={port}"]
    if topology == "one_node":
        return [([*run, "--nproc-per-node=2", *where, script, *args], {})]
    if topology == "two_nodes":
        node = ["--nnodes=2", "--nproc-per-node=1"]
        return [([*run, *node, f"--node-rank={k}", *where, script, *args], {}) for k in range(2)]
    slurm = {"SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2", "SLURM_NODEID": "0"}
    slurm |= {"SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "4242", "MASTER_PORT": str(port)}
    return [
        (
            [sys.executable, script, *args],
            {**slurm, "SLURM_PROCID": f"{k}", "SLURM_LOCALID": f"{k}"},
        )
        for k in range(2)
    ]


def processes_with(token: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TOKEN_VAR) == token and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


class Job:
    """One launch: started on construction; ``finish`` waits and collects what it left."""

    def __init__(
        self, topology: str, outdir: Path, port: int, script: str, args: list[str] | None
    ) -> None:
        self.topology = topology
        self.outdir = outdir
        self.token = uuid.uuid4().hex
        self.procs: list[subprocess.Popen[bytes]] = []
        for k, (cmd, extra) in enumerate(
            commands(topology, port, script, [str(outdir)] if args is None else args)
        ):
            with open(outdir / f"launch{k}.log", "w") as log:
                env = {**clean_env(self.token), **extra}
                self.procs.append(
                    subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                )

    def finish(self, deadline: float) -> None:
        """Wait until ``deadline`` (monotonic), then kill what is left and read the results."""
        self.returncodes: list[int | None] = []
        for proc in self.procs:
            try:
                self.returncodes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.returncodes.append(None)
        # Every process of the launch (agents, ranks, their forkservers and workers) carries the
        # token; give them a moment to exit, then kill and report whatever is left.
        left = processes_with(self.token)
        end = time.monotonic() + 10
        while left and time.monotonic() < end:
            time.sleep(0.1)
            left = processes_with(self.token)
        self.leftovers = [(p.pid, p.name()) for p in left]
        for p in left:
            p.kill()
        for proc in self.procs:
            if proc.poll() is None:
                proc.wait(5)
        self.ranks = {}
        for r in range(2):
            path = self.outdir / f"rank{r}.pkl"
            if path.exists():
                with open(path, "rb") as f:
                    self.ranks[r] = pickle.load(f)
        logs = [self.outdir / f"launch{k}.log" for k in range(len(self.procs))]
        self.output = "\n".join(log.read_text() for log in logs)

    def seen(self, name: str) -> list[object]:
        """What every rank recorded under ``name``, in rank order."""
        assert sorted(self.ranks) == [0, 1], f"not every rank finished:\n{self.output[-4000:]}"
        return [self.ranks[r][name] for r in (0, 1)]


# name: (topology, script, its arguments; None: the output folder)
LAUNCHES = {
    "one_node": ("one_node", SCRIPT, None),
    "two_nodes": ("two_nodes", SCRIPT, None),
    "slurm_like": ("slurm_like", SCRIPT, None),
    "dead_rank": ("slurm_like", DEAD_RANK, []),
    "example": ("one_node", EXAMPLE, []),
}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    """Every launch of this module, run side by side (they mostly wait on each other)."""
    ports: set[int] = set()
    while len(ports) < len(LAUNCHES):
        ports.add(free_port())
    started: dict[str, Job] = {}
    deadline = time.monotonic() + LAUNCH_SECONDS
    try:
        for (name, (topology, script, args)), port in zip(LAUNCHES.items(), ports, strict=True):
            started[name] = Job(topology, tmp_path_factory.mktemp(name), port, script, args)
    finally:
        for job in started.values():
            job.finish(deadline)
    return started


@pytest.fixture(params=TOPOLOGIES)
def job(request: pytest.FixtureRequest, launches: dict[str, Job]) -> Job:
    return launches[request.param]


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The single-process run of every scenario (inline: no processes, same results)."""
    marks = str(tmp_path_factory.mktemp("single") / "marks")
    return {
        name: jobs.run(name, "inline", False, marks)
        for name in jobs.SCENARIOS
        if name != "error_died"  # os._exit inline would end the test process itself
    }


class TestLaunch:
    def test_every_rank_exits_cleanly(self, job):
        """Every launched process exits 0 within the time limit and every rank reports."""
        assert job.returncodes and all(code == 0 for code in job.returncodes), job.output[-4000:]
        assert sorted(job.ranks) == [0, 1]

    def test_no_process_left(self, job):
        """No process of the launch (agent, rank, forkserver, worker) outlives it."""
        assert job.leftovers == []

    def test_launcher_detected(self, job):
        """Each rank sees its launcher, rank, world size and local rank."""
        launcher = "slurm" if job.topology == "slurm_like" else "torchrun"
        per_node = 1 if job.topology == "two_nodes" else 2
        for r, info in enumerate(job.seen("launch")):
            assert info.launcher == launcher
            assert (info.rank, info.world_size, info.local_world_size) == (r, 2, per_node)
        ids = job.seen("ids")
        local = [0, 0] if per_node == 1 else [0, 1]
        assert ids == [(r, 2, local[r], per_node, r == 0) for r in (0, 1)]

    def test_nncore_helpers(self, job):
        """is_distributed() is True and get_dist_info() is (rank, world size) on each rank."""
        assert job.seen("nncore") == [(True, (r, 2)) for r in (0, 1)]


class TestCollectives:
    def test_all_gather(self, job):
        """all_gather gives every rank the list of every rank's object, closures included."""
        assert job.seen("all_gather") == [[(0, 0), (1, 1)]] * 2

    def test_gather(self, job):
        """gather delivers the list on dst only, None elsewhere."""
        assert job.seen("gather") == [None, [0, 10]]
        assert job.seen("gather0") == [["r0", "r1"], None]

    def test_broadcast(self, job):
        """broadcast hands src's object to every rank."""
        assert job.seen("broadcast") == ["from 1", "from 1"]

    def test_barrier_and_main_only(self, job):
        """barrier returns on every rank; main_only runs on rank 0 alone."""
        assert job.seen("barrier") == [None, None]
        assert job.seen("main_only") == [1, None]

    def test_local_devices(self, job):
        """devices="local" on a CPU node is the rank's share of the cores, at least one."""
        cores = len(os.sched_getaffinity(0))
        per_node = 1 if job.topology == "two_nodes" else 2
        assert job.seen("local_devices") == [["cpu"] * max(1, cores // per_node)] * 2


class TestDistributedMap:
    @pytest.mark.parametrize(
        "name",
        ["plain", "consumer", "cfg", "batches", "seed", "seed_batches", "generator", "local"],
    )
    def test_equals_single_process(self, job, expected, name):
        """Every rank returns exactly the single-process result (order, batches, seeds)."""
        assert expected[name][0] == "ok"
        assert job.seen(name) == [expected[name]] * 2

    def test_consumer_runs_once_on_rank_0(self, job):
        """The consumer folds once, on rank 0; the other rank receives its result."""
        assert (job.outdir / "marks").read_text() == "0\n"
        assert (job.outdir / "marks.b").read_text() == "0\n"

    def test_error_on_one_rank_reaches_all(self, job, expected):
        """A work function raising on rank 1 raises WorkerError on every rank, naming it."""
        single = expected["error_item"][1]
        for tag, err in job.seen("error_item"):
            assert tag == "error"
            assert err["type"] == "WorkerError"
            assert err["message"].startswith("rank 1 of 2 failed: fail_at_5 raised ValueError")
            assert "while running item 5 " in err["message"]
            assert (err["cause_type"], err["cause"]) == (single["cause_type"], single["cause"])
            assert (
                (err["index"], err["stage"])
                == (single["index"], single["stage"])
                == (5, "fail_at_5")
            )

    def test_dead_worker_on_one_rank_reaches_all(self, job):
        """A worker dying on rank 1 (WorkerDied there) raises WorkerError on every rank."""
        for tag, err in job.seen("error_died"):
            assert tag == "error"
            assert err["type"] == "WorkerError"
            assert err["message"].startswith(
                "rank 1 of 2 failed: worker 0 on cpu died (exit code 3)"
            )
            assert "while running item 3 " in err["message"]
            assert (err["cause_type"], err["index"]) == ("WorkerDied", 3)

    def test_consumer_error_reaches_all(self, job, expected):
        """The consumer raising on rank 0 raises WorkerError on every rank."""
        single = expected["error_consumer"][1]
        for tag, err in job.seen("error_consumer"):
            assert tag == "error"
            assert err["message"].startswith("rank 0 of 2 failed: fussy_sum raised KeyError")
            assert (err["cause_type"], err["cause"]) == (single["cause_type"], single["cause"])
            assert err["index"] == single["index"] == 4

    def test_usable_after_errors(self, job, expected):
        """After errors, the ranks are still in step: the next map works everywhere."""
        assert job.seen("after_errors") == [expected["after_errors"]] * 2


class TestDeadRank:
    def test_dead_rank_is_an_error_not_a_hang(self, launches):
        """A rank dying before the exchange makes the others' map raise WorkerDied promptly."""
        job = launches["dead_rank"]
        assert job.returncodes == [0, 7], job.output[-4000:]
        assert "rank 0 got WorkerDied: rank 0: the collective exchanging results failed" in (
            job.output
        )
        assert job.leftovers == []


class TestExample:
    def test_example_on_one_node(self, launches):
        """The documented one-node launch runs the example; every rank gets the error once."""
        job = launches["example"]
        assert job.returncodes == [0], job.output[-4000:]
        assert "world of 2 (torchrun)" in job.output
        assert "single-process run agrees: OK" in job.output
        line = "got: rank 1 of 2 failed: picky raised ValueError: item 7 is not welcome"
        assert job.output.count(line) == 2
        assert job.leftovers == []
