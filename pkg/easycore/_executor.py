"""The process executor behind ``Pipeline.map``/``imap``/``open``: one worker per device.

Data flow (the caller's own thread runs the loop; ``Runner.submit`` runs the same loop in one
background thread)::

    caller process                                       worker process k (one per device)
    ------------------------------------------------     ---------------------------------------
    data ──lazy──> [window] ──chunk (start, items)───>   pipe k ──> reader thread ──> local queue
     ^ (backpressure: at most `window` items            (duplex     │ EOF: caller died ->
     │  taken and not yet yielded)                     Unix socket) │      os._exit (no orphan)
     │                                                      │       v
    yield / consumer <── reorder buffer <── reply ──────────┘     main thread: init once, then
                        (ordered=True:      (one per chunk:       per item: slots[k] = (index,
                         segments keyed     results + errors)     start), fused producers; STOP
                         by start index)                          -> end -> ENDED -> exit
          big tensors/arrays in both directions: shared-memory segments, only their ids in the
          pickle (see _transport); slots: one shared array of 2 doubles per worker
    multiprocessing.connection.wait([pipe 1..n, process sentinel 1..n], timeout)
       pipe ready      -> read replies (results, errors left after the worker's own retries,
                          READY, ENDED)
       sentinel ready  -> the process is gone: drain its pipe first (results already sent are
                          kept, never re-run), then re-queue what it still held (retries) or
                          raise WorkerDied naming the item from slots[k]
       timeout         -> an item passed `timeout` (start time in slots[k]): kill that worker,
                          then as above, raising ItemTimeout when retries are spent

With several pools (``a.on(2) >> b.on(1) >> consumer``), data goes worker to worker and the
caller only routes::

    caller ──chunk──> pool 0 worker i ──(results held)          pool 1 worker j ──reply──> caller
      ^                   │ MID: "chunk c done"                    ^    │
      │<──────────────────┘                                        │    │
      │ "fwd c to j" (+ its end of a new socket pair, SCM_RIGHTS)  │    │
      └──────────────────> pool 0 worker i: sender thread ─────────┘    │ release notes for
                              └─ SENT c ─> caller                      │ i's segments go
                                                                        └─ back over the pair

    * a finished chunk waits in its worker until a worker of the next pool has fewer than
      DEPTH chunks: backpressure holds over the chain; the window bounds what is in flight;
    * the caller knows where each chunk is (running, held, moving from i to j); when a worker
      dies, every chunk it ran, held or was sending is re-run from its first-pool items (the
      caller keeps them) under a new id, and replies for the old id are dropped;
    * chunks hold whole last-pool batches, so every pool's batches, item indices and seeds
      are the same whatever the routing; exceptions are retried inside the worker.

Why this shape:

* Routing from the caller rather than from worker to worker: one process sees every queue's
  depth and every death, so exactly-once delivery and backpressure need no distributed
  protocol, while the bytes (the expensive part) never pass through it.
* Per-worker pipes (as torch's DataLoader keeps per-worker index queues) tell us exactly which
  items each worker holds, so a dead worker's items can be re-run and nothing is lost or
  doubled: a chunk's results arrive in one message, and a chunk is forgotten only when its
  reply has been read.
* Waiting on process sentinels (as loky does) sees a death the moment it happens, not on a
  polling timer. No ``multiprocessing.Queue``: its feeder thread turns pickling errors into
  silent hangs; here the caller pickles synchronously and can name the item.
* Workers start from a forkserver that has already imported torch and easycore (Linux
  default): the first pool pays the import once, later pools and respawns fork in
  milliseconds, and no worker is forked from a caller that may hold threads or CUDA state.
  A caller that never imported torch gets a second, light forkserver (easycore and numpy
  only): its workers fork and exit several times faster and import torch only if the work
  does (see ``_light_wanted``; ``_worker._setup_torch`` gives it threads and seed then).
* Chunks grow adaptively (target ~50 ms of work or ~1 MiB per message) so tiny items do not
  drown in per-message overhead; the window scales with the chunk size and bounds memory:
  at most ``n_workers * (DEPTH + 1) * chunk`` items are in flight, and with ``ordered=True`` the
  reorder buffer holds at most that many results (a slow item stalls the stream instead of
  growing memory).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import functools
import itertools
import math
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.spawn
import os
import select
import socket
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import attrs
import cloudpickle

from easycore import _worker
from easycore._config import CfgNode
from easycore._errors import (
    EasycoreError,
    ItemTimeout,
    SerializationError,
    WorkerDied,
    WorkerError,
    describe_exitcode,
)
from easycore._pipeline import Pipeline, Stage
from easycore._transport import Channel

__all__ = ["Runner", "StageStats", "check_run_args", "parse_devices"]

DEPTH = 2  # chunks outstanding per worker: one running, one queued behind it
MAX_CHUNK = 16384  # items per chunk, at most
TARGET_CHUNK_SECONDS = 0.05  # grow chunks until one takes about this long...
TAIL_CHUNK_SECONDS = 0.001  # ...and, as a sized input runs out, shrink them no further
TARGET_CHUNK_BYTES = 1 << 20  # ...or carries about this many pickled bytes
ABORT_GRACE = 2.0  # seconds a worker gets to run `end` after an error or Ctrl-C
INLINE = "inline"
# Shared doubles per worker: index of the item in hand, its start time (or 1.0 / 0.0 idle),
# id of the chunk whose results it is sending (-1.0 when none).
_SLOT = 3
_PIPE_TAGS = frozenset((_worker.MID, _worker.SENT, _worker.BAD_OUTPUT))


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------
def check_run_args(
    *, batch_size: int | None, timeout: float | None, retries: int, seed: int | None
) -> None:
    """Validate per-run options before any process starts.

    Raises:
        ValueError: a value out of range.
        TypeError: a value of the wrong type.
    """
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        msg = f"batch_size must be a positive int or None, got {batch_size!r}"
        raise ValueError(msg)
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0
    ):
        msg = f"timeout must be a positive number of seconds or None, got {timeout!r}"
        raise ValueError(msg)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        msg = f"retries must be an int >= 0, got {retries!r}"
        raise ValueError(msg)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        msg = f"seed must be an int or None, got {seed!r}"
        raise ValueError(msg)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _gpu_count() -> int:
    # Importing torch costs a second or more; skip it where no NVIDIA driver exists at all.
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return 0
    if not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidia0")):
        return 0
    import torch

    return int(torch.cuda.device_count())


def _one_device(entry: Any, gpus: Callable[[], int]) -> str:
    text = str(entry) if type(entry).__name__ == "device" else entry
    if not isinstance(text, str):
        msg = f"a device must be a string like 'cpu' or 'cuda:0' or a torch.device, got {entry!r}"
        raise ValueError(msg)
    if text in ("cpu", "cpu:0"):
        return "cpu"
    if text == "cuda" or text.startswith("cuda:"):
        number = text[5:] or "0"
        if not number.isdigit():
            msg = f"bad device {entry!r}: expected 'cuda:N' with N a GPU number"
            raise ValueError(msg)
        count = gpus()
        if int(number) >= count:
            msg = f"device {entry!r} does not exist: this machine has {count} visible GPU(s)" + (
                f" (cuda:0 .. cuda:{count - 1})" if count else ""
            )
            raise ValueError(msg)
        return f"cuda:{int(number)}"
    msg = f"unknown device {entry!r}: use 'cpu', 'cuda:N', 'cuda', 'auto', 'inline' or an int"
    raise ValueError(msg)


def parse_devices(devices: Any) -> list[str]:
    """Turn the ``devices`` argument into one device string per worker, or ``["inline"]``.

    Raises:
        ValueError: an impossible device (``0``, ``-1``, ``"tpu"``, a GPU that is not there).

    >>> parse_devices(2)
    ['cpu', 'cpu']
    >>> parse_devices("inline")
    ['inline']
    """
    cache: list[int] = []

    def gpus() -> int:
        if not cache:
            cache.append(_gpu_count())
        return cache[0]

    if isinstance(devices, bool):
        msg = f"devices must be an int, a device list or a keyword, got {devices!r}"
        raise ValueError(msg)
    if isinstance(devices, int):
        if devices < 1:
            msg = f"devices={devices}: need at least 1 worker (an int means that many CPU workers)"
            raise ValueError(msg)
        return ["cpu"] * devices
    if isinstance(devices, str):
        if devices == INLINE:
            return [INLINE]
        if devices == "auto":
            n = gpus()
            return [f"cuda:{i}" for i in range(n)] if n else ["cpu"] * _cpu_count()
        if devices == "cuda":
            n = gpus()
            if n == 0:
                msg = "devices='cuda' but no GPU is visible; use an int for CPU workers or 'auto'"
                raise ValueError(msg)
            return [f"cuda:{i}" for i in range(n)]
        return [_one_device(devices, gpus)]
    if type(devices).__name__ == "device":
        return [_one_device(devices, gpus)]
    if isinstance(devices, Iterable):
        out = [_one_device(d, gpus) for d in devices]
        if not out:
            msg = "devices is an empty list: give at least one device"
            raise ValueError(msg)
        return out
    msg = f"devices must be an int, a list of devices, 'cuda', 'auto' or 'inline', got {devices!r}"
    raise ValueError(msg)


@attrs.define
class StageStats:
    """What one pool of a runner did in the run under way (or the last run).

    ``done``: items (batches, for a pool with ``batch_size``) it finished; ``busy``: the
    fraction of its workers' time spent computing since the run started; ``queued``: items
    sent to its workers and not finished; ``waiting``: items it finished that wait for room
    in the next pool (a pool with many waiting items feeds a bottleneck).
    """

    name: str
    devices: tuple[str, ...]
    done: int = 0
    busy: float = 0.0
    queued: int = 0
    waiting: int = 0


def _plan_pools(pipeline: Pipeline, devices: Any) -> list[_PoolSpec]:
    """Cut the producers into pools and give each its devices (raises ValueError early)."""
    cache: list[tuple[str, ...]] = []

    def run_devices() -> tuple[str, ...]:
        if not cache:
            cache.append(tuple(parse_devices(devices)))
        return cache[0]

    groups = pipeline.pools
    if not groups:
        return [_PoolSpec(0, (), run_devices(), None, 1)]
    inline = isinstance(devices, str) and devices == INLINE
    specs: list[_PoolSpec] = []
    slot, unit = 0, 1
    for i, (stages, binding) in enumerate(groups):
        if inline:
            devs: tuple[str, ...] = (INLINE,)
        elif binding is None:
            devs = run_devices()
        else:
            devs = tuple(parse_devices(binding.devices))
        batch = binding.batch_size if binding is not None and i > 0 else None
        unit *= batch or 1
        specs.append(_PoolSpec(i, stages, devs, batch, unit, slot))
        slot += len(devs)
    return specs


def _frozen_cfg(cfg: Mapping[str, Any] | None) -> CfgNode:
    if cfg is None:
        return CfgNode({}, frozen=True)
    if not isinstance(cfg, Mapping):
        msg = f"cfg must be a mapping or CfgNode, got {type(cfg).__name__}"
        raise TypeError(msg)
    return CfgNode(dict(cfg), frozen=True)


# ---------------------------------------------------------------------------------------------
# process start-up
# ---------------------------------------------------------------------------------------------
_START_LOCK = threading.Lock()
_PRELOAD_SET = False
_LIGHT_SERVER: Any = None  # the forkserver without torch (see _light_wanted)
_TORCH_SEEN = False  # a worker of this process has loaded torch: later pools fork with it


def _light_wanted(method: str, devices: Sequence[str]) -> bool:
    """Whether workers should fork from the light forkserver (no torch loaded) this time.

    Forking a process that has torch loaded costs ~4 ms of kernel time per worker here
    (~150 MB of private memory to copy-on-write) plus as much again to start Python in it,
    and tearing it down ~3 ms: for a caller that never imported torch (pure Python work),
    a forkserver without torch starts and stops pools several times faster. Such workers
    import torch only if their work does (then with the thread budget and seed they would
    have had), and say so, so that every later pool of this process forks with torch.
    """
    if method != "forkserver" or _TORCH_SEEN or "torch" in sys.modules:
        return False
    if any(d.startswith("cuda") for d in devices):
        return False
    return hasattr(multiprocessing.forkserver, "connect_to_new_process")


def _light_server() -> Any:
    global _LIGHT_SERVER
    if _LIGHT_SERVER is None:
        server = multiprocessing.forkserver.ForkServer()
        server.set_forkserver_preload(["easycore._preload_light"])
        _LIGHT_SERVER = server
    return _LIGHT_SERVER


def _context(start_method: str | None) -> Any:
    global _PRELOAD_SET
    methods = mp.get_all_start_methods()
    method = start_method or ("forkserver" if "forkserver" in methods else "spawn")
    if method not in methods:
        msg = f"start_method {method!r} is not available here; choose from {methods}"
        raise ValueError(msg)
    if method == "fork":
        import sys

        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            msg = (
                "start_method='fork' after CUDA was initialised in this process is unsafe; "
                "use 'forkserver' or 'spawn'"
            )
            raise ValueError(msg)
    ctx = mp.get_context(method)
    if method == "forkserver" and not _PRELOAD_SET:
        # The forkserver imports torch once, before it has any thread or CUDA context; every
        # worker forks from it with torch already loaded. No '__main__': see _hidden_main.
        ctx.set_forkserver_preload(["easycore._preload"])
        _PRELOAD_SET = True
    return ctx


@contextlib.contextmanager
def _hidden_main(light: bool = False) -> Iterator[None]:
    # multiprocessing re-imports the caller's __main__ in spawned/forkserver children, which
    # re-runs an unguarded script's top level (and fails in notebooks). Everything a worker
    # needs travels by cloudpickle, so we leave __main__ out of the children's preparation.
    # `light`: the forkserver process started here comes from the light forkserver instead.
    # The originals are read under the lock: read before it, they could be another start's
    # replacements, and "restoring" them would leave those in place for good.
    forkserver: Any = multiprocessing.forkserver  # its module-level connect is swapped
    with _START_LOCK:
        original = multiprocessing.spawn.get_preparation_data
        connect = getattr(forkserver, "connect_to_new_process", None)

        def without_main(name: str) -> dict[str, Any]:
            data = original(name)
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
            return data

        multiprocessing.spawn.get_preparation_data = without_main
        if light:
            forkserver.connect_to_new_process = _light_server().connect_to_new_process
        try:
            yield
        finally:
            multiprocessing.spawn.get_preparation_data = original
            if light:
                forkserver.connect_to_new_process = connect


def _note_torch(loaded: bool) -> None:
    global _TORCH_SEEN
    if loaded:
        _TORCH_SEEN = True


def _culprit_of(producers: tuple[Stage, ...], cfg: CfgNode) -> str:
    for stage in producers:
        for role, obj in (("work function", stage.fn), ("init", stage.init), ("end", stage.end)):
            try:
                cloudpickle.dumps(obj)
            except Exception as exc:
                return f"the {role} of stage {stage.name!r} cannot be pickled: {exc}"
    try:
        cloudpickle.dumps(cfg)
    except Exception as exc:
        return f"cfg cannot be pickled: {exc}"
    return "the pipeline cannot be pickled"


@attrs.define(eq=False)
class _PoolSpec:
    """One pool of a pipeline: its fused producers and one worker per device."""

    index: int
    stages: tuple[Stage, ...]
    devices: tuple[str, ...]
    batch: int | None  # groups the previous pool's results into one item (pools after the first)
    unit: int  # first-pool items per item of this pool
    first_slot: int = 0  # global slot of its first worker
    payload: bytes = b""

    @property
    def name(self) -> str:
        return " >> ".join(s.name for s in self.stages)


@attrs.define(eq=False, slots=True)
class _Chunk:
    """Consecutive first-pool items on their way through the pools."""

    id: int
    start: int  # index of its first first-pool item
    items: Sequence[Any]  # the first-pool items, kept to re-run the chunk after a death
    pool: int = 0  # the pool that has it
    slot: int = -1  # the worker of that pool that runs it, holds its results, or receives it
    held: bool = False  # done in `pool`, its results waiting (in `slot`) for the next pool
    src: int = -1  # >= 0 while moving: the worker sending it to `slot` (not yet confirmed)
    run: Any = None  # the _Run it belongs to


@attrs.define(eq=False)
class _Worker:
    slot: int  # global: this worker's place in `Runner._workers` and in the slots array
    index: int  # within its pool (the `worker` injected into its functions)
    pool: int
    device: str
    proc: Any
    chan: Channel
    ready: bool = False
    alive: bool = True
    # chunks it runs or will run (counted against DEPTH), by chunk id
    outstanding: dict[int, _Chunk] = attrs.Factory(dict)
    # chunks whose results it holds for the next pool, or is sending there (multi-pool)
    holding: dict[int, _Chunk] = attrs.Factory(dict)
    timed_out: int | None = None  # index of the item we killed it for
    last_nbytes: int = 0  # size of the last reply (pickle + shared memory), for chunk sizing
    _exit_poll: Any = None

    @property
    def conn(self) -> Any:
        return self.chan.conn

    def exited(self) -> bool:
        """Whether the process has ended (``not proc.is_alive()``, without a selector per call)."""
        if self._exit_poll is None:
            self._exit_poll = _poller((self.proc.sentinel,))
        return bool(self._exit_poll.poll(0))


class _ChunkSizer:
    """Grow chunks of small items until one takes ~10 ms or ~1 MiB, shrink for slow ones."""

    __slots__ = ("bytes_per_item", "per_item", "size")

    def __init__(self) -> None:
        self.size = 1
        self.per_item: float | None = None
        self.bytes_per_item = 0.0

    def limit_bytes(self, n: int, nbytes: int) -> None:
        """Results measured after the fact (a middle pool's, when sent on)."""
        if n > 0:
            self.bytes_per_item = max(self.bytes_per_item, nbytes / n)
            self.size = max(1, min(self.size, int(TARGET_CHUNK_BYTES / self.bytes_per_item)))

    def floor(self) -> int:
        """The smallest chunk worth a message: about a millisecond of work."""
        if self.per_item is None:
            return 1
        return max(1, min(self.size, int(TAIL_CHUNK_SECONDS / self.per_item)))

    def update(self, n: int, elapsed: float, nbytes: int) -> None:
        if n <= 0:
            return
        t = max(elapsed / n, 1e-7)
        self.per_item = t if self.per_item is None else 0.5 * self.per_item + 0.5 * t
        by_time = TARGET_CHUNK_SECONDS / self.per_item
        by_bytes = TARGET_CHUNK_BYTES / max(nbytes / n, self.bytes_per_item, 1)
        target = max(1, min(MAX_CHUNK, int(min(by_time, by_bytes))))
        # Grow at most 16x per reply so one fast outlier does not make a huge chunk.
        self.size = min(target, self.size * 16)


def _raise_remote(
    entry: tuple[str, bytes | None, str, str, str],
    *,
    device: str | None,
    worker: int | None,
    index: int | None,
    what: str,
) -> None:
    stage, blob, tname, text, tb = entry
    original = _worker.unpack_exception(blob, tname, text, tb)
    where = f"on {device} (worker {worker})" if device is not None else "in the calling process"
    short = tname.rsplit(".", 1)[-1]
    msg = f"{stage} raised {short}: {text}\n  {what} {where}\n\nRemote traceback:\n{tb}"
    cls = SerializationError if stage == "<result pickling>" else WorkerError
    raise cls(msg, stage, device, worker, index, tb) from original


def _item_label(index: int, batch_size: int | None) -> str:
    if batch_size is None:
        return f"item {index}"
    return f"batch {index} (items {index * batch_size}..{(index + 1) * batch_size - 1})"


def _after(retries: int) -> str:
    if not retries:
        return ""
    return f" after {retries} retr{'y' if retries == 1 else 'ies'}"


def _short_repr(obj: Any, limit: int = 80) -> str:
    try:
        text = repr(obj)
    except Exception:
        text = f"<{type(obj).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _batched(data: Iterable[Any], size: int) -> Iterator[list[Any]]:
    it = iter(data)
    while batch := list(itertools.islice(it, size)):
        yield batch


def _kill_all(procs: list[Any]) -> None:
    for p in procs:
        with contextlib.suppress(Exception):
            if p.is_alive():
                p.kill()
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(1.0)


class _Waiter:
    """``multiprocessing.connection.wait`` for file descriptors, without a selector per call.

    The run loop waits once per message; building and filling a selector each time cost
    more than handling a small message. One ``poll`` object is kept while the set of
    descriptors stays the same.
    """

    def __init__(self) -> None:
        self._fds: tuple[int, ...] = ()
        self._poll: Any = None
        self._lock = threading.Lock()  # a poll object cannot be used by two threads at once

    def wait(self, fds: Sequence[int], timeout: float | None) -> set[int]:
        """The descriptors of ``fds`` that are readable (or closed), waiting up to ``timeout`` s."""
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        key = tuple(fds)
        if not self._lock.acquire(blocking=False):
            return {fd for fd, _ in _poller(key).poll(ms)}
        try:
            if key != self._fds or self._poll is None:
                self._poll, self._fds = _poller(key), key
            return {fd for fd, _ in self._poll.poll(ms)}
        finally:
            self._lock.release()


def _poller(fds: Sequence[int]) -> Any:
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return poller


# ---------------------------------------------------------------------------------------------
# the runner
# ---------------------------------------------------------------------------------------------
class Runner:
    """Workers for one pipeline that stay up across calls; made by ``Pipeline.open``.

    ``init`` runs once per worker when the runner activates, ``end`` at :meth:`close`.
    ``map``/``imap`` may be called any number of times, one at a time. After an error or
    Ctrl-C inside a call the runner is closed (``is_active`` is False, no process left);
    :meth:`activate` starts it again.

    >>> from easycore import producer
    >>> @producer
    ... def inc(x):
    ...     return x + 1
    >>> with inc.open(devices="inline") as runner:
    ...     runner.map([1, 2])
    [2, 3]
    """

    def __init__(
        self,
        pipeline: Pipeline,
        devices: Any = "auto",
        *,
        cfg: Mapping[str, Any] | None = None,
        start_method: str | None = None,
        _wait: bool = True,
    ) -> None:
        self.pipeline = pipeline
        # False for the runner a one-shot map opens: work goes to each worker as soon as it
        # is ready instead of after the slowest one (init errors surface during the map).
        self._wait = _wait
        self._pools = _plan_pools(pipeline, devices)
        self.devices: tuple[str, ...] = tuple(d for p in self._pools for d in p.devices)
        self.cfg = _frozen_cfg(cfg)
        self._start_method = start_method
        self._inline = INLINE in self.devices
        if len(self._pools) > 1 and start_method == "fork":
            msg = (
                "a pipeline with several pools (.on) needs start_method 'forkserver' or "
                "'spawn': with 'fork', workers inherit each other's pipes"
            )
            raise ValueError(msg)
        self._workers: list[_Worker] = []
        self._waiter = _Waiter()
        self._active = False
        self._busy: object | None = None  # the run holding the runner, if any
        self._states: list[Any] = []
        self._slots: Any = None
        self._ctx: Any = None
        self._light = False  # workers fork from the light forkserver (see _light_wanted)
        self._pairs: dict[tuple[int, int], int] = {}  # (from slot, to slot) -> pipe key
        self._pair_keys = itertools.count()
        self._chunk_ids = itertools.count()
        self._last_run: _Run | None = None
        self._server: _Server | None = None
        # Guards _busy (the run holding the runner: a map/imap stream or the submit run),
        # _server and _refusing. Re-entrant: the submit run's source shares it.
        self._submit_lock = threading.RLock()
        self._refusing = False  # refuse submits: closing, or a map waits for the submit run
        self._last_server: _Server | None = None  # the last submit run (it may be ending)
        self._generation = 0  # +1 per activate(): a run of an earlier activation must stop
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self.startup_seconds = 0.0
        self.activate()

    # -- public state --------------------------------------------------------------------
    @property
    def is_active(self) -> bool:
        """True between :meth:`activate` and :meth:`close`."""
        return self._active

    @property
    def n_workers(self) -> int:
        """How many workers this runner has, over all its pools (1 for ``"inline"``)."""
        return 1 if self._inline else len(self.devices)

    def __repr__(self) -> str:
        state = "active" if self._active else "closed"
        if len(self._pools) > 1:
            where = ", ".join(f"{p.name}: {list(p.devices)}" for p in self._pools)
            return f"<Runner {self.pipeline!r} on {{{where}}} ({state})>"
        return f"<Runner {self.pipeline!r} on {list(self.devices)} ({state})>"

    def stats(self) -> list[StageStats]:
        """Per pool, for the run under way or the last one: what is done, busy and queued.

        The pool whose workers are busy near 100% while the pool before it has results
        waiting is the bottleneck; give it more devices.
        """
        run = self._last_run
        if run is None:
            return [StageStats(p.name, p.devices) for p in self._pools]
        return run.stats()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        # Leaving early (GeneratorExit from an abandoned imap) is a normal close, not an error.
        if exc[0] is None or exc[0] is GeneratorExit:
            self.close()
        else:
            self._abort()

    # -- lifecycle -----------------------------------------------------------------------
    def activate(self) -> None:
        """Start the workers and run every producer's ``init``; no-op when already active.

        Raises:
            WorkerError: an ``init`` raised (no worker is left running).
            WorkerDied: a worker died while starting.
            SerializationError: a stage function or ``cfg`` cannot be pickled.
        """
        if self._active:
            return
        self._generation += 1  # a leftover run of the previous activation sees it and ends
        leftover = self._last_server
        if leftover is not None and not leftover.is_current():
            self._stop_server(abort=True)
            leftover.finished.wait(ABORT_GRACE + 3.0)
        self._refusing = False
        t0 = time.perf_counter()
        producers = self.pipeline.producers
        if self._inline:
            self._activate_inline()
        elif producers:
            for pool in self._pools:
                try:
                    pool.payload = cloudpickle.dumps((pool.stages, self.cfg), _worker._PROTOCOL)
                except Exception as exc:
                    culprit = _culprit_of(pool.stages, self.cfg)
                    msg = f"{culprit}; workers receive their functions pickled"
                    raise SerializationError(msg) from exc
            self._ctx = _context(self._start_method)
            self._light = _light_wanted(self._ctx.get_start_method(), self.devices)
            n = len(self.devices)
            self._slots = self._ctx.RawArray("d", _SLOT * n)
            self._active = True
            try:
                self._workers = []
                self._pairs.clear()
                for i in range(n):
                    self._workers.append(self._spawn(i))
                self._finalizer = weakref.finalize(self, _kill_all, [w.proc for w in self._workers])
                while self._wait and not all(w.ready for w in self._workers):
                    self._wait_and_handle(None, on_result=None)
            except BaseException:
                self._abort()
                raise
        self._active = True
        self.startup_seconds = time.perf_counter() - t0

    def _activate_inline(self) -> None:
        context = {"device": "cpu", "cfg": self.cfg, "worker": 0}
        self._states = []
        for stage in self.pipeline.producers:
            if not stage.has_init:
                self._states.append(None)
                continue
            try:
                self._states.append(stage.init(**{n: context[n] for n in stage.init_names}))
            except Exception as exc:
                self._end_inline(suppress=True)
                self._wrap_local(exc, f"{stage.name} (init)", None, "while starting")
        self._active = True

    def _pool_of(self, slot: int) -> _PoolSpec:
        for pool in reversed(self._pools):
            if slot >= pool.first_slot:
                return pool
        raise AssertionError(slot)  # pragma: no cover

    def _spawn(self, slot: int) -> _Worker:
        device = self.devices[slot]
        pool = self._pool_of(slot)
        index = slot - pool.first_slot
        cpus = _cpu_count()
        env_set = any(k in os.environ for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"))
        threads = None if env_set else max(1, cpus // len(self.devices))
        role = None
        if len(self._pools) > 1:
            role = (pool.index, pool.index == len(self._pools) - 1, pool.batch, pool.unit)
        parent, child = self._ctx.Pipe(duplex=True)
        entropy = int.from_bytes(os.urandom(8), "little") >> 1
        proc = self._ctx.Process(
            target=_worker.worker_main,
            args=(child, self._slots, slot, index, device, threads, pool.payload, entropy, role),
            name=f"easycore-worker-{slot}-{device}",
            daemon=True,
        )
        with _hidden_main(self._light):
            proc.start()
        child.close()
        self._slots[_SLOT * slot + 1] = 0.0
        self._slots[_SLOT * slot + 2] = -1.0
        return _Worker(
            slot=slot, index=index, pool=pool.index, device=device, proc=proc, chan=Channel(parent)
        )

    def _pair(self, src: _Worker, dst: _Worker) -> tuple[int, int | None]:
        """The pipe from ``src`` to ``dst`` (next pool): its key, and ``src``'s end if new.

        Raises:
            OSError: ``dst`` is dying (nothing is registered then).

        A new pipe is a socket pair made here: ``dst`` gets its end now, ``src`` with the
        forward order; we keep neither end, so a worker's death is an EOF to its peers.
        """
        key = self._pairs.get((src.slot, dst.slot))
        if key is not None:
            return key, None
        key = next(self._pair_keys)
        a, b = socket.socketpair()
        try:
            dst.chan.send_control(("peer", key), b.fileno())
        except BaseException:
            a.close()
            raise
        finally:
            b.close()
        self._pairs[(src.slot, dst.slot)] = key
        return key, a.detach()

    def close(self) -> None:
        """Run every worker's ``end`` and stop the workers; idempotent.

        Raises:
            WorkerError: an ``end`` raised (the workers are stopped all the same).
            WorkerDied: a worker died during ``end``.
        """
        try:
            self._stop_server(abort=False)  # submitted items finish first
        except BaseException:
            self._abort()
            raise
        if not self._active:
            return
        if self._inline:
            self._active = False
            self._end_inline(suppress=False)
            return
        self._shutdown(grace=None, report=True)

    def _abort(self) -> None:
        """Stop everything now after an error or interrupt: `end` gets a short grace."""
        self._stop_server(abort=True, timeout=ABORT_GRACE + 3.0)
        if self._inline:
            if self._active:
                self._active = False
                self._end_inline(suppress=True)
            return
        if self._workers or self._active:
            self._shutdown(grace=ABORT_GRACE, report=False)

    def _shutdown(self, grace: float | None, report: bool) -> None:
        self._active = False
        workers, self._workers = self._workers, []
        failure: BaseException | None = None
        try:
            for w in workers:
                if w.alive:
                    with contextlib.suppress(OSError, ValueError):
                        w.conn.send_bytes(_worker.STOP)
            deadline = None if grace is None else time.monotonic() + grace
            waiting = {w.slot: w for w in workers if w.alive}
            while waiting:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                if remaining == 0.0:
                    break
                objs = [w.conn for w in waiting.values()] + [
                    w.proc.sentinel for w in waiting.values()
                ]
                ready = mp.connection.wait(objs, remaining)
                if not ready:
                    break
                for w in list(waiting.values()):
                    done, err = self._read_goodbye(w)
                    if err is not None and failure is None:
                        failure = err
                    if done:
                        del waiting[w.slot]
        except BaseException:
            _kill_all([w.proc for w in workers])
            raise
        finally:
            for w in workers:
                if w.proc.is_alive():
                    w.proc.join(0.5 if grace is not None else 5.0)
                if w.proc.is_alive():
                    w.proc.kill()
                w.proc.join(2.0)
                with contextlib.suppress(Exception):
                    w.chan.close()
                w.alive = False
            if self._finalizer is not None:
                self._finalizer.detach()
                self._finalizer = None
        if report and failure is not None:
            raise failure

    def _read_goodbye(self, w: _Worker) -> tuple[bool, BaseException | None]:
        """Read what a stopping worker sends; (finished?, error from its `end`)."""
        try:
            while w.chan.poll():
                msg = w.chan.recv()
                if msg[0] == _worker.READY:
                    w.ready = True
                    _note_torch(msg[4])
                elif msg[0] == _worker.ENDED:
                    _note_torch(msg[1])
                    return True, None
                if msg[0] in (_worker.END_ERROR, _worker.INIT_ERROR):
                    try:
                        what = "while ending" if msg[0] == _worker.END_ERROR else "while starting"
                        _raise_remote(
                            msg[1:], device=w.device, worker=w.slot, index=None, what=what
                        )
                    except WorkerError as exc:
                        return True, exc
                # replies of chunks that no longer matter are dropped
        except (EOFError, OSError):
            pass
        if not w.proc.is_alive():
            w.proc.join(0.1)
            code = w.proc.exitcode
            if code not in (0, None):
                when = "while ending" if w.ready else "while starting (during init)"
                return True, WorkerDied(
                    f"worker {w.slot} on {w.device} died {when}: {describe_exitcode(code)}",
                    w.device,
                    w.slot,
                    code,
                )
            return True, None
        return False, None

    def _end_inline(self, *, suppress: bool) -> None:
        context = {"device": "cpu", "cfg": self.cfg, "worker": 0}
        first: BaseException | None = None
        for stage, state in zip(self.pipeline.producers, self._states, strict=False):
            if stage.end is None:
                continue
            try:
                stage.end(**{n: {**context, "state": state}[n] for n in stage.end_names})
            except Exception as exc:
                if first is None:
                    try:
                        self._wrap_local(exc, f"{stage.name} (end)", None, "while ending")
                    except WorkerError as wrapped:
                        first = wrapped
        self._states = []
        if first is not None and not suppress:
            raise first

    @staticmethod
    def _wrap_local(
        exc: BaseException, stage: str, index: int | None, what: str, device: str | None = "cpu"
    ) -> NoReturn:
        import traceback

        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        where = "inline on cpu (worker 0)" if device is not None else "in the calling process"
        msg = f"{stage} raised {type(exc).__name__}: {exc}\n  {what} {where}\n\nTraceback:\n{tb}"
        raise WorkerError(msg, stage, device, 0 if device else None, index, tb) from exc

    # -- running -------------------------------------------------------------------------
    def map(
        self,
        data: Iterable[Any],
        ordered: bool = True,
        batch_size: int | None = None,
        progress: bool = False,
        seed: int | None = None,
        timeout: float | None = None,
        retries: int = 0,
    ) -> Any:
        """Run ``data`` through the pipeline on this runner's workers.

        Returns:
            The consumer's result, or a list of the producers' results without a consumer.

        Raises:
            RuntimeError: the runner is closed (call ``activate()``) or busy.
            WorkerError, WorkerDied, ItemTimeout: see :mod:`easycore._errors`.
        """
        check_run_args(batch_size=batch_size, timeout=timeout, retries=retries, seed=seed)
        batch_size = self._first_batch(batch_size)
        stream = self._results(data, ordered, batch_size, progress, seed, timeout, retries)
        cons = self.pipeline.consumer
        if cons is None:
            out: list[Any] = []
            for _, values in stream:
                out.extend(values)
            return out
        context = {"cfg": self.cfg}
        kw = {n: context[n] for n in cons.fn_names}
        acc = self._consumer_init(cons)
        fn = cons.fn
        if kw:
            fn = functools.partial(fn, **kw)
        failure: tuple[Exception, int] | None = None
        try:
            for index, values in stream:
                folded = iter(values)
                try:
                    for y in folded:
                        new = fn(acc, y)
                        if new is not None:
                            acc = new
                except Exception as exc:
                    # `folded` stopped just after the failing result: what is left names it
                    failure = (exc, index + len(values) - 1 - sum(1 for _ in folded))
                    break
        except Exception:
            raise  # the run's own error (the runner is closed) or the input's, as raised
        except BaseException:
            self._abort()
            stream.close()
            raise
        if failure is not None:
            self._abort()
            stream.close()
            error, at = failure
            label = _item_label(at, batch_size)
            self._wrap_local(error, cons.name, at, f"while folding {label}", None)
        if cons.end is None:
            return acc
        try:
            return cons.end(acc, **{n: context[n] for n in cons.end_names})
        except Exception as exc:
            self._wrap_local(exc, f"{cons.name} (end)", None, "while finishing", None)

    def _consumer_init(self, cons: Stage) -> Any:
        if callable(cons.init):
            try:
                return cons.init(**{n: self.cfg for n in cons.init_names})
            except Exception as exc:
                self._wrap_local(exc, f"{cons.name} (init)", None, "while starting", None)
        return copy.deepcopy(cons.init)

    def imap(
        self,
        data: Iterable[Any],
        ordered: bool = True,
        batch_size: int | None = None,
        progress: bool = False,
        seed: int | None = None,
        timeout: float | None = None,
        retries: int = 0,
    ) -> Iterator[Any]:
        """Yield the producers' results lazily, with bounded memory (no consumer allowed)."""
        if self.pipeline.consumer is not None:
            msg = f"imap is for pipelines without a consumer; {self.pipeline!r} has one: use map"
            raise TypeError(msg)
        check_run_args(batch_size=batch_size, timeout=timeout, retries=retries, seed=seed)
        batch_size = self._first_batch(batch_size)
        stream = self._results(data, ordered, batch_size, progress, seed, timeout, retries)
        return (y for _, values in stream for y in values)

    def _results(
        self,
        data: Iterable[Any],
        ordered: bool,
        batch_size: int | None,
        progress: bool,
        seed: int | None,
        timeout: float | None,
        retries: int,
    ) -> _Claimed:
        """Yield segments ``(index of first item, results)`` in the requested order.

        The runner is taken for this run now (a second run raises ``RuntimeError``) and
        given back when the stream ends, is closed, or is dropped.
        """
        token = self._claim()
        try:
            stream = self._open_stream(data, ordered, batch_size, progress, seed, timeout, retries)
        except BaseException:
            self._release(token)
            raise
        return _Claimed(self, token, stream)

    def _claim(self) -> object:
        """Take the runner for one map/imap (a submit run is waited for); return the token."""
        while True:
            with self._submit_lock:
                if not self._active:
                    msg = "this runner is closed: call runner.activate() to start its workers again"
                    raise RuntimeError(msg)
                if self._busy is None:
                    token = self._busy = object()
                    return token
                server = self._server
            if server is None or server.is_current():
                msg = "this runner is already running a map/imap; runs go one at a time"
                raise RuntimeError(msg)
            self._stop_server(abort=False, refuse=False)  # let submitted items finish first

    def _release(self, token: object) -> None:
        with self._submit_lock:
            if self._busy is token:
                self._busy = None

    def _open_stream(
        self,
        data: Iterable[Any],
        ordered: bool,
        batch_size: int | None,
        progress: bool,
        seed: int | None,
        timeout: float | None,
        retries: int,
    ) -> Iterator[tuple[int, list[Any]]]:
        source: Iterable[Any] = _batched(data, batch_size) if batch_size else data
        total = None
        with contextlib.suppress(TypeError):
            n = len(data)  # type: ignore[arg-type]
            total = n if batch_size is None else math.ceil(n / batch_size)
        bars = self._progress_bars(total) if progress else None
        if self._inline or not self.pipeline.producers:
            stream = self._stream_inline(source, seed, retries, batch_size)
        else:
            stream = self._stream(source, ordered, seed, timeout, retries, batch_size, bars)
        if bars is None:
            return stream
        if len(bars) == 1:
            return self._with_progress(stream, bars)
        return self._closing(stream, bars)

    def _first_batch(self, batch_size: int | None) -> int | None:
        """``map``'s batch_size, or the first pool's ``.on(batch_size=...)``."""
        groups = self.pipeline.pools
        bound = groups[0][1] if groups else None
        if bound is None or bound.batch_size is None:
            return batch_size
        if batch_size is not None and batch_size != bound.batch_size:
            msg = (
                f"batch_size={batch_size} conflicts with the first pool's "
                f".on(batch_size={bound.batch_size}); give it once"
            )
            raise ValueError(msg)
        return bound.batch_size

    def _progress_bars(self, total: int | None) -> list[Any]:
        from tqdm.auto import tqdm

        bars = []
        multi = len(self._pools) > 1
        for k, pool in enumerate(self._pools):
            n = None if total is None else math.ceil(total / pool.unit)
            desc = f"{pool.name} ({len(pool.devices)})" if multi else None
            bars.append(tqdm(total=n, unit="item", dynamic_ncols=True, position=k, desc=desc))
        return bars

    @staticmethod
    def _with_progress(
        stream: Iterator[tuple[int, list[Any]]], bars: list[Any]
    ) -> Iterator[tuple[int, list[Any]]]:
        try:
            for segment in stream:
                bars[0].update(len(segment[1]))
                yield segment
        finally:
            bars[0].close()

    @staticmethod
    def _closing(
        stream: Iterator[tuple[int, list[Any]]], bars: list[Any]
    ) -> Iterator[tuple[int, list[Any]]]:
        try:
            yield from stream  # the run updates each pool's bar as its chunks finish
        finally:
            for bar in bars:
                bar.close()

    def _stream_inline(
        self,
        source: Iterable[Any],
        seed: int | None,
        retries: int,
        batch_size: int | None,
        abort: bool = True,
    ) -> Iterator[tuple[int, list[Any]]]:
        context = {"device": "cpu", "cfg": self.cfg, "worker": 0}
        states = iter(self._states or [None] * len(self.pipeline.producers))
        if seed is None and self.pipeline.producers:
            _worker.seed_everything(int.from_bytes(os.urandom(8), "little") >> 1)
        stream: Iterator[tuple[int, Any]] = enumerate(source)
        for pool in self._pools:
            stages = [
                (s, {n: {**context, "state": st}[n] for n in s.fn_names})
                for s, st in zip(pool.stages, states, strict=False)
            ]
            if pool.batch:
                stream = enumerate(_batched((v for _, v in stream), pool.batch))
            label = batch_size if pool.index == 0 else pool.batch
            stream = self._inline_pool(stream, stages, pool.index, seed, retries, label, abort)
        try:
            for index, value in stream:
                yield index, [value]
        except GeneratorExit:
            raise  # the caller stopped early: not an error
        except BaseException:
            # the input's own error or an interrupt: closed, as a process runner would be
            # (a stage's error has closed it already)
            if abort:
                self._abort()
            raise

    def _inline_pool(
        self,
        stream: Iterator[tuple[int, Any]],
        stages: list[tuple[Stage, dict[str, Any]]],
        pool: int,
        seed: int | None,
        retries: int,
        batch_size: int | None,
        abort: bool = True,
    ) -> Iterator[tuple[int, Any]]:
        for index, item in stream:
            attempt = 0
            while True:
                hooks: list[Any] = []
                if seed is not None:
                    _worker.seed_everything(_worker.derive_seed(seed, index, pool))
                    # as in a worker: torch or numpy first imported by this item's work is
                    # seeded for it (hooks only for those not loaded, only while stages run)
                    hooks = _worker.seed_on_import()
                value, failed = item, None
                try:
                    for stage, kw in stages:
                        try:
                            value = stage.fn(value, **kw)
                        except Exception as error:
                            failed = (stage, error)
                            break
                finally:
                    _worker.drop_hooks(hooks)
                if failed is None:
                    break
                attempt += 1
                if attempt > retries:
                    if abort:  # (a submitted item's error fails only its future)
                        self._abort()
                    stage, exc = failed
                    self._wrap_local(
                        exc, stage.name, index, f"while running {_item_label(index, batch_size)}"
                    )
            yield index, value

    def submit(self, item: Any) -> concurrent.futures.Future[Any]:
        """Send one item to the workers now; its result arrives in the returned future.

        For callers that feed items one at a time (a server, a training loop prefetching
        batches). Items run as workers free up, in no set order. An item that raises, or
        whose worker dies, fails only its own future (``WorkerError``/``WorkerDied``; the
        worker is respawned); the rest go on. ``map``/``imap`` and :meth:`close` first wait
        for the submitted items to finish. Safe to call from several threads, and from a
        future's callback.

        Raises:
            RuntimeError: the runner is closed or closing, or a ``map``/``imap`` is running.
            TypeError: the pipeline has a consumer, or a pool groups items (``batch_size``):
                one item, one result.
        """
        if self.pipeline.consumer is not None:
            msg = f"submit is for pipelines without a consumer; {self.pipeline!r} has one"
            raise TypeError(msg)
        first = self.pipeline.pools[0][1] if self.pipeline.pools else None
        if self._pools[-1].unit > 1 or (first is not None and first.batch_size is not None):
            msg = "submit needs one result per item; a pool of this pipeline has a batch_size"
            raise TypeError(msg)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # queued items run; cancel() cannot stop them
        if self._inline or not self.pipeline.producers:
            self._submit_inline(item, future)
            return future
        with self._submit_lock:
            if not self._active or self._refusing:
                msg = (
                    "this runner is closed: call runner.activate() to start its workers again"
                    if not self._active
                    else "this runner is closing, or a map/imap waits for submitted items"
                )
                raise RuntimeError(msg)
            server = self._server
            if server is not None and server.put(item, future):
                return future
            if self._busy is not None:
                msg = "this runner is already running a map/imap; runs go one at a time"
                raise RuntimeError(msg)
            self._server = _Server(self, item, future)  # takes the runner (_busy)
            self._last_server = self._server
            return future

    def _submit_inline(self, item: Any, future: concurrent.futures.Future[Any]) -> None:
        token = self._claim()
        try:
            stream = self._stream_inline([item], None, 0, None, abort=False)
            future.set_result(next(stream)[1][0])
        except EasycoreError as exc:
            future.set_exception(exc)
        finally:
            self._release(token)

    def _stop_server(self, abort: bool, refuse: bool = True, timeout: float | None = None) -> None:
        """End the submit run: wait for its items (or drop them, ``abort``).

        New submits are refused meanwhile (``refuse=False`` allows them again after). The
        run stays registered until its thread has ended, so an interrupted wait can be
        followed by an abort that still finds it.
        """
        with self._submit_lock:
            self._refusing = True
            server = self._server
        try:
            if server is not None:
                server.stop(abort, timeout)  # joins, unless called from the server thread
        finally:
            with self._submit_lock:
                if (
                    server is not None
                    and self._server is server
                    and (server.is_current() or server.finished.is_set())
                ):
                    self._server = None
                if not refuse:
                    self._refusing = False

    # -- the process loop ----------------------------------------------------------------
    def _stream(
        self,
        source: Iterable[Any],
        ordered: bool,
        seed: int | None,
        timeout: float | None,
        retries: int,
        batch_size: int | None,
        bars: list[Any] | None,
        tolerant: bool = False,
    ) -> Iterator[tuple[int, list[Any]]]:
        run = _Run(self, source, ordered, seed, timeout, retries, batch_size, bars)
        run.tolerant = tolerant
        self._last_run = run  # for stats(); it lets go of the data when the run ends
        try:
            yield from run.loop()
        except GeneratorExit:
            # The caller stopped early (break out of imap): wait for what is in flight and
            # drop it, so the runner stays usable. Ctrl-C while waiting aborts instead.
            if self._active:
                try:
                    run.drain()
                except BaseException:
                    self._abort()
                    raise
            raise
        except BaseException:
            self._abort()
            raise
        finally:
            run.let_go()

    def _wait_and_handle(
        self,
        timeout: float | None,
        on_result: Callable[[_Worker, Any], None] | None,
        extra: Sequence[Any] = (),
    ) -> None:
        """Wait for any pipe or sentinel, then handle it. Used at start-up and by `_Run`."""
        live = [w for w in self._workers if w.alive]
        fds = [w.conn.fileno() for w in live] + [w.proc.sentinel for w in live]
        fds += [x if isinstance(x, int) else x.fileno() for x in extra]
        ready = self._waiter.wait(fds, timeout)
        n = len(live)
        for k, w in enumerate(live):
            if fds[k] in ready or fds[n + k] in ready:
                self._handle(w, on_result)

    def _handle(self, w: _Worker, on_result: Callable[[_Worker, Any], None] | None) -> None:
        # Read everything the worker sent before looking at whether it is alive: a result that
        # reached the pipe before the death must count, and must not be re-run.
        broken = False
        try:
            while w.chan.poll():
                frame, fds = w.chan.recv_frame()
                msg = w.chan.decode(frame, fds)
                tag = msg[0]
                if tag == _worker.READY:
                    w.ready = True
                    _note_torch(msg[4])
                elif tag == _worker.INIT_ERROR:
                    _raise_remote(
                        msg[1:], device=w.device, worker=w.slot, index=None, what="while starting"
                    )
                elif tag == _worker.UNREADABLE and on_result is not None:
                    on_result(w, msg)
                elif tag == _worker.DONE and on_result is not None:
                    w.last_nbytes = len(frame) + w.chan.shm_in
                    w.chan.shm_in = 0
                    on_result(w, msg)
                elif tag in _PIPE_TAGS and on_result is not None:
                    on_result(w, msg)
        except (EOFError, OSError):
            broken = True
        if broken or w.exited():
            w.proc.join(1.0)
            if w.proc.is_alive():  # pipe broke but the process lingers: finish it
                w.proc.kill()
                w.proc.join(1.0)
            w.alive = False
            with contextlib.suppress(Exception):
                w.chan.close()
            if not w.ready:
                code = w.proc.exitcode
                msg = (
                    f"worker {w.slot} on {w.device} died while starting (during init): "
                    f"{describe_exitcode(code)}"
                )
                raise WorkerDied(msg, w.device, w.slot, code)
            if on_result is None:  # pragma: no cover - only during start-up
                raise WorkerDied(
                    f"worker {w.slot} on {w.device} died", w.device, w.slot, w.proc.exitcode
                )
            on_result(w, None)  # None: the worker is gone

    def _respawn(self, slot: int) -> None:
        for pair in [p for p in self._pairs if slot in p]:
            del self._pairs[pair]
        self._workers[slot] = self._spawn(slot)
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _kill_all, [w.proc for w in self._workers])


class _Run:
    """The state of one ``map``/``imap`` call on an active process runner.

    Work moves in chunks of consecutive first-pool items; results come back per chunk and
    are delivered as segments ``(start index, [results])``, so the per-item cost in the
    caller is a list append, not a message.

    With several pools, a chunk finished by pool ``p`` stays in that worker (``held``) until
    a worker of pool ``p + 1`` has room; then we tell the holder to send it there directly
    (``fwd``), and the holder confirms (``SENT``). We route, so we know where every chunk is:
    when a worker dies, each chunk it ran, held, or was about to receive is re-run from its
    first-pool items (kept here) under a new id, and a late reply for the old id is dropped,
    so nothing is lost or delivered twice. Chunks hold a whole number of the last pool's
    items, so every pool's batches are the same whatever the routing.
    """

    def __init__(
        self,
        runner: Runner,
        source: Iterable[Any],
        ordered: bool,
        seed: int | None,
        timeout: float | None,
        retries: int,
        batch_size: int | None,
        bars: list[Any] | None = None,
    ) -> None:
        self.r = runner
        self.pools = runner._pools
        self.multi = len(self.pools) > 1
        self.align = self.pools[-1].unit  # chunks hold whole items of every pool
        # A range is cut into sub-ranges: three ints on the wire per chunk instead of every item.
        self.range = source if type(source) is range else None
        # With a known length, chunks shrink as the input runs out ("guided" scheduling), so
        # the workers finish together instead of one waiting on the other's last big chunk.
        self.total: int | None = None
        with contextlib.suppress(TypeError):
            self.total = len(source)  # type: ignore[arg-type]
        self.live_src = source if isinstance(source, _LiveSource) else None
        self.it = iter(source) if self.live_src is None else iter(())
        self.tolerant = False  # submit(): a failed item fails its own future, the run goes on
        self.pulled = 0  # items taken from the source so far (the next item's index)
        self.exhausted = False
        self.ordered = ordered
        self.seed = seed
        self.timeout = timeout
        self.retries = retries
        self.batch_size = batch_size
        self.bars = bars if self.multi else None
        self.redo: deque[tuple[int, Sequence[Any]]] = deque()
        self.attempts: dict[tuple[int, int], int] = {}  # (pool, item index) -> runs charged
        # results, and how many first-pool items they stand for
        self.segments: dict[int, tuple[list[Any], int]] = {}  # ordered: by start index
        self.ready: deque[tuple[int, list[Any], int]] = deque()  # unordered: as they come
        self.next_out = 0
        self.taken = 0  # items pulled from the source and not yet yielded
        # one sizer per pool: chunks are as big as the slowest pool allows
        self.sizers = [_ChunkSizer() for _ in self.pools]
        self.chunk_size = self.align
        # ids never repeat on a runner: a late reply from an earlier run cannot match a chunk
        self.chunk_ids = runner._chunk_ids
        self.live: dict[int, _Chunk] = {}
        self.waiting: list[list[_Chunk]] = [[] for _ in self.pools]  # held, by pool
        self.done = [0] * len(self.pools)
        self.busy_seconds = [0.0] * len(self.pools)
        self.started = time.monotonic()
        self.finished: float | None = None
        self.failures: dict[int, _Failed] = {}  # tolerant runs: index -> its error
        self.idle_deaths: dict[int, int] = {}  # slot -> deaths that charged no item
        self.generation = runner._generation

    # -- insight ---------------------------------------------------------------------------
    def stats(self) -> list[StageStats]:
        wall = max((self.finished or time.monotonic()) - self.started, 1e-9)
        out = []
        for pool in self.pools:
            p = pool.index
            per = pool.unit
            workers = [w for w in list(self.r._workers) if w.pool == p]
            # snapshots: another thread (a submit run) may be changing these
            queued = sum(len(c.items) for w in workers for c in list(w.outstanding.values()))
            waiting = sum(len(c.items) for c in list(self.waiting[p]))
            busy = self.busy_seconds[p] / (wall * len(pool.devices))
            out.append(
                StageStats(
                    pool.name,
                    pool.devices,
                    done=self.done[p],
                    busy=min(1.0, busy),
                    queued=-(-queued // per),
                    waiting=-(-waiting // per),
                )
            )
        return out

    def _label(self, pool: int, index: int) -> str:
        batch = self.batch_size if pool == 0 else self.pools[pool].batch
        label = _item_label(index, batch)
        if self.multi:
            label = f"{label} of stage {self.pools[pool].name!r}"
        return label

    # -- dispatch --------------------------------------------------------------------------
    def window(self) -> int:
        # One chunk per worker beyond what the workers hold: new work can go out while the
        # results just received still wait to be yielded.
        n = len(self.r._workers)
        return max((DEPTH + 1) * n * self.chunk_size, 2 * DEPTH * n * self.align)

    def _floor(self) -> int:
        return min((s.floor() for s in self.sizers if s.per_item is not None), default=1)

    def _resize(self, pool: int, n: int, elapsed: float, nbytes: int) -> None:
        self.sizers[pool].update(n, elapsed, nbytes)
        self._resize_to_sizers()

    def _resize_to_sizers(self) -> None:
        if any(s.per_item is None for s in self.sizers):
            return  # a pool not yet measured may be the slow one: no big chunks before then
        size = min(s.size for s in self.sizers)
        self.chunk_size = max(self.align, size - size % self.align)

    def _take(self) -> tuple[int, Sequence[Any]] | None:
        if self.redo:
            return self.redo.popleft()
        room = min(self.chunk_size, self.window() - self.taken)
        if self.total is not None:
            share = -(-(self.total - self.pulled) // (2 * len(self.pools[0].devices)))
            room = min(room, max(share, self._floor()))
        if room <= 0 or self.exhausted:
            return None
        if self.align > 1:
            room = max(self.align, room - room % self.align)
        items: Sequence[Any]
        if self.live_src is not None:
            queued = self.live_src.items
            items = [queued.popleft() for _ in range(min(room, len(queued)))]
            if self.live_src.closed and not queued:
                self.exhausted = True
        elif self.range is not None:
            items = self.range[self.pulled : self.pulled + room]
        else:
            items = list(itertools.islice(self.it, room))
        if len(items) < room and self.live_src is None:
            self.exhausted = True
        if not items:
            return None
        start = self.pulled
        self.pulled += len(items)
        self.taken += len(items)
        return start, items

    def dispatch(self) -> None:
        if self.multi:
            self._route()
            self._give_back()
        timed = self.timeout is not None
        for w in self.r._workers:
            if w.pool:
                break
            while w.alive and w.ready and len(w.outstanding) < DEPTH:
                taken = self._take()
                if taken is None:
                    return
                start, items = taken
                chunk = _Chunk(next(self.chunk_ids), start, items, slot=w.slot, run=self)
                try:
                    frame = w.chan.encode(
                        (chunk.id, self.seed, start, items, timed, self.retries, self._spent(chunk))
                    )
                except Exception as exc:
                    if not self.tolerant:
                        self._unpicklable(w, start, items, exc)
                    self._fail_unpicklable(start, items)
                    continue
                w.outstanding[chunk.id] = chunk
                self.live[chunk.id] = chunk
                try:
                    w.chan.send_frame(frame)
                except OSError:
                    break  # the worker is dying; its sentinel will tell us and we re-queue

    def _give_back(self) -> None:
        """Tell last-pool workers which of their segments we are done with.

        Workers of the first pool learn it from the next chunk we send them; the others get
        no chunks from us, so a bare note carries the list (else they would map new shared
        memory for every result).
        """
        for w in self.r._workers[self.pools[-1].first_slot :]:
            if w.alive and w.chan.released:
                with contextlib.suppress(OSError):
                    w.chan.send(None)

    def _spent(self, chunk: _Chunk) -> dict[tuple[int, int], int]:
        """Runs already charged to items of this chunk (by deaths), for the worker's retries."""
        if not self.attempts:
            return {}
        end = chunk.start + len(chunk.items)
        return {
            (p, i): n
            for (p, i), n in self.attempts.items()
            if chunk.start <= i * self.pools[p].unit < end
        }

    def _route(self) -> None:
        """Send chunks finished by pool p to workers of pool p + 1 that have room."""
        workers = self.r._workers
        for p in range(len(self.pools) - 2, -1, -1):
            held = self.waiting[p]
            if not held:
                continue
            nxt = self.pools[p + 1]
            targets = workers[nxt.first_slot : nxt.first_slot + len(nxt.devices)]
            while held:
                room = [t for t in targets if t.alive and t.ready and len(t.outstanding) < DEPTH]
                if not room:
                    break
                dst = min(room, key=lambda t: len(t.outstanding))
                chunk = held[0]
                src = workers[chunk.slot]
                try:
                    key, fd = self.r._pair(src, dst)
                except OSError:
                    break  # dst is dying: its sentinel will tell us, the chunk stays held
                held.pop(0)
                try:
                    src.chan.send_control(("fwd", chunk.id, key), fd)
                except OSError:
                    # the holder is dying: leave the chunk with it, its death re-runs it
                    held.insert(0, chunk)
                    break
                finally:
                    if fd is not None:
                        os.close(fd)
                chunk.pool, chunk.src, chunk.slot, chunk.held = p + 1, src.slot, dst.slot, False
                dst.outstanding[chunk.id] = chunk

    def _fail_unpicklable(self, start: int, items: Sequence[Any]) -> None:
        """Tolerant runs: the items that do not pickle fail; the others go again one by one."""
        for k, item in enumerate(items):
            try:
                cloudpickle.dumps(item)
            except Exception as inner:
                msg = f"item {start + k} cannot be pickled to reach a worker: {inner}"
                error = SerializationError(msg, "<item pickling>", None, None, start + k)
                error.__cause__ = inner
                self.failures[start + k] = _Failed(error)
                self._deliver_failure(start + k)
            else:
                self.redo.append((start + k, [item]))

    def _unpicklable(
        self, w: _Worker, start: int, items: Sequence[Any], exc: Exception
    ) -> NoReturn:
        for k, item in enumerate(items):
            try:
                cloudpickle.dumps(item)  # a probe: must not consume releases
            except Exception as inner:
                label = _item_label(start + k, self.batch_size)
                msg = (
                    f"{label} cannot be pickled to reach a worker: {inner} "
                    f"(item: {_short_repr(item)})"
                )
                raise SerializationError(msg, "<item pickling>", None, None, start + k) from inner
        raise SerializationError(f"a chunk of items cannot be pickled: {exc}") from exc

    # -- results ---------------------------------------------------------------------------
    def on_message(self, w: _Worker, msg: Any) -> None:
        if msg is None:
            self._on_death(w)
            return
        tag = msg[0]
        if tag == _worker.SENT:
            chunk = w.holding.pop(msg[1], None)
            if chunk is not None:
                self.sizers[w.pool].limit_bytes(len(chunk.items), msg[2])
                self._resize_to_sizers()
                if chunk.src == w.slot:
                    chunk.src = -1
            return
        if tag == _worker.UNREADABLE:
            if not w.outstanding:
                msg = f"a chunk could not be unpickled in worker {w.index} on {w.device}"
                raise SerializationError(msg)
            chunk = w.outstanding[min(w.outstanding)]
            unit = self.pools[w.pool].unit
            first, last = chunk.start // unit, (chunk.start + len(chunk.items) - 1) // unit
            what = (
                f"while unpickling {self._label(w.pool, first)} .. "
                f"{_item_label(last, None)} in the worker"
            )
            try:
                _raise_remote(msg[1:], device=w.device, worker=w.index, index=first, what=what)
            except WorkerError as exc:
                error = SerializationError(str(exc), *exc.args[1:])
                error.__cause__ = exc.__cause__
                if not self.tolerant:
                    raise error from exc.__cause__
                # tolerant: the chunk's items fail (which one is unknown), the run goes on
                self._untrack(chunk)
                for k in range(len(chunk.items)):
                    self.failures[chunk.start + k] = _Failed(error)
                    self._deliver_failure(chunk.start + k)
                return
        if tag == _worker.BAD_OUTPUT:
            _, chunk_id, k, entry = msg
            chunk = self.live.get(chunk_id)
            if chunk is None:
                return
            if self.tolerant:  # fail that item; the chunk's others run again
                self._untrack(chunk)
                self._fail_items(w, chunk, [(k, entry)], middle=True)
                return
            index = chunk.start // self.pools[w.pool].unit + k
            what = f"while sending {self._label(w.pool, index)} to the next stage"
            _raise_remote(entry, device=w.device, worker=w.index, index=index, what=what)
        chunk_id, values, errors, elapsed = msg[1], msg[2], msg[3], msg[4]
        chunk = w.outstanding.pop(chunk_id, None)
        if chunk is None or self.live.get(chunk_id) is not chunk:
            # a chunk we already re-ran elsewhere (its sender died before confirming)
            if tag == _worker.MID:
                with contextlib.suppress(OSError):
                    w.chan.send_control(("drop", chunk_id))
            return
        if chunk.src >= 0:  # it arrived before its sender's confirmation did
            self.r._workers[chunk.src].holding.pop(chunk_id, None)
            chunk.src = -1
        p = w.pool
        unit = self.pools[p].unit
        n = values if tag == _worker.MID else len(values)
        self.done[p] += n
        self.busy_seconds[p] += elapsed
        if self.bars is not None:
            self.bars[p].update(n)
        self._resize(p, len(chunk.items), elapsed, w.last_nbytes if tag == _worker.DONE else 0)
        if errors and not self.tolerant:
            k, entry = min(errors, key=lambda e: e[0])
            index = chunk.start // unit + k
            what = f"while running {self._label(p, index)}{_after(self.retries)}"
            _raise_remote(entry, device=w.device, worker=w.index, index=index, what=what)
        if errors:
            self._fail_items(w, chunk, errors, tag == _worker.MID)
            if tag == _worker.MID:
                return
            values = list(values)
            for k, _ in errors:
                values[k] = self.failures.pop(chunk.start + k)
        if tag == _worker.MID:
            chunk.held = True
            w.holding[chunk_id] = chunk
            self.waiting[p].append(chunk)
            if self.ordered:
                self.waiting[p].sort(key=lambda c: c.start)
            return
        del self.live[chunk_id]
        if self.ordered:
            self.segments[chunk.start] = (values, len(chunk.items))
        else:
            self.ready.append((chunk.start, values, len(chunk.items)))

    def _fail_items(
        self, w: _Worker, chunk: _Chunk, errors: list[tuple[int, Any]], middle: bool
    ) -> None:
        """Tolerant runs (one item, one unit in every pool): turn errors into failures."""
        for k, entry in errors:
            index = chunk.start + k
            what = f"while running {self._label(w.pool, index)}"
            try:
                _raise_remote(entry, device=w.device, worker=w.index, index=index, what=what)
            except EasycoreError as exc:
                self.failures[index] = _Failed(exc)
        if middle:
            # The other items of the chunk did not move on: re-run them from the start.
            self.live.pop(chunk.id, None)
            failed = {k for k, _ in errors}
            for k, item in enumerate(chunk.items):
                index = chunk.start + k
                if k in failed:
                    self._deliver_failure(index)
                else:
                    self.redo.append((index, [item]))

    def _deliver_failure(self, index: int) -> None:
        value = [self.failures.pop(index)]
        if self.ordered:
            self.segments[index] = (value, 1)
        else:
            self.ready.append((index, value, 1))

    def _untrack(self, chunk: _Chunk) -> None:
        """Forget a chunk everywhere we track it: live, its queue, its holder."""
        workers = self.r._workers
        self.live.pop(chunk.id, None)
        if chunk.held:  # done in its pool, waiting in worker `slot` for room in the next
            if chunk in self.waiting[chunk.pool]:
                self.waiting[chunk.pool].remove(chunk)
            workers[chunk.slot].holding.pop(chunk.id, None)
            return
        workers[chunk.slot].outstanding.pop(chunk.id, None)  # queued at, or moving to, `slot`
        if chunk.src >= 0:  # moving: its sender holds it until SENT
            workers[chunk.src].holding.pop(chunk.id, None)

    def _forget(self, w: _Worker) -> tuple[list[_Chunk], list[_Chunk]]:
        """Take every chunk a dead worker ran, held or was sending: (ran, all of them)."""
        running = sorted(w.outstanding.values(), key=lambda c: c.start)
        lost = running + list(w.holding.values())
        for chunk in lost:
            self._untrack(chunk)
        return running, lost

    def _on_death(self, w: _Worker) -> None:
        running, lost = self._forget(w)
        code = w.proc.exitcode
        slots = self.r._slots
        unit = self.pools[w.pool].unit
        base = _SLOT * w.slot
        sending = int(slots[base + 2])  # the chunk whose results it was sending, or -1
        culprit: int | None = w.timed_out  # an index in w's pool
        if culprit is None and slots[base + 1] > 0:
            culprit = int(slots[base])
        holder = next(
            (c for c in running if c.start <= (culprit or 0) * unit < c.start + len(c.items)),
            None,
        )
        if holder is None:
            culprit = None
        # Results being pickled or sent when it died are suspects too (a result whose
        # pickling kills the process); with an item running as well, both are charged.
        suspect = next((c for c in lost if c.id == sending), None)
        charged = [culprit] if culprit is not None else []
        if suspect is not None:
            units = {(suspect.start + k) // unit for k in range(len(suspect.items))}
            charged = sorted(units.union(charged))
        if charged:
            pass
        elif slots[base + 1] > 0 or w.timed_out is not None:
            # It was running something we no longer track (a chunk re-run elsewhere after
            # its sender died): nothing of ours is to blame.
            charged = []
        else:
            # Died between items: what it was about to reply for (its oldest chunk) is suspect.
            oldest = min(running, key=lambda c: c.id, default=None)
            charged = (
                sorted({(oldest.start + k) // unit for k in range(len(oldest.items))})
                if oldest is not None
                else []
            )
        exhausted = False
        for index in charged:
            key = (w.pool, index)
            self.attempts[key] = self.attempts.get(key, 0) + 1
            exhausted = exhausted or self.attempts[key] > self.retries
        if not charged:
            self.idle_deaths[w.slot] = self.idle_deaths.get(w.slot, 0) + 1
            exhausted = self.idle_deaths[w.slot] > self.retries
        spared: set[int] = set()  # tolerant: first-pool items failed instead of re-run
        if exhausted:
            item = None
            if holder is not None and culprit is not None and w.pool == 0:
                item = holder.items[culprit - holder.start]
            try:
                held = sum(len(c.items) for c in lost)
                self._raise_death(w, code, culprit, item, held, suspect)
            except EasycoreError as exc:
                if not self.tolerant:
                    raise
                failed = [culprit] if culprit is not None else charged
                for index in failed:
                    self.failures[index] = _Failed(exc)
                    self._deliver_failure(index)
                    spared.add(index)
        # Re-run what it had ahead of new input, the culprit's items alone so it is pinned down.
        requeue: list[tuple[int, Sequence[Any]]] = []
        for chunk in sorted(lost, key=lambda c: c.start):
            start, items = chunk.start, chunk.items
            if spared:
                requeue.extend(
                    (start + k, [item]) for k, item in enumerate(items) if start + k not in spared
                )
            elif chunk is holder and culprit is not None:
                a = (culprit * unit) // self.align * self.align
                b = a + self.align
                parts = [
                    (start, items[: a - start]),
                    (a, items[a - start : b - start]),
                    (b, items[b - start :]),
                ]
                requeue.extend(part for part in parts if len(part[1]))
            else:
                requeue.append((start, items))
        self.redo.extendleft(reversed(requeue))
        self.r._respawn(w.slot)

    def _raise_death(
        self,
        w: _Worker,
        code: int | None,
        culprit: int | None,
        item: Any,
        held: int,
        sending: _Chunk | None = None,
    ) -> NoReturn:
        how = describe_exitcode(code)
        tries = _after(self.retries)
        who = f"worker {w.index}"
        if self.multi:
            who += f" of stage {self.pools[w.pool].name!r}"
        also = ""
        if sending is not None:
            unit = self.pools[w.pool].unit
            first = sending.start // unit
            last = (sending.start + len(sending.items) - 1) // unit
            also = f"the results of {self._label(w.pool, first)} .. {_item_label(last, None)}"
        if culprit is not None:
            label = _item_label(
                culprit, self.batch_size if w.pool == 0 else self.pools[w.pool].batch
            )
            shown = f" (item: {_short_repr(item)})" if w.pool == 0 else ""
            if also:
                shown += f" while sending {also}"
            if w.timed_out is not None:
                msg = (
                    f"{label} ran past timeout={self.timeout}s on {w.device} ({who}); "
                    f"the worker was killed{tries}{shown}"
                )
                raise ItemTimeout(msg, "<timeout>", w.device, w.index, culprit)
            msg = f"{who} on {w.device} died ({how}) while running {label}{tries}{shown}"
            raise WorkerDied(msg, w.device, w.index, code, culprit)
        if sending is not None:
            msg = f"{who} on {w.device} died ({how}) while sending {also}{tries}"
            index = sending.start // self.pools[w.pool].unit
            raise WorkerDied(msg, w.device, w.index, code, index)
        holding = f" holding {held} item(s)" if held else ""
        msg = f"{who} on {w.device} died ({how}){holding}{tries}"
        raise WorkerDied(msg, w.device, w.index, code)

    # -- the loop --------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.live)

    def let_go(self) -> None:
        """Drop the input and results once the run is over (stats() keeps the counters)."""
        self.it = iter(())
        self.range = None
        self.live_src = None
        self.live.clear()
        self.redo.clear()
        self.segments.clear()
        self.ready.clear()
        self.failures.clear()
        for held in self.waiting:
            held.clear()
        for w in list(self.r._workers):  # nothing of this run is tracked past its end
            for book in (w.outstanding, w.holding):
                for chunk_id, chunk in list(book.items()):
                    if chunk.run is self:
                        del book[chunk_id]

    def _settled(self) -> bool:
        """Nothing in flight, to re-run, or to yield."""
        return not (self.live or self.redo or self.segments or self.ready)

    def loop(self) -> Iterator[tuple[int, list[Any]]]:
        try:
            yield from self._loop()
        finally:
            self.finished = time.monotonic()

    def _loop(self) -> Iterator[tuple[int, list[Any]]]:
        while True:
            # Refill before yielding (the workers compute while the caller folds results) and
            # after (yielding frees room): never wait with room to spare and nothing in flight.
            self.dispatch()
            if self.ordered:
                while self.next_out in self.segments:
                    start = self.next_out
                    values, n = self.segments.pop(start)
                    self.taken -= n
                    self.next_out += n
                    yield start, values
            else:
                while self.ready:
                    start, values, n = self.ready.popleft()
                    self.taken -= n
                    yield start, values
            if not self.r._active or self.r._generation != self.generation:
                msg = "the runner was closed while this run had items pending"
                raise RuntimeError(msg)
            self.dispatch()
            src = self.live_src
            if src is not None and (src.aborted or (self._settled() and src.idle())):
                return
            if not self.busy():
                if self.exhausted and not self.redo and not self.segments and not self.ready:
                    return
                if src is not None and not self.exhausted:
                    pass  # idle until the next submit
                elif all(w.ready for w in self.r._workers):
                    # Nothing in flight, every worker idle, yet work remains: waiting would
                    # hang forever, so fail loudly instead (this is a bug in easycore).
                    msg = f"easycore internal error: stalled with {self.taken} item(s) pending"
                    raise EasycoreError(msg)
            if src is None:
                self.r._wait_and_handle(self._wait_time(), self.on_message)
            else:
                self.r._wait_and_handle(self._wait_time(), self.on_message, (src.rx,))
                src.clear()
            self._check_timeouts()

    def _wait_time(self) -> float | None:
        if self.timeout is None:
            return None
        now = time.monotonic()
        slots = self.r._slots
        nearest = self.timeout
        for w in self.r._workers:
            start = slots[_SLOT * w.slot + 1]
            if w.alive and start > 1.0:  # timed items, also of chunks no longer tracked
                nearest = min(nearest, start + self.timeout - now)
        # A worker may start an item without telling us; look again at least every 0.25 s.
        return max(0.0, min(nearest, 0.25))

    def _check_timeouts(self) -> None:
        if self.timeout is None:
            return
        slots = self.r._slots
        now = time.monotonic()
        for w in self.r._workers:
            if not w.alive or w.timed_out is not None:
                continue
            index, start = slots[_SLOT * w.slot], slots[_SLOT * w.slot + 1]
            if start > 1.0 and now - start > self.timeout and slots[_SLOT * w.slot] == index:
                w.timed_out = int(index)
                w.proc.kill()

    def drain(self) -> None:
        """Wait for the chunks in flight and drop their results (caller stopped early)."""
        self.exhausted = True
        self.redo.clear()
        for held in self.waiting:
            for chunk in list(held):
                self._untrack(chunk)
                with contextlib.suppress(OSError):
                    self.r._workers[chunk.slot].chan.send_control(("drop", chunk.id))
        while self.busy():
            self.r._wait_and_handle(self._wait_time(), self._discard)
            self._check_timeouts()

    def _discard(self, w: _Worker, msg: Any) -> None:
        if msg is None:
            self._forget(w)
            self.r._respawn(w.slot)
            return
        tag = msg[0]
        if tag == _worker.SENT:
            w.holding.pop(msg[1], None)
            return
        if tag == _worker.UNREADABLE:
            if not w.outstanding:
                return
            chunk_id = min(w.outstanding)
        else:
            chunk_id = msg[1]
        chunk = self.live.get(chunk_id) or w.outstanding.get(chunk_id)
        if chunk is not None:  # (for BAD_OUTPUT, w is its sender, not where it is queued)
            self._untrack(chunk)
        if tag == _worker.MID:
            with contextlib.suppress(OSError):
                w.chan.send_control(("drop", chunk_id))


class _Claimed:
    """A run's stream that holds the runner from its creation until it ends, is closed, or
    is dropped (a generator closed before its first ``next`` never runs its ``finally``)."""

    def __init__(self, runner: Runner, token: object, stream: Iterator[Any]) -> None:
        self._runner: Runner | None = runner
        self._token = token
        self._stream = stream

    def __iter__(self) -> _Claimed:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._stream)
        except BaseException:
            self._release()
            raise

    def close(self) -> None:
        try:
            close = getattr(self._stream, "close", None)
            if close is not None:
                close()  # an early stop drains what is in flight
        finally:
            self._release()

    def _release(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            runner._release(self._token)

    def __del__(self) -> None:
        if self._runner is not None:
            with contextlib.suppress(Exception):
                self.close()


class _Failed:
    """An item's error in a tolerant run (``submit``): delivered in place of its result."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _LiveSource:
    """Items submitted one at a time: the run takes what is there and never blocks on it."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.items: deque[Any] = deque()
        self.lock = server.r._submit_lock
        self.closed = False  # no more items: finish what is queued, then end
        self.aborted = False  # end now (the runner is being torn down)
        self.rx, self.tx = socket.socketpair()  # a byte on tx wakes the run loop
        self.rx.setblocking(False)
        self.tx.setblocking(False)

    def __iter__(self) -> Iterator[Any]:  # taken from by `_Run._take`, never iterated
        return iter(())

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            self.tx.send(b"\0")

    def clear(self) -> None:
        with contextlib.suppress(OSError):
            while self.rx.recv(4096):
                pass

    def idle(self) -> bool:
        """Nothing queued: end the run (a later submit starts a new one) and free the runner."""
        with self.lock:
            if self.items:
                return False
            self.end()
            return True

    def end(self) -> None:
        """Close, unregister the server and free the runner, at once (under the lock)."""
        with self.lock:
            self.closed = True
            runner = self.server.r
            if runner._server is self.server:
                runner._server = None
            if runner._busy is self.server:
                runner._busy = None

    def close(self) -> None:
        self.rx.close()
        self.tx.close()


class _Server:
    """The thread behind :meth:`Runner.submit`: one tolerant, unordered run fed live."""

    def __init__(self, runner: Runner, item: Any, future: concurrent.futures.Future[Any]) -> None:
        # Made under the runner's lock, with the runner free: it takes it (runner._busy).
        self.r = runner
        self.src = _LiveSource(self)
        self.lock = runner._submit_lock
        self.futures: dict[int, concurrent.futures.Future[Any]] = {0: future}
        self.count = 1
        self.src.items.append(item)  # before the thread starts: it ends when nothing is queued
        runner._busy = self
        self.finished = threading.Event()  # set as the thread's very last step
        self.thread = threading.Thread(target=self._serve, name="easycore-submit", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return not self.finished.is_set() and not self.src.closed

    def is_current(self) -> bool:
        return threading.current_thread() is self.thread

    def put(self, item: Any, future: concurrent.futures.Future[Any]) -> bool:
        """Queue an item; False when this run has ended (start another)."""
        with self.lock:
            if self.src.closed:
                return False
            self.futures[self.count] = future
            self.count += 1
            self.src.items.append(item)
        self.src.wake()
        return True

    def _serve(self) -> None:
        error: BaseException = RuntimeError("the runner closed before this item ran")
        try:
            stream = self.r._stream(self.src, False, None, None, 0, None, None, tolerant=True)
            for start, values in stream:
                for k, value in enumerate(values):
                    with self.lock:
                        future = self.futures.pop(start + k, None)
                    if future is None or future.done():
                        continue
                    if isinstance(value, _Failed):
                        future.set_exception(value.exc)
                    else:
                        future.set_result(value)
        except BaseException as exc:
            error = exc
        finally:
            self.src.end()
            with self.lock:
                pending = list(self.futures.values())
                self.futures.clear()
            for future in pending:  # their callbacks may submit again: the runner is free
                if not future.done():
                    future.set_exception(error)
            self.src.close()
            self.finished.set()

    def stop(self, abort: bool, timeout: float | None = None) -> None:
        with self.lock:
            self.src.closed = True
            self.src.aborted = self.src.aborted or abort
        self.src.wake()
        if not self.is_current():
            # Not Thread.join: a Ctrl-C that interrupts it can leave the thread marked as
            # stopped while it still runs (CPython 3.11), and we would stop waiting for it.
            self.finished.wait(timeout)
