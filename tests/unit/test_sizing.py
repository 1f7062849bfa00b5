"""Chunk sizes: a writing pool's chunks (a file each) stay big as the input runs out."""

from __future__ import annotations

from easycore._exec.core.sizing import (
    TAIL_CHUNK_SECONDS,
    TARGET_CHUNK_SECONDS,
    WRITE_CHUNK_SECONDS,
    WRITE_TAIL_SECONDS,
    ChunkSizer,
)


def grown(seconds: float, per_item: float) -> ChunkSizer:
    """A sizer that has seen enough chunks of items of ``per_item`` seconds to settle."""
    sizer = ChunkSizer(seconds)
    for _ in range(8):
        sizer.update(sizer.size, sizer.size * per_item, 0)
    return sizer


def test_a_writing_pool_tail_holds_a_fifth_of_its_chunks_work():
    # items of 50 us: chunks of 0.5 s are 10,000 items, the tail no less than 0.1 s of them
    sizer = grown(WRITE_CHUNK_SECONDS, 50e-6)
    assert sizer.size == 10_000
    assert sizer.floor() == int(WRITE_TAIL_SECONDS / 50e-6) == 2_000


def test_other_pools_shrink_to_a_millisecond():
    sizer = grown(TARGET_CHUNK_SECONDS, 50e-6)
    assert sizer.size == 1_000
    assert sizer.floor() == int(TAIL_CHUNK_SECONDS / 50e-6) == 20


def test_the_floor_is_never_above_the_chunk_size_nor_below_one():
    slow = grown(WRITE_CHUNK_SECONDS, 2.0)  # items slower than a chunk's target
    assert slow.size == 1 and slow.floor() == 1
    assert ChunkSizer(WRITE_CHUNK_SECONDS).floor() == 1  # nothing measured yet
