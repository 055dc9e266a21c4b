"""What every object backend of tier ``s3`` shares: the record's object name under ``root``,
the records a listing finds, and which failures count.

Object names come from the key's sha256 hex digest, never from key text:
``<root>/<digest[:2]>/<digest>``. The two-character shard keeps directory-like
stores (``file://``) at 256 entries per level and spreads S3 key prefixes.
Every primitive handles one object (:attr:`ObjectBackend.call_sizes` of 1): an
object is one request, so each gets its own deadline and retries.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Sequence
from typing import Any

from kvplug import CallSizes, FailureKind, RecordBackend, RecordToWrite, StoredRecord, WriteRefusals, classify_failure
from kvplug_s3.reads import s3_error_code

_DIGEST = re.compile(r"[0-9a-f]{64}")
#: S3 error codes that say the location itself is unusable: s3fs turns them into
#: FileNotFoundError like a missing key, but every key of the tier will fail alike.
LOCATION_ERROR_CODES = frozenset({"NoSuchBucket", "AllAccessDisabled", "AccountProblem", "NotSignedUp"})
#: Building the client is local work (no network), but slow on a busy machine.
OPEN_TIMEOUT_S = 60.0


def classify_s3_failure(exc: BaseException) -> FailureKind:
    """Like :func:`kvplug.classify_failure`, but a missing bucket (and an account that
    cannot be used) is a failure that counts towards the breaker, not an absent key:
    otherwise every lookup would pay a round trip to learn the same thing forever."""
    if s3_error_code(exc) in LOCATION_ERROR_CODES:
        return "permanent"
    return classify_failure(exc)


class ObjectBackend(RecordBackend):
    """Records as whole objects under ``root``; a missing object raises
    ``FileNotFoundError`` (a miss, see :meth:`classify`). A write the store refuses for want
    of permission (:meth:`write_refusal`) is that record's failure, and the next writes wait
    a cool-down (:class:`kvplug.WriteRefusals`): the store still serves reads."""

    # One object per request: per-object deadlines and retries.
    call_sizes = CallSizes(query=1, read=1, write=1)
    open_timeout_s = OPEN_TIMEOUT_S

    def __init__(
        self,
        fs: Any,
        root: str,
        where: str,
        record_bound: Callable[[], int | None],
        refusal_cooldown_s: float = 10.0,
    ) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.where = where
        #: The tier's ``max_record_bytes``, read at each read (the engine may raise it).
        self._record_bound = record_bound
        self.refusals = WriteRefusals(refusal_cooldown_s)

    def path_for(self, digest: str) -> str:
        return f"{self.root}/{digest[:2]}/{digest}"

    def classify(self, exc: BaseException) -> FailureKind:
        return classify_s3_failure(exc)

    async def write(self, records: Sequence[RecordToWrite]) -> list[BaseException | None]:
        refused = self.refusals.current()
        if refused is not None:
            return [refused]
        try:
            outcomes = await self._write(records)
        except OSError as exc:
            cause = self.write_refusal(exc)
            if cause is None:
                raise
            return [self.refusals.refused(self.where, cause)]
        self.refusals.accepted()
        return outcomes

    async def _write(self, records: Sequence[RecordToWrite]) -> list[BaseException | None]:
        """Write the one record of ``records`` (see :meth:`write`)."""
        raise NotImplementedError

    def write_refusal(self, exc: OSError) -> str | None:
        """What says that the store refused a write for want of permission (the cause to
        give), or ``None``: ``exc`` is the tier's failure."""
        return None

    def describe(self) -> dict[str, int | float | str]:
        return {"url": self.where}

    def _records(self, found: dict[str, dict[str, Any]]) -> list[StoredRecord]:
        records = []
        for path, info in found.items():
            parts = path.rstrip("/").rsplit("/", 2)
            # Only <root>/<shard>/<digest>: a record deeper down is another tier's (a
            # nested prefix), which this one would count, evict by the wrong path and list.
            if len(parts) == 3 and parts[0] == self.root and _DIGEST.fullmatch(parts[2]) and parts[1] == parts[2][:2]:
                records.append(StoredRecord(parts[2], int(info.get("size") or 0), modified(info)))
        return records


def modified(info: dict[str, Any]) -> float:
    """When the store says an object was last written (seconds since the epoch; 0: it does not say)."""
    for name in ("LastModified", "mtime", "created", "updated"):
        value = info.get(name)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0
