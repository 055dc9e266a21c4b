"""kvplug plugin: serializers ``zstd`` and ``lz4`` (lossless) and ``int8`` and ``fp8`` (lossy)."""

from __future__ import annotations

import kvplug
from kvplug_compress.lossless import LZ4Serializer, ZstdSerializer
from kvplug_compress.quantized import FP8Serializer, Int8Serializer

__all__ = ["FP8Serializer", "Int8Serializer", "LZ4Serializer", "ZstdSerializer"]


@kvplug.hookimpl
def kvplug_serializers() -> list[type]:
    return [ZstdSerializer, LZ4Serializer, Int8Serializer, FP8Serializer]
