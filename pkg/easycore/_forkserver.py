"""What a forkserver of easycore does for itself (imported by both preload modules).

multiprocessing makes each forkserver's listening socket in the caller's temporary
directory (``/tmp/pymp-*``) and removes both when the caller exits. A caller killed with
SIGKILL removes nothing; its forkservers see it gone (their ``alive`` pipe closes) and exit
normally, so they remove their own socket, and the directory once it is empty.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import stat

__all__ = ["remove_listener_at_exit"]


def _listeners() -> list[str]:
    """The paths of this process's Unix sockets that live in a multiprocessing temp dir."""
    paths = []
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # pragma: no cover - not Linux
        return []
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            try:
                addr = sock.getsockname() if sock.family == socket.AF_UNIX else None
            except OSError:
                continue
        if isinstance(addr, str) and os.path.basename(os.path.dirname(addr)).startswith("pymp-"):
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
