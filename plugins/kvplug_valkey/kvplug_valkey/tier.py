"""Tier ``valkey``: a Valkey or Redis server (or cluster) shared by many engines.

Each value is stored under ``key_prefix + sha256(key)`` as the same key-bound,
checksummed record as the disk and s3 tiers (:func:`kvplug.pack_record_header` and
the value); every read is verified by :func:`kvplug.unpack_record`, so a torn,
swapped or damaged value is a miss, counted, and deleted. Batches are pipelined
(``pipeline_keys`` keys per request, several requests at once) on the tier's own
event loop under core's :class:`kvplug.RemoteCalls`: a deadline per attempt,
bounded retries, a circuit breaker. A server that is down, hung or refusing costs
one failed batch, then lookups miss and stores are dropped at no cost until it
answers again. The server's ``maxmemory`` and LRU policy are the shared budget;
an OOM refusal is a dropped store, counted. ``stats()`` items and bytes come from this
process's bounded index of its keys (:mod:`kvplug_valkey.index`): an estimate, since
the server evicts without telling its clients.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from kvplug import (
    RECORD_HEADER_SIZE,
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
    TierUnavailableError,
    ValueTooLargeError,
)
from kvplug_valkey.client import ValkeyStore, classify
from kvplug_valkey.config import SCHEMES, ValkeyTierConfig
from kvplug_valkey.index import KeyIndex

T = TypeVar("T")
A = TypeVar("A")
#: Listing a large prefix legitimately takes longer than one batch.
LISTING_TIMEOUT_S = 300.0
#: Keys per pipeline for commands with small replies (STRLEN, EXISTS, DEL): a lookup is one round trip.
SMALL_REPLY_KEYS = 1024
_COUNTERS = ("hits", "misses", "puts", "evictions", "dropped_puts", "oom", "corrupt", "incompatible")


def key_name_digest(key: str) -> str:
    """The sha256 hex digest naming ``key`` in the server (never the key text itself)."""
    return key_digest(key).hex()


def _chunks(items: Sequence[A], size: int) -> list[Sequence[A]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class ValkeyTier(StorageTier):
    """A Valkey/Redis server or cluster as a storage tier; see the module docstring."""

    name = "valkey"
    medium = "remote"
    Config = ValkeyTierConfig

    def __init__(self, config: ValkeyTierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        self.config: ValkeyTierConfig = config
        self._where = config.address.display()
        self._calls = RemoteCalls(self.name, config, context, where=self._where, classify=classify)
        self._store = ValkeyStore(config)
        # With max_bytes, keys pushed out of a full index are deleted: forgotten, their
        # bytes would escape the budget (100k SGLang pages of 128 KiB: 12.8 GB unseen).
        self._index = KeyIndex(config.index_max_keys, evicts_when_full=config.max_bytes is not None)
        self._warned_full = False
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._closed = False

    @classmethod
    def location_config(cls, location: str, options: Mapping[str, Any]) -> ValkeyTierConfig | None:
        """``redis://``, ``rediss://``, ``valkey://``, ``valkeys://`` and ``unix://`` URLs open as this tier.

        ``?prefix=P`` in the location selects the key prefix (default ``kvplug:``); the
        password comes from ``REDISCLI_AUTH`` (as for valkey-cli and redis-cli; never the
        command line, where ``ps`` shows it). ``options`` may set ``password``,
        ``username``, ``key_prefix`` and ``cluster``."""
        if "://" not in location or location.split("://", 1)[0].lower() not in SCHEMES:
            return None
        allowed = {"password", "username", "key_prefix", "cluster"}
        given = {name: value for name, value in options.items() if value is not None}
        unknown = sorted(set(given) - allowed)
        if unknown:
            raise ValueError(
                f"option(s) {', '.join(unknown)} do not apply to a valkey store; it takes {sorted(allowed)}"
            )
        parts = urlsplit(location)
        query = parse_qs(parts.query, keep_blank_values=True)
        if "prefix" in query:
            given.setdefault("key_prefix", query.pop("prefix")[-1])
            location = urlunsplit(parts._replace(query=urlencode(query, doseq=True)))
        if "password" not in given and os.environ.get("REDISCLI_AUTH"):
            given["password"] = os.environ["REDISCLI_AUTH"]
        # Inspection must survive slow listings of a big prefix; nothing is ever evicted (no max_bytes).
        return ValkeyTierConfig(url=location, request_timeout_s=30.0, **given)

    # --- reads ----------------------------------------------------------------------

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """One pipelined STRLEN for the batch (one round trip): a present key holds at least a record header."""
        self._check_open()
        if not keys:
            return []
        if not self._calls.allow(len(keys)):
            return [False] * len(keys)
        digests = [key_name_digest(key) for key in keys]
        seen = dict(zip(digests, self._index.snapshot(digests)))
        answers: list[bool] = []
        for group, result in self._groups(self._store.lengths, digests, SMALL_REPLY_KEYS):
            if isinstance(result, BaseException):
                answers.extend([False] * len(group))
                continue
            for digest, length in zip(group, result):
                if length == 0:  # evicted, expired or deleted by another process
                    self._index.forget_gone(digest, seen[digest])
                answers.append(length >= RECORD_HEADER_SIZE)
        return answers

    def get(self, keys: Sequence[str]) -> list[Buffer | None]:
        self._check_open()
        if not keys:
            return []
        if not self._calls.allow(len(keys)):
            self._count("misses", len(keys))
            return [None] * len(keys)
        digests = [key_name_digest(key) for key in keys]
        seen = self._index.snapshot(digests)
        stored: list[bytes | None] = []
        for group, result in self._groups(self._store.get_many, digests):
            stored.extend([None] * len(group) if isinstance(result, BaseException) else result)
        values: list[Buffer | None] = []
        corrupt: list[str] = []
        pushed: list[tuple[str, str | None]] = []
        for key, digest, data, entry in zip(keys, digests, stored, seen):
            value = None
            if data is None:  # evicted, expired or deleted by another process
                self._index.forget_gone(digest, entry)
            else:
                try:
                    # A key of another type reads as b"" (FOREIGN): too short, corrupt.
                    value = unpack_record(data, key)
                except IncompatibleChunkError:
                    # Possibly a newer kvplug's record in a shared server: skip it, keep it.
                    self._count("incompatible")
                except CorruptChunkError as exc:
                    self.context.logger.warning("tier valkey: corrupt value for %s (%s); deleting it", key, exc)
                    self._count("corrupt")
                    corrupt.append(digest)
            if value is None:
                self._count("misses")
            else:
                self._count("hits")
                pushed += self._index.record(digest, value.nbytes, key)
            values.append(value)
        if corrupt:
            self._delete_quietly(corrupt)
        self._pushed_out(pushed)
        return values

    # --- writes ---------------------------------------------------------------------

    def put(self, items: Sequence[tuple[str, Buffer]]) -> None:
        self._check_open()
        latest = dict(items)  # the same key twice in a batch: the last value wins
        budget = None if self.config.max_bytes is None else int(self.config.max_bytes)
        for key, value in latest.items():
            size = memoryview(value).nbytes
            if budget is not None and size > budget:
                raise ValueTooLargeError(
                    f"value of {size} bytes for {key} exceeds the valkey tier's max_bytes {budget}"
                )
        if not latest:
            return
        if not self._calls.allow(len(latest)):
            self._count("dropped_puts", len(latest))
            return
        keys = list(latest)
        framed: list[tuple[str, Buffer]] = []
        for key in keys:
            value = latest[key]
            # One buffer per SET: the value is copied once, behind its record header.
            framed.append((key_name_digest(key), b"".join((pack_record_header(key, value), value))))
        groups = self._put_groups(framed)
        results = self._calls.batch(self._store.set_many, groups)
        failed = False
        pushed: list[tuple[str, str | None]] = []
        for group, result in zip(groups, results):
            if isinstance(result, BaseException):
                failed = True
                self._count("dropped_puts", len(group))
                self._calls.warn_dropped(result)
                continue
            for (digest, frame), stored in zip(group, result):
                if stored:
                    self._count("puts")
                    pushed += self._index.record(digest, len(frame) - RECORD_HEADER_SIZE, None)
                else:
                    self._count("oom")
                    self._count("dropped_puts")
                    self._calls.warn_dropped(MemoryError("the server is out of memory (maxmemory, noeviction)"))
        if budget is not None:
            self._evict(pushed + self._index.evict_over(budget))
        else:
            self._pushed_out(pushed)
        # After a failed group the server is likely down or hung: a check would pay the
        # put's worst case again before the breaker opens.
        if not failed:
            self._check_indexed()

    def remove(self, keys: Sequence[str]) -> None:
        self._check_open()
        if not keys:
            return
        if not self._calls.allow(len(keys)):
            raise TierUnavailableError(
                f"tier valkey: {self._where} is unavailable (circuit breaker open); nothing removed"
            )
        digests = [key_name_digest(key) for key in keys]
        removed, failed = [], 0
        key_of = dict(zip(digests, keys))
        for group, result in self._groups(self._store.delete_many, digests, SMALL_REPLY_KEYS):
            if isinstance(result, BaseException):
                failed += len(group)
                continue
            for digest in group:
                if self._index.forget(digest) is not False:
                    removed.append(key_of[digest])
        if removed:
            self.context.emit(KVEvent("removed", tuple(removed), tier=self.name))
        if failed:
            raise TierUnavailableError(f"tier valkey: {failed} of {len(keys)} removals from {self._where} failed")

    def _pushed_out(self, pushed: list[tuple[str, str | None]]) -> None:
        """Entries a full index pushed out: evicted with ``max_bytes``, else forgotten (warned once)."""
        if not pushed:
            return
        if self._index.evicts_when_full:
            self._evict(pushed)
        elif not self._warned_full:
            self._warned_full = True
            self.context.logger.warning(
                "tier valkey: the index of this process's keys is full (index_max_keys=%d): the least "
                "recently used are forgotten, not deleted, and stay in %s until its own policy evicts them "
                "(counted as index_dropped_full)",
                self._index.max_keys,
                self._where,
            )

    def _evict(self, victims: list[tuple[str, str | None]]) -> None:
        """Delete entries already removed from the index, counted and reported as evictions."""
        if not victims:
            return
        self._count("evictions", len(victims))
        self._delete_quietly([digest for digest, _ in victims], forget=False)
        known = tuple(key for _, key in victims if key is not None)
        if known:
            self.context.emit(KVEvent("evicted", known, tier=self.name))

    def _check_indexed(self) -> None:
        """Drop the indexed keys the server no longer holds, among the next ones of the
        index's round (one pipelined EXISTS, which does not refresh the keys' LRU/LFU
        data as STRLEN would; see :mod:`kvplug_valkey.index`)."""
        # Bookkeeping only: never the breaker's half-open probe, never counted as
        # short-circuited; and the round moves on only for keys really checked.
        if self._calls.breaker.state != "closed":
            return
        due = self._index.due_checks()
        if not due:
            return
        for group, result in self._groups(self._store.exist, list(due), SMALL_REPLY_KEYS):
            if isinstance(result, BaseException):
                continue
            for digest, exists in zip(group, result):
                if not exists:
                    self._index.forget_gone(digest, due[digest])

    def _delete_quietly(self, digests: list[str], *, forget: bool = True) -> None:
        if forget:
            for digest in digests:
                self._index.forget(digest)
        if self._calls.allow(len(digests)):
            self._groups(self._store.delete_many, digests, SMALL_REPLY_KEYS)

    # --- maintenance (kvplug.RecordStore, for `kvplug store`) -----------------------

    def records(self) -> Iterator[StoredRecord]:
        """Every record under the prefix (SCAN; every primary of a cluster)."""
        self._check_open()
        found = self._calls.run(self._store.scan, timeout_s=LISTING_TIMEOUT_S)
        return iter([StoredRecord(digest, size, None) for digest, size in found])

    def read_record(self, digest: str) -> Buffer | None:
        """The stored bytes (record frame and value), unverified; ``None`` if gone."""
        self._check_open()
        (data,) = self._calls.run(lambda: self._store.get_many([digest]))
        return data

    def delete_record(self, digest: str) -> bool:
        self._check_open()
        self._index.forget(digest)
        return self._calls.run(lambda: self._store.delete_many([digest])) > 0

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
                "cluster": "unknown" if self._store.cluster is None else str(self._store.cluster).lower(),
                "max_bytes": -1 if self.config.max_bytes is None else int(self.config.max_bytes),
                # items and bytes_used: this process's index, not a count by the server.
                "items_are": "estimate",
                "index_max_keys": self._index.max_keys,
                "index_dropped_full": self._index.dropped_full,
                "index_found_gone": self._index.found_gone,
                "breaker_state": self._calls.breaker.state,
                "breaker_opens": self._calls.breaker.opens,
                "dropped_puts": counters["dropped_puts"],
                "oom_dropped_puts": counters["oom"],
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

    # --- plumbing -------------------------------------------------------------------

    def _groups(
        self, operation: Callable[[Sequence[str]], Awaitable[T]], digests: Sequence[str], size: int | None = None
    ) -> list[tuple[Sequence[str], T | BaseException]]:
        """Run ``operation`` on groups of ``size`` (default ``pipeline_keys``) concurrently; (group, result or exception)."""
        groups = _chunks(digests, size or self.config.pipeline_keys)
        try:
            results = self._calls.batch(operation, groups)
        except TierClosedError:
            raise TierClosedError(f"tier 'valkey' ({self._where}) was closed during the operation") from None
        return list(zip(groups, results))

    def _put_groups(self, framed: Sequence[tuple[str, Buffer]]) -> list[Sequence[tuple[str, Buffer]]]:
        """Groups of at most ``pipeline_keys`` values and ``pipeline_bytes`` bytes (at least one value each)."""
        limit = int(self.config.pipeline_bytes)
        groups: list[Sequence[tuple[str, Buffer]]] = []
        current: list[tuple[str, Buffer]] = []
        size = 0
        for item in framed:
            length = len(item[1])
            if current and (len(current) >= self.config.pipeline_keys or size + length > limit):
                groups.append(current)
                current, size = [], 0
            current.append(item)
            size += length
        if current:
            groups.append(current)
        return groups

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counters[name] += amount

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError(f"tier 'valkey' ({self._where}) is closed")
