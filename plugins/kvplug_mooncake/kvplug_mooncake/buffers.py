"""The registered transfer buffer that values are framed into and read into.

Mooncake moves bytes between registered memory and the store's segments
(``batch_put_from`` / ``batch_get_into``): registering costs time (and pins memory
for RDMA), so the tier registers one buffer once and hands out ranges of it. A
range is given back only by the thread that ran the client call using it: a call
abandoned at its deadline may still be writing into its range.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import mmap
import threading
import weakref
from collections.abc import Callable


class Lease:
    """A range of registered memory for one client call: ``address`` and a writable ``view``.

    ``start`` is its offset in the shared buffer, or ``None`` for a temporary buffer."""

    def __init__(self, address: int, view: memoryview, release: Callable[[], None], start: int | None = None) -> None:
        self.address = address
        self.view = view
        self.start = start
        self._release = release

    def detach(self) -> None:
        """Its range is handed out piece by piece (see :meth:`TransferBuffers.hand_out`)."""
        self._release = _nothing
        try:
            self.view.release()
        except BufferError:
            pass

    def release(self) -> None:
        release, self._release = self._release, _nothing
        try:
            self.view.release()
        except BufferError:  # a view derived from it is still alive; the range is free all the same
            pass
        release()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _nothing() -> None:
    return None


def buffer_address(buffer: mmap.mmap | bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class TransferBuffers:
    """First-fit ranges of one registered buffer; requests that do not fit get a
    temporary buffer registered for the call."""

    def __init__(
        self, size: int, register: Callable[[int, int], int], unregister: Callable[[int], int], align: int = 64
    ) -> None:
        self.size = size
        self._register = register
        self._unregister = unregister
        self._align = align
        # Re-entrant: a handed-out view can be garbage-collected (and return its slot)
        # while this thread holds the lock.
        self._lock = threading.RLock()
        self.handed_out = 0
        self.max_handed_out = size // 2
        self._memory = mmap.mmap(-1, size) if size > 0 else None
        self._view = memoryview(self._memory) if self._memory is not None else None
        self.address = buffer_address(self._memory) if self._memory is not None else 0
        if self._memory is not None:
            code = register(self.address, size)
            if code != 0:
                raise OSError(f"mooncake register_buffer of {size} bytes failed with code {code}")
        # free ranges as sorted starts and their lengths
        self._free_starts: list[int] = [0] if size > 0 else []
        self._free_lengths: dict[int, int] = {0: size} if size > 0 else {}
        self.temporary = 0

    def lease(self, nbytes: int) -> Lease:
        need = max(self._align, -(-nbytes // self._align) * self._align)
        with self._lock:
            for start in self._free_starts:
                length = self._free_lengths[start]
                if length >= need:
                    self._take(start, length, need)
                    assert self._view is not None
                    return Lease(
                        self.address + start,
                        self._view[start : start + nbytes],
                        functools.partial(self._give_back, start, need),
                        start,
                    )
        return self._temporary(nbytes)

    def hand_out(self, lease: Lease, pieces: list[tuple[int, int, int]]) -> list[memoryview] | None:
        """Read-only views of ``pieces`` (offset in the lease, bytes, slot bytes; slots tile
        the lease) that stay valid while the caller holds them: each slot returns to the
        buffer when its view is garbage. ``None`` (nothing handed out) for a temporary
        lease, or when values held by callers would exceed ``max_handed_out`` bytes: the
        caller copies then, so callers keeping values cannot starve the transfers."""
        if lease.start is None or self._memory is None:
            return None
        total = sum(slot for _, _, slot in pieces)
        with self._lock:
            if self.handed_out + total > self.max_handed_out:
                return None
            self.handed_out += total
        base = lease.start
        lease.detach()
        views = []
        for offset, nbytes, slot in pieces:
            # from_buffer keeps the mapping alive while the view lives, even past close().
            holder = (ctypes.c_char * max(nbytes, 1)).from_buffer(self._memory, base + offset)
            weakref.finalize(holder, self._returned, base + offset, slot)
            views.append(memoryview(holder).cast("B")[:nbytes].toreadonly())
        return views

    def _returned(self, start: int, length: int) -> None:
        self._give_back(start, length)
        with self._lock:
            self.handed_out -= length

    def _take(self, start: int, length: int, need: int) -> None:
        self._free_starts.remove(start)
        del self._free_lengths[start]
        if length > need:
            bisect.insort(self._free_starts, start + need)
            self._free_lengths[start + need] = length - need

    def _give_back(self, start: int, length: int) -> None:
        with self._lock:
            index = bisect.bisect_left(self._free_starts, start)
            # merge with the following and the preceding free range
            if index < len(self._free_starts) and self._free_starts[index] == start + length:
                following = self._free_starts.pop(index)
                length += self._free_lengths.pop(following)
            if index > 0:
                before = self._free_starts[index - 1]
                if before + self._free_lengths[before] == start:
                    self._free_lengths[before] += length
                    return
            self._free_starts.insert(index, start)
            self._free_lengths[start] = length

    def _temporary(self, nbytes: int) -> Lease:
        memory = mmap.mmap(-1, max(nbytes, 1))
        address = buffer_address(memory)
        code = self._register(address, len(memory))
        if code != 0:
            memory.close()
            raise OSError(f"mooncake register_buffer of {nbytes} bytes failed with code {code}")
        with self._lock:
            self.temporary += 1
        view = memoryview(memory)

        def release() -> None:
            self._unregister(address)
            view.release()
            try:
                memory.close()
            except BufferError:  # a ctypes export still alive: the GC frees it
                pass

        return Lease(address, view[:nbytes], release)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(self._free_lengths.values())

    def close(self) -> None:
        """Unregister the buffer (the client is closing)."""
        if self._memory is not None:
            self._unregister(self.address)
