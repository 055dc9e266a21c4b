"""Pins and quotas under vLLM: the ``kvplug.pin`` request flag, and the figures on vLLM's /metrics."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvplug import (
    CacheEngine,
    Fingerprint,
    KVLayout,
    Tenancy,
    TierChain,
    TierContext,
    load_config,
    slots_from_block_ids,
)
from kvplug.core.tenants import TenantLabels
from kvplug_cpu import CPUTier
from kvplug_vllm.layout import VLLM_CPU
from kvplug_vllm.prom_metrics import KVPlugPromMetrics
from kvplug_vllm.request_state import request_info
from kvplug_vllm.worker_stats import stats_name

LAYOUT = KVLayout(VLLM_CPU, num_layers=2, block_size=32, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
PROMPT = list(range(1000, 1256))


@pytest.mark.parametrize("request_pins", [True, False])
def test_the_pin_flag_pins_the_stored_chunks_through_a_scan_where_the_operator_allows_it(request_pins: bool) -> None:
    extra = {
        "kvplug.chunk_size": 64,
        "kvplug.store.queue.mode": "sync",
        # Room for about 15 chunks of 64 tokens (64 KiB of KV each), half of it for pins.
        "kvplug.tiers": [
            {
                "type": "cpu",
                "max_bytes": "1MiB",
                "pin_max_bytes": "50%",
                "request_pin_max_bytes": "50%",
                "eviction": "s3fifo",
            }
        ],
        # Off by default: any API client could pin everything it stores.
        **({"kvplug.tenancy": {"request_pins": True}} if request_pins else {}),
    }
    config = load_config(engine_extra=extra, env={}).config
    request = SimpleNamespace(kv_transfer_params={"kvplug.pin": True}, cache_salt="tenant-a", lora_request=None)
    info = request_info(request, config)  # the scheduler side's reading of the request
    assert info.overrides == {"pin_request": True}
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="unit")) as cache:
        caches = [torch.randn(16, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
        slots = slots_from_block_ids(list(range(1, 9)), 32, len(PROMPT))
        cache.store(PROMPT, caches, slots, request=info)
        for i in range(12):  # one-off prompts of other tenants fill the tier many times over
            other = [i * 10_000 + t for t in range(len(PROMPT))]  # (i = 0: range(256))
            cache.store(other, caches, slots)
        cache.flush()
        assert cache.lookup(PROMPT, request=info) == (len(PROMPT) if request_pins else 0)
        assert cache.lookup(list(range(256)), request=None) == 0  # the first one-off prompt: evicted
        assert cache.chain.tiers[0].stats().extra["pinned_items"] == (4 if request_pins else 0)
        assert cache.metrics.value("kvplug_request_pins_ignored_total") == (0 if request_pins else 1)


FA, FB = "fa" * 16, "fb" * 16  # two tenants' fingerprints


def key(fingerprint: str, n: int) -> str:
    """A well-formed store key (tenancy reads the fingerprint of well-formed keys only)."""
    return f"v1/{fingerprint}/{n:032x}"


def test_pin_and_tenant_figures_reach_vllms_metrics_never_with_a_salt() -> None:
    salt_a, salt_b = "Qv8-secret-of-a", "Rw3-secret-of-b"
    context = TierContext(tenancy=Tenancy(labels=TenantLabels({"tenant-a": salt_a})))  # tenancy.tenants
    context.tenancy.tenants.note(FA, salt_a)  # as the engine notes salted requests' fingerprints
    context.tenancy.tenants.note(FB, salt_b)
    tier = CPUTier(CPUTier.Config(max_bytes=1000, pin_max_bytes=100, quotas={"tenant-a": 300}), context)
    chain = TierChain([tier])
    tier.put([(key(FA, 1), b"a" * 200), (key(FB, 1), b"b" * 50)])
    tier.get([key(FA, 1), key(FA, 1), key(FB, 1)])
    tier.put([(key(FA, 2), b"a" * 200)])  # tenant-a over its quota: its first chunk goes
    assert tier.pin([key(FB, 1), key(FA, 2)]) == [("pinned", 50), ("refused", 200)]
    tier.put([(key(FA, 3), b"a" * 951)])  # no room beside the pinned 50 bytes: refused, counted
    stats = {}
    for sample in chain.metrics.samples():  # what the worker side reports each step
        name = stats_name(sample)
        if name is not None:
            stats[name] = sample.value
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    prom = KVPlugPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    prom.observe(stats)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"engine": "0", **labels})

    assert value("kvplug_tenant_bytes", tier="0:cpu", tenant="tenant-a") == 200
    assert value("kvplug_tenant_bytes", tier="0:cpu", tenant="(other)") == 50  # tenant-b: not named in quotas
    assert value("kvplug_tenant_hits_total", tier="0:cpu", tenant="tenant-a") == 2
    assert value("kvplug_pinned_bytes", tier="0:cpu") == 50
    assert value("kvplug_pins_refused_total", tier="0:cpu") == 1
    assert value("kvplug_quota_evictions_total", tier="0:cpu") == 1
    assert value("kvplug_stores_refused_total", tier="0:cpu", reason="pins") == 1
    scraped = generate_latest(registry).decode()  # what vllm serve's /metrics shows
    assert 'tenant="tenant-a"' in scraped and salt_a not in scraped and salt_b not in scraped
