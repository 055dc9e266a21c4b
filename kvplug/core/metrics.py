"""Prometheus metrics of one cache engine, in a registry of its own.

Each engine owns a ``CollectorRegistry`` (several engines may live in one test
process); an adapter exposes ``metrics.registry`` through its engine's server, or
``prometheus_client.start_http_server(port, registry=metrics.registry)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from kvplug.core.tenant_metrics import TenantCollector


@dataclass(frozen=True)
class MetricSample:
    """One sample of an engine metric, as Prometheus exposes it (a counter's name ends
    in ``_total``): what an adapter reads to pass kvplug's figures on to its engine."""

    name: str
    labels: Mapping[str, str]
    value: float

    @property
    def series(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """The name and sorted labels: which series the sample is of (hashable)."""
        return self.name, tuple(sorted(self.labels.items()))


class EngineMetrics:
    """Counters the cache engine and tier chain update."""

    tenants: TenantCollector

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # prometheus_client (and the http server it imports) is imported by the engines that
        # count, not by every module that names this class: ``kvplug config validate`` builds none.
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from kvplug.core.tenant_metrics import TenantCollector

        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.lookups = Counter("kvplug_lookups", "Lookup calls", registry=r)
        self.lookup_tokens = Counter("kvplug_lookup_tokens", "Tokens asked about in lookups", registry=r)
        #: Every token a lookup of this engine found, however often it is asked (an adapter may ask
        #: many times per request): not "tokens loaded". An engine adapter's own hit figures (tokens
        #: past the engine's own prefix cache, once per admitted request) are other counters.
        self.lookup_hit_tokens = Counter("kvplug_lookup_hit_tokens", "Tokens found cached by lookups", registry=r)
        self.stored_tokens = Counter("kvplug_stored_tokens", "Tokens handed to the tiers", registry=r)
        self.stored_bytes = Counter("kvplug_stored_bytes", "Serialized bytes handed to the tiers", registry=r)
        self.loaded_tokens = Counter("kvplug_loaded_tokens", "Tokens written into the engine cache", registry=r)
        self.loaded_bytes = Counter("kvplug_loaded_bytes", "Serialized bytes read back", registry=r)
        self.load_errors = Counter("kvplug_load_errors", "Chunks that failed to load", ["reason"], registry=r)
        self.store_dropped = Counter(
            "kvplug_store_dropped", "Chunk batches dropped by a full or closed queue", ["queue"], registry=r
        )
        self.tier_errors = Counter("kvplug_tier_errors", "Tier calls that raised", ["tier", "op"], registry=r)
        self.promotions = Counter("kvplug_promotions", "Chunks copied to a faster tier", ["tier"], registry=r)
        self.admission_admitted = Counter(
            "kvplug_admission_admitted", "Chunks a tier's admission policy let the chain write to it", ["tier"],
            registry=r,
        )  # fmt: skip
        self.admission_declined = Counter(
            "kvplug_admission_declined", "Chunks a tier's admission policy kept the chain from writing to it",
            ["tier"], registry=r,
        )  # fmt: skip
        self.lookup_budget_spent = Counter(
            "kvplug_lookup_budget_spent",
            "Lookups that ran out of lookup_budget_s before asking every tier",
            registry=r,
        )
        self.remote_breaker_state = Gauge(
            "kvplug_remote_breaker_state", "Circuit breaker of a remote tier: 0 closed, 1 half open, 2 open", ["tier"],
            registry=r,
        )  # fmt: skip
        self.remote_failures = Counter(
            "kvplug_remote_failures", "Failed attempts of remote store operations", ["tier", "kind"], registry=r
        )
        self.remote_retries = Counter("kvplug_remote_retries", "Retried remote store operations", ["tier"], registry=r)
        self.remote_refused_writes = Counter(
            "kvplug_remote_refused_writes",
            "Records a remote store refused to write for want of permission (dropped; its reads go on)",
            ["tier"],
            registry=r,
        )
        self.remote_short_circuits = Counter(
            "kvplug_remote_short_circuits", "Remote calls answered without the store (breaker open, budget spent)",
            ["tier"], registry=r,
        )  # fmt: skip
        self.request_pins_ignored = Counter(
            "kvplug_request_pins_ignored",
            "Stores that asked to pin their chunks while request pins are off (tenancy.request_pins)",
            registry=r,
        )
        self.pin_book_full = Counter(
            "kvplug_pin_book_full",
            "Chunks a pin could not be remembered for: the pin book held tenancy.max_pins keys "
            "(origin request: not pinned; operator: pinned only where held then)",
            ["origin"],
            registry=r,
        )
        self.retrieve_seconds = Histogram("kvplug_retrieve_seconds", "Time of retrieve calls", registry=r)
        self.store_seconds = Histogram("kvplug_store_seconds", "Time of store calls (caller side)", registry=r)
        #: Pins and per-tenant bytes and hits, read from the tiers of each chain added to its ``sources``.
        self.tenants = TenantCollector()
        r.register(self.tenants)

    def samples(self) -> list[MetricSample]:
        """Every metric's current samples (``_created`` timestamps left out)."""
        return [
            MetricSample(sample.name, dict(sample.labels), sample.value)
            for family in self.registry.collect()
            for sample in family.samples
            if not sample.name.endswith("_created")
        ]

    def snapshot(self) -> dict[str, float]:
        """Flat ``name{label=value,...} -> value`` of every sample, for reading by people
        (programs use :meth:`samples` or :meth:`value`)."""
        values: dict[str, float] = {}
        for sample in self.samples():
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return values

    def value(self, name: str, **labels: str) -> float:
        """The value of the sample ``name`` with exactly ``labels``; 0 if there is none yet."""
        for sample in self.samples():
            if sample.name == name and sample.labels == labels:
                return sample.value
        return 0.0
