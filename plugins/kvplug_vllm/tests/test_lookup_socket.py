"""The worker's lookup socket (its control socket) against abusive clients, on a real socket.

A real :class:`kvplug.ControlServer` serves a real cache engine (cpu tier); real client sockets
send half messages, huge headers, requests they never read the answers of; planted links
and foreign folders must not be used. A normal lookup must keep working throughout.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from lookup_engines import LEN, PROMPT, engine_holding_prompt

from kvplug import (
    LOOKUP_DIR_ENV,
    CacheEngine,
    ControlIdentity,
    ControlServer,
    RequestInfo,
    ServerLimits,
    check_socket_file,
    private_socket_dir,
)
from kvplug.core.control.protocol import encode_request
from kvplug.errors import UnsafeSocketPathError
from kvplug_vllm.lookup import LookupChannelError, SocketLookup, socket_path


@pytest.fixture
def engine() -> Iterator[CacheEngine]:
    with engine_holding_prompt() as engine:
        yield engine


def serve(engine: CacheEngine, name: str, limits: ServerLimits) -> ControlServer:
    """The control server a vLLM worker runs, which its scheduler looks up on."""
    return ControlServer(engine, ControlIdentity(name, "m", "vllm"), socket_path(name, 0, 0), limits)


@pytest.fixture
def server(engine: CacheEngine) -> Iterator[ControlServer]:
    limits = ServerLimits(
        max_message_bytes=16 * 2**20, max_buffered_bytes=24 * 2**20, read_deadline_s=1.0, write_deadline_s=1.0
    )
    served = serve(engine, f"abuse-{os.getpid()}-{id(engine):x}", limits)
    yield served
    served.close()


def normal_lookup_works(server: ControlServer, timeout_s: float = 2.0) -> float:
    """A fresh well-behaved client gets the right answer within ``timeout_s``; returns seconds taken."""
    started = time.monotonic()
    client = SocketLookup([server.path], timeout_s=timeout_s)
    try:
        assert client.lookup(PROMPT, RequestInfo()) == 192
    finally:
        client.close()
    return time.monotonic() - started


def connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(path))
    return sock


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        while True:
            data = sock.recv(1 << 16)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_half_sent_messages_are_bounded_and_time_out(server: ControlServer) -> None:
    """12 clients announce big messages and send part: the server holds at most its byte budget."""
    payload = b"\0" * (6 * 2**20)
    framed = {size: LEN.pack(size) + payload for size in (60 * 2**20, 15 * 2**20)}
    clients: list[socket.socket] = []
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for announced in [60 * 2**20] * 4 + [15 * 2**20] * 8:  # over the limit, and just under it
            sock = connect(server.path)
            clients.append(sock)
            try:
                sock.sendall(framed[announced])
            except OSError:
                pass  # dropped while sending: what we want for the oversized ones
        assert normal_lookup_works(server) < 2.0
        assert server.buffered_bytes <= server.limits.max_buffered_bytes
        peak = tracemalloc.get_traced_memory()[1] - baseline
        # 12 x 6 MiB were sent; the server kept at most its 24 MiB budget (plus one recv buffer).
        assert peak < 28 * 2**20, f"server buffered {peak / 2**20:.0f} MiB"
        assert all(closed_by_server(sock, within_s=5.0) for sock in clients)  # read deadline
        assert server.buffered_bytes == 0
    finally:
        tracemalloc.stop()
        for sock in clients:
            sock.close()


def test_huge_headers_and_extra_key_counts_are_refused_before_parsing(server: ControlServer) -> None:
    header = json.dumps({"v": 1, "op": "lookup", "extra_keys": [[0, 1, "x" * 8]] * 200_000}).encode()
    flood = LEN.pack(len(header)) + header
    with connect(server.path) as sock:  # a malformed request: its connection is closed, unparsed
        sock.sendall(LEN.pack(len(flood)) + flood)
        assert closed_by_server(sock, within_s=5.0)
    # 5000 extra keys fit the header budget but not the count budget.
    header = json.dumps({"v": 1, "op": "lookup", "extra_keys": [[0, 1, "x"]] * 5000}).encode()
    many = LEN.pack(len(header)) + header
    with connect(server.path) as sock:
        sock.sendall(LEN.pack(len(many)) + many)
        assert closed_by_server(sock, within_s=5.0)
    assert normal_lookup_works(server) < 2.0


def test_a_client_that_never_reads_blocks_only_itself(server: ControlServer) -> None:
    message = encode_request("lookup", {}, PROMPT)
    greedy = connect(server.path)
    greedy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stop = threading.Event()

    def pipeline() -> None:  # requests forever, never a read
        framed = LEN.pack(len(message)) + message
        greedy.settimeout(0.2)
        while not stop.is_set():
            try:
                greedy.sendall(framed)
            except TimeoutError:
                continue
            except OSError:
                return

    sender = threading.Thread(target=pipeline, daemon=True)
    sender.start()
    try:
        time.sleep(0.5)  # the greedy client's receive buffer is full by now
        for _ in range(3):
            assert normal_lookup_works(server) < 2.0
        stop.set()
        sender.join(timeout=5)
        deadline = time.monotonic() + 5.0  # unread replies: closed after the write deadline (1 s)
        while server.connections and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.connections == 0
        assert closed_by_server(greedy, within_s=5.0)
    finally:
        stop.set()
        sender.join(timeout=5)
        greedy.close()


def test_connections_are_bounded(engine: CacheEngine) -> None:
    limits = ServerLimits(max_connections=4, read_deadline_s=1.0)
    served = serve(engine, f"conns-{os.getpid()}", limits)
    idle = [connect(served.path) for _ in range(10)]
    try:
        assert normal_lookup_works(served) < 2.0
        time.sleep(0.2)
        assert served.connections <= 4
    finally:
        for sock in idle:
            sock.close()
        served.close()


# --- the private folder ----------------------------------------------------------------------


@pytest.fixture
def fresh_dir_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private temp root and no folder resolved yet; restored afterwards."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    monkeypatch.delenv(LOOKUP_DIR_ENV, raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr("kvplug.core.control_socket._dir", None)
    return root


def test_a_planted_link_is_not_followed(fresh_dir_state: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (fresh_dir_state / f"kvplug-{os.getuid()}").symlink_to(target)
    folder = private_socket_dir()
    assert folder.parent == fresh_dir_state and not folder.is_symlink() and folder != target
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700 and os.lstat(folder).st_uid == os.getuid()
    assert os.environ[LOOKUP_DIR_ENV] == str(folder)  # children find the same folder
    assert list(target.iterdir()) == []


def test_an_open_or_foreign_folder_is_not_used(fresh_dir_state: Path) -> None:
    squatted = fresh_dir_state / f"kvplug-{os.getuid()}"
    squatted.mkdir()
    squatted.chmod(0o777)
    if os.getuid() == 0:  # as root, also make it another user's, as a squatter's would be
        os.chown(squatted, 65534, 65534)
    folder = private_socket_dir()
    assert folder != squatted and stat.S_IMODE(os.lstat(folder).st_mode) == 0o700


def test_xdg_runtime_dir_is_preferred(fresh_dir_state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert private_socket_dir() == runtime / "kvplug"


def test_clients_refuse_a_link_to_a_socket(server: ControlServer) -> None:
    link = server.path.parent / "lookup-link.sock"
    link.symlink_to(server.path)
    try:
        with pytest.raises(LookupChannelError, match="not a socket"):
            SocketLookup([link], timeout_s=1).lookup(PROMPT, RequestInfo())
    finally:
        link.unlink()
    with pytest.raises(UnsafeSocketPathError):
        check_socket_file(Path(tempfile.gettempdir()) / "nonexistent-dir" / "x.sock")


def test_a_worker_that_never_answers_costs_one_lookup_timeout(tmp_path: Path) -> None:
    """The scheduler asks on its own thread unless its lookups go to the background: a worker
    that accepted the lookup and hangs costs ``lookup_timeout_s``, once (no second try that
    waits as long again), and the lookup is refused naming the timeout."""
    folder = tmp_path / "hung"
    folder.mkdir(mode=0o700)
    path = folder / "worker.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    accepted: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not done.is_set():
            try:
                accepted.append(listener.accept()[0])  # held open, never answered
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    client = SocketLookup([path], timeout_s=0.5)
    try:
        with pytest.raises(LookupChannelError, match="no answer within lookup_timeout_s"):
            client.locate(PROMPT, RequestInfo())
    finally:
        done.set()
        thread.join(5)
        client.close()
        for sock in accepted:
            sock.close()
        listener.close()
    assert len(accepted) == 1


def test_the_workers_are_asked_at_once(engine: CacheEngine) -> None:
    """An engine of several workers (TP ranks, pipeline stages) is asked all at once, so a
    lookup waits for the slowest worker, not for the sum of them (each up to
    ``lookup_timeout_s``). Two workers that answer only once both were asked (a barrier in
    their lookups) answer a parallel lookup and time out one asked after the other."""
    both_asked = threading.Barrier(2, timeout=30)
    original = engine.locate

    def locate_once_both_asked(*args: object, **kwargs: object) -> object:
        both_asked.wait()
        return original(*args, **kwargs)  # type: ignore[arg-type]

    engine.locate = locate_once_both_asked  # type: ignore[method-assign]
    limits = ServerLimits(max_message_bytes=16 * 2**20, read_deadline_s=5.0, write_deadline_s=5.0)
    name = f"both-{os.getpid()}-{id(engine):x}"
    servers = [
        ControlServer(
            engine, ControlIdentity(name, "m", "vllm", tp_size=2, tp_rank=rank), socket_path(name, 0, rank), limits
        )
        for rank in range(2)
    ]
    client = SocketLookup([server.path for server in servers], timeout_s=5.0)
    try:
        assert client.lookup(PROMPT, RequestInfo()) == 192
    finally:
        both_asked.abort()  # a worker still waiting (asked alone) gives up
        client.close()
        for server in servers:
            server.close()
