"""The typed tier boundary: the chain reads a tier's settings from its ``TierConfig``; a
tier with a plain pydantic ``Config`` is refused when its plugin registers, naming
``TierConfig``; ``connector: {type: auto}`` ranks by the declared ``KVConnector.priority``."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import ClassVar

import pytest
from core_helpers import LAYOUTS
from pydantic import BaseModel, ConfigDict

from kvplug import (
    Buffer,
    CacheEngine,
    Fingerprint,
    KVConnector,
    StorageTier,
    TierContext,
    TierStats,
    TorchConnector,
    hookimpl,
    load_config,
)
from kvplug.core.plugins import PluginRegistry
from kvplug.errors import ConfigError

NUM_BLOCKS = 40


class LegacyConfig(BaseModel):
    """A plain pydantic model: not a TierConfig."""

    model_config = ConfigDict(extra="forbid")
    capacity: int = 1000


class LegacyDictTier(StorageTier):
    """A third-party tier whose Config is not a TierConfig."""

    name = "legacy_dict"
    Config = LegacyConfig  # type: ignore[assignment]  # what the registry refuses
    medium = "memory"

    def __init__(self, config: LegacyConfig, context: TierContext) -> None:
        super().__init__(config, context)  # type: ignore[arg-type]
        self.capacity = config.capacity  # its own field, read as it always was
        self._values: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._values for key in keys]

    def get(self, keys: Sequence[str]) -> list[Buffer | None]:
        with self._lock:
            return [self._values.get(key) for key in keys]

    def put(self, items: Sequence[tuple[str, Buffer]]) -> None:
        with self._lock:
            for key, value in items[: self.capacity - len(self._values)]:
                self._values[key] = bytes(value)

    def remove(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._values.pop(key, None)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(items=len(self._values))

    def close(self) -> None:
        pass


class _LegacyPlugin:
    @staticmethod
    @hookimpl
    def kvplug_storage_tiers() -> list[type]:
        return [LegacyDictTier]


def _engine(tiers: list[dict], registry: PluginRegistry, **extra: object) -> CacheEngine:
    layout = LAYOUTS["sglang_mha"]
    kvplug = {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers, **extra}
    config = load_config(engine_extra={"kvplug": kvplug}, env={}, registry=registry).config
    return CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m"), registry=registry)


def test_a_tier_with_a_plain_pydantic_config_is_refused_naming_tier_config() -> None:
    registry = PluginRegistry(plugin_filter="cpu")
    registry.register(_LegacyPlugin, "legacy-test")
    assert "legacy_dict" not in registry.storage_tiers() and "cpu" in registry.storage_tiers()
    [error] = registry.load_errors
    assert error.plugin == "legacy-test"
    assert "its storage tier 'legacy_dict' has a Config (LegacyConfig) that does not subclass kvplug.TierConfig" in str(
        error
    )
    with pytest.raises(ConfigError, match="legacy_dict.*plugins that failed to load: legacy-test"):
        _engine([{"type": "legacy_dict", "capacity": 100}], registry)


def test_a_tier_config_subclass_is_read_as_is_without_a_warning() -> None:
    registry = PluginRegistry(plugin_filter="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _engine([{"type": "cpu", "queue": {"mode": "async", "max_items": 3}}], registry)
    with engine:
        assert engine.chain.settings[0] is engine.chain.tiers[0].config
        assert engine.chain.settings[0].queue.max_items == 3
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]


class _EagerConnector(TorchConnector):
    """The torch connector under another name that ranks above every shipped one."""

    name = "eager"
    priority: ClassVar[int] = 1000


class _ShyConnector(TorchConnector):
    """Declares nothing: the base's priority, 0."""

    name = "shy"


def test_auto_picks_the_available_connector_of_highest_declared_priority() -> None:
    assert KVConnector.priority == 0 and _ShyConnector.priority == 0

    class Plugin:
        @staticmethod
        @hookimpl
        def kvplug_kv_connectors() -> list[type]:
            return [_ShyConnector, _EagerConnector]

    registry = PluginRegistry(plugin_filter="cpu")
    registry.register(Plugin, "connectors-test")
    with _engine([{"type": "cpu"}], registry, connector={"type": "auto"}) as engine:
        assert engine.connector.name == "eager"
