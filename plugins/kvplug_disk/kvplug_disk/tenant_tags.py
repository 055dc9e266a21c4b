"""Which tenant each record of a shared folder belongs to, and each tenant's bytes in the folder.

A tenant's quota is meant for the folder, which several processes (engines, TP ranks)
share; each process knows the tenants of the records it wrote or was asked about only.
So a record of a salted tenant carries its tenant's tag (:func:`tenant_tag`) in an
extended attribute, ``user.kvplug.tenant``, set on its temp file before it is renamed into
place, and the folder's ledger holds each tag's file bytes (:func:`encode_usage`), kept
under the folder's lock by every process that writes or unlinks a record. The record
frame itself (its 64-byte header, shared by every persistent tier) does not change: a
record without the attribute (written by an older kvplug, or where the file system has
no user attributes) counts for no tenant of the folder, as before.

A tag is a digest of the salt, never the salt: the folder (private to its user) holds it
beside the KV those salts guard, so the tag tells whoever can read it nothing they could
not read there already.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from collections.abc import Mapping
from stat import S_ISREG
from typing import Protocol

TAG_XATTR = "user.kvplug.tenant"
TAG_SIZE = 16
_PERSON = b"kvplug-folder-tn"
#: After the ledger's 8-byte total: magic, tenant count, the total again (a total changed by
#: a process that keeps no table, an older kvplug, makes the table stale), then the tenants
#: (tag, file bytes) and a checksum of all that (a torn write reads as no table).
_TABLE_MAGIC = b"KVT1"
_TABLE_HEAD = struct.Struct("<Q4sIQ")
_ENTRY = struct.Struct(f"<{TAG_SIZE}sQ")
_CHECK_SIZE = 8
#: Most tenants a table holds. The file is read and written whole at every write, under the
#: folder's lock, by every process: a folder of more tenants keeps no table (quotas then bound
#: what each process knows of, the folder listed again at most every so often), and a file
#: longer than a table of this many (a local user's, a disk's error) is read as its total alone.
MAX_TABLE_TENANTS = 1 << 16
#: The longest ledger file read whole: a table of :data:`MAX_TABLE_TENANTS` (1.5 MiB).
MAX_USAGE_BYTES = _TABLE_HEAD.size + MAX_TABLE_TENANTS * _ENTRY.size + _CHECK_SIZE


class Records(Protocol):
    """What :func:`record_tag` needs of a :class:`~kvplug_disk.files.RecordFolder` (which tags files)."""

    def open_record(self, digest: str) -> tuple[int, os.stat_result] | None: ...


@functools.lru_cache(maxsize=1 << 16)  # (every write of a salted record, every listing: each known salt)
def tenant_tag(salt: str) -> bytes:
    """The tag of tenant ``salt`` in a folder: the same in every process and kvplug version."""
    return hashlib.blake2b(salt.encode(), digest_size=TAG_SIZE, person=_PERSON).digest()


def tag_file(fd: int, tag: bytes) -> bool:
    """Set ``tag`` on the open file ``fd``; whether it was (a file system without user
    attributes: the record counts for no tenant of the folder)."""
    try:
        os.setxattr(fd, TAG_XATTR, tag)
    except OSError:
        return False
    return True


def record_tag(folder: Records, digest: str) -> bytes | None:
    """The tenant tag of a record file, ``None`` when it has none (or cannot be read)."""
    try:
        opened = folder.open_record(digest)
    except OSError:
        return None
    if opened is None:
        return None
    fd, _ = opened
    try:
        return _tag_of(fd)
    finally:
        os.close(fd)


def read_tag(dir_fd: int, name: str) -> bytes | None:
    """The tenant tag of the record file ``name`` in the shard folder open as ``dir_fd`` (a
    listing's: it opens nothing but the file), ``None`` when it has none or is not a regular
    file (opened without following a link, non-blocking: a FIFO planted there cannot hang it)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        regular = S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        regular = False
    try:
        return _tag_of(fd) if regular else None
    finally:
        os.close(fd)


def _tag_of(fd: int) -> bytes | None:
    try:
        tag = os.getxattr(fd, TAG_XATTR)
    except OSError:  # no attribute, or none on this file system
        return None
    return tag if len(tag) == TAG_SIZE else None


def encode_usage(total: int, tenants: Mapping[bytes, int] | None) -> bytes:
    """The ledger's bytes: the total, then (``tenants`` known, at most :data:`MAX_TABLE_TENANTS`) the tenant table."""
    if tenants is None:
        return total.to_bytes(8, "little")
    kept = sorted((tag, size) for tag, size in tenants.items() if size > 0)
    if len(kept) > MAX_TABLE_TENANTS:
        return total.to_bytes(8, "little")
    body = _TABLE_HEAD.pack(total, _TABLE_MAGIC, len(kept), total) + b"".join(_ENTRY.pack(*entry) for entry in kept)
    return body + _check(body)


def decode_usage(data: bytes) -> tuple[int | None, dict[bytes, int] | None]:
    """The total (``None``: no valid one) and the tenant table (``None``: none, torn or stale)."""
    if len(data) < 8:
        return None, None
    total = int.from_bytes(data[:8], "little")
    if len(data) < _TABLE_HEAD.size + _CHECK_SIZE:
        return total, None
    _, magic, count, again = _TABLE_HEAD.unpack_from(data)
    end = _TABLE_HEAD.size + count * _ENTRY.size
    if magic != _TABLE_MAGIC or again != total or len(data) != end + _CHECK_SIZE or data[end:] != _check(data[:end]):
        return total, None
    entries = (_ENTRY.unpack_from(data, _TABLE_HEAD.size + i * _ENTRY.size) for i in range(count))
    return total, {tag: size for tag, size in entries}


def _check(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=_CHECK_SIZE).digest()
