"""Imported once by the forkserver, before it forks any worker.

Everything a worker needs at start-up is imported and warmed up here, once, so each forked
worker finds it ready (copy-on-write) instead of paying for it again: torch, then what the
light forkserver preloads too (``easycore._exec.process.preload_light``). Nothing here may
start a thread or touch CUDA: the forkserver must stay safe to fork.
"""

from __future__ import annotations

import contextlib

import torch  # noqa: F401 - the point of the forkserver

with contextlib.suppress(ImportError):  # (numpy 2 imports it on first use: here, once)
    import numpy.random  # noqa: F401

# the worker's loop, the forkserver's own cleanup, seeded generators, then gc.freeze()
import easycore._exec.process.preload_light  # noqa: F401
