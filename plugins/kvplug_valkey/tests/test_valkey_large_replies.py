"""Records of realistic size (64 KiB on) read by the bounded parser's own path for long
strings (kvplug_valkey.replies.LARGE_STRING): exact bytes, one or many to a pipeline,
with and without a record bound; a server that stops mid-record is a miss, never a hang."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import tracemalloc

import pytest
from valkey_helpers import fresh_prefix

from kvplug.testing import key_for, tier_context
from kvplug_valkey import ValkeyTier
from kvplug_valkey.replies import LARGE_STRING

#: Around the threshold, and records of a few MiB (odd lengths: no alignment assumed).
SIZES = [LARGE_STRING - 100, LARGE_STRING, 1024**2 + 7, 4 * 1024**2 + 3]


@pytest.mark.parametrize("bound", [None, 8 * 1024**2], ids=["GET", "GETRANGE"])
def test_large_records_round_trip_exactly(bound: int | None, valkey_server) -> None:
    config = ValkeyTier.Config(url=valkey_server.url, cluster=False, key_prefix=fresh_prefix(), request_timeout_s=10.0)
    tier = ValkeyTier(config, tier_context(max_record_bytes=bound))
    try:
        keys = [key_for(f"large-{size}") for size in SIZES]
        values = [os.urandom(size) for size in SIZES]
        tier.put(list(zip(keys, values)))
        for _ in range(2):  # the second time on the connections the first left
            assert [bytes(v) for v in tier.get(keys)] == values
            assert [bytes(v) for v in tier.get(keys[::-1])] == values[::-1]
        extra = tier.stats().extra
        assert extra["corrupt"] == 0 and extra["failures"] == 0, extra
    finally:
        tier.close()


class _PartialServer:
    """Answers every command with the header of a ``length``-byte bulk string and 1 MiB of it,
    then hangs up (``hang_up``) or sends nothing more until the client does."""

    def __init__(self, length: int, *, hang_up: bool) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._length = length
        self._hang_up = hang_up
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = self._server.accept()
                with connection, contextlib.suppress(OSError):
                    connection.recv(65536)
                    connection.sendall(b"$%d\r\n" % self._length + b"\x07" * 1024**2)
                    while not self._hang_up and connection.recv(65536):  # until the client gives up
                        pass

    def close(self) -> None:
        self._server.close()


def test_a_server_that_stops_mid_record_is_a_miss() -> None:
    server = _PartialServer(4 * 1024**2, hang_up=True)
    config = ValkeyTier.Config(url=f"redis://127.0.0.1:{server.port}", cluster=False, request_timeout_s=10.0, retries=0)
    tier = ValkeyTier(config, tier_context())
    try:
        assert tier.get([key_for("cut")]) == [None]
        extra = tier.stats().extra
        assert extra["failures"] == 1 and extra["corrupt"] == 0, extra
    finally:
        tier.close()
        server.close()


def test_a_long_announced_string_takes_memory_as_its_bytes_arrive_not_at_once() -> None:
    """A server (hostile, or broken) announces a 256 MiB string within the bound (no record
    bound: Valkey's own 512 MiB), sends 1 MiB, then nothing: the reader holds what arrived, not
    a buffer of the announced size (one such reply a connection would take GiBs unsent)."""
    announced = 256 * 1024**2
    server = _PartialServer(announced, hang_up=False)
    config = ValkeyTier.Config(url=f"redis://127.0.0.1:{server.port}", cluster=False, request_timeout_s=1.0, retries=0)
    tier = ValkeyTier(config, tier_context())
    tracemalloc.start()
    try:
        assert tier.get([key_for("announced")]) == [None]  # the call's deadline: a miss
        _, peak = tracemalloc.get_traced_memory()
        assert peak < announced // 8, f"{peak} bytes held at the peak for 1 MiB received"
    finally:
        tracemalloc.stop()
        tier.close()
        server.close()
