"""Starting worker processes, and the process-global state that goes with it.

The local engine's global state is all here (the Ray engine's, whether this process
started Ray and how many runners use it, is in ``ray.engine``):

* ``_LIGHT_SERVER``: a second forkserver without torch, for callers that never import it;
* ``_TORCH_SEEN``: a worker of this process has loaded torch, so later pools fork with it;
* ``_START_LOCK``: guards the two module attributes of multiprocessing we swap while a
  process starts (see :func:`_hidden_main`);
* ``_OWN``: this process's live workers started by ``spawn`` or ``fork`` (its children: it
  is the subreaper of what they start while it has any; see :func:`start_worker`).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.spawn
import os
import resource
import signal
import stat
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from easycore._reaping import (
    become_subreaper,
    children,
    descendants,
    end_processes,
    left_by,
    remove_mp_tempdir,
    start_time,
    ticks_now,
)

__all__ = [
    "check_capacity",
    "context",
    "descriptors",
    "fork_is_safe",
    "kill_all",
    "kill_workers",
    "light_forkserver_pid",
    "light_wanted",
    "note_torch",
    "start_worker",
]

_START_LOCK = threading.Lock()
_LIGHT_SERVER: Any = None  # the forkserver without torch (see light_wanted)
_TORCH_SEEN = False  # a worker of this process has loaded torch: later pools fork with it
# spawned or forked workers alive: pid -> (start time, this process's children before it)
_OWN: dict[int, tuple[int, frozenset[int]]] = {}
_OWN_LOCK = threading.RLock()  # (a start holds it: a finalizer run by gc there ends workers)


def _after_fork_in_child() -> None:
    """A fork (easycore's or anyone's) copied only the thread that made it: the locks held
    around a start are free in the child, and the parent's workers are not the child's."""
    global _START_LOCK, _OWN_LOCK
    _START_LOCK, _OWN_LOCK = threading.Lock(), threading.RLock()
    _OWN.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


# Descriptors the caller keeps per worker: its end of the pipe, the process sentinel, and one
# spare for a socket pair to a worker of another pool or a start-up in flight.
FDS_PER_WORKER = 3


def check_capacity(n_workers: int) -> None:
    """Refuse, before any process starts, a worker count this process cannot start.

    Counts far above the cores are fine (I/O-bound work); what is refused is what the
    open-file limit (``ulimit -n``) or the process limit (``ulimit -u``) cannot hold.

    Raises:
        ValueError: naming the limit and what it allows.
    """
    files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if files != resource.RLIM_INFINITY:
        in_use = len(descriptors()) + 3  # (and the standard streams)
        room = max(0, files - in_use) // FDS_PER_WORKER
        if n_workers > room:
            msg = (
                f"{n_workers} workers need about {FDS_PER_WORKER * n_workers} open files, "
                f"but this process may open {files} (ulimit -n) and has {in_use} open: at "
                f"most {room} workers fit; ask for fewer, or raise the limit"
            )
            raise ValueError(msg)
    procs, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if procs != resource.RLIM_INFINITY and n_workers >= procs:
        msg = (
            f"{n_workers} workers are more processes than this user may run "
            f"({procs}, ulimit -u); ask for fewer, or raise the limit"
        )
        raise ValueError(msg)


def fork_is_safe(own: Mapping[int, tuple[int, int, int]] = {}) -> bool:
    """Whether a worker may fork from this process itself: the cheapest start (no new
    interpreter, nothing imported again), chosen when nobody asked for a start method.

    A fork copies only the thread that calls it, and shares every open file: a lock another
    thread held stays locked in the child for good (an OpenMP pool that ran a parallel op
    hangs the child's next one; a lock of logging or of the allocator; a CUDA context), and
    a file opened by the caller (a dataset module's, at import) has one offset for the
    caller and every worker, a pipe or a socket stays open after the caller closes it. So a
    fork is taken only on Linux, with CUDA not initialised, when this process runs no other
    thread once the idle pool of each OpenBLAS library loaded here is stopped (as its own
    fork handler stops it; it starts again at its next call), and holds no descriptor but
    its standard streams, character devices (``/dev/null``), shared memory and ``own``
    (easycore's workers' pipes, by number -> identity, see :func:`descriptors`): any other
    (a log file, an event loop, a forkserver's) means the forkserver.
    """
    if not sys.platform.startswith("linux") or threading.active_count() != 1:
        return False
    torch = sys.modules.get("torch")
    with contextlib.suppress(Exception):  # (a torch without CUDA support answers False)
        if torch is not None and torch.cuda.is_initialized():
            return False
    try:
        if len(os.listdir("/proc/self/task")) > 1:
            _pause_openblas()
            if len(os.listdir("/proc/self/task")) > 1:
                return False
    except OSError:  # pragma: no cover - no /proc
        return False
    for fd, ident in descriptors().items():
        if stat.S_ISCHR(ident[2]) or own.get(fd) == ident:
            continue
        with contextlib.suppress(OSError):  # (the listing's own descriptor, closed since)
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/shm/"):
                return False
    return True


def descriptors() -> dict[int, tuple[int, int, int]]:
    """This process's open descriptors past the standard streams: number -> (device, inode,
    mode), which tells a descriptor from a later one given the same number."""
    out = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if int(name) > 2:
                    st = os.fstat(int(name))
                    out[int(name)] = (st.st_dev, st.st_ino, st.st_mode)
    return out


def _pause_openblas() -> None:
    """Stop the idle thread pool of every OpenBLAS library loaded here, as OpenBLAS does
    itself before a fork (its next call starts the pool again): by its
    ``blas_thread_shutdown_``, or, where a build does not export it (numpy's since 2.3), by
    a fork that exits at once, which runs OpenBLAS's own fork handler."""
    import ctypes

    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "openblas" in line and ".so" in line}
    hidden = False
    for path in paths:
        try:
            ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).blas_thread_shutdown_()
        except (OSError, AttributeError):
            hidden = True
    if hidden:
        with warnings.catch_warnings():  # (3.12+ warns of a fork with threads: OpenBLAS's)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)


def light_wanted(method: str, devices: Sequence[str]) -> bool:
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
    cuda = any(d.startswith("cuda") for d in devices)
    return not cuda and hasattr(multiprocessing.forkserver, "connect_to_new_process")


def light_forkserver_pid() -> int | None:
    """The light forkserver's pid while it runs (a long-lived helper, not a worker)."""
    return getattr(_LIGHT_SERVER, "_forkserver_pid", None) or None


def note_torch(loaded: bool) -> None:
    """A worker reported whether it has torch loaded; once one has, later pools fork with it."""
    global _TORCH_SEEN
    _TORCH_SEEN = _TORCH_SEEN or loaded


def context(
    start_method: str | None,
    forkable: bool = False,
    own: Mapping[int, tuple[int, int, int]] = {},
) -> Any:
    """The multiprocessing context for ``start_method``; by default ``fork`` where
    ``forkable`` (one pool of CPU workers) and :func:`fork_is_safe` (given ``own``), else
    the forkserver.

    Raises:
        ValueError: the method does not exist here, or ``fork`` after CUDA was initialised.
    """
    methods = mp.get_all_start_methods()
    method = start_method or ("forkserver" if "forkserver" in methods else "spawn")
    if start_method is None and forkable and "fork" in methods and fork_is_safe(own):
        method = "fork"
    if method not in methods:
        msg = f"start_method {method!r} is not available here; choose from {methods}"
        raise ValueError(msg)
    if method == "fork" and "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        msg = (
            "start_method='fork' after CUDA was initialised in this process is unsafe; "
            "use 'forkserver' or 'spawn'"
        )
        raise ValueError(msg)
    ctx = mp.get_context(method)
    if method == "forkserver":
        # The forkserver imports torch once, before it has any thread or CUDA context; every
        # worker forks from it with torch already loaded. No '__main__': see _hidden_main.
        ctx.set_forkserver_preload(["easycore._exec.process.preload"])
    return ctx


@contextlib.contextmanager
def _hidden_main(method: str, devices: Sequence[str]) -> Iterator[None]:
    """Start processes without the caller's ``__main__`` (and from the light forkserver
    where :func:`light_wanted`).

    multiprocessing re-imports the caller's ``__main__`` in spawned/forkserver children, which
    re-runs an unguarded script's top level (and fails in notebooks). Everything a worker
    needs travels by cloudpickle, so we leave ``__main__`` out of the children's preparation.
    The originals are read under the lock: read before it, they could be another start's
    replacements, and "restoring" them would leave those in place for good.
    """
    global _LIGHT_SERVER
    if method == "fork":  # (a fork prepares nothing: the caller's state is there)
        yield
        return
    light = light_wanted(method, devices)
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
        if light and _LIGHT_SERVER is None:
            _LIGHT_SERVER = multiprocessing.forkserver.ForkServer()
            _LIGHT_SERVER.set_forkserver_preload(["easycore._exec.process.preload_light"])
        if light:
            forkserver.connect_to_new_process = _LIGHT_SERVER.connect_to_new_process
        try:
            yield
        finally:
            multiprocessing.spawn.get_preparation_data = original
            if light:
                forkserver.connect_to_new_process = connect


def kill_workers(procs: Sequence[Any]) -> None:
    """Kill worker processes and every process below them, also those that left the
    worker's group (a session of their own, a daemon the worker adopted).

    They are found before the workers die: afterwards they are the orphans of whoever
    adopts them (a forkserver ends those it adopts; a spawned worker's go to init).
    """
    live = []
    for p in procs:
        with contextlib.suppress(Exception):
            if p.is_alive():
                live.append(p)
    if not live:
        return
    below = descendants(p.pid for p in live)
    for p in live:
        with contextlib.suppress(Exception):
            p.kill()
    for pid in below:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def kill_all(procs: Sequence[Any]) -> None:
    """Kill and reap processes and what they started (:func:`kill_workers`), then their
    process groups (a worker leads one), and remove the temporary directory each one's
    multiprocessing used (a killed worker cannot). A worker of :func:`start_worker` that did
    not end well left what it started here, those that left its group too: they are ended
    (and reaped)."""
    kill_workers(procs)
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(1.0)
        pid, code = p.pid, p.exitcode
        if not pid:
            continue
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        with _OWN_LOCK:
            own = _OWN.pop(pid, None)
            if own is not None and code != 0:
                since, before = own
                keep = [child.pid for child in mp.active_children()]
                end_processes(left_by(since, keep=[*keep, *before, *_OWN]))
            if own is not None and not _OWN:
                become_subreaper(on=False)
        if code != 0:  # (one that ended well removed its own: no scan of the temp folder)
            remove_mp_tempdir(pid)


def start_worker(proc: Any, method: str, devices: Sequence[str]) -> None:
    """Start a worker process by ``method`` (from the light forkserver where
    :func:`light_wanted`).

    A worker started by ``spawn`` or ``fork`` is a child of this process, which is then made
    the subreaper of what the worker starts (a forkserver is its workers'). A worker that dies
    leaves it here: processes that left the worker's group (``setsid``, a daemon) included,
    found and ended by :func:`kill_all`.
    """
    # Ctrl-C between a fork and the worker's ignoring it would print the worker's own
    # KeyboardInterrupt: a forked worker starts with SIGINT blocked (the caller's stays
    # pending until the start is done)
    block = {signal.SIGINT} if method == "fork" else set()
    with _hidden_main(method, devices), _OWN_LOCK:
        # (subreaper before the start: the worker may die at once)
        adopting = method != "forkserver" and become_subreaper()
        before = frozenset(children(os.getpid())) if adopting else frozenset()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, block)
        try:
            since = ticks_now() if adopting else None  # (the worker starts at it or later)
            proc.start()
            if since is None and adopting:
                since = start_time(proc.pid)  # (the clock's ticks are coarse: and `before`)
            if adopting and since is not None:
                _OWN[proc.pid] = (since, before)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            if adopting and not _OWN:
                become_subreaper(on=False)
