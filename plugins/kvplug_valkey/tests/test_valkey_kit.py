"""The test kit's servers: a port taken between choosing it and binding it (other tests of
this machine) is chosen again, never a failed start; a port the caller gave is kept."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvplug_valkey.fault_proxy as proxy_kit
from kvplug_valkey.fault_proxy import FaultProxy
from kvplug_valkey.testing import HOST, ValkeyServer
from kvplug_valkey.testing import server as server_kit


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process holds (a listening socket of this one stands in for it)."""
    with socket.socket() as holder:
        holder.bind((HOST, 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def test_a_chosen_port_taken_before_the_bind_is_chosen_again(
    tmp_path: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    choices = iter([taken_port])
    real_free_port = server_kit.free_port
    # The race cannot be caused on demand: free_port hands out the port another process took.
    monkeypatch.setattr(server_kit, "free_port", lambda **kw: next(choices, None) or real_free_port(**kw))
    server = ValkeyServer(tmp_path)
    assert server.port == taken_port
    try:
        server.start()
        assert server.port != taken_port
        assert server.cli("ping").strip() == "PONG"
        port = server.port
        server.restart()  # (its URL may be in use: a restart keeps the port it started on)
        assert server.port == port
    finally:
        server.kill()


def test_a_port_the_caller_gave_is_kept_and_its_failure_named(tmp_path: Path, taken_port: int) -> None:
    server = ValkeyServer(tmp_path, port=taken_port)
    try:
        with pytest.raises(RuntimeError, match=f"port {taken_port} exited at start"):
            server.start()
        assert server.port == taken_port
    finally:
        server.kill()


def test_the_fault_proxy_binds_a_port_of_its_own(
    tmp_path: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race cannot be caused on demand: a probe hands out the port another process took
    # (``raising=False``: the proxy binds port 0 itself and has no probe to patch).
    monkeypatch.setattr(proxy_kit, "free_port", lambda **kw: taken_port, raising=False)
    server = ValkeyServer(tmp_path).start()
    proxy = FaultProxy(server.port)
    try:
        assert proxy.port not in (0, taken_port)
        proxy.set_mode("refuse")
        proxy.set_mode("pass")  # listening again: on the port clients know
        with socket.create_connection((HOST, proxy.port), timeout=5) as conn:
            conn.sendall(b"PING\r\n")
            assert conn.recv(64) == b"+PONG\r\n"
    finally:
        proxy.close()
        server.kill()
