"""Replies bounded before they are read: a server's announced length is checked first.

A RESP bulk string starts with its length (``$<n>``), and valkey-py's parser then waits
for all ``n`` bytes, buffering them: a hostile or broken server that announces a gigabyte
makes a reader buffer up to its deadline times the bandwidth before the call fails.
The tier knows how big a record can be (its ``max_record_bytes``; reads ask for at most
one byte more, ``GETRANGE``), so a longer announced reply is refused before any of it is
read: :class:`ReplyTooLongError` fails the call (a miss), and the client drops the
connection, whose stream is mid-reply. Replies of other commands (``INFO``, ``SCAN``
pages) stay well under :data:`MIN_REPLY_BOUND`; an array is bounded in elements too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from valkey import exceptions as vex
from valkey._parsers import _AsyncRESP2Parser

#: The bound of a reply whatever the record bound (INFO's text, a page of SCAN).
MIN_REPLY_BOUND = 1024**2
#: Valkey's own largest string (``proto-max-bulk-len``'s default), for when no record bound is known.
NO_RECORD_BOUND = 512 * 1024**2
#: Most elements of one array reply (a SCAN page holds about ``SCAN_COUNT`` keys).
MAX_ARRAY_ELEMENTS = 1024**2


class ReplyTooLongError(vex.InvalidResponse):
    """The server announced a reply longer than any this client asked for."""


def bounded_parser(record_bound: Callable[[], int | None]) -> type[_AsyncRESP2Parser]:
    """A RESP2 parser class that refuses a bulk string over ``record_bound() + 1`` bytes
    (at least :data:`MIN_REPLY_BOUND`) and an array over :data:`MAX_ARRAY_ELEMENTS`,
    before reading it. ``record_bound`` is read at each reply (the engine may raise it)."""

    class BoundedParser(_AsyncRESP2Parser):
        async def _read(self, length: int) -> bytes:
            bound = record_bound()
            limit = max(MIN_REPLY_BOUND, NO_RECORD_BOUND if bound is None else bound + 1)
            if length > limit:
                raise ReplyTooLongError(
                    f"the server announced a reply of {length} bytes, over the {limit} bytes a record "
                    "of this store can be (refused unread; the connection is dropped)"
                )
            data: bytes = await super()._read(length)
            return data

        async def _readline(self) -> bytes:
            line: bytes = await super()._readline()
            if line[:1] == b"*" and line[1:].isdigit() and int(line[1:]) > MAX_ARRAY_ELEMENTS:
                raise ReplyTooLongError(
                    f"the server announced an array of {int(line[1:])} elements, over {MAX_ARRAY_ELEMENTS}"
                )
            return line

    return BoundedParser


def bound_replies(client: Any, parser: type[_AsyncRESP2Parser]) -> Any:
    """Make every connection ``client`` opens from now on parse with ``parser``."""
    client.connection_pool.connection_kwargs["parser_class"] = parser
    return client
