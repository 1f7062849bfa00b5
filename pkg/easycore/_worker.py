"""The loop that runs inside a worker process (see ``_executor`` for the whole picture).

A worker owns one end of a duplex pipe to the caller. Two threads share it:

* the *reader* thread only receives: it moves raw task messages into a local queue, sets the
  stop flag on ``STOP``, and ends the process at once when the pipe reaches EOF (the caller
  is gone, so nobody is left to report to: no orphans);
* the *main* thread binds the device, limits torch's threads, runs ``init``, then takes task
  chunks from the local queue, runs the fused producers item by item and sends one reply per
  chunk; on ``STOP`` it runs ``end`` and says goodbye.

Because the reader always drains the pipe, the caller's ``send`` never waits on our compute,
and our ``send`` of a large result never deadlocks against the caller sending us work.

Before each item the main thread writes the item's index and start time into a slot of a
shared array, so the caller knows which item a dead or timed-out worker held without any
per-item message.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import queue
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle

from easycore._errors import RemoteTraceback
from easycore._transport import Channel

STOP = b"\x00easycore-stop"
_PROTOCOL = pickle.HIGHEST_PROTOCOL

# Message tags, worker -> caller.
READY = "ready"
INIT_ERROR = "init_error"
DONE = "done"
ENDED = "ended"
END_ERROR = "end_error"
UNREADABLE = "unreadable"


def pack_exception(exc: BaseException) -> tuple[bytes | None, str, str]:
    """Return (pickled exception or None, type name, str) for sending to the caller."""
    try:
        blob: bytes | None = cloudpickle.dumps(exc, _PROTOCOL)
    except Exception:
        blob = None
    return blob, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc)


def unpack_exception(blob: bytes | None, tname: str, text: str, tb: str) -> BaseException:
    """The inverse of :func:`pack_exception`, in the caller.

    The original exception when it unpickles, else a ``RuntimeError`` naming its type; its
    ``__cause__`` carries the remote traceback unless it already has a cause.
    """
    original: Any = None
    if blob is not None:
        try:
            original = pickle.loads(blob)
        except Exception:
            original = None
    if not isinstance(original, BaseException):
        original = RuntimeError(f"{tname}: {text} (the original exception did not unpickle)")
    if original.__cause__ is None:
        original.__cause__ = RemoteTraceback(tb)
    exc: BaseException = original
    return exc


def derive_seed(seed: int, index: int) -> int:
    """A 63-bit seed for item ``index`` of a run seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_everything(value: int) -> None:
    """Seed ``random``, numpy (when imported) and torch's CPU and CUDA generators."""
    random.seed(value)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(value % (2**32))
    torch = sys.modules.get("torch")
    if torch is not None:
        # Not torch.manual_seed: while CUDA is not initialised it records a formatted stack
        # for a lazy CUDA call, tens of milliseconds in a fresh worker, on every call.
        torch.default_generator.manual_seed(value)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(value)


def _setup_torch(device: str, n_threads: int | None) -> None:
    import torch

    if n_threads is not None:
        torch.set_num_threads(n_threads)
    if device.startswith("cuda"):
        # Bind before anything can touch CUDA, so the context lands on our device.
        torch.cuda.set_device(torch.device(device))


def _reader(chan: Channel, tasks: queue.SimpleQueue[Any], stop: threading.Event) -> None:
    try:
        while True:
            frame, fds = chan.recv_frame()
            if frame == STOP:
                stop.set()
                tasks.put(None)
                return
            tasks.put((frame, fds))
    except (EOFError, OSError):
        # The caller died or closed our pipe without STOP: exit now, do not linger as an orphan.
        os._exit(0)


def _send(chan: Channel, obj: Any) -> None:
    try:
        chan.send(obj)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        os._exit(0)


class _Stage:
    """A producer stage prepared in this worker: function plus its injected kwargs."""

    __slots__ = ("end", "end_names", "fn", "kwargs", "name", "state")

    def __init__(self, fn: Callable[..., Any], name: str, kwargs: dict[str, Any]) -> None:
        self.fn = fn
        self.name = name
        self.kwargs = kwargs
        self.state: Any = None
        self.end: Callable[..., Any] | None = None
        self.end_names: tuple[str, ...] = ()


def error_entry(stage: str, exc: BaseException) -> tuple[str, bytes | None, str, str, str]:
    """What the caller needs to re-raise ``exc``: (stage, pickled, type name, text, traceback)."""
    blob, tname, text = pack_exception(exc)
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return (stage, blob, tname, text, tb)


def _reply(
    chan: Channel, chunk_id: int, values: list[Any], errors: list[tuple[int, Any]], elapsed: float
) -> None:
    try:
        frame = chan.encode((DONE, chunk_id, values, errors, elapsed))
    except Exception:
        failed = {k for k, _ in errors}
        for k, value in enumerate(values):
            if k in failed:
                continue
            try:
                cloudpickle.dumps(value)  # a probe: must not consume releases
            except Exception as exc:
                err = TypeError(f"the result cannot be pickled: {exc}")
                errors.append((k, error_entry("<result pickling>", err)))
                values[k] = None
        frame = chan.encode((DONE, chunk_id, values, errors, elapsed))
    try:
        chan.send_frame(frame)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        os._exit(0)


def worker_main(
    conn: Any,
    slots: Any,
    slot: int,
    worker: int,
    device: str,
    n_threads: int | None,
    payload: bytes,
    entropy: int,
) -> None:
    """Entry point of a worker process (the ``target`` given to ``Process``)."""
    entered = time.monotonic()
    # Ctrl-C reaches the whole foreground process group; the caller decides what happens.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    chan = Channel(conn)
    tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
    stop = threading.Event()
    threading.Thread(target=_reader, args=(chan, tasks, stop), daemon=True).start()

    _setup_torch(device, n_threads)
    # Never share a random stream with another worker (torch's default seed is a constant,
    # numpy's state survives fork): seed everything from per-worker entropy.
    seed_everything(entropy)

    stages: list[_Stage] = []
    name = "<payload>"
    try:
        producers, cfg = pickle.loads(payload)
        context = {"device": device, "cfg": cfg, "worker": worker}
        for p in producers:
            name = f"{p.name} (init)"
            st = _Stage(p.fn, p.name, {})
            if p.has_init:
                st.state = p.init(**{n: context[n] for n in p.init_names})
            full = {**context, "state": st.state}
            st.kwargs = {n: full[n] for n in p.fn_names}
            st.end, st.end_names = p.end, p.end_names
            stages.append(st)
    except BaseException as exc:
        _send(chan, (INIT_ERROR, *error_entry(name, exc)))
        return
    _send(chan, (READY, os.getpid(), entered, time.monotonic()))

    # slots[2k] = index of the item in hand, slots[2k+1] = its start time (timeouts) or 1.0
    # while a chunk runs, 0.0 when idle: the caller reads them when we die or run late.
    cur = memoryview(slots).cast("B").cast("d")
    base = 2 * slot
    clock = time.monotonic
    fast = stages[0].fn if len(stages) == 1 and not stages[0].kwargs else None
    while True:
        task = tasks.get()
        if task is None or stop.is_set():
            break
        try:
            chunk_id, seed, start, items, timed = chan.decode(*task)
        except BaseException as exc:
            # An item that pickled in the caller but does not unpickle here: say so for the
            # oldest chunk we hold (chunks arrive and are answered in order).
            _send(chan, (UNREADABLE, *error_entry("<item unpickling>", exc)))
            continue
        values: list[Any] = []
        errors: list[tuple[int, Any]] = []
        t0 = clock()
        cur[base + 1] = 1.0
        index = float(start)
        if fast is not None and seed is None and not timed:
            # the hot path: one stage, nothing injected, no per-item seed or clock
            append = values.append
            for item in items:
                cur[base] = index
                index += 1.0
                try:
                    append(fast(item))
                except BaseException as exc:
                    errors.append((len(values), error_entry(stages[0].name, exc)))
                    append(None)
        else:
            for item in items:
                cur[base] = index
                if timed:
                    cur[base + 1] = clock()
                if seed is not None:
                    seed_everything(derive_seed(seed, int(index)))
                index += 1.0
                value = item
                for st in stages:
                    try:
                        value = st.fn(value, **st.kwargs)
                    except BaseException as exc:
                        errors.append((len(values), error_entry(st.name, exc)))
                        value = None
                        break
                values.append(value)
                if stop.is_set():
                    break
        cur[base + 1] = 0.0
        if stop.is_set():
            break
        _reply(chan, chunk_id, values, errors, clock() - t0)

    # end runs for every stage even when an earlier one fails; the first failure is reported.
    failure: tuple[Any, ...] | None = None
    for st in stages:
        if st.end is None:
            continue
        try:
            full = {"device": device, "cfg": cfg, "worker": worker, "state": st.state}
            st.end(**{n: full[n] for n in st.end_names})
        except BaseException as exc:
            if failure is None:
                failure = error_entry(f"{st.name} (end)", exc)
    _send(chan, (END_ERROR, *failure) if failure is not None else (ENDED,))
    # Nothing is left to do: skip interpreter teardown (the caller joins us right now).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
