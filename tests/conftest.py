"""Shared fixtures of the core tests."""

from __future__ import annotations

import pytest

from kvplug import CacheEngine, Fingerprint, KVLayout, load_config
from kvplug.core.plugins import PluginRegistry
from kvplug.testing.control_cli import socket_dir  # noqa: F401  (a fixture for the control server tests)


@pytest.fixture
def registry() -> PluginRegistry:
    """Builtins and the installed cpu tier only, whatever else is installed."""
    return PluginRegistry(plugin_filter="cpu")


@pytest.fixture
def make_engine(registry: PluginRegistry):
    engines: list[CacheEngine] = []

    def make(
        layout: KVLayout, *, model_id: str = "test-model", env: dict | None = None, **settings: object
    ) -> CacheEngine:
        extra = {"kvplug.store.queue.mode": "sync", "kvplug.chunk_size": 8}
        extra.update({f"kvplug.{key}": value for key, value in settings.items()})
        config = load_config(engine_extra=extra, env=env or {}, registry=registry).config
        engine = CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id=model_id), registry=registry)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
