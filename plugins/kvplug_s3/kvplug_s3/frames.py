"""Reusable upload buffers for record frames.

An object is one PUT body: the 64-byte record header followed by the value, so
each put copies the value once. Copying into freshly allocated memory costs a
page fault per 4 KiB (large allocations are fresh mmaps), which made uploads of
multi-MiB values ~30% slower than raw s3fs. KV chunks of one model mostly share
one size, so buffers of the exact size are kept and refilled: warm pages copy at
memory speed.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from kvplug import RECORD_HEADER_SIZE


class FrameBuffers:
    """A bounded pool of ``bytearray`` frames keyed by exact length. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: defaultdict[int, list[bytearray]] = defaultdict(list)
        self._held = 0
        self._lock = threading.Lock()

    def frame(self, header: bytes, value: memoryview) -> bytearray:
        """A record's 64-byte header and its value (bytes) in one buffer, from the pool
        when one of that size is free."""
        size = RECORD_HEADER_SIZE + value.nbytes
        with self._lock:
            free = self._free.get(size)
            buffer = free.pop() if free else None
            if buffer is not None:
                self._held -= size
        if buffer is None:
            buffer = bytearray(size)
        buffer[:RECORD_HEADER_SIZE] = header
        buffer[RECORD_HEADER_SIZE:] = value
        return buffer

    @property
    def held_bytes(self) -> int:
        """Bytes of the frames waiting in the pool."""
        with self._lock:
            return self._held

    def release(self, buffer: bytearray) -> None:
        """Take back a frame whose upload finished (never one that may still be in flight)."""
        size = len(buffer)
        with self._lock:
            if self._held + size > self.max_bytes:
                return
            self._free[size].append(buffer)
            self._held += size

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._held = 0
