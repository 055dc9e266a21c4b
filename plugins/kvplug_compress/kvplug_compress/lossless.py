"""Serializers ``zstd`` and ``lz4``: lossless, bit-exact, byte planes compressed apart.

Each element is split into its bytes, and byte ``i`` of every element goes to plane
``i``: the sign/exponent plane of bf16 or fp16 KV is highly repetitive and shrinks a
lot, while the mantissa plane is close to random and barely does; compressed
together, the mantissa bytes would break up the exponent runs. A chunk is cut into
segments of ``segment_bytes``; each segment's planes are compressed independently, on
a thread pool when there is more than one segment (both C libraries release the GIL).

Payload of a ``KVPC`` frame (encoding 1)::

    u32[segments * itemsize]   compressed length of each (segment, plane), high bit: stored as is
    the compressed planes, segment by segment, plane by plane

If compressing would not make the chunk smaller it is stored as is (encoding 0).
"""

from __future__ import annotations

import os
import struct
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import lz4.block
import zstandard
from pydantic import BaseModel, ConfigDict, Field

from kvplug import LazyModule
from kvplug.errors import CorruptChunkError
from kvplug_compress import frame as kvpc
from kvplug_compress.base import CompressingSerializer, tensor_over

if TYPE_CHECKING:
    import torch
else:  # loaded on first use: reading the Config needs no torch
    torch = LazyModule("torch")

_RAW_PLANE = 0x8000_0000
#: Bounds of ``segment_bytes``; a frame's segments are never smaller than the lower one.
MIN_SEGMENT_BYTES = 4096
MAX_SEGMENT_BYTES = 1 << 28
_T = TypeVar("_T")
_R = TypeVar("_R")


class LosslessConfig(BaseModel):
    """Options shared by ``zstd`` and ``lz4``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    segment_bytes: int = Field(
        default=1 << 20,
        ge=MIN_SEGMENT_BYTES,
        le=MAX_SEGMENT_BYTES,
        description="Chunk bytes per independently compressed segment (the unit of parallel work).",
    )
    threads: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="Threads compressing segments of one chunk; None: one per CPU, at most 8 "
        "(does not change the stored bytes).",
    )


class LosslessSerializer(CompressingSerializer):
    """Byte planes of each segment, each compressed by :meth:`compress_plane`."""

    Config: ClassVar[type[BaseModel]] = LosslessConfig
    runtime_options = frozenset({"threads"})

    def __init__(self, config: BaseModel) -> None:
        super().__init__(config)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._local = threading.local()

    # --- codec ----------------------------------------------------------------------

    @abstractmethod
    def compress_plane(self, plane: memoryview) -> bytes:
        """One plane compressed; called from several threads at once."""

    @abstractmethod
    def decompress_plane(self, blob: memoryview, size: int) -> bytes:
        """One plane back, exactly ``size`` bytes; raises the library's error on bad input."""

    def level(self) -> int:
        """The level recorded in the frame header (informative; decoding does not need it)."""
        return int(getattr(self.config, "level", 0))

    # --- frames ---------------------------------------------------------------------

    def encode(self, tensor: torch.Tensor) -> bytearray:
        itemsize = tensor.element_size()
        numel = tensor.numel()
        per_segment = max(1, self.config.segment_bytes // itemsize)  # type: ignore[attr-defined]
        flat = tensor.reshape(-1).view(torch.uint8) if numel else torch.empty(0, dtype=torch.uint8)
        bounds = [(start, min(numel, start + per_segment)) for start in range(0, numel, per_segment)]
        segments = self._map(lambda span: self._compress_segment(flat, span, itemsize), bounds)
        lengths = [length for segment in segments for length, _ in segment]
        table = struct.pack(f"<{len(lengths)}I", *lengths)
        payload_length = len(table) + sum(len(blob) for segment in segments for _, blob in segment)
        if payload_length >= numel * itemsize:
            return self.stored_frame(tensor, param_a=per_segment, param_b=self.level())
        out = self.new_frame(tensor, kvpc.ENCODED, payload_length, param_a=per_segment, param_b=self.level())
        position = kvpc.HEADER_SIZE
        out[position : position + len(table)] = table
        position += len(table)
        for segment in segments:
            for _, blob in segment:
                out[position : position + len(blob)] = blob
                position += len(blob)
        return out

    def decode(self, header: kvpc.FrameHeader, payload: memoryview, dtype: torch.dtype) -> torch.Tensor:
        itemsize, numel, per_segment = header.itemsize, header.numel, header.param_a
        # Every size below comes from the header: each is checked against the payload, in
        # arithmetic, before a list or buffer is built from it. The encoder stores a chunk
        # that would not shrink (encoding 0), so an encoded payload is smaller than its chunk,
        # and its segments hold at least MIN_SEGMENT_BYTES (a 1-element segment would make
        # the table, and the lists below, larger than the chunk).
        if payload.nbytes >= numel * itemsize:
            raise CorruptChunkError(
                f"encoded payload of {payload.nbytes} bytes for a chunk of {numel * itemsize} bytes (shape {header.shape})"
            )
        if per_segment < MIN_SEGMENT_BYTES // itemsize:
            raise CorruptChunkError(
                f"segments of {per_segment} elements; a {header.dtype} segment has at least "
                f"{MIN_SEGMENT_BYTES // itemsize} (segment_bytes >= {MIN_SEGMENT_BYTES})"
            )
        segments = -(-numel // per_segment)
        table_bytes = 4 * segments * itemsize
        if table_bytes > payload.nbytes:
            raise CorruptChunkError(f"payload of {payload.nbytes} bytes cannot hold its {table_bytes}-byte table")
        bounds = [(start, min(numel, start + per_segment)) for start in range(0, numel, per_segment)]
        lengths = struct.unpack_from(f"<{segments * itemsize}I", payload, 0)
        offsets, position = [], table_bytes
        for length in lengths:
            offsets.append(position)
            position += length & ~_RAW_PLANE
        if position != payload.nbytes:
            raise CorruptChunkError(
                f"planes take {position - table_bytes} bytes, payload has {payload.nbytes - table_bytes}"
            )
        buffer = bytearray(numel * itemsize)
        out = tensor_over(buffer, torch.uint8, (numel * itemsize,))
        jobs = [
            (
                out,
                span,
                itemsize,
                [(payload, offsets[i * itemsize + p], lengths[i * itemsize + p]) for p in range(itemsize)],
            )
            for i, span in enumerate(bounds)
        ]
        self._map(self._decompress_segment, jobs)
        return tensor_over(buffer, dtype, header.shape)

    def _compress_segment(self, flat: torch.Tensor, span: tuple[int, int], itemsize: int) -> list[tuple[int, Any]]:
        start, end = span
        count = end - start
        planes = bytearray(count * itemsize)
        target = tensor_over(planes, torch.uint8, (itemsize, count))
        elements = flat[start * itemsize : end * itemsize].view(count, itemsize)
        # A strided read per plane into contiguous memory: about 3x faster in torch than
        # one copy of the transposed [count, itemsize] view.
        for plane in range(itemsize):
            target[plane].copy_(elements[:, plane])
        view = memoryview(planes)
        result: list[tuple[int, Any]] = []
        for plane in range(itemsize):
            raw = view[plane * count : (plane + 1) * count]
            packed = self.compress_plane(raw)
            result.append((len(packed), packed) if len(packed) < count else (count | _RAW_PLANE, raw))
        return result

    def _decompress_segment(
        self, job: tuple[torch.Tensor, tuple[int, int], int, list[tuple[memoryview, int, int]]]
    ) -> None:
        out, (start, end), itemsize, planes = job
        count = end - start
        target = out[start * itemsize : end * itemsize].view(count, itemsize)
        for plane, (payload, offset, length) in enumerate(planes):
            size = length & ~_RAW_PLANE
            blob = payload[offset : offset + size]
            if length & _RAW_PLANE:
                if size != count:
                    raise CorruptChunkError(f"stored plane of {size} bytes, expected {count}")
                data: Any = blob
            else:
                try:
                    data = self.decompress_plane(blob, count)
                except CorruptChunkError:
                    raise
                except Exception as exc:  # each library has its own error types for bad input
                    raise CorruptChunkError(f"{self.name} plane does not decompress: {exc}") from exc
                if len(data) != count:
                    raise CorruptChunkError(f"{self.name} plane decompressed to {len(data)} bytes, expected {count}")
            target[:, plane].copy_(tensor_over(data, torch.uint8, (count,)))

    def close(self) -> None:
        """End the thread pool (its threads would outlive a closed engine that is still referenced)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _map(self, work: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """``work`` over ``items``, on the pool when there is more than one item and thread."""
        threads = self.config.threads or min(8, os.cpu_count() or 1)  # type: ignore[attr-defined]
        if len(items) <= 1 or threads <= 1:
            return [work(item) for item in items]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"kvplug-{self.name}")
        return list(self._pool.map(work, items))


class ZstdConfig(LosslessConfig):
    """Options of ``zstd``."""

    level: int = Field(default=1, ge=-7, le=22, description="zstd level: negative is faster, up to 22 is smaller.")


class ZstdSerializer(LosslessSerializer):
    """Lossless: byte planes compressed with Zstandard (``zstandard``)."""

    name = "zstd"
    Config: ClassVar[type[BaseModel]] = ZstdConfig

    def compress_plane(self, plane: memoryview) -> bytes:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:  # zstandard contexts are not thread-safe: one per thread
            compressor = self._local.compressor = zstandard.ZstdCompressor(level=self.level())
        compressed: bytes = compressor.compress(plane)
        return compressed

    def decompress_plane(self, blob: memoryview, size: int) -> bytes:
        # python-zstandard allocates the content size a frame declares and ignores
        # max_output_size then: a 32 KB plane can declare 1 GiB. The declared size is checked
        # first; a frame that declares none (-1) is bounded by max_output_size.
        declared = zstandard.frame_content_size(blob)
        if declared not in (size, -1):
            raise CorruptChunkError(f"zstd plane declares {declared} bytes, expected {size}")
        decompressor = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = self._local.decompressor = zstandard.ZstdDecompressor()
        plain: bytes = decompressor.decompress(blob, max_output_size=size)
        return plain


class LZ4Config(LosslessConfig):
    """Options of ``lz4``."""

    level: int = Field(
        default=0, ge=0, le=12, description="0: LZ4's fast default mode; 1-12: LZ4 HC at that level (smaller, slower)."
    )


class LZ4Serializer(LosslessSerializer):
    """Lossless: byte planes compressed with LZ4 block format (``lz4``)."""

    name = "lz4"
    Config: ClassVar[type[BaseModel]] = LZ4Config

    def compress_plane(self, plane: memoryview) -> bytes:
        level = self.level()
        if level == 0:
            fast: bytes = lz4.block.compress(plane, store_size=False)
            return fast
        small: bytes = lz4.block.compress(plane, mode="high_compression", compression=level, store_size=False)
        return small

    def decompress_plane(self, blob: memoryview, size: int) -> bytes:
        # With uncompressed_size the output buffer is exactly size bytes: a block that
        # would decode to more is an error, whatever the blob says.
        plain: bytes = lz4.block.decompress(blob, uncompressed_size=size)
        return plain
