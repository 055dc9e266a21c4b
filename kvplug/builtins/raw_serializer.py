"""Serializer ``raw``: the tensor's bytes behind a checksummed ``KVPL`` header."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvplug.core import chunk_format
from kvplug.core.chunk_format import dtype_name
from kvplug.core.serializer import Serializer
from kvplug.core.tier import Buffer
from kvplug.errors import IncompatibleChunkError

if TYPE_CHECKING:  # imported where a frame is made or read: ``kvplug config validate`` reads the Config alone
    import torch


class RawSerializer(Serializer):
    """Zero-copy on both sides: the connector gathers into the frame, and
    ``loads`` returns a tensor over the stored bytes after checking them."""

    name = "raw"

    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, new_buffer: Callable[[int], Any] = bytearray
    ) -> tuple[Any, torch.Tensor]:
        header = chunk_format.pack_header(dtype_name(dtype), shape)
        length = chunk_format.payload_length(dtype_name(dtype), shape)
        frame = new_buffer(chunk_format.HEADER_SIZE + length)
        memoryview(frame).cast("B")[: chunk_format.HEADER_SIZE] = header
        return frame, _tensor_over(frame, dtype, shape, length)

    def seal(self, frame: Any) -> Buffer:
        view = memoryview(frame).cast("B")
        chunk_format.seal_frame(view)
        return view.toreadonly()

    def seal_unchecked(self, frame: Any) -> Buffer:
        # The checksum pass reads the whole frame once more: a third of the store's
        # memory traffic, for bytes that never leave this process (bench_engine.py).
        return memoryview(frame).cast("B").toreadonly()

    def loads(
        self,
        data: Buffer,
        *,
        expected_shape: tuple[int, ...] | None = None,
        expected_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        return self._decode(chunk_format.verify_frame(data), data, expected_shape, expected_dtype)

    def loads_trusted(
        self,
        data: Buffer,
        *,
        expected_shape: tuple[int, ...] | None = None,
        expected_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        return self._decode(chunk_format.parse_header(data), data, expected_shape, expected_dtype)

    def _decode(
        self,
        header: chunk_format.ChunkHeader,
        data: Buffer,
        expected_shape: tuple[int, ...] | None,
        expected_dtype: torch.dtype | None,
    ) -> torch.Tensor:
        if expected_dtype is not None and header.dtype != dtype_name(expected_dtype):
            raise IncompatibleChunkError(f"chunk dtype {header.dtype}, expected {dtype_name(expected_dtype)}")
        if expected_shape is not None and header.shape != tuple(expected_shape):
            raise IncompatibleChunkError(f"chunk shape {header.shape}, expected {tuple(expected_shape)}")
        # A raw frame's payload is the chunk itself, already in memory: the bound is for
        # symmetry with the other serializers (a reader never gets a chunk over it).
        self.check_chunk_shape(header.shape, chunk_format.DTYPE_SIZES[header.dtype], header.dtype)
        import torch

        return _tensor_over(data, getattr(torch, header.dtype), header.shape, header.payload_length)


def _tensor_over(buffer: Buffer, dtype: torch.dtype, shape: tuple[int, ...], length: int) -> torch.Tensor:
    import torch

    if length == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # frombuffer warns on read-only buffers; readers never write through it.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=length, offset=chunk_format.HEADER_SIZE)
    return flat.view(dtype).view(shape)
