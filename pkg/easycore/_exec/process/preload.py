"""Imported once by the forkserver, before it forks any worker.

Everything a worker needs at start-up is imported and warmed up here, once, so each forked
worker finds it ready (copy-on-write) instead of paying for it again. Nothing here may start
a thread or touch CUDA: the forkserver must stay safe to fork.
"""

from __future__ import annotations

import contextlib
import gc

# What unpickling a worker's Process object needs (its slots are a RawArray on an mp heap
# arena, whose descriptor travels as a popen_forkserver._DupFd): imported once here rather
# than in every worker.
import multiprocessing.heap
import multiprocessing.popen_forkserver
import multiprocessing.sharedctypes  # noqa: F401

import torch  # noqa: F401 - the point of the forkserver

with contextlib.suppress(ImportError):  # (numpy 2 imports it on first use: here, once)
    import numpy.random  # noqa: F401

import easycore._exec.process.worker_loop  # noqa: F401 - the worker's loop and what it imports
from easycore._exec.process.forkserver import end_what_it_adopts, remove_listener_at_exit
from easycore._seeding import seed_loaded

remove_listener_at_exit()  # a caller killed with SIGKILL cannot remove it
end_what_it_adopts()  # what a killed or dead worker started ends here
seed_loaded(0)  # first calls import and set up the generators

# Everything imported so far lives as long as the forkserver: keep the garbage collector off
# it, so that a collection in a forked worker does not touch (and copy-on-write) every page.
gc.freeze()
