"""What a forkserver of easycore does for itself (imported by both preload modules).

* multiprocessing makes each forkserver's listening socket in the caller's temporary
  directory (``/tmp/pymp-*``) and removes both when the caller exits. A caller killed with
  SIGKILL removes nothing; its forkservers see it gone (their ``alive`` pipe closes) and
  exit normally, so they remove their own socket, and the directory once it is empty.
* A worker that is killed or dies leaves what it started (those processes that left its
  process group: a session of their own, a daemon) to the nearest subreaper above it: the
  forkserver, which ends what it adopts (see ``easycore._reaping``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import stat
import warnings
from typing import Any

from easycore._exec.process.startup import descriptors
from easycore._reaping import become_subreaper, children

__all__ = ["end_what_it_adopts", "remove_listener_at_exit"]


def _listeners() -> list[str]:
    """The paths of this process's Unix sockets that live in a multiprocessing temp dir."""
    paths = []
    for fd, (_, _, mode) in descriptors().items():
        if not stat.S_ISSOCK(mode):
            continue
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as sock:
            addr = sock.getsockname() if sock.family == socket.AF_UNIX else None
            folder = os.path.dirname(addr) if isinstance(addr, str) else ""
            if os.path.basename(folder).startswith("pymp-"):
                paths.append(addr)
    return paths


def remove_listener_at_exit() -> None:
    """When this forkserver exits, remove its listening socket, and its directory if that
    is then empty (the caller may still use it: then it stays, and the caller removes it)."""
    me, paths = os.getpid(), _listeners()

    def tidy() -> None:
        if os.getpid() != me:  # pragma: no cover - forked children leave by os._exit
            return
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(path))

    atexit.register(tidy)


def end_what_it_adopts() -> None:
    """Make this forkserver the subreaper of its workers' processes, and kill those it adopts.

    A worker ends what it started when it exits; one that is killed, or dies, cannot: its
    children are re-parented here. multiprocessing's loop reaps a child of ours after each
    SIGCHLD (``os.waitpid(-1, WNOHANG)``), and it offers no hook: so ``os.fork`` and
    ``os.waitpid`` are wrapped in this process (workers get the plain ones back). Whenever a
    child of ours has ended, every child we did not fork is one we adopted, and is killed;
    its own children come here in turn, and go the same way. (The forkserver is easycore's:
    a user's own ``forkserver`` processes started from it are treated alike.)
    """
    if not become_subreaper():
        return
    adopter = _Adopter()
    os.fork = adopter.fork
    os.waitpid = adopter.waitpid
    # multiprocessing's loop warns of each reaped pid it did not fork: those are ours
    warnings.filterwarnings("ignore", "forkserver: waitpid returned unexpected pid")


class _Adopter:
    """A forkserver's ``os.fork`` and ``os.waitpid``: the first knows its workers, the second
    kills the other children (adopted) each time a child has ended."""

    def __init__(self) -> None:
        self.plain_fork, self.plain_waitpid = os.fork, os.waitpid
        self.forked: set[int] = set()  # workers, until reaped
        self.knows = False  # a fork went through us (else it knows none of our children)

    def fork(self) -> int:
        pid = self.plain_fork()
        if pid == 0:  # in the worker: the plain calls
            os.fork, os.waitpid = self.plain_fork, self.plain_waitpid
        else:
            self.forked.add(pid)
            self.knows = True
        return pid

    def waitpid(self, pid: int, options: int) -> Any:
        got = self.plain_waitpid(pid, options)
        if got[0] and self.knows:  # a child ended: its orphans may have come to us
            self.forked.discard(got[0])
            if os.WIFEXITED(got[1]) and os.WEXITSTATUS(got[1]) == 0:
                return got  # a worker that ended well ended what it started itself
            for orphan in children(os.getpid()):
                if orphan not in self.forked:
                    with contextlib.suppress(OSError):
                        os.kill(orphan, signal.SIGKILL)
        return got
