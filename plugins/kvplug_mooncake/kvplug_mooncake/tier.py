"""Tier ``mooncake``: values as objects in a Mooncake Store cluster.

Each object is a kvplug record (header with the key's digest and checksums, then
the value) named ``key_prefix + sha256(key)``; :class:`kvplug.RecordTier` frames,
verifies, indexes and counts them. The backend here speaks the store: a batch is one
client call, values are framed straight into a registered transfer buffer and
written with ``batch_upsert_from``; reads land in it through ``batch_get_into``.

Mooncake's client calls are blocking C++ calls. They run in a small thread pool,
awaited on the tier's loop, so every call keeps its deadline, retries and circuit
breaker: a hung master costs one deadline, after which lookups miss and stores are
dropped at no cost until a probe finds the store back. A call abandoned at its
deadline keeps its buffer range until the client returns.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

from kvplug import SIZE_UNKNOWN, Buffer, CallSizes, RecordBackend, RecordTier, RecordToWrite
from kvplug.errors import CorruptChunkError, TierClosedError
from kvplug_mooncake.buffers import TransferBuffers
from kvplug_mooncake.config import MooncakeTierConfig

T = TypeVar("T")

# Mooncake's error codes (mooncake-store/include/types.h).
NO_SPACE = -200  # NO_AVAILABLE_HANDLE: the segments are full
INVALID_PARAMS = -600  # also: the buffer given to get_into is too small
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706  # being read by a client; a plain remove is refused
#: Codes that say a key has no object: gone (any other code is no answer for the key).
GONE_CODES = frozenset({0, OBJECT_NOT_FOUND})
#: Codes that say the store is not answering (as opposed to answering about a key).
UNAVAILABLE_CODES = frozenset({-1, -101, -103, -703, -800, -900, -1010, -1011})
#: A batch is one client call whatever its size (the client pipelines it itself).
ONE_CALL = 1 << 30


def _library_timeouts(config: MooncakeTierConfig) -> None:
    """Bound the client library's own RPC timeouts and setup retries by this tier's
    deadline (its defaults are 30 s and many retries, with the GIL held in setup).
    Process-wide, read when the first client starts; values already set win."""
    timeout_ms = max(int(config.request_timeout_s * 1000), 100)
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(timeout_ms))
    os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", str(min(timeout_ms, 1000)))
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")


def _endpoints(config: MooncakeTierConfig) -> list[tuple[str, str, int]]:
    """The TCP endpoints setup needs, each with its option: the master, and an HTTP or etcd
    metadata server (named in the error: the master's address alone would blame the master)."""
    host, _, port = config.master.rpartition(":")
    found = [("master", host.strip("[]"), int(port))]
    if config.metadata_server != "P2PHANDSHAKE":
        parts = urlsplit(
            config.metadata_server if "://" in config.metadata_server else f"etcd://{config.metadata_server}"
        )
        if parts.hostname:
            found.append(("metadata_server", parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)))
    return found


def _probe(option: str, host: str, port: int, timeout_s: float) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise MooncakeCallError(f"connecting to the {option} {host}:{port} ({exc})", -900) from None


class MooncakeCallError(Exception):
    """A client call failed as a whole (the store did not answer), or one record was
    refused (``code`` says why: -200, the store is full); transient."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed with mooncake code {code}")
        self.code = code


def _failed_key(what: str, name: str, code: int) -> MooncakeCallError:
    """The store answered for the other keys but failed on this one: no answer for it."""
    return MooncakeCallError(f"{what} of {name}", code)


def _raise_if_unavailable(what: str, codes: Sequence[int]) -> None:
    """Fail the batch when every key failed because the store did not answer."""
    if codes and all(code in UNAVAILABLE_CODES or code < -1000 for code in codes):
        raise MooncakeCallError(what, codes[0])


class MooncakeBackend(RecordBackend):
    """Speaks a Mooncake Store cluster through ``MooncakeDistributedStore``."""

    call_sizes = CallSizes(query=ONE_CALL, read=ONE_CALL, write=ONE_CALL, write_bytes=1 << 62)

    def __init__(self, config: MooncakeTierConfig, record_bound: Callable[[], int | None] = lambda: None) -> None:
        self.config = config
        #: The tier's ``max_record_bytes``, read at each read (the engine may raise it).
        self._record_bound = record_bound
        self.where = f"mooncake master {config.master}"
        self.open_timeout_s = config.setup_timeout_s
        _library_timeouts(config)
        self._endpoints = _endpoints(config)
        self._pool = ThreadPoolExecutor(config.transfer_threads, thread_name_prefix="kvplug-mooncake")
        self._setup_lock = threading.Lock()
        self._lock = threading.Lock()
        self._store: Any = None
        self._buffers: TransferBuffers | None = None
        self._record_hint = 0  # the largest record seen: the read size for records of unknown size
        self._no_space = 0
        self._leased = 0
        self._failed = {"failed_lookups": 0, "failed_removes": 0}  # keys the store failed on alone
        self._closed = False

    # --- the client ----------------------------------------------------------------

    def _connected(self) -> tuple[Any, TransferBuffers]:
        """The set-up client and its buffers (in a pool thread); sets one up when there is none."""
        with self._setup_lock:
            if self._store is not None and self._buffers is not None:
                return self._store, self._buffers
            config = self.config
            # setup() holds the GIL while it retries: it would freeze every thread of the
            # engine past any deadline. A store that refuses connections fails here instead.
            for option, host, port in self._endpoints:
                _probe(option, host, port, min(config.request_timeout_s, 1.0))
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
                raise MooncakeCallError(f"setup with {self.where} (metadata_server {config.metadata_server})", code)
            buffers = TransferBuffers(int(config.transfer_buffer_size), store.register_buffer, store.unregister_buffer)
            self._store, self._buffers = store, buffers
            return store, buffers

    async def _blocking(self, function: Callable[[], T]) -> T:
        if self._closed:
            raise TierClosedError(f"{self.where}: the client is closed")
        return await asyncio.get_running_loop().run_in_executor(self._pool, function)

    def _full(self, names: Sequence[str]) -> list[str]:
        return [self.config.key_prefix + name for name in names]

    async def open(self) -> None:
        await self._blocking(self._connected)

    # --- the primitives -------------------------------------------------------------

    async def sizes(self, names: Sequence[str]) -> list[int | None | BaseException]:
        full = self._full(names)

        def exist() -> list[int]:
            unique = list(dict.fromkeys(full))  # one question per object (see _read)
            answers = dict(zip(unique, self._connected()[0].batch_is_exist(unique)))
            codes = [int(answers[name]) for name in full]
            _raise_if_unavailable("batch_is_exist", codes)
            return codes

        sizes: list[int | None | BaseException] = []
        for name, code in zip(full, await self._blocking(exist)):
            if code == 1:
                sizes.append(SIZE_UNKNOWN)
            elif code in GONE_CODES:
                sizes.append(None)
            else:
                sizes.append(self._key_failed("failed_lookups", _failed_key("batch_is_exist", name, code)))
        return sizes

    async def read(self, names: Sequence[str], sizes: Sequence[int | None]) -> list[Buffer | None | BaseException]:
        full = self._full(names)
        # The client mixes up the buffers of an object named twice in one batch: read each once.
        hints = dict(zip(full, sizes))
        unique = list(hints)
        found = dict(zip(unique, await self._blocking(lambda: self._read(unique, [hints[n] for n in unique]))))
        return [found[name] for name in full]

    def _read(self, names: list[str], known: list[int | None]) -> list[Buffer | None | BaseException]:
        """Each object's bytes, ``None`` where there is none, an exception where the
        store failed on it alone (in a pool thread)."""
        store, buffers = self._connected()
        with self._lock:
            hint = self._record_hint
        sizes = [hint if size is None else size for size in known]
        results: list[Buffer | int | BaseException] = [INVALID_PARAMS] * len(names)
        guessed = [i for i, size in enumerate(sizes) if size > 0]
        if guessed:
            self._read_into(store, buffers, [names[i] for i in guessed], [sizes[i] for i in guessed], guessed, results)
        # Objects of unknown size, or larger than guessed: ask their size, then read them.
        # One larger than any record of the engine is corrupt unread: anyone who can write
        # the store could otherwise make this read, and (as the size hint) every later read
        # of a record of unknown size, lease that much registered memory.
        bound = self._record_bound()
        exact: list[int] = []
        for i in [i for i, r in enumerate(results) if isinstance(r, int) and r == INVALID_PARAMS]:
            size = int(store.get_size(names[i]))
            if size < 0:
                results[i] = size
            elif bound is not None and size > bound:
                results[i] = CorruptChunkError(
                    f"record is {size} bytes, over the {bound} bytes a record of this store can be"
                )
            else:
                exact.append(i)
                sizes[i] = size
        if exact:
            self._read_into(store, buffers, [names[i] for i in exact], [sizes[i] for i in exact], exact, results)
        codes = [r for r in results if isinstance(r, int)]
        if len(codes) == len(results):
            _raise_if_unavailable("batch_get_into", codes)
        found: list[Buffer | None | BaseException] = []
        for name, result in zip(names, results):
            if not isinstance(result, int):
                found.append(result)
            elif result == OBJECT_NOT_FOUND:
                found.append(None)
            else:  # a miss that says nothing about whether the record is there
                found.append(self._key_failed("failed_lookups", _failed_key("batch_get_into", name, result)))
        return found

    def _read_into(
        self,
        store: Any,
        buffers: TransferBuffers,
        names: list[str],
        sizes: list[int],
        positions: list[int],
        results: list[Buffer | int | BaseException],
    ) -> None:
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
                    continue
                self._saw(code)
                # Copied out when not handed out: the range is reused once this call returns.
                results[position] = views[i] if views is not None else bytes(lease.view[offset : offset + code])

    async def write(self, records: Sequence[RecordToWrite]) -> list[BaseException | None]:
        names = self._full([record.name for record in records])

        def write() -> list[int]:
            store, buffers = self._connected()
            offsets, total = [], 0
            for record in records:
                offsets.append(total)
                total += -(-record.size // 64) * 64
            # Header and value framed straight into registered memory: the value's one copy.
            with buffers.lease(total) as lease:
                for record, offset in zip(records, offsets):
                    start = offset + len(record.header)
                    lease.view[offset:start] = record.header
                    lease.view[start : start + record.value.nbytes] = record.value
                sizes = [record.size for record in records]
                codes = [int(c) for c in store.batch_upsert_from(names, [lease.address + o for o in offsets], sizes)]
            _raise_if_unavailable("batch_upsert_from", codes)
            return codes

        outcomes: list[BaseException | None] = []
        for name, record, code in zip(names, records, await self._blocking(write)):
            if code == 0:
                self._saw(record.size)
                outcomes.append(None)
                continue
            if code == NO_SPACE:
                with self._lock:
                    self._no_space += 1
            outcomes.append(MooncakeCallError(f"put of {name}", code))
        return outcomes

    async def delete(self, names: Sequence[str]) -> list[bool | BaseException]:
        full = self._full(names)
        unique = list(dict.fromkeys(full))  # see read
        done: dict[str, bool | BaseException] = {}
        for name, code in zip(unique, await self._blocking(lambda: self._delete(unique))):
            if code in GONE_CODES:
                done[name] = code == 0
            else:  # removed or not, the store did not say: the tier keeps the record indexed
                done[name] = self._key_failed("failed_removes", _failed_key("batch_remove", name, code))
        return [done[name] for name in full]

    def _delete(self, names: list[str]) -> list[int]:
        """Remove objects (in a pool thread). A plain remove is refused while a reader
        holds a lease (-706); a record being removed is meant to go, and a reader racing
        the removal gets a record that fails verification: a miss."""
        store = self._connected()[0]
        codes = [int(code) for code in store.batch_remove(names, False)]
        leased = [i for i, code in enumerate(codes) if code == OBJECT_HAS_LEASE]
        if leased:
            with self._lock:
                self._leased += len(leased)
            for i, code in zip(leased, store.batch_remove([names[i] for i in leased], True)):
                codes[i] = int(code)
        _raise_if_unavailable("batch_remove", codes)
        return codes

    def _key_failed(self, counter: str, exc: MooncakeCallError) -> MooncakeCallError:
        with self._lock:
            self._failed[counter] += 1
        return exc

    def _saw(self, record_size: int) -> None:
        with self._lock:
            self._record_hint = max(self._record_hint, record_size)

    # --- counters and shutdown ------------------------------------------------------

    def errors(self) -> int:
        with self._lock:
            return sum(self._failed.values())

    def describe(self) -> dict[str, int | float | str]:
        buffers = self._buffers
        with self._lock:
            return {
                "master": self.config.master,
                "dropped_no_space": self._no_space,
                "leased_removes": self._leased,
                **self._failed,
                "temporary_buffers": 0 if buffers is None else buffers.temporary,
            }

    async def close(self) -> None:
        self._closed = True

        def shut_down() -> None:
            # A call abandoned at its deadline may still run in a pool thread (a hung or
            # killed master): closing the client under it crashes the process (SIGSEGV in
            # the client), so the client is closed only once every pool call has returned.
            self._pool.shutdown(wait=True, cancel_futures=True)
            with self._setup_lock:
                store, self._store = self._store, None
                buffers, self._buffers = self._buffers, None
            if store is not None:
                _close_client(store, buffers)

        # The client's close talks to the master; a hung master must not hang close
        # (nor, at exit, the interpreter: a daemon thread, not an executor's).
        closer = threading.Thread(target=shut_down, name="kvplug-mooncake-close", daemon=True)
        closer.start()
        deadline = time.monotonic() + self.config.request_timeout_s
        while closer.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)


def _close_client(store: Any, buffers: TransferBuffers | None) -> None:
    try:
        if buffers is not None:
            buffers.close()
        store.close()
    except Exception:
        pass


class MooncakeTier(RecordTier):
    """A Mooncake Store cluster as a storage tier; see the module docstring."""

    name = "mooncake"
    medium = "remote"
    Config = MooncakeTierConfig

    def open_backend(self, loop: asyncio.AbstractEventLoop) -> MooncakeBackend:
        assert isinstance(self.config, MooncakeTierConfig)
        return MooncakeBackend(self.config, record_bound=lambda: self.context.max_record_bytes)
