"""How many items go in one chunk: adaptive, per hop, so tiny items do not drown in messages."""

from __future__ import annotations

__all__ = [
    "MAX_CHUNK",
    "TAIL_CHUNK_SECONDS",
    "TARGET_CHUNK_BYTES",
    "TARGET_CHUNK_SECONDS",
    "WRITE_CHUNK_SECONDS",
    "WRITE_TAIL_SECONDS",
    "ChunkSizer",
]

MAX_CHUNK = 16384  # items per chunk, at most
TARGET_CHUNK_SECONDS = 0.05  # grow chunks until one takes about this long...
TAIL_CHUNK_SECONDS = 0.001  # ...and, as a sized input runs out, shrink them no further
TARGET_CHUNK_BYTES = 1 << 20  # ...or carries about this many pickled bytes
WRITE_CHUNK_SECONDS = 0.5  # a run whose last pool writes files: a file per chunk, so bigger
WRITE_TAIL_SECONDS = 0.1  # ...and its tail shrinks to no less: a file of 50 rows is no use


class ChunkSizer:
    """Grow chunks of small items until one takes ~50 ms or carries ~1 MiB; shrink for slow
    or big ones. One per hop: a run's chunks are as big as its slowest hop allows."""

    __slots__ = ("bytes_per_item", "per_item", "seconds", "size", "tail")

    def __init__(self, seconds: float = TARGET_CHUNK_SECONDS) -> None:
        self.seconds = seconds  # the work a chunk should hold
        # the least work a chunk holds as a sized input runs out: a millisecond, or for the
        # bigger chunks of a writing pool (each is a file) a fifth of their time, so the
        # last files are not tens of rows each, for at most ~0.1 s of one worker idle
        self.tail = WRITE_TAIL_SECONDS if seconds >= WRITE_CHUNK_SECONDS else TAIL_CHUNK_SECONDS
        self.size = 1
        self.per_item: float | None = None
        self.bytes_per_item = 0.0

    def limit_bytes(self, n: int, nbytes: int) -> None:
        """Results measured after the fact (a middle hop's, when sent on)."""
        if n > 0:
            self.bytes_per_item = max(self.bytes_per_item, nbytes / n)
            self.size = max(1, min(self.size, int(TARGET_CHUNK_BYTES / self.bytes_per_item)))

    def floor(self) -> int:
        """The smallest chunk worth a message: about a millisecond of work."""
        if self.per_item is None:
            return 1
        return max(1, min(self.size, int(self.tail / self.per_item)))

    def update(self, n: int, elapsed: float, nbytes: int) -> None:
        """A chunk of ``n`` items took ``elapsed`` seconds and replied ``nbytes``."""
        if n <= 0:
            return
        t = max(elapsed / n, 1e-7)
        self.per_item = t if self.per_item is None else 0.5 * self.per_item + 0.5 * t
        by_time = self.seconds / self.per_item
        by_bytes = TARGET_CHUNK_BYTES / max(nbytes / n, self.bytes_per_item, 1)
        target = max(1, min(MAX_CHUNK, int(min(by_time, by_bytes))))
        # Grow at most 16x per reply so one fast outlier does not make a huge chunk.
        self.size = min(target, self.size * 16)
