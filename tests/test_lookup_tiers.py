"""CacheEngine.lookup_tiers: the cached prefix, per chunk, with the fastest tier holding it."""

from __future__ import annotations

import pytest
import torch
from core_helpers import LAYOUTS, random_caches

from kvplug.core.plugins import PluginRegistry


@pytest.fixture
def registry() -> PluginRegistry:
    """Builtins with the cpu and disk tiers (both in the core test environment)."""
    return PluginRegistry(plugin_filter="cpu,disk")


def test_lookup_tiers_names_the_fastest_tier_of_each_chunk(make_engine, tmp_path) -> None:
    layout = LAYOUTS["vllm_flash"]
    tiers = [{"type": "cpu", "max_bytes": "64MiB"}, {"type": "disk", "path": str(tmp_path)}]
    engine = make_engine(layout, tiers=tiers)
    caches = random_caches(layout, 80)
    tokens = list(range(100, 130))
    assert engine.lookup_tiers(tokens) == []
    engine.store(tokens, caches, torch.arange(30))
    # The disk tier is written by the chain's queue: removals below must come after that write.
    engine.flush()
    assert engine.lookup_tiers(tokens) == [("cpu", 8)] * 3
    cpu, disk = engine.chain.tiers
    first_key = engine.chunk_keys(tokens)[0].key
    cpu.remove([first_key])  # now only on disk: a slow hit
    assert engine.lookup_tiers(tokens) == [("disk", 8), ("cpu", 8), ("cpu", 8)]
    disk.remove([first_key])
    assert engine.lookup_tiers(tokens) == []
    assert engine.lookup(tokens) == 0
