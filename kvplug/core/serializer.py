"""The serializer contract: one KV chunk tensor <-> one bytes-like frame."""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from kvplug.core.chunk_format import DEFAULT_MAX_CHUNK_BYTES
from kvplug.core.components import EmptyConfig
from kvplug.core.tier import Buffer
from kvplug.errors import CorruptChunkError

if TYPE_CHECKING:  # a serializer's module loads without torch: ``kvplug config validate`` reads its Config
    import torch


class Serializer(ABC):
    """Turns chunk tensors into frames with a versioned header and a checksum.

    The fast path is ``allocate`` + ``seal``: the engine asks for a frame, lets the
    connector gather the paged KV straight into ``tensor`` (no extra copy), then
    seals it. ``dumps`` is the convenience form for a tensor already in hand.

    Frames are untrusted input (anyone who can write a store can write one), so every
    size a decoder takes from a header (shape times itemsize, segment or plane counts,
    a codec's declared output size) is checked before anything is allocated: against
    the chunk the frame says it holds, and that against :attr:`max_chunk_bytes`, with or
    without an ``expected_shape``.
    """

    name: ClassVar[str]
    Config: ClassVar[type[BaseModel]] = EmptyConfig
    #: The largest chunk, in bytes of the decoded tensor, that ``loads`` accepts; a frame
    #: whose header asks for more is a ``CorruptChunkError`` before any allocation.
    #: ``CacheEngine`` sets it from ``KVPlugConfig.max_chunk_bytes``.
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES

    def __init__(self, config: BaseModel) -> None:
        self.config = config

    def fingerprint(self) -> str:
        """What the key fingerprint records of this serializer: its name and options.

        Chunks written under one fingerprint are never looked up under another, so a
        frame is never read by a serializer (or options) it was not written with. The
        default is the name, followed by the options as canonical JSON when there are
        any; a serializer whose options do not change the stored bytes (thread counts)
        overrides this to leave them out, so changing them keeps the cache.
        """
        options = self.config.model_dump(mode="json")
        if not options:
            return self.name
        return f"{self.name}:{json.dumps(options, sort_keys=True, separators=(',', ':'))}"

    @abstractmethod
    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, new_buffer: Callable[[int], Any] = bytearray
    ) -> tuple[Any, torch.Tensor]:
        """A new frame and a writable CPU tensor view of its payload.

        ``new_buffer(nbytes)`` supplies the memory (the engine passes its
        :class:`kvplug.core.engine.frame_pool.FramePool`); the frame is that buffer.
        """

    @abstractmethod
    def seal(self, frame: Any) -> Buffer:
        """Finish a frame whose payload is written; returns what tiers store."""

    @abstractmethod
    def loads(
        self,
        data: Buffer,
        *,
        expected_shape: tuple[int, ...] | None = None,
        expected_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Decode and verify a frame.

        Raises ``CorruptChunkError`` (bad checksum, truncated, malformed) or
        ``IncompatibleChunkError`` (another format version, dtype or shape).
        """

    def seal_unchecked(self, frame: Any) -> Buffer:
        """:meth:`seal` for a frame that never leaves this process (only tiers with
        ``trusted_reads`` hold it): a serializer may skip its checksum. The default seals."""
        return self.seal(frame)

    def loads_trusted(
        self,
        data: Buffer,
        *,
        expected_shape: tuple[int, ...] | None = None,
        expected_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """:meth:`loads` for bytes this process itself put into a tier with
        ``trusted_reads``: a serializer may skip re-verifying its checksum (the header
        is still checked). The default verifies."""
        return self.loads(data, expected_shape=expected_shape, expected_dtype=expected_dtype)

    def check_chunk_bytes(self, nbytes: int, what: str) -> None:
        """``CorruptChunkError`` naming the bound if a frame's ``what`` (a decoded chunk of
        ``nbytes``) is over :attr:`max_chunk_bytes`; call it before allocating for a frame."""
        if nbytes > self.max_chunk_bytes:
            raise CorruptChunkError(
                f"{what} is {nbytes} bytes, over the maximum chunk of {self.max_chunk_bytes} bytes (max_chunk_bytes)"
            )

    def check_chunk_shape(self, shape: tuple[int, ...], itemsize: int, dtype: str) -> None:
        """:meth:`check_chunk_bytes` for a frame's ``shape`` of ``dtype`` (``itemsize`` bytes):
        its bytes, and also its extent (every dim, a zero counted as 1, times ``itemsize``).

        An empty chunk holds 0 bytes whatever its other dims; bounding the extent keeps a
        header like ``(0, 2**32-1, 2**32-1, 2**32-1)`` from reaching torch, whose strides
        would overflow (a ``RuntimeError``, not a ``ChunkError``). kvplug never stores a
        chunk with a zero dim; an empty chunk within the bound still decodes.
        """
        what = f"chunk of shape {shape} and dtype {dtype}"
        self.check_chunk_bytes(math.prod(shape) * itemsize, what)
        extent = math.prod(max(d, 1) for d in shape) * itemsize
        if extent > self.max_chunk_bytes:
            raise CorruptChunkError(
                f"{what} spans {extent} bytes (its dims, a zero counted as 1), over the maximum chunk of "
                f"{self.max_chunk_bytes} bytes (max_chunk_bytes)"
            )

    def max_frame_bytes(self, chunk_bytes: int) -> int:
        """The most bytes a frame of a chunk of ``chunk_bytes`` (its decoded tensor) takes:
        what bounds the records a tier reads for this serializer's chunks. The default,
        twice the chunk plus 1 MiB, holds any header and a codec's worst-case growth (the
        shipped serializers stay within the chunk plus 96 bytes); a serializer whose
        frames can be larger overrides it."""
        return 2 * chunk_bytes + (1 << 20)

    def close(self) -> None:
        """Release what the serializer holds beyond its frames (a codec's thread pool): called
        when the engine that made it closes, so that a closed engine leaves no thread behind.
        A serializer used after it is closed may start them again. The default holds nothing."""
        return None

    def dumps(self, tensor: torch.Tensor) -> Buffer:
        frame, payload = self.allocate(tuple(tensor.shape), tensor.dtype)
        payload.copy_(tensor)
        return self.seal(frame)
