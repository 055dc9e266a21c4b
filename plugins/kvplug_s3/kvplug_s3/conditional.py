"""Removing a corrupt S3 object only while it is still the object that was read
(:meth:`kvplug_s3.backend.AsyncObjectBackend.delete_if_same`).

S3 cannot compare content and delete in one request, but a ``DELETE`` with
``If-Match: <ETag>`` removes the object only while its ETag is that one, and refuses
(``412 Precondition Failed``) once another writer has replaced it. So the object is
read again: if it still holds the bytes the tier judged (or, for one found bad unread,
is still longer than the record bound), it is deleted under the ETag of that very read.

A server that ignores ``If-Match`` on ``DELETE`` would remove whatever is there by then.
Each backend asks its server once, with an object of its own under the tier's prefix (not
named like a record, so never listed): a conditional delete with a wrong ETag must be
refused. Where it is not (or the probe cannot be written: a read-only bucket), corrupt
objects are kept, and the tier takes them for absent until they are stored again. A probe
that meets a passing failure (no answer, a 5xx, ``SlowDown``) decides nothing: it fails
that delete, and the next corrupt object asks again.
"""

from __future__ import annotations

import secrets
from typing import Any

from kvplug import Buffer
from kvplug_s3.reads import body_equals, body_length, s3_error_code

#: An ETag no object has: a server that honours ``If-Match`` refuses a delete under it.
_NO_SUCH_ETAG = '"00000000000000000000000000000000"'
#: Answers that say the server is busy or failing for now, not what it does with ``If-Match``.
_PASSING_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable"})


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of the S3 answer behind ``exc`` (s3fs chains botocore's error), if any."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return None
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return status if isinstance(status, int) else None
        seen = seen.__cause__ or seen.__context__
    return None


class ConditionalDeletes:
    """Whether one S3 server honours ``If-Match`` on ``DELETE`` (asked once), and the
    compare-then-delete of one object."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root
        self.honoured: bool | None = None

    async def delete_if_same(self, path: str, seen: Buffer | None, bound: int | None) -> bool:
        """Delete the object at ``path`` if it still is what was read of it; whether it was.
        Raises :class:`ConditionalDeleteUnsupported` where the server cannot be trusted to."""
        bucket, key, _ = self.fs.split_path(path)
        try:
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return False
        body = response["Body"]
        try:  # the bytes decide, at most one past what was read or the bound: a reported size is not trusted
            if seen is None:  # found bad unread (over the bound): still longer than a record can be
                same = bound is not None and await body_length(body, bound + 1) > bound
            else:
                same = await body_equals(body, seen)
        finally:
            body.close()
        if not same:  # replaced since the read (or it was not bad for this reason)
            return False
        etag = response.get("ETag")
        if not etag:
            raise ConditionalDeleteUnsupported(f"{path}: the server sent no ETag; a corrupt object is kept")
        if not await self._honoured(bucket):
            raise ConditionalDeleteUnsupported(f"s3://{bucket} ignores If-Match on DELETE: corrupt objects are kept")
        try:
            await self.fs._call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=etag)
        except FileNotFoundError:  # removed since the read
            return False
        except OSError as exc:
            if s3_error_code(exc) in ("PreconditionFailed", "412"):  # replaced since the read
                return False
            raise
        return True

    async def _honoured(self, bucket: str) -> bool:
        if self.honoured is None:
            self.honoured = await self._probe(bucket)
        return self.honoured

    async def _probe(self, bucket: str) -> bool:
        _, prefix, _ = self.fs.split_path(self.root)
        key = f"{prefix}/.kvplug-if-match-probe-{secrets.token_hex(8)}".lstrip("/")
        try:
            await self.fs._call_s3("put_object", Bucket=bucket, Key=key, Body=b"probe")
        except OSError as exc:
            if self._passing(exc):
                raise
            return False  # not ours to write: nothing is deleted on trust
        try:
            await self.fs._call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=_NO_SUCH_ETAG)
        except OSError as exc:
            honoured = s3_error_code(exc) in ("PreconditionFailed", "412")
            if not honoured and self._passing(exc):
                await self._remove_probe(bucket, key)
                raise
        else:
            return False  # deleted under an ETag it does not have: the header was ignored
        await self._remove_probe(bucket, key)
        return honoured

    async def _remove_probe(self, bucket: str, key: str) -> None:
        try:
            await self.fs._call_s3("delete_object", Bucket=bucket, Key=key)
        except OSError:
            pass  # a stray probe object is not a record: nothing lists or counts it

    def _passing(self, exc: OSError) -> bool:
        """Whether a failed probe request says nothing of the server's rules: no S3 answer
        at all (a connection cut, a timeout), a 5xx other than 501 Not Implemented, or a
        busy server's code. Cached as an answer, it would keep corrupt objects for good."""
        code, status = s3_error_code(exc), _http_status(exc)
        if code is None and status is None:
            return True
        return code in _PASSING_CODES or (status is not None and status >= 500 and status != 501)


class ConditionalDeleteUnsupported(OSError):
    """The server does not honour ``If-Match`` on ``DELETE``: the object is not removed."""
