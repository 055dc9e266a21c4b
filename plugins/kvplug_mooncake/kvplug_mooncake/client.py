"""The Mooncake Store client: set up within the tier's deadline, and closed.

Mooncake's ``setup`` holds the GIL while it retries, and the library's own RPC timeouts
default to 30 s: a master that refuses connections would freeze every thread of the
engine past any deadline. So the library's timeouts are bounded by the tier's, and the
master and metadata server are probed with a plain TCP connect before ``setup``.
"""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlsplit

from kvplug_mooncake.buffers import TransferBuffers
from kvplug_mooncake.config import MooncakeTierConfig


class MooncakeCallError(Exception):
    """A client call failed as a whole (the store did not answer), or one record was
    refused (``code`` says why: -200, the store is full); transient."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed with mooncake code {code}")
        self.code = code


def library_timeouts(config: MooncakeTierConfig) -> None:
    """Bound the client library's own RPC timeouts and setup retries by this tier's
    deadline (its defaults are 30 s and many retries, with the GIL held in setup).
    Process-wide, read when the first client starts; values already set win."""
    timeout_ms = max(int(config.request_timeout_s * 1000), 100)
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(timeout_ms))
    os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", str(min(timeout_ms, 1000)))
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")


def endpoints(config: MooncakeTierConfig) -> list[tuple[str, str, int]]:
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


def connect(config: MooncakeTierConfig, where: str) -> tuple[Any, TransferBuffers]:
    """A set-up client and its registered transfer buffers (blocking: call it in a pool thread)."""
    # setup() holds the GIL while it retries: it would freeze every thread of the
    # engine past any deadline. A store that refuses connections fails here instead.
    for option, host, port in endpoints(config):
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
        raise MooncakeCallError(f"setup with {where} (metadata_server {config.metadata_server})", code)
    return store, TransferBuffers(int(config.transfer_buffer_size), store.register_buffer, store.unregister_buffer)


def close_client(store: Any, buffers: TransferBuffers | None) -> None:
    """Unregister the buffers and close the client; a client that fails to close is dropped."""
    try:
        if buffers is not None:
            buffers.close()
        store.close()
    except Exception:
        pass
