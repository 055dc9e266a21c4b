"""Building the configured serializer. Kept apart from the serializer contract
(:mod:`kvplug.core.serializer`): the registry types what it returns with that contract,
so the contract imports neither the registry nor the config."""

from __future__ import annotations

from kvplug.core.config.model import KVPlugConfig
from kvplug.core.plugins import PluginRegistry
from kvplug.core.serializer import Serializer


def make_serializer(config: KVPlugConfig, registry: PluginRegistry) -> Serializer:
    """The serializer ``config.serializer`` names, with its options, bounded by
    ``config.max_chunk_bytes``: how ``CacheEngine`` and every adapter that reads frames
    itself builds one, so that none reads frames without the bound."""
    spec = config.serializer
    serializer: Serializer = registry.serializers()[spec.type](spec.options)
    serializer.max_chunk_bytes = int(config.max_chunk_bytes)
    return serializer
