"""The record backend of tier ``s3``: whole objects on an fsspec filesystem.

Object names come from the key's sha256 hex digest, never from key text:
``<root>/<digest[:2]>/<digest>``. The two-character shard keeps directory-like
stores (``file://``) at 256 entries per level and spreads S3 key prefixes.
Every primitive handles one object (:attr:`ObjectBackend.call_sizes` of 1): an
object is one request, so each gets its own deadline and retries.

Two implementations:

- :class:`AsyncObjectBackend` calls an async filesystem's coroutines (s3fs's
  ``_cat_file``, ``_pipe_file``, ``_rm_file``, ``_find``; ranged GETs for sizes and
  records, see :mod:`kvplug_s3.reads`)
  and frames uploads into reusable buffers (:class:`~kvplug_s3.frames.FrameBuffers`).
- :class:`ThreadedObjectBackend` runs a sync filesystem (``memory://``, ``file://``)
  on a bounded thread pool; on stores whose writes are not atomic (files) it
  writes a temporary object and renames it into place, so a reader or a crash
  never leaves a partial object under the final name; a listing (the start-up scan)
  removes the temporaries of writers killed before their rename.
"""

from __future__ import annotations

import asyncio
import datetime
import re
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fsspec.implementations.local import LocalFileSystem

from kvplug import (
    SIZE_UNKNOWN,
    Buffer,
    CallSizes,
    FailureKind,
    RecordBackend,
    RecordToWrite,
    StoredRecord,
    WriteRefusals,
    classify_failure,
)
from kvplug.errors import CorruptChunkError
from kvplug_s3.conditional import ConditionalDeletes, ConditionalDeleteUnsupported
from kvplug_s3.config import S3TierConfig
from kvplug_s3.frames import FrameBuffers
from kvplug_s3.local_files import read_local_file, remove_local_file, write_local_file
from kvplug_s3.reads import cat_bounded, over_bound, s3_error_code, s3_read, s3_size

T = TypeVar("T")
_DIGEST = re.compile(r"[0-9a-f]{64}")
#: Stores where writing one object is atomic by themselves (a PUT replaces the
#: object whole); others get temp-and-rename.
ATOMIC_PUT_PROTOCOLS = frozenset({"s3", "s3a", "gcs", "gs", "az", "abfs", "abfss", "oci", "oss", "memory"})
#: S3 error codes that say the location itself is unusable: s3fs turns them into
#: FileNotFoundError like a missing key, but every key of the tier will fail alike.
_LOCATION_ERROR_CODES = frozenset({"NoSuchBucket", "AllAccessDisabled", "AccountProblem", "NotSignedUp"})
#: Building the client is local work (no network), but slow on a busy machine.
OPEN_TIMEOUT_S = 60.0
#: A temporary object (a write not yet renamed into place) this old is a killed writer's:
#: writing one record takes seconds, so no live writer still owns it.
STALE_TEMPORARY_S = 3600.0
#: ``.<digest>.tmp-<uuid4 hex>``: see :meth:`ThreadedObjectBackend._write_sync` and
#: :func:`~kvplug_s3.local_files.write_local_file`.
_TEMPORARY = re.compile(r"\.[0-9a-f]{64}\.tmp-[0-9a-f]{32}")


def classify_s3_failure(exc: BaseException) -> FailureKind:
    """Like :func:`kvplug.classify_failure`, but a missing bucket (and an account that
    cannot be used) is a failure that counts towards the breaker, not an absent key:
    otherwise every lookup would pay a round trip to learn the same thing forever."""
    if s3_error_code(exc) in _LOCATION_ERROR_CODES:
        return "permanent"
    return classify_failure(exc)


class ObjectBackend(RecordBackend):
    """Records as whole objects under ``root``; a missing object raises
    ``FileNotFoundError`` (a miss, see :meth:`classify`)."""

    # One object per request: per-object deadlines and retries.
    call_sizes = CallSizes(query=1, read=1, write=1)
    open_timeout_s = OPEN_TIMEOUT_S

    def __init__(self, fs: Any, root: str, where: str, record_bound: Callable[[], int | None]) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.where = where
        #: The tier's ``max_record_bytes``, read at each read (the engine may raise it).
        self._record_bound = record_bound

    def path_for(self, digest: str) -> str:
        return f"{self.root}/{digest[:2]}/{digest}"

    def classify(self, exc: BaseException) -> FailureKind:
        return classify_s3_failure(exc)

    def describe(self) -> dict[str, int | float | str]:
        return {"url": self.where}

    def _records(self, found: dict[str, dict[str, Any]]) -> list[StoredRecord]:
        records = []
        for path, info in found.items():
            parts = path.rstrip("/").rsplit("/", 2)
            # Only <root>/<shard>/<digest>: a record deeper down is another tier's (a
            # nested prefix), which this one would count, evict by the wrong path and list.
            if len(parts) == 3 and parts[0] == self.root and _DIGEST.fullmatch(parts[2]) and parts[1] == parts[2][:2]:
                records.append(StoredRecord(parts[2], int(info.get("size") or 0), _modified(info)))
        return records


class AsyncObjectBackend(ObjectBackend):
    """An fsspec ``AsyncFileSystem`` (s3fs, gcsfs, ...) driven by its coroutines."""

    def __init__(
        self,
        fs: Any,
        root: str,
        where: str,
        *,
        frame_buffer_bytes: int,
        record_bound: Callable[[], int | None] = lambda: None,
        refusal_cooldown_s: float = 10.0,
    ) -> None:
        super().__init__(fs, root, where, record_bound)
        self._is_s3 = hasattr(fs, "_s3")
        self.refusals = WriteRefusals(refusal_cooldown_s)
        self._conditional = ConditionalDeletes(fs, self.root, s3_error_code)
        #: Upload buffers for reuse, or ``None`` (each frame allocated anew).
        self.frames = FrameBuffers(frame_buffer_bytes) if frame_buffer_bytes > 0 else None

    async def open(self) -> None:
        # Building the botocore client parses the S3 service model (megabytes of JSON,
        # about a second on a busy machine, holding the GIL). Done lazily it would land
        # in the first lookup and hold every thread past the lookup budget.
        set_session = getattr(self.fs, "set_session", None)
        if set_session is not None:
            await set_session()

    async def sizes(self, names: Sequence[str]) -> list[int | None]:
        (name,) = names
        path = self.path_for(name)
        if self._is_s3:
            size = await s3_size(self.fs, path)
            return [SIZE_UNKNOWN if size is None else size]
        info = await self.fs._info(path)
        if info.get("type") == "directory":
            raise FileNotFoundError(path)
        size = info.get("size")
        return [size if isinstance(size, int) and size >= 0 else SIZE_UNKNOWN]

    async def read(self, names: Sequence[str], sizes: Sequence[int | None]) -> list[Buffer | BaseException | None]:
        # Read at most one byte past the record bound whatever the store reports of the
        # object's size (see kvplug_s3.reads); the size hints are not trusted for that.
        (name,) = names
        path = self.path_for(name)
        if self._is_s3:
            return [await s3_read(self.fs, path, self._record_bound())]
        return [await cat_bounded(self.fs, path, self._record_bound())]

    async def write(self, records: Sequence[RecordToWrite]) -> list[BaseException | None]:
        refused = self.refusals.current()
        if refused is not None:
            return [refused]
        try:
            outcomes = await self._write(records)
        except PermissionError as exc:  # (a wrong key or signature is not AccessDenied: the tier's failure)
            if s3_error_code(exc) != "AccessDenied":
                raise
            return [self.refusals.refused(self.where, f"AccessDenied: {exc}")]
        self.refusals.accepted()
        return outcomes

    async def _write(self, records: Sequence[RecordToWrite]) -> list[BaseException | None]:
        (record,) = records
        path = self.path_for(record.name)
        if self.frames is None:
            await self.fs._pipe_file(path, record.joined())
            return [None]
        frame = self.frames.frame(record.header, record.value)
        await self.fs._pipe_file(path, frame)
        # Back to the pool only after a finished upload: an attempt that failed, or was
        # abandoned at its deadline, may still be sending from this frame.
        self.frames.release(frame)
        return [None]

    async def delete(self, names: Sequence[str]) -> list[bool]:
        (name,) = names
        await self.fs._rm_file(self.path_for(name))
        # S3 answers a DELETE alike whether or not the object was there: "not there"
        # then, so only records this process indexed count as removed.
        return [not self._is_s3]

    @property
    def deletes_if_same(self) -> bool:
        # Other object stores, and a server found to ignore If-Match: corrupt objects are kept.
        return self._is_s3 and self._conditional.honoured is not False

    async def delete_if_same(self, names: Sequence[str], seen: Sequence[Buffer | None]) -> list[bool | BaseException]:
        """S3: the object read again and deleted under its ETag if it is still the bad one
        (:mod:`kvplug_s3.conditional`); a server that ignores ``If-Match`` keeps it."""
        (name,), (data,) = names, seen
        if not self._is_s3:
            return [False]
        try:
            return [await self._conditional.delete_if_same(self.path_for(name), data, self._record_bound())]
        except ConditionalDeleteUnsupported as exc:  # no answer for this name: the tier keeps it absent
            return [exc]

    async def listing(self) -> list[StoredRecord]:
        try:
            found = await self.fs._find(self.root, detail=True)
        except FileNotFoundError as exc:
            if s3_error_code(exc) in _LOCATION_ERROR_CODES:
                raise  # no bucket is a failure, not an empty prefix
            return []
        return self._records(found)

    async def close(self) -> None:
        if self.frames is not None:
            self.frames.clear()
        creator = getattr(self.fs, "_s3creator", None)
        if creator is not None and getattr(self.fs, "_s3", None) is not None:
            await creator.__aexit__(None, None, None)
            self.fs._s3 = None
            return
        session = getattr(self.fs, "session", None)
        if session is not None and hasattr(session, "close") and asyncio.iscoroutinefunction(session.close):
            await session.close()


class ThreadedObjectBackend(ObjectBackend):
    """A sync fsspec filesystem on a bounded thread pool owned by the backend.

    Uploads are never pooled: a sync store (``memory://``) may keep the very
    buffer it is given, and a thread abandoned at its deadline may still write."""

    def __init__(
        self,
        fs: Any,
        root: str,
        where: str,
        *,
        threads: int,
        atomic_put: bool,
        record_bound: Callable[[], int | None] = lambda: None,
        read_only: bool = False,
    ) -> None:
        super().__init__(fs, root, where, record_bound)
        self.atomic_put = atomic_put
        #: Opened for inspection: a listing removes nothing (not even stale temporaries).
        self.read_only = read_only
        #: ``file://``: regular files in real shard folders only (:mod:`kvplug_s3.local_files`).
        self._local = isinstance(fs, LocalFileSystem)
        self._remove: Callable[[str], None] = remove_local_file if self._local else fs.rm_file
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvplug-s3-io")

    async def _call(self, function: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, function, *args)

    async def sizes(self, names: Sequence[str]) -> list[int | None]:
        path = self.path_for(names[0])

        def info() -> int:
            details = self.fs.info(path)
            if details.get("type") == "directory":
                raise FileNotFoundError(path)
            return int(details.get("size") or 0)

        return [await self._call(info)]

    async def read(self, names: Sequence[str], sizes: Sequence[int | None]) -> list[Buffer | BaseException | None]:
        path = self.path_for(names[0])
        bound = self._record_bound()
        if self._local:
            return [await self._call(read_local_file, path, bound)]
        if bound is None:
            data: bytes = await self._call(self.fs.cat_file, path)
            return [data]

        def read_bounded() -> bytes | CorruptChunkError:
            # One byte past the bound tells a record too big without reading the rest of it;
            # no cache: a buffered remote file would read a block (5 MiB) ahead.
            with self.fs.open(path, "rb", cache_type="none") as file:
                found: bytes = file.read(bound + 1)
            return over_bound(bound) if len(found) > bound else found

        return [await self._call(read_bounded)]

    async def write(self, records: Sequence[RecordToWrite]) -> list[BaseException | None]:
        (record,) = records
        try:
            await self._call(self._write_sync, self.path_for(record.name), record)
        except NotADirectoryError as exc:  # a shard that is no folder of the store: this record's failure
            return [exc]
        return [None]

    def _write_sync(self, path: str, record: RecordToWrite) -> None:
        data = record.joined()  # in the pool's thread, not on the tier's loop
        if self._local:
            write_local_file(path, data)
            return
        if self.atomic_put:
            self.fs.pipe_file(path, data)
            return
        parent, name = path.rsplit("/", 1)
        # A leading dot and a suffix keep temporaries out of listings (not a digest name).
        temporary = f"{parent}/.{name}.tmp-{uuid.uuid4().hex}"
        self.fs.makedirs(parent, exist_ok=True)
        try:
            self.fs.pipe_file(temporary, data)
            self.fs.mv(temporary, path)
        except BaseException:
            try:
                self.fs.rm_file(temporary)
            except OSError:
                pass
            raise

    async def delete(self, names: Sequence[str]) -> list[bool]:
        await self._call(self._remove, self.path_for(names[0]))
        return [True]  # a missing object raised FileNotFoundError

    async def listing(self) -> list[StoredRecord]:
        def find() -> dict[str, dict[str, Any]]:
            try:
                found: dict[str, dict[str, Any]] = self.fs.find(self.root, detail=True)
            except FileNotFoundError:
                return {}
            if not self.read_only:
                self._remove_stale_temporaries(found)
            return found

        return self._records(await self._call(find))

    def _remove_stale_temporaries(self, found: dict[str, dict[str, Any]]) -> None:
        """Remove the temporaries of writers killed before their rename: nothing else ever
        would, and they hold space outside the budget. Only those older than
        :data:`STALE_TEMPORARY_S` (one without a time may be a live writer's)."""
        now = time.time()
        for path, info in found.items():
            modified = _modified(info)
            if _TEMPORARY.fullmatch(path.rsplit("/", 1)[-1]) and 0 < modified < now - STALE_TEMPORARY_S:
                try:
                    self._remove(path)
                except OSError:
                    pass  # gone already (another process's listing), or not ours to remove

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def open_object_backend(
    config: S3TierConfig,
    loop: asyncio.AbstractEventLoop,
    record_bound: Callable[[], int | None] = lambda: None,
    *,
    read_only: bool = False,
) -> ObjectBackend:
    """The backend for ``config.url``, bound to ``loop`` when the filesystem is async;
    ``record_bound`` gives the tier's ``max_record_bytes`` (see :mod:`kvplug_s3.reads`);
    ``read_only``: opened for inspection (nothing is removed, see :class:`ThreadedObjectBackend`)."""
    import fsspec
    from fsspec.asyn import AsyncFileSystem

    protocol = config.protocol
    cls = fsspec.get_filesystem_class(protocol)
    options = config.filesystem_options()
    root = cls._strip_protocol(config.url)
    where = re.sub(r"://[^/@]*@", "://", config.url)  # never show credentials in a URL
    if issubclass(cls, AsyncFileSystem) and getattr(cls, "async_impl", False):
        # skip_instance_cache: fsspec caches instances per options; a tier owns its
        # filesystem, sessions and loop, and closes them.
        fs = cls(asynchronous=True, loop=loop, skip_instance_cache=True, **options)
        if hasattr(fs, "retries"):
            fs.retries = 1  # s3fs's own retry loop would multiply the tier's bounded retries
        return AsyncObjectBackend(
            fs,
            root,
            where,
            frame_buffer_bytes=int(config.frame_buffer_bytes),
            record_bound=record_bound,
            refusal_cooldown_s=config.breaker_cooldown_s,
        )
    fs = cls(skip_instance_cache=True, **options)
    threads = min(config.max_concurrency, 16)
    return ThreadedObjectBackend(
        fs,
        root,
        where,
        threads=threads,
        atomic_put=protocol in ATOMIC_PUT_PROTOCOLS,
        record_bound=record_bound,
        read_only=read_only,
    )


def _modified(info: dict[str, Any]) -> float:
    for name in ("LastModified", "mtime", "created", "updated"):
        value = info.get(name)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0
