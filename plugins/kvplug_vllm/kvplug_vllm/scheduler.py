"""Scheduler side of the connector: lookups, and what each step loads and stores.

Semantics follow LMCache's vLLM v1 adapter:

- ``get_num_new_matched_tokens`` asks the worker's cache engine for the cached
  prefix (whole chunks, or the full prompt). vLLM must compute at least one token
  to sample from, so a full-prompt hit still leaves the last token to recompute.
  With ``lookups: background`` a lookup the tiers answering inline (memory, local
  files: ``StorageTier.inline_lookups``) cannot answer alone runs off the scheduler thread (:mod:`kvplug_vllm.lookup_pool`): the answer is ``None``
  ("ask again next step") until it is done, and vLLM schedules other requests.
- Each step a request is scheduled, the tokens whose KV will exist after the step
  are known; their whole chunks not stored yet are stored (the last, partial
  chunk of the prompt too with ``save_unfull_chunk``; chunks completed by decode
  tokens only with ``save_decode_cache``). Loads are synchronous: the worker writes
  the cached blocks before the forward pass (or layer by layer inside it).
- If a load fails, vLLM rolls the request back to the first bad block and
  recomputes; a request whose computed count went backwards re-stores from there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvplug import ChunkLocation, ExtraKey, KVPlugConfig, RequestInfo
from kvplug.core.locations import hit_tokens
from kvplug.errors import ConfigError, KVPlugError
from kvplug_vllm.kv_events import KVPlugKVEvents
from kvplug_vllm.lookup import DirectLookup, SocketLookup, inline_tiers, local_worker, socket_path
from kvplug_vllm.lookup_pool import LookupPool, Tiers
from kvplug_vllm.lookup_result import LookupResult
from kvplug_vllm.metadata import KVPlugConnectorMetadata, LoadSpec, RequestMeta
from kvplug_vllm.prefill_resume import load_refusal
from kvplug_vllm.settings import ConnectorSettings, request_overrides, wants_report
from kvplug_vllm.stats import KVPlugConnectorStats

logger = logging.getLogger("kvplug.vllm")

#: The medium served at memory speed; a prefix needing a tier of any other medium
#: (``StorageTier.medium``) loads in the background (load: auto). Lookups go off the
#: scheduler thread (lookups: background) only for tiers that do not answer inline.
FAST_MEDIUM = "memory"
#: How long an idle scheduler step waits for a background lookup, rather than spin.
IDLE_WAIT_S = 0.01


@dataclass
class _Tracker:
    """What the scheduler side remembers of a running request."""

    request: Any
    info: RequestInfo
    block_ids: list[int]
    prompt_len: int
    #: Every KV cache group's block ids (a hybrid model only; ``block_ids`` is group 0's).
    group_block_ids: list[list[int]] = field(default_factory=list)
    num_saved: int = 0
    num_computed: int = 0
    hit_tokens: int = 0
    vllm_cached_tokens: int = 0
    external_tokens: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)


def request_info(request: Any, config: KVPlugConfig, *, with_overrides: bool = True) -> RequestInfo:
    """Isolation and extra keys of a vLLM request: cache_salt, LoRA, multimodal inputs.

    Each multimodal item becomes an :class:`kvplug.ExtraKey` over its placeholder
    tokens, so two prompts with equal placeholder ids but different images never
    share those chunks. Raises ``ConfigError`` for bad kvplug ``kv_transfer_params``.
    """
    extra_keys = []
    for feature in getattr(request, "mm_features", None) or ():
        position = feature.mm_position
        value = feature.mm_hash or feature.identifier
        extra_keys.append(ExtraKey(position.offset, position.offset + position.length, f"{feature.modality}:{value}"))
    lora = getattr(request, "lora_request", None)
    overrides = request_overrides(request.kv_transfer_params, config) if with_overrides else {}
    return RequestInfo(
        cache_salt=getattr(request, "cache_salt", None),
        lora_id=lora.lora_name if lora is not None else None,
        extra_keys=tuple(extra_keys),
        overrides=overrides,
    )


class SchedulerSide:
    """The scheduler-role half of :class:`kvplug_vllm.KVPlugConnector`."""

    def __init__(
        self,
        vllm_config: Any,
        settings: ConnectorSettings,
        config: KVPlugConfig,
        engine_key: tuple[str, int, int],
        *,
        num_kv_cache_groups: int = 1,
        state_groups: bool = False,
    ) -> None:
        kv_transfer = vllm_config.kv_transfer_config
        self.settings = settings
        self.config = config
        self.chunk_size = config.chunk_size
        self.block_size = vllm_config.cache_config.block_size
        refusal = load_refusal(vllm_config)
        if refusal is not None and kv_transfer.is_kv_consumer:
            logger.warning("kvplug loads nothing into this engine: %s", refusal)
        self.can_load = kv_transfer.is_kv_consumer and refusal is None
        self.can_save = kv_transfer.is_kv_producer
        self.engine_key = engine_key
        #: A hybrid model's loads all go to the background: vLLM takes a failed load of
        #: several KV cache groups by request (failed_recving), never by block id.
        self.num_groups = num_kv_cache_groups
        #: Some group keeps recurrent state (state_groups.py): a hit ends at a chunk whose state is
        #: stored, before the prompt's last token (which vLLM computes from the state before it).
        self.state_groups = state_groups
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        #: Tier types looked up on the scheduler thread (memory, local files); the others in the background.
        self.inline = inline_tiers(config)
        self._channel: DirectLookup | SocketLookup | None = None
        self._lookups: dict[str, LookupResult] = {}
        #: Lookups off the scheduler thread (lookup_pool.py), and their answers kept until admission.
        self._pool: LookupPool | None = None
        if settings.lookups == "background" and any(spec.type not in self.inline for spec in config.tiers):
            self._pool = LookupPool(settings.max_background_lookups, settings.lookup_timeout_s)
        self._answered: dict[str, Tiers] = {}
        self._requests: dict[str, Any] = {}
        self._trackers: dict[str, _Tracker] = {}
        #: Background loads allocated this step (go into the next metadata), and those sent.
        self._background: dict[str, LookupResult] = {}
        self._background_hits: dict[str, LookupResult] = {}
        #: Background loads that failed with nothing valid: vLLM asks again and computes the prompt.
        self._failed_loads: dict[str, LookupResult] = {}
        self._stats = KVPlugConnectorStats()
        kv_events = getattr(vllm_config, "kv_events_config", None)
        self.publish_events = bool(kv_events is not None and kv_events.enable_kv_cache_events)
        self._events: KVPlugKVEvents | None = None
        #: Worker and scheduler counters since start, for per-request reports.
        self.totals = KVPlugConnectorStats()

    # --- lookups ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._lookups.pop(request.request_id, None)
        tokens = request.prompt_token_ids
        if not self.can_load or tokens is None:
            return 0, False
        failed = self._background_hits.pop(request.request_id, None)
        if failed is not None:
            # Its background load failed or ran past load_timeout_ms and vLLM rolled it back to
            # nothing: trying the same slow tier again could fail the same way, forever.
            self._failed_loads[request.request_id] = failed
            logger.info("request %s: its background load failed; vLLM computes the prompt", request.request_id)
            return 0, False
        try:
            info = self.request_info(request)
        except ConfigError as exc:
            logger.warning("request %s: ignoring kvplug settings in kv_transfer_params: %s", request.request_id, exc)
            info = self.request_info(request, with_overrides=False)
        if self.settings.skip_last_n_tokens:
            tokens = tokens[: max(0, len(tokens) - self.settings.skip_last_n_tokens)]
        if self.state_groups:
            # vLLM computes the last token whatever the hit, and resumes a recurrent state only
            # where one is stored: the hit must be a chunk end with a state before that token.
            tokens = tokens[:-1]
        tiers = self._find(request.request_id, tokens, info)
        if tiers is None:
            return None, False  # its lookup runs in the background: vLLM asks again next step
        hit = hit_tokens(tiers)
        need = hit - num_computed_tokens
        if hit == request.num_tokens:
            need -= 1  # the engine must compute the last token to sample the next
        background = need > 0 and self._loads_in_background(tiers, num_computed_tokens)
        lookup = LookupResult(num_computed_tokens, hit, tiers, len(request.prompt_token_ids), background=background)
        self._lookups[request.request_id] = lookup
        logger.info(
            "request %s: %d prompt tokens, %d cached by kvplug (%s), %d in vLLM's own prefix cache, loading %d%s",
            request.request_id, len(request.prompt_token_ids), hit, lookup.describe(), num_computed_tokens,
            max(need, 0), " in the background" if background else "",
        )  # fmt: skip
        return max(need, 0), background

    def _find(self, req_id: str, tokens: list[int], info: RequestInfo) -> Tiers | None:
        """The request's cached prefix by tier, or ``None`` while its background lookup runs."""
        if req_id in self._answered:  # not admitted when last answered: the same answer
            return self._answered[req_id]
        started = time.perf_counter()
        try:
            channel = self._lookup_channel()
            tiers = channel.locate(tokens, info) if self._pool is None else channel.inline_lookup(tokens, info)
        except KVPlugError as exc:
            logger.warning("request %s: lookup failed, treated as a miss: %s", req_id, exc)
            tiers = []
        if tiers is not None:
            if self._pool is not None:  # answered inline: an earlier ask's lookup is stale
                self._pool.discard(req_id)
            self._count_lookup_time(time.perf_counter() - started)
            return tiers
        assert self._pool is not None
        answer = self._pool.ask(req_id, lambda: channel.locate(tokens, info))
        if answer is None:
            return None
        # Time is spent on every ask; what was found is counted once the request is admitted.
        self._count_lookup_time(answer.waited_s)
        self._answered[req_id] = answer.tiers
        return answer.tiers

    def _count_lookup_time(self, seconds: float) -> None:
        lookup_us = int(seconds * 1e6)
        self._stats.add(lookup_us=lookup_us)
        self._stats.sample("lookup_seconds", lookup_us / 1e6)
        self.totals.add(lookup_us=lookup_us)

    def _loads_in_background(self, tiers: list[ChunkLocation], num_computed: int) -> bool:
        """Whether a load of the chunks past ``num_computed`` goes to the background."""
        if self.num_groups > 1:
            return True
        if self.settings.load != "auto":
            return self.settings.load == "async"
        end = 0
        for location in tiers:
            end += location.tokens
            if end > num_computed and location.medium != FAST_MEDIUM:
                return True
        return False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        self._answered.pop(request.request_id, None)  # if vLLM preempts it, its next ask looks up anew
        lookup = self._lookups.get(request.request_id)
        if lookup is None:
            return
        # Admitted: its lookup counts now, once, however many times vLLM asked (lookup_result.py).
        counts = lookup.counts()
        self._stats.add(**counts)
        self.totals.add(**counts)
        lookup.num_external = num_external_tokens
        if lookup.background and num_external_tokens > 0:
            # The request waits in WAITING_FOR_REMOTE_KVS: it is not scheduled this step,
            # so its load goes into the next metadata from here, with these blocks.
            lookup.block_ids = list(blocks.get_block_ids()[0])
            if self.num_groups > 1:
                lookup.group_block_ids = [list(ids) for ids in blocks.get_block_ids()]
            self._background[request.request_id] = self._lookups.pop(request.request_id)

    def request_info(self, request: Any, *, with_overrides: bool = True) -> RequestInfo:
        return request_info(request, self.config, with_overrides=with_overrides)

    # --- per step -----------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVPlugConnectorMetadata:
        meta = KVPlugConnectorMetadata(idle=scheduler_output.total_num_scheduled_tokens == 0)
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        #: Recurrent states vLLM hands over this step (align mode): request -> (group, block, boundary).
        states = dict(getattr(block_state, "boundary_state_offloads", None) or {}) if self.state_groups else {}
        if meta.idle and self._pool is not None:
            self._pool.wait_any(IDLE_WAIT_S)  # nothing runs: a busy loop would take the lookups' CPU
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        for req_id, lookup in self._background.items():
            request = self._requests[req_id]
            meta.requests.append(
                RequestMeta(
                    req_id=req_id,
                    token_ids=list(request.all_token_ids[: lookup.num_hit]),
                    block_ids=lookup.block_ids,
                    group_block_ids=lookup.group_block_ids,
                    **_isolation(self.request_info(request, with_overrides=False)),
                    load=LoadSpec(
                        lookup.num_computed,
                        lookup.num_hit,
                        lookup.num_external,
                        background=True,
                        chunk_hashes=lookup.chunk_hashes(),
                    ),
                    block_hashes=self._block_hashes(request, lookup.num_hit),
                )
            )
            self._background_hits[req_id] = lookup
        self._background.clear()
        for new in scheduler_output.scheduled_new_reqs:
            request = self._requests.get(new.req_id)
            if request is None or new.prompt_token_ids is None:
                continue
            try:
                info = self.request_info(request)
            except ConfigError:
                info = self.request_info(request, with_overrides=False)
            tracker = _Tracker(
                request, info, list(new.block_ids[0]), len(new.prompt_token_ids), overrides=dict(info.overrides)
            )
            if self.num_groups > 1:
                tracker.group_block_ids = [list(ids) for ids in new.block_ids]
            self._trackers[new.req_id] = tracker
            loaded = self._background_hits.pop(new.req_id, None)
            if loaded is not None:  # its KV arrived in the background (or failed and is recomputed)
                tracker.hit_tokens, tracker.external_tokens = loaded.new_hit, loaded.num_external
                tracker.vllm_cached_tokens = loaded.vllm_cached
                tracker.num_saved = min(loaded.num_hit, new.num_computed_tokens) // self.chunk_size * self.chunk_size
            failed = self._failed_loads.pop(new.req_id, None)
            if failed is not None:  # the report still says what the lookup found; nothing was loaded
                tracker.hit_tokens, tracker.vllm_cached_tokens = failed.new_hit, failed.vllm_cached
            end = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            load = self._take_load(new.req_id, tracker)
            self._add(meta, new.req_id, tracker, end, load, states.get(new.req_id, ()))
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            running = self._trackers.get(req_id)
            if running is None:
                continue
            tracker = running
            new_blocks = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:
                tracker.block_ids = list(new_blocks[0]) if new_blocks else []
                if self.num_groups > 1:
                    tracker.group_block_ids = [list(ids) for ids in new_blocks] if new_blocks else []
            elif new_blocks:
                tracker.block_ids.extend(new_blocks[0])
                for ids, added in zip(tracker.group_block_ids, new_blocks):
                    ids.extend(added)
            computed = cached.num_computed_tokens[index]
            if computed < tracker.num_computed:  # preempted, or rolled back after a failed load
                tracker.num_saved = min(tracker.num_saved, computed // self.chunk_size * self.chunk_size)
            end = computed + scheduler_output.num_scheduled_tokens[req_id]
            self._add(meta, req_id, tracker, end, self._take_load(req_id, tracker), states.get(req_id, ()))
        return meta

    def _take_load(self, req_id: str, tracker: _Tracker) -> LoadSpec | None:
        lookup = self._lookups.pop(req_id, None)
        if lookup is None:
            return None
        tracker.hit_tokens, tracker.vllm_cached_tokens = lookup.new_hit, lookup.vllm_cached
        tracker.num_saved = max(tracker.num_saved, lookup.num_hit)
        if lookup.num_external <= 0:
            return None
        tracker.external_tokens += lookup.num_external
        return LoadSpec(lookup.num_computed, lookup.num_hit, lookup.num_external, chunk_hashes=lookup.chunk_hashes())

    def _add(
        self,
        meta: KVPlugConnectorMetadata,
        req_id: str,
        tracker: _Tracker,
        end: int,
        load: LoadSpec | None,
        handed: Sequence[tuple[int, int, int]] = (),
    ) -> None:
        """Add the request to the step's metadata if it loads or stores anything."""
        tracker.num_computed = end
        save_start, save_end = tracker.num_saved, self._save_end(tracker, end)
        saving = save_end > save_start
        if saving:
            tracker.num_saved = save_end
        # A state at a chunk end kvplug stores chunks up to: vLLM hands over a state in the step
        # that computes its boundary (boundary <= end), so save_end bounds the states as well.
        states = [(g, b, n) for g, b, n in handed if n % self.chunk_size == 0 and 0 < n <= save_end]
        if not saving and load is None and not states:
            return
        stored_to = max(save_end if saving else 0, *(n for _, _, n in states), 0)
        tokens = tracker.request.all_token_ids[: max(stored_to, load.num_hit if load else 0)]
        meta.requests.append(
            RequestMeta(
                req_id=req_id,
                token_ids=list(tokens),
                block_ids=list(tracker.block_ids),
                group_block_ids=[list(ids) for ids in tracker.group_block_ids],
                cache_salt=tracker.info.cache_salt,
                lora_id=tracker.info.lora_id,
                extra_keys=[(k.start, k.end, k.value) for k in tracker.info.extra_keys],
                overrides=dict(tracker.overrides),
                load=load,
                save_start=save_start // self.chunk_size * self.chunk_size if saving else 0,
                save_end=save_end if saving else 0,
                block_hashes=self._block_hashes(tracker.request, len(tokens)),
                state_blocks=[(int(g), int(b), int(n)) for g, b, n in states],
            )
        )

    def _save_end(self, tracker: _Tracker, end: int) -> int:
        """How many leading tokens should be stored once this step's KV exists."""
        config = self.config.with_overrides(tracker.overrides) if tracker.overrides else self.config
        if not self.can_save or config.skip_save:
            return 0
        if end > tracker.prompt_len and not self.settings.save_decode_cache:
            end = tracker.prompt_len  # decode tokens are not stored
        if end == tracker.prompt_len and config.save_unfull_chunk:
            return end
        return end // self.chunk_size * self.chunk_size

    # --- outputs ------------------------------------------------------------------------

    def _block_hashes(self, request: Any, num_tokens: int) -> list[Any]:
        """vLLM's hashes of the full blocks of the first ``num_tokens``, as its KV events publish them."""
        if not self.publish_events:
            return []
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        # vLLM hashes in units of its hash block size; kvplug's events are per KV block.
        hashes = list(request.block_hashes)[: num_tokens // self.block_size]
        return [maybe_convert_block_hash(h) for h in hashes]

    def update_connector_output(self, connector_output: Any) -> None:
        stats = connector_output.kv_connector_stats
        if stats is not None:
            self.totals.aggregate(stats, counts_only=True)
        events = connector_output.kv_cache_events
        if isinstance(events, KVPlugKVEvents):
            if self._events is None:
                self._events = events
            else:
                self._events.add_events(events.get_all_events())
                self._events.increment_workers(events.get_number_of_workers())

    def take_events(self) -> Iterable[Any]:
        """kvplug's BlockStored/BlockRemoved events from the workers, for vLLM's publisher."""
        if self._events is None:
            return
        events, self._events = self._events, None
        yield from events.aggregate().get_all_events()

    def reset_cache(self) -> bool:
        """Remove this engine's chunks from the ``reset_tiers`` tiers (vLLM's reset_prefix_cache)."""
        try:
            removed = self._lookup_channel().reset()
        except KVPlugError as exc:
            logger.warning("reset_cache failed: %s", exc)
            return False
        which = self.settings.reset_tiers if self.settings.reset_tiers is not None else "of medium memory"
        logger.info("reset_cache: removed %d chunks from kvplug tiers %s", removed, which)
        return True

    def get_kv_connector_stats(self) -> KVPlugConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVPlugConnectorStats()
        return stats

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tracker = self._trackers.get(request.request_id)
        report = None
        if wants_report(request.kv_transfer_params):
            report = {
                "kvplug": {
                    "hit_tokens": tracker.hit_tokens if tracker else 0,
                    "vllm_cached_tokens": tracker.vllm_cached_tokens if tracker else 0,
                    "external_tokens": tracker.external_tokens if tracker else 0,
                    "totals": self.totals.reduce(),
                }
            }
        self._forget(request.request_id)
        return False, report

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _forget(self, req_id: str) -> None:
        self._trackers.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._lookups.pop(req_id, None)
        self._background.pop(req_id, None)
        self._background_hits.pop(req_id, None)
        self._failed_loads.pop(req_id, None)
        self._answered.pop(req_id, None)
        if self._pool is not None:
            self._pool.discard(req_id)

    def _lookup_channel(self) -> DirectLookup | SocketLookup:
        if self._channel is None:
            engine_id, dp_rank, _ = self.engine_key
            keys = [(engine_id, dp_rank, rank) for rank in range(self.tp_size)]
            found = [local_worker(key) for key in keys]
            workers = [w for w in found if w is not None]
            mode = self.settings.lookup
            if mode == "direct" or (mode == "auto" and len(workers) == len(keys)):
                if len(workers) < len(keys):
                    raise KVPlugError("lookup: direct, but the worker's cache engine is not in this process")
                self._channel = DirectLookup(
                    [w.engine for w in workers],
                    [w.reset for w in workers],
                    trims=[w.trim for w in workers],
                )
            else:
                self._channel = SocketLookup([socket_path(*key) for key in keys], self.settings.lookup_timeout_s)
            logger.info(
                "kvplug lookups go %s",
                "directly to the worker's engine"
                if isinstance(self._channel, DirectLookup)
                else "over the worker's lookup socket",
            )
        return self._channel


def _isolation(info: RequestInfo) -> dict[str, Any]:
    """The RequestMeta fields that key a request's chunks."""
    return dict(
        cache_salt=info.cache_salt,
        lora_id=info.lora_id,
        extra_keys=[(k.start, k.end, k.value) for k in info.extra_keys],
    )
