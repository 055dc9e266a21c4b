"""Pipelined batches against one Valkey/Redis server or cluster, as coroutines.

Every method runs on the tier's event loop (:class:`kvplug.RemoteCalls`) and sends
one pipeline: N keys cost one round trip (in cluster mode, one per node holding
some of them; valkey-py groups the commands by slot owner). The client is made on
first use, on that loop, with one connection pool; when ``cluster`` is unset the
first call asks the server (``INFO cluster``) which client it needs.

Per-key answers that are not failures of the server come back as values: a key
of another type (``WRONGTYPE``) reads as a foreign record, a store refused for
memory (``OOM``) as ``False``. Anything else (connection refused or reset,
timeout, authentication, cluster down) raises, and the tier's retry policy and
circuit breaker judge it.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from typing import Any

import valkey.asyncio as avalkey
from valkey import exceptions as vex
from valkey.asyncio.cluster import ValkeyCluster

from kvplug import Buffer, FailureKind, classify_failure
from kvplug_valkey.config import ValkeyTierConfig

#: SCAN page size: keys per round trip when listing.
SCAN_COUNT = 1000
#: A value that is not a string (another program's key under our prefix).
FOREIGN = b""

Client = Any  # valkey.asyncio.Valkey | ValkeyCluster: their stubs share no protocol


def classify(exc: BaseException) -> FailureKind:
    """Credentials and permissions are permanent (no retry fixes them); the rest transient."""
    if isinstance(exc, (vex.AuthenticationError, vex.AuthorizationError, vex.NoPermissionError)):
        return "permanent"
    if isinstance(exc, vex.AuthenticationWrongNumberOfArgsError):
        return "permanent"
    if isinstance(exc, vex.ResponseError):
        text = str(exc).upper()
        if text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
            return "permanent"
    if isinstance(exc, vex.ValkeyError):
        return "transient"
    return classify_failure(exc)


def _raise_server_errors(results: Sequence[Any]) -> None:
    """Raise the first failure of the server itself found among pipeline results."""
    for result in results:
        if isinstance(result, BaseException) and not _per_key(result):
            raise result


def _per_key(result: BaseException) -> bool:
    """Errors that answer for one key and say nothing about the server's health."""
    return isinstance(result, vex.OutOfMemoryError) or (
        isinstance(result, vex.ResponseError) and str(result).upper().startswith("WRONGTYPE")
    )


class ValkeyStore:
    """Batched GET/SET/STRLEN/EXISTS/DEL/SCAN under ``key_prefix``; see the module docstring."""

    def __init__(self, config: ValkeyTierConfig) -> None:
        self.config = config
        self.address = config.address
        self.prefix = config.key_prefix.encode()
        self.cluster: bool | None = config.cluster
        self._client: Client | None = None
        self._lock: asyncio.Lock | None = None
        self._ttl_ms = None if config.ttl_s is None else max(1, round(config.ttl_s * 1000))

    def name(self, digest: str) -> bytes:
        return self.prefix + digest.encode()

    # --- batches --------------------------------------------------------------------

    async def get_many(self, digests: Sequence[str]) -> list[bytes | None]:
        """Each stored value (``FOREIGN`` for a non-string key), ``None`` where missing."""
        results = await self._pipeline([("GET", self.name(d)) for d in digests])
        return [FOREIGN if isinstance(r, BaseException) else r for r in results]

    async def lengths(self, digests: Sequence[str]) -> list[int]:
        """Stored bytes per key (0: missing, -1: not a string)."""
        results = await self._pipeline([("STRLEN", self.name(d)) for d in digests])
        return [-1 if isinstance(r, BaseException) else int(r) for r in results]

    async def exist(self, digests: Sequence[str]) -> list[bool]:
        """Whether each key exists (of any type), without touching it.

        ``EXISTS`` leaves a key's LRU/LFU data as it was (every Valkey; Redis before
        6.0 and since 6.2: early 6.0 releases touched, redis/redis#8016, no worse than
        ``STRLEN``), where a read such as ``STRLEN`` makes it look freshly used to the
        server: the index's round of checks must not keep this process's cold keys
        alive in a server that other clients share. (``CLIENT NO-TOUCH`` would need
        Valkey/Redis 7.2 and an error path on older servers.)"""
        results = await self._pipeline([("EXISTS", self.name(d)) for d in digests])
        return [isinstance(r, BaseException) or int(r) > 0 for r in results]

    async def set_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Store each frame; ``False`` where the server refused it for memory (OOM)."""
        expiry: tuple[Any, ...] = () if self._ttl_ms is None else ("PX", self._ttl_ms)
        results = await self._pipeline([("SET", self.name(d), frame, *expiry) for d, frame in items])
        return [not isinstance(r, BaseException) for r in results]

    async def delete_many(self, digests: Sequence[str]) -> int:
        """Delete the keys; how many existed."""
        results = await self._pipeline([("DEL", self.name(d)) for d in digests])
        return sum(int(r) for r in results if not isinstance(r, BaseException))

    async def scan(self) -> list[tuple[str, int]]:
        """(digest, stored bytes) of every key under the prefix named by a digest (every node of a cluster)."""
        client = await self.client()
        names: list[bytes] = []
        async for name in client.scan_iter(match=self.prefix + b"*", count=SCAN_COUNT):
            digest = name[len(self.prefix) :]
            if len(digest) == 64 and all(c in b"0123456789abcdef" for c in digest):
                names.append(name)
        found: list[tuple[str, int]] = []
        for start in range(0, len(names), SCAN_COUNT):
            page = names[start : start + SCAN_COUNT]
            sizes = await self._pipeline([("STRLEN", name) for name in page])
            for name, size in zip(page, sizes):
                if not isinstance(size, BaseException) and int(size) > 0:
                    found.append((name[len(self.prefix) :].decode(), int(size)))
        return found

    async def ping(self) -> None:
        client = await self.client()
        await client.ping()

    # --- client ---------------------------------------------------------------------

    async def client(self) -> Client:
        """The client, made on first use (asking the server whether it is a cluster when unset)."""
        if self._client is not None:
            return self._client
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._client is not None:
                return self._client
            if self.cluster is None:
                probe = self._standalone()
                try:
                    info = await probe.info("cluster")
                finally:
                    await probe.aclose()
                self.cluster = bool(int(info.get("cluster_enabled", 0)))
            self._client = self._cluster() if self.cluster else self._standalone()
            return self._client

    def _common(self) -> dict[str, Any]:
        config = self.config
        options: dict[str, Any] = {
            "username": config.username,
            "password": None if config.password is None else config.password.get_secret_value(),
            "socket_timeout": config.request_timeout_s,
            "socket_connect_timeout": config.connect_timeout_s,
            "decode_responses": False,
            "client_name": "kvplug",
        }
        if self.address.tls:
            options["ssl"] = True
            options["ssl_cert_reqs"] = "required"
            options["ssl_check_hostname"] = True
            if config.tls_ca_file is not None:
                options["ssl_ca_certs"] = config.tls_ca_file
            options["ssl_min_version"] = ssl.TLSVersion.TLSv1_2
        return options

    def _standalone(self) -> Client:
        if self.address.unix_path is not None:
            where: dict[str, Any] = {"unix_socket_path": self.address.unix_path}
        else:
            where = {"host": self.address.host, "port": self.address.port}
        # valkey-py's own retries stay off (its default): kvplug's policy retries within its deadline.
        return avalkey.Valkey(
            **where, db=self.address.db, max_connections=self.config.max_connections, **self._common()
        )

    def _cluster(self) -> Client:
        return ValkeyCluster(
            host=self.address.host,
            port=self.address.port,
            max_connections=self.config.max_connections,
            # Redirections after a resharding need a second try; connection errors are kvplug's to retry.
            cluster_error_retry_attempts=2,
            connection_error_retry_attempts=1,
            require_full_coverage=False,
            **self._common(),
        )

    async def _pipeline(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        if not commands:
            return []
        client = await self.client()
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        results = await pipe.execute(raise_on_error=False)
        _raise_server_errors(results)
        return list(results)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
