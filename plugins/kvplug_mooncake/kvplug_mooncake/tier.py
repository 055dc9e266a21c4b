"""Tier ``mooncake``: values as objects in a Mooncake Store cluster.

Each object is a kvplug record (header with the key's digest and checksums, then
the value) named ``key_prefix + sha256(key)``. Batches are one client call each:
values are framed straight into a registered transfer buffer and written with
``batch_upsert_from``; reads land in it through ``batch_get_into`` and are verified
(a torn, foreign or bit-flipped object is a miss, counted, and removed).

Mooncake's client calls are blocking C++ calls. They run in a small thread pool,
awaited on core's :class:`kvplug.RemoteCalls` loop, so every call keeps its deadline,
retries and circuit breaker: a hung master costs one deadline, after which lookups
miss and stores are dropped at no cost until a probe finds the store back. A call
abandoned at its deadline keeps its buffer range until the client returns.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

from kvplug import (
    RECORD_HEADER_SIZE,
    Absent,
    Buffer,
    KVEvent,
    RemoteCalls,
    StorageTier,
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
from kvplug_mooncake.buffers import TransferBuffers
from kvplug_mooncake.config import MooncakeTierConfig

T = TypeVar("T")

# Mooncake's error codes (mooncake-store/include/types.h).
NO_SPACE = -200  # NO_AVAILABLE_HANDLE: the segments are full
INVALID_PARAMS = -600  # also: the buffer given to get_into is too small
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706  # being read by a client; a plain remove is refused
#: Codes that say the store is not answering (as opposed to answering about a key).
UNAVAILABLE_CODES = frozenset({-1, -101, -103, -703, -800, -900, -1010, -1011})
_COUNTERS = ("hits", "misses", "puts", "evictions", "dropped_puts", "no_space", "corrupt", "incompatible", "leased")


def _library_timeouts(config: MooncakeTierConfig) -> None:
    """Bound the client library's own RPC timeouts and setup retries by this tier's
    deadline (its defaults are 30 s and many retries, with the GIL held in setup).
    Process-wide, read when the first client starts; values already set win."""
    timeout_ms = max(int(config.request_timeout_s * 1000), 100)
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(timeout_ms))
    os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", str(min(timeout_ms, 1000)))
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")


def _endpoints(config: MooncakeTierConfig) -> list[tuple[str, int]]:
    """The TCP endpoints setup needs: the master, and an HTTP or etcd metadata server."""
    host, _, port = config.master.rpartition(":")
    found = [(host.strip("[]"), int(port))]
    if config.metadata_server != "P2PHANDSHAKE":
        parts = urlsplit(
            config.metadata_server if "://" in config.metadata_server else f"etcd://{config.metadata_server}"
        )
        if parts.hostname:
            found.append((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)))
    return found


def _probe(host: str, port: int, timeout_s: float) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise MooncakeCallError(f"connecting to {host}:{port} ({exc})", -900) from None


class MooncakeCallError(Exception):
    """A client call failed as a whole (the store did not answer); transient."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed with mooncake code {code}")
        self.code = code


def _all_unavailable(codes: Sequence[int]) -> int | None:
    """The code when every key failed because the store did not answer."""
    if codes and all(code in UNAVAILABLE_CODES or code < -1000 for code in codes):
        return codes[0]
    return None


class MooncakeTier(StorageTier):
    """A Mooncake Store cluster as a storage tier; see the module docstring."""

    name = "mooncake"
    medium = "remote"
    Config = MooncakeTierConfig

    def __init__(self, config: MooncakeTierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        self.config: MooncakeTierConfig = config
        self._where = f"mooncake master {config.master}"
        _library_timeouts(config)
        self._endpoints = _endpoints(config)
        self._calls = RemoteCalls(self.name, config, context, where=self._where)
        self._pool = ThreadPoolExecutor(config.transfer_threads, thread_name_prefix="kvplug-mooncake")
        self._setup_lock = threading.Lock()
        self._store: Any = None
        self._buffers: TransferBuffers | None = None
        self._lock = threading.Lock()
        self._index: OrderedDict[str, tuple[int, str]] = OrderedDict()  # object name -> (value bytes, key)
        self._bytes = 0
        self._record_hint = 0  # the largest record seen: the read size for keys of unknown size
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._closed = False
        try:  # connect now so the first lookup is fast; a store that is down is retried later
            self._calls.run(lambda: self._blocking(self._connected), timeout_s=config.setup_timeout_s)
        except (TierUnavailableError, Absent) as exc:
            context.logger.warning("tier mooncake: cannot connect to %s yet (%s); will retry", self._where, exc)

    # --- the client ----------------------------------------------------------------

    def _connected(self) -> Any:
        """The set-up client (in a pool thread); sets one up when there is none."""
        with self._setup_lock:
            if self._store is not None:
                return self._store
            config = self.config
            # setup() holds the GIL while it retries: it would freeze every thread of the
            # engine past any deadline. A store that refuses connections fails here instead.
            for host, port in self._endpoints:
                _probe(host, port, min(config.request_timeout_s, 1.0))
            from mooncake.store import MooncakeDistributedStore  # the C++ extension loads on first use

            store = MooncakeDistributedStore()
            code = store.setup(
                config.local_hostname,
                config.metadata_server,
                int(config.global_segment_size),
                int(config.local_buffer_size),
                config.protocol,
                config.rdma_devices,
                config.master,
            )
            if code != 0:
                raise MooncakeCallError(f"setup with {self._where}", code)
            self._buffers = TransferBuffers(
                int(config.transfer_buffer_size), store.register_buffer, store.unregister_buffer
            )
            self._store = store
            return store

    async def _blocking(self, function: Callable[[], T]) -> T:
        if self._closed:
            raise TierClosedError("tier 'mooncake' is closed")
        return await asyncio.get_running_loop().run_in_executor(self._pool, function)

    def _run(self, function: Callable[[], T]) -> T:
        try:
            return self._calls.run(lambda: self._blocking(function))
        except TierClosedError:
            raise TierClosedError(f"tier 'mooncake' ({self._where}) was closed during the operation") from None

    def _names(self, keys: Sequence[str]) -> list[str]:
        return [self.config.key_prefix + key_digest(key).hex() for key in keys]

    # --- reads ----------------------------------------------------------------------

    def contains(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        if not keys:
            return []
        if not self._calls.allow(len(keys)):
            return [False] * len(keys)
        names = self._names(keys)

        def exists() -> list[int]:
            unique = list(dict.fromkeys(names))  # one question per key (see _read)
            answers = dict(zip(unique, self._connected().batch_is_exist(unique)))
            codes = [int(answers[name]) for name in names]
            failed = _all_unavailable(codes)
            if failed is not None:
                raise MooncakeCallError("batch_is_exist", failed)
            return codes

        try:
            codes = self._run(exists)
        except TierUnavailableError:
            return [False] * len(keys)
        for name, code in zip(names, codes):
            if code == 0:
                self._forget(name)
        return [code == 1 for code in codes]

    def get(self, keys: Sequence[str]) -> list[Buffer | None]:
        self._check_open()
        if not keys:
            return []
        if not self._calls.allow(len(keys)):
            self._count("misses", len(keys))
            return [None] * len(keys)
        names = self._names(keys)
        try:
            results = self._run(lambda: self._read(names))
        except TierUnavailableError:
            self._count("misses", len(keys))
            return [None] * len(keys)
        values: list[Buffer | None] = []
        corrupt: list[str] = []
        for key, name, result in zip(keys, names, results):
            value = None
            if not isinstance(result, int):
                try:
                    value = unpack_record(result, key)
                except IncompatibleChunkError:
                    self._count("incompatible")  # possibly a newer kvplug's record: keep it for that one
                except CorruptChunkError as exc:
                    self.context.logger.warning("tier mooncake: corrupt object for %s (%s); removing it", key, exc)
                    self._count("corrupt")
                    corrupt.append(name)
            elif result == OBJECT_NOT_FOUND:
                self._forget(name)
            if value is None:
                self._count("misses")
            else:
                self._count("hits")
                self._record(name, value.nbytes, key)
            values.append(value)
        if corrupt:
            self._remove_quietly(corrupt)
        return values

    def _read(self, names: list[str]) -> list[Buffer | int]:
        """Each object's bytes, or its mooncake code (in a pool thread)."""
        # The client mixes up the buffers of a key named twice in one batch: read each once.
        unique = list(dict.fromkeys(names))
        if len(unique) < len(names):
            found = dict(zip(unique, self._read(unique)))
            return [found[name] for name in names]
        store = self._connected()
        assert self._buffers is not None
        with self._lock:
            hint = self._record_hint
            sizes = [self._index[name][0] + RECORD_HEADER_SIZE if name in self._index else hint for name in names]
        results: list[Buffer | int] = [INVALID_PARAMS] * len(names)
        guessed = [i for i, size in enumerate(sizes) if size > 0]
        if guessed:
            self._read_into(store, [names[i] for i in guessed], [sizes[i] for i in guessed], guessed, results)
        # Keys of unknown size, or larger than guessed: ask their size, then read them.
        retry = [i for i, r in enumerate(results) if r == INVALID_PARAMS]
        exact: list[int] = []
        for i in retry:
            size = int(store.get_size(names[i]))
            if size < 0:
                results[i] = size
            else:
                exact.append(i)
                sizes[i] = size
        if exact:
            self._read_into(store, [names[i] for i in exact], [sizes[i] for i in exact], exact, results)
        codes = [r for r in results if isinstance(r, int)]
        failed = _all_unavailable(codes) if len(codes) == len(results) else None
        if failed is not None:
            raise MooncakeCallError("batch_get_into", failed)
        return results

    def _read_into(
        self, store: Any, names: list[str], sizes: list[int], positions: list[int], results: list[Buffer | int]
    ) -> None:
        buffers = self._buffers
        assert buffers is not None
        offsets, slots, total = [], [], 0
        for size in sizes:
            offsets.append(total)
            slots.append(-(-max(size, 1) // 64) * 64)
            total += slots[-1]
        with buffers.lease(total) as lease:
            codes = [int(code) for code in store.batch_get_into(names, [lease.address + o for o in offsets], sizes)]
            # Zero copy: the values stay where they landed until the caller drops them.
            views = buffers.hand_out(lease, [(o, max(c, 0), s) for o, c, s in zip(offsets, codes, slots)])
            for i, (position, offset, code) in enumerate(zip(positions, offsets, codes)):
                if code < 0:
                    results[position] = code
                elif views is not None:
                    results[position] = views[i]
                else:  # copied out: the range is reused once this call returns
                    results[position] = bytes(lease.view[offset : offset + code])

    # --- writes ---------------------------------------------------------------------

    def put(self, items: Sequence[tuple[str, Buffer]]) -> None:
        self._check_open()
        latest = dict(items)  # the same key twice in a batch: the last value wins
        budget = None if self.config.max_bytes is None else int(self.config.max_bytes)
        for key, value in latest.items():
            size = memoryview(value).nbytes
            if budget is not None and size > budget:
                raise ValueTooLargeError(
                    f"value of {size} bytes for {key} exceeds the mooncake tier's max_bytes {budget}"
                )
        if not latest:
            return
        if not self._calls.allow(len(latest)):
            self._count("dropped_puts", len(latest))
            return
        keys = list(latest)
        names = self._names(keys)
        values = [
            memoryview(latest[key]).cast("B") if memoryview(latest[key]).nbytes else memoryview(b"") for key in keys
        ]

        def write() -> list[int]:
            store = self._connected()
            assert self._buffers is not None
            offsets, total = [], 0
            for value in values:
                offsets.append(total)
                total += -(-(RECORD_HEADER_SIZE + value.nbytes) // 64) * 64
            with self._buffers.lease(total) as lease:
                for key, value, offset in zip(keys, values, offsets):
                    lease.view[offset : offset + RECORD_HEADER_SIZE] = pack_record_header(key, value)
                    start = offset + RECORD_HEADER_SIZE
                    lease.view[start : start + value.nbytes] = value
                sizes = [RECORD_HEADER_SIZE + value.nbytes for value in values]
                codes = list(store.batch_upsert_from(names, [lease.address + o for o in offsets], sizes))
            failed = _all_unavailable(codes)
            if failed is not None:
                raise MooncakeCallError("batch_upsert_from", failed)
            return codes

        try:
            codes = self._run(write)
        except TierUnavailableError as exc:
            self._count("dropped_puts", len(keys))
            self._calls.warn_dropped(exc)
            return
        for key, name, value, code in zip(keys, names, values, codes):
            if code == 0:
                self._count("puts")
                self._record(name, value.nbytes, key)
                continue
            # Not stored: whatever was there before is stale or gone.
            self._forget(name)
            self._count("dropped_puts")
            if code == NO_SPACE:
                self._count("no_space")
            self._calls.warn_dropped(MooncakeCallError(f"put of {key}", code))
        if budget is not None:
            self._evict_over(budget)

    def remove(self, keys: Sequence[str]) -> None:
        self._check_open()
        if not keys:
            return
        if not self._calls.allow(len(keys)):
            raise TierUnavailableError(
                f"tier mooncake: {self._where} is unavailable (circuit breaker open); nothing removed"
            )
        names = self._names(keys)
        codes = self._run(lambda: self._delete(names))
        removed, failed = [], 0
        for key, name, code in zip(keys, names, codes):
            if code not in (0, OBJECT_NOT_FOUND):
                failed += 1
                continue
            if self._forget(name):
                removed.append(key)
        if removed:
            self.context.emit(KVEvent("removed", tuple(removed), tier=self.name))
        if failed:
            raise TierUnavailableError(f"tier mooncake: {failed} of {len(keys)} removals from {self._where} failed")

    def _delete(self, names: list[str]) -> list[int]:
        """Remove objects (in a pool thread). A plain remove is refused while a reader
        holds a lease (-706); a record being removed is meant to go, and a reader racing
        the removal gets a record that fails verification: a miss."""
        store = self._connected()
        unique = list(dict.fromkeys(names))
        if len(unique) < len(names):
            done = dict(zip(unique, self._delete(unique)))
            return [done[name] for name in names]
        codes = list(store.batch_remove(names, False))
        leased = [i for i, code in enumerate(codes) if code == OBJECT_HAS_LEASE]
        if leased:
            self._count("leased", len(leased))
            for i, code in zip(leased, store.batch_remove([names[i] for i in leased], True)):
                codes[i] = int(code)
        failed = _all_unavailable(codes)
        if failed is not None:
            raise MooncakeCallError("batch_remove", failed)
        return codes

    def _evict_over(self, budget: int) -> None:
        victims: list[tuple[str, str]] = []
        with self._lock:
            while self._bytes > budget and self._index:
                name, (size, key) = self._index.popitem(last=False)
                self._bytes -= size
                victims.append((name, key))
        if not victims:
            return
        self._count("evictions", len(victims))
        self._remove_quietly([name for name, _ in victims])
        self.context.emit(KVEvent("evicted", tuple(key for _, key in victims), tier=self.name))

    def _remove_quietly(self, names: list[str]) -> None:
        for name in names:
            self._forget(name)
        if self._calls.allow(len(names)):
            try:
                self._run(lambda: self._delete(names))
            except TierUnavailableError as exc:
                self.context.logger.debug("tier mooncake: removing %d objects failed: %s", len(names), exc)

    # --- bookkeeping ----------------------------------------------------------------

    def _record(self, name: str, size: int, key: str) -> None:
        with self._lock:
            old = self._index.pop(name, None)
            if old is not None:
                self._bytes -= old[0]
            self._index[name] = (size, key)
            self._bytes += size
            self._record_hint = max(self._record_hint, size + RECORD_HEADER_SIZE)

    def _forget(self, name: str) -> bool:
        with self._lock:
            old = self._index.pop(name, None)
            if old is None:
                return False
            self._bytes -= old[0]
            return True

    def flush(self) -> None:
        """Puts are synchronous: nothing is pending."""
        self._check_open()

    def stats(self) -> TierStats:
        with self._lock:
            counters = dict(self._counters)
            items, used = len(self._index), self._bytes
        buffers = self._buffers
        return TierStats(
            bytes_used=used,
            items=items,
            hits=counters["hits"],
            misses=counters["misses"],
            puts=counters["puts"],
            evictions=counters["evictions"],
            errors=self._calls.failed + counters["corrupt"],
            extra={
                "master": self.config.master,
                "max_bytes": -1 if self.config.max_bytes is None else int(self.config.max_bytes),
                "breaker_state": self._calls.breaker.state,
                "breaker_opens": self._calls.breaker.opens,
                "dropped_puts": counters["dropped_puts"],
                "dropped_no_space": counters["no_space"],
                "short_circuited": self._calls.short_circuited,
                "failures": self._calls.failed,
                "retries": self._calls.retried,
                "corrupt": counters["corrupt"],
                "incompatible": counters["incompatible"],
                "leased_removes": counters["leased"],
                "temporary_buffers": 0 if buffers is None else buffers.temporary,
            },
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._calls.close()
        store, self._store = self._store, None
        buffers, self._buffers = self._buffers, None

        def shut_down() -> None:
            # A call abandoned at its deadline may still run in a pool thread (a hung or
            # killed master): closing the client under it crashes the process (SIGSEGV in
            # the client), so the client is closed only once every pool call has returned.
            self._pool.shutdown(wait=True, cancel_futures=True)
            if store is not None:
                _close_client(store, buffers)

        # The client's close talks to the master; a hung master must not hang close.
        closer = threading.Thread(target=shut_down, name="kvplug-mooncake-close", daemon=True)
        closer.start()
        closer.join(self.config.request_timeout_s)
        with self._lock:
            self._index.clear()
            self._bytes = 0

    # --- plumbing -------------------------------------------------------------------

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counters[name] += amount

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError(f"tier 'mooncake' ({self._where}) is closed")


def _close_client(store: Any, buffers: TransferBuffers | None) -> None:
    try:
        if buffers is not None:
            buffers.close()
        store.close()
    except Exception:
        pass
