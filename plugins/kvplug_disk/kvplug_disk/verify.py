"""Check every record file of a disk tier folder (for ``kvplug store verify``).

Without keys (files hold only their key's digest), a record is whole when its frame
verifies and the key digest in its header is the one its file name says: that
catches flipped bits, truncation, appended bytes and files renamed onto another
key's name; a KV chunk frame inside is checked too
(kvplug.check_record, as ``kvplug store verify`` does). It reads every byte, so it takes as long as reading the cache once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from kvplug import RECORD_HEADER_SIZE, RecordCheck, check_record
from kvplug.errors import CorruptChunkError
from kvplug_disk.files import RecordFolder, value_size_of
from kvplug_disk.folder_scan import ForeignEntryError
from kvplug_disk.ledger import FolderLockTimeoutError, UsageLedger
from kvplug_disk.tenant_tags import record_tag

#: Longest a removal of :func:`verify_folder` waits for the folder's lock, which a paused
#: process may hold for ever: then it raises :class:`~kvplug_disk.ledger.FolderLockTimeoutError`.
VERIFY_LOCK_WAIT_S = 30.0


@dataclass
class VerifyReport:
    """What :func:`verify_folder` found. ``corrupt_digests`` names the bad files."""

    ok: int = 0
    corrupt: int = 0
    incompatible: int = 0
    removed: int = 0
    ok_bytes: int = 0
    #: Entries named like records that are not regular files (folders, links): skipped.
    foreign: int = 0
    #: Corrupt records that could not be removed (no permission).
    undeletable: int = 0
    #: Records there but not readable by this process (no permission, an I/O error): not verified.
    unreadable: int = 0
    corrupt_digests: list[str] = field(default_factory=list)


def verify_folder(path: str | os.PathLike[str], *, remove_corrupt: bool = False) -> VerifyReport:
    """Verify every record under ``path``; with ``remove_corrupt``, delete the bad ones.

    Records of another record version are counted as ``incompatible`` and kept.
    Safe to run while tiers use the folder: a file that vanishes meanwhile is skipped.
    Folders or links named like records are counted as ``foreign`` and left alone; a
    corrupt record the process may not delete is counted as ``undeletable``, one it may
    not read as ``unreadable``. A file whose size its header rules out is corrupt
    unread, and a record is mapped, not copied: a sparse or huge file costs no memory.
    A removal waits at most ``VERIFY_LOCK_WAIT_S`` for the folder's lock, then raises
    :class:`~kvplug_disk.ledger.FolderLockTimeoutError` (a process paused holding it).
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"disk tier folder {str(root)!r} does not exist")
    folder = RecordFolder(root, fsync=False, create=False)
    ledger: UsageLedger | None = None  # opened at the first removal: a clean folder is left as it was
    report = VerifyReport()
    try:
        report.foreign = len(folder.scan().foreign)
        for digest, _ in folder.iter_record_paths():
            try:
                found = folder.read(digest, mapped=True)
            except ForeignEntryError:  # replaced by a folder or a link since the listing
                report.foreign += 1
                continue
            except CorruptChunkError as exc:  # a size its header rules out: not read
                check, stat = RecordCheck("corrupt", str(exc)), _stat_or_none(folder, digest)
            except OSError:  # there, but not ours to read
                report.unreadable += 1
                continue
            else:  # record frame, its key digest, and a KV chunk frame inside
                check = check_record(digest, None if found is None else found[0])
                stat = None if found is None else found[1]
            if stat is None:  # vanished meanwhile
                continue
            if check.status in ("incompatible", "newer"):  # neither removed: a newer kvplug's is kept
                report.incompatible += 1
            elif check.status == "corrupt":
                report.corrupt += 1
                report.corrupt_digests.append(digest)
                if remove_corrupt:
                    try:
                        ledger = ledger or UsageLedger(folder.root_fd, where=str(root))
                        report.removed += _remove_if_same(folder, ledger, digest, stat)
                    except FolderLockTimeoutError:
                        raise
                    except OSError:
                        report.undeletable += 1
            else:
                report.ok += 1
                report.ok_bytes += stat.st_size - RECORD_HEADER_SIZE
    finally:
        if ledger is not None:
            ledger.close()
        folder.close()
    return report


def _remove_if_same(folder: RecordFolder, ledger: UsageLedger, digest: str, stat: os.stat_result) -> bool:
    """Unlink a bad record if its name still holds the file judged, and take its bytes off the
    folder's shared total: under the folder's lock, which every tier's publish takes, so a good
    record renamed over it meanwhile stays, and the tiers' budget does not evict good records
    for room already free."""
    with ledger.locked(timeout_s=VERIFY_LOCK_WAIT_S, then="the corrupt record stays") as usage:
        tag = record_tag(folder, digest) if usage.tenants else None  # its tenant's count goes too
        if not folder.unlink_if_same(digest, stat):
            return False
        if usage.known:
            usage.total -= value_size_of(stat.st_size)
            usage.add_tenant(tag, -stat.st_size)
        return True


def _stat_or_none(folder: RecordFolder, digest: str) -> os.stat_result | None:
    try:
        return folder.stat(digest)
    except OSError:
        return None
