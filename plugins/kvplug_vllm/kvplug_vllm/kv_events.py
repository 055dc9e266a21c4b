"""kvplug's stored/evicted chunks as vLLM KV events, for cache-aware routers.

A router (llm-d's KV indexer, Dynamo) matches prompts to servers by vLLM's own
block hashes. kvplug keys chunks by its own chained hashes, so the worker keeps,
for each chunk it stored or loaded, the vLLM block hashes of the blocks it spans
(the scheduler sends them with each request, from ``Request.block_hashes``). When a
tier of its cache engine reports a chunk stored (``add_event_listener``: a ``stored``
event with that ``tier``, once the tier holds it: an async tier's write landed, a
promotion written), the worker publishes a ``BlockStored`` with ``medium`` = the tier
type (``cpu``, ``disk``, ``s3``...); a write dropped, declined or refused is never
published. When a tier evicts or removes it, a ``BlockRemoved`` with that tier as
``medium``, unless another tier of that type (a second ``disk`` folder: events tell tiers
apart by ``KVEvent.tier_id``) still holds it. Events leave the worker in the step's
``KVConnectorOutput`` and vLLM's scheduler publishes them (``take_events``) on its
ZMQ publisher together with its own prefix cache's events.

Only the engine's first worker (tensor- and pipeline-parallel rank 0) publishes. vLLM
publishes an event only if every worker that sent events in a step sent it too, and each
rank's tier writes land when they land: an async tier's write on rank 0 in one step and on
rank 1 in the next was published at once if rank 1 sent nothing in that step, and never if it
sent anything else. The first rank's records stand for the engine's: every rank stores the
same chunks (MLA's one record and replicated heads are the first rank's), and a chunk another
rank evicted first is a miss there, not wrong KV.

The index (kvplug's :class:`~kvplug.HeldChunks`, the one SGLang's adapter keeps too) remembers
the chunks some tier holds, at most ``max_chunks`` of them: one it forgets
is published removed from every medium then, since its later eviction could not be (a router
would believe it held for good); a later store or load of it announces it again. A chunk no
tier holds (its writes not landed yet, declined or dropped, or it left every tier) waits for a
``stored`` event among at most ``max_waiting`` others, the oldest whose write can no longer land
forgotten first (the engine's ``writes_in_flight``: a write still queued lands announced): no
router was told it is held. A chunk without vLLM blocks is never published, so never remembered. So the
index holds what the tiers hold, not every chunk the engine ever stored or loaded.

Records a persistent tier held before the worker started are never announced as such: a record
names its chunk by a digest, not by tokens or vLLM block hashes. Loaded, such a chunk is
announced for the faster tiers the load promotes it to (their ``stored``), not for the tier
that served it, which wrote nothing (docs/fleet.md).

The index translates events; it is not a journal of what the worker stored: ``kvplug ctl
clear`` and ``reset_cache`` read the worker's control target's journal. A worker keeps an
index only when vLLM publishes KV events.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents, KVEventAggregator

from kvplug import ChunkKey, HeldChunks, KVEvent

#: Chunks some tier holds remembered at most (oldest forgotten first): bounds the index's memory.
MAX_CHUNKS = 1 << 20
#: Chunks no tier holds remembered at most (oldest forgotten first): writes in flight, and any
#: that never land (declined, dropped), whose chunks would otherwise be remembered forever.
MAX_WAITING = 1 << 14


@dataclass(frozen=True)
class _Chunk:
    block_hashes: tuple[Any, ...]
    parent: Any
    token_ids: tuple[int, ...]
    lora_name: str | None


class ChunkIndex:
    """Chunk key -> the vLLM blocks it holds, and the vLLM events not yet handed to vLLM.

    Which tiers hold which chunk is kvplug's :class:`~kvplug.HeldChunks` (media: the tier
    types); this class names chunks by vLLM's blocks. ``on_event`` is called from kvplug's
    threads (store worker, tier writers); everything is guarded by one lock.
    """

    def __init__(
        self,
        block_size: int,
        tier_names: Sequence[str],
        in_flight: Callable[[Sequence[str]], list[bool]] | None = None,
        *,
        max_chunks: int = MAX_CHUNKS,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        """``in_flight``: the cache engine's ``writes_in_flight`` (see :class:`~kvplug.HeldChunks`)."""
        self.block_size = block_size
        #: The types of the engine's tiers: the media published (events of no tier are ignored).
        self.tier_names = list(tier_names)
        #: The medium of a tier is its type.
        self.chunks: HeldChunks[_Chunk] = HeldChunks(
            str, max_held=max_chunks, max_waiting=max_waiting, in_flight=in_flight
        )
        self._events: list[KVCacheEvent] = []
        self._lock = threading.Lock()

    def remember(
        self, keys: Sequence[ChunkKey], token_ids: Sequence[int], block_hashes: Sequence[Any], lora_name: str | None
    ) -> None:
        """Record the vLLM blocks of each chunk; ``block_hashes[i]`` is block ``i``'s, as vLLM publishes it.

        Chunks that end inside a block, or past the blocks vLLM hashed, have no
        vLLM identity and are not published (vLLM hashes full blocks only): not remembered.
        """
        size = self.block_size
        with self._lock:
            for key in keys:
                first, last = key.start // size, key.end // size
                if key.start % size or key.end % size or last > len(block_hashes) or last == first:
                    continue
                parent = block_hashes[first - 1] if first else None
                chunk = _Chunk(
                    tuple(block_hashes[first:last]), parent, tuple(token_ids[key.start : key.end]), lora_name
                )
                self.chunks.expect(key.key, chunk)

    def on_event(self, event: KVEvent) -> None:
        # The engine's own "stored" (tier None) only says it handed chunks to its tiers.
        if event.tier is None or event.tier not in self.tier_names:
            return
        with self._lock:
            removed: list[Any] = []
            for change in self.chunks.observe(event):
                chunk = change.chunk
                if change.kind == "forgotten":
                    # Its later eviction could no longer be published: a router would believe it
                    # held for good. Said removed now, from every medium (a removal of what a
                    # router never held is a no-op); a later store or load announces it again.
                    for medium in dict.fromkeys(self.tier_names):
                        self._events.append(BlockRemoved(block_hashes=list(chunk.block_hashes), medium=medium))
                elif change.kind == "stored":
                    self._events.append(
                        BlockStored(
                            block_hashes=list(chunk.block_hashes),
                            parent_block_hash=chunk.parent,
                            token_ids=list(chunk.token_ids),
                            block_size=self.block_size,
                            lora_id=None,
                            medium=change.medium,
                            lora_name=chunk.lora_name,
                        )
                    )
                else:  # one event's removals from one medium: one BlockRemoved
                    removed += chunk.block_hashes
            if removed:
                self._events.append(BlockRemoved(block_hashes=removed, medium=event.tier))

    def take(self) -> list[KVCacheEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events


class KVPlugKVEvents(KVConnectorKVEvents):
    """The worker's events of one step, merged across tensor-parallel workers by vLLM.

    With several workers each stores its own shard of a chunk and reports it; only
    events every worker reported are published (a chunk is usable only then).
    """

    def __init__(self, num_workers: int = 1) -> None:
        self._aggregator = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._aggregator.add_events(events)

    def aggregate(self) -> KVPlugKVEvents:
        common = self._aggregator.get_common_events()
        self._aggregator.clear_events()
        self._aggregator.add_events(common)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        events: list[KVCacheEvent] = self._aggregator.get_all_events()
        return events

    def get_number_of_workers(self) -> int:
        return int(self._aggregator.get_number_of_workers())

    def clear_events(self) -> None:
        self._aggregator.clear_events()
        self._aggregator.reset_workers()


class SchedulerEvents:
    """The scheduler side's part: vLLM's block hashes for each request's metadata, and the
    workers' events gathered from each step's output until vLLM's publisher takes them."""

    def __init__(self, vllm_config: Any) -> None:
        kv_events = getattr(vllm_config, "kv_events_config", None)
        self.publish = bool(kv_events is not None and kv_events.enable_kv_cache_events)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._events: KVPlugKVEvents | None = None

    def block_hashes(self, request: Any, num_tokens: int) -> list[Any]:
        """vLLM's hashes of the full blocks of the first ``num_tokens``, as its KV events publish them."""
        if not self.publish:
            return []
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        # vLLM hashes in units of its hash block size; kvplug's events are per KV block.
        hashes = list(request.block_hashes)[: num_tokens // self.block_size]
        return [maybe_convert_block_hash(h) for h in hashes]

    def add(self, events: Any) -> None:
        """Gather a step's worker events (``KVConnectorOutput.kv_cache_events``)."""
        if not isinstance(events, KVPlugKVEvents):
            return
        if self._events is None:
            self._events = events
        else:
            self._events.add_events(events.get_all_events())
            self._events.increment_workers(events.get_number_of_workers())

    def take(self) -> Iterable[KVCacheEvent]:
        """kvplug's BlockStored/BlockRemoved events from the workers, for vLLM's publisher."""
        if self._events is None:
            return
        events, self._events = self._events, None
        yield from events.aggregate().get_all_events()
