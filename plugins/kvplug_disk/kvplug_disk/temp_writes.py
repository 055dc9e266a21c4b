"""The temp files of a put of tier ``disk``'s backend (:class:`~kvplug_disk.backend.DiskBackend`).

A record is written whole into a temp file before the backend renames it into place
under the folder's lock (:meth:`~kvplug_disk.files.RecordFolder.write_temp`); ``write_threads``
of them are written at once, so their fdatasyncs overlap (they release the GIL). A salted
tenant's record carries its tenant's tag (:mod:`kvplug_disk.tenant_tags`). On a full disk a
write makes room and tries again, a few rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from time import time_ns

from kvplug import NameTenants, RecordToWrite
from kvplug_disk.files import RecordFolder, TempFile
from kvplug_disk.problems import is_no_space
from kvplug_disk.tenant_tags import tenant_tag

#: On a full disk, rounds of evicting this tier's next victims (each twice the last) before a write gives up.
NO_SPACE_ROUNDS = 4


class TempWriter:
    """Writes the temp files of ``folder``'s records, ``threads`` at once; ``make_room(size,
    attempt)`` evicts for a write the disk had no space for (False: nothing left to evict);
    ``written(record)`` is told of each temp file written."""

    def __init__(
        self,
        folder: RecordFolder,
        tenant_names: NameTenants,
        make_room: Callable[[int, int], bool],
        written: Callable[[RecordToWrite], None],
        threads: int,
    ) -> None:
        self._folder = folder
        self._tenant_names = tenant_names
        self._make_room = make_room
        self._written = written
        self._io = ThreadPoolExecutor(threads, thread_name_prefix="kvplug-disk-io") if threads > 1 else None

    def write(self, records: list[RecordToWrite]) -> list[TempFile | OSError]:
        """The temp files of ``records`` (or why one failed). Their mtimes (the order a restart
        rebuilds) follow the order of ``records``, whichever finishes first."""
        start = time_ns()
        stamps = range(start, start + len(records))
        if self._io is None or len(records) < 2:
            return [self._write_or_error(record, stamp) for record, stamp in zip(records, stamps)]
        return list(self._io.map(self._write_or_error, records, stamps))

    def close(self) -> None:
        """Wait for the temp files being written."""
        if self._io is not None:
            self._io.shutdown(wait=True)

    def _write_or_error(self, record: RecordToWrite, mtime_ns: int) -> TempFile | OSError:
        try:
            return self._write(record, mtime_ns)
        except OSError as exc:
            return exc

    def _write(self, record: RecordToWrite, mtime_ns: int) -> TempFile:
        """Write the temp file; on a full disk, make room and retry."""
        for attempt in range(NO_SPACE_ROUNDS + 1):
            try:
                tenant = self._tenant_names.tenant_of(record.name)
                tag = None if tenant is None else tenant_tag(tenant)
                temp = self._folder.write_temp(record.name, record.header, record.value, mtime_ns=mtime_ns, tag=tag)
            except OSError as exc:
                if not is_no_space(exc) or attempt == NO_SPACE_ROUNDS or not self._make_room(record.size, attempt):
                    raise
            else:
                self._written(record)
                return temp
        raise AssertionError("unreachable")
