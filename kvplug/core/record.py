"""The frame a persistent tier wraps around each stored value, without torch.

Tiers store opaque bytes, but a file or object can be torn, truncated, bit-rotted
or swapped for another key's. Every persistent tier (disk, s3, fsspec) writes::

    0   4s  magic b"KVPR"
    4   H   record version (1)
    6   H   header length (64)
    8   Q   value length
    16  32s sha256 of the key (binds the bytes to the key they were stored under)
    48  Q   xxh3_64 of the value
    56  Q   xxh3_64 of header bytes [0, 56)

followed by the value. :func:`unpack_record` checks all of it and raises
:class:`kvplug.errors.CorruptChunkError` or ``IncompatibleChunkError``.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import xxhash

from kvplug.core.tier import Buffer
from kvplug.errors import CorruptChunkError, IncompatibleChunkError

RECORD_MAGIC = b"KVPR"
RECORD_VERSION = 1
RECORD_HEADER_SIZE = 64
_HEADER = struct.Struct("<4sHHQ32sQQ")
assert _HEADER.size == RECORD_HEADER_SIZE


@dataclass(frozen=True)
class RecordHeader:
    value_length: int
    key_digest: bytes
    value_checksum: int

    @property
    def record_length(self) -> int:
        return RECORD_HEADER_SIZE + self.value_length


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def pack_record_header(key: str, value: Buffer) -> bytes:
    """The 64-byte header for ``value`` stored under ``key``."""
    view = memoryview(value)
    body = _HEADER.pack(
        RECORD_MAGIC, RECORD_VERSION, RECORD_HEADER_SIZE, view.nbytes, key_digest(key), xxhash.xxh3_64_intdigest(view), 0
    )
    return body[:56] + struct.pack("<Q", xxhash.xxh3_64_intdigest(body[:56]))


def pack_record(key: str, value: Buffer) -> bytes:
    """Header and value as one bytes object (for stores that take one buffer)."""
    return pack_record_header(key, value) + bytes(value)


def parse_record_header(data: Buffer, key: str | None = None) -> RecordHeader:
    """Check magic, version, header checksum and (if given) the key; not the value."""
    view = memoryview(data)
    if view.nbytes < RECORD_HEADER_SIZE:
        raise CorruptChunkError(f"record is {view.nbytes} bytes, shorter than its header")
    magic, version, header_size, length, digest, checksum, header_checksum = _HEADER.unpack_from(view, 0)
    if magic != RECORD_MAGIC:
        raise CorruptChunkError(f"bad record magic {bytes(magic)!r}")
    if header_checksum != xxhash.xxh3_64_intdigest(view[:56]):
        raise CorruptChunkError("record header checksum mismatch")
    if version != RECORD_VERSION or header_size != RECORD_HEADER_SIZE:
        raise IncompatibleChunkError(f"record version {version} is not {RECORD_VERSION}")
    if key is not None and digest != key_digest(key):
        raise CorruptChunkError("record was stored under another key")
    return RecordHeader(length, digest, checksum)


def unpack_record(data: Buffer, key: str | None = None) -> memoryview:
    """The verified value inside a record (a zero-copy view of ``data``)."""
    view = memoryview(data)
    header = parse_record_header(view, key)
    if view.nbytes != header.record_length:
        raise CorruptChunkError(f"record is {view.nbytes} bytes, header says {header.record_length}")
    value = view[RECORD_HEADER_SIZE:]
    if xxhash.xxh3_64_intdigest(value) != header.value_checksum:
        raise CorruptChunkError("record value checksum mismatch")
    return value.toreadonly()
