"""Tier ``cpu``: values in host memory, evicted by the configured policy (``eviction``:
``lru``, least recently used first, or the scan-resistant ``s3fifo``; see
:class:`kvplug.core.policies.eviction.EvictionPolicy`).

``bytes_used`` is the exact sum of stored value lengths. Values are kept as given
(the caller hands them over, see :class:`kvplug.StorageTier`), or copied into
page-locked memory when ``pin_memory`` applies and they are not pinned already
(frames of an engine's pinned frame pool are), so a CUDA engine can copy them to
the GPU asynchronously. A value that is a view of a shared file's mapping (a hit in
tier ``shm`` promoted here) is copied: kept, it would hold the file's pages in the
shared folder's memory after the file is evicted, which no budget counts and no
eviction frees.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import ByteSize, Field

from kvplug import (
    Buffer,
    EvictionName,
    GuardedEviction,
    KVEvent,
    OrderedEvents,
    StorageTier,
    TenancySettings,
    TierConfig,
    TierContext,
    TierStats,
    is_mapped_file,
)
from kvplug.errors import TierClosedError, ValueTooLargeError


class CPUTierConfig(TenancySettings, TierConfig):
    """Options of tier ``cpu``."""

    max_bytes: ByteSize = Field(default=ByteSize(4 * 1024**3), description="Byte budget of stored values.")
    pin_memory: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="auto: pin when torch is already loaded and CUDA is present "
        "(this tier never imports torch itself); always: require it.",
    )
    eviction: EvictionName = Field(
        default="lru",
        description="Which values leave first past max_bytes: lru (least recently used) or s3fifo "
        "(scan-resistant: a value read at least twice outlives a scan of one-off prompts; "
        "Yang et al., SOSP 2023).",
    )


class CPUTier(StorageTier):
    """A thread-safe, byte-bounded map of byte buffers, evicted by its ``eviction`` policy."""

    name = "cpu"
    medium = "memory"
    Config = CPUTierConfig
    keeps_buffers = True
    trusted_reads = True  # a dict of this process's own buffers
    reports_stored = True

    def __init__(self, config: CPUTierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        self.config: CPUTierConfig = config
        self._entries: dict[str, Buffer] = {}
        quotas, default_quota = config.quota_bytes()
        tenancy = context.tenancy
        # Guarded by self._lock, like _entries: pinned keys are never its victims.
        self._policy = GuardedEviction(
            config.eviction,
            pin_budget=config.pin_budget(),
            quotas=tenancy.labels.quota_salts(quotas),
            default_quota=default_quota,
            tenant_of=tenancy.tenants.tenant_of,
            wants_pin=tenancy.pins.wants_key,
            logger=context.logger,
            tier=self.name,
            request_pin_budget=config.request_pin_budget(),
            requested_pin=tenancy.pins.requested_key,
            labels=tenancy.labels,
        )
        self._lock = threading.Lock()
        # Queued under self._lock, sent after it: in the order of the changes, whichever thread sends.
        # Through the context as it is then (a test may replace its emit).
        self._events = OrderedEvents(lambda event: self.context.emit(event))
        self._stats = TierStats()
        self._closed = False
        self._pin = _pinning_copier(config.pin_memory)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            self._check_open()
            return [key in self._entries for key in keys]

    def get(self, keys: Sequence[str]) -> list[Buffer | None]:
        found: list[Buffer | None] = []
        with self._lock:
            self._check_open()
            accessed = self._policy.accessed
            for key in keys:
                value = self._entries.get(key)
                if value is None:
                    self._stats.misses += 1
                else:
                    accessed(key)
                    self._stats.hits += 1
                found.append(value)
        return found

    def put(self, items: Sequence[tuple[str, Buffer]]) -> None:
        budget = int(self.config.max_bytes)
        prepared = []
        for key, value in items:
            view = memoryview(value)
            if view.nbytes > budget:
                raise ValueTooLargeError(f"value of {view.nbytes} bytes for {key} exceeds max_bytes {budget}")
            prepared.append((key, self._own(value, view), view.nbytes))
        evicted: dict[str, None] = {}
        stored: dict[str, None] = {}
        with self._lock:
            self._check_open()
            stats = self._stats
            for key, value, size in prepared:
                if not self._policy.admits(key, size, budget):  # it would only evict others, then itself
                    continue
                evicted.pop(key, None)  # evicted earlier in this put, held again: not reported as gone
                old = self._entries.pop(key, None)
                if old is not None:
                    self._account(old, -1)
                self._entries[key] = value
                stats.bytes_used += size
                stats.items += 1
                self._policy.inserted(key, size)
                stats.puts += 1
                self._drop_over_quota(evicted)
                while stats.bytes_used > budget:
                    # Never None: pins fit in pin_max_bytes <= max_bytes, the rest is the policy's.
                    popped = self._policy.pop_victim()
                    assert popped is not None, "the policy holds every stored key not pinned"
                    self._drop_victim(*popped, evicted)
                stored[key] = None
            # Only what this put left here: a value it admitted, then pushed out again, was never held.
            held = tuple(key for key in stored if key in self._entries)
            if held:  # before the evictions this put caused: a router hears "stored" first
                self._events.add(KVEvent("stored", held, tier=self.name))
            self._add_evicted(evicted)
        self._events.deliver()

    def stored_unsent(self, keys: Sequence[str]) -> list[bool]:
        return self._events.stored_unsent(keys)

    def _drop_victim(self, victim: str, size: int, evicted: dict[str, None]) -> None:
        del self._entries[victim]
        self._stats.bytes_used -= size
        self._stats.items -= 1
        self._stats.evictions += 1
        evicted[victim] = None

    def pin(self, keys: Sequence[str]) -> list[tuple[str, int]]:
        evicted: dict[str, None] = {}
        with self._lock:
            self._check_open()
            outcomes: list[tuple[str, int]] = []
            for key in keys:
                outcome = self._policy.pin(key)
                value = self._entries.get(key)
                outcomes.append((outcome, 0 if value is None else memoryview(value).nbytes))
            self._drop_over_quota(evicted)  # request pins an operator's pin made ordinary again
            self._add_evicted(evicted)
        self._events.deliver()
        return outcomes

    def unpin(self, keys: Sequence[str]) -> list[int | None]:
        evicted: dict[str, None] = {}
        with self._lock:
            self._check_open()
            sizes = [self._policy.unpin(key) for key in keys]
            self._drop_over_quota(evicted)  # unpinned chunks count against their tenant's quota again
            self._add_evicted(evicted)
        self._events.deliver()
        return sizes

    def _drop_over_quota(self, evicted: dict[str, None]) -> None:
        for victim, victim_size in self._policy.take_over_quota():  # the tenant's own chunks
            self._drop_victim(victim, victim_size, evicted)

    def _add_evicted(self, evicted: dict[str, None]) -> None:
        if evicted:
            self._events.add(KVEvent("evicted", tuple(evicted), tier=self.name))

    def remove(self, keys: Sequence[str]) -> None:
        self._remove_where([(key, None) for key in keys])

    def remove_if_same(self, items: Sequence[tuple[str, Buffer]]) -> None:
        """Remove each key only while it holds that value: one put since (a promotion) stays."""
        self._remove_where(items)

    def _remove_where(self, items: Sequence[tuple[str, Buffer | None]]) -> None:
        """Remove each key that holds the value given with it (``None``: any value)."""
        removed = []
        with self._lock:
            self._check_open()
            for key, seen in items:
                held = self._entries.get(key)
                if held is not None and seen is not None and memoryview(held).tobytes() != bytes(seen):
                    continue  # stored again since it was read: not the value found unusable
                value = self._entries.pop(key, None)
                if value is not None:
                    self._account(value, -1)
                    self._policy.removed(key)
                    removed.append(key)
            if removed:
                self._events.add(KVEvent("removed", tuple(removed), tier=self.name))
        self._events.deliver()

    def stats(self) -> TierStats:
        with self._lock:
            snapshot = TierStats(**{k: v for k, v in vars(self._stats).items() if k != "extra"})
            snapshot.extra = {
                "max_bytes": int(self.config.max_bytes),
                "pinned": self._pin is not None,
                "eviction": self._policy.eviction,
                **self._policy.stats_extra(),
            }
            return snapshot

    def close(self) -> None:
        with self._lock:
            was_open, self._closed = not self._closed, True
            gone = tuple(self._entries)
            self._entries.clear()
            self._policy.clear()
            self._stats.bytes_used = self._stats.items = 0
            if was_open and gone:  # the process's memory lets go of them: a router told "stored" must hear it
                self._events.add(KVEvent("removed", gone, tier=self.name))
        self._events.deliver()

    def _account(self, value: Buffer, sign: int) -> None:
        self._stats.bytes_used += sign * memoryview(value).nbytes
        self._stats.items += sign

    def _own(self, value: Buffer, view: memoryview) -> Buffer:
        if self._pin is not None:
            return self._pin(view)
        if isinstance(value, bytes):
            return value
        if is_mapped_file(view):
            return view.tobytes()
        return view.toreadonly()

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError("tier 'cpu' is closed")


def _pinning_copier(mode: str) -> Callable[[memoryview], memoryview] | None:
    """A function copying a buffer into pinned memory, or None when not pinning."""
    if mode == "never":
        return None
    torch: Any = sys.modules.get("torch")
    cuda_ok = torch is not None and torch.cuda.is_available()
    if not cuda_ok:
        if mode == "always":
            raise RuntimeError("pin_memory: always needs torch with CUDA loaded in this process")
        return None

    def copy_pinned(view: memoryview) -> memoryview:
        if view.nbytes and _is_pinned(torch, view):  # a frame of a pinned pool: keep it as it is
            return view.toreadonly()
        pinned = torch.empty(view.nbytes, dtype=torch.uint8, pin_memory=True)
        if view.nbytes:
            pinned.numpy()[:] = memoryview(view).cast("B")
        return memoryview(pinned.numpy()).toreadonly()

    return copy_pinned


def _is_pinned(torch: Any, view: memoryview) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer warns on read-only views; nothing writes here
        return bool(torch.frombuffer(view, dtype=torch.uint8).is_pinned())
