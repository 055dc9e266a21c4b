"""For tests: a TCP proxy on 127.0.0.1 in front of a real valkey-server, switchable between faults.

- ``pass``: forward bytes both ways;
- ``delay``: hold every chunk ``delay_s`` seconds before forwarding it (a slow server);
- ``hang``: accept connections and read requests, never answer (a hung server);
- ``refuse``: stop listening (connections are refused) and reset open ones.

``connections`` and ``received_bytes`` count what reached the proxy: an open
circuit breaker must leave them unchanged.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

MODES = ("pass", "delay", "hang", "refuse")


class FaultProxy:
    def __init__(self, target_port: int, *, delay_s: float = 1.0) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.mode = "pass"
        #: 0 until the first listen binds a port the OS picks (a port probed free and let go could
        #: be taken before the bind); later listens (after ``refuse``) keep it: clients know it.
        self.port = 0
        self.connections = 0
        self.received_bytes = 0
        self._open: set[asyncio.StreamWriter] = set()
        self._server: asyncio.base_events.Server | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="valkey-fault-proxy", daemon=True)
        self._thread.start()
        self._call(self._listen())

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def traffic(self) -> tuple[int, int]:
        return self.connections, self.received_bytes

    def set_mode(self, mode: str) -> None:
        assert mode in MODES, mode
        self._call(self._switch(mode))

    def close(self) -> None:
        self._call(self._switch("refuse"))
        self._call(self._cancel_handlers())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _cancel_handlers(self) -> None:
        current = asyncio.current_task()
        pending = [task for task in asyncio.all_tasks() if task is not current]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _switch(self, mode: str) -> None:
        self.mode = mode
        if mode == "refuse":
            for writer in list(self._open):
                writer.transport.abort()
            self._open.clear()
            if self._server is not None:
                self._server.close()
                await self._server.wait_closed()
                self._server = None
        elif self._server is None:
            await self._listen()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._open.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._open.add(up_writer)
        await asyncio.gather(
            self._pipe(reader, up_writer, count=True), self._pipe(up_reader, writer), return_exceptions=True
        )
        for w in (writer, up_writer):
            self._open.discard(w)
            w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, count: bool = False) -> None:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            if count:
                self.received_bytes += len(data)
            if self.mode == "delay":
                await asyncio.sleep(self.delay_s)
            while self.mode == "hang":  # swallow: the client waits for an answer that never comes
                await asyncio.sleep(0.05)
            if self.mode == "refuse":
                break
            writer.write(data)
            await writer.drain()
        writer.transport.abort()


class SilentListener:
    """A TCP listener on 127.0.0.1 that accepts connections and never answers (a hung server from the start)."""

    def __init__(self) -> None:
        import socket

        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(64)  # the kernel completes handshakes; nobody ever reads
        self.port = int(self._socket.getsockname()[1])

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self._socket.close()
