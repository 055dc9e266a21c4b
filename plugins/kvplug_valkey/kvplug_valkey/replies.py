"""Replies bounded before they are read: a server's announced length is checked first.

A RESP bulk string starts with its length (``$<n>``), and valkey-py's parser then waits
for all ``n`` bytes, buffering them: a hostile or broken server that announces a gigabyte
makes a reader buffer up to its deadline times the bandwidth before the call fails.
The tier knows how big a record can be (its ``max_record_bytes``; reads ask for at most
one byte more, ``GETRANGE``), so a longer announced reply is refused before any of it is
read: :class:`ReplyTooLongError` fails the call (a miss), and the client drops the
connection, whose stream is mid-reply. Replies of other commands (``INFO``, ``SCAN``
pages) stay well under :data:`MIN_REPLY_BOUND`. The bound is of the reply as a whole (its
strings' bytes, its arrays' elements at every depth): an array of strings each within the
bound, or of arrays each within it, would otherwise be as long as the server likes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from valkey import exceptions as vex
from valkey._parsers import _AsyncRESP2Parser
from valkey._parsers.socket import SERVER_CLOSED_CONNECTION_ERROR
from valkey.asyncio.cluster import ClusterParser

#: The bound of a reply whatever the record bound (INFO's text, a page of SCAN).
MIN_REPLY_BOUND = 1024**2
#: Valkey's own largest string (``proto-max-bulk-len``'s default), for when no record bound is known.
NO_RECORD_BOUND = 512 * 1024**2
#: Bulk strings from this size on (records) are read by :meth:`BoundedParser._read_large`.
LARGE_STRING = 64 * 1024
#: The most :meth:`BoundedParser._read_large` allocates for a string before its bytes arrive.
FIRST_BUFFER = 4 * 1024**2
#: Most elements of one array reply (a SCAN page holds about ``SCAN_COUNT`` keys).
MAX_ARRAY_ELEMENTS = 1024**2


class ReplyTooLongError(vex.InvalidResponse):
    """The server announced a reply longer than any this client asked for."""


def bounded_parser(record_bound: Callable[[], int | None]) -> type[_AsyncRESP2Parser]:
    """A RESP2 parser class that refuses a reply whose bulk strings add up to over
    ``record_bound() + 1`` bytes (at least :data:`MIN_REPLY_BOUND`), or whose arrays, at
    every depth, to over :data:`MAX_ARRAY_ELEMENTS` elements, before reading past the bound.
    ``record_bound`` is read at each reply (the engine may raise it)."""

    class BoundedParser(_AsyncRESP2Parser):
        #: Bytes of strings and elements of arrays announced so far in the reply being read:
        #: each part within its bound is not enough (an array of a thousand 1 MiB strings,
        #: arrays of a million elements in an array of a million), the reply as a whole is bounded.
        _reply_bytes = 0
        _reply_elements = 0

        async def read_response(self, disable_decoding: bool = False) -> Any:
            # (A reply that a timeout cut is parsed again from its start: counted again from zero.)
            self._reply_bytes = self._reply_elements = 0
            return await super().read_response(disable_decoding=disable_decoding)

        async def _read(self, length: int) -> bytes:
            bound = record_bound()
            limit = max(MIN_REPLY_BOUND, NO_RECORD_BOUND if bound is None else bound + 1)
            self._reply_bytes += max(0, length)
            if self._reply_bytes > limit:
                raise ReplyTooLongError(
                    f"the server announced a reply of {self._reply_bytes} bytes, over the {limit} bytes a record "
                    "of this store can be (refused unread; the connection is dropped)"
                )
            if length < LARGE_STRING or len(self._buffer) > self._pos:  # (buffered: a reply parsed again)
                data: bytes = await super()._read(length)
                return data
            return await self._read_large(length)  # type: ignore[return-value]  # (a Buffer, as the tier takes)

        async def _read_large(self, length: int) -> memoryview:
            """A record's bytes, copied as they arrive into one buffer. asyncio's
            ``readexactly``, which the parser uses, first gathers them all in the stream's own
            buffer (growing and moving it, pausing and resuming the socket at each read past the
            stream's limit), then copies them out, and the parser copies them once more. The
            buffer is of the announced length only up to :data:`FIRST_BUFFER`, then doubles as
            the bytes arrive: a server announcing 512 MiB and sending nothing would otherwise
            have the reader hold as much (on each of its connections) until the deadline."""
            want = length + 2
            whole = bytearray(min(want, FIRST_BUFFER))
            got = 0
            while got < want:
                chunk = await self._stream.read(want - got)
                if not chunk:
                    raise vex.ConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
                self._chunks.append(chunk)  # as the parser keeps what it read: a reply cut is parsed again
                end = got + len(chunk)
                if end > len(whole):
                    whole.extend(bytes(min(want, max(end, 2 * len(whole))) - len(whole)))
                whole[got:end] = chunk
                got = end
            self._pos += want
            return memoryview(whole)[:-2]

        async def _readline(self) -> bytes:
            line: bytes = await super()._readline()
            if line[:1] == b"*":
                try:  # as the parser reads it (int() also takes "+5", " 5", "5_000")
                    count = int(line[1:])
                except ValueError:
                    return line  # the parser refuses it
                self._reply_elements += max(0, count)
                if self._reply_elements > MAX_ARRAY_ELEMENTS:
                    raise ReplyTooLongError(
                        f"the server announced arrays of {self._reply_elements} elements in one reply, "
                        f"over {MAX_ARRAY_ELEMENTS}"
                    )
            return line

    return BoundedParser


def bound_replies(client: Any, parser: type[_AsyncRESP2Parser]) -> Any:
    """Make every connection ``client`` opens from now on parse with ``parser``."""
    client.connection_pool.connection_kwargs["parser_class"] = parser
    return client


def bound_cluster_replies(cluster: Any, parser: type[_AsyncRESP2Parser]) -> Any:
    """Make every connection of a ``ValkeyCluster`` client (its slot map's ``CLUSTER SLOTS``
    and ``CLUSTER SHARDS``) parse with ``parser``, keeping the redirections
    (``MOVED``, ``ASK``) that the cluster's own parser raises as its errors."""
    bounded = type("BoundedClusterParser", (parser,), {"EXCEPTION_CLASSES": ClusterParser.EXCEPTION_CLASSES})
    cluster.connection_kwargs["parser_class"] = bounded  # (the nodes it finds: made from this mapping)
    for node in cluster.nodes_manager.startup_nodes.values():  # made already, from a copy of it
        node.connection_kwargs["parser_class"] = bounded
    return cluster
