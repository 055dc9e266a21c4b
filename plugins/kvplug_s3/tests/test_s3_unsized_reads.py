"""A read of the s3 tier takes at most one byte past the engine's record bound whatever
the store says of an object's size: on other async fsspec protocols (gcs, az, ...: here
a small real async filesystem whose listings misreport or omit sizes, as gcsfs and adlfs
cannot reach a real server here), on sync remote protocols (fsspec's buffered files read
ahead) and on an S3 gateway that answers without ``Content-Length`` and ignores ``Range``. An oversized record is a corrupt miss, counted
once, never a hit."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import aiohttp
import fsspec
import pytest
from aiohttp import web
from fsspec.asyn import AsyncFileSystem
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from kvplug.core.records.frame import pack_record
from kvplug.testing import key_for, tier_context, value_for
from kvplug_s3 import S3Tier
from kvplug_s3.testing import BUCKET, MotoS3, free_port, s3_options

#: The largest record the reading engine can store or read (its ``max_record_bytes``).
BOUND = 64 + 64 * 1024
#: A planted object far over the bound: reading it whole would cost a reader this much.
PLANTED = 64 * 1024**2
PROTOCOL = "kvplugobjects"
SYNC_PROTOCOL = "kvplugsyncobjects"


class RangeNotSatisfiable(Exception):
    """What a client library raises for an HTTP 416 (gcsfs's ``HttpError`` is no ``OSError``)."""


class ObjectStoreFS(AsyncFileSystem):  # type: ignore[misc]
    """An async object store in memory, like gcsfs or adlfs: flat keys, whole-object puts,
    ranged reads. Its listing reports ``listed_size`` for every object where that is set
    (a stale or lying listing; ``None``: no size at all). ``served`` counts the bytes its
    reads returned."""

    protocol = (PROTOCOL,)
    async_impl = True
    objects: ClassVar[dict[str, bytes]] = {}
    served: ClassVar[int] = 0
    listed_size: ClassVar[int | None | str] = "true"

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        try:
            data = self.objects[self._strip_protocol(path)]
        except KeyError:
            raise FileNotFoundError(path) from None
        if not data and (start is not None or end is not None):
            # A range of an empty object is unsatisfiable (HTTP 416), as GCS and Azure answer.
            raise RangeNotSatisfiable(f"416 Requested range not satisfiable: {path}")
        part = data[start:end]
        type(self).served += len(part)
        return part

    async def _pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        self.objects[self._strip_protocol(path)] = bytes(value)

    async def _rm_file(self, path: str, **kwargs: Any) -> None:
        if self.objects.pop(self._strip_protocol(path), None) is None:
            raise FileNotFoundError(path)

    def _entry(self, name: str) -> dict[str, Any]:
        size = len(self.objects[name]) if self.listed_size == "true" else self.listed_size
        return {"name": name, "size": size, "type": "file"}

    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        name = self._strip_protocol(path)
        if name not in self.objects:
            raise FileNotFoundError(path)
        return self._entry(name)

    async def _find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        root = self._strip_protocol(path).rstrip("/") + "/"
        return {name: self._entry(name) for name in sorted(self.objects) if name.startswith(root)}


@pytest.fixture
def object_store() -> Iterator[type[ObjectStoreFS]]:
    fsspec.register_implementation(PROTOCOL, ObjectStoreFS, clobber=True)
    ObjectStoreFS.objects, ObjectStoreFS.served, ObjectStoreFS.listed_size = {}, 0, "true"
    yield ObjectStoreFS
    ObjectStoreFS.objects = {}


def object_name(root: str, key: str) -> str:
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f"{root}/{digest[:2]}/{digest}"


@pytest.mark.parametrize("listed_size", ["true", 100, None], ids=["listed-true", "listed-small", "listed-none"])
def test_another_async_protocol_reads_at_most_the_bound(object_store, listed_size) -> None:
    tier = S3Tier(S3Tier.Config(url=f"{PROTOCOL}://bucket/cache"), tier_context(max_record_bytes=BOUND))
    try:
        victim, other, edge = key_for("planted"), key_for("kept"), key_for("edge")
        edge_value = value_for("edge", BOUND - 64)  # a record of exactly the bound
        tier.put([(victim, value_for("planted", 4096)), (other, value_for("kept", 4096)), (edge, edge_value)])
        planted = object_name("bucket/cache", victim)
        object_store.objects[planted] = pack_record(victim, b"\x07" * PLANTED)  # whole and valid, only too big
        object_store.listed_size = listed_size
        object_store.served = 0
        got = tier.get([victim, other, edge])
        assert got[0] is None, "a record over the bound was served"
        assert bytes(got[1]) == value_for("kept", 4096) and bytes(got[2]) == edge_value
        assert object_store.served <= 3 * (BOUND + 1), f"the reads took {object_store.served} bytes"
        # Kept (no store but S3 deletes only what is still the same), absent to this process.
        assert tier.stats().extra["corrupt"] == 1 and planted in object_store.objects
        # a listing without sizes still finds records
        assert tier.contains([victim, other, edge]) == [False, True, True]
    finally:
        tier.close()


def test_an_empty_object_on_another_async_protocol_is_a_corrupt_miss(object_store) -> None:
    """A store refuses a range of an empty object: a record too short (a miss, removed), not a
    failure of the store (which a writer of the bucket could repeat until the breaker opens)."""
    tier = S3Tier(
        S3Tier.Config(url=f"{PROTOCOL}://bucket/cache", breaker_failures=2, retries=0),
        tier_context(max_record_bytes=BOUND),
    )
    try:
        empty, other = key_for("empty"), key_for("kept")
        tier.put([(other, value_for("kept", 4096))])
        for _ in range(3):
            object_store.objects[object_name("bucket/cache", empty)] = b""
            assert tier.get([empty]) == [None]
        stats = tier.stats()
        assert (stats.extra["corrupt"], stats.extra["breaker_state"]) == (3, "closed")
        assert object_name("bucket/cache", empty) in object_store.objects  # kept, absent to this process
        assert tier.contains([empty]) == [False]
        assert bytes(tier.get([other])[0]) == value_for("kept", 4096)
    finally:
        tier.close()


class SyncObjectFile(AbstractBufferedFile):  # type: ignore[misc]
    """A file of :class:`SyncObjectStoreFS`, read in ranges (as sftp, webdav, ... files are)."""

    def _fetch_range(self, start: int, end: int) -> bytes:
        part = SyncObjectStoreFS.objects[self.path][start:end]
        SyncObjectStoreFS.served += len(part)
        return part


class SyncObjectStoreFS(AbstractFileSystem):  # type: ignore[misc]
    """A sync remote store in memory whose files are fsspec's buffered files, with their
    default read-ahead; ``served`` counts the bytes its range reads returned."""

    protocol = (SYNC_PROTOCOL,)
    objects: ClassVar[dict[str, bytes]] = {}
    served: ClassVar[int] = 0

    def _open(self, path: str, mode: str = "rb", block_size: Any = "default", **kwargs: Any) -> Any:
        name = self._strip_protocol(path)
        if "r" in mode:
            if name not in self.objects:
                raise FileNotFoundError(path)
            return SyncObjectFile(self, name, mode, block_size, size=len(self.objects[name]), **kwargs)
        raise NotImplementedError(mode)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        self.objects[self._strip_protocol(path)] = bytes(value)

    def rm_file(self, path: str) -> None:
        if self.objects.pop(self._strip_protocol(path), None) is None:
            raise FileNotFoundError(path)

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.objects[self._strip_protocol(path2)] = self.objects.pop(self._strip_protocol(path1))

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        name = self._strip_protocol(path)
        if name not in self.objects:
            raise FileNotFoundError(path)
        return {"name": name, "size": len(self.objects[name]), "type": "file"}

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        root = self._strip_protocol(path).rstrip("/") + "/"
        return {name: self.info(name) for name in sorted(self.objects) if name.startswith(root)}


def test_a_sync_remote_protocol_reads_at_most_the_bound() -> None:
    """fsspec's buffered files read ahead a block (5 MiB) past what is asked: not past the bound."""
    fsspec.register_implementation(SYNC_PROTOCOL, SyncObjectStoreFS, clobber=True)
    SyncObjectStoreFS.objects = {}
    tier = S3Tier(S3Tier.Config(url=f"{SYNC_PROTOCOL}://bucket/cache"), tier_context(max_record_bytes=BOUND))
    try:
        victim, other = key_for("planted"), key_for("kept")
        tier.put([(victim, value_for("planted", 4096)), (other, value_for("kept", 4096))])
        planted = object_name("bucket/cache", victim)
        SyncObjectStoreFS.objects[planted] = pack_record(victim, b"\x07" * PLANTED)
        SyncObjectStoreFS.served = 0
        got = tier.get([victim, other])
        assert got[0] is None and bytes(got[1]) == value_for("kept", 4096)
        assert SyncObjectStoreFS.served <= 2 * (BOUND + 1), f"the reads took {SyncObjectStoreFS.served} bytes"
        assert tier.stats().extra["corrupt"] == 1 and planted in SyncObjectStoreFS.objects
        assert tier.contains([victim, other]) == [False, True]  # kept, absent to this process
    finally:
        tier.close()
        SyncObjectStoreFS.objects = {}


class SizelessGateway:
    """An S3 gateway on 127.0.0.1 in front of ``target`` that answers every request chunked
    (no ``Content-Length``, so no size) and ignores ``Range`` (always the whole object);
    with ``total`` (``*``: unknown, or a number), it serves ranges, sized, but says that of
    the object's size (``Content-Range: bytes 0-0/*``). ``answered_bytes`` counts the body bytes it sent."""

    def __init__(self, target: str, *, total: str | None = None) -> None:
        self.target = target
        self.total = total
        self.port = free_port()
        self.answered_bytes = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sizeless-gateway", daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        dropped = {"host", "content-length", "transfer-encoding", "expect"} | (set() if self.total else {"range"})
        headers = {name: value for name, value in request.headers.items() if name.lower() not in dropped}
        async with self._session.request(
            request.method, self.target + request.path_qs, headers=headers, data=await request.read()
        ) as upstream:
            unsized = {"transfer-encoding", "connection", "content-range"} | (
                set() if self.total else {"content-length"}
            )
            kept = {name: value for name, value in upstream.headers.items() if name.lower() not in unsized}
            if self.total and "Content-Range" in upstream.headers:
                kept["Content-Range"] = upstream.headers["Content-Range"].rpartition("/")[0] + "/" + self.total
            response = web.StreamResponse(status=upstream.status, headers=kept)
            if not self.total:
                response.enable_chunked_encoding()
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_chunked(1 << 16):
                    await response.write(chunk)
                    self.answered_bytes += len(chunk)
                await response.write_eof()
            except (ConnectionError, aiohttp.ClientError):
                pass  # the client hung up before the end
            return response

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@pytest.fixture
def gateway(moto_s3: MotoS3) -> Iterator[SizelessGateway]:
    gateway = SizelessGateway(moto_s3.endpoint)
    yield gateway
    gateway.close()


@pytest.fixture
def gateway_tier(gateway: SizelessGateway, s3_client) -> Iterator[tuple[S3Tier, str]]:
    """A tier through the gateway holding two records, one of them then replaced behind its
    back by a whole, valid record far over the bound: (tier, its prefix)."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    tier = S3Tier(S3Tier.Config(**s3_options(gateway.endpoint, prefix)), tier_context(max_record_bytes=BOUND))
    try:
        victim, other = key_for("planted"), key_for("kept")
        tier.put([(victim, value_for("planted", 4096)), (other, value_for("kept", 4096))])
        assert bytes(tier.get([other])[0]) == value_for("kept", 4096)  # chunked answers are understood
        s3_client.put_object(
            Bucket=BUCKET, Key=object_name(prefix, victim), Body=pack_record(victim, b"\x07" * PLANTED)
        )
        yield tier, prefix
    finally:
        tier.close()


def test_an_s3_gateway_without_sizes_or_ranges_is_read_at_most_to_the_bound(
    gateway: SizelessGateway, gateway_tier: tuple[S3Tier, str], s3_client
) -> None:
    tier, prefix = gateway_tier
    before = gateway.answered_bytes
    got = tier.get([key_for("planted"), key_for("kept")])
    received = gateway.answered_bytes - before
    assert got[0] is None, "a record over the bound was served"
    assert bytes(got[1]) == value_for("kept", 4096)
    # Socket buffers may hold a few MiB of the body when the reader hangs up; not most of it.
    assert received < PLANTED // 4, f"the reader received {received} bytes of a {PLANTED}-byte object"
    assert tier.stats().extra["corrupt"] == 1
    # Removed: the second read's bytes (not a size the gateway omits) show it is still over the bound.
    listing = s3_client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    assert [item["Key"] for item in listing.get("Contents", [])] == [object_name(prefix, key_for("kept"))]


def test_a_lookup_through_a_gateway_without_sizes_or_ranges_reads_one_byte(
    gateway: SizelessGateway, gateway_tier: tuple[S3Tier, str]
) -> None:
    tier, _ = gateway_tier
    before = gateway.answered_bytes
    found = tier.contains([key_for("planted"), key_for("kept")])
    received = gateway.answered_bytes - before
    assert received < PLANTED // 4, f"a lookup received {received} bytes of a {PLANTED}-byte object"
    assert found == [True, True]  # stored, size unknown: a later read decides


def test_a_range_of_unknown_total_is_a_record_of_unknown_size(moto_s3: MotoS3) -> None:
    """``Content-Range: bytes 0-0/*`` (the server does not know the size): the record is
    there, of unknown size, not one byte long (a miss to every lookup)."""
    gateway = SizelessGateway(moto_s3.endpoint, total="*")
    tier = S3Tier(S3Tier.Config(**s3_options(gateway.endpoint)), tier_context(max_record_bytes=BOUND))
    try:
        key = key_for("unknown total")
        tier.put([(key, value_for("unknown total", 4096))])
        assert tier.contains([key, key_for("absent")]) == [True, False]
        assert bytes(tier.get([key])[0]) == value_for("unknown total", 4096)
    finally:
        tier.close()
        gateway.close()


def test_a_size_reported_over_the_bound_does_not_make_a_whole_record_corrupt(moto_s3: MotoS3) -> None:
    """The bytes received decide: a gateway claiming a terabyte for a record within the bound
    gets it served, not deleted as corrupt."""
    gateway = SizelessGateway(moto_s3.endpoint, total=str(1 << 40))
    tier = S3Tier(S3Tier.Config(**s3_options(gateway.endpoint)), tier_context(max_record_bytes=BOUND))
    try:
        key = key_for("claimed big")
        tier.put([(key, value_for("claimed big", 4096))])
        assert bytes(tier.get([key])[0]) == value_for("claimed big", 4096)
        assert tier.stats().extra["corrupt"] == 0
    finally:
        tier.close()
        gateway.close()


def test_an_empty_object_is_a_corrupt_miss_with_ranged_reads(moto_s3: MotoS3, s3_client) -> None:
    """S3 refuses a range of an empty object (416): that is a record too short, not a failure."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    tier = S3Tier(S3Tier.Config(**s3_options(moto_s3.endpoint, prefix)), tier_context(max_record_bytes=BOUND))
    try:
        empty = key_for("empty")
        s3_client.put_object(Bucket=BUCKET, Key=object_name(prefix, empty), Body=b"")
        assert tier.get([empty]) == [None]
        stats = tier.stats()
        assert (stats.extra["corrupt"], stats.errors) == (1, 1)
        assert "Contents" not in s3_client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    finally:
        tier.close()


def test_a_reported_length_is_trusted_for_memory_only_up_to_the_bound() -> None:
    """A read takes its buffer's size from the answer's Content-Length, but never more than
    the record bound (or, with none, 64 MiB) on that word alone: a body that claims a
    terabyte and sends a few bytes costs a few bytes."""
    import tracemalloc

    from kvplug_s3.reads import read_body

    class Claims:
        """A body that claims far more than it sends."""

        def __init__(self, data: bytes) -> None:
            self.data = data

        async def readinto(self, into: memoryview) -> int:
            count = min(len(into), len(self.data))
            into[:count], self.data = self.data[:count], self.data[count:]
            return count

    tracemalloc.start()
    try:
        for limit in (None, BOUND + 1):
            tracemalloc.reset_peak()
            data = asyncio.run(read_body(Claims(b"record"), limit, expected=1 << 40))
            assert bytes(data) == b"record"
            allowed = (64 << 20 if limit is None else limit) + (1 << 20)  # and one piece in hand
            assert tracemalloc.get_traced_memory()[1] < allowed
    finally:
        tracemalloc.stop()
