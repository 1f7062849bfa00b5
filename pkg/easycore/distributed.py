"""Run easycore across machines on ``torch.distributed``, launched by ``torchrun`` or Slurm.

easycore brings no cluster engine of its own: every process of a ``torchrun`` (or ``srun``)
job is a *rank*, and each rank drives the ordinary executor on its own devices. This module
finds the launcher from the environment, sets up the process group, and offers the
communication helpers a training or inference script needs::

    from easycore import distributed

    distributed.init()                       # torchrun / Slurm / nothing: a world of one
    distributed.rank(), distributed.world_size(), distributed.local_rank()
    distributed.is_distributed(), distributed.get_dist_info()   # nncore's: (rank, world_size)
    distributed.all_gather(obj)              # [obj of rank 0, obj of rank 1, ...]
    distributed.gather(obj, dst=0)           # that list on dst, None elsewhere
    distributed.broadcast(obj, src=0)        # src's obj on every rank
    distributed.barrier()
    share = distributed.rank_share(dataset_indices)   # this rank's part of an epoch

    @distributed.main_only                   # runs on rank 0 only (None elsewhere)
    def save(result): ...

    result = pipeline.map(data, devices="local", distributed=True)

``pipeline.map(..., distributed=True)`` splits the work between ranks: unit ``i`` (an item,
or a batch) runs on rank ``i % world_size`` with the ordinary executor, and every rank gets
the same result (see ``easycore._exec.sharded``).

``torch`` is imported only when a process group is needed: without a launcher, every helper
works on a world of one without loading it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

import attrs
import cloudpickle

from easycore._devices import cpu_count, gpu_count
from easycore._seeding import check_int

__all__ = [
    "LaunchInfo",
    "all_gather",
    "barrier",
    "broadcast",
    "detect_launcher",
    "gather",
    "get_dist_info",
    "init",
    "is_distributed",
    "is_main",
    "local_devices",
    "local_rank",
    "local_world_size",
    "main_only",
    "rank",
    "rank_share",
    "world_size",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")

DEFAULT_PORT = 29500  # torch's own default MASTER_PORT


# ---------------------------------------------------------------------------------------------
# the launcher
# ---------------------------------------------------------------------------------------------
@attrs.frozen
class LaunchInfo:
    """Where this process stands in its job, as the launcher described it in the environment.

    Attributes:
        launcher: ``"torchrun"``, ``"slurm"`` or ``"none"`` (a plain ``python script.py``).
        rank: this process's global rank, 0 .. world_size-1.
        world_size: how many processes the job has.
        local_rank: this process's rank on its node (its GPU number, one rank per GPU).
        local_world_size: how many processes run on this node.
        master_addr: host of rank 0's rendezvous store (``None`` without a launcher).
        master_port: port of that store (``None`` without a launcher).
    """

    launcher: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    with contextlib.suppress(ValueError):
        return int(env.get(name, ""))
    return default


def _tasks_on_node(tasks_per_node: str, node: int) -> int | None:
    """Read Slurm's ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``) for node number ``node``."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if node < len(counts) else None


def detect_launcher(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Describe this process's place in the job from the launcher's environment variables.

    ``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT``; it wins when both are present. Slurm's ``srun`` sets
    ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` and the node list; rank 0's host is
    then ``MASTER_ADDR`` if set, else the first host of ``SLURM_JOB_NODELIST`` (or
    ``SLURM_NODELIST``), and the port is ``MASTER_PORT`` if set, else
    ``29500 + SLURM_JOB_ID % 10000`` (two jobs sharing a node rarely collide). Neither: a
    world of one.

    Args:
        environ: the variables to read; ``os.environ`` when ``None``.

    Returns:
        A :class:`LaunchInfo`.

    >>> detect_launcher({}).launcher
    'none'
    >>> info = detect_launcher({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
    ...                         "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_JOB_ID": "1234"})
    >>> info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port
    (3, 8, 1, 'node07', 30734)
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher, names = "torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        per_node: int | None = _int(env, "LOCAL_WORLD_SIZE", 0)
        host, port = env.get("MASTER_ADDR", "127.0.0.1"), DEFAULT_PORT
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        launcher, names = "slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
        per_node = _int(env, "SLURM_NTASKS_PER_NODE", 0) or _tasks_on_node(
            env.get("SLURM_TASKS_PER_NODE", ""), _int(env, "SLURM_NODEID", 0)
        )
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        # the first host of the list ("node[01-02],gpu7" -> "node01"): to a comma outside [],
        # each bracket group ("[01-04,07]") its first member ("01"), zero-padding kept
        first = re.findall(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", nodelist)[0].strip()
        first = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)
        host = env.get("MASTER_ADDR") or first
        job = _int(env, "SLURM_JOB_ID", -1)
        port = DEFAULT_PORT + job % 10000 if job >= 0 else DEFAULT_PORT
    else:
        return LaunchInfo(launcher="none")
    me, world, local = (_int(env, n, default) for n, default in zip(names, (0, 1, 0), strict=True))
    port = _int(env, "MASTER_PORT", port)
    return LaunchInfo(launcher, me, world, local, per_node or world, host, port)


# ---------------------------------------------------------------------------------------------
# the process group
# ---------------------------------------------------------------------------------------------
@attrs.define
class _State:
    ready: bool = False  # init() has run (a world of one needs nothing more)
    group: Any = None  # the group our object collectives use (gloo); None: the default group
    created: bool = False  # we made the default process group, so we destroy it at exit


_STATE = _State()


def _dist() -> Any:
    """``torch.distributed`` when a process group is up, else ``None`` (never imports torch)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _destroy() -> None:
    dist = _dist()
    if dist is not None and _STATE.created:
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            dist.destroy_process_group()
    _STATE.ready = _STATE.created = False
    _STATE.group = None


def init(backend: str | None = None, *, timeout: float | None = None) -> None:
    """Join the job's process group: detect the launcher and set ``torch.distributed`` up.

    Under ``torchrun`` or Slurm this initialises the default process group: ``nccl`` where
    CUDA is available (each rank bound to ``cuda:LOCAL_RANK`` first), else ``gloo``. Without a
    launcher it is a world of one and needs nothing (not even ``MASTER_ADDR``). Calling it
    again, or after the script set up ``torch.distributed`` itself, changes nothing. Every
    collective here calls it for you; ``pipeline.map(..., distributed=True)`` does too.

    Object collectives always travel over a ``gloo`` group (created next to an ``nccl``
    default group), so they never touch GPU memory.

    Args:
        backend: ``"gloo"``, ``"nccl"``...; ``None`` picks by the presence of CUDA.
        timeout: seconds a rank waits for the others, at start-up and in every collective
            (so the slowest rank's share of a ``map`` must finish within it); ``None``
            keeps torch's default (30 minutes for gloo, 10 for nccl).

    Raises:
        RuntimeError: a launcher says the world is larger than one but this torch has no
            ``torch.distributed``.

    >>> init()          # a plain `python` process: a world of one
    >>> world_size()
    1
    """
    if _STATE.ready:
        return
    info = detect_launcher()
    dist = _dist()
    if dist is None and info.launcher == "none":
        _STATE.ready = True
        return
    import torch
    import torch.distributed as dist

    delta = None if timeout is None else datetime.timedelta(seconds=timeout)
    if not dist.is_available():
        msg = f"{info.launcher} started {info.world_size} processes, but this torch build has no "
        msg += "torch.distributed"
        raise RuntimeError(msg)
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        chosen = backend or ("nccl" if cuda and dist.is_nccl_available() else "gloo")
        if cuda and chosen == "nccl":
            torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        # a timeout only when given: torch 2.1 refuses timeout=None here
        kwargs: dict[str, Any] = {} if delta is None else {"timeout": delta}
        if info.launcher == "slurm":
            kwargs["init_method"] = f"tcp://{info.master_addr}:{info.master_port}"
        # torchrun: env:// (the default), which joins the store torchrun's agent already
        # serves at MASTER_ADDR:MASTER_PORT instead of trying to bind that port again.
        dist.init_process_group(chosen, rank=info.rank, world_size=info.world_size, **kwargs)
        _STATE.created = True
        atexit.register(_destroy)
    if dist.get_backend() != "gloo":
        _STATE.group = dist.new_group(backend="gloo", timeout=delta)
    _STATE.ready = True


# ---------------------------------------------------------------------------------------------
# where am I
# ---------------------------------------------------------------------------------------------
def rank() -> int:
    """This process's global rank (0 without a launcher); works before :func:`init` too.

    Returns:
        The rank, from the process group once there is one, else from the launcher's
        environment.

    >>> rank()
    0
    """
    dist = _dist()
    return int(dist.get_rank()) if dist is not None else detect_launcher().rank


def world_size() -> int:
    """How many processes the job has (1 without a launcher).

    Returns:
        The world size.

    >>> world_size()
    1
    """
    dist = _dist()
    return int(dist.get_world_size()) if dist is not None else detect_launcher().world_size


def is_distributed() -> bool:
    """True when the job has more than one rank (nncore's ``is_distributed``).

    Returns:
        Whether ``world_size() > 1``.

    >>> is_distributed()
    False
    """
    return world_size() > 1


def get_dist_info() -> tuple[int, int]:
    """``(rank, world_size)``: ``(0, 1)`` without a launcher (nncore's ``get_dist_info``).

    Returns:
        The pair ``(rank(), world_size())``.

    >>> get_dist_info()
    (0, 1)
    """
    return rank(), world_size()


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK`` / ``SLURM_LOCALID``; 0 without one).

    Returns:
        The local rank.

    >>> local_rank()
    0
    """
    return detect_launcher().local_rank


def local_world_size() -> int:
    """How many of the job's processes run on this node (1 without a launcher).

    Returns:
        The number of ranks on this node.

    >>> local_world_size()
    1
    """
    return detect_launcher().local_world_size


def is_main() -> bool:
    """True on rank 0, the rank that logs, saves and runs a distributed map's consumer.

    Returns:
        Whether ``rank() == 0``.

    >>> is_main()
    True
    """
    return rank() == 0


def main_only(fn: Callable[_P, _R]) -> Callable[_P, _R | None]:
    """Decorate a function to run on rank 0 only; elsewhere a call does nothing, returns None.

    No collective is involved (a rank never waits for another), so it suits logging,
    printing and saving. To hand rank 0's value to everyone, use :func:`broadcast`.

    Args:
        fn: the function to wrap.

    Returns:
        A function with ``fn``'s signature that returns ``fn``'s result on rank 0 and
        ``None`` elsewhere.

    >>> @main_only
    ... def report(x):
    ...     return f"done: {x}"
    >>> report(3)
    'done: 3'
    """

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
        return fn(*args, **kwargs) if is_main() else None

    return wrapper


def local_devices() -> list[str]:
    """This rank's own devices, what ``devices="local"`` means in a distributed map.

    Its GPU ``cuda:LOCAL_RANK`` where GPUs exist (modulo their number, so ranks that each see
    one GPU all use ``cuda:0``), else its share of the node's CPU cores:
    ``max(1, cores // local_world_size())`` CPU workers. Pass it to ``open`` to keep workers
    up across several calls.

    Returns:
        A list of device strings, as ``devices=`` takes them.

    >>> local_devices()[0] in ("cpu", "cuda:0")
    True
    """
    gpus = gpu_count()
    if gpus:
        return [f"cuda:{local_rank() % gpus}"]
    return ["cpu"] * max(1, cpu_count() // max(1, local_world_size()))


def rank_share(
    items: Sequence[_T], rank: int | None = None, world_size: int | None = None, pad: bool = True
) -> list[_T]:
    """This rank's share of a sized sequence: every ``world_size``-th item from ``rank``.

    Every rank gets the same number of items, so that ranks step together (a collective in
    each training step never waits for a rank that ran out): with ``pad=True`` the items are
    first made a multiple of ``world_size`` long by repeating items from the start (as
    torch's ``DistributedSampler`` does), with ``pad=False`` the remainder is dropped. The
    shares are disjoint apart from that padding, and together cover every item (every item
    but the dropped remainder with ``pad=False``). Which rank gets which item depends on
    nothing but ``rank`` and ``world_size``, not on how many workers each rank runs.

    Args:
        items: a sequence (``len`` and integer indexing): items, or indices into a dataset
            (e.g. :func:`easycore.permutation` of the epoch).
        rank: this process's rank (default: the launcher's, see :func:`rank`).
        world_size: how many ranks (default: the launcher's, see :func:`world_size`).
        pad: repeat items to fill the last round (True), or drop the remainder (False).

    Returns:
        A list of ``ceil(n / world_size)`` items (``pad=True``) or ``n // world_size``.

    Raises:
        ValueError: ``world_size`` is below 1 or ``rank`` not in ``0 .. world_size - 1``.
        TypeError: ``items`` is not a sized sequence (no length, no indexing, or a mapping
            such as a dict), ``rank`` or ``world_size`` not an int, or ``pad`` not a bool.

    >>> rank_share(range(10), rank=1, world_size=4)
    [1, 5, 9]
    >>> rank_share(range(10), rank=3, world_size=4)
    [3, 7, 1]
    >>> rank_share(range(10), rank=3, world_size=4, pad=False)
    [3, 7]
    """
    launched = get_dist_info() if rank is None or world_size is None else (rank, world_size)
    world = check_int("world_size", launched[1] if world_size is None else world_size, 1)
    me = _check_rank("rank", check_int("rank", launched[0] if rank is None else rank), world)
    sized = hasattr(items, "__len__") and hasattr(items, "__getitem__")
    if isinstance(items, Mapping) or not sized:  # a dict's [k] is by key, not position
        msg = f"rank_share needs a sized sequence (len and indexing), got {type(items).__name__}"
        raise TypeError(msg)
    if not isinstance(pad, bool):
        msg = f"pad must be True (repeat items) or False (drop the remainder), got {pad!r}"
        raise TypeError(msg)
    n = len(items)
    per_rank = -(-n // world) if pad else n // world
    # rank r's k-th item is item (r + k * world) of the input padded from its start
    return [items[(me + k * world) % n] for k in range(per_rank)] if n else []


# ---------------------------------------------------------------------------------------------
# collectives on picklable objects
# ---------------------------------------------------------------------------------------------
def _check_rank(name: str, value: int, world: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < world:
        msg = f"{name}={value!r} is not a rank of a world of {world}: expected 0 .. {world - 1}"
        raise ValueError(msg)
    return value


def _joined() -> Any:
    """``torch.distributed`` with the job's process group joined, or None in a world of one."""
    init()
    return _dist()


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` in a world of one).

    Objects travel by cloudpickle: anything a worker could receive (lambdas included).
    Every rank must call it (a collective); the first call initialises the process group.

    Args:
        obj: this rank's object.

    Returns:
        The list of every rank's object, indexed by rank.

    >>> all_gather({"loss": 0.5})
    [{'loss': 0.5}]
    """
    blob = cloudpickle.dumps(obj)
    parts: list[Any] = [blob]
    dist = _joined()
    if dist is not None:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, blob, group=_STATE.group)
    return [cloudpickle.loads(b) for b in parts]


def gather(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on rank ``dst``; ``None`` on the other ranks.

    Args:
        obj: this rank's object (cloudpickled).
        dst: the rank that receives the list.

    Returns:
        The list of every rank's object on ``dst``, ``None`` on the others.

    Raises:
        ValueError: ``dst`` is not a rank of this job.

    >>> gather("mine")
    ['mine']
    """
    _check_rank("dst", dst, world_size())
    blob = cloudpickle.dumps(obj)
    parts: list[Any] | None = [blob]
    dist = _joined()
    if dist is not None:
        parts = [None] * dist.get_world_size() if dist.get_rank() == dst else None
        dist.gather_object(blob, parts, dst=dst, group=_STATE.group)
    return None if parts is None else [cloudpickle.loads(b) for b in parts]


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (the others' ``obj`` is ignored; pass ``None``).

    Args:
        obj: the object to send, on rank ``src``; ignored elsewhere.
        src: the rank whose object everyone receives.

    Returns:
        Rank ``src``'s object (a copy, also on ``src``).

    Raises:
        ValueError: ``src`` is not a rank of this job.

    >>> broadcast([1, 2])
    [1, 2]
    """
    _check_rank("src", src, world_size())
    box = [cloudpickle.dumps(obj) if rank() == src else None]
    dist = _joined()
    if dist is not None:
        dist.broadcast_object_list(box, src=src, group=_STATE.group)
    return cloudpickle.loads(box[0])


def barrier() -> None:
    """Wait until every rank reaches this point (nothing to wait for in a world of one).

    >>> barrier()
    """
    dist = _joined()
    if dist is not None:
        dist.barrier(group=_STATE.group)
