"""Serializers ``int8`` and ``fp8``: lossy, opt-in; about half the bytes of bf16/fp16 KV.

The last axis of a chunk (``[layers, K/V, tokens, heads * head_dim]``) is cut into
groups of ``group_size`` elements; each group has its own scale ``s``, the group's
largest magnitude ``amax`` over the code's largest value rounded up to the scale's dtype
(so no value clips): fp16, at most ``2**-10`` of it above ``amax / code_max``; fp32 for a
frame whose scales fall outside fp16's normal range, one fp32 step above at most (``2**-149``
where ``amax / code_max`` is below fp32's normal range, e.g. bf16 or fp32 subnormals). With
``group_size`` equal to the model's head_dim that is a scale per token per head.

Error bound per element ``x`` of a group with stored scale ``s``, plus ``|x| * 2**-24`` of
float32 rounding in ``x / s`` (``2**-53`` for float64 chunks, computed in float64), before
the result is rounded to the chunk's dtype (which adds at most half an ulp of that dtype):

* ``int8``: ``|x' - x| <= s / 2`` (symmetric, round to nearest);
* ``fp8`` (e4m3fn): ``|x' - x| <= max(|x| * 2**-4, s * 2**-10)``: three mantissa bits give a
  relative error of at most 2**-4, down to e4m3's subnormals.

Chunks whose dtype is not a float of 2 bytes or more (fp8 KV caches, integer caches)
are stored as they are, as are chunks holding inf or NaN, and float64 chunks whose scales
pass fp32's range: those stay exact.

Payload of a ``KVPC`` frame (encoding 1): the scales, ``[rows, groups]`` in the scale
dtype, then the codes, ``[rows, width]`` one byte each (``rows`` = elements / width).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from kvplug import LazyModule, dtype_name
from kvplug.errors import CorruptChunkError
from kvplug_compress import frame as kvpc
from kvplug_compress.base import CompressingSerializer, tensor_over

if TYPE_CHECKING:
    import torch
else:  # loaded on first use: reading the Config needs no torch
    torch = LazyModule("torch")

#: Chunk dtypes that are quantized; anything else is stored as is.
QUANTIZED_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
#: Scale dtype codes in the frame header (parameter B).
SCALE_DTYPES: dict[int, str] = {1: "float16", 2: "float32"}
#: fp16's largest and smallest normal values (``torch.finfo(torch.float16)``), fp32's largest.
_FP16_MAX = 65504.0
_FP16_TINY = 2.0**-14
_FP32_MAX = 3.4028234663852886e38


class QuantizedConfig(BaseModel):
    """Options of ``int8`` and ``fp8``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group_size: int = Field(
        default=64,
        ge=8,
        le=65536,
        description="Elements of the last axis (heads * head_dim) sharing one scale; "
        "the model's head_dim gives a scale per token per head.",
    )


class QuantizedSerializer(CompressingSerializer):
    """Per-group absmax scaling to a one-byte code (:attr:`code_dtype`)."""

    Config: ClassVar[type[BaseModel]] = QuantizedConfig
    #: Largest magnitude of the code.
    code_max: ClassVar[float]
    #: The code's torch dtype, by name.
    code_dtype_name: ClassVar[str]

    @property
    def code_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.code_dtype_name)
        return dtype

    def encode(self, tensor: torch.Tensor) -> bytearray:
        group = self.config.group_size  # type: ignore[attr-defined]
        if dtype_name(tensor.dtype) not in QUANTIZED_DTYPES or tensor.numel() == 0:
            return self.stored_frame(tensor, param_a=group)
        width = tensor.shape[-1] if tensor.dim() else 1
        rows = tensor.numel() // width
        groups = math.ceil(width / group)
        work = _work_dtype(tensor.dtype)
        # One copy, padded only when groups do not divide the width; the rest in place.
        values = tensor.reshape(rows, width).to(work, copy=True)  # a copy: divided in place below
        padded = (
            values if groups * group == width else torch.nn.functional.pad(values, (0, groups * group - width))
        ).view(rows, groups, group)
        amax = padded.abs().amax(-1)
        if not bool(torch.isfinite(amax).all()):  # an inf or NaN in a group shows in its amax
            return self.stored_frame(tensor, param_a=group)  # inf/NaN have no code: keep them exact
        # In float64: amax / code_max exactly enough that a scale rounded up is never below it.
        chosen = _scales(amax.to(torch.float64).div_(self.code_max))
        if chosen is None:
            return self.stored_frame(tensor, param_a=group)
        scales, scale_code = chosen
        divisor = scales.to(work, copy=True).masked_fill_(scales == 0, 1.0).unsqueeze(-1)  # (scales stay 0)
        codes = self.quantize(padded.div_(divisor)).view(rows, groups * group)[:, :width]
        scale_bytes = scales.numel() * scales.element_size()
        out = self.new_frame(tensor, kvpc.ENCODED, scale_bytes + rows * width, param_a=group, param_b=scale_code)
        tensor_over(out, scales.dtype, tuple(scales.shape), kvpc.HEADER_SIZE).copy_(scales)
        tensor_over(out, self.code_dtype, (rows, width), kvpc.HEADER_SIZE + scale_bytes).copy_(codes)
        return out

    def decode(self, header: kvpc.FrameHeader, payload: memoryview, dtype: torch.dtype) -> torch.Tensor:
        group = header.param_a
        scale_name = SCALE_DTYPES.get(header.param_b)
        if scale_name is None or group <= 0 or dtype_name(dtype) not in QUANTIZED_DTYPES:
            raise CorruptChunkError(f"encoded {header.dtype} frame with group {group}, scale code {header.param_b}")
        scale_dtype = getattr(torch, scale_name)
        if header.numel == 0:  # the encoder stores empty chunks; and a zero width divides nothing
            raise CorruptChunkError(f"encoded frame of an empty chunk (shape {header.shape})")
        width = header.shape[-1] if header.shape else 1
        rows = header.numel // width
        groups = -(-width // group)
        scale_bytes = rows * groups * torch.empty((), dtype=scale_dtype).element_size()
        if payload.nbytes != scale_bytes + rows * width:
            raise CorruptChunkError(
                f"payload is {payload.nbytes} bytes, {rows}x{width} codes in groups of {group} need {scale_bytes + rows * width}"
            )
        work = _work_dtype(dtype)
        scales = tensor_over(payload, scale_dtype, (rows, groups)).to(work)
        codes = tensor_over(payload, self.code_dtype, (rows, width), scale_bytes).to(work)
        if groups * group == width:
            values = codes.view(rows, groups, group).mul_(scales.unsqueeze(-1)).view(rows, width)
        else:
            # Each column's scale by index, not by padding rows to whole groups: the header's
            # group (up to 2**32) would size the padding, not the payload.
            values = codes.mul_(scales[:, torch.arange(width) // group])
        # code_max times a scale rounded up can pass the dtype's largest finite value (fp16's
        # 65504 decoded as 65532), which the cast would make inf; every stored value was
        # finite and within it (else the frame is stored as is), so clamping only nears it.
        largest = min(torch.finfo(dtype).max, torch.finfo(work).max)
        return values.clamp_(-largest, largest).to(dtype).reshape(header.shape)

    def quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        """Codes of values already divided by their scale (so within ``[-code_max, code_max]``)."""
        raise NotImplementedError


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a chunk of ``dtype`` is quantized in: float32, float64 for float64 chunks
    (whose values float32 would flush or overflow)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scales(exact: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """Scales to store and their dtype code: fp16 or fp32, each rounded up (never below
    ``exact``, float64); ``None``: scales past fp32's range (float64 chunks only).

    Rounding up keeps every ``|x| / scale`` within the code's range, so nothing clips, and the
    error within the documented bound of the stored scale, including fp32 scales below fp32's
    normal range, whose rounding to nearest could have lost up to 2**-150 of each.
    """
    used = exact[exact > 0]
    # Within fp16's normal range rounding up costs at most 2**-10 of the scale; subnormal
    # fp16 scales would lose more precision than that, so such frames keep fp32 scales.
    if used.numel() == 0 or (float(used.max()) <= _FP16_MAX / 2 and float(used.min()) >= _FP16_TINY):
        return _rounded_up(exact, torch.float16, torch.int16), 1
    if float(used.max()) <= _FP32_MAX / 2:
        return _rounded_up(exact, torch.float32, torch.int32), 2
    return None


def _rounded_up(exact: torch.Tensor, dtype: torch.dtype, bits_dtype: torch.dtype) -> torch.Tensor:
    """``exact`` (non-negative, float64) in ``dtype``, the next value up where rounding went below it."""
    rounded = exact.to(dtype)
    bits = rounded.view(bits_dtype)
    # Non-negative floats order like their bit patterns: +1 is the next larger value (0's is the
    # smallest subnormal, for a scale that underflowed).
    return torch.where(rounded.to(torch.float64) < exact, bits + 1, bits).view(dtype)


class Int8Serializer(QuantizedSerializer):
    """Lossy: symmetric int8 codes with a scale per group (``|error| <= scale / 2``)."""

    name = "int8"
    code_max = 127.0
    code_dtype_name = "int8"

    def quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round_().clamp_(-127, 127).to(torch.int8)


class FP8Serializer(QuantizedSerializer):
    """Lossy: float8 e4m3fn codes with a scale per group (relative error <= 2**-4)."""

    name = "fp8"
    code_max = 448.0
    code_dtype_name = "float8_e4m3fn"

    def quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        # Clamped first: e4m3fn has no inf, and an out-of-range cast would give NaN.
        return scaled.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
