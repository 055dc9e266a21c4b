"""A control server busy with a slow request: other clients are still answered, and a
client that finds the connection backlog full waits out its timeout.

The server is a real :class:`ControlServer` on a real unix socket; the slow request is a
real :class:`ControlTarget` op (a lookup that blocks on an event until the test releases
it); the backlog is filled with real connections; the CLI is the real ``kvplug ctl``.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from core_helpers import LAYOUTS
from typer.testing import CliRunner

from kvplug import (
    CacheEngine,
    ChunkLocation,
    ControlIdentity,
    ControlServer,
    EngineControl,
    Fingerprint,
    RequestInfo,
    load_config,
)
from kvplug.cli.main import app
from kvplug.core.control.client import ask
from kvplug.core.control.protocol import encode_request
from kvplug.core.control.server import CONTROL_LIMITS
from kvplug.errors import ControlError

LAYOUT = LAYOUTS["vllm_flash"]
TOKENS = list(range(100, 140))
IDENTITY = ControlIdentity("engine-a", "tiny", "test")


class SlowLookups(EngineControl):
    """An engine's control target whose lookups wait until the test releases them."""

    def __init__(self, engine: CacheEngine) -> None:
        super().__init__(engine)
        self.entered = threading.Event()
        self.release = threading.Event()

    def locate(self, tokens: Sequence[int], request: RequestInfo) -> list[ChunkLocation]:
        self.entered.set()
        self.release.wait(120)
        return super().locate(tokens, request)


@pytest.fixture
def target(tmp_path: Path) -> Iterator[SlowLookups]:
    extra = {"kvplug": {"chunk_size": 8, "tiers": [{"type": "cpu", "max_bytes": "16MiB"}]}}
    config = load_config(engine_extra=extra, env={}).config
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="m")) as engine:
        slow = SlowLookups(engine)
        yield slow
        slow.release.set()


def start_slow_lookup(server: ControlServer, target: SlowLookups, pool: ThreadPoolExecutor) -> Future[dict[str, Any]]:
    slow = pool.submit(ask, server.path, "lookup", None, TOKENS, timeout_s=120)
    assert target.entered.wait(60), "the slow lookup never reached the target"
    return slow


def fill_backlog(path: Path) -> list[socket.socket]:
    """Connect until the kernel refuses with EAGAIN: the listener's backlog is full."""
    fillers: list[socket.socket] = []
    while len(fillers) < 10_000:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(str(path))
        except BlockingIOError:
            sock.close()
            return fillers
        fillers.append(sock)
    raise AssertionError("the backlog never filled: the server kept accepting")


def test_a_slow_request_does_not_stall_another_clients_requests(target: SlowLookups, socket_dir: Path) -> None:
    server = ControlServer(target, IDENTITY)
    pool = ThreadPoolExecutor(1)
    try:
        slow = start_slow_lookup(server, target, pool)
        assert ask(server.path, "info", timeout_s=20)["engine_id"] == "engine-a"
        assert "metrics" in ask(server.path, "stats", timeout_s=20)
        assert not slow.done()  # both answered while the slow one still runs
        target.release.set()
        assert slow.result(timeout=60)["num_tokens"] == len(TOKENS)
    finally:
        target.release.set()
        pool.shutdown()
        server.close()


def test_a_client_that_leaves_while_its_request_is_answered_stops_nothing(
    target: SlowLookups, socket_dir: Path
) -> None:
    server = ControlServer(target, IDENTITY)
    try:
        body = encode_request("lookup", tokens=TOKENS)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(server.path))
            sock.sendall(struct.pack("<I", len(body)) + body)
            assert target.entered.wait(60)
        target.release.set()  # its reply has nowhere to go
        deadline = time.monotonic() + 60
        while server.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.connections == 0
        assert ask(server.path, "info", timeout_s=20)["engine_id"] == "engine-a"
    finally:
        target.release.set()
        server.close()


def test_a_client_waits_while_the_backlog_is_full_then_times_out_clearly_or_gets_in(
    target: SlowLookups, socket_dir: Path
) -> None:
    # One connection at most: the slow request's own connection fills the server, which
    # leaves newcomers in the kernel's backlog until that request is answered.
    server = ControlServer(target, IDENTITY, limits=dataclasses.replace(CONTROL_LIMITS, max_connections=1))
    pool = ThreadPoolExecutor(2)
    fillers: list[socket.socket] = []
    try:
        slow = start_slow_lookup(server, target, pool)
        fillers = fill_backlog(server.path)
        with pytest.raises(ControlError) as refused:
            ask(server.path, "info", timeout_s=0.5)
        assert str(server.path) in str(refused.value) and "within 0.5 s" in str(refused.value)
        result = CliRunner().invoke(app, ["ctl", "stats", "--timeout", "0.5"])
        said = " ".join(result.output.split())
        assert result.exit_code == 2 and server.path.name in said and "within 0.5 s" in said, result.output

        waiter = pool.submit(ask, server.path, "info", timeout_s=120)
        time.sleep(0.5)  # lets the waiter find the backlog full (it gets in either way)
        assert not waiter.done()
        target.release.set()
        assert slow.result(timeout=60)["num_tokens"] == len(TOKENS)
        for sock in fillers:
            sock.close()
        assert waiter.result(timeout=60)["engine_id"] == "engine-a"
    finally:
        target.release.set()
        for sock in fillers:
            sock.close()
        pool.shutdown()
        server.close()
