"""kvplug plugin: serializers ``zstd`` and ``lz4`` (lossless) and ``int8`` and ``fp8`` (lossy)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvplug

if TYPE_CHECKING:
    from kvplug_compress.lossless import LZ4Serializer, ZstdSerializer
    from kvplug_compress.quantized import FP8Serializer, Int8Serializer

#: Exported name -> its module, imported on first use: registering the plugin (every
#: ``kvplug`` command does) imports none of them, nor what they import (torch).
_LAZY = {
    "LZ4Serializer": "kvplug_compress.lossless",
    "ZstdSerializer": "kvplug_compress.lossless",
    "FP8Serializer": "kvplug_compress.quantized",
    "Int8Serializer": "kvplug_compress.quantized",
}

__all__ = ["FP8Serializer", "Int8Serializer", "LZ4Serializer", "ZstdSerializer"]


__getattr__ = kvplug.lazy_exports(__name__, _LAZY)


@kvplug.hookimpl
def kvplug_serializers() -> list[type]:
    from kvplug_compress.lossless import LZ4Serializer, ZstdSerializer
    from kvplug_compress.quantized import FP8Serializer, Int8Serializer

    return [ZstdSerializer, LZ4Serializer, Int8Serializer, FP8Serializer]
