"""A bounded pool of reusable pinned host buffers for device <-> host staging.

Pinning memory is slow (``cudaHostAlloc`` takes milliseconds) and pinned memory is
scarce, so buffers are kept and reused: they come in power-of-two size classes
(from 64 KiB), and the pool never holds more than ``capacity_bytes`` in all. When
a request does not fit, free buffers of other sizes are dropped first; then the
pool asks its ``reclaim`` callback (the connector finishing its oldest in-flight
copy) and waits for a release, but only until ``timeout_s``: a pool that stays
exhausted past that is a counted miss and raises :class:`PinnedPoolExhaustedError`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvplug import LazyModule
from kvplug.errors import PinnedPoolExhaustedError

if TYPE_CHECKING:
    import torch
else:  # imported on first use: ``kvplug plugins`` and ``config validate`` load this module without torch
    torch = LazyModule("torch")

#: Smallest buffer the pool allocates; smaller requests share this size class.
MIN_BUFFER_BYTES = 64 * 1024

#: ``reclaim(deadline)`` finishes one in-flight user of the pool if it can; False: nothing to finish.
Reclaim = Callable[[float], bool]


@dataclass
class PoolStats:
    """Counters of a :class:`PinnedPool`."""

    capacity_bytes: int
    allocated_bytes: int = 0
    in_use_bytes: int = 0
    acquires: int = 0
    reuses: int = 0
    allocations: int = 0
    waits: int = 0
    misses: int = 0


class PinnedBuffer:
    """A pooled host buffer; ``tensor`` is ``uint8`` of its size class, ``view`` its used part."""

    __slots__ = ("nbytes", "size", "tensor")

    def __init__(self, tensor: torch.Tensor, nbytes: int) -> None:
        self.tensor = tensor
        self.size = tensor.numel()
        self.nbytes = nbytes

    def view(self, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The first ``nbytes`` as ``dtype`` (and ``shape``)."""
        flat = self.tensor[: self.nbytes].view(dtype)
        return flat if shape is None else flat.view(shape)


class PinnedPool:
    """Hands out pinned (``pin=True``) or plain host buffers within a byte budget; thread safe."""

    def __init__(self, capacity_bytes: int, *, pin: bool, timeout_s: float, reclaim: Reclaim | None = None) -> None:
        if capacity_bytes < MIN_BUFFER_BYTES:
            raise ValueError(f"pinned pool capacity must be at least {MIN_BUFFER_BYTES} bytes, got {capacity_bytes}")
        if timeout_s <= 0:
            raise ValueError(f"pinned pool timeout must be positive, got {timeout_s}")
        self.pin = pin
        self.timeout_s = timeout_s
        self.reclaim = reclaim
        self._stats = PoolStats(capacity_bytes=capacity_bytes)
        self._free: dict[int, list[torch.Tensor]] = {}
        self._changed = threading.Condition()
        self._closed = False

    @property
    def capacity_bytes(self) -> int:
        return self._stats.capacity_bytes

    def acquire(self, nbytes: int) -> PinnedBuffer:
        """A buffer of at least ``nbytes``; waits at most ``timeout_s`` for room."""
        size = _size_class(nbytes)
        if size > self.capacity_bytes:
            with self._changed:
                self._stats.misses += 1
            raise PinnedPoolExhaustedError(
                f"a {nbytes}-byte staging buffer exceeds the pinned pool's capacity of {self.capacity_bytes} "
                "bytes; raise pinned_pool_bytes"
            )
        deadline = time.monotonic() + self.timeout_s
        waited = False
        while True:
            with self._changed:
                if self._closed:
                    raise PinnedPoolExhaustedError("the pinned pool is closed")
                tensor = self._take(size)
                if tensor is not None:
                    self._stats.acquires += 1
                    self._stats.in_use_bytes += size
                    self._stats.waits += int(waited)
                    return PinnedBuffer(tensor, nbytes)
            waited = True
            # Outside the lock: reclaiming releases buffers, which takes it.
            if self.reclaim is not None and self.reclaim(deadline):
                continue
            with self._changed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._stats.misses += 1
                    raise PinnedPoolExhaustedError(
                        f"no {size}-byte pinned buffer came free within {self.timeout_s}s "
                        f"({self._stats.in_use_bytes} of {self.capacity_bytes} bytes in use)"
                    )
                self._changed.wait(min(remaining, 0.01))

    def release(self, buffer: PinnedBuffer) -> None:
        """Return ``buffer``; its memory may be handed out again at once."""
        with self._changed:
            self._stats.in_use_bytes -= buffer.size
            if self._closed:
                self._stats.allocated_bytes -= buffer.size
            else:
                self._free.setdefault(buffer.size, []).append(buffer.tensor)
            self._changed.notify_all()

    def stats(self) -> PoolStats:
        with self._changed:
            return PoolStats(**vars(self._stats))

    def close(self) -> None:
        """Drop free buffers; buffers still out are dropped when released."""
        with self._changed:
            self._closed = True
            for size, tensors in self._free.items():
                self._stats.allocated_bytes -= size * len(tensors)
            self._free.clear()
            self._changed.notify_all()

    def _take(self, size: int) -> torch.Tensor | None:
        """A free buffer of ``size``, or a new one if the budget allows (lock held)."""
        free = self._free.get(size)
        if free:
            self._stats.reuses += 1
            return free.pop()
        stats = self._stats
        # Drop idle buffers of other sizes until the new one fits.
        for other in sorted(self._free, reverse=True):
            while self._free[other] and stats.allocated_bytes + size > stats.capacity_bytes:
                self._free[other].pop()
                stats.allocated_bytes -= other
        if stats.allocated_bytes + size > stats.capacity_bytes:
            return None
        tensor = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        stats.allocated_bytes += size
        stats.allocations += 1
        return tensor


def _size_class(nbytes: int) -> int:
    if nbytes < 0:
        raise ValueError(f"buffer size must be non-negative, got {nbytes}")
    return max(MIN_BUFFER_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())
