"""A read of the s3 tier on other fsspec protocols takes at most one byte past the engine's
record bound whatever the store says of an object's size: on other async protocols (gcs,
az, ...: here a small real async filesystem whose listings misreport or omit sizes, as
gcsfs and adlfs cannot reach a real server here) and on sync remote protocols (fsspec's
buffered files read ahead). An oversized record is a corrupt miss, counted once, never a
hit. S3 itself (a gateway without sizes or ranges): test_s3_unsized_reads.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import fsspec
import pytest
from fsspec.asyn import AsyncFileSystem
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem
from test_s3_unsized_reads import BOUND, PLANTED, object_name

from kvplug.core.records.frame import pack_record
from kvplug.testing import key_for, tier_context, value_for
from kvplug_s3 import S3Tier

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
