"""The frame a persistent tier wraps around each stored value, without torch.

Tiers store opaque bytes, but a file or object can be torn, truncated, bit-rotted,
swapped for another key's, or forged by anyone who can write the store. Every
persistent tier (disk, s3, fsspec, and remote key-value tiers) writes a 64-byte
header followed by the value. Two versions exist; which one is written depends on
whether this process has an integrity key (:mod:`kvplug.core.records.integrity`)::

    version 1 (no integrity key: checksums against accidents, not attackers)
    0   4s  magic b"KVPR"
    4   H   record version (1)
    6   H   header length (64)
    8   Q   value length
    16  32s sha256 of the key (binds the bytes to the key they were stored under)
    48  Q   xxh3_64 of the value
    56  Q   xxh3_64 of header bytes [0, 56)

    version 2 (integrity key set: a keyed MAC only holders of the key can compute)
    0   4s  magic b"KVPR"
    4   H   record version (2)
    6   H   header length (64)
    8   Q   value length
    16  32s sha256 of the key
    48  16s keyed blake3 of header bytes [0, 48) and the value (128-bit MAC)

A process with a key reads only version 2 records whose MAC its key reproduces:
a version 1 record or a bad MAC is :class:`kvplug.errors.CorruptChunkError` (a miss,
counted, and removed by ``kvplug store gc``). A process without a key reads version 1
as before and treats version 2 as :class:`kvplug.errors.MissingIntegrityKeyError`
(an incompatible record: a miss, never misread, kept for the processes that hold
the key). The key is process-wide, resolved once from the environment, so the
signatures of the record functions stay as they were.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

# The key's functions, also under this module (tests and tools set and resolve the key here).
from kvplug.core.records.integrity import (  # noqa: F401
    MAX_INTEGRITY_KEY_FILE_BYTES,
    IntegrityKey,
    integrity_key,
    resolve_integrity_key,
    set_integrity_key,
)
from kvplug.core.tier import Buffer
from kvplug.errors import (
    CorruptChunkError,
    IncompatibleChunkError,
    MissingIntegrityKeyError,
    NewerFormatError,
)

if TYPE_CHECKING:
    from kvplug.core.serializer import Serializer

RECORD_MAGIC = b"KVPR"
#: The version written without an integrity key (readable by every kvplug since 0.1).
RECORD_VERSION = 1
#: The version written with an integrity key.
KEYED_RECORD_VERSION = 2
RECORD_HEADER_SIZE = 64
_HEADER = struct.Struct("<4sHHQ32sQQ")
_KEYED_HEADER = struct.Struct("<4sHHQ32s16s")
_PREFIX = struct.Struct("<4sHH")
_MAC_OFFSET = 48
assert _HEADER.size == _KEYED_HEADER.size == RECORD_HEADER_SIZE


@dataclass(frozen=True)
class RecordHeader:
    value_length: int
    key_digest: bytes
    value_checksum: int
    #: 1: unkeyed checksums; 2: keyed MAC (``value_checksum`` is 0 then).
    version: int = RECORD_VERSION

    @property
    def record_length(self) -> int:
        return RECORD_HEADER_SIZE + self.value_length


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def pack_record_header(key: str, value: Buffer) -> bytes:
    """The 64-byte header for ``value`` stored under ``key`` (keyed when this process has a key)."""
    view = memoryview(value)
    secret = integrity_key()
    if secret is not None:
        prefix = _KEYED_HEADER.pack(
            RECORD_MAGIC, KEYED_RECORD_VERSION, RECORD_HEADER_SIZE, view.nbytes, key_digest(key), b""
        )[:_MAC_OFFSET]
        return prefix + secret.mac(prefix, view)
    body = _HEADER.pack(
        RECORD_MAGIC,
        RECORD_VERSION,
        RECORD_HEADER_SIZE,
        view.nbytes,
        key_digest(key),
        xxhash.xxh3_64_intdigest(view),
        0,
    )
    return body[:56] + struct.pack("<Q", xxhash.xxh3_64_intdigest(body[:56]))


def pack_record(key: str, value: Buffer) -> bytes:
    """Header and value as one bytes object (for stores that take one buffer)."""
    return pack_record_header(key, value) + bytes(value)


def parse_record_header(data: Buffer, key: str | None = None) -> RecordHeader:
    """Check magic, version, header checksum and (if given) the key; not the value (nor a MAC)."""
    view = memoryview(data)
    if view.nbytes < RECORD_HEADER_SIZE:
        raise CorruptChunkError(f"record is {view.nbytes} bytes, shorter than its header")
    magic, version, header_size = _PREFIX.unpack_from(view, 0)
    if magic != RECORD_MAGIC:
        raise CorruptChunkError(f"bad record magic {bytes(magic)!r}")
    if version > KEYED_RECORD_VERSION:
        # Before any checksum: a newer kvplug's header need not keep version 1's checksum
        # where version 1 has it (version 2 does not), and its records, in a store shared
        # during a rolling upgrade, must be kept, not deleted as corrupt or incompatible.
        raise NewerFormatError(
            f"record version {version} is newer than this kvplug reads ({RECORD_VERSION} or {KEYED_RECORD_VERSION}): "
            "written by a later kvplug"
        )
    if version not in (RECORD_VERSION, KEYED_RECORD_VERSION) or header_size != RECORD_HEADER_SIZE:
        raise IncompatibleChunkError(
            f"record version {version} (header {header_size} bytes) is not one this kvplug reads "
            f"({RECORD_VERSION} or {KEYED_RECORD_VERSION}, header {RECORD_HEADER_SIZE} bytes)"
        )
    secret = integrity_key()
    if version == KEYED_RECORD_VERSION:
        if secret is None:
            raise MissingIntegrityKeyError(
                "record is signed with an integrity key and this process has none (set KVPLUG_INTEGRITY_KEY)"
            )
        _, _, _, length, digest, _ = _KEYED_HEADER.unpack_from(view, 0)
        checksum = 0
    else:
        _, _, _, length, digest, checksum, header_checksum = _HEADER.unpack_from(view, 0)
        if header_checksum != xxhash.xxh3_64_intdigest(view[:56]):
            raise CorruptChunkError("record header checksum mismatch")
        if secret is not None:
            # Anyone can compute an unkeyed record: with a key set it proves nothing.
            raise CorruptChunkError("record has no keyed MAC and this process requires one (integrity key set)")
    if key is not None and digest != key_digest(key):
        raise CorruptChunkError("record was stored under another key")
    return RecordHeader(length, digest, checksum, version)


def check_record_size(header: Buffer, size: int, max_bytes: int | None = None) -> None:
    """Raise ``CorruptChunkError`` when a stored record of ``size`` bytes, whose first
    bytes are ``header``, cannot be whole: over ``max_bytes``, not a record (its magic),
    or its header declares another length than ``size``. Unverified: the checks that
    need the whole record come after it is read.

    For a store that knows a record's size before it reads it (a file's ``fstat``):
    call it with the header alone, so a sparse or forged file of a few KiB on disk that
    claims a gigabyte is a miss without that gigabyte being allocated."""
    view = memoryview(header).cast("B")
    if max_bytes is not None and size > max_bytes:
        raise CorruptChunkError(f"record is {size} bytes, over the {max_bytes} bytes a record of this store can be")
    if view.nbytes < RECORD_HEADER_SIZE:
        return  # too short to declare a length: reading it costs nothing, and verification refuses it
    if bytes(view[:4]) != RECORD_MAGIC:
        raise CorruptChunkError(f"bad record magic {bytes(view[:4])!r}")
    declared = RECORD_HEADER_SIZE + int.from_bytes(view[8:16], "little")
    if declared != size:
        raise CorruptChunkError(f"record is {size} bytes, header says {declared}")


def unpack_record(data: Buffer, key: str | None = None, *, check_value: bool = True) -> memoryview:
    """The verified value inside a record (a zero-copy view of ``data``).

    ``check_value=False`` checks everything but the checksum over the value (magic,
    version, header checksum, key, length; a keyed record's MAC still covers its value):
    for a store whose operator trusts its bytes as the process's own (tier ``shm``'s
    ``trust_host``, docs/security.md)."""
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    header = parse_record_header(view, key)
    if view.nbytes != header.record_length:
        raise CorruptChunkError(f"record is {view.nbytes} bytes, header says {header.record_length}")
    value = view[RECORD_HEADER_SIZE:]
    if header.version == KEYED_RECORD_VERSION:
        secret = integrity_key()
        assert secret is not None  # parse_record_header refused a keyed record otherwise
        expected = secret.mac(view[:_MAC_OFFSET], value)
        if not _same(expected, view[_MAC_OFFSET:RECORD_HEADER_SIZE]):
            raise CorruptChunkError("record MAC mismatch (forged, damaged, or written with another integrity key)")
    elif check_value and xxhash.xxh3_64_intdigest(value) != header.value_checksum:
        raise CorruptChunkError("record value checksum mismatch")
    return value.toreadonly()


def _same(expected: bytes, found: memoryview) -> bool:
    import hmac

    return hmac.compare_digest(expected, bytes(found))


def record_bound(serializer: Serializer, chunk_bytes: int | None) -> int:
    """The largest record (header and frame) of a chunk of ``chunk_bytes``, or of the
    largest chunk the serializer decodes (``max_chunk_bytes``): a larger one is corrupt."""
    largest = serializer.max_chunk_bytes if chunk_bytes is None else min(chunk_bytes, serializer.max_chunk_bytes)
    return RECORD_HEADER_SIZE + serializer.max_frame_bytes(largest)
