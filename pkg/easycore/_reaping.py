"""Finding and ending the processes a worker started, wherever they went (Linux).

A worker leads a process group, and killing the group ends what it started, except what
left the group: a program started in a session of its own (``setsid``,
``start_new_session=True``) or a daemon (forked twice, its parent gone). Such a process is
found through its parents instead:

* a worker is a *child subreaper* (:func:`become_subreaper`): a process of its tree whose
  parent dies is re-parented to the worker rather than to init, so every process the work
  started is the worker's descendant while the worker lives, and it ends them all before it
  exits (:func:`end_children`);
* a worker that is killed, or dies on its own, cannot: its children go to the nearest
  subreaper above it, its forkserver, which ends what it adopts
  (``easycore._exec.process.forkserver``);
  a caller that kills a worker first collects the worker's descendants
  (:func:`descendants`) and ends them too;
* a worker started by ``spawn`` or ``fork`` has the caller for its parent: the caller is then
  the subreaper while it has such workers, and ends what a dead one left it
  (:func:`left_by`, :func:`end_processes`).

Elsewhere than Linux these do nothing: the process group is all there is.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable

__all__ = [
    "become_subreaper",
    "children",
    "descendants",
    "end_children",
    "end_processes",
    "left_by",
    "name_mp_tempdir",
    "remove_mp_tempdir",
    "remove_own_mp_tempdir",
    "start_time",
    "ticks_now",
]

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper(on: bool = True) -> bool:
    """Make this process the subreaper of its descendants (``prctl``), or no longer
    (``on=False``); True if that worked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(_libc().prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0)
    except (OSError, AttributeError):  # pragma: no cover - no prctl
        return False


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, opened once (twice per worker start otherwise: ~0.1 ms each)."""
    return ctypes.CDLL(None, use_errno=True)


def _stat(pid: int | str) -> tuple[int, int, int] | None:
    """A process's parent, process group and start time (clock ticks after boot), read from
    /proc; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp session ... starttime(22nd) ...": comm may hold spaces
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[1]), int(fields[2]), int(fields[19])
    except (IndexError, ValueError):  # pragma: no cover - not Linux's format
        return None


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (None: gone, or no /proc)."""
    stat = _stat(pid)
    return None if stat is None else stat[2]


def ticks_now() -> int | None:
    """Now, in the clock ticks after boot of :func:`start_time` (the kernel counts a start
    on the boot-time clock, truncated to ticks): a process started after this call has a
    start time no less. None where there is no such clock."""
    try:
        hz = os.sysconf("SC_CLK_TCK")
        return time.clock_gettime_ns(time.CLOCK_BOOTTIME) * hz // 1_000_000_000
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not Linux
        return None


def _table() -> dict[int, tuple[int, int, int]]:
    """Every process's :func:`_stat` (parent, group, start time), read from /proc."""
    try:
        names = os.listdir("/proc")
    except OSError:  # pragma: no cover - no /proc
        return {}
    # (a process gone meanwhile has no stat)
    return {int(n): stat for n in names if n.isdigit() and (stat := _stat(n)) is not None}


def _listed(pid: int) -> list[int] | None:
    """The children of ``pid`` as the kernel lists them per thread
    (``/proc/<pid>/task/<tid>/children``, zombies included): a few reads, where a scan of
    /proc reads every process's stat (a millisecond per hundred processes, paid at every
    worker's start). None: the kernel has no such list, or ``pid`` is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        found: list[int] = []
        for tid in tasks:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found += map(int, f.read().split())
    except (OSError, ValueError):  # (no CONFIG_PROC_CHILDREN, a thread gone meanwhile)
        return None
    return found


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` now (zombies included)."""
    listed = _listed(pid)
    if listed is not None:
        return listed
    return [p for p, stat in _table().items() if stat[0] == pid]


def descendants(roots: Iterable[int]) -> list[int]:
    """Every process below ``roots`` now: children, theirs, and so on (roots excluded)."""
    scanned: dict[int, list[int]] | None = None

    def below(pid: int) -> list[int]:  # (the kernel's list; else one reading of /proc)
        nonlocal scanned
        listed = _listed(pid)
        if listed is not None:
            return listed
        if scanned is None:
            scanned = {}
            for p, stat in _table().items():
                scanned.setdefault(stat[0], []).append(p)
        return scanned.get(pid, [])

    out: list[int] = []
    todo = list(roots)
    seen = set(todo)
    while todo:
        for p in below(todo.pop()):
            if p not in seen:
                seen.add(p)
                out.append(p)
                todo.append(p)
    return out


def _has_any_child() -> bool:
    """Whether this process has a child, live or not yet reaped (a subreaper's descendants
    all hang below its children), asked without reaping it."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (AttributeError, OSError) as exc:  # (but no waitid at all: look)
        return not isinstance(exc, ChildProcessError)
    return True


def end_children(within: float = 1.0) -> None:
    """Kill every child of this process and reap it, until none is left (``within`` s at
    most, for one that does not die: a process stuck in the kernel).

    In a subreaper, the children of a killed child come to it before that child is reaped,
    so this ends the whole tree below it. Call it only on the way out: it reaps every child,
    so a ``Popen`` of this process could not learn its child's exit status afterwards.
    """
    if not _has_any_child():
        return  # (the common case: no /proc scan on every worker's way out)
    deadline = time.monotonic() + within
    while (left := children(os.getpid())) and time.monotonic() < deadline:
        end_processes(left, deadline - time.monotonic())


def left_by(since: int, keep: Iterable[int] = ()) -> list[int]:
    """(in a subreaper) What a child of this process that started at ``since`` (clock ticks,
    :func:`start_time`) and has died left here: the children this process adopted, and
    every process below them.

    Adopted children are told from this process's own by what the kernel shows: they
    started after that child did, and stand outside this process's group (they were in the
    dead child's group, or left it). ``keep``: children of this process's own that may look
    alike (those it had before that child, its live workers, what it started through
    multiprocessing).
    """
    me, group, keep = os.getpid(), os.getpgrp(), set(keep)
    found = [
        pid
        for pid, (parent, pgrp, start) in _table().items()
        if parent == me and pgrp != group and start >= since and pid not in keep
    ]
    return found + descendants(found)


def end_processes(pids: Iterable[int], within: float = 1.0) -> None:
    """Kill ``pids``, and reap each one that is, or becomes, a child of this process (a
    subreaper adopts the children of those it kills), ``within`` s at most."""
    left = set(pids)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + within
    while left:
        for pid in list(left):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    left.discard(pid)
                continue
            except ChildProcessError:
                pass
            stat = _stat(pid)
            if stat is None or stat[0] not in left:  # gone, or its parent's to reap
                left.discard(pid)
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.002)


def _mp_tempdir_prefix(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"pymp-easycore-{pid}-")


def name_mp_tempdir() -> None:
    """(in a worker) Have multiprocessing name the temporary directory it makes for this
    process, if the work makes it need one, after the process's pid: a forkserver or a
    manager the work starts keeps its socket there, and ``os._exit`` or a kill skip the
    finaliser that removes it, so whoever buries the worker removes it by name
    (:func:`remove_mp_tempdir`). Nothing is made until multiprocessing asks."""
    import multiprocessing
    import multiprocessing.util as util

    config = getattr(multiprocessing.current_process(), "_config", None)
    original = getattr(util, "get_temp_dir", None)
    if not isinstance(config, dict) or original is None:  # pragma: no cover - moved
        return
    prefix = os.path.basename(_mp_tempdir_prefix(os.getpid()))

    def get_temp_dir() -> str:
        if config.get("tempdir") is None:
            config["tempdir"] = tempfile.mkdtemp(prefix=prefix)
        return str(original())

    util.get_temp_dir = get_temp_dir


def remove_own_mp_tempdir() -> None:
    """(in a worker, on its way out) Remove the directory multiprocessing made for it (one
    it inherited, the caller's, holds the caller's forkserver socket: that one stays)."""
    import multiprocessing

    config = getattr(multiprocessing.current_process(), "_config", None)
    path = config.get("tempdir") if isinstance(config, dict) else None
    if isinstance(path, str) and path.startswith(_mp_tempdir_prefix(os.getpid())):
        shutil.rmtree(path, ignore_errors=True)


def remove_mp_tempdir(pid: int) -> None:
    """Remove the directory multiprocessing made in process ``pid``, now gone
    (:func:`name_mp_tempdir`)."""
    for path in glob.glob(glob.escape(_mp_tempdir_prefix(pid)) + "*"):
        shutil.rmtree(path, ignore_errors=True)
