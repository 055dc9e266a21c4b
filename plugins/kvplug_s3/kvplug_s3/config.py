"""Options of tier ``s3`` and the check of its URL against what fsspec knows.

The URL is checked when the config is validated, without importing the
filesystem package (``importlib.util.find_spec`` only), so that a typo or a
missing ``gcsfs`` is reported with the config's other problems, naming the
protocols fsspec knows and which of them are installed. fsspec's own
implementations (sftp, smb, git, ...) are importable modules whatever their
dependencies: the chosen one is imported (a small module of fsspec) to tell.
"""

from __future__ import annotations

import importlib.util
from typing import Any
from urllib.parse import urlsplit

from pydantic import (
    ByteSize,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from kvplug import BackoffSeconds, FailureCount, RecordTierConfig, TimeoutSeconds

#: Protocols spoken by the S3 options (endpoint, region, keys).
S3_PROTOCOLS = frozenset({"s3", "s3a"})
#: The longest object key S3 takes, in UTF-8 bytes.
MAX_S3_KEY_BYTES = 1024
#: What a record adds to the prefix: ``/<shard>/<digest>`` (kvplug_s3.objects.ObjectBackend.path_for).
RECORD_NAME_BYTES = 1 + 2 + 1 + 64
#: fsspec's own implementations whose module imports its dependency only when a filesystem
#: is made (``get_filesystem_class`` succeeds without it): the dependency, found by name.
LAZY_DEPENDENCIES = {"fsspec.implementations.arrow.HadoopFileSystem": "pyarrow"}
#: fsspec protocols that cannot store anything (read-only or archive views).
READ_ONLY_PROTOCOLS = frozenset(
    {"http", "https", "zip", "tar", "data", "github", "git", "gist", "libarchive", "reference", "generic"}
)


class S3TierConfig(RecordTierConfig):
    """Options of tier ``s3``: an S3 bucket prefix or any writable fsspec URL.

    Every network call has a deadline (``request_timeout_s`` per attempt) and is
    retried at most ``retries`` times with exponential backoff and full jitter.
    After ``breaker_failures`` consecutive failures the circuit breaker opens:
    lookups answer "miss" and puts are dropped (counted) without touching the
    network, until a probe after ``breaker_cooldown_s`` succeeds.
    """

    url: str = Field(
        description="Where objects go: s3://bucket/prefix, gcs://bucket/prefix, file:///path, memory://name."
    )
    endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint (MinIO, Ceph, moto), s3 only.")
    region: str | None = Field(default=None, description="AWS region, s3 only.")
    access_key_id: SecretStr | None = Field(
        default=None, description="s3 only; when unset, the usual AWS environment/config chain applies."
    )
    secret_access_key: SecretStr | None = Field(default=None, description="s3 only; set together with access_key_id.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for the fsspec filesystem; they win over the above."
    )
    connect_timeout_s: TimeoutSeconds = Field(default=3.0, description="Seconds to open a connection (s3).")
    read_timeout_s: TimeoutSeconds = Field(default=15.0, description="Seconds a socket read may stall (s3).")
    # Objects are whole chunks (MBs): an attempt may take longer than a key-value store's.
    request_timeout_s: TimeoutSeconds = Field(
        default=30.0, description="Deadline of one attempt of one object operation, transfer included."
    )
    retries: int = Field(default=2, ge=0, le=10, description="Retries after a failed attempt (bounded).")
    backoff_base_s: BackoffSeconds = Field(default=0.05, description="First backoff; doubles per retry, full jitter.")
    backoff_max_s: BackoffSeconds = Field(default=2.0, description="Longest backoff between two attempts.")
    breaker_failures: FailureCount = Field(default=5, description="Consecutive failures that open the circuit breaker.")
    breaker_cooldown_s: TimeoutSeconds = Field(
        default=10.0, description="Seconds the breaker stays open before one probe batch may try the store."
    )
    frame_buffer_bytes: ByteSize = Field(
        default=ByteSize(256 * 1024**2),
        description="Upload buffers kept for reuse (values framed for a PUT); 0 allocates each anew.",
    )
    scan_on_start: bool = Field(
        default=True,
        description="List the prefix on start so stats and the max_bytes budget include objects already stored.",
    )

    @field_validator("url")
    @classmethod
    def _known_writable_protocol(cls, url: str) -> str:
        check_url(url)
        return url

    @field_validator("endpoint_url")
    @classmethod
    def _http_endpoint(cls, endpoint: str | None) -> str | None:
        if endpoint is not None:
            parts = urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(
                    "endpoint_url must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:9000"
                )
            if parts.username is not None or parts.password is not None:
                # S3 signs requests with its keys; a user:password in the URL is never used, only leaked.
                raise ValueError(
                    "endpoint_url must not carry credentials (user:password@); set access_key_id and secret_access_key"
                )
        return endpoint

    @model_validator(mode="after")
    def _options_fit_the_protocol(self) -> S3TierConfig:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("access_key_id and secret_access_key go together: set both or neither")
        if self.protocol not in S3_PROTOCOLS:
            given = [n for n in ("endpoint_url", "region", "access_key_id") if getattr(self, n) is not None]
            if given:
                raise ValueError(
                    f"{', '.join(given)} only apply to s3:// URLs; for {self.protocol}:// pass options in storage_options"
                )
        return self

    @property
    def protocol(self) -> str:
        return self.url.split("://", 1)[0]

    def filesystem_options(self) -> dict[str, Any]:
        """Keyword arguments for ``fsspec.filesystem(protocol, ...)``, secrets revealed."""
        options: dict[str, Any] = {}
        if self.protocol in S3_PROTOCOLS:
            client_kwargs: dict[str, Any] = {}
            if self.region:
                client_kwargs["region_name"] = self.region
            config_kwargs: dict[str, Any] = {
                "connect_timeout": self.connect_timeout_s,
                "read_timeout": self.read_timeout_s,
                # kvplug retries with its own budget and breaker; botocore's retries would multiply it.
                "retries": {"total_max_attempts": 1},
                "max_pool_connections": self.max_concurrency,
            }
            options.update(client_kwargs=client_kwargs, config_kwargs=config_kwargs, use_listings_cache=False)
            if self.endpoint_url:
                options["endpoint_url"] = self.endpoint_url
            if self.access_key_id is not None and self.secret_access_key is not None:
                options["key"] = self.access_key_id.get_secret_value()
                options["secret"] = self.secret_access_key.get_secret_value()
        elif self.protocol in ("file", "local"):
            options["auto_mkdir"] = True
        for name, value in self.storage_options.items():
            if isinstance(value, dict) and isinstance(options.get(name), dict):
                options[name] = {**options[name], **value}
            else:
                options[name] = value
        return options


def check_url(url: str) -> None:
    """Raise ``ValueError`` naming what is wrong with ``url`` as a tier location."""
    if "::" in url:
        raise ValueError("chained fsspec URLs (a::b://...) are not supported; give one protocol://location")
    if "://" not in url:
        raise ValueError(
            f"url needs a protocol, e.g. s3://bucket/prefix or file://{url if url.startswith('/') else '/path'}"
        )
    protocol, location = url.split("://", 1)
    if "@" in location.split("/", 1)[0] and ":" in location.split("@", 1)[0]:
        # kvplug never takes credentials from a url (s3fs would read "key:secret@bucket" as
        # the bucket's name), and a url goes into logs, errors and stats.
        raise ValueError(
            "url must not carry credentials (user:password@); set access_key_id and secret_access_key "
            "(s3) or give them in storage_options"
        )
    known, installed = fsspec_protocols()
    if protocol not in known:
        raise ValueError(
            f"unknown fsspec protocol {protocol!r}; fsspec knows: {', '.join(sorted(known))}; "
            f"installed: {', '.join(sorted(installed))}"
        )
    if protocol in READ_ONLY_PROTOCOLS:
        raise ValueError(f"protocol {protocol!r} cannot store objects; use s3://, gcs://, file:// or memory://")
    if protocol not in installed:
        hint = _install_hint(protocol)
        raise ValueError(f"protocol {protocol!r} is not installed ({hint}); installed: {', '.join(sorted(installed))}")
    _check_fsspec_dependencies(protocol)
    if protocol in S3_PROTOCOLS:
        bucket, _, prefix = location.partition("/")
        if not bucket:
            raise ValueError("an s3 url names a bucket: s3://bucket or s3://bucket/prefix")
        longest = MAX_S3_KEY_BYTES - RECORD_NAME_BYTES
        if len(prefix.rstrip("/").encode()) > longest:
            # S3 refuses every object name past its limit (KeyTooLongError): the tier would
            # drop every store, one failure at a time, until its breaker opened.
            raise ValueError(
                f"the prefix of an s3 url can be at most {longest} bytes (got {len(prefix.rstrip('/').encode())}): "
                f"object names (prefix/xx/<64-hex digest>) must fit S3's {MAX_S3_KEY_BYTES}-byte keys"
            )
    elif protocol in ("file", "local") and not location.startswith("/"):
        raise ValueError(f"a file url needs an absolute path: file:///abs/path (got {url!r})")
    elif not location.strip("/"):
        raise ValueError(f"url {url!r} names no location after {protocol}://")


def fsspec_protocols() -> tuple[set[str], set[str]]:
    """(every protocol fsspec knows, those whose implementation is importable here)."""
    from fsspec.registry import known_implementations, registry

    known = set(known_implementations) | set(registry)
    installed = set(registry)
    for protocol, spec in known_implementations.items():
        module = spec.get("class", "").rsplit(".", 1)[0]
        top = module.split(".", 1)[0]
        try:
            if top and importlib.util.find_spec(top) is not None:
                installed.add(protocol)
        except (ImportError, ValueError):
            continue
    return known, installed


def _check_fsspec_dependencies(protocol: str) -> None:
    """Raise ``ValueError`` when ``protocol`` is one of fsspec's own implementations whose
    dependency is missing (``sftp`` without paramiko): ``find_spec`` found fsspec, and the
    tier would fail only when it opens, after the engine started."""
    from fsspec.registry import get_filesystem_class, known_implementations

    spec = known_implementations.get(protocol, {})
    if not spec.get("class", "").startswith("fsspec."):
        return  # another package's: find_spec of it told already, without importing it
    try:
        get_filesystem_class(protocol)
    except ImportError as exc:
        raise ValueError(f"protocol {protocol!r} is not installed ({exc})") from None
    dependency = LAZY_DEPENDENCIES.get(spec["class"])
    if dependency is not None and importlib.util.find_spec(dependency) is None:
        hint = spec.get("err") or f"needs {dependency}"
        raise ValueError(f"protocol {protocol!r} is not installed ({hint}: {dependency} is missing)")


def _install_hint(protocol: str) -> str:
    from fsspec.registry import known_implementations

    spec = known_implementations.get(protocol, {})
    return spec.get("err") or f"needs {spec.get('class', 'an implementation').split('.', 1)[0]}"
