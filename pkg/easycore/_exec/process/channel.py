"""How messages, tensors and arrays cross between the caller and a worker.

One :class:`Channel` per end of each worker's pipe (a Unix socket pair). A message is pickled
with cloudpickle's pickler (so lambdas and ``__main__`` classes travel) extended with one
hook: a CPU tensor or numpy array of at least ``SHM_THRESHOLD`` bytes is written into a
*segment* of shared memory owned by the sender, and only ``(segment, dtype, shape)`` goes
into the pickle. Segments are ``memfd_create`` files: they never appear in ``/dev/shm`` (so
its size limit, the classic Docker failure, does not apply) and vanish with the last process
that maps them, so a crash cannot leak them. A new segment's file descriptor follows its
first message over the socket (``SCM_RIGHTS``); both sides map it with libc ``mmap`` and
close the descriptor, so mappings hold no descriptors.

The receiver gets an ordinary tensor/array *over the segment itself*: no copy is made on
receipt. The segment is lent to it, and given back to the sender (announced on the
receiver's next message) when the last view of it is freed; the sender then reuses it like a
slot in a ring, so in steady state no memory is mapped or page-faulted per item. The one
copy is the sender's write into the segment (a producer's result must leave its own memory).
Tensors that need their own semantics (``requires_grad``, subclasses such as
``nn.Parameter``, sparse, quantized) take the plain pickle path.

CUDA tensors go through torch's own CUDA IPC reductions (torch keeps the sender's memory
alive until the receiver is done with it).

Frame layout on the socket: ``send_bytes(flag + pickle)``; flag ``0`` plain, ``1`` segment
file descriptors follow in ``SCM_RIGHTS`` messages of ``_FD_MARKER`` bytes (at most
``_MAX_FDS`` each; the first marker holds the total), ``2`` a
*control* frame: a plain pickle outside the envelope (no segments, no releases), read and
acted on by a worker's reader thread; ``3`` the same, followed by one socket descriptor (a
pipe to a peer worker of a multi-pool pipeline).
"""

from __future__ import annotations

import ctypes
import io
import math
import mmap
import os
import pickle
import select
import socket
import sys
import threading
import weakref
from collections import deque
from typing import Any, NamedTuple

import cloudpickle

__all__ = ["SHM_THRESHOLD", "Channel", "Damaged", "Undecoded", "contains_undecoded"]

SHM_THRESHOLD = 64 * 1024  # smaller payloads are cheaper inside the pickle
MAX_POOL_BYTES = 2 << 30  # per direction and worker; past it, payloads go inline
MAX_FREE_BYTES = 256 << 20  # free segments kept for reuse; beyond that they are unmapped
_SEGMENT_MIN = 1 << 20
_FD_MARKER = 8
_MAX_FDS = 64
PLAIN = b"\x00"
WITH_FDS = b"\x01"
CONTROL = b"\x02"
CONTROL_FD = b"\x03"

_local = threading.local()  # the channel decoding on this thread (for the rebuild functions)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    """A shared mapping of a segment file that keeps no file descriptor open.

    (Python's ``mmap`` keeps a duplicate descriptor per mapping: with results kept by the
    caller, that would exhaust the descriptor limit.) It is unmapped when the last reference
    to it is gone: its owner's (a pool, or a channel's ``peer``) and those of the arrays lent
    from it (see ``_lend``).
    """

    __slots__ = ("addr", "buf", "size")

    def __init__(self, fd: int, size: int) -> None:
        self.buf: Any = None
        addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of a {size}-byte segment failed: {os.strerror(err)}")
        self.addr: int = addr
        self.size = size
        self.buf = (ctypes.c_char * size).from_address(addr)

    def __del__(self, munmap: Any = _libc.munmap) -> None:  # (bound now: also at shutdown)
        if self.buf is not None:
            munmap(self.addr, self.size)


class _Pool:
    """Segments this side owns: free ones, and ones lent to the peer until it releases them."""

    def __init__(self) -> None:
        self.segments: dict[int, _Mapping] = {}  # by id
        self.free: list[int] = []
        self.total_bytes = 0  # of every segment we own
        self.next_id = 0
        self.new_fds: list[int] = []
        self.recent: list[int] = []  # lent during the encode under way
        self.forgotten: list[int] = []  # dropped segments the peer should unmap

    def alloc(self, nbytes: int) -> int | None:
        """The id of a segment of at least ``nbytes`` (the smallest free one, else a new one),
        lent to the peer; None when the pool is full."""
        fits = [seg_id for seg_id in self.free if self.segments[seg_id].size >= nbytes]
        if fits:
            seg_id = min(fits, key=lambda i: self.segments[i].size)
            self.free.remove(seg_id)
        else:
            if self.total_bytes + nbytes > MAX_POOL_BYTES:
                return None
            size = math.ceil(max(nbytes, _SEGMENT_MIN) / mmap.PAGESIZE) * mmap.PAGESIZE
            fd = os.memfd_create(f"easycore-{self.next_id}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                self.segments[self.next_id] = _Mapping(fd, size)
            except BaseException:
                os.close(fd)
                raise
            seg_id = self.next_id
            self.total_bytes += size
            self.next_id += 1
            self.new_fds.append(fd)
        self.recent.append(seg_id)
        return seg_id

    def release(self, seg_ids: list[int]) -> None:
        for seg_id in seg_ids:  # (a message read twice, leniently, releases its arrays twice)
            if seg_id in self.segments and seg_id not in self.free:
                self.free.append(seg_id)
        # After a burst of results the caller kept, do not hold their memory for ever: unmap
        # the oldest free segments past a budget, and tell the peer to unmap them too.
        free_bytes = sum(self.segments[i].size for i in self.free)
        while free_bytes > MAX_FREE_BYTES:
            seg_id = self.free.pop(0)
            seg = self.segments.pop(seg_id)  # (unmapped)
            self.total_bytes -= seg.size
            free_bytes -= seg.size
            self.forgotten.append(seg_id)

    def close(self) -> None:
        for fd in self.new_fds:
            os.close(fd)
        self.new_fds.clear()
        self.segments.clear()
        self.free.clear()


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle plus the shared-memory hook for big CPU tensors and numpy arrays."""

    def __init__(self, file: Any, channel: Channel) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._channel = channel

    def reducer_override(self, obj: Any) -> Any:
        reduced = None
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor:
            reduced = _torch_reduce(self._channel, obj, torch)
        elif (np := sys.modules.get("numpy")) is not None and type(obj) is np.ndarray:
            reduced = _numpy_reduce(self._channel, obj, np)
        return super().reducer_override(obj) if reduced is None else reduced


def _torch_reduce(chan: Channel, obj: Any, torch: Any) -> Any:
    if obj.device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(obj)  # type: ignore[no-untyped-call]
    odd = obj.requires_grad or obj.layout != torch.strided or obj.is_quantized
    if obj.device.type != "cpu" or odd or obj.is_conj() or obj.is_neg():
        return None
    nbytes = obj.numel() * obj.element_size()
    dtype = str(obj.dtype).removeprefix("torch.")
    seg_id = chan.pool.alloc(nbytes) if nbytes >= SHM_THRESHOLD else None
    if seg_id is None:
        # Small (or no room left): raw bytes in the pickle. torch's own tensor pickling goes
        # through a storage serializer, ~20x slower for a small tensor.
        raw = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return (_rebuild_small_tensor, (raw, dtype, tuple(obj.shape)))
    buf = chan.pool.segments[seg_id].buf
    dst = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(obj.dtype)
    dst.view(obj.shape).copy_(obj)
    chan.shm_bytes += nbytes
    return (_rebuild_tensor, (seg_id, nbytes, dtype, tuple(obj.shape)))


def _numpy_reduce(chan: Channel, obj: Any, np: Any) -> Any:
    if obj.dtype.hasobject or obj.dtype.fields is not None or obj.nbytes < SHM_THRESHOLD:
        return None
    seg_id = chan.pool.alloc(obj.nbytes)
    if seg_id is None:
        return None
    buf = chan.pool.segments[seg_id].buf
    dst = np.frombuffer(buf, dtype=obj.dtype, count=obj.size).reshape(obj.shape)
    np.copyto(dst, obj, casting="no")
    chan.shm_bytes += obj.nbytes
    return (_rebuild_array, (seg_id, obj.dtype.str, tuple(obj.shape)))


def _lend(seg_id: int, count: int, dtype: Any) -> Any:
    """A numpy array over the peer's segment (of the channel decoding on this thread); the
    segment goes back when the array dies.

    The array is the one owner of the memory: torch tensors made from it, and every view of
    either, keep it alive, so the segment cannot be reused while any of them exists.
    """
    import numpy as np

    chan: Channel = _local.channel
    mapping = chan.peer[seg_id]
    base = np.frombuffer(mapping.buf, dtype=dtype, count=count)
    chan.shm_in += base.nbytes
    weakref.finalize(base, _returned, chan.released, seg_id, mapping)
    return base


def _returned(released: deque[int], seg_id: int, mapping: _Mapping) -> None:
    """(``mapping`` rides along: it stays mapped while an array lent from it lives)"""
    released.append(seg_id)


def _rebuild_tensor(seg_id: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    return torch.from_numpy(_lend(seg_id, nbytes, "u1")).view(getattr(torch, dtype)).view(shape)


def _rebuild_small_tensor(raw: bytes, dtype: str, shape: tuple[int, ...]) -> Any:
    import numpy as np
    import torch

    if not raw:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    flat = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _rebuild_array(seg_id: int, dtype: str, shape: tuple[int, ...]) -> Any:
    return _lend(seg_id, math.prod(shape), dtype).reshape(shape)


class Undecoded:
    """Stands in for an object that could not be unpickled here (its class is missing, or
    rebuilding it raised): ``error`` says why. See :meth:`Channel.decode`."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"<not unpickled: {self.error!r}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Undecoded:
        """(a class that cannot be imported here unpickles as one: building one is it)"""
        return self


class Damaged(NamedTuple):
    """A message that unpickled only with :class:`Undecoded` in places of its contents."""

    message: Any
    error: BaseException


def _tolerant(opcode: bytes, popped: int) -> Any:
    """An unpickler step that calls code of the object's class: on an error, the ``popped``
    entries it takes from the stack become one Undecoded."""
    step = pickle._Unpickler.dispatch[opcode[0]]

    def load(self: Any) -> None:
        depth = len(self.stack)
        try:
            step(self)
        except Exception as exc:
            del self.stack[depth - popped :]
            self.stack.append(Undecoded(exc))

    return load


class _LenientUnpickler(pickle._Unpickler):
    """The pure-Python unpickler, with what cannot be rebuilt here left as Undecoded (only
    used once the fast one has failed on a frame)."""

    tolerated = {pickle.REDUCE: 2, pickle.BUILD: 2, pickle.NEWOBJ: 2, pickle.NEWOBJ_EX: 3}
    dispatch = pickle._Unpickler.dispatch | {op[0]: _tolerant(op, n) for op, n in tolerated.items()}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except Exception as exc:
            return Undecoded(exc)


def contains_undecoded(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` holds an :class:`Undecoded` (in containers and attributes)."""
    if type(value) is Undecoded:
        return True
    if depth > 32 or isinstance(value, str | bytes | int | float | type(None)):
        return False
    if isinstance(value, dict):
        items: Any = [*value.keys(), *value.values()]
    elif isinstance(value, list | tuple | set | frozenset):
        items = value
    else:
        items = getattr(value, "__dict__", {}).values()
    return any(contains_undecoded(v, depth + 1) for v in items)


class Channel:
    """One end of a worker pipe: framing, pickling, and this side's shared-memory segments.

    Not thread-safe, except that :meth:`recv_frame` (socket reads only) may run on another
    thread than :meth:`send` and :meth:`decode`.
    """

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.sock = socket.socket(fileno=os.dup(conn.fileno()))
        self.pool = _Pool()
        self.peer: dict[int, _Mapping] = {}
        self.next_peer_id = 0
        # Peer segments we are done with, to announce on our next message. Appended to by
        # finalizers (any thread, any time): a deque, drained with popleft.
        self.released: deque[int] = deque()
        self.shm_bytes = 0  # bytes moved through shared memory by the last encode
        self.shm_in = 0  # bytes copied out of the peer's segments since last reset
        # Held while a frame (and the descriptors after it) goes out: a worker's sender thread
        # and its main thread both write small frames to the caller.
        self.send_lock = threading.Lock()
        # conn.poll() builds a selector per call (~30 us); the caller polls after every message
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)

    # -- sending ---------------------------------------------------------------------------
    def encode(self, payload: Any) -> bytes:
        """Pickle ``(released, forgotten, payload)``; big arrays land in our segments."""
        released = []
        while self.released:
            released.append(self.released.popleft())
        buf = io.BytesIO()
        buf.write(PLAIN)
        self.shm_bytes = 0
        self.pool.recent = []
        try:
            _Pickler(buf, self).dump((released, self.pool.forgotten, payload))
        except BaseException:
            # Nothing was sent: take back the releases and the segments this attempt lent.
            self.released.extendleft(reversed(released))
            self.pool.release(self.pool.recent)
            raise
        self.pool.forgotten = []
        return buf.getvalue()

    def send(self, payload: Any) -> None:
        """Encode and send one message."""
        self.send_frame(self.encode(payload))

    def send_frame(self, frame: bytes) -> None:
        fds = self.pool.new_fds
        if fds:
            frame = WITH_FDS + frame[1:]
            self.pool.new_fds = []
        try:
            with self.send_lock:
                self.conn.send_bytes(frame)
                # SCM_RIGHTS carries a bounded number of descriptors: send them in groups, the
                # first marker saying how many to expect in all.
                for i in range(0, len(fds), _MAX_FDS):
                    marker = len(fds).to_bytes(_FD_MARKER, "little")
                    socket.send_fds(self.sock, [marker], fds[i : i + _MAX_FDS])
        finally:
            for fd in fds:
                os.close(fd)

    def send_bare(self, payload: Any) -> None:
        """Send a message without releases or segments (any thread); :meth:`decode` reads it."""
        frame = PLAIN + pickle.dumps(([], [], payload), pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            self.conn.send_bytes(frame)

    def send_control(self, payload: Any, fd: int | None = None) -> None:
        """Send a control frame (plain pickle), with one descriptor after it when given."""
        flag = CONTROL if fd is None else CONTROL_FD
        frame = flag + pickle.dumps(payload, pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            self.conn.send_bytes(frame)
            if fd is not None:
                socket.send_fds(self.sock, [(1).to_bytes(_FD_MARKER, "little")], [fd])

    # -- receiving -------------------------------------------------------------------------
    def recv_frame(self) -> tuple[bytes, list[int]]:
        """Read one frame and any file descriptors that follow it (socket work only)."""
        frame = self.conn.recv_bytes()
        flag = frame[:1]
        if flag == WITH_FDS:
            fds: list[int] = []
            expected = 1
            while len(fds) < expected:  # (every marker holds the total)
                marker, more, _, _ = socket.recv_fds(self.sock, _FD_MARKER, _MAX_FDS)
                if not marker:
                    raise EOFError("the peer closed the pipe while sending descriptors")
                expected = int.from_bytes(marker, "little")
                fds.extend(more)
            return frame, fds
        if flag == CONTROL_FD:  # one descriptor follows
            _, fds, _, _ = socket.recv_fds(self.sock, _FD_MARKER, 1)
            return frame, fds
        return frame, []

    def decode(self, frame: bytes, fds: list[int]) -> Any:
        """Unpickle a frame: map new peer segments, copy arrays out, apply releases."""
        for fd in fds:
            try:
                self.peer[self.next_peer_id] = _Mapping(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            self.next_peer_id += 1
        _local.channel = self
        try:
            try:
                released, forgotten, payload = pickle.loads(memoryview(frame)[1:])
            except Exception as exc:
                # Something in it cannot be rebuilt in this process (a class it lacks, a
                # __setstate__ that raises): read it again leaving those parts Undecoded,
                # so that the receiver can tell which results are hit.
                released, forgotten, payload = _LenientUnpickler(io.BytesIO(frame[1:])).load()
                payload = Damaged(payload, exc)
        finally:
            _local.channel = None
        if released:
            self.pool.release(released)
        for seg_id in forgotten:
            self.peer.pop(seg_id, None)  # unmapped now, or when the last array lent from it dies
        return payload

    def poll(self) -> bool:
        """Whether a frame (or the end of the pipe) is waiting to be read."""
        return bool(self._poller.poll(0))

    def fileno(self) -> int:
        return int(self.conn.fileno())

    def close(self) -> None:
        """Close the pipe and unmap every segment; idempotent."""
        self.pool.close()
        self.peer.clear()  # unmapped now, or when the last array lent from it dies
        self.sock.close()
        self.conn.close()
