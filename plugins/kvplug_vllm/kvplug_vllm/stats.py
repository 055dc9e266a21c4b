"""The connector's counters in vLLM's ``KVConnectorStats`` form.

What they count (tokens are prompt tokens; vLLM's own prefix cache answers first):

- ``lookups``, ``lookup_tokens``: requests looked up in kvplug's tiers, and their prompt
  tokens. These and the hit figures below are counted once, when vLLM admits the request,
  however often vLLM asked about it while it waited (``lookup_result``).
- ``hit_tokens``: tokens kvplug holds past what vLLM's own prefix cache already had:
  what kvplug adds, and loads (``loaded_tokens``), unless a load fails. For a
  full-prompt hit vLLM recomputes the last token, but kvplug writes its block anyway.
- ``vllm_cached_tokens``: tokens kvplug holds that vLLM's own prefix cache had already;
  kvplug loads none of them. ``hit_tokens + vllm_cached_tokens`` is all kvplug held.
- ``hit_tokens_tier.<index>:<tier type>``: ``hit_tokens`` split by the fastest tier holding
  them, named by its position in the chain and its type (``0:cpu``, ``1:disk``), as the other
  per-tier figures are.
- ``loaded_tokens``, ``loaded_bytes``: tokens written into vLLM's blocks, and the
  serialized bytes read for them (worker side).
- ``stored_tokens``, ``stored_bytes``: tokens handed to the tiers, and their serialized bytes.
  Tokens are the engine's, counted by its first rank (tensor- and pipeline-parallel rank 0);
  bytes are summed over every rank's records.
- ``load_error_blocks``, ``load_error_requests``: vLLM blocks promised but not loaded
  (vLLM recomputes them), and the requests they belong to. Each rank counts its own failed
  loads, summed over the ranks (a block no rank could load counts once per rank): the first
  rank alone does not know them all. The ranks agree on failed synchronous loads only so that
  none stores KV computed on top of them (:mod:`kvplug_vllm.load_results`), within the
  tensor-parallel group; background loads and other pipeline stages are not agreed on.

The worker side reports what it loaded, stored and failed to load since the
previous step, and ``worker_us``, the time the forward pass spent in the
connector (loads, layer waits, copies out for stores); the scheduler side
reports its lookups and ``lookup_us``, their time. vLLM adds the two up,
sends them to the front end (they are plain ints, so they serialize) and logs
``KV Transfer metrics: ...`` with :meth:`KVPlugConnectorStats.reduce`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

#: Every counter, in the order they are logged.
COUNTERS = (
    "lookups",
    "lookup_tokens",
    "hit_tokens",
    "vllm_cached_tokens",
    "loaded_tokens",
    "loaded_bytes",
    "stored_tokens",
    "stored_bytes",
    "load_error_blocks",
    "load_error_requests",
    "lookup_us",
    "worker_us",
    # where loads' time went: tier reads, decode and verify, writes into vLLM's blocks
    "load_fetch_us",
    "load_verify_us",
    "load_write_us",
)


#: ``hit_tokens_tier.<index>:<tier type>``: ``hit_tokens`` whose chunk was found first in that tier.
TIER_HIT_PREFIX = "hit_tokens_tier."
#: ``load_errors.<reason>``: chunks that failed to load (corrupt, ...) or loads given up (deadline).
LOAD_ERROR_PREFIX = "load_errors."
#: ``gauge.<name>``: a level (latest value wins when stats are merged), e.g. ``gauge.breaker_state.<tier>``.
GAUGE_PREFIX = "gauge."
#: Keys holding lists of seconds, one entry per operation (for latency histograms).
SAMPLES = ("lookup_seconds", "load_seconds", "store_seconds")


def _zeros() -> dict[str, Any]:
    return {name: 0 for name in COUNTERS}


@dataclass
class KVPlugConnectorStats(KVConnectorStats):
    """Counters since the last report; unknown keys in ``data`` are kept and summed too."""

    data: dict[str, Any] = field(default_factory=_zeros)

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, **counts: int) -> None:
        for name, value in counts.items():
            self.data[name] = self.data.get(name, 0) + int(value)

    def reset(self) -> None:
        self.data = _zeros()

    def sample(self, name: str, seconds: float) -> None:
        """Record one operation's latency (``name`` in :data:`SAMPLES`)."""
        self.data.setdefault(name, []).append(seconds)

    def aggregate(self, other: KVConnectorStats, *, counts_only: bool = False) -> KVPlugConnectorStats:
        """Add ``other`` in: counters are summed, gauges take ``other``'s level, latency
        samples are concatenated (left out with ``counts_only``, for running totals)."""
        for name, value in other.data.items():
            if name.startswith(GAUGE_PREFIX):
                if not counts_only:
                    self.data[name] = value
            elif isinstance(value, list):
                if not counts_only:
                    self.data.setdefault(name, []).extend(value)
            elif isinstance(value, (int, float)):
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = {name: self.data.get(name, 0) for name in COUNTERS}
        asked = self.data.get("lookup_tokens", 0)
        reduced["miss_tokens"] = asked - self.data.get("hit_tokens", 0)
        reduced["hit_rate"] = round(self.data.get("hit_tokens", 0) / asked, 4) if asked else 0.0
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTERS)
