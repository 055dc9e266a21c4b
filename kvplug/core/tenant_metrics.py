"""Per-tier pin and per-tenant figures as Prometheus metrics, read from the tiers when scraped.

Tiers that keep pins and quotas count them in ``stats().extra``
(:meth:`kvplug.GuardedEviction.stats_extra`); this collector turns those figures into
``kvplug_tenant_bytes{tier,tenant}`` (what this process knows of), ``kvplug_folder_tenant_bytes{tier,tenant}``
(a folder shared by processes: all of theirs), ``kvplug_tenant_hits_total{tier,tenant}``,
``kvplug_pinned_bytes{tier}``, ``kvplug_folder_pinned_bytes{tier}`` (a folder shared by processes: all of
theirs), ``kvplug_pins_refused_total{tier}``,
``kvplug_quota_evictions_total{tier}`` and ``kvplug_stores_refused_total{tier,reason}``.
The tenant label set is bounded and never shows a salt: the names of ``tenancy.tenants``,
a keyed digest for an unnamed salt a tier's ``quotas`` names, ``(other)`` for every other
salt, ``(unsalted)`` (:class:`kvplug.core.tenants.TenantLabels`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvplug.core.tenants import FOLDER_PINNED_BYTES, FOLDER_TENANT_BYTES, STORES_REFUSED, TENANT_BYTES, TENANT_HITS

#: (tier label, its stats' extra figures) of each tier of a chain.
TierFigures = Callable[[], Iterable[tuple[str, Mapping[str, object]]]]

logger = logging.getLogger("kvplug.metrics")


class TenantCollector(Collector):
    """Collects the figures of every registered tier source (see the module docstring)."""

    def __init__(self) -> None:
        self.sources: list[TierFigures] = []

    def collect(self) -> Iterator[Metric]:
        held = GaugeMetricFamily(
            "kvplug_tenant_bytes",
            "Bytes a tenant (cache_salt) holds in a tier, of the chunks this process knows",
            labels=["tier", "tenant"],
        )
        folder_held = GaugeMetricFamily(
            "kvplug_folder_tenant_bytes",
            "Bytes a tenant holds in a folder tier's folder, every process's records (what its quota bounds)",
            labels=["tier", "tenant"],
        )
        hits = CounterMetricFamily(
            "kvplug_tenant_hits", "Reads of a tenant's chunks a tier served", labels=["tier", "tenant"]
        )
        pinned = GaugeMetricFamily("kvplug_pinned_bytes", "Bytes of pinned chunks in a tier", labels=["tier"])
        folder_pinned = GaugeMetricFamily(
            "kvplug_folder_pinned_bytes",
            "Bytes of pinned records in a folder tier's folder, summed over every live process sharing it",
            labels=["tier"],
        )
        refused = CounterMetricFamily(
            "kvplug_pins_refused",
            "Pins a tier refused: its pin_max_bytes (or its folder's budget of every process's pins) was spent",
            labels=["tier"],
        )
        evicted = CounterMetricFamily(
            "kvplug_quota_evictions", "Chunks a tier evicted because their tenant was over its quota", labels=["tier"]
        )
        stores_refused = CounterMetricFamily(
            "kvplug_stores_refused",
            "Chunks a tier did not store, by reason: pins (less room beside the pinned chunks than the chunk), "
            "quota (the chunk is larger than its tenant's quota less its request pins)",
            labels=["tier", "reason"],
        )
        for source in self.sources:
            try:
                figures = list(source())
            except Exception:  # a closed chain, a tier that fails: no figures, never a failed scrape
                logger.debug("tenant metrics: a tier source failed", exc_info=True)
                continue
            for tier, extra in figures:
                if "pinned_bytes" not in extra:
                    continue  # a tier that keeps no pins or quotas
                pinned.add_metric([tier], _number(extra["pinned_bytes"]))
                if FOLDER_PINNED_BYTES in extra:
                    folder_pinned.add_metric([tier], _number(extra[FOLDER_PINNED_BYTES]))
                refused.add_metric([tier], _number(extra.get("pins_refused", 0)))
                evicted.add_metric([tier], _number(extra.get("quota_evictions", 0)))
                for key, value in extra.items():
                    if key.startswith(TENANT_BYTES):
                        held.add_metric([tier, key[len(TENANT_BYTES) :]], _number(value))
                    elif key.startswith(FOLDER_TENANT_BYTES):
                        folder_held.add_metric([tier, key[len(FOLDER_TENANT_BYTES) :]], _number(value))
                    elif key.startswith(TENANT_HITS):
                        hits.add_metric([tier, key[len(TENANT_HITS) :]], _number(value))
                    elif key.startswith(STORES_REFUSED):
                        stores_refused.add_metric([tier, key[len(STORES_REFUSED) :]], _number(value))
        yield from (held, folder_held, hits, pinned, folder_pinned, refused, evicted, stores_refused)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the families are known only when collected


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0
