"""The scheduler's lookup channel (:class:`kvplug_vllm.lookup.SocketLookup`) across a worker's
timeout and its own close, on real sockets: no answer is ever read as another lookup's, and a
closed channel opens nothing again.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from lookup_engines import LEN, PROMPT, engine_holding_prompt

from kvplug import (
    CacheEngine,
    ControlIdentity,
    ControlServer,
    RequestInfo,
    ServerLimits,
)
from kvplug_vllm.lookup import LookupChannelError, SocketLookup, socket_path


@pytest.fixture
def engine() -> Iterator[CacheEngine]:
    with engine_holding_prompt() as engine:
        yield engine


def test_a_late_answer_is_never_read_as_the_next_lookups(tmp_path: Path) -> None:
    """A worker that answers after ``lookup_timeout_s`` answers on a connection the scheduler
    closed when it gave up: its reply (here 192 tokens held) is never taken as the answer to
    the next lookup, which goes on a new connection and gets that lookup's own (none held)."""
    folder = tmp_path / "late"
    folder.mkdir(mode=0o700)
    path = folder / "worker.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    gave_up = threading.Event()
    held = [["memory", "cpu", 64, f"{i:032x}", 0] for i in range(3)]

    def reply(sock: socket.socket, locations: list[list[object]]) -> None:
        (length,) = LEN.unpack(sock.recv(4, socket.MSG_WAITALL))
        sock.recv(length, socket.MSG_WAITALL)  # the request
        body = json.dumps({"locations": locations}).encode()
        try:
            sock.sendall(LEN.pack(len(body)) + body)
        except OSError:
            pass  # the scheduler closed it: what a late reply meets

    def worker() -> None:
        listener.settimeout(30)
        first = listener.accept()[0]
        gave_up.wait(30)
        reply(first, held)  # late: after the scheduler's timeout
        second = listener.accept()[0]
        reply(second, [])
        for sock in (first, second):
            sock.close()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    client = SocketLookup([path], timeout_s=0.5)
    try:
        with pytest.raises(LookupChannelError, match="no answer within lookup_timeout_s"):
            client.locate(PROMPT, RequestInfo())
        gave_up.set()
        assert client.lookup(PROMPT, RequestInfo()) == 0, "the late answer was read as the next lookup's"
    finally:
        gave_up.set()
        client.close()
        thread.join(30)
        listener.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_lookup_after_close_opens_nothing(engine: CacheEngine, workers: int) -> None:
    """A background lookup still waiting for the channel's lock when the scheduler shut down
    runs after ``close``: it is refused as a miss (LookupChannelError), where one worker's
    channel connected again (a socket nothing would close) and several workers' raised
    RuntimeError from the shut-down thread pool."""
    limits = ServerLimits(max_message_bytes=16 * 2**20, read_deadline_s=5.0, write_deadline_s=5.0)
    name = f"closed-{workers}-{os.getpid()}-{id(engine):x}"
    servers = [
        ControlServer(
            engine,
            ControlIdentity(name, "m", "vllm", tp_size=workers, tp_rank=rank),
            socket_path(name, 0, rank),
            limits,
        )
        for rank in range(workers)
    ]
    client = SocketLookup([server.path for server in servers], timeout_s=5.0)
    try:
        assert client.lookup(PROMPT, RequestInfo()) == 192
        client.close()
        with pytest.raises(LookupChannelError, match="closed"):
            client.lookup(PROMPT, RequestInfo())
        assert client._socks == {}, "a closed channel connected again"
    finally:
        client.close()
        for server in servers:
            server.close()
