"""The object backend of a sync fsspec filesystem (``memory://``, ``file://``): each call on a
bounded thread pool the backend owns. On stores whose writes are not atomic (files) a write
goes to a temporary object renamed into place, so a reader or a crash never leaves a partial
object under the final name; a listing (the start-up scan) removes the temporaries of writers
killed before their rename."""

from __future__ import annotations

import asyncio
import errno
import re
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fsspec.implementations.local import LocalFileSystem

from kvplug import Buffer, RecordToWrite, StoredRecord
from kvplug.errors import CorruptChunkError
from kvplug_s3.local_files import read_local_file, remove_local_file, write_local_file
from kvplug_s3.objects import ObjectBackend, modified
from kvplug_s3.reads import over_bound

T = TypeVar("T")
#: A temporary object (a write not yet renamed into place) this old is a killed writer's:
#: writing one record takes seconds, so no live writer still owns it.
STALE_TEMPORARY_S = 3600.0
#: ``.<digest>.tmp-<uuid4 hex>``: see :meth:`ThreadedObjectBackend._write_sync` and
#: :func:`~kvplug_s3.local_files.write_local_file`.
_TEMPORARY = re.compile(r"\.[0-9a-f]{64}\.tmp-[0-9a-f]{32}")


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
        refusal_cooldown_s: float = 10.0,
    ) -> None:
        super().__init__(fs, root, where, record_bound, refusal_cooldown_s)
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

    async def _write(self, records: Sequence[RecordToWrite]) -> list[BaseException | None]:
        (record,) = records
        try:
            await self._call(self._write_sync, self.path_for(record.name), record)
        except NotADirectoryError as exc:  # a shard that is no folder of the store: this record's failure
            return [exc]
        return [None]

    def write_refusal(self, exc: OSError) -> str | None:
        # A folder this process may not write (its mode, an immutable flag) or a read-only
        # mount: the records there still read. Any other OSError is the tier's failure.
        if isinstance(exc, PermissionError) or exc.errno == errno.EROFS:
            return f"{type(exc).__name__}: {exc}"
        return None

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
            written = modified(info)
            if _TEMPORARY.fullmatch(path.rsplit("/", 1)[-1]) and 0 < written < now - STALE_TEMPORARY_S:
                try:
                    self._remove(path)
                except OSError:
                    pass  # gone already (another process's listing), or not ours to remove

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
