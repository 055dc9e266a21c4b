"""What ``kvplug store`` needs from a persistent tier, and how it judges a record.

Persistent tiers name records by the sha256 digest of their key (a key never
becomes a path), so maintenance works on digests. A tier that implements
:class:`RecordStore` can be listed, verified and cleaned by ``kvplug store``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from kvplug.core import chunk_format
from kvplug.core.records.frame import KEYED_RECORD_VERSION, parse_record_header, unpack_record
from kvplug.core.records.manifest import decode_manifest
from kvplug.core.tier import Buffer
from kvplug.errors import CorruptChunkError, IncompatibleChunkError, MissingIntegrityKeyError, NewerFormatError


@dataclass(frozen=True)
class StoredRecord:
    """One stored record: the digest of its key, its size in the store, when written (or last
    used, where the store's reads move it: :attr:`~kvplug.RecordBackend.listed_time`)."""

    digest: str
    size: int
    modified: float | None = None


@runtime_checkable
class RecordStore(Protocol):
    """Optional methods of a persistent tier, used by ``kvplug store``."""

    def records(self) -> Iterator[StoredRecord]:
        """Every record in the store (its listing; may include other processes' writes)."""

    def read_record(self, digest: str) -> Buffer | None:
        """The stored bytes (record frame and value) of one record, or None if gone;
        raises ``CorruptChunkError`` for one found bad unread, ``RecordUnreadableError``
        for one that is there but cannot be read."""

    def delete_record(self, digest: str) -> bool:
        """Remove one record; False if it was already gone."""


@dataclass(frozen=True)
class RecordCheck:
    """The verdict on one record; ``dtype``/``shape`` when it holds a KV chunk frame."""

    #: ``unreadable``: there, but this process could not read it; ``oversized``: larger than the
    #: bound on what is read of a record, so not read (``kvplug store``'s verdicts). ``newer``: of a
    #: format a later kvplug wrote (kept); ``incompatible``: of one no kvplug reads any more.
    status: Literal["ok", "corrupt", "incompatible", "newer", "unverified", "gone", "unreadable", "oversized"]
    reason: str = ""
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    #: The record's keyed MAC was checked (an integrity key's signature; ``--require-signed``).
    signature_checked: bool = False


def check_record(digest: str, data: Buffer | None) -> RecordCheck:
    """Verify the record frame, that it belongs to ``digest``, and the chunk frame inside."""
    if data is None:
        return RecordCheck("gone", "vanished while checking")
    signed = False  # a record of another version has no MAC this kvplug checks
    try:
        header = parse_record_header(data)
        if header.key_digest.hex() != digest:
            raise CorruptChunkError("record was stored under another key")
        value = unpack_record(data)
        signed = header.version == KEYED_RECORD_VERSION
        if bytes(value[:4]) != chunk_format.MAGIC:
            manifest = decode_manifest(value)
            if manifest is not None:
                reason = f"fingerprint manifest {manifest.fingerprint_hex} (kvplug explain)"
                return RecordCheck("ok", reason, signature_checked=signed)
            return RecordCheck("ok", "opaque value (not a KV chunk frame)", signature_checked=signed)
        chunk = chunk_format.verify_frame(value)
    except MissingIntegrityKeyError as exc:
        return RecordCheck("unverified", str(exc))
    except NewerFormatError as exc:
        return RecordCheck("newer", str(exc), signature_checked=signed)
    except IncompatibleChunkError as exc:
        return RecordCheck("incompatible", str(exc), signature_checked=signed)
    except CorruptChunkError as exc:
        return RecordCheck("corrupt", str(exc))
    return RecordCheck("ok", dtype=chunk.dtype, shape=chunk.shape, signature_checked=signed)
