"""A tenant's quota counts every record of its chunks: each head group's (``heads_per_record``
below a rank's heads) and another TP size's records a load promotes, not only record 0's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from core_helpers import LAYOUTS, random_caches

from kvplug import CacheEngine, Fingerprint, HeadShard, RequestInfo, load_config
from kvplug.core.plugins import PluginRegistry

SALT = RequestInfo(cache_salt="acme")
QUOTA = 3 * 1024


def engine(tiers: list[dict[str, Any]], layout: Any, heads: HeadShard) -> CacheEngine:
    registry = PluginRegistry(plugin_filter="cpu,disk")
    extra = {"kvplug": {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}}
    config = load_config(engine_extra=extra, env={}, registry=registry).config
    return CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m"), registry=registry, heads=heads)


def tenant_bytes(opened: CacheEngine) -> dict[str, int]:
    extra = opened.chain.stats()[0][1].extra
    return {name.partition(":")[2]: held for name, held in extra.items() if name.startswith("tenant_bytes:")}


def test_every_head_groups_record_counts_against_the_tenants_quota() -> None:
    layout = LAYOUTS["vllm_flash"]  # 2 KV heads: 2 records per chunk of 1 head each
    heads = HeadShard.for_rank(total_heads=2, tp_rank=0, tp_size=1, heads_per_record=1)
    tiers = [{"type": "cpu", "max_bytes": "1MiB", "quotas": {"default": QUOTA}}]
    with engine(tiers, layout, heads) as opened:
        assert opened.records.count == 2
        caches = random_caches(layout, 8)
        for n in range(8):
            opened.store(list(range(1000 * n, 1000 * n + 32)), caches, torch.arange(32), request=SALT)
        held = tenant_bytes(opened)
        assert "(unsalted)" not in held, held  # before: record 1 of every chunk, past the quota
        assert 0 < held["(other)"] <= QUOTA


def test_records_of_another_tp_size_a_load_promotes_are_the_tenants(tmp_path: Path) -> None:
    full = replace(LAYOUTS["vllm_flash"], num_kv_heads=4)
    half = replace(full, num_kv_heads=2)
    disk = {"type": "disk", "path": str(tmp_path / "kv")}
    source = random_caches(full, 8, seed=1)
    tokens = list(range(100, 132))
    with engine([disk], full, HeadShard.for_rank(total_heads=4, tp_rank=0, tp_size=1)) as writer:
        writer.store(tokens, source, torch.arange(32), request=SALT)
        writer.flush()
    tiers = [{"type": "cpu", "max_bytes": "1MiB", "quotas": {"default": "1MiB"}}, disk]
    with engine(tiers, half, HeadShard.for_rank(total_heads=4, tp_rank=0, tp_size=2)) as reader:
        target = [torch.zeros_like(t[:, :, :, :2]) for t in source]
        assert bool(reader.retrieve(tokens, target, torch.arange(32), request=SALT).all())
        reader.flush()
        held = tenant_bytes(reader)
        assert "(unsalted)" not in held and held["(other)"] > 0, held
