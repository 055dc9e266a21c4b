"""The frame pool maps memory as frames need it, not its whole capacity up front:
a capacity at or above physical memory must not kill the engine."""

from __future__ import annotations

import gc
import os

from kvplug.core.engine.frame_pool import GRANULARITY, SEGMENT_BYTES, FramePool

PHYSICAL = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_a_capacity_far_above_physical_memory_maps_only_what_frames_use() -> None:
    pool = FramePool(8 * PHYSICAL)  # one mapping of this size is refused (ENOMEM) under default overcommit
    assert pool.stats().mapped == 0
    frames = [pool.new_buffer(3 * 1024**2) for _ in range(30)]  # 90 MiB
    assert not any(isinstance(f, bytearray) for f in frames) and pool.stats().fallbacks == 0
    mapped = pool.stats().mapped
    assert 90 * 1024**2 <= mapped <= 90 * 1024**2 + SEGMENT_BYTES
    for i, frame in enumerate(frames):  # frames of different segments never overlap
        memoryview(frame).cast("B")[:4] = i.to_bytes(4, "little")
    assert [int.from_bytes(bytes(memoryview(f)[:4]), "little") for f in frames] == list(range(30))
    del frames, frame
    gc.collect()
    again = [pool.new_buffer(3 * 1024**2) for _ in range(30)]
    assert pool.stats().mapped == mapped and pool.stats().recycled == 30  # recycled, nothing new mapped
    del again


def test_growth_stops_at_the_capacity_and_falls_back() -> None:
    pool = FramePool(SEGMENT_BYTES + SEGMENT_BYTES // 2)
    size = SEGMENT_BYTES // 4
    frames = [pool.new_buffer(size) for _ in range(6)]
    assert sum(not isinstance(f, bytearray) for f in frames) == 6 and pool.stats().mapped == pool.capacity
    extra = pool.new_buffer(size)
    assert isinstance(extra, bytearray) and pool.stats().fallbacks == 1
    assert pool.stats().mapped <= pool.capacity


def test_a_frame_larger_than_a_segment_gets_a_mapping_of_its_own() -> None:
    pool = FramePool(4 * SEGMENT_BYTES)
    small = pool.new_buffer(GRANULARITY)
    big = pool.new_buffer(SEGMENT_BYTES + 5)
    assert not isinstance(big, bytearray) and memoryview(big).nbytes == SEGMENT_BYTES + 5
    memoryview(big).cast("B")[-1] = 7
    assert memoryview(small).nbytes == GRANULARITY and memoryview(big).cast("B")[-1] == 7
