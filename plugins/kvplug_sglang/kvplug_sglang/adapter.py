"""The ``sglang`` engine adapter: how ``kvplug plugins`` lists the SGLang integration."""

from __future__ import annotations

from typing import ClassVar

from kvplug import EngineAdapter


class SGLangAdapter(EngineAdapter):
    """kvplug inside SGLang, three ways.

    - ``--radix-cache-backend kvplug``: :class:`kvplug_sglang.radix_cache.KVPlugRadixCache`;
    - ``--hicache-storage-backend dynamic`` with ``module_path=kvplug_sglang.hicache``,
      ``class_name=KVPlugStorage``: :class:`kvplug_sglang.hicache.KVPlugStorage`;
    - the connector API (:class:`kvplug_sglang.connector.KVPlugConnector`) for code
      that drives SGLang's pools itself.
    """

    name: ClassVar[str] = "sglang"
    engine_distribution: ClassVar[str] = "sglang"
    #: SGLang releases the plugin is tested with.
    tested_versions: ClassVar[tuple[str, ...]] = ("0.5.23",)
