"""``kvplug_hit_tokens_by_tier_total`` names a tier as the other per-tier metrics do: its position
in the chain and its type (``1:disk``), so two tiers of one type (an NVMe and an NFS ``disk``
folder) are two series, not one sum.

No engine: a real CacheEngine with real tiers, the scheduler side's lookup path and vLLM's
metrics class over real Prometheus metrics (as test_tier_media.py and test_pins_vllm.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from test_tier_media import BLOCKS, LAYOUT, PROMPT, answer, hit_figures, request, scheduler

from kvplug import CacheEngine, ChunkLocation, Fingerprint, PluginRegistry, load_config, slots_from_block_ids
from kvplug_vllm.prom_metrics import KVPlugPromMetrics
from kvplug_vllm.scheduler import SchedulerSide


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[CacheEngine]:
    """PROMPT's 3 chunks: the first in cpu, the second only in the first disk folder, the third
    only in the second."""
    extra = {
        "kvplug.chunk_size": 64,
        "kvplug.store.queue.mode": "sync",
        "kvplug.tiers": [
            {"type": "cpu", "max_bytes": "64MiB"},
            {"type": "disk", "path": str(tmp_path / "nvme"), "max_bytes": "64MiB"},
            {"type": "disk", "path": str(tmp_path / "nfs"), "max_bytes": "64MiB"},
        ],
    }
    registry = PluginRegistry(plugin_filter="cpu,disk")
    config = load_config(engine_extra=extra, env={}, registry=registry).config
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="unit"), registry=registry) as cache:
        caches = [torch.randn(16, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
        cache.store(PROMPT, caches, slots_from_block_ids(list(range(1, 16)), 32, len(PROMPT)))
        cache.chain.flush()
        keys = [k.key for k in cache.chunk_keys(PROMPT)]
        cpu, nvme, _ = cache.chain.tiers
        cpu.remove(keys[1:])
        nvme.remove(keys[2:])
        yield cache


@pytest.fixture
def side(engine: CacheEngine) -> Iterator[SchedulerSide]:
    yield from scheduler(engine)


def test_two_tiers_of_one_type_are_counted_apart(engine: CacheEngine, side: SchedulerSide) -> None:
    assert answer(side, request("r-two-disks"), 0) == (192, True)  # disk: loaded in the background
    side.update_state_after_alloc(request("r-two-disks"), BLOCKS, 192)
    stats = side.get_kv_connector_stats()
    assert stats is not None
    by_tier = {k: v for k, v in hit_figures(stats).items() if k.startswith("hit_tokens_tier.")}
    assert by_tier == {"hit_tokens_tier.0:cpu": 64, "hit_tokens_tier.1:disk": 64, "hit_tokens_tier.2:disk": 64}

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    prom = KVPlugPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    prom.observe(stats.data)

    def hits(tier: str) -> float | None:
        return registry.get_sample_value("kvplug_hit_tokens_by_tier_total", {"engine": "0", "tier": tier})

    assert (hits("0:cpu"), hits("1:disk"), hits("2:disk")) == (64, 64, 64)
    assert hits("disk") is None  # no series sums the two folders


def test_a_location_keeps_its_tier_index_through_the_lookup_channel(engine: CacheEngine) -> None:
    """A scheduler in another process reads the workers' answers as JSON (``ChunkLocation.to_json``)."""
    found = engine.locate(PROMPT)
    assert [loc.tier_label for loc in found] == ["0:cpu", "1:disk", "2:disk"]
    sent = [ChunkLocation.from_json(json.loads(json.dumps(loc.to_json()))) for loc in found]
    assert [loc.tier_label for loc in sent] == ["0:cpu", "1:disk", "2:disk"]
    with pytest.raises(ValueError, match="tier index"):
        ChunkLocation.from_json(["disk", "disk", 64, "", -1])
