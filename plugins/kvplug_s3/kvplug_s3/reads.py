"""Reads of the async object backend that take at most one byte past the engine's record bound.

Whatever the store says of an object's size (a listing, a HEAD, a ``Content-Length``,
a ``Content-Range``) may be missing or wrong: a gateway that answers chunked, ignores
``Range`` or misreports sizes, or another fsspec protocol that sizes objects its own
way. So a read never takes more than ``bound + 1`` bytes, and one byte past the bound
makes the record corrupt (a miss), never a hit: what is received decides, not what is
reported.
"""

from __future__ import annotations

from typing import Any

from kvplug import Buffer
from kvplug.errors import CorruptChunkError

#: What one read of a body asks for at a time.
_PIECE = 1 << 20
#: The most a read without a record bound allocates on the word of a reported size.
_TRUSTED_UNBOUNDED = 64 << 20
#: S3 error codes of a ranged GET on an empty object (it has no byte 0).
_EMPTY_RANGE_CODES = ("InvalidRange", "416")


def over_bound(bound: int, size: int | None = None) -> CorruptChunkError:
    """The corrupt-record error of a record over ``bound`` bytes (``size`` where known)."""
    found = "record" if size is None else f"record is {size} bytes,"
    return CorruptChunkError(f"{found} over the {bound} bytes a record of this store can be")


def s3_error_code(exc: BaseException) -> str | None:
    """The S3 error code (``NoSuchKey``, ``NoSuchBucket``, ...) behind an exception
    that s3fs translated, found on the botocore error it chained; ``None`` when none."""
    response = _error_response(exc)
    code = response.get("Error", {}).get("Code") if response else None
    return str(code) if code else None


def s3_http_status(exc: BaseException) -> int | None:
    """The HTTP status of the answer behind an exception that s3fs translated; ``None`` when none."""
    response = _error_response(exc)
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") if response else None
    return status if isinstance(status, int) else None


def _error_response(exc: BaseException) -> dict[str, Any] | None:
    """The parsed answer of the botocore error that ``exc`` chains (s3fs chains one level)."""
    seen: BaseException | None = exc
    for _ in range(5):  # a little more than one level is harmless
        if seen is None:
            return None
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            return response
        seen = seen.__cause__ or seen.__context__
    return None


def reported_total(response: dict[str, Any]) -> int | None:
    """An object's whole size from a GET's answer: ``Content-Range``'s total for a ranged
    answer (``None`` for ``*``, a total the server does not know), else ``Content-Length``;
    ``None`` where the answer says neither."""
    content_range = str(response.get("ContentRange") or "")  # "bytes 0-N/<size>"
    if content_range:
        total = content_range.rpartition("/")[2]
        return int(total) if total.isdigit() else None
    length = response.get("ContentLength")
    return length if isinstance(length, int) and length >= 0 else None


async def read_body(body: Any, limit: int | None, expected: int | None = None) -> bytearray:
    """At most ``limit`` bytes of a GET's streamed body (all of it for ``None``), read into one
    buffer of the length the answer reports (``expected``, its ``Content-Length``), so a record
    costs its size once, not its pieces and then their join. A body longer than reported (a
    gateway that misreports) grows the buffer piece by piece, up to ``limit``; a shorter one
    is cut to what came. Without a limit a reported size is trusted only up to
    :data:`_TRUSTED_UNBOUNDED` (a server could claim a terabyte). The caller closes the body,
    which drops a connection with bytes left unread."""
    ceiling = limit if limit is not None else 1 << 62
    buffer = bytearray(max(0, min(expected or 0, ceiling if limit is not None else _TRUSTED_UNBOUNDED)))
    got = 0
    while got < ceiling:
        if got == len(buffer):
            buffer.extend(bytes(min(_PIECE, ceiling - got)))
        # One piece at a time: a body reads no more than it is asked into its own buffer
        # first (httpx's collects that much), and a memoryview must be let go before the
        # buffer can grow or shrink.
        with memoryview(buffer) as whole, whole[got : min(len(buffer), got + _PIECE)] as piece:
            count: int = await body.readinto(piece)
        if not count:
            break
        got += count
    del buffer[got:]
    return buffer


async def body_length(body: Any, limit: int) -> int:
    """How many bytes a GET's body holds, counting at most ``limit``: read piece by piece
    and dropped, so telling an object over the record bound holds none of it."""
    got = 0
    while got < limit:
        piece: bytes = await body.read(min(limit - got, _PIECE))
        if not piece:
            break
        got += len(piece)
    return got


async def body_equals(body: Any, expected: Buffer) -> bool:
    """Whether a GET's body is exactly ``expected``, compared piece by piece (reading at most
    one byte past it), so the comparison holds no second copy of the record."""
    view = memoryview(expected).cast("B")
    got = 0
    while True:
        piece: bytes = await body.read(min(view.nbytes + 1 - got, _PIECE))
        if not piece:
            return got == view.nbytes
        if got + len(piece) > view.nbytes or view[got : got + len(piece)] != piece:
            return False
        got += len(piece)


async def s3_size(fs: Any, path: str) -> int | None:
    """The size of the object at ``path`` from one ranged GET of its first byte (one round
    trip, hit or miss: s3fs's ``_info`` would HEAD and, on a miss, list the prefix; a GET,
    unlike a HEAD, also tells a missing key from a missing bucket). At most that byte is
    read, also from a gateway that ignores ``Range``. ``None`` when the answer gives no size."""
    bucket, key, _ = fs.split_path(path)
    try:
        response = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range="bytes=0-0")
    except OSError as exc:
        if s3_error_code(exc) in _EMPTY_RANGE_CODES:
            return 0
        raise
    body = response["Body"]
    try:
        await read_body(body, 1)
    finally:
        body.close()
    return reported_total(response)


async def s3_read(fs: Any, path: str, bound: int | None) -> bytes | bytearray | CorruptChunkError:
    """One GET of the object at ``path`` (s3fs would HEAD first to decide on ranged reads),
    for its first ``bound + 1`` bytes, and no more of the body is read whatever the answer
    says: anyone who can write the bucket could otherwise make a reader allocate gigabytes,
    and a record longer than any this engine stores be served. Only the bytes received
    decide (a size the answer reports is named in the error, never trusted)."""
    bucket, key, _ = fs.split_path(path)
    ranged = {} if bound is None else {"Range": f"bytes=0-{bound}"}
    try:
        response = await fs._call_s3("get_object", Bucket=bucket, Key=key, **ranged)
    except OSError as exc:
        if ranged and s3_error_code(exc) in _EMPTY_RANGE_CODES:
            return b""  # an empty object: not a record (the tier's checks say so)
        raise
    body = response["Body"]
    length = response.get("ContentLength")
    try:
        data = await read_body(body, None if bound is None else bound + 1, length if isinstance(length, int) else None)
    finally:
        body.close()
    if bound is not None and len(data) > bound:
        return over_bound(bound, reported_total(response))
    return data


async def cat_bounded(fs: Any, path: str, bound: int | None) -> bytes | CorruptChunkError:
    """The object at ``path`` from another async fsspec filesystem (gcsfs, adlfs, ...),
    asked for its first ``bound + 1`` bytes only (a ranged read, whatever its listing says
    of the size); more than ``bound`` bytes back make it corrupt. A range of an empty object
    is unsatisfiable (HTTP 416, an error of the client library): that is an empty object,
    not a failure of the store, which anyone who can write the bucket could repeat until
    the breaker opens."""
    if bound is None:
        whole: bytes = await fs._cat_file(path)
        return whole
    try:
        data: bytes = await fs._cat_file(path, start=0, end=bound + 1)
    except FileNotFoundError:
        raise
    except Exception as exc:
        if await _is_empty(fs, path):
            return b""  # not a record (the tier's checks say so)
        raise exc
    if len(data) > bound:
        return over_bound(bound)
    return data


async def _is_empty(fs: Any, path: str) -> bool:
    """Whether the store lists the object at ``path`` as empty (``False`` when it cannot say)."""
    try:
        info = await fs._info(path)
    except Exception:
        return False
    return bool(info.get("size") == 0)
