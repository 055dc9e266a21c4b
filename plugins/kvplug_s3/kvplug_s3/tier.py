"""Tier ``s3``: values as objects in S3 or any writable fsspec store.

Each object is a :mod:`kvplug.core.record` frame (header with the key's digest
and checksums, then the value) named by the key's sha256 digest. Every read is
verified: a torn, truncated, bit-flipped or swapped object is a miss, counted,
and deleted. Batches run concurrently on the tier's own event loop, each object
operation under a deadline, bounded retries and a circuit breaker
(core's :class:`kvplug.RemoteCalls`): a store that is down costs one failed batch,
then lookups miss and puts are dropped at no cost until the store is back.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from kvplug import (
    RECORD_HEADER_SIZE,
    Absent,
    Buffer,
    KVEvent,
    RemoteCalls,
    StorageTier,
    StoredRecord,
    TierContext,
    TierStats,
    key_digest,
    pack_record_header,
    unpack_record,
)
from kvplug.errors import (
    CorruptChunkError,
    IncompatibleChunkError,
    TierClosedError,
    TierError,
    TierUnavailableError,
    ValueTooLargeError,
)
from kvplug_s3.backend import AsyncObjectStore, ObjectStore, StoredObject, classify_s3_failure, open_object_store
from kvplug_s3.config import S3TierConfig
from kvplug_s3.frames import FrameBuffers
from kvplug_s3.index import SizeIndex
from kvplug_s3.location import s3_location_config

T = TypeVar("T")
#: A listing of a large prefix legitimately takes longer than one object request.
LISTING_TIMEOUT_S = 300.0
#: Building the client is local work (no network), but slow on a busy machine.
OPEN_TIMEOUT_S = 60.0
_COUNTERS = ("hits", "misses", "puts", "evictions", "dropped_puts", "corrupt", "incompatible")


def object_digest(key: str) -> str:
    """The sha256 hex digest naming ``key``'s object (never the key text itself)."""
    return key_digest(key).hex()


class S3Tier(StorageTier):
    """A remote object store as a storage tier; see the module docstring."""

    name = "s3"
    medium = "remote"
    Config = S3TierConfig

    @classmethod
    def location_config(cls, location: str, options: Mapping[str, Any]) -> S3TierConfig | None:
        """``s3://bucket/prefix`` and other writable fsspec URLs (see :mod:`kvplug_s3.location`)."""
        return s3_location_config(location, options)

    def __init__(self, config: S3TierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        self.config: S3TierConfig = config
        self._where = re.sub(r"://[^/@]*@", "://", config.url)  # never show credentials in a URL
        self._calls = RemoteCalls(self.name, config, context, where=self._where, classify=classify_s3_failure)
        try:
            self._store: ObjectStore = open_object_store(config, self._calls.loop.loop)
        except Exception as exc:
            self._calls.close()
            raise TierError(f"tier 's3' cannot open {self._where}: {type(exc).__name__}: {exc}") from exc
        try:
            self._calls.submit(self._store.open()).result(OPEN_TIMEOUT_S)
        except Exception as exc:
            self.context.logger.warning("tier s3: could not prepare the client for %s: %s", self._where, exc)
        # Sync stores (memory://) may keep the very buffer they are given: no reuse there.
        reusable = isinstance(self._store, AsyncObjectStore) and config.frame_buffer_bytes > 0
        self._frames = FrameBuffers(int(config.frame_buffer_bytes)) if reusable else None
        self._index = SizeIndex()
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._closed = False
        self._scan_future = None
        if config.scan_on_start:
            self._index.begin_scan()
            self._scan_future = self._calls.submit(self._scan_into_index())

    # --- reads ----------------------------------------------------------------------

    def contains(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        if not keys:
            return []
        if not self._calls.allow(len(keys)):
            return [False] * len(keys)
        digests = [object_digest(key) for key in keys]
        results = self._batch(self._store.size, [self._store.path_for(d) for d in digests])
        answers = []
        for digest, result in zip(digests, results):
            if isinstance(result, int):
                answers.append(result >= RECORD_HEADER_SIZE)
            else:
                if isinstance(result, Absent):
                    self._index.forget(digest)
                answers.append(False)
        return answers

    def get(self, keys: Sequence[str]) -> list[Buffer | None]:
        self._check_open()
        if not keys:
            return []
        if not self._calls.allow(len(keys)):
            self._count("misses", len(keys))
            return [None] * len(keys)
        digests = [object_digest(key) for key in keys]
        results = self._batch(self._store.read, [self._store.path_for(d) for d in digests])
        values: list[Buffer | None] = []
        corrupt: list[str] = []
        for key, digest, result in zip(keys, digests, results):
            value = None
            if isinstance(result, (bytes, bytearray, memoryview)):
                try:
                    value = unpack_record(result, key)
                except IncompatibleChunkError:
                    # Possibly a newer kvplug's record in a shared bucket: skip it, keep it.
                    self._count("incompatible")
                except CorruptChunkError as exc:
                    self.context.logger.warning("tier s3: corrupt object for %s (%s); removing it", key, exc)
                    self._count("corrupt")
                    corrupt.append(digest)
            elif isinstance(result, Absent):
                self._index.forget(digest)
            if value is None:
                self._count("misses")
            else:
                self._count("hits")
                self._index.record(digest, value.nbytes, key)
            values.append(value)
        if corrupt:
            self._delete_quietly(corrupt)
        return values

    # --- writes ---------------------------------------------------------------------

    def put(self, items: Sequence[tuple[str, Buffer]]) -> None:
        self._check_open()
        latest = dict(items)  # the same key twice in a batch: the last value wins
        budget = None if self.config.max_bytes is None else int(self.config.max_bytes)
        for key, value in latest.items():
            size = memoryview(value).nbytes
            if budget is not None and size > budget:
                raise ValueTooLargeError(f"value of {size} bytes for {key} exceeds the s3 tier's max_bytes {budget}")
        if not latest:
            return
        if not self._calls.allow(len(latest)):
            self._count("dropped_puts", len(latest))
            return
        keys = list(latest)
        digests = [object_digest(key) for key in keys]
        frames: list[Buffer] = []

        def framed() -> Iterator[tuple[str, Buffer]]:
            for key, digest in zip(keys, digests):
                value = latest[key]
                # One buffer per object (a PUT body): the value is copied once.
                frame = (
                    self._frames.frame(key, value)
                    if self._frames
                    else b"".join((pack_record_header(key, value), value))
                )
                frames.append(frame)
                yield self._store.path_for(digest), frame

        retries_before = self._calls.retried
        results = self._batch(lambda write: self._store.write(*write), framed())
        # A frame goes back to the pool only after its upload finished. After a
        # retry, an abandoned attempt's connection might still be sending from it:
        # then no frame of this batch is reused.
        if self._frames and self._calls.retried == retries_before:
            for frame, result in zip(frames, results):
                if not isinstance(result, BaseException) and isinstance(frame, bytearray):
                    self._frames.release(frame)
        for key, digest, result in zip(keys, digests, results):
            if isinstance(result, Absent):  # the bucket or folder is gone: a failure for a write
                result = TierUnavailableError(f"{self._where} does not exist")
            if isinstance(result, BaseException):
                self._count("dropped_puts")
                self._calls.warn_dropped(result)
            else:
                self._count("puts")
                self._index.record(digest, memoryview(latest[key]).nbytes, key)
        if budget is not None:
            self._evict_over(budget)

    def remove(self, keys: Sequence[str]) -> None:
        self._check_open()
        if not keys:
            return
        if not self._calls.allow(len(keys)):
            raise TierUnavailableError(f"tier s3: {self._where} is unavailable (circuit breaker open); nothing removed")
        digests = [object_digest(key) for key in keys]
        results = self._batch(self._store.delete, [self._store.path_for(d) for d in digests])
        removed, failed = [], 0
        for key, digest, result in zip(keys, digests, results):
            if isinstance(result, BaseException) and not isinstance(result, Absent):
                failed += 1
                continue
            if self._index.forget(digest) is not False:
                removed.append(key)
        if removed:
            self.context.emit(KVEvent("removed", tuple(removed), tier=self.name))
        if failed:
            raise TierUnavailableError(f"tier s3: {failed} of {len(keys)} removals from {self._where} failed")

    def _evict_over(self, budget: int) -> None:
        victims = self._index.evict_over(budget)
        if not victims:
            return
        self._count("evictions", len(victims))
        # An object whose delete fails stays in the store but leaves this budget; a
        # later listing (restart) brings it back into the index.
        self._delete_quietly([digest for digest, _ in victims], forget=False)
        known = tuple(key for _, key in victims if key is not None)
        if known:
            self.context.emit(KVEvent("evicted", known, tier=self.name))

    def _delete_quietly(self, digests: list[str], *, forget: bool = True) -> None:
        if forget:
            for digest in digests:
                self._index.forget(digest)
        if self._calls.allow(len(digests)):
            self._batch(self._store.delete, [self._store.path_for(d) for d in digests])

    # --- whole store ----------------------------------------------------------------

    def scan(self) -> Iterator[StoredObject]:
        """Every object under the prefix (digest, object size, modification time),
        for ``kvplug store`` commands; objects not named by a digest are skipped."""
        self._check_open()
        objects = self._calls.run(self._store.listing, timeout_s=LISTING_TIMEOUT_S)
        return iter(objects)

    # --- maintenance (kvplug.core.record_store.RecordStore) ------------------------------

    def records(self) -> Iterator[StoredRecord]:
        for found in self.scan():
            yield StoredRecord(found.digest, found.size, found.modified)

    def read_record(self, digest: str) -> Buffer | None:
        """The whole stored object (record frame and value), unverified."""
        self._check_open()
        (result,) = self._batch(self._store.read, [self._store.path_for(digest)])
        if isinstance(result, Absent):
            return None
        if isinstance(result, BaseException):
            raise TierUnavailableError(f"tier s3: reading {digest} from {self._where} failed: {result}")
        return result

    def delete_record(self, digest: str) -> bool:
        self._check_open()
        (result,) = self._batch(self._store.delete, [self._store.path_for(digest)])
        self._index.forget(digest)
        if isinstance(result, Absent):
            return False
        if isinstance(result, BaseException):
            raise TierUnavailableError(f"tier s3: deleting {digest} from {self._where} failed: {result}")
        return True

    async def _scan_into_index(self) -> None:
        try:
            objects = await self._calls.policy.run(self._store.listing, timeout_s=LISTING_TIMEOUT_S)
        except Exception as exc:
            self._index.abandon_scan()
            self.context.logger.warning("tier s3: could not list %s on start: %s", self._where, exc)
            return
        self._index.finish_scan(objects, RECORD_HEADER_SIZE)

    def flush(self) -> None:
        """Puts are synchronous; this waits for the start-up listing to be indexed
        (and applies the budget to it)."""
        self._check_open()
        future, self._scan_future = self._scan_future, None
        if future is None:
            return
        try:
            future.result(LISTING_TIMEOUT_S * 2)
        except Exception as exc:
            self.context.logger.debug("tier s3: start-up listing did not finish: %s", exc)
        if self.config.max_bytes is not None:
            self._evict_over(int(self.config.max_bytes))

    def stats(self) -> TierStats:
        with self._lock:
            counters = dict(self._counters)
        return TierStats(
            bytes_used=self._index.bytes_used,
            items=self._index.items,
            hits=counters["hits"],
            misses=counters["misses"],
            puts=counters["puts"],
            evictions=counters["evictions"],
            errors=self._calls.failed + counters["corrupt"],
            extra={
                "url": self._where,
                "max_bytes": -1 if self.config.max_bytes is None else int(self.config.max_bytes),
                "breaker_state": self._calls.breaker.state,
                "breaker_opens": self._calls.breaker.opens,
                "dropped_puts": counters["dropped_puts"],
                "short_circuited": self._calls.short_circuited,
                "failures": self._calls.failed,
                "retries": self._calls.retried,
                "corrupt": counters["corrupt"],
                "incompatible": counters["incompatible"],
            },
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._calls.close(final=self._store.close())
        self._index.clear()
        if self._frames:
            self._frames.clear()

    # --- plumbing -------------------------------------------------------------------

    def _batch(self, operation: Callable[[Any], Awaitable[T]], arguments: Iterable[Any]) -> list[T | BaseException]:
        """Run ``operation`` on each argument concurrently (see :meth:`kvplug.RemoteCalls.batch`)."""
        try:
            return self._calls.batch(operation, arguments)
        except TierClosedError:
            raise TierClosedError(f"tier 's3' ({self._where}) was closed during the operation") from None

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counters[name] += amount

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError(f"tier 's3' ({self._where}) is closed")
