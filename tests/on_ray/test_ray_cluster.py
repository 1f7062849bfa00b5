"""engine="ray" on a cluster of Ray nodes on this machine (Ray's own ``Cluster`` test
utility): a node removed in the middle of a run, and the result equals the fault-free run."""

from __future__ import annotations

import time

import pytest
import ray
from ray.cluster_utils import Cluster

from easycore import WorkerDied, producer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster():
    """A head without CPUs (so actors land on the worker nodes) and three 1-CPU nodes."""
    if ray.is_initialized():  # pragma: no cover - a previous module's
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [c.add_node(num_cpus=1) for _ in range(3)]
    c.wait_for_nodes()
    ray.init(address=c.address)
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def _where(log):
    """An init that records the node of each actor it starts."""

    def init():
        node = ray.get_runtime_context().get_node_id()
        with open(log, "a") as f:
            f.write(node + "\n")

    return init


def test_a_node_removed_mid_run_heals_with_retries(cluster, tmp_path):
    c, nodes = cluster
    log = tmp_path / "nodes"

    @producer(init=_where(log))
    def double(x, *, state):
        time.sleep(0.02)
        return 2 * x

    data = list(range(300))
    results = double.imap(data, devices=2, engine="ray", retries=2)
    got = [next(results) for _ in range(30)]
    hosts = log.read_text().split()
    assert len(hosts) == 2
    victim = next(n for n in nodes if n.node_id == hosts[0])
    c.remove_node(victim)
    nodes.remove(victim)
    got += list(results)
    assert got == [2 * x for x in data]  # nothing lost, nothing doubled, in order
    started = log.read_text().split()
    assert len(started) >= 3  # a fresh actor took the dead one's place...
    assert victim.node_id not in started[2:]  # ...on a node still there


def test_out_of_retries_a_lost_node_is_worker_died_naming_the_node(cluster, tmp_path):
    c, nodes = cluster
    log = tmp_path / "nodes"

    @producer(init=_where(log))
    def slow(x, *, state):
        time.sleep(0.05)
        return x

    results = slow.imap(range(10_000), devices=1, engine="ray")
    next(results)
    host = log.read_text().split()[0]
    victim = next(n for n in nodes if n.node_id == host)
    c.remove_node(victim)
    nodes.remove(victim)
    with pytest.raises(WorkerDied, match="Ray node") as info:
        list(results)
    assert "died" in str(info.value)
