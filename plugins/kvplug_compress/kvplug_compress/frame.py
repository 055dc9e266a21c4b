"""The on-storage frame of a compressed or quantized KV chunk (format ``KVPC`` v1).

Layout, little-endian, 96 bytes of header then the payload::

    0   4s  magic  b"KVPC"
    4   H   frame version (1)
    6   H   header length (96)
    8   8s  codec name, ASCII, NUL padded ("zstd", "lz4", "int8", "fp8")
    16  16s dtype name of the chunk tensor, ASCII, NUL padded ("bfloat16", ...)
    32  B   ndim (0..6)
    33  B   encoding: 0 = stored (the payload is the tensor's bytes), 1 = encoded by the codec
    34  2x  padding
    36  6I  shape, unused dims 0     (24 bytes)
    60  I   codec parameter A (lossless: elements per segment; lossy: group size)
    64  i   codec parameter B (lossless: compression level; lossy: scale dtype code)
    68  4x  padding
    72  Q   payload length in bytes
    80  Q   xxh3_64 of the whole frame except these 8 bytes
    88  8x  reserved, zero

Like core's ``KVPL`` frame, the checksum covers header and payload, so a flipped bit
anywhere is a :class:`~kvplug.errors.CorruptChunkError`; a frame of another version,
codec, dtype or shape is an :class:`~kvplug.errors.IncompatibleChunkError`. The magic
differs from ``KVPL`` on purpose: tools that check raw frames (``kvplug store verify``)
see these as opaque values instead of misreading their payload length.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import xxhash

from kvplug import CHUNK_DTYPE_SIZES, RAW_FRAME_MAGIC
from kvplug.errors import CorruptChunkError, IncompatibleChunkError

MAGIC = b"KVPC"
FRAME_VERSION = 1
HEADER_SIZE = 96
MAX_NDIM = 6
#: Bytes of the header's codec field: a serializer's name must fit (a longer one would be cut,
#: and no frame it wrote would read back as its own).
MAX_CODEC_NAME = 8
STORED = 0
ENCODED = 1
_CHECKSUM_OFFSET = 80
_STRUCT = struct.Struct("<4sHH8s16sBB2x6IIi4xQQ8x")
assert _STRUCT.size == HEADER_SIZE


@dataclass(frozen=True)
class FrameHeader:
    """The decoded header of a ``KVPC`` frame."""

    codec: str
    dtype: str
    shape: tuple[int, ...]
    encoding: int
    param_a: int
    param_b: int
    payload_length: int
    checksum: int

    @property
    def itemsize(self) -> int:
        return CHUNK_DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def itemsize_of(dtype: str) -> int:
    """Bytes per element of ``dtype``; ``IncompatibleChunkError`` naming the allowed ones."""
    try:
        return CHUNK_DTYPE_SIZES[dtype]
    except KeyError:
        supported = ", ".join(CHUNK_DTYPE_SIZES)
        raise IncompatibleChunkError(f"dtype {dtype!r} is not supported; supported: {supported}") from None


def pack_header(
    codec: str, dtype: str, shape: tuple[int, ...], *, encoding: int, param_a: int, param_b: int, payload_length: int
) -> bytes:
    """A header with a zero checksum; :func:`seal` fills it in once the payload is written."""
    itemsize_of(dtype)
    if len(shape) > MAX_NDIM:
        raise IncompatibleChunkError(f"a chunk has at most {MAX_NDIM} dims, got shape {shape}")
    if any(d < 0 or d >= 2**32 for d in shape):
        raise IncompatibleChunkError(f"chunk dims must fit in uint32, got shape {shape}")
    padded = tuple(shape) + (0,) * (MAX_NDIM - len(shape))
    return _STRUCT.pack(
        MAGIC,
        FRAME_VERSION,
        HEADER_SIZE,
        codec.encode("ascii"),
        dtype.encode("ascii"),
        len(shape),
        encoding,
        *padded,
        param_a,
        param_b,
        payload_length,
        0,
    )


def _checksum(view: memoryview) -> int:
    digest = xxhash.xxh3_64()
    digest.update(view[:_CHECKSUM_OFFSET])
    digest.update(view[_CHECKSUM_OFFSET + 8 :])
    return digest.intdigest()


def seal(frame: bytearray) -> None:
    """Write the checksum of a fully written frame into its header, in place."""
    struct.pack_into("<Q", frame, _CHECKSUM_OFFSET, _checksum(memoryview(frame)))


def _ascii(raw: bytes, field: str) -> str:
    try:
        return raw.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise CorruptChunkError(f"{field} field is not ASCII") from None


def verify(data: bytes | bytearray | memoryview, codec: str) -> FrameHeader:
    """Parse the header, check lengths and checksum, and that ``codec`` wrote it."""
    view = memoryview(data).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise CorruptChunkError(f"chunk is {view.nbytes} bytes, shorter than its header")
    magic, version, header_size, codec_raw, dtype_raw, ndim, encoding, *rest = _STRUCT.unpack_from(view, 0)
    dims, (param_a, param_b, length, checksum) = rest[:MAX_NDIM], rest[MAX_NDIM:]
    if magic == RAW_FRAME_MAGIC:  # core's raw frame, handed to a compressing serializer
        raise IncompatibleChunkError(f"a 'raw' serializer frame, not one of serializer {codec!r}")
    if magic != MAGIC:
        raise CorruptChunkError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FRAME_VERSION or header_size != HEADER_SIZE:
        raise IncompatibleChunkError(
            f"compressed frame version {version} (header {header_size} bytes) is not version {FRAME_VERSION}"
        )
    if view.nbytes != HEADER_SIZE + length:
        raise CorruptChunkError(f"chunk is {view.nbytes} bytes, header says {HEADER_SIZE + length}")
    actual = _checksum(view)
    if actual != checksum:
        raise CorruptChunkError(f"checksum mismatch: stored {checksum:016x}, computed {actual:016x}")
    # Checked after the checksum: a field that reads wrong here was written that way.
    written_by = _ascii(codec_raw, "codec")
    if written_by != codec:
        raise IncompatibleChunkError(f"chunk written by serializer {written_by!r}, read by {codec!r}")
    if ndim > MAX_NDIM or encoding not in (STORED, ENCODED):
        raise CorruptChunkError(f"ndim {ndim} or encoding {encoding} out of range")
    dtype = _ascii(dtype_raw, "dtype")
    itemsize_of(dtype)
    return FrameHeader(written_by, dtype, tuple(dims[:ndim]), encoding, param_a, param_b, length, checksum)


def check_expected(header: FrameHeader, expected_shape: tuple[int, ...] | None, expected_dtype: str | None) -> None:
    """``IncompatibleChunkError`` if the frame holds another dtype or shape than the reader wants."""
    if expected_dtype is not None and header.dtype != expected_dtype:
        raise IncompatibleChunkError(f"chunk dtype {header.dtype}, expected {expected_dtype}")
    if expected_shape is not None and header.shape != tuple(expected_shape):
        raise IncompatibleChunkError(f"chunk shape {header.shape}, expected {tuple(expected_shape)}")
