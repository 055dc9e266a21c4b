"""Recycled host memory for serializer frames.

A store must write each chunk into memory it can keep. Fresh memory costs a page
fault on first touch of every 4 KiB page, and on the VMs we measured that made a
copy into new memory ten times slower than ``memcpy`` (1.2 vs 11.6 GB/s; see
benchmarks/bench_engine.py). The pool carves frames out of one lazily mapped arena
and takes each back when its last reference is gone (tier, reader, tensor view),
so steady-state stores write into memory that is already mapped.

The arena grows on demand, one ``SEGMENT_BYTES`` mapping at a time, up to the
pool's capacity: mapping the whole capacity up front (a cpu tier's ``max_bytes`` plus
headroom) failed with ``ENOMEM`` as soon as that exceeded what the kernel would
overcommit, and pinned all of it. A segment that cannot be mapped is not fatal: the
frame falls back to a ``bytearray``, counted, like a frame past the capacity.

Frames are ``ctypes`` arrays over the arena: they export the buffer protocol like
a bytearray, and ``weakref.finalize`` tells the pool when they die. A request
that does not fit (arena full, no free frame of that size) gets a plain
``bytearray``, counted as a fallback.

With ``pin=True`` (the engine asks when its connector moves KV to a CUDA device)
each segment is page-locked once with ``cudaHostRegister`` when it is mapped, so the
device can DMA straight into and out of every frame: no staging copy per chunk, and
no ``cudaHostAlloc`` per chunk either. Pinning commits a segment's memory; the first
segment is mapped (and pinned) at once, so ``stats().pinned`` is known from the start.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

GRANULARITY = 4096
#: Size of each mapping the arena grows by (a larger frame gets a mapping of its own size).
SEGMENT_BYTES = 64 * 1024 * 1024

#: cudaHostRegisterPortable: pinned for every CUDA context in the process, not only the current device's.
_CUDA_HOST_REGISTER_PORTABLE = 1

logger = logging.getLogger("kvplug.frame_pool")


@dataclass
class FramePoolStats:
    capacity: int
    carved: int
    in_use: int
    recycled: int
    fallbacks: int
    pinned: bool = False
    #: Bytes mapped so far (at most ``capacity``); the rest costs nothing until frames need it.
    mapped: int = 0


class _Arena(mmap.mmap):
    """The pool's anonymous mapping; page-locked for CUDA by :meth:`pin` until it dies.

    Frames keep the arena alive (``from_buffer`` holds a reference), so it is
    unregistered only after the last frame is gone, and before it is unmapped.
    """

    _pinned_address: int | None = None

    def pin(self) -> bool:
        """Page-lock the mapping for CUDA; False (with the reason logged) if that fails."""
        try:
            import torch

            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch ships this untyped
            address = ctypes.addressof(ctypes.c_char.from_buffer(self))
            error = cudart.cudaHostRegister(address, len(self), _CUDA_HOST_REGISTER_PORTABLE)
        except Exception as exc:  # no CUDA runtime in this torch, no device: frames stay pageable
            logger.warning("frame pool: cannot pin %d bytes for CUDA (%s); frames stay pageable", len(self), exc)
            return False
        if error != cudart.cudaError.success:
            logger.warning(
                "frame pool: cudaHostRegister of %d bytes failed (%s); frames stay pageable", len(self), error
            )
            return False
        self._pinned_address = address
        return True

    def __del__(self) -> None:
        address, self._pinned_address = self._pinned_address, None
        if address is not None:
            try:
                import torch

                torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]  # untyped in torch
            except Exception:  # interpreter shutdown: the process exit releases it anyway
                pass


class FramePool:
    """A bump allocator over anonymous mappings made as needed, with free lists per frame size."""

    def __init__(self, capacity: int, *, pin: bool = False) -> None:
        self.capacity = max(0, capacity - capacity % GRANULARITY)
        self._pin = pin
        self._pin_failed = False
        self._lock = threading.RLock()
        self._free: dict[int, list[tuple[_Arena, int]]] = defaultdict(list)
        self._arena: _Arena | None = None  # the segment frames are carved from now
        self._bump = 0
        self._mapped = 0
        self._carved = 0
        self._in_use = 0
        self._recycled = 0
        self._fallbacks = 0
        if pin and self.capacity:
            with self._lock:
                self._map_segment(min(SEGMENT_BYTES, self.capacity))

    @property
    def pinned(self) -> bool:
        return self._pin and self._mapped > 0 and not self._pin_failed

    def new_buffer(self, nbytes: int) -> Any:
        """A writable buffer of exactly ``nbytes`` bytes."""
        size = -(-max(nbytes, 1) // GRANULARITY) * GRANULARITY
        with self._lock:
            free = self._free.get(size)
            if free:
                arena, offset = free.pop()
                self._recycled += 1
            else:
                if self._arena is None or self._bump + size > len(self._arena):
                    room = self.capacity - self._mapped
                    if size > room or not self._map_segment(min(room, max(size, SEGMENT_BYTES))):
                        self._fallbacks += 1
                        return bytearray(nbytes)
                arena, offset = self._arena, self._bump  # type: ignore[assignment]
                self._bump += size
                self._carved += size
            self._in_use += size
        frame = (ctypes.c_ubyte * nbytes).from_buffer(arena, offset)
        weakref.finalize(frame, self._release, arena, offset, size)
        return frame

    def _map_segment(self, nbytes: int) -> bool:
        """Map (and pin, if asked) a new segment to carve from (lock held); False if the
        kernel refuses. The rest of the last segment stays untouched, so costs no memory."""
        try:
            arena = _Arena(-1, nbytes)
        except OSError as exc:
            logger.warning("frame pool: cannot map %d more bytes (%s); frames fall back to fresh memory", nbytes, exc)
            return False
        if self._pin and not self._pin_failed and not arena.pin():
            self._pin_failed = True
        self._arena, self._bump = arena, 0
        self._mapped += nbytes
        return True

    def _release(self, arena: _Arena, offset: int, size: int) -> None:
        with self._lock:
            self._free[size].append((arena, offset))
            self._in_use -= size

    def stats(self) -> FramePoolStats:
        with self._lock:
            return FramePoolStats(
                self.capacity, self._carved, self._in_use, self._recycled, self._fallbacks, self.pinned, self._mapped
            )
