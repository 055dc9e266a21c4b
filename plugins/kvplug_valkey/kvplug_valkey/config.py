"""Options of tier ``valkey`` and the parsing of its URL.

The URL says where the server is (``redis://host:port/db``, ``rediss://`` for TLS,
``valkey://``/``valkeys://`` as synonyms, ``unix:///path/to.sock?db=N``); the
password never goes in it: it is a separate secret option, so no URL kvplug logs,
prints or puts in a metric label can leak it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated
from urllib.parse import parse_qs, unquote, urlsplit

from pydantic import (
    ByteSize,
    Field,
    PositiveInt,
    SecretStr,
    field_validator,
    model_validator,
)

from kvplug import BackoffSeconds, Bounded, Concurrency, RecordTierConfig, TimeoutSeconds

#: URL schemes the tier accepts, and whether they mean TLS.
SCHEMES = {"redis": False, "valkey": False, "rediss": True, "valkeys": True, "unix": False}
_PREFIX_CHARS = re.compile(r"[!-~]*")  # printable ASCII without spaces: safe in SCAN patterns and logs
_GLOB_CHARS = re.compile(r"[*?\[\]\\]")
DEFAULT_PORT = 6379


@dataclass(frozen=True)
class ServerAddress:
    """Where the server is, from the URL."""

    host: str | None
    port: int
    unix_path: str | None
    db: int
    tls: bool

    def display(self) -> str:
        """``redis://host:port/db`` or ``unix:///path?db=N``, for logs and stats."""
        if self.unix_path is not None:
            return f"unix://{self.unix_path}?db={self.db}"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"{'rediss' if self.tls else 'redis'}://{host}:{self.port}/{self.db}"


def parse_server_url(url: str) -> ServerAddress:
    """Parse a tier URL; ``ValueError`` naming what is wrong and what is allowed."""
    allowed = "redis://host:port/db, rediss://host:port/db (TLS), valkey://, valkeys://, unix:///path/to.sock?db=N"
    if "://" not in url:
        raise ValueError(f"url {url!r} has no scheme; use {allowed}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"url scheme {parts.scheme!r} is not supported; use {allowed}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("url must not carry credentials (user:password@); set the username and password options")
    if parts.fragment:
        raise ValueError(f"url {url!r} has a #fragment; remove it")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - {"db"})
    if unknown:
        raise ValueError(f"url query option(s) {', '.join(unknown)} are not supported; only ?db=N")
    db_text = query["db"][-1] if "db" in query else None
    if scheme == "unix":
        path = unquote(parts.path)
        if not path.startswith("/") or parts.netloc:
            raise ValueError(f"a unix url needs an absolute socket path: unix:///path/to.sock (got {url!r})")
        return ServerAddress(None, 0, path, _db_number(db_text or "0"), False)
    if not parts.hostname:
        raise ValueError(f"url {url!r} names no host; e.g. redis://127.0.0.1:6379/0")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise ValueError(f"url {url!r} has an invalid port; use 1-65535") from None
    path = parts.path.strip("/")
    if path and db_text is not None:
        raise ValueError(f"url {url!r} gives the database twice (path and ?db=)")
    return ServerAddress(parts.hostname, port, None, _db_number(path or db_text or "0"), SCHEMES[scheme])


def _db_number(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise ValueError(f"database {text!r} must be a number 0-65535 (redis://host:port/DB)")
    return int(text)


class ValkeyTierConfig(RecordTierConfig):
    """Options of tier ``valkey``: a Valkey or Redis server (or cluster) shared by engines.

    The server's ``maxmemory`` with an LRU policy (``allkeys-lru``) is the cache's real
    budget: the server evicts, and a store the server refuses for memory (OOM under
    ``noeviction``) is dropped and counted, never an error for the engine. ``max_bytes``
    additionally bounds what this process stored and read (its own LRU of keys).

    Every call has a deadline (``request_timeout_s`` per attempt, hundreds of
    milliseconds: a key-value store answers in well under that), at most ``retries``
    retries, and a circuit breaker: after ``breaker_failures`` consecutive failures,
    lookups miss and stores are dropped without a network call until a probe after
    ``breaker_cooldown_s`` finds the server back.
    """

    url: str = Field(
        description="redis://host:port/db, rediss://host:port/db (TLS), valkey://, valkeys://, "
        "or unix:///path/to.sock?db=N. No credentials here: see username/password."
    )
    username: str | None = Field(default=None, description="ACL user (Valkey/Redis 6+); default: the default user.")
    password: SecretStr | None = Field(default=None, description="AUTH password; never printed or logged.")
    key_prefix: str = Field(
        default="kvplug:",
        description="Prefix of every key this tier writes (keys are prefix + sha256 hex digest); "
        "`kvplug store` lists and cleans only keys under it.",
    )
    ttl_s: Annotated[float, Bounded(0, 366 * 86400, "seconds", exclusive_minimum=True, note="a year")] | None = Field(
        default=None, description="Expire stored values after this many seconds (SET PX); None: never."
    )
    cluster: bool | None = Field(
        default=None,
        description="true: Valkey/Redis Cluster; false: a standalone server; unset: ask the server (INFO cluster).",
    )
    connect_timeout_s: TimeoutSeconds = Field(default=0.25, description="Seconds to open a connection.")
    request_timeout_s: TimeoutSeconds = Field(
        default=0.5, description="Deadline of one attempt of one pipelined batch, transfer included."
    )
    backoff_base_s: BackoffSeconds = Field(default=0.01, description="First backoff; doubles per retry, full jitter.")
    backoff_max_s: BackoffSeconds = Field(default=0.1, description="Longest backoff between two attempts.")
    breaker_cooldown_s: TimeoutSeconds = Field(
        default=2.0, description="Seconds the breaker stays open before one probe may try the server."
    )
    pipeline_keys: Annotated[int, Bounded(1, 4096, "keys")] = Field(
        default=8, description="Keys per pipelined request; larger batches go as several pipelines at once."
    )
    pipeline_bytes: ByteSize = Field(
        # Measured: asyncio moves one huge write buffer with O(n) copies per partial send;
        # 8 MiB pipelines sent side by side cost a third of the client CPU of 32 MiB ones.
        default=ByteSize(8 * 1024**2),
        description="Bytes of values per pipelined store request (at least one value); several go at once.",
    )
    max_connections: Concurrency = Field(default=64, description="Connections per server in the client's pool.")
    tls_ca_file: str | None = Field(default=None, description="CA bundle to verify the server's TLS certificate.")
    index_max_keys: PositiveInt = Field(
        default=100_000,
        le=100_000_000,
        description="Most keys in this process's index of what it stored and read (about 300 bytes "
        "each), which gives stats() its estimate and max_bytes its LRU. Past it the least recently used "
        "are forgotten, not deleted (warned once): they stay in the server until its maxmemory policy "
        "evicts them. With max_bytes set they are deleted instead (evictions), so max_bytes always holds.",
    )

    @field_validator("url")
    @classmethod
    def _valid_url(cls, url: str) -> str:
        parse_server_url(url)
        return url

    @field_validator("key_prefix")
    @classmethod
    def _plain_prefix(cls, prefix: str) -> str:
        if len(prefix) > 200 or not _PREFIX_CHARS.fullmatch(prefix):
            raise ValueError("key_prefix must be at most 200 printable ASCII characters without spaces")
        if not prefix:
            # Every key of the database named like a digest would be the tier's: listed,
            # evicted under max_bytes, and removed by `kvplug store gc` when not a record.
            raise ValueError(
                "key_prefix must not be empty: the tier would take every key of the database named by a "
                "64-hex digest (another application's too) for its own, evict and gc it; e.g. kvplug:"
            )
        if _GLOB_CHARS.search(prefix):
            raise ValueError("key_prefix must not contain * ? [ ] or \\ (they are SCAN pattern characters)")
        return prefix

    @field_validator("username")
    @classmethod
    def _plain_username(cls, username: str | None) -> str | None:
        if username is not None and (not username or not _PREFIX_CHARS.fullmatch(username)):
            raise ValueError("username must be printable ASCII without spaces")
        return username

    @model_validator(mode="after")
    def _cluster_fits_the_url(self) -> ValkeyTierConfig:
        address = self.address
        if self.cluster and address.unix_path is not None:
            raise ValueError("cluster: true needs a host:port url (cluster nodes are not reached over unix sockets)")
        if self.cluster and address.db != 0:
            raise ValueError(f"a cluster has only database 0; the url selects database {address.db}")
        if self.tls_ca_file is not None and not address.tls:
            raise ValueError("tls_ca_file applies to rediss:// or valkeys:// urls only")
        if self.max_connections <= self.max_concurrency:
            # The client's pool refuses a call past its connections ("Too many
            # connections") rather than wait: with fewer connections than pipelines in
            # flight, a healthy server's batches failed and opened the breaker.
            raise ValueError(
                f"max_connections ({self.max_connections}) must be more than max_concurrency "
                f"({self.max_concurrency}): the tier sends up to max_concurrency pipelines at once (and a "
                "start-up listing beside them), and the client refuses a call past its connections; "
                "raise max_connections or lower max_concurrency"
            )
        return self

    @property
    def address(self) -> ServerAddress:
        return parse_server_url(self.url)
