"""Whether a server that a ``rediss://`` (``valkeys://``) URL names answers without TLS.

A plain server reads the TLS handshake as an inline command that never ends (or, where the
handshake's random bytes hold a newline, as an unknown command): the client's handshake
times out, or fails on an answer that is no TLS. Either reads as the server being slow or
down, retried for ever. A plain ``PING`` on a connection of its own tells it: a RESP
answer (``+PONG``, ``-NOAUTH ...``) is a server that speaks no TLS on that port, which no
retry fixes (:class:`PlainServerError`, permanent as a ``ValueError``).
"""

from __future__ import annotations

import asyncio
import contextlib

#: The most of an answer the probe reads: a RESP line starts with one of these bytes.
_ANSWER_BYTES = 256
_RESP_FIRST_BYTES = b"+-"


class PlainServerError(ValueError):
    """The URL asks for TLS, and the server answers without it: permanent."""


async def plain_answer(host: str, port: int, timeout_s: float) -> bytes | None:
    """The server's answer to a plain ``PING`` when it is a RESP line, else ``None`` (no
    connection, no answer within ``timeout_s``, or an answer that is no RESP: a TLS server)."""

    async def ping() -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(b"PING\r\n")
            await writer.drain()
            return await reader.readline()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    try:
        line = await asyncio.wait_for(ping(), timeout_s)
    except (OSError, asyncio.TimeoutError, ValueError):  # (ValueError: a line past the stream's limit)
        return None
    line = line[:_ANSWER_BYTES].strip()
    return line if line[:1] and line[:1] in _RESP_FIRST_BYTES else None


async def raise_if_plain(where: str, host: str | None, port: int, timeout_s: float, failure: BaseException) -> None:
    """Raise :class:`PlainServerError` (from ``failure``, the TLS connection's) when the
    server at ``host:port`` answers a plain ``PING``; else return (``failure`` stands)."""
    if host is None:
        return
    answer = await plain_answer(host, port, timeout_s)
    if answer is not None:
        raise PlainServerError(
            f"{where} answers without TLS ({answer.decode('ascii', 'replace')!r} to a plain PING), "
            "and the url asks for TLS: use redis:// or valkey://, or turn TLS on at the server"
        ) from failure
