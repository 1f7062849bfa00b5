"""Imported once by the light forkserver: the one for callers that never imported torch
(and by the forkserver's own preload, after torch).

Workers forked from it carry no torch (see ``easycore._exec.process.startup.light_wanted``): they
start and exit several times faster, and import torch only if their work does. numpy is loaded when
installed (small, and most array work needs it). Nothing here may start a thread.
"""

from __future__ import annotations

import contextlib
import gc

with contextlib.suppress(ImportError):
    import numpy  # noqa: F401

# What unpickling a worker's Process object needs (its slots are a RawArray on an mp heap
# arena, which sharedctypes imports, whose descriptor travels as a popen_forkserver._DupFd):
# imported once here rather than in every worker.
import multiprocessing.popen_forkserver
import multiprocessing.sharedctypes  # noqa: F401

import easycore._exec.process.worker_loop  # noqa: F401 - the worker's loop and what it imports
from easycore._exec.process.forkserver import end_what_it_adopts, remove_listener_at_exit
from easycore._seeding import seed_loaded

remove_listener_at_exit()  # a caller killed with SIGKILL cannot remove it
end_what_it_adopts()  # what a killed or dead worker started ends here
seed_loaded(0)  # first calls import and set up the generators

# Everything imported so far lives as long as the forkserver: keep the garbage collector off
# it, so that a collection in a forked worker does not touch (and copy-on-write) every page.
gc.freeze()
