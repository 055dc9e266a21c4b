"""The bounded server behind kvplug's private unix sockets: :class:`MessageServer`.

An engine adapter's worker answers on unix sockets in this user's private folder
(:mod:`kvplug.core.control_socket`): its scheduler's lookups, and the operator's
``kvplug ctl`` (:mod:`kvplug.core.control.server`). Whatever connects,
:class:`MessageServer` holds: every message's size is checked against
``max_message_bytes`` before a byte of its body is buffered; all connections together
buffer at most ``max_buffered_bytes`` (a connection that would go over it is not read from
until others' messages are answered or dropped: it waits; when all that hold bytes wait, the
one holding most is closed); a message, once begun, must arrive within
``read_deadline_s``; a reply the client does not read within ``write_deadline_s``
closes that connection (the server never blocks on a send: sockets are non-blocking
and a connection with an unsent reply is not read from); at most ``max_connections``
are open (the one idle longest is closed for a new one); an idle connection closes
after ``idle_timeout_s``. On Linux a connection from a process of another user
(``SO_PEERCRED``) is closed before anything of it is read; an answer of ``None`` (a
malformed message) closes that connection.

By default the server's one thread answers every message, one at a time. A server with
``answer_threads`` (the control server: one request may take long, a ``clear`` of many
chunks) answers on that many threads of its own while its thread goes on serving the
other connections: a slow answer holds up only the connection that asked (it is not
read from until answered). A connection waiting for its answer is never closed to make
room: while every connection allowed waits for one, no new connection is accepted, and
newcomers wait in the kernel's backlog (a client waits out its own timeout there).
"""

from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from queue import SimpleQueue
from typing import ClassVar

from kvplug.core.control.socket_file import bind_private_socket, remove_socket_file
from kvplug.core.control_socket import foreign_peer

logger = logging.getLogger("kvplug.socket")

_LEN = struct.Struct("<I")


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
    #: An answer thread has its message: it is not read from, nor closed for room.
    answering: bool = False
    #: Not read from (not registered) until other connections' buffered bytes go.
    paused: bool = False


class MessageServer:
    """Length-prefixed messages on a unix socket, answered by :meth:`answer`: on the server's
    thread one at a time, or with ``answer_threads`` on that many threads at once."""

    thread_name = "kvplug-socket-server"
    #: Threads that answer messages (0: the server's own thread, one message at a time).
    answer_threads: ClassVar[int] = 0

    def __init__(self, path: Path, limits: ServerLimits | None = None) -> None:
        self.path = path
        self.limits = limits or ServerLimits()
        self._listener, self._inode = bind_private_socket(path)  # close removes only this file
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._connections: dict[socket.socket, _Connection] = {}
        self._paused: list[_Connection] = []
        self._buffered = 0
        self._stopping = False
        self._listening = True
        # With answer threads: messages for them, the replies they finished (for the server's
        # thread to send), the threads (started as needed), and the messages being answered.
        self._questions: SimpleQueue[tuple[_Connection, bytes] | None] = SimpleQueue()
        self._answered: deque[tuple[_Connection, bytes | None]] = deque()
        self._answerers: list[threading.Thread] = []
        self._in_flight = 0
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
        self._wake()
        self._thread.join(timeout=10)
        for _ in self._answerers:  # an answer still running finds the server gone and is dropped
            self._questions.put(None)
        for conn in list(self._connections.values()):
            conn.sock.close()
        self._connections.clear()
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        remove_socket_file(self.path, self._inode)

    def remove_file(self) -> None:
        """Remove the socket file only, the server left running: for a process about to be
        ended by a signal, where nothing else would run (safe in a signal handler)."""
        remove_socket_file(self.path, self._inode)

    # --- event loop ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            for key, events in self._selector.select(timeout=self._next_timeout()):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    self._take_answers()
                else:
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
            self._resume()
            if not self._listening and self._has_room():
                self._listening = True
                self._selector.register(self._listener, selectors.EVENT_READ, None)

    def _next_timeout(self) -> float:
        return min(1.0, self.limits.read_deadline_s / 4, self.limits.write_deadline_s / 4)

    def _has_room(self) -> bool:
        """Whether a new connection can be accepted: under the cap, or one open is not being answered."""
        conns = self._connections.values()
        return len(conns) < self.limits.max_connections or not all(c.answering for c in conns)

    def _accept(self) -> None:
        while True:
            if not self._has_room():  # newcomers wait in the backlog: no request being answered is dropped
                self._listening = False
                self._selector.unregister(self._listener)
                return
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
                idle = [c for c in self._connections.values() if not c.answering]
                oldest = min(idle, key=lambda c: c.last_active)
                self._drop(oldest, f"{self.limits.max_connections} connections open; closing the one idle longest")
            sock.setblocking(False)
            self._connections[sock] = _Connection(sock, time.monotonic())
            self._selector.register(sock, selectors.EVENT_READ, None)

    def _receive(self, conn: _Connection) -> None:
        header = _LEN.size
        want = header - len(conn.inbox) if conn.body_length is None else conn.body_length - len(conn.inbox)
        room = self.limits.max_buffered_bytes - self._buffered
        if room <= 0:
            # Other connections hold the budget: this one waits (unread) until their messages
            # are answered or dropped (their read deadline bounds the wait), never refused.
            conn.paused = True
            self._selector.unregister(conn.sock)
            self._paused.append(conn)
            return
        want = min(want, 1 << 20, room)
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
            if self.answer_threads <= 0:
                self._reply(conn, self._answer_safely(body))
                return
            conn.answering = True
            self._selector.unregister(conn.sock)  # one message at a time per connection
            self._questions.put((conn, body))
            self._in_flight += 1
            if len(self._answerers) < min(self._in_flight, self.answer_threads):
                answerer = threading.Thread(target=self._answer_loop, name=f"{self.thread_name}-answer", daemon=True)
                answerer.start()
                self._answerers.append(answerer)

    def _resume(self) -> None:
        """Read again from paused connections while the budget has room. When every connection
        holding bytes waits for room (none can finish), the one holding most is closed."""
        while self._paused and self._buffered < self.limits.max_buffered_bytes:
            conn = self._paused.pop(0)
            if self._connections.get(conn.sock) is conn:
                conn.paused = False
                if conn.started is not None:  # its deadline counts from now: the wait was the server's
                    conn.started = time.monotonic()
                self._selector.register(conn.sock, selectors.EVENT_READ, None)
        if self._paused and self._buffered >= self.limits.max_buffered_bytes:
            holders = [c for c in self._connections.values() if c.inbox]
            if holders and all(c.paused for c in holders):
                largest = max(holders, key=lambda c: len(c.inbox))
                self._drop(
                    largest,
                    f"every connection holding bytes waits for room; closing the one holding {len(largest.inbox)}",
                )
                self._resume()

    def _answer_safely(self, body: bytes) -> bytes | None:
        try:
            return self.answer(body)
        except Exception:  # one request's failure ends that request only, never a serving thread
            logger.exception("%s: answering a request failed", self.path.name)
            return None

    def _answer_loop(self) -> None:
        while (question := self._questions.get()) is not None:
            if self._stopping:  # closed: nobody is there to send a reply to
                continue
            conn, body = question
            self._answered.append((conn, self._answer_safely(body)))
            self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # full: a wake-up is pending anyway; closed: the server has stopped
            pass

    def _take_answers(self) -> None:
        """Send the replies the answer threads finished (on the server's thread)."""
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while self._answered:
            conn, reply = self._answered.popleft()
            conn.answering = False
            self._in_flight -= 1
            if self._connections.get(conn.sock) is not conn:
                continue
            self._selector.register(conn.sock, selectors.EVENT_READ, None)
            try:
                self._reply(conn, reply)
            except OSError as exc:  # e.g. the client left while its request was answered
                self._drop(conn, f"socket error: {exc}")

    def _reply(self, conn: _Connection, reply: bytes | None) -> None:
        if reply is None:
            self._drop(conn, "a malformed message")
            return
        conn.outbox += _LEN.pack(len(reply)) + reply
        conn.out_since = time.monotonic()
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
            if conn.answering or conn.paused:  # waiting on the server, not on its client
                continue
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
        if not conn.answering and not conn.paused:  # else not registered now
            self._selector.unregister(conn.sock)
        conn.sock.close()
