"""kvplug's figures on ``vllm serve``'s own ``/metrics`` (``build_prom_metrics``).

vLLM sends each step's connector stats (:class:`~kvplug_vllm.stats.KVPlugConnectorStats`
data: counters, latency samples, gauge levels) from the engine to the API server,
which calls :meth:`KVPlugPromMetrics.observe`. The metrics are vLLM's Prometheus
classes, labelled per engine like vLLM's own; names start with ``kvplug_`` (the same
names as kvplug's own registry where both exist, so one dashboard fits both).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvplug_vllm.stats import GAUGE_PREFIX, LOAD_ERROR_PREFIX, SAMPLES, TIER_HIT_PREFIX

#: stats counter -> (metric name, help)
_COUNTERS = {
    "lookups": ("kvplug_lookups", "Prompts looked up in kvplug's tiers"),
    "lookup_tokens": ("kvplug_lookup_tokens", "Prompt tokens looked up"),
    "hit_tokens": (
        "kvplug_hit_tokens",
        "Prompt tokens kvplug holds past what vLLM's own prefix cache had: what kvplug loads",
    ),
    "vllm_cached_tokens": (
        "kvplug_vllm_cached_tokens",
        "Prompt tokens kvplug holds that vLLM's own prefix cache had already (kvplug loads none of them)",
    ),
    "loaded_tokens": ("kvplug_loaded_tokens", "Tokens of KV loaded into vLLM's cache"),
    "loaded_bytes": ("kvplug_loaded_bytes", "Serialized bytes read from kvplug's tiers"),
    "stored_tokens": ("kvplug_stored_tokens", "Tokens of KV stored in kvplug's tiers"),
    "stored_bytes": ("kvplug_stored_bytes", "Serialized bytes written to kvplug's tiers"),
    "load_error_blocks": (
        "kvplug_load_error_blocks",
        "vLLM blocks promised but not loaded (recomputed), each rank's own",
    ),
}
#: stats sample list -> (metric name, help)
_HISTOGRAMS = {
    "lookup_seconds": ("kvplug_lookup_seconds", "Time of one prompt's lookup (scheduler side)"),
    "load_seconds": ("kvplug_load_seconds", "Time of one request's load, fetch to written"),
    "store_seconds": ("kvplug_store_seconds", "Time vLLM's worker spent handing one request's chunks to kvplug"),
}
_BUCKETS = [1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
assert set(_HISTOGRAMS) == set(SAMPLES)


class KVPlugPromMetrics(KVConnectorPromMetrics):
    """Registers kvplug's metrics with vLLM's Prometheus classes and records each step's stats."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            for key, (name, doc) in _COUNTERS.items()
        }
        self._tier_hits = self._counter_cls(
            name="kvplug_hit_tokens_by_tier",
            documentation="kvplug_hit_tokens by the fastest kvplug tier holding them",
            labelnames=[*labelnames, "tier"],
        )
        self._load_errors = self._counter_cls(
            name="kvplug_load_errors",
            documentation="Chunks that failed to load by reason (corrupt, incompatible, ...); "
            "background loads given up (deadline, fetch_failed)",
            labelnames=[*labelnames, "reason"],
        )
        self._dropped = self._counter_cls(
            name="kvplug_store_dropped",
            documentation="Chunk batches dropped by a full or closed store queue",
            labelnames=[*labelnames, "queue"],
        )
        self._breaker = self._gauge_cls(
            name="kvplug_remote_breaker_state",
            documentation="Circuit breaker of a remote kvplug tier: 0 closed, 1 half open, 2 open",
            labelnames=[*labelnames, "tier"],
            multiprocess_mode="mostrecent",
        )
        self._pins = {  # stats key prefix -> metric, labelled by tier
            GAUGE_PREFIX + "pinned_bytes.": self._gauge_cls(
                name="kvplug_pinned_bytes",
                documentation="Bytes of pinned chunks in a kvplug tier",
                labelnames=[*labelnames, "tier"],
                multiprocess_mode="mostrecent",
            ),
            "pins_refused.": self._counter_cls(
                name="kvplug_pins_refused",
                documentation="Pins a kvplug tier refused: its pin_max_bytes was spent",
                labelnames=[*labelnames, "tier"],
            ),
            "quota_evictions.": self._counter_cls(
                name="kvplug_quota_evictions",
                documentation="Chunks a kvplug tier evicted because their tenant was over its quota",
                labelnames=[*labelnames, "tier"],
            ),
        }
        self._stores_refused = self._counter_cls(
            name="kvplug_stores_refused",
            documentation="Chunks a kvplug tier did not store, by reason: pins (no room beside the pinned "
            "chunks), quota (larger than its tenant's quota)",
            labelnames=[*labelnames, "tier", "reason"],
        )
        # Tenant labels are bounded and never a cache_salt: the names of tenancy.tenants, a keyed
        # digest for an unnamed salt a tier's quotas names, (other), (unsalted).
        self._tenant_bytes = self._gauge_cls(
            name="kvplug_tenant_bytes",
            documentation="Bytes a tenant (cache_salt) holds in a kvplug tier",
            labelnames=[*labelnames, "tier", "tenant"],
            multiprocess_mode="mostrecent",
        )
        self._tenant_hits = self._counter_cls(
            name="kvplug_tenant_hits",
            documentation="Reads of a tenant's chunks a kvplug tier served",
            labelnames=[*labelnames, "tier", "tenant"],
        )
        self._histograms = {
            key: self._histogram_cls(name=name, documentation=doc, labelnames=labelnames, buckets=_BUCKETS)
            for key, (name, doc) in _HISTOGRAMS.items()
        }
        for engine_idx in per_engine_labelvalues:  # every series exists from the start, at 0
            values = per_engine_labelvalues[engine_idx]
            for metric in [*self._counters.values(), *self._histograms.values()]:
                metric.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if key in self._counters:
                if value:
                    self._counters[key].labels(*values).inc(value)
            elif key in self._histograms:
                histogram = self._histograms[key].labels(*values)
                for seconds in value:
                    histogram.observe(seconds)
            elif key.startswith(TIER_HIT_PREFIX):
                if value:
                    self._tier_hits.labels(*values, key[len(TIER_HIT_PREFIX) :]).inc(value)
            elif key.startswith(LOAD_ERROR_PREFIX):
                if value:
                    self._load_errors.labels(*values, key[len(LOAD_ERROR_PREFIX) :]).inc(value)
            elif key.startswith("store_dropped."):
                if value:
                    self._dropped.labels(*values, key[len("store_dropped.") :]).inc(value)
            elif key.startswith(GAUGE_PREFIX + "breaker_state."):
                self._breaker.labels(*values, key[len(GAUGE_PREFIX + "breaker_state.") :]).set(value)
            else:
                self._observe_tenancy(values, key, value)

    def _observe_tenancy(self, values: list[object], key: str, value: Any) -> None:
        """Pin and per-tenant figures (stats keys ``<prefix><tier>``, ``<prefix><tier>|<tenant>`` or
        ``<prefix><tier>|<reason>``)."""
        for prefix, metric in self._pins.items():
            if key.startswith(prefix):
                tier = key[len(prefix) :]
                if prefix.startswith(GAUGE_PREFIX):
                    metric.labels(*values, tier).set(value)
                elif value:
                    metric.labels(*values, tier).inc(value)
                return
        for prefix, metric in (
            (GAUGE_PREFIX + "tenant_bytes.", self._tenant_bytes),
            ("tenant_hits.", self._tenant_hits),
            ("stores_refused.", self._stores_refused),
        ):
            if key.startswith(prefix):
                tier, _, tenant = key[len(prefix) :].partition("|")
                if prefix.startswith(GAUGE_PREFIX):
                    metric.labels(*values, tier, tenant).set(value)
                elif value:
                    metric.labels(*values, tier, tenant).inc(value)
                return
