"""A corrupt object is deleted only while it is still the object read (``If-Match`` on its
ETag): a good record another engine stored under its name since survives. A server that
ignores ``If-Match`` on DELETE keeps corrupt objects (the tier takes them for absent)."""

from __future__ import annotations

import asyncio
import hashlib
import threading

from kvplug.cli.store import _check_all
from kvplug.testing import key_for, tier_context, value_for
from kvplug.testing.corrupt_races import (
    check_remove_if_same_keeps_a_newer_value,
    storing_after_gc_read,
    storing_before_corrupt_removal,
)
from kvplug_s3 import S3Tier
from kvplug_s3.testing import BUCKET, s3_options

KEY = key_for("raced")
VALUE = value_for("raced", 4000)


def object_name(prefix: str) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"{prefix}/{digest[:2]}/{digest}"


def names_under(client, prefix: str) -> list[str]:
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    return sorted(item["Key"] for item in listing.get("Contents", []))


def damage(client, prefix: str) -> None:
    body = bytearray(client.get_object(Bucket=BUCKET, Key=object_name(prefix))["Body"].read())
    body[100] ^= 1
    client.put_object(Bucket=BUCKET, Key=object_name(prefix), Body=bytes(body))


def config(endpoint: str, prefix: str) -> S3Tier.Config:
    return S3Tier.Config(**s3_options(endpoint, prefix))


class IfMatchStripper:
    """A TCP proxy to an S3 server that renames every ``If-Match`` request header: a server
    that ignores conditional deletes, as some S3-compatible stores do."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0),
            self._loop,  # port 0: a probed one could be taken
        ).result(10)
        self.port = int(self._server.sockets[0].getsockname()[1])

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, strip: bool) -> None:
            try:
                while chunk := await source.read(1 << 16):
                    sink.write(chunk.replace(b"\r\nIf-Match:", b"\r\nX-Ignore:") if strip else chunk)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def test_a_good_record_stored_after_the_corrupt_read_is_not_deleted(s3_server) -> None:
    prefix = f"race-{type(s3_server).__name__}"
    client = s3_server.client()
    other = S3Tier(config(s3_server.endpoint, prefix), tier_context())  # another engine on the bucket
    stored_again: list[bool] = []

    def store_again() -> None:
        other.put([(KEY, VALUE)])
        stored_again.append(True)

    RacedTier = storing_before_corrupt_removal(S3Tier, store_again)
    tier = RacedTier(config(s3_server.endpoint, prefix), tier_context())
    try:
        other.put([(KEY, VALUE)])
        damage(client, prefix)
        assert tier.get([KEY]) == [None]
        assert stored_again and tier.stats().extra["corrupt"] == 1
        assert names_under(client, prefix) == [object_name(prefix)], "the good record another engine stored was deleted"
        assert [bytes(v) for v in tier.get([KEY]) if v is not None] == [VALUE]
    finally:
        tier.close()
        other.close()


def test_a_corrupt_object_nobody_replaced_is_deleted(s3_server) -> None:
    prefix = f"plain-{type(s3_server).__name__}"
    client = s3_server.client()
    tier = S3Tier(config(s3_server.endpoint, prefix), tier_context())
    try:
        tier.put([(KEY, VALUE)])
        damage(client, prefix)
        assert tier.get([KEY]) == [None]
        assert names_under(client, prefix) == []  # (the server's probe object is gone too)
        assert tier.contains([KEY]) == [False]
    finally:
        tier.close()


def test_a_server_that_ignores_if_match_keeps_corrupt_objects(moto_s3) -> None:
    prefix = "ignores-if-match"
    client = moto_s3.client()
    proxy = IfMatchStripper(int(moto_s3.endpoint.rsplit(":", 1)[1]))
    tier = S3Tier(config(proxy.endpoint, prefix), tier_context())
    try:
        tier.put([(KEY, VALUE)])
        damage(client, prefix)
        assert tier.get([KEY]) == [None]
        assert tier.stats().extra["corrupt"] == 1
        # Deleted by name, a good record stored there since the read would go too: it is kept,
        # and absent to the tier, so an engine stores it again over the bad one.
        assert names_under(client, prefix) == [object_name(prefix)]
        assert tier.contains([KEY]) == [False]
        tier.put([(KEY, VALUE)])
        assert [bytes(v) for v in tier.get([KEY]) if v is not None] == [VALUE]
    finally:
        tier.close()
        proxy.close()


def test_gc_keeps_a_good_record_stored_after_it_read_the_corrupt_one(moto_s3) -> None:
    prefix = "gc-race"
    client = moto_s3.client()
    other = S3Tier(config(moto_s3.endpoint, prefix), tier_context())
    other.put([(KEY, VALUE)])
    damage(client, prefix)

    RacedTier = storing_after_gc_read(S3Tier, lambda: other.put([(KEY, VALUE)]))
    tier = RacedTier(config(moto_s3.endpoint, prefix), tier_context())
    try:
        verdicts = _check_all(tier, remove=True)
        assert verdicts["corrupt"] == 1 and verdicts["removed"] == 0
        assert names_under(client, prefix) == [object_name(prefix)], "gc deleted the good record stored after its read"
        assert [bytes(v) for v in other.get([KEY]) if v is not None] == [VALUE]
    finally:
        tier.close()
        other.close()


def test_gc_on_a_server_that_ignores_if_match_removes_by_name(moto_s3) -> None:
    """There ``kvplug store gc`` cannot remove only the bad copy: it removes the corrupt object
    by name, as documented (run it when no engine writes)."""
    prefix = "gc-ignores-if-match"
    client = moto_s3.client()
    proxy = IfMatchStripper(int(moto_s3.endpoint.rsplit(":", 1)[1]))
    writer = S3Tier(config(moto_s3.endpoint, prefix), tier_context())
    writer.put([(KEY, VALUE)])
    writer.close()
    damage(client, prefix)
    tier = S3Tier(config(proxy.endpoint, prefix), tier_context())
    try:
        verdicts = _check_all(tier, remove=True)
        assert verdicts["corrupt"] == 1 and verdicts["removed"] == 1
        assert names_under(client, prefix) == []
    finally:
        tier.close()
        proxy.close()


def test_remove_if_same_keeps_a_record_another_engine_stored_since_the_read(moto_s3) -> None:
    """A load's removal of a value it found unusable (the engine's checks, not the record's)."""
    prefix = "remove-if-same"
    tier = S3Tier(config(moto_s3.endpoint, prefix), tier_context())
    other = S3Tier(config(moto_s3.endpoint, prefix), tier_context())  # another engine on the bucket
    try:
        check_remove_if_same_keeps_a_newer_value(tier, other)
        assert names_under(moto_s3.client(), prefix) == []
    finally:
        tier.close()
        other.close()


class ProbeRefuser(IfMatchStripper):
    """A TCP proxy to an S3 server that, while ``failing``, answers the ``If-Match`` probe's
    PUT with ``503 ServiceUnavailable`` itself (a server busy for a moment) and forwards
    everything else as it is."""

    failing = True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, requests: bool) -> None:
            try:
                while chunk := await source.read(1 << 16):
                    if requests and self.failing and b"PUT /" in chunk and b".kvplug-if-match-probe-" in chunk:
                        body = b"<Error><Code>ServiceUnavailable</Code><Message>busy</Message></Error>"
                        writer.write(
                            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
                        )
                        await writer.drain()
                        break
                    sink.write(chunk)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()
                if requests:
                    writer.close()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))


def test_a_server_busy_when_asked_about_if_match_is_asked_again(moto_s3) -> None:
    # The If-Match probe met a passing failure (503): that says nothing of the server's
    # rules, so it must not decide, for the tier's lifetime, that corrupt objects are kept.
    prefix = "busy-probe"
    client = moto_s3.client()
    proxy = ProbeRefuser(int(moto_s3.endpoint.rsplit(":", 1)[1]))
    tier = S3Tier(config(proxy.endpoint, prefix), tier_context())
    try:
        tier.put([(KEY, VALUE)])
        damage(client, prefix)
        assert tier.get([KEY]) == [None]  # the probe failed: kept this time, absent to the tier
        assert names_under(client, prefix) == [object_name(prefix)]
        proxy.failing = False  # the server answers again
        tier.put([(KEY, VALUE)])
        damage(client, prefix)
        assert tier.get([KEY]) == [None]
        assert tier.stats().extra["corrupt"] == 2
        assert names_under(client, prefix) == [], "a corrupt object is kept for good after one 503"
    finally:
        tier.close()
        proxy.close()
