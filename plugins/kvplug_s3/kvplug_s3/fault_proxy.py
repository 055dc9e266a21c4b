"""For tests of the s3 tier: a TCP proxy on 127.0.0.1 in front of a real S3 server that
injects network faults (delays, cut connections, refused connections, HTTP 503 answers,
a hung server). Part of kvplug-s3's test kit (:mod:`kvplug_s3.testing` re-exports it);
no runtime module imports it."""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

from kvplug.testing import free_port

__all__ = ["FaultProxy", "free_port"]

#: A request line; not anchored, since a request may follow a body in the same read.
_REQUEST_LINE = re.compile(rb"(GET|PUT|HEAD|POST|DELETE) /\S* HTTP/1\.1\r\n")


class FaultProxy:
    """A TCP proxy on 127.0.0.1 to ``target_port`` whose behaviour can be switched:

    - ``pass``: forward bytes both ways;
    - ``delay``: hold every chunk ``delay_s`` seconds before forwarding it;
    - ``cut``: reset every connection (new and open ones);
    - ``refuse``: stop listening, so connecting fails with ECONNREFUSED;
    - ``http503``: answer every request ``HTTP/1.1 503`` itself;
    - ``forbid_puts``: answer a PUT ``HTTP/1.1 403 Forbidden`` itself, with no S3 error in
      its body (what a proxy or gateway in front of the store says); forward the rest;
    - ``hang``: accept connections and read requests, never answer.

    ``requests`` counts the HTTP requests forwarded to the server, per method;
    ``forbidden`` the PUTs ``forbid_puts`` answered;
    ``answered_bytes`` the bytes of the server's answers forwarded to clients;
    ``swallowed_bytes`` the bytes ``hang`` read and never answered.
    """

    def __init__(self, target_port: int, *, delay_s: float = 5.0) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.mode = "pass"
        #: 0 until the first listen binds a port the OS picks (a port probed free and let go could
        #: be taken before the bind); later listens (after ``refuse``) keep it: clients know it.
        self.port = 0
        self.connections = 0
        self.forwarded_bytes = 0
        self.answered_bytes = 0
        self.swallowed_bytes = 0
        self.requests: dict[str, int] = {}
        self.forbidden = 0
        self._open: set[asyncio.StreamWriter] = set()
        self._server: asyncio.base_events.Server | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        self._call(self._listen())

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_mode(self, mode: str) -> None:
        assert mode in ("pass", "delay", "cut", "refuse", "http503", "forbid_puts", "hang"), mode
        self._call(self._switch(mode))

    def close(self) -> None:
        self._call(self._switch("refuse"))
        self._call(self._end_handlers())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _end_handlers(self) -> None:
        # Handlers left pending when the loop stops would be reported as destroyed tasks;
        # their connections were aborted, so they end at their next read.
        handlers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        if handlers:
            await asyncio.wait(handlers, timeout=2)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _switch(self, mode: str) -> None:
        self.mode = mode
        if mode in ("cut", "refuse", "http503", "forbid_puts", "hang"):
            for writer in list(self._open):  # open keep-alive connections must see the fault too
                writer.transport.abort()
            self._open.clear()
        if mode == "refuse" and self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        elif mode != "refuse" and self._server is None:
            await self._listen()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.mode == "cut":
            writer.transport.abort()
            return
        if self.mode == "http503":
            await self._answer_503(reader, writer)
            return
        if self.mode == "hang":
            self._open.add(writer)
            while data := await reader.read(1 << 16):
                self.swallowed_bytes += len(data)
            self._open.discard(writer)
            return
        head = b""
        if self.mode == "forbid_puts":
            head = await self._request_head(reader)
            if head.startswith(b"PUT "):
                self.forbidden += 1
                await self._answer_403(reader, writer, head)
                return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._open.update((writer, up_writer))
        if head:
            self._count_requests(head)
            up_writer.write(head)
        await asyncio.gather(
            self._pipe(reader, up_writer, count=True),
            self._pipe(up_reader, writer, answer=True),
            return_exceptions=True,
        )
        for w in (writer, up_writer):
            self._open.discard(w)
            w.transport.abort()

    def total_requests(self) -> int:
        return sum(self.requests.values())

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, count: bool = False, answer: bool = False
    ) -> None:
        tail = b""
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            if self.mode == "delay":
                await asyncio.sleep(self.delay_s)
            if self.mode not in ("pass", "delay", "forbid_puts"):
                break
            if count:
                self.forwarded_bytes += len(data)
                # Request lines, also when one is split across two reads (bodies are
                # test values, which never hold a request line).
                window = tail + data
                self._count_requests(window, after=len(tail))
                tail = window[-200:]
            if answer:
                self.answered_bytes += len(data)
            writer.write(data)
            await writer.drain()
        writer.transport.abort()

    def _count_requests(self, window: bytes, after: int = 0) -> None:
        for match in _REQUEST_LINE.finditer(window):
            if match.end() > after:  # lines wholly before ``after`` were counted already
                name = match.group(1).decode()
                self.requests[name] = self.requests.get(name, 0) + 1

    @staticmethod
    async def _request_head(reader: asyncio.StreamReader) -> bytes:
        """The request line and headers of a connection's first request, with
        ``Connection: close`` added, so that each request comes on a connection of its
        own and ``forbid_puts`` sees every one."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError):
            return b""
        kept = [line for line in head[:-4].split(b"\r\n") if not line.lower().startswith(b"connection:")]
        return b"\r\n".join([*kept, b"Connection: close"]) + b"\r\n\r\n"

    @staticmethod
    async def _answer_403(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        # Read the body first (unless the client waits for a 100-continue): a client still
        # sending it would see the connection reset rather than the answer.
        length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        if length and not re.search(rb"(?im)^expect:\s*100-continue", head):
            try:
                await asyncio.wait_for(reader.readexactly(int(length.group(1))), 5)
            except (asyncio.IncompleteReadError, asyncio.TimeoutError):
                pass
        body = b"<html><body><h1>403 Forbidden</h1>Request forbidden by administrative rules.</body></html>"
        await _answer_and_close(writer, b"403 Forbidden", b"text/html", body)

    @staticmethod
    async def _answer_503(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError):
            pass
        body = b"<?xml version='1.0'?><Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"
        await _answer_and_close(writer, b"503 Service Unavailable", b"application/xml", body)


async def _answer_and_close(writer: asyncio.StreamWriter, status: bytes, content_type: bytes, body: bytes) -> None:
    """Send one HTTP answer and close the connection (``Connection: close``)."""
    writer.write(
        b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
        % (status, content_type, len(body), body)
    )
    try:
        await writer.drain()
    finally:
        writer.close()
