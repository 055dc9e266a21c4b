"""The typed tier boundary: the chain reads a tier's settings from its
``TierConfig``; a tier written against 0.2 with a plain pydantic ``Config`` still loads,
with a ``DeprecationWarning`` naming it; ``connector: {type: auto}`` ranks by the declared
``KVConnector.priority``."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import ClassVar, Literal

import pytest
import torch
from core_helpers import LAYOUTS, random_caches
from pydantic import BaseModel, ConfigDict

from kvplug import (
    Buffer,
    CacheEngine,
    Fingerprint,
    KVConnector,
    StorageTier,
    TierConfig,
    TierContext,
    TierStats,
    TorchConnector,
    hookimpl,
    load_config,
)
from kvplug.core.plugins import PluginRegistry

NUM_BLOCKS = 40
NOT_TIER_CONFIG = "is not a kvplug.TierConfig"


class LegacyConfig(BaseModel):
    """A 0.2-style tier config: a plain pydantic model with some of TierConfig's fields."""

    model_config = ConfigDict(extra="forbid")
    capacity: int = 1000
    write_mode: Literal["sync", "async"] = "sync"
    write_queue_items: int = 7


class LegacyDictTier(StorageTier):
    """A third-party tier as written against kvplug 0.2: its Config is not a TierConfig."""

    name = "legacy_dict"
    Config = LegacyConfig  # type: ignore[assignment]  # what 0.2 allowed
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


def test_a_tier_with_a_plain_pydantic_config_still_loads_with_a_deprecation_warning() -> None:
    registry = PluginRegistry(plugin_filter="cpu")
    registry.register(_LegacyPlugin, "legacy-test")
    tiers = [{"type": "legacy_dict", "write_mode": "async", "capacity": 100}]
    with pytest.warns(DeprecationWarning, match=r"tier 'legacy_dict' \(.*LegacyDictTier\): its Config LegacyConfig"):
        engine = _engine(tiers, registry)
    with engine:
        tier = engine.chain.tiers[0]
        assert isinstance(tier, LegacyDictTier) and tier.capacity == 100
        settings = engine.chain.settings[0]
        # Its own values of the settings it has, TierConfig's defaults for the others.
        # (0.2's queue keys, write_mode and write_queue_items, read as queue settings.)
        assert (settings.queue.mode, settings.queue.max_items) == ("async", 7)
        assert (settings.queue.on_full, settings.max_bytes) == ("drop", None)
        assert settings.queue.max_bytes == TierConfig().queue.max_bytes

        layout = LAYOUTS["sglang_mha"]
        tokens = list(range(100, 116))
        engine.store(tokens, random_caches(layout, NUM_BLOCKS), torch.arange(16))
        engine.chain.flush()
        assert "writer_pending" in engine.chain.stats()[0][1].extra  # written by its write queue
        assert engine.lookup(tokens) == 16
        assert engine.retrieve(tokens, random_caches(layout, NUM_BLOCKS, seed=1), torch.arange(16)).all()


def test_a_tier_config_subclass_is_read_as_is_without_a_warning() -> None:
    registry = PluginRegistry(plugin_filter="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _engine([{"type": "cpu", "queue": {"mode": "async", "max_items": 3}}], registry)
    with engine:
        assert engine.chain.settings[0] is engine.chain.tiers[0].config
        assert engine.chain.settings[0].queue.max_items == 3
    assert not [w for w in caught if NOT_TIER_CONFIG in str(w.message)]


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
