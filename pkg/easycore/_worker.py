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

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.util
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
from easycore._transport import CONTROL, Channel

STOP = b"\x00easycore-stop"
_PROTOCOL = pickle.HIGHEST_PROTOCOL

# Message tags, worker -> caller.
READY = "ready"
INIT_ERROR = "init_error"
DONE = "done"
ENDED = "ended"
END_ERROR = "end_error"
UNREADABLE = "unreadable"
MID = "mid"  # a middle pool finished a chunk; its results wait for the caller's routing
SENT = "sent"  # a middle pool handed a chunk to the next pool's worker
BAD_OUTPUT = "bad_output"  # a middle pool's result cannot be pickled
CLOSED = "closed"  # (local) an upstream peer's pipe reached EOF


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


def derive_seed(seed: int, index: int, pool: int = 0) -> int:
    """A 63-bit seed for item ``index`` of a run seeded with ``seed`` (in pool ``pool``)."""
    key = f"{seed}:{index}" if pool == 0 else f"{seed}:{pool}:{index}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_LAST_SEED: int | None = None  # the last value given to seed_everything in this process


def seed_everything(value: int) -> None:
    """Seed ``random``, numpy (when imported) and torch's CPU and CUDA generators.

    numpy or torch imported later by the work itself are seeded with the same value on
    import (see :func:`_setup_torch`).
    """
    global _LAST_SEED
    _LAST_SEED = value
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
    """Bind the device and give torch its share of threads, now or when the work imports it.

    A worker from the torch forkserver (or on a GPU) has torch loaded already. One from the
    light forkserver (a caller that never imported torch) does not, and pays for the import
    only if its work needs torch: then, right after the import, torch gets the thread budget
    and the worker's current seed, exactly as if it had been loaded from the start.
    """
    if device.startswith("cuda") or "torch" in sys.modules:
        import torch

        _torch_loaded(n_threads, torch)
        if device.startswith("cuda"):
            # Bind before anything can touch CUDA, so the context lands on our device.
            torch.cuda.set_device(torch.device(device))
        return
    seed_on_import(n_threads)


def seed_on_import(n_threads: int | None = None) -> list[Any]:
    """Make a later import of torch or numpy seed it (and set torch's threads) at once.

    Returns the import hooks put in place (each removes itself once its module loads), for
    :func:`drop_hooks`.
    """
    hooks: list[Any] = []
    if "torch" not in sys.modules:
        hooks.append(_AfterImport("torch", functools.partial(_torch_loaded, n_threads)))
    if "numpy" not in sys.modules:
        hooks.append(_AfterImport("numpy", _numpy_loaded))
    for hook in hooks:
        sys.meta_path.insert(0, hook)
    return hooks


def drop_hooks(hooks: list[Any]) -> None:
    """Remove import hooks of :func:`seed_on_import` that have not fired."""
    for hook in hooks:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(hook)


def _torch_loaded(n_threads: int | None, torch: Any) -> None:
    if n_threads is not None:
        torch.set_num_threads(n_threads)
    if _LAST_SEED is not None:
        torch.default_generator.manual_seed(_LAST_SEED)


def _numpy_loaded(np: Any) -> None:
    if _LAST_SEED is not None:
        np.random.seed(_LAST_SEED % (2**32))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` once, right after the module ``name`` is first imported."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name = name
        self.then = then
        self.looking = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name or self.looking:
            return None
        self.looking = True  # the search below asks every finder again, this one included
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.looking = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenLoader(spec.loader, self)
        return spec

    def done(self, module: Any) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        self.then(module)


class _ThenLoader(importlib.abc.Loader):
    """A module's own loader, then :meth:`_AfterImport.done` once the module has run."""

    def __init__(self, inner: Any, hook: _AfterImport) -> None:
        self.inner = inner
        self.hook = hook

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        self.hook.done(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, is_package...
        if name in ("inner", "hook"):  # not set yet (a copy): no endless recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def _reader(chan: Channel, tasks: queue.SimpleQueue[Any], stop: threading.Event) -> None:
    try:
        while True:
            frame, fds = chan.recv_frame()
            if frame == STOP:
                stop.set()
                tasks.put(None)
                return
            tasks.put((chan, frame, fds))
    except (EOFError, OSError):
        # The caller died or closed our pipe without STOP: exit now, do not linger as an orphan.
        os._exit(0)


def _pool_reader(
    chan: Channel,
    tasks: queue.SimpleQueue[Any],
    stop: threading.Event,
    outbox: queue.SimpleQueue[Any] | None,
) -> None:
    """The reader of a worker in a multi-pool pipeline: the caller's pipe plus peer pipes.

    Chunks (from the caller, or from an upstream peer) go to the main thread with the channel
    that decodes them; forward/drop orders and a downstream peer's release notes go to the
    sender thread (``outbox``). New peer pipes arrive as descriptors after control frames; a
    peer's death is an EOF on its pipe (nobody else holds its end).
    """
    import multiprocessing.connection as mpc

    conns: dict[Any, tuple[str, int, Channel]] = {chan.conn: ("caller", -1, chan)}

    def drop(role: str, key: int) -> None:
        for conn, (r, k, ch) in list(conns.items()):
            if r == role and k == key:
                del conns[conn]
                if role == "up":
                    tasks.put((CLOSED, ch, None))
                elif outbox is not None:
                    outbox.put(("gone", key))

    while True:
        for conn in mpc.wait(list(conns)):
            role, key, ch = conns[conn]
            try:
                frame, fds = ch.recv_frame()
            except (EOFError, OSError):
                if role == "caller":
                    os._exit(0)
                drop(role, key)
                continue
            if role == "up":
                tasks.put((ch, frame, fds))
            elif role == "down":
                if outbox is not None:
                    outbox.put(("rel", key, frame, fds))
            elif frame == STOP:
                stop.set()
                tasks.put(None)
                if outbox is not None:
                    outbox.put(None)
                return
            elif frame[:1] == CONTROL:
                op = Channel.read_control(frame)
                peer = Channel(mpc.Connection(fds[0])) if fds else None
                if op[0] == "peer" and peer is not None:  # an upstream worker will send here
                    conns[peer.conn] = ("up", op[1], peer)
                elif op[0] == "fwd" and outbox is not None:
                    if peer is not None:  # the first chunk to this downstream worker
                        conns[peer.conn] = ("down", op[2], peer)
                    outbox.put(("fwd", op[1], op[2], peer))
                elif op[0] == "drop" and outbox is not None:
                    outbox.put(op)
            else:
                tasks.put((ch, frame, fds))


def _sender(caller: Channel, outbox: queue.SimpleQueue[Any], cur: Any, at: int) -> None:
    """Move finished chunks of a middle pool to the worker the caller names.

    Results wait here (``held``) until the caller routes them (it knows every queue's depth,
    which is how backpressure holds across pools); only this thread encodes on downstream
    pipes, so their shared-memory segments need no lock.
    """
    held: dict[int, Any] = {}
    down: dict[int, Channel] = {}
    while True:
        op = outbox.get()
        if op is None:
            return
        kind = op[0]
        if kind == "held":
            held[op[1]] = op[2]
        elif kind == "drop":
            held.pop(op[1], None)
        elif kind == "rel":
            _, key, frame, fds = op
            ch = down.get(key)
            if ch is None:
                for fd in fds:
                    os.close(fd)
            else:
                ch.decode(frame, fds)
        elif kind == "gone":
            ch = down.pop(op[1], None)
            if ch is not None:
                ch.close()
        elif kind == "fwd":
            _, chunk_id, key, new = op
            if new is not None:
                down[key] = new
            msg = held.pop(chunk_id, None)
            ch = down.get(key)
            if msg is None or ch is None:
                continue  # dropped, or the peer died: the caller re-runs the chunk
            cur[at + 2] = float(chunk_id)  # if we die now, this chunk is to blame
            try:
                frame = ch.encode(msg)
            except Exception:
                cur[at + 2] = -1.0
                _bad_output(caller, chunk_id, msg[3])
                continue
            nbytes = len(frame) + ch.shm_bytes
            try:
                ch.send_frame(frame)
            except OSError:
                continue  # the peer died; its reader-side EOF cleans up
            finally:
                cur[at + 2] = -1.0
            _send_bare(caller, (SENT, chunk_id, nbytes))


def _bad_output(caller: Channel, chunk_id: int, values: list[Any]) -> None:
    for k, value in enumerate(values):
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            err = TypeError(f"the result cannot be pickled: {exc}")
            _send_bare(caller, (BAD_OUTPUT, chunk_id, k, error_entry("<result pickling>", err)))
            return
    err = TypeError("the chunk's results cannot be pickled")
    _send_bare(caller, (BAD_OUTPUT, chunk_id, 0, error_entry("<result pickling>", err)))


def _send_bare(chan: Channel, obj: Any) -> None:
    try:
        chan.send_bare(obj)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        os._exit(0)


def _or_die(target: Callable[..., None], *args: Any) -> None:
    """Run a helper thread's loop; if it breaks, end the process (a death the caller handles).

    A dead reader or sender thread in a live process would leave the caller waiting for
    chunks nobody sends; a dead process is seen at once, and its chunks re-run.
    """
    try:
        target(*args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(70)


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
    chan: Channel,
    chunk_id: int,
    values: list[Any],
    errors: list[tuple[int, Any]],
    elapsed: float,
    rerun: Callable[[int], tuple[int, Callable[[], tuple[Any, Any]]]] | None = None,
) -> None:
    try:
        frame = chan.encode((DONE, chunk_id, values, errors, elapsed))
    except Exception:
        failed = {k for k, _ in errors}
        for k in range(len(values)):
            if k not in failed:
                _make_picklable(values, errors, k, rerun)
        frame = chan.encode((DONE, chunk_id, values, errors, elapsed))
    try:
        chan.send_frame(frame)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        os._exit(0)


def _make_picklable(
    values: list[Any],
    errors: list[tuple[int, Any]],
    k: int,
    rerun: Callable[[int], tuple[int, Callable[[], tuple[Any, Any]]]] | None,
) -> None:
    """Probe result ``k``; re-run its item while retries allow, else record the error."""
    allowed, run = rerun(k) if rerun is not None else (0, None)
    tries = 0
    while True:
        try:
            cloudpickle.dumps(values[k])  # a probe: must not consume releases
            return
        except Exception as exc:
            if run is None or tries >= allowed:
                err = TypeError(f"the result cannot be pickled: {exc}")
                errors.append((k, error_entry("<result pickling>", err)))
                values[k] = None
                return
        tries += 1
        values[k], failed = run()
        if failed is not None:
            errors.append((k, error_entry(failed[0].name, failed[1])))
            values[k] = None
            return


# How a chunk is run: (seed or None, pool number, timed?, retries, runs already charged by
# deaths as {(pool, index): n}).
_Task = tuple[int | None, int, bool, int, dict[tuple[int, int], int]]


def _run_one(
    stages: list[_Stage],
    item: Any,
    index: int,
    task: _Task,
    cur: Any,
    at: int,
) -> tuple[Any, tuple[_Stage, BaseException] | None]:
    """Run the fused stages over one item: (value, None) or (None, (stage, exception))."""
    seed, pool, timed = task[0], task[1], task[2]
    cur[at] = float(index)
    if timed:
        cur[at + 1] = time.monotonic()
    if seed is not None:
        seed_everything(derive_seed(seed, index, pool))
    value = item
    for st in stages:
        try:
            value = st.fn(value, **st.kwargs)
        except BaseException as exc:
            return None, (st, exc)
    return value, None


def _rerun(
    stages: list[_Stage],
    units: Any,
    base: int,
    task: _Task,
    cur: Any,
    at: int,
    k: int,
) -> tuple[int, Callable[[], tuple[Any, Any]]]:
    """(retries left, a function re-running unit ``k``) for a result that did not pickle."""
    _, pool, _, retries, spent = task
    index = base + k
    allowed = retries - spent.get((pool, index), 0) if spent else retries
    return allowed, functools.partial(_run_one, stages, units[k], index, task, cur, at)


def _run_units(
    stages: list[_Stage],
    units: Any,
    base: int,
    task: _Task,
    cur: Any,
    at: int,
    stop: threading.Event,
) -> tuple[list[Any], list[tuple[int, Any]]]:
    """Run the fused stages over one chunk's units; failed units are retried here."""
    seed, pool, timed, retries, spent = task
    values: list[Any] = []
    errors: list[tuple[int, Any]] = []
    fast = stages[0].fn if len(stages) == 1 and not stages[0].kwargs else None
    if fast is not None and seed is None and not timed and not retries:
        # the hot path: one stage, nothing injected, no per-item seed, clock or retry
        append = values.append
        where = float(base)
        for item in units:
            cur[at] = where
            where += 1.0
            try:
                append(fast(item))
            except BaseException as exc:
                errors.append((len(values), error_entry(stages[0].name, exc)))
                append(None)
        return values, errors
    index = base
    for item in units:
        allowed = retries - spent.get((pool, index), 0) if spent else retries
        attempt = 0
        while True:
            value, failed = _run_one(stages, item, index, task, cur, at)
            if failed is None or attempt >= allowed:
                break
            attempt += 1
        if failed is not None:
            errors.append((len(values), error_entry(failed[0].name, failed[1])))
        values.append(value)
        index += 1
        if stop.is_set():
            break
    return values, errors


def _flush_releases(upstream: set[Channel]) -> None:
    # Tell upstream peers which of their segments we no longer use (they reuse them).
    for ch in list(upstream):
        if ch.released:
            try:
                ch.send(None)
            except OSError:
                upstream.discard(ch)


def worker_main(
    conn: Any,
    slots: Any,
    slot: int,
    worker: int,
    device: str,
    n_threads: int | None,
    payload: bytes,
    entropy: int,
    role: tuple[int, bool, int | None, int] | None = None,
) -> None:
    """Entry point of a worker process (the ``target`` given to ``Process``).

    ``role`` is None in a one-pool pipeline; in a multi-pool one it is ``(pool, last,
    group, unit)``: this pool's number, whether it is the last pool (results go to the
    caller, else to the next pool's workers), how many incoming results make one of its
    items (its ``batch_size``) and how many first-pool items one of its items spans.
    """
    entered = time.monotonic()
    # Ctrl-C reaches the whole foreground process group; the caller decides what happens.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    chan = Channel(conn)
    tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
    stop = threading.Event()
    pool, last, group, unit = role or (0, True, None, 1)
    # slots[3k] = index of the item in hand, slots[3k+1] = its start time (timeouts) or 1.0
    # while a chunk runs, 0.0 when idle, slots[3k+2] = id of the chunk whose results are being
    # pickled or sent, else -1: the caller reads them when we die or run late.
    cur = memoryview(slots).cast("B").cast("d")
    at = 3 * slot
    outbox: queue.SimpleQueue[Any] | None = None
    if role is None:
        threading.Thread(target=_reader, args=(chan, tasks, stop), daemon=True).start()
    else:
        outbox = None if last else queue.SimpleQueue()
        reader_args = (_pool_reader, chan, tasks, stop, outbox)
        threading.Thread(target=_or_die, args=reader_args, daemon=True).start()
        if outbox is not None:
            sender_args = (_sender, chan, outbox, cur, at)
            threading.Thread(target=_or_die, args=sender_args, daemon=True).start()

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
    _send(chan, (READY, os.getpid(), entered, time.monotonic(), "torch" in sys.modules))

    clock = time.monotonic
    upstream: set[Channel] = set()
    while True:
        if upstream:
            try:
                task = tasks.get(timeout=0.05)
            except queue.Empty:
                _flush_releases(upstream)
                continue
        else:
            task = tasks.get()
        if task is None or stop.is_set():
            break
        src, frame, fds = task
        if isinstance(src, str):  # CLOSED: an upstream peer is gone
            upstream.discard(frame)
            frame.close()
            continue
        try:
            msg = src.decode(frame, fds)
        except BaseException as exc:
            # An item that pickled in the caller but does not unpickle here: say so for the
            # oldest chunk we hold (chunks arrive and are answered in order).
            _send(chan, (UNREADABLE, *error_entry("<item unpickling>", exc)))
            continue
        if msg is None:  # only releases
            continue
        if src is not chan:
            upstream.add(src)
        chunk_id, seed, start, items, timed, retries, spent = msg
        if group is not None:
            items = [items[i : i + group] for i in range(0, len(items), group)]
        t0 = clock()
        cur[at + 1] = 1.0
        base = start // unit
        spec = (seed, pool, timed, retries, spent)
        values, errors = _run_units(stages, items, base, spec, cur, at, stop)
        cur[at + 1] = 0.0
        if stop.is_set():
            break
        elapsed = clock() - t0
        if last:
            rerun = functools.partial(_rerun, stages, items, base, spec, cur, at)
            cur[at + 2] = float(chunk_id)  # if pickling a result kills us, this chunk did
            _reply(chan, chunk_id, values, errors, elapsed, rerun)
            cur[at + 2] = -1.0
        elif errors:
            _send(chan, (MID, chunk_id, len(values), errors, elapsed))
        else:
            assert outbox is not None
            outbox.put(("held", chunk_id, (chunk_id, seed, start, values, timed, retries, spent)))
            _send(chan, (MID, chunk_id, len(values), [], elapsed))
        del items, values, msg
        if upstream:
            _flush_releases(upstream)

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
    _send(chan, (END_ERROR, *failure) if failure is not None else (ENDED, "torch" in sys.modules))
    # Nothing is left to do: skip interpreter teardown (the caller joins us right now).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
