"""The record backend of tier ``s3``: whole objects on an fsspec filesystem (names and
listings: :mod:`kvplug_s3.objects`).

Two implementations, which :func:`open_object_backend` chooses by the filesystem:

- :class:`AsyncObjectBackend` calls an async filesystem's coroutines (s3fs's
  ``_cat_file``, ``_pipe_file``, ``_rm_file``, ``_find``; ranged GETs for sizes and
  records, see :mod:`kvplug_s3.reads`)
  and frames uploads into reusable buffers (:class:`~kvplug_s3.frames.FrameBuffers`).
- :class:`~kvplug_s3.threaded.ThreadedObjectBackend` runs a sync filesystem (``memory://``,
  ``file://``) on a bounded thread pool, with temp-and-rename where writes are not atomic.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from typing import Any

from kvplug import SIZE_UNKNOWN, Buffer, RecordToWrite, StoredRecord
from kvplug_s3.conditional import ConditionalDeletes, ConditionalDeleteUnsupported
from kvplug_s3.config import S3TierConfig
from kvplug_s3.frames import FrameBuffers
from kvplug_s3.objects import LOCATION_ERROR_CODES, ObjectBackend
from kvplug_s3.reads import cat_bounded, s3_error_code, s3_http_status, s3_read, s3_size
from kvplug_s3.threaded import ThreadedObjectBackend

#: Stores where writing one object is atomic by themselves (a PUT replaces the
#: object whole); others get temp-and-rename.
ATOMIC_PUT_PROTOCOLS = frozenset({"s3", "s3a", "gcs", "gs", "az", "abfs", "abfss", "oci", "oss", "memory"})


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
        super().__init__(fs, root, where, record_bound, refusal_cooldown_s)
        self._is_s3 = hasattr(fs, "_s3")
        self._conditional = ConditionalDeletes(fs, self.root)
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

    def write_refusal(self, exc: OSError) -> str | None:
        # A wrong key or signature is no refusal of writes (InvalidAccessKeyId,
        # SignatureDoesNotMatch: the tier's failure); a 403 without any S3 error code is a
        # proxy's or gateway's answer to the PUT, and a store that refuses reads alike
        # opens the breaker on its reads.
        code = s3_error_code(exc)
        if code == "AccessDenied":
            return f"AccessDenied: {exc}"
        if code is None and s3_http_status(exc) == 403:
            return "HTTP 403 Forbidden without an S3 error: a proxy or gateway in front of the store?"
        return None

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
            if s3_error_code(exc) in LOCATION_ERROR_CODES:
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
        refusal_cooldown_s=config.breaker_cooldown_s,
    )
