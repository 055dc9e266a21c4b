"""What one scheduler-side lookup found, and the counters it adds once vLLM admits the request.

vLLM 0.32 asks ``get_num_new_matched_tokens`` again, step after step, about a waiting
request it could not schedule (token budget, no free blocks, ...). Counting a lookup
each time it is asked would count the same hit tokens many times over while kvplug
loads them once, so the hit figures (``lookups``, ``lookup_tokens``, ``hit_tokens``,
``vllm_cached_tokens``, ``hit_tokens_tier.*``) are counted when vLLM allocates the
request's blocks (``update_state_after_alloc``), from the latest lookup: once per
admitted request, as vLLM records its own prefix cache stats "at admission so
unscheduled lookups are not counted". A request vLLM preempts and admits again is
looked up and loaded again, and counted again. ``lookup_us`` is time really spent and
is counted on every ask that looks up; a background lookup (``background_lookups``)
counts once, when its answer is taken: the time the request waited for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvplug import ChunkLocation
from kvplug_vllm.stats import TIER_HIT_PREFIX


@dataclass
class LookupResult:
    """One lookup of a waiting request: what kvplug holds, and what vLLM computed already."""

    num_computed: int
    num_hit: int
    #: Where each chunk of the prefix is, in prefix order.
    tiers: list[ChunkLocation] = field(default_factory=list)
    prompt_tokens: int = 0
    num_external: int = 0
    background: bool = False
    #: Every KV cache group's blocks, for a background load.
    group_block_ids: list[list[int]] = field(default_factory=list)

    @property
    def new_hit(self) -> int:
        """Tokens kvplug holds past what vLLM had computed (its own prefix cache): what kvplug adds."""
        return max(0, self.num_hit - self.num_computed)

    @property
    def vllm_cached(self) -> int:
        """Tokens kvplug holds that vLLM's own prefix cache had already: kvplug loads none of them."""
        return min(self.num_hit, self.num_computed)

    def counts(self) -> dict[str, int]:
        """The counters this lookup adds when its request is admitted (see the module docstring)."""
        counts = dict(
            lookups=1, lookup_tokens=self.prompt_tokens, hit_tokens=self.new_hit, vllm_cached_tokens=self.vllm_cached
        )
        end = 0
        # By tier label (``<index>:<type>``), as the other per-tier metrics: two ``disk`` folders stay apart.
        for name, count in ((location.tier_label, location.tokens) for location in self.tiers):
            # Only the part of each chunk past vLLM's own prefix cache is kvplug's hit.
            beyond = min(count, max(0, end + count - self.num_computed))
            end += count
            if beyond:
                counts[TIER_HIT_PREFIX + name] = counts.get(TIER_HIT_PREFIX + name, 0) + beyond
        return counts

    def chunk_hashes(self) -> list[str]:
        """Each chunk's hash, for the load (empty unless the lookup knew every one)."""
        hashes = [location.chunk_hash for location in self.tiers]
        return hashes if all(hashes) else []

    def describe(self) -> str:
        """``cpu 128, s3 64`` (tokens by tier, in prefix order) for log lines."""
        by_tier: dict[str, int] = {}
        for location in self.tiers:
            name, count = location.tier, location.tokens
            by_tier[name] = by_tier.get(name, 0) + count
        return ", ".join(f"{name} {count}" for name, count in by_tier.items()) or "none"
