"""The cache engine's metrics passed on in the worker's connector stats, each step as a difference.

vLLM shows a connector's stats in its logs and Prometheus (``KVPlugConnectorStats``); the
worker adds the engine's own counters and gauges to them by name and label. With
``metrics_port`` the worker also serves the engine's own Prometheus registry.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvplug import CacheEngine, LayerwiseRetrieve, MetricSample
from kvplug_vllm.background import GroupsRetrieve
from kvplug_vllm.stats import GAUGE_PREFIX, LOAD_ERROR_PREFIX, KVPlugConnectorStats

logger = logging.getLogger("kvplug.vllm")

#: kvplug metric -> connector stats counter reported each step as a difference.
_METRIC_COUNTERS = {
    "kvplug_loaded_tokens_total": "loaded_tokens",
    "kvplug_loaded_bytes_total": "loaded_bytes",
    "kvplug_stored_tokens_total": "stored_tokens",
    "kvplug_stored_bytes_total": "stored_bytes",
}
#: Counters of tokens, which every tensor- or pipeline-parallel rank counts for its own heads
#: or layers of the same tokens: passed on by the engine's first rank only, so that vLLM's sum
#: over the workers is the engine's tokens (bytes are each rank's own, and summed).
_PER_ENGINE = frozenset({"loaded_tokens", "stored_tokens"})


#: Labelled kvplug metrics passed on by label: metric -> (its label, connector stats key prefix).
_LABELLED = {
    "kvplug_load_errors_total": ("reason", LOAD_ERROR_PREFIX),
    "kvplug_store_dropped_total": ("queue", "store_dropped."),
    "kvplug_remote_breaker_state": ("tier", GAUGE_PREFIX + "breaker_state."),
    "kvplug_pinned_bytes": ("tier", GAUGE_PREFIX + "pinned_bytes."),
    "kvplug_pins_refused_total": ("tier", "pins_refused."),
    "kvplug_quota_evictions_total": ("tier", "quota_evictions."),
}
#: Per-tenant metrics (labels tier and tenant) -> connector stats key prefix; ``<tier>|<tenant>`` follows
#: (a tier label, ``<index>:<type>``, has no ``|``).
_TENANT_LABELLED = {
    "kvplug_tenant_bytes": GAUGE_PREFIX + "tenant_bytes.",
    "kvplug_tenant_hits_total": "tenant_hits.",
}
#: Per-tier counters with a reason -> connector stats key prefix; ``<tier>|<reason>`` follows.
_REASON_LABELLED = {"kvplug_stores_refused_total": "stores_refused."}


def stats_name(sample: MetricSample) -> str | None:
    """The connector stats key a kvplug metric sample is reported under, or None."""
    if not sample.labels:
        return _METRIC_COUNTERS.get(sample.name)
    if sample.name in _LABELLED:
        label, prefix = _LABELLED[sample.name]
        if set(sample.labels) == {label}:
            return prefix + sample.labels[label]
    if sample.name in _TENANT_LABELLED and set(sample.labels) == {"tier", "tenant"}:
        return f"{_TENANT_LABELLED[sample.name]}{sample.labels['tier']}|{sample.labels['tenant']}"
    if sample.name in _REASON_LABELLED and set(sample.labels) == {"tier", "reason"}:
        return f"{_REASON_LABELLED[sample.name]}{sample.labels['tier']}|{sample.labels['reason']}"
    return None


def pass_engine_metrics(
    stats: KVPlugConnectorStats, engine: CacheEngine, marks: dict[str, float], *, first_rank: bool = True
) -> None:
    """Add what changed in ``engine``'s metrics since ``marks`` (updated) to ``stats``:
    counters as differences, gauges as they are; token counters only on the engine's
    ``first_rank`` (tensor- and pipeline-parallel rank 0)."""
    for sample in engine.metrics.samples():
        name = stats_name(sample)
        if name is None or sample.value == marks.get(name, 0.0) or (name in _PER_ENGINE and not first_rank):
            continue
        if name.startswith(GAUGE_PREFIX):
            stats.data[name] = sample.value
        else:
            stats.add(**{name: int(sample.value - marks.get(name, 0.0))})
        marks[name] = sample.value


def serve_metrics(port: int, engine: CacheEngine) -> Any:
    """Serve ``engine``'s Prometheus metrics on 127.0.0.1 at ``port``; the server, for :func:`stop_serving_metrics`."""
    from prometheus_client import start_http_server

    server = start_http_server(port, addr="127.0.0.1", registry=engine.metrics.registry)
    logger.info("kvplug metrics on http://127.0.0.1:%d/metrics", port)
    return server


def stop_serving_metrics(server: Any) -> None:
    httpd, thread = server
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


_F = TypeVar("_F", bound=Callable[..., Any])


def timed(method: _F) -> _F:
    """Count the method's wall time as connector time on the forward pass (``worker_us``,
    summed in its object's ``_busy_s``)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy_s += time.perf_counter() - started

    return wrapper  # type: ignore[return-value]


def count_load_phases(stats: KVPlugConnectorStats, retriever: LayerwiseRetrieve | GroupsRetrieve) -> None:
    """Where a load's time went (tier reads, verify, writing into vLLM's blocks), for the breakdown of a hit."""
    timings = retriever.timings
    stats.add(
        load_fetch_us=int(timings.fetch_s * 1e6),
        load_verify_us=int(timings.verify_s * 1e6),
        load_write_us=int(timings.write_s * 1e6),
    )
