"""Recycled host memory for serializer frames.

A store must write each chunk into memory it can keep. Fresh memory costs a page
fault on first touch of every 4 KiB page, and on the VMs we measured that made a
copy into new memory ten times slower than ``memcpy`` (1.2 vs 11.6 GB/s; see
benchmarks/bench_engine.py). The pool carves frames out of one lazily mapped arena
and takes each back when its last reference is gone (tier, reader, tensor view),
so steady-state stores write into memory that is already mapped.

Frames are ``ctypes`` arrays over the arena: they export the buffer protocol like
a bytearray, and ``weakref.finalize`` tells the pool when they die. A request
that does not fit (arena full, no free frame of that size) gets a plain
``bytearray``, counted as a fallback.

With ``pin=True`` (the engine asks when its connector moves KV to a CUDA device)
the whole arena is page-locked once with ``cudaHostRegister``, so the device can
DMA straight into and out of every frame: no staging copy per chunk, and no
``cudaHostAlloc`` per chunk either. Pinning commits the arena's memory up front.
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

            cudart = torch.cuda.cudart()
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

                torch.cuda.cudart().cudaHostUnregister(address)
            except Exception:  # interpreter shutdown: the process exit releases it anyway
                pass


class FramePool:
    """A bump allocator over an anonymous mapping, with free lists per frame size."""

    def __init__(self, capacity: int, *, pin: bool = False) -> None:
        self.capacity = max(0, capacity - capacity % GRANULARITY)
        # mmap is mapped lazily: untouched capacity costs address space, not memory.
        self._arena = _Arena(-1, self.capacity) if self.capacity else None
        self.pinned = bool(pin and self._arena is not None and self._arena.pin())
        self._lock = threading.RLock()
        self._free: dict[int, list[int]] = defaultdict(list)
        self._bump = 0
        self._in_use = 0
        self._recycled = 0
        self._fallbacks = 0

    def new_buffer(self, nbytes: int) -> Any:
        """A writable buffer of exactly ``nbytes`` bytes."""
        size = -(-max(nbytes, 1) // GRANULARITY) * GRANULARITY
        with self._lock:
            free = self._free.get(size)
            if free:
                offset = free.pop()
                self._recycled += 1
            elif self._arena is not None and self._bump + size <= self.capacity:
                offset, self._bump = self._bump, self._bump + size
            else:
                self._fallbacks += 1
                return bytearray(nbytes)
            self._in_use += size
        frame = (ctypes.c_ubyte * nbytes).from_buffer(self._arena, offset)
        weakref.finalize(frame, self._release, offset, size)
        return frame

    def _release(self, offset: int, size: int) -> None:
        with self._lock:
            self._free[size].append(offset)
            self._in_use -= size

    def stats(self) -> FramePoolStats:
        with self._lock:
            return FramePoolStats(self.capacity, self._bump, self._in_use, self._recycled, self._fallbacks, self.pinned)
