"""What the compressing serializers share: the frame the connector gathers into, and loading."""

from __future__ import annotations

import ctypes
import warnings
from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

import kvplug
from kvplug import LazyModule, dtype_name
from kvplug.errors import CorruptChunkError
from kvplug_compress import frame as kvpc

if TYPE_CHECKING:
    import torch
else:  # loaded on first use: reading the Config needs no torch
    torch = LazyModule("torch")


def tensor_over(buffer: Any, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
    """A tensor viewing ``buffer`` from ``offset`` (no copy); empty tensors need no buffer."""
    count = kvpc.itemsize_of(dtype_name(dtype)) * int(torch.Size(shape).numel())
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # frombuffer warns on read-only buffers; readers never write through them.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=count, offset=offset)
    return flat.view(dtype).view(shape)


def staged_frame(buffer: Any, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
    """An unsealed frame: the chunk's plain bytes in ``buffer`` (from the engine's frame pool).

    The connector gathers straight into it; :meth:`CompressingSerializer.seal` encodes it
    into a new, smaller buffer, after which this one goes back to the pool. It is a
    ctypes array over ``buffer`` because the engine measures queued frames with
    ``memoryview`` (a plain object has no buffer protocol before Python 3.12), and it
    carries the chunk's shape and dtype as attributes.
    """
    frame = (ctypes.c_ubyte * memoryview(buffer).nbytes).from_buffer(buffer)
    frame.kvplug_chunk = (tuple(shape), dtype)  # type: ignore[attr-defined]  # ctypes arrays take attributes
    return frame


class CompressingSerializer(kvplug.Serializer):
    """A serializer whose frame is an encoding of the chunk, not the chunk's bytes.

    ``allocate`` hands out plain staging memory, ``seal`` encodes it into a ``KVPC``
    frame (:mod:`kvplug_compress.frame`) and ``loads`` decodes one into a new tensor.
    Subclasses implement :meth:`encode` and :meth:`decode`.
    """

    #: Options that do not change the stored bytes; left out of the key fingerprint.
    runtime_options: frozenset[str] = frozenset()

    def __init__(self, config: BaseModel) -> None:
        super().__init__(config)
        if not self.name.isascii() or len(self.name) > kvpc.MAX_CODEC_NAME:
            raise ValueError(
                f"serializer name {self.name!r} must be ASCII of at most {kvpc.MAX_CODEC_NAME} characters: "
                "the frame header records it in that many bytes"
            )

    def fingerprint(self) -> str:
        options = {k: v for k, v in self.config.model_dump(mode="json").items() if k not in self.runtime_options}
        described = ",".join(f"{k}={options[k]}" for k in sorted(options))
        return f"{self.name}:{described}" if described else self.name

    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, new_buffer: Callable[[int], Any] = bytearray
    ) -> tuple[Any, torch.Tensor]:
        nbytes = kvpc.itemsize_of(dtype_name(dtype)) * int(torch.Size(shape).numel())
        frame = staged_frame(new_buffer(nbytes), shape, dtype)
        return frame, tensor_over(frame, dtype, shape)

    def seal(self, frame: Any) -> memoryview:
        chunk = getattr(frame, "kvplug_chunk", None)
        if chunk is None:
            raise TypeError(
                f"serializer {self.name!r} seals frames from its own allocate(), got {type(frame).__name__}"
            )
        shape, dtype = chunk
        sealed = self.encode(tensor_over(frame, dtype, shape))
        kvpc.seal(sealed)
        return memoryview(sealed).toreadonly()

    def dumps(self, tensor: torch.Tensor) -> memoryview:
        sealed = self.encode(tensor.detach().to("cpu").contiguous())
        kvpc.seal(sealed)
        return memoryview(sealed).toreadonly()

    def loads(
        self,
        data: Any,
        *,
        expected_shape: tuple[int, ...] | None = None,
        expected_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        header = kvpc.verify(data, self.name)
        kvpc.check_expected(header, expected_shape, None if expected_dtype is None else dtype_name(expected_dtype))
        # Before anything is allocated: without an expected shape, the header's is all there is.
        self.check_chunk_shape(header.shape, header.itemsize, header.dtype)
        dtype = getattr(torch, header.dtype)
        if header.encoding == kvpc.STORED:
            if header.payload_length != header.numel * header.itemsize:
                raise CorruptChunkError(
                    f"stored payload is {header.payload_length} bytes, shape {header.shape} needs "
                    f"{header.numel * header.itemsize}"
                )
            return tensor_over(data, dtype, header.shape, kvpc.HEADER_SIZE)
        return self.decode(header, memoryview(data).cast("B")[kvpc.HEADER_SIZE :], dtype)

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> bytearray:
        """A whole ``KVPC`` frame (header with a zero checksum, then payload) for a contiguous CPU tensor."""

    @abstractmethod
    def decode(self, header: kvpc.FrameHeader, payload: memoryview, dtype: torch.dtype) -> torch.Tensor:
        """The chunk tensor of a verified, encoded frame; ``CorruptChunkError`` if the payload does not decode."""

    def stored_frame(self, tensor: torch.Tensor, *, param_a: int = 0, param_b: int = 0) -> bytearray:
        """A frame holding the tensor's bytes as they are (encoding 0)."""
        nbytes = tensor.numel() * tensor.element_size()
        out = self.new_frame(tensor, kvpc.STORED, nbytes, param_a=param_a, param_b=param_b)
        if nbytes:
            tensor_over(out, tensor.dtype, tuple(tensor.shape), kvpc.HEADER_SIZE).copy_(tensor)
        return out

    def new_frame(
        self, tensor: torch.Tensor, encoding: int, payload_length: int, *, param_a: int, param_b: int
    ) -> bytearray:
        """A frame buffer with its header written (checksum zero) and room for the payload."""
        header = kvpc.pack_header(
            self.name,
            dtype_name(tensor.dtype),
            tuple(tensor.shape),
            encoding=encoding,
            param_a=param_a,
            param_b=param_b,
            payload_length=payload_length,
        )
        out = bytearray(kvpc.HEADER_SIZE + payload_length)
        out[: kvpc.HEADER_SIZE] = header
        return out
