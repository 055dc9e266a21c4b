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

With ``prefault=True`` (the engine's default, ``store.prefault_frames``) the pool maps
the segment after the one frames are carved from ahead of time, and a background thread
faults its pages in (``MADV_POPULATE_WRITE``, Linux 5.14+, in the kernel with the GIL
released). A freshly started engine's stores then write into resident memory as a warm
one's do: on a 2-core VM a copy into new pages ran at 2.3 GB/s against 12.9 GB/s into
resident ones, which put about 8 ms of page faults into the store of a 1024-token prompt.
It commits at most one segment ahead of what frames use. Where the kernel has no
``MADV_POPULATE_WRITE`` nothing is faulted in ahead (touching the pages from a thread
would race with frames carved from them).

With ``pin=True`` (the engine asks when its connector moves KV to a CUDA device)
each segment is page-locked once with ``cudaHostRegister`` when it is mapped, so the
device can DMA straight into and out of every frame: no staging copy per chunk, and
no ``cudaHostAlloc`` per chunk either. Pinning commits a segment's memory; the first
segment is mapped (and pinned) at once, so ``stats().pinned`` is known from the start.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GRANULARITY = 4096
#: Size of each mapping the arena grows by (a larger frame gets a mapping of its own size).
SEGMENT_BYTES = 64 * 1024 * 1024

#: cudaHostRegisterPortable: pinned for every CUDA context in the process, not only the current device's.
_CUDA_HOST_REGISTER_PORTABLE = 1

#: madvise advice that faults a range in for writing without changing its bytes (Linux 5.14+).
_MADV_POPULATE_WRITE = 23

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

    def __init__(self, capacity: int, *, pin: bool = False, prefault: bool = False) -> None:
        self.capacity = max(0, capacity - capacity % GRANULARITY)
        self._pin = pin
        self._pin_failed = False
        # Pinning faults a segment in already; elsewhere only Linux has the madvise that does.
        self._prefault = prefault and not pin and sys.platform.startswith("linux")
        self._next: _Arena | None = None  # with prefault: the segment after the current one
        self.prefaulting: threading.Thread | None = None  # the thread faulting _next in, while it runs
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
        elif self._prefault:
            with self._lock:
                self._prepare_next()

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
                if (self._arena is None or self._bump + size > len(self._arena)) and not self._next_segment(size):
                    self._fallbacks += 1
                    return bytearray(nbytes)
                arena, offset = self._arena, self._bump  # type: ignore[assignment]
                self._bump += size
                self._carved += size
            self._in_use += size
        frame = (ctypes.c_ubyte * nbytes).from_buffer(arena, offset)
        weakref.finalize(frame, self._release, arena, offset, size)
        return frame

    def _next_segment(self, size: int) -> bool:
        """Carve from now on from a segment with room for ``size`` bytes (lock held); False if none can be had.

        The segment mapped ahead is taken when the frame fits it; the rest of the last
        segment stays untouched, so costs no memory.
        """
        ready = self._next
        if ready is not None and len(ready) >= size:
            self._next = None
            self._arena, self._bump = ready, 0
        else:
            room = self.capacity - self._mapped
            if size > room or not self._map_segment(min(room, max(size, SEGMENT_BYTES))):
                return False
        if self._prefault and self._next is None:
            self._prepare_next()
        return True

    def _map_segment(self, nbytes: int) -> bool:
        """Map (and pin, if asked) a new segment to carve from (lock held); False if the kernel refuses."""
        arena = self._new_arena(nbytes)
        if arena is None:
            return False
        self._arena, self._bump = arena, 0
        return True

    def _new_arena(self, nbytes: int) -> _Arena | None:
        try:
            arena = _Arena(-1, nbytes)
        except OSError as exc:
            logger.warning("frame pool: cannot map %d more bytes (%s); frames fall back to fresh memory", nbytes, exc)
            return None
        if self._pin and not self._pin_failed and not arena.pin():
            self._pin_failed = True
        self._mapped += nbytes
        return arena

    def _prepare_next(self) -> None:
        """Map the next segment and fault it in on a background thread (lock held)."""
        room = self.capacity - self._mapped
        if room < GRANULARITY:
            return
        arena = self._new_arena(min(room, SEGMENT_BYTES))
        if arena is not None:
            self._next = arena
            self.prefaulting = threading.Thread(
                target=_fault_in, args=(arena,), name="kvplug-frame-prefault", daemon=True
            )
            self.prefaulting.start()

    def close(self) -> None:
        """Wait for the segment being faulted in, if any, so a closed engine leaves no thread
        behind. Frames already handed out stay valid; the pool may still hand out more."""
        thread = self.prefaulting
        if thread is not None:
            thread.join()  # one madvise of at most a segment: it ends by itself

    def _release(self, arena: _Arena, offset: int, size: int) -> None:
        with self._lock:
            self._free[size].append((arena, offset))
            self._in_use -= size

    def stats(self) -> FramePoolStats:
        with self._lock:
            return FramePoolStats(
                self.capacity, self._carved, self._in_use, self._recycled, self._fallbacks, self.pinned, self._mapped
            )


def _fault_in(arena: _Arena) -> None:
    """Fault every page of ``arena`` in for writing, without changing a byte (frames may be carved meanwhile)."""
    view = (ctypes.c_char * len(arena)).from_buffer(arena)
    try:
        madvise = _libc_madvise()
        if madvise is not None and madvise(ctypes.addressof(view), len(arena), _MADV_POPULATE_WRITE) != 0:
            # An older kernel (EINVAL): the first stores fault the pages in themselves.
            logger.debug("frame pool: MADV_POPULATE_WRITE failed (errno %d)", ctypes.get_errno())
    finally:
        del view  # the arena's buffer export ends here, so the arena can be unmapped once unused


@functools.cache
def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, called through ctypes (which releases the GIL), or None where there is none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise
