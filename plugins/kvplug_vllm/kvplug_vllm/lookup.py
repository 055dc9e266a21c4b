"""How the scheduler-side connector asks the worker's cache engine what it holds.

The worker owns the :class:`kvplug.CacheEngine` and its tiers. With vLLM's
in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the scheduler finds that
engine in :data:`_LOCAL_ENGINES` and calls it directly. With the multiprocess
engine the scheduler (EngineCore process) and the worker are different
processes: the worker then serves lookups on a unix socket and the scheduler
connects to it (LMCache does the same over ZMQ).

Wire format, no pickle: each message is ``<u32 length>`` + body. A request body
is ``<u32 header length>`` + a JSON header + the token ids as little-endian
int64; a reply body is JSON, ``{"hit": n}`` or ``{"error": "..."}``. The socket
lives in a per-user folder of mode 0700 under the temp dir, named from a sha256
of the engine id and ranks, never from user text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import selectors
import socket
import struct
import tempfile
import threading
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvplug import CacheEngine, ExtraKey, RequestInfo
from kvplug.errors import KVPlugError

logger = logging.getLogger("kvplug.vllm.lookup")

_LEN = struct.Struct("<I")
_MAX_MESSAGE = 64 * 1024 * 1024

#: (engine id, data-parallel rank, tensor-parallel rank) -> the worker's engine in this process.
_LOCAL_ENGINES: dict[tuple[str, int, int], CacheEngine] = {}
_LOCAL_LOCK = threading.Lock()


class LookupChannelError(KVPlugError):
    """A lookup could not be answered (the worker is gone, slow or said no)."""


def register_local(engine_key: tuple[str, int, int], engine: CacheEngine) -> None:
    with _LOCAL_LOCK:
        _LOCAL_ENGINES[engine_key] = engine


def unregister_local(engine_key: tuple[str, int, int]) -> None:
    with _LOCAL_LOCK:
        _LOCAL_ENGINES.pop(engine_key, None)


def local_engine(engine_key: tuple[str, int, int]) -> CacheEngine | None:
    with _LOCAL_LOCK:
        return _LOCAL_ENGINES.get(engine_key)


def socket_path(engine_id: str, dp_rank: int, tp_rank: int) -> Path:
    """The lookup socket of one worker; a private folder, a hex name."""
    folder = Path(tempfile.gettempdir()) / f"kvplug-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise LookupChannelError(f"{folder} must be owned by uid {os.getuid()} with mode 0700 (it holds lookup sockets)")
    name = hashlib.sha256(f"{engine_id}\0{dp_rank}\0{tp_rank}".encode()).hexdigest()[:32]
    return folder / f"lookup-{name}.sock"


def remove_stale_sockets(folder: Path, *, min_age_s: float = 60.0) -> None:
    """Remove lookup sockets nobody listens on (their worker was killed, e.g. SIGKILL).

    Only files older than ``min_age_s``: a worker starting right now has bound its
    socket but may not listen yet.
    """
    now = time.time()
    for candidate in folder.glob("lookup-*.sock"):
        try:
            if now - candidate.stat().st_mtime < min_age_s:
                continue
        except OSError:
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(str(candidate))
            except ConnectionRefusedError:
                candidate.unlink(missing_ok=True)
            except OSError:
                pass


# --- encoding ---------------------------------------------------------------------------


def encode_request(tokens: Sequence[int], request: RequestInfo) -> bytes:
    header = json.dumps(
        {
            "op": "lookup",
            "cache_salt": request.cache_salt,
            "lora_id": request.lora_id,
            "extra_keys": [[k.start, k.end, k.value] for k in request.extra_keys],
            "overrides": dict(request.overrides),
        }
    ).encode()
    packed = array("q", tokens)
    if struct.pack("=q", 1) != struct.pack("<q", 1):  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return _LEN.pack(len(header)) + header + packed.tobytes()


def decode_request(body: bytes) -> tuple[list[int], RequestInfo]:
    (header_len,) = _LEN.unpack_from(body)
    header = json.loads(body[_LEN.size : _LEN.size + header_len])
    if header.get("op") != "lookup":
        raise ValueError(f"unknown op {header.get('op')!r}")
    raw = body[_LEN.size + header_len :]
    if len(raw) % 8:
        raise ValueError("token bytes are not a whole number of int64")
    tokens = array("q")
    tokens.frombytes(raw)
    if struct.pack("=q", 1) != struct.pack("<q", 1):  # pragma: no cover
        tokens.byteswap()
    info = RequestInfo(
        cache_salt=header.get("cache_salt"),
        lora_id=header.get("lora_id"),
        extra_keys=tuple(ExtraKey(int(s), int(e), str(v)) for s, e, v in header.get("extra_keys", [])),
        overrides=dict(header.get("overrides") or {}),
    )
    return tokens.tolist(), info


# --- server (worker side) -----------------------------------------------------------------


class LookupServer:
    """Answers lookups for one worker's engine on a unix socket, from one thread."""

    def __init__(self, engine: CacheEngine, path: Path) -> None:
        self.engine = engine
        self.path = path
        remove_stale_sockets(path.parent)
        path.unlink(missing_ok=True)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        os.chmod(path, 0o600)
        self._listener.listen(16)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._buffers: dict[socket.socket, bytearray] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvplug-lookup-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread, close every socket and remove the socket file."""
        if self._stopping:
            return
        self._stopping = True
        self._wake_w.send(b"x")
        self._thread.join(timeout=10)
        for conn in list(self._buffers):
            conn.close()
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        self.path.unlink(missing_ok=True)

    def _run(self) -> None:
        while not self._stopping:
            for key, _ in self._selector.select(timeout=1.0):
                if key.data == "accept":
                    self._accept()
                elif key.data == "read":
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        conn.setblocking(True)
        self._buffers[conn] = bytearray()
        self._selector.register(conn, selectors.EVENT_READ, "read")

    def _read(self, conn: socket.socket) -> None:
        buffer = self._buffers[conn]
        try:
            data = conn.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        buffer += data
        while len(buffer) >= _LEN.size:
            (length,) = _LEN.unpack_from(buffer)
            if length > _MAX_MESSAGE:
                self._drop(conn)
                return
            if len(buffer) < _LEN.size + length:
                break
            body = bytes(buffer[_LEN.size : _LEN.size + length])
            del buffer[: _LEN.size + length]
            reply = self._answer(body)
            try:
                conn.sendall(_LEN.pack(len(reply)) + reply)
            except OSError:
                self._drop(conn)
                return

    def _answer(self, body: bytes) -> bytes:
        try:
            tokens, info = decode_request(body)
            return json.dumps({"hit": self.engine.lookup(tokens, request=info)}).encode()
        except Exception as exc:  # a bad request or a closed engine: the client sees a miss
            logger.warning("lookup request failed: %s", exc)
            return json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()

    def _drop(self, conn: socket.socket) -> None:
        self._selector.unregister(conn)
        self._buffers.pop(conn, None)
        conn.close()


# --- client (scheduler side) ---------------------------------------------------------------


class SocketLookup:
    """Asks every tensor-parallel worker of one engine; the hit is the smallest answer."""

    def __init__(self, paths: Sequence[Path], timeout_s: float) -> None:
        self.paths = list(paths)
        self.timeout_s = timeout_s
        self._socks: dict[Path, socket.socket] = {}
        self._lock = threading.Lock()

    def lookup(self, tokens: Sequence[int], request: RequestInfo) -> int:
        message = encode_request(tokens, request)
        with self._lock:
            return min(self._ask(path, message) for path in self.paths)

    def close(self) -> None:
        with self._lock:
            for sock in self._socks.values():
                sock.close()
            self._socks.clear()

    def _ask(self, path: Path, message: bytes) -> int:
        for attempt in (1, 2):  # one reconnect: the worker may have restarted its server
            sock = self._socks.get(path)
            try:
                if sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.settimeout(self.timeout_s)
                    sock.connect(str(path))
                    self._socks[path] = sock
                sock.sendall(_LEN.pack(len(message)) + message)
                reply: dict[str, Any] = json.loads(_recv_message(sock))
            except (OSError, ValueError) as exc:
                self._socks.pop(path, None)
                if sock is not None:
                    sock.close()
                if attempt == 2:
                    raise LookupChannelError(f"lookup via {path} failed: {exc}") from exc
                continue
            if "error" in reply:
                raise LookupChannelError(f"worker could not look up: {reply['error']}")
            return int(reply["hit"])
        raise AssertionError("unreachable")


def _recv_message(sock: socket.socket) -> bytes:
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if length > _MAX_MESSAGE:
        raise ValueError(f"reply of {length} bytes is too large")
    return _recv_exact(sock, length)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        data = sock.recv(size - len(chunks))
        if not data:
            raise ConnectionError("lookup server closed the connection")
        chunks += data
    return bytes(chunks)


class DirectLookup:
    """The worker's engines live in this process: call them."""

    def __init__(self, engines: Sequence[CacheEngine]) -> None:
        self.engines = list(engines)

    def lookup(self, tokens: Sequence[int], request: RequestInfo) -> int:
        return min(engine.lookup(tokens, request=request) for engine in self.engines)

    def close(self) -> None:
        pass
