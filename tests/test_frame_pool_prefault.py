"""The frame pool faults its next segment in ahead of the stores (store.prefault_frames): a new
engine's frames are resident memory, as a warm engine's recycled ones are."""

from __future__ import annotations

import ctypes
import gc

from core_helpers import LAYOUTS

from kvplug.core.engine.frame_pool import GRANULARITY, SEGMENT_BYTES, FramePool

PAGE = 4096


def resident_fraction(frame: object) -> float:
    """Share of the frame's pages in memory, from mincore(2); merely mapped pages are not."""
    view = memoryview(frame).cast("B")  # type: ignore[arg-type]
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    start = address - address % PAGE
    pages = -(-(address + view.nbytes - start) // PAGE)
    flags = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(start, pages * PAGE, flags) == 0, ctypes.get_errno()
    return sum(flag & 1 for flag in flags) / pages


def test_frames_of_a_prefaulting_pool_are_resident_before_they_are_written() -> None:
    pool = FramePool(4 * SEGMENT_BYTES, prefault=True)
    assert pool.stats().mapped == SEGMENT_BYTES  # the first segment, mapped ahead of any frame
    assert pool.prefaulting is not None
    pool.prefaulting.join(timeout=30)
    frame = pool.new_buffer(8 * 1024**2)
    assert resident_fraction(frame) == 1.0
    # Carving from it mapped the next segment ahead: one segment beyond what frames use.
    assert pool.stats().mapped == 2 * SEGMENT_BYTES
    plain = FramePool(4 * SEGMENT_BYTES).new_buffer(8 * 1024**2)
    assert resident_fraction(plain) < 0.5  # the same frame of a pool that does not prefault


def test_frames_carved_while_their_segment_is_faulted_in_keep_their_bytes() -> None:
    pool = FramePool(3 * SEGMENT_BYTES, prefault=True)
    frames = [pool.new_buffer(3 * 1024**2) for _ in range(40)]  # across segments, some being faulted in
    for i, frame in enumerate(frames):
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(frame)), i + 1, memoryview(frame).nbytes)
    if pool.prefaulting is not None:
        pool.prefaulting.join(timeout=30)
    assert all(bytes(memoryview(f)[:1]) == bytes([i + 1]) and bytes(memoryview(f)[-1:]) == bytes([i + 1])
               for i, f in enumerate(frames))  # fmt: skip
    assert pool.stats().fallbacks == 0 and pool.stats().mapped <= pool.capacity


def test_prefault_stops_at_the_capacity() -> None:
    pool = FramePool(SEGMENT_BYTES + SEGMENT_BYTES // 2, prefault=True)
    frames = [pool.new_buffer(SEGMENT_BYTES // 4) for _ in range(6)]
    assert pool.stats().fallbacks == 0 and pool.stats().mapped == pool.capacity
    assert isinstance(pool.new_buffer(GRANULARITY), bytearray)
    del frames
    gc.collect()


def test_the_engine_prefaults_unless_told_not_to(make_engine) -> None:
    assert make_engine(LAYOUTS["vllm_flash"]).frame_pool.stats().mapped > 0
    assert make_engine(LAYOUTS["vllm_flash"], **{"store.prefault_frames": False}).frame_pool.stats().mapped == 0
