"""kvplug plugin: SGLang integration (engine adapter ``sglang``).

Importing this package does not import SGLang; the SGLang-facing modules
(``connector``, ``radix_cache``, ``hicache``) do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvplug

if TYPE_CHECKING:
    from kvplug_sglang.adapter import SGLangAdapter

#: Exported name -> its module, imported on first use: registering the plugin (every
#: ``kvplug`` command does) imports none of them, nor what they import (torch).
_LAZY = {
    "SGLangAdapter": "kvplug_sglang.adapter",
}

__all__ = ["SGLangAdapter"]


__getattr__ = kvplug.lazy_exports(__name__, _LAZY)


@kvplug.hookimpl
def kvplug_engine_adapters() -> list[type]:
    from kvplug_sglang.adapter import SGLangAdapter

    return [SGLangAdapter]
