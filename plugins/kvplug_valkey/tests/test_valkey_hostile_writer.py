"""What a writer of the server can make a reader do: a value too big for any record of the
engine is a miss, and the server sends no more of it than the bound."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import pytest
import valkey
import valkey.asyncio
from valkey_helpers import fresh_prefix

from kvplug import key_digest
from kvplug.core.records.frame import pack_record
from kvplug.testing import key_for, tier_context, value_for
from kvplug_valkey import ValkeyTier
from kvplug_valkey.replies import MAX_ARRAY_ELEMENTS, ReplyTooLongError, bound_replies, bounded_parser

#: The largest record the reading engine can store or read (its ``max_record_bytes``).
BOUND = 64 + 64 * 1024
#: A planted value far over the bound: reading it whole would cost a reader this much.
PLANTED = 64 * 1024**2


def sent_bytes(client: valkey.Valkey) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


def test_a_value_over_the_record_bound_is_a_miss_the_server_does_not_send(valkey_server) -> None:
    prefix = fresh_prefix()
    config = ValkeyTier.Config(url=valkey_server.url, key_prefix=prefix, request_timeout_s=10.0)
    tier = ValkeyTier(config, tier_context(max_record_bytes=BOUND))
    client = valkey.Valkey.from_url(valkey_server.url)
    try:
        victim, other = key_for("planted"), key_for("kept")
        tier.put([(victim, value_for("planted", 4096)), (other, value_for("kept", 4096))])
        name = prefix.encode() + key_digest(victim).hex().encode()
        # A whole, valid record of the victim's key: only its size gives it away.
        client.set(name, pack_record(victim, b"\x07" * PLANTED))
        before = sent_bytes(client)
        got = tier.get([victim, other, key_for("never stored")])
        sent = sent_bytes(client) - before
        assert got[0] is None and bytes(got[1]) == value_for("kept", 4096) and got[2] is None
        assert sent < PLANTED // 4, f"the server sent {sent} bytes for a {PLANTED}-byte value"
        assert tier.stats().extra["corrupt"] == 1
        assert client.exists(name) == 0  # removed, as any corrupt record
        assert tier.contains([victim, other]) == [False, True]
    finally:
        tier.close()
        client.close()


class HugeReplyServer:
    """A socket server speaking just enough RESP: ``+OK`` to each command, and to a read
    (``GET``, ``GETRANGE``) a bulk string announced at ``announced`` bytes, then filler
    until the client hangs up or ``cap`` bytes are sent: a broken or hostile server."""

    def __init__(
        self,
        announced: int,
        cap: int,
        head: bytes | None = None,
        filler: bytes | None = None,
        reads: tuple[bytes, ...] = (b"GET", b"GETRANGE"),
    ) -> None:
        self.announced, self.cap, self.sent = announced, cap, 0
        #: The commands answered so (upper case).
        self.reads = reads
        #: What a read is answered (else a bulk string of ``announced`` bytes), then ``filler`` again and again.
        self.head = b"$%d\r\n" % announced if head is None else head
        self.filler = b"\x07" * 1024**2 if filler is None else filler
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = self._server.accept()
                threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection, contextlib.suppress(OSError):
            pending = b""
            while data := connection.recv(65536):
                pending += data
                while (command := _next_command(pending)) is not None:
                    name, pending = command
                    if name not in self.reads:
                        connection.sendall(b"+OK\r\n")
                        continue
                    connection.sendall(self.head)
                    while self.sent < self.cap:
                        connection.sendall(self.filler)
                        self.sent += len(self.filler)

    def close(self) -> None:
        self._server.close()


def _next_command(pending: bytes) -> tuple[bytes, bytes] | None:
    """The first whole RESP command of ``pending`` (its name, upper case) and the rest."""
    lines = pending.split(b"\r\n")
    if len(lines) < 2 or not lines[0].startswith(b"*"):
        return None
    count = int(lines[0][1:])
    if len(lines) < 2 + 2 * count:  # *N, then $len and the argument per argument, then the rest
        return None
    rest = b"\r\n".join(lines[1 + 2 * count :])
    return lines[2].upper(), rest


def test_a_reply_announced_over_the_record_bound_is_refused_unread() -> None:
    server = HugeReplyServer(announced=2 * 1024**3, cap=256 * 1024**2)
    config = ValkeyTier.Config(url=f"redis://127.0.0.1:{server.port}", cluster=False, request_timeout_s=10.0, retries=0)
    tier = ValkeyTier(config, tier_context(max_record_bytes=BOUND))
    try:
        assert tier.get([key_for("announced huge")]) == [None]
        # Refused at its announced length: the client hung up before the socket buffers filled.
        assert server.sent < 32 * 1024**2, f"the client took {server.sent} bytes of a reply it had to refuse"
        extra = tier.stats().extra
        assert extra["failures"] == 1 and extra["corrupt"] == 0, extra
    finally:
        tier.close()
        server.close()


def test_an_array_reply_is_bounded_in_bytes_as_a_whole() -> None:
    # Each string is within the bound of one (MIN_REPLY_BOUND, over the record bound here);
    # all of them together are not: the reply as a whole is bounded, or a hostile server
    # sends a reader what it likes until its deadline (here 1 GiB).
    string = b"$%d\r\n%s\r\n" % (1024**2 - 64, b"\x07" * (1024**2 - 64))
    server = HugeReplyServer(announced=0, cap=40 * 1024**2, head=b"*1024\r\n", filler=string)
    config = ValkeyTier.Config(url=f"redis://127.0.0.1:{server.port}", cluster=False, request_timeout_s=10.0, retries=0)
    tier = ValkeyTier(config, tier_context(max_record_bytes=BOUND))
    try:
        assert tier.get([key_for("array reply")]) == [None]
        assert server.sent < 32 * 1024**2, f"the client took {server.sent} bytes of a reply it had to refuse"
        assert tier.stats().extra["failures"] == 1
    finally:
        tier.close()
        server.close()


def test_nested_arrays_are_bounded_in_elements_as_a_whole() -> None:
    # Arrays of as many elements as one may hold (MAX_ARRAY_ELEMENTS) in an array as long:
    # a trillion small elements, each costing the reader a Python object. Refused once
    # MAX_ARRAY_ELEMENTS are announced in the reply as a whole, not at the client's deadline.
    inner = b"*%d\r\n%s" % (MAX_ARRAY_ELEMENTS, b":1\r\n" * MAX_ARRAY_ELEMENTS)
    server = HugeReplyServer(announced=0, cap=40 * 1024**2, head=b"*%d\r\n" % MAX_ARRAY_ELEMENTS, filler=inner)

    async def read() -> object:
        client = bound_replies(
            valkey.asyncio.Valkey(port=server.port, socket_timeout=10.0), bounded_parser(lambda: BOUND)
        )
        try:
            return await client.execute_command("GET", "k")
        finally:
            await client.aclose()

    try:
        with pytest.raises(ReplyTooLongError, match="elements"):
            asyncio.run(read())
    finally:
        server.close()


def test_a_cluster_clients_replies_are_bounded_too() -> None:
    # The cluster client's own connections (its slot map's CLUSTER SLOTS, a listing's SCAN)
    # read a reply the same way as the nodes' clients: bounded.
    string = b"$%d\r\n%s\r\n" % (1024**2 - 64, b"\x07" * (1024**2 - 64))
    server = HugeReplyServer(announced=0, cap=40 * 1024**2, head=b"*1024\r\n", filler=string, reads=(b"CLUSTER",))
    config = ValkeyTier.Config(url=f"redis://127.0.0.1:{server.port}", cluster=True, request_timeout_s=10.0, retries=0)
    tier = ValkeyTier(config, tier_context(max_record_bytes=BOUND))
    try:
        assert tier.get([key_for("cluster reply")]) == [None]
        assert server.sent < 32 * 1024**2, f"the client took {server.sent} bytes of a reply it had to refuse"
    finally:
        tier.close()
        server.close()
