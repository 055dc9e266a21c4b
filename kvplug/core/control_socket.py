"""The private unix sockets a running engine answers on, and the bounded server behind them.

An engine adapter's worker answers on unix sockets: its scheduler's lookups, and the
operator's ``kvplug ctl`` (:mod:`kvplug.core.control_server`). Whatever connects,
:class:`MessageServer` holds: every message's size is checked against
``max_message_bytes`` before a byte of its body is buffered; all connections together
buffer at most ``max_buffered_bytes``; a message, once begun, must arrive within
``read_deadline_s``; a reply the client does not read within ``write_deadline_s``
closes that connection (the server never blocks on a send: sockets are non-blocking
and a connection with an unsent reply is not read from); at most ``max_connections``
are open (the one idle longest is closed for a new one); an idle connection closes
after ``idle_timeout_s``. On Linux a connection from a process of another user
(``SO_PEERCRED``) is closed before anything of it is read; an answer of ``None`` (a
malformed message) closes that connection.

The sockets live in a folder only this user can enter: ``$KVPLUG_LOOKUP_DIR`` if
set, else ``$XDG_RUNTIME_DIR/kvplug``, else ``<tmp>/kvplug-<uid>``; a candidate that
is a link, owned by another user or open to others is refused, and then a fresh
``mkdtemp`` folder is used and exported as ``$KVPLUG_LOOKUP_DIR`` so that the
processes this one starts (an engine's workers) find the same folder.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import stat
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvplug.errors import UnsafeSocketPathError

logger = logging.getLogger("kvplug.socket")

LOOKUP_DIR_ENV = "KVPLUG_LOOKUP_DIR"
_LEN = struct.Struct("<I")


# --- the private folder --------------------------------------------------------------------

_dir_lock = threading.Lock()
_dir: Path | None = None


def private_socket_dir() -> Path:
    """This user's private folder for kvplug's sockets (resolved once per process; see the module doc)."""
    global _dir
    with _dir_lock:
        if _dir is not None and os.environ.get(LOOKUP_DIR_ENV, str(_dir)) == str(_dir):
            return _dir
        _dir = _resolve_dir()
        os.environ[LOOKUP_DIR_ENV] = str(_dir)  # the processes this one starts use the same folder
        return _dir


def _resolve_dir() -> Path:
    explicit = os.environ.get(LOOKUP_DIR_ENV)
    if explicit:
        problem = _make_private(Path(explicit))
        if problem:
            raise UnsafeSocketPathError(f"{LOOKUP_DIR_ENV}={explicit} cannot hold kvplug sockets: {problem}")
        return Path(explicit)
    candidates = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and not _check_private(Path(runtime)):
        candidates.append(Path(runtime) / "kvplug")
    candidates.append(Path(tempfile.gettempdir()) / f"kvplug-{os.getuid()}")
    for candidate in candidates:
        problem = _make_private(candidate)
        if not problem:
            return candidate
        logger.warning("not using %s for kvplug sockets: %s; using a fresh private folder", candidate, problem)
    return Path(tempfile.mkdtemp(prefix=f"kvplug-{os.getuid()}-"))  # mode 0700 by construction


def _make_private(folder: Path) -> str | None:
    """Create ``folder`` (0700) if missing; what is wrong with it, or ``None``."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot create it ({exc.strerror})"
    return _check_private(folder)


def _check_private(folder: Path) -> str | None:
    try:
        info = os.lstat(folder)
    except OSError as exc:
        return f"cannot inspect it ({exc.strerror})"
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    if info.st_uid != os.getuid():
        return f"it is owned by uid {info.st_uid}, not {os.getuid()}"
    if info.st_mode & 0o077:
        return f"its mode is {stat.S_IMODE(info.st_mode):o}; others may enter it (want 700)"
    return None


def check_socket_file(path: Path) -> None:
    """Refuse to connect to anything but a socket this user owns, inside a private folder."""
    problem = _check_private(path.parent)
    if problem is None:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            raise ConnectionRefusedError(f"no kvplug socket at {path}") from None
        if not stat.S_ISSOCK(info.st_mode):
            problem = "it is not a socket" + (" (a symbolic link)" if stat.S_ISLNK(info.st_mode) else "")
        elif info.st_uid != os.getuid():
            problem = f"it is owned by uid {info.st_uid}"
    if problem:
        raise UnsafeSocketPathError(f"refusing socket {path}: {problem}")


def remove_stale_sockets(folder: Path, *, min_age_s: float = 60.0) -> None:
    """Remove sockets nobody listens on (their worker was killed, e.g. SIGKILL).

    Only sockets of this user, older than ``min_age_s`` (a worker starting right now
    has bound its socket but may not listen yet); links are never followed.
    """
    now = time.time()
    for candidate in folder.glob("*.sock"):
        try:
            info = os.lstat(candidate)
        except OSError:
            continue
        if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid() or now - info.st_mtime < min_age_s:
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(str(candidate))
            except ConnectionRefusedError:
                candidate.unlink(missing_ok=True)
            except OSError:
                pass


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def foreign_peer(sock: socket.socket) -> str | None:
    """Why the process at the other end of ``sock`` may not talk to us (another user), or
    ``None``. The private folder already keeps other users out; this holds even if a
    process of theirs got through it (a capability, a folder opened by mistake).
    Where the platform has no ``SO_PEERCRED`` the folder alone decides."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:  # pragma: no cover - not Linux
        return None
    try:
        pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _PEERCRED.size))
    except OSError as exc:
        return f"cannot read its credentials ({exc.strerror})"
    if uid != os.getuid():
        return f"process {pid} runs as uid {uid}, not {os.getuid()}"
    return None


# --- the server --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerLimits:
    """What one client, or all of them together, can make the server hold."""

    max_message_bytes: int = 16 * 1024 * 1024
    max_buffered_bytes: int = 64 * 1024 * 1024
    max_connections: int = 64
    read_deadline_s: float = 5.0
    write_deadline_s: float = 5.0
    idle_timeout_s: float = 600.0


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    last_active: float
    inbox: bytearray = field(default_factory=bytearray)
    body_length: int | None = None
    started: float | None = None
    outbox: bytearray = field(default_factory=bytearray)
    out_since: float | None = None


class MessageServer:
    """Length-prefixed messages on a unix socket, answered one at a time by :meth:`answer`, from one thread."""

    thread_name = "kvplug-socket-server"

    def __init__(self, path: Path, limits: ServerLimits | None = None) -> None:
        self.path = path
        self.limits = limits or ServerLimits()
        problem = _check_private(path.parent)
        if problem:
            raise UnsafeSocketPathError(f"refusing to serve in {path.parent}: {problem}")
        remove_stale_sockets(path.parent)
        self._remove_own_socket()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        os.chmod(path, 0o600, follow_symlinks=False)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._connections: dict[socket.socket, _Connection] = {}
        self._buffered = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def answer(self, body: bytes) -> bytes | None:
        """The reply to one message; ``None`` closes the connection (a malformed message).
        It never raises: a request that fails gets an error reply."""
        raise NotImplementedError

    @property
    def buffered_bytes(self) -> int:
        """Bytes of unfinished messages held for all connections (bounded by the limits)."""
        return self._buffered

    @property
    def connections(self) -> int:
        return len(self._connections)

    def close(self) -> None:
        """Stop the thread, close every socket and remove the socket file."""
        if self._stopping:
            return
        self._stopping = True
        self._wake_w.send(b"x")
        self._thread.join(timeout=10)
        for conn in list(self._connections.values()):
            conn.sock.close()
        self._connections.clear()
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        self._remove_own_socket()

    def _remove_own_socket(self) -> None:
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(info.st_mode) and not stat.S_ISLNK(info.st_mode):
            raise UnsafeSocketPathError(f"{self.path} exists and is not a socket; not removing it")
        self.path.unlink(missing_ok=True)  # a link itself is removed, never its target

    # --- event loop ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            for key, events in self._selector.select(timeout=self._next_timeout()):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is not self._wake_r:
                    conn = self._connections.get(key.fileobj)  # type: ignore[call-overload]
                    if conn is None:
                        continue
                    try:
                        if events & selectors.EVENT_WRITE:
                            self._flush(conn)
                        elif events & selectors.EVENT_READ:
                            self._receive(conn)
                    except OSError as exc:
                        self._drop(conn, f"socket error: {exc}")
            self._expire(time.monotonic())

    def _next_timeout(self) -> float:
        return min(1.0, self.limits.read_deadline_s / 4, self.limits.write_deadline_s / 4)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.warning("%s: accept failed: %s", self.path.name, exc)
                return
            # The peer first: another user's connection must not cost the owner one of theirs.
            refused = foreign_peer(sock)
            if refused is not None:
                logger.warning("%s: refusing a connection: %s", self.path.name, refused)
                sock.close()
                continue
            if len(self._connections) >= self.limits.max_connections:
                oldest = min(self._connections.values(), key=lambda c: c.last_active)
                self._drop(oldest, f"{self.limits.max_connections} connections open; closing the one idle longest")
            sock.setblocking(False)
            self._connections[sock] = _Connection(sock, time.monotonic())
            self._selector.register(sock, selectors.EVENT_READ, None)

    def _receive(self, conn: _Connection) -> None:
        header = _LEN.size
        want = header - len(conn.inbox) if conn.body_length is None else conn.body_length - len(conn.inbox)
        want = min(want, 1 << 20)
        if self._buffered + want > self.limits.max_buffered_bytes:
            self._drop(conn, f"clients hold {self._buffered} buffered bytes, the limit of all connections")
            return
        try:
            data = conn.sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            self._drop(conn, None)
            return
        now = time.monotonic()
        conn.last_active = now
        if conn.started is None:
            conn.started = now
        conn.inbox += data
        self._buffered += len(data)
        if conn.body_length is None and len(conn.inbox) == header:
            (length,) = _LEN.unpack(conn.inbox)
            if length > self.limits.max_message_bytes:
                self._drop(conn, f"message of {length} bytes is over the {self.limits.max_message_bytes} limit")
                return
            conn.body_length = length
            conn.inbox.clear()
            self._buffered -= header
        if conn.body_length is not None and len(conn.inbox) == conn.body_length:
            body = bytes(conn.inbox)
            self._buffered -= len(conn.inbox)
            conn.inbox.clear()
            conn.body_length = conn.started = None
            try:
                reply = self.answer(body)
            except Exception:  # one request's failure ends that request only, never the serving thread
                logger.exception("%s: answering a request failed", self.path.name)
                reply = None
            if reply is None:
                self._drop(conn, "a malformed message")
                return
            conn.outbox += _LEN.pack(len(reply)) + reply
            conn.out_since = now
            self._flush(conn)

    def _flush(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        del conn.outbox[:sent]
        # While a reply waits, the connection is not read: a client that never reads
        # replies stalls only itself, and its unread replies cannot pile up here.
        wanted = selectors.EVENT_WRITE if conn.outbox else selectors.EVENT_READ
        if not conn.outbox:
            conn.out_since = None
        if self._selector.get_key(conn.sock).events != wanted:
            self._selector.modify(conn.sock, wanted, None)

    def _expire(self, now: float) -> None:
        limits = self.limits
        for conn in list(self._connections.values()):
            if conn.started is not None and now - conn.started > limits.read_deadline_s:
                self._drop(conn, f"a message did not arrive within {limits.read_deadline_s} s")
            elif conn.out_since is not None and now - conn.out_since > limits.write_deadline_s:
                self._drop(conn, f"a reply was not read within {limits.write_deadline_s} s")
            elif conn.started is None and conn.out_since is None and now - conn.last_active > limits.idle_timeout_s:
                self._drop(conn, None)

    def _drop(self, conn: _Connection, reason: str | None) -> None:
        if reason:
            logger.warning("%s: closing a connection: %s", self.path.name, reason)
        if self._connections.pop(conn.sock, None) is None:
            return
        self._buffered -= len(conn.inbox)
        self._selector.unregister(conn.sock)
        conn.sock.close()
