"""The on-storage frame of a serialized KV chunk (format ``KVPL`` v1), without torch.

Layout, little-endian, 96 bytes of header then the payload::

    0   4s  magic  b"KVPL"
    4   H   frame version (1)
    6   H   header length (96)
    8   16s dtype name, ASCII, NUL padded ("bfloat16", "float8_e4m3fn", ...)
    24  B   ndim (0..6)
    25  3x  padding
    28  6I  shape, unused dims 0     (24 bytes)
    52  4x  padding
    56  Q   payload length in bytes
    64  16s reserved, zero
    80  Q   xxh3_64 of the whole frame except these 8 bytes
    88  8x  reserved, zero

The checksum covers the header as well as the payload, so a flipped bit in the
shape or dtype is caught like one in the data. Everything here works on bytes so
that ``kvplug store verify`` and tiers can check frames without importing torch.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import xxhash

from kvplug.errors import CorruptChunkError, IncompatibleChunkError, NewerFormatError


def dtype_name(dtype: object) -> str:
    """The name a frame header and a fingerprint give a torch dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


MAGIC = b"KVPL"
FRAME_VERSION = 1
HEADER_SIZE = 96
MAX_NDIM = 6
#: The default bound on a decoded chunk (``KVPlugConfig.max_chunk_bytes``, ``Serializer.max_chunk_bytes``).
DEFAULT_MAX_CHUNK_BYTES = 1 << 30
_CHECKSUM_OFFSET = 80
_STRUCT = struct.Struct("<4sHH16sB3x6I4xQ16sQ8x")
assert _STRUCT.size == HEADER_SIZE

#: dtype name -> bytes per element. Names are torch's (``str(torch.bfloat16)[6:]``).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
}


@dataclass(frozen=True)
class ChunkHeader:
    """The decoded header of a chunk frame."""

    dtype: str
    shape: tuple[int, ...]
    payload_length: int
    checksum: int
    version: int = FRAME_VERSION

    @property
    def frame_length(self) -> int:
        return HEADER_SIZE + self.payload_length


def payload_length(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a C-contiguous tensor of ``dtype`` and ``shape``."""
    try:
        itemsize = DTYPE_SIZES[dtype]
    except KeyError:
        raise IncompatibleChunkError(f"dtype {dtype!r} is not supported; supported: {', '.join(DTYPE_SIZES)}") from None
    return itemsize * math.prod(shape)


def pack_header(dtype: str, shape: tuple[int, ...]) -> bytearray:
    """A header with a zero checksum; :func:`seal_frame` fills it in."""
    if len(shape) > MAX_NDIM:
        raise IncompatibleChunkError(f"a chunk has at most {MAX_NDIM} dims, got shape {shape}")
    if any(d < 0 or d >= 2**32 for d in shape):
        raise IncompatibleChunkError(f"chunk dims must fit in uint32, got shape {shape}")
    padded = tuple(shape) + (0,) * (MAX_NDIM - len(shape))
    header = bytearray(HEADER_SIZE)
    _STRUCT.pack_into(
        header,
        0,
        MAGIC,
        FRAME_VERSION,
        HEADER_SIZE,
        dtype.encode("ascii"),
        len(shape),
        *padded,
        payload_length(dtype, shape),
        b"",
        0,
    )
    return header


def frame_checksum(frame: memoryview) -> int:
    """xxh3_64 over every byte of the frame but the checksum field itself."""
    digest = xxhash.xxh3_64()
    digest.update(frame[:_CHECKSUM_OFFSET])
    digest.update(frame[_CHECKSUM_OFFSET + 8 :])
    return digest.intdigest()


def seal_frame(frame: bytearray | memoryview) -> None:
    """Write the checksum of a fully written frame into its header, in place."""
    view = memoryview(frame)
    struct.pack_into("<Q", view, _CHECKSUM_OFFSET, frame_checksum(view))


def parse_header(data: bytes | bytearray | memoryview) -> ChunkHeader:
    """Decode and sanity-check a frame's header (not its checksum)."""
    view = memoryview(data)
    if view.nbytes < HEADER_SIZE:
        raise CorruptChunkError(f"chunk is {view.nbytes} bytes, shorter than its header")
    magic, version, header_size, dtype_raw, ndim, *rest = _STRUCT.unpack_from(view, 0)
    dims, (length, _, checksum) = rest[:MAX_NDIM], rest[MAX_NDIM:]
    if magic != MAGIC:
        raise CorruptChunkError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version > FRAME_VERSION:
        raise NewerFormatError(f"chunk frame version {version} is newer than this kvplug reads ({FRAME_VERSION})")
    if version != FRAME_VERSION or header_size != HEADER_SIZE:
        raise IncompatibleChunkError(
            f"chunk frame version {version} (header {header_size} bytes) is not version {FRAME_VERSION}"
        )
    if ndim > MAX_NDIM:
        raise CorruptChunkError(f"ndim {ndim} exceeds {MAX_NDIM}")
    try:
        dtype = dtype_raw.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise CorruptChunkError("dtype field is not ASCII") from None
    shape = tuple(dims[:ndim])
    if dtype not in DTYPE_SIZES:
        # Every kvplug knows the dtypes earlier ones wrote: an unknown one is a later kvplug's.
        raise NewerFormatError(f"chunk dtype {dtype!r} is not one this kvplug knows (a later kvplug's)")
    if length != payload_length(dtype, shape):
        raise CorruptChunkError(f"payload length {length} does not match dtype {dtype} and shape {shape}")
    if view.nbytes != HEADER_SIZE + length:
        raise CorruptChunkError(f"chunk is {view.nbytes} bytes, header says {HEADER_SIZE + length}")
    return ChunkHeader(dtype=dtype, shape=shape, payload_length=length, checksum=checksum)


def verify_frame(data: bytes | bytearray | memoryview) -> ChunkHeader:
    """Parse the header and check the checksum; raise on any mismatch."""
    header = parse_header(data)
    actual = frame_checksum(memoryview(data))
    if actual != header.checksum:
        raise CorruptChunkError(f"checksum mismatch: stored {header.checksum:016x}, computed {actual:016x}")
    return header
