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

from kvplug import RECORD_HEADER_SIZE, check_record
from kvplug_disk.files import ForeignEntryError, RecordFolder


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
    corrupt_digests: list[str] = field(default_factory=list)


def verify_folder(path: str | os.PathLike[str], *, remove_corrupt: bool = False) -> VerifyReport:
    """Verify every record under ``path``; with ``remove_corrupt``, delete the bad ones.

    Records of another record version are counted as ``incompatible`` and kept.
    Safe to run while tiers use the folder: a file that vanishes meanwhile is skipped.
    Folders or links named like records are counted as ``foreign`` and left alone; a
    corrupt record the process may not delete is counted as ``undeletable``.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"disk tier folder {str(root)!r} does not exist")
    folder = RecordFolder(root, fsync=False, create=False)
    report = VerifyReport()
    try:
        report.foreign = len(folder.scan().foreign)
        for digest, _ in folder.iter_record_paths():
            try:
                found = folder.read(digest)
            except ForeignEntryError:  # replaced by a folder or a link since the listing
                report.foreign += 1
                continue
            if found is None:
                continue
            data, stat = found
            check = check_record(digest, data)  # record frame, its key digest, and a KV chunk frame inside
            if check.status == "incompatible":
                report.incompatible += 1
            elif check.status == "corrupt":
                report.corrupt += 1
                report.corrupt_digests.append(digest)
                if remove_corrupt:
                    try:
                        report.removed += folder.unlink_if_same(digest, stat)
                    except OSError:
                        report.undeletable += 1
            else:
                report.ok += 1
                report.ok_bytes += len(data) - RECORD_HEADER_SIZE
    finally:
        folder.close()
    return report
