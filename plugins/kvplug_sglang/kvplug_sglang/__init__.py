"""kvplug plugin: SGLang integration (engine adapter ``sglang``).

Importing this package does not import SGLang; the SGLang-facing modules
(``connector``, ``radix_cache``, ``hicache``) do.
"""

from __future__ import annotations

import kvplug
from kvplug_sglang.adapter import SGLangAdapter

__all__ = ["SGLangAdapter"]


@kvplug.hookimpl
def kvplug_engine_adapters() -> list[type]:
    return [SGLangAdapter]
