"""Fixtures: real SGLang pools on CPU and a ModelConfig from a local config-only model."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from sglang_pools import make_pool, write_model_dir

from kvplug.testing.control_cli import socket_dir  # noqa: F401  (a fixture for the control server tests)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def model_config(model_dir: Path) -> Any:
    """SGLang's real ModelConfig, built from a config.json without weights."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(str(model_dir))


@pytest.fixture
def pool_factory() -> Callable[..., Any]:
    return make_pool


@pytest.fixture(scope="module")
def registered() -> None:
    """Load the plugin the way SGLang does: through its entry point, twice."""
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends

    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvplug"]
    register = ep.load()
    register()
    register()  # SGLang calls plugins in every process, maybe more than once
    assert registered_radix_cache_backends().count("kvplug") == 1


@pytest.fixture
def kvplug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLUG_CHUNK_SIZE", "16")
    monkeypatch.setenv("KVPLUG_STORE__QUEUE__MODE", "sync")
