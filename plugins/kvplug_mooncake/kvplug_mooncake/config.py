"""Options of tier ``mooncake``."""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import ByteSize, Field, field_validator

from kvplug import RecordTierConfig, ThreadCount, TimeoutSeconds

_HOST_PORT = re.compile(r"^(?P<host>[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:]+\]):(?P<port>[0-9]{1,5})$")
_KEY_PREFIX = re.compile(r"^[A-Za-z0-9._\-/]{0,64}$")


def check_host_port(value: str, field: str) -> str:
    match = _HOST_PORT.match(value)
    if match is None or not 0 < int(match["port"]) < 65536:
        raise ValueError(f"{field} must be host:port with a port in 1..65535, e.g. 127.0.0.1:50051 (got {value!r})")
    return value


class MooncakeTierConfig(RecordTierConfig):
    """Options of tier ``mooncake``: a Mooncake Store cluster (master + storage nodes).

    Values are stored as kvplug records (key-bound, checksummed) under the sha256
    digest of the key. Every store call has a deadline, bounded retries and a circuit
    breaker, and the records this process wrote or read are indexed (see
    :class:`kvplug.RecordTierConfig`; the store cannot list, so ``scan_on_start`` finds nothing).
    """

    master: str = Field(description="The mooncake_master RPC address, host:port.")
    metadata_server: str = Field(
        description="Transfer-engine metadata: http://host:port/metadata (the master's built-in HTTP metadata "
        "server or mooncake_http_metadata_server), etcd://host:port, or P2PHANDSHAKE."
    )
    protocol: Literal["tcp", "rdma"] = Field(default="tcp", description="Transfer protocol.")
    rdma_devices: str = Field(default="", description="RDMA devices (protocol rdma), e.g. mlx5_0,mlx5_1.")
    local_hostname: str = Field(
        default="127.0.0.1",
        description="This client's address as other nodes reach it; set a routable address when "
        "global_segment_size > 0 on a multi-host cluster.",
    )
    global_segment_size: ByteSize = Field(
        default=ByteSize(0), description="Memory this process contributes to the store; 0 = pure client."
    )
    local_buffer_size: ByteSize = Field(
        default=ByteSize(16 * 1024**2), description="The client's own transfer buffer (mooncake setup option)."
    )
    transfer_buffer_size: ByteSize = Field(
        default=ByteSize(256 * 1024**2),
        description="Registered buffer that values are framed into and read into (batch_put_from / "
        "batch_get_into); a batch larger than what is free uses a temporary buffer.",
    )
    key_prefix: str = Field(
        default="kvplug/", description="Prefix of every object key in the store (letters, digits, . _ - /)."
    )
    setup_timeout_s: TimeoutSeconds = Field(
        default=10.0, description="Deadline of connecting the client to the master (setup)."
    )
    transfer_threads: ThreadCount = Field(default=8, description="Threads that run the client's blocking calls.")

    @field_validator("master")
    @classmethod
    def _master_address(cls, value: str) -> str:
        return check_host_port(value, "master")

    @field_validator("metadata_server")
    @classmethod
    def _metadata_address(cls, value: str) -> str:
        if value == "P2PHANDSHAKE":
            return value
        parts = urlsplit(value)
        if parts.scheme in ("http", "https") and parts.netloc:
            return value
        if parts.scheme == "etcd" and parts.netloc:
            return value
        if _HOST_PORT.match(value):  # a bare etcd address, as mooncake accepts it
            return value
        raise ValueError(
            "metadata_server must be http://host:port/metadata, etcd://host:port, host:port (etcd) "
            f"or P2PHANDSHAKE (got {value!r})"
        )

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not _KEY_PREFIX.match(value):
            raise ValueError(f"key_prefix may hold at most 64 letters, digits and . _ - / (got {value!r})")
        return value

    @field_validator("local_hostname")
    @classmethod
    def _hostname(cls, value: str) -> str:
        if not value or not re.match(r"^[A-Za-z0-9.\-:\[\]]+$", value):
            raise ValueError(f"local_hostname must be a host name or address (got {value!r})")
        return value
