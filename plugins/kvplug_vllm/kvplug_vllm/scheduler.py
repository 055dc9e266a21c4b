"""Scheduler side of the connector: lookups, and what each step loads and stores.

Semantics follow LMCache's vLLM v1 adapter:

- ``get_num_new_matched_tokens`` asks the worker's cache engine for the cached
  prefix (whole chunks, or the full prompt). vLLM must compute at least one token
  to sample from, so a full-prompt hit still leaves the last token to recompute.
  With ``background_lookups`` a lookup the tiers answering inline (memory, local
  files: ``StorageTier.inline_lookups``) cannot answer alone runs off the scheduler
  thread (:mod:`kvplug_vllm.scheduler_lookups`): the answer is ``None`` ("ask again next
  step") until it is done, and vLLM schedules other requests.
- Each step a request is scheduled, the tokens whose KV will exist after the step
  are known; their whole chunks not stored yet are stored (:mod:`kvplug_vllm.plan`).
  Loads are synchronous unless they go to the background: the worker writes the
  cached blocks before the forward pass (or layer by layer inside it).
- If a load fails, vLLM rolls the request back to the first bad block and
  recomputes; a request whose computed count went backwards re-stores from there.

Each request has one :class:`~kvplug_vllm.request_state.RequestState`, with its phase.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from kvplug import KVPlugConfig, hit_tokens
from kvplug.errors import KVPlugError
from kvplug_vllm.kv_events import SchedulerEvents
from kvplug_vllm.lookup_pool import LookupPool
from kvplug_vllm.lookup_result import LookupResult
from kvplug_vllm.metadata import KVPlugConnectorMetadata, LoadSpec, RequestMeta
from kvplug_vllm.plan import (
    SaveRules,
    background_hit,
    loads_in_background,
    plan_step,
    rolled_back,
    saved_after_background_load,
    tokens_to_load,
)
from kvplug_vllm.prefill_resume import load_refusal
from kvplug_vllm.request_state import Phase, Progress, RequestState, isolation, prompt_ids
from kvplug_vllm.scheduler_lookups import SchedulerLookups
from kvplug_vllm.settings import ConnectorSettings, wants_report
from kvplug_vllm.stats import KVPlugConnectorStats

logger = logging.getLogger("kvplug.vllm")

#: How long an idle scheduler step waits for a background lookup, rather than spin.
IDLE_WAIT_S = 0.01


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
        refusal = load_refusal(vllm_config)
        if refusal is not None and kv_transfer.is_kv_consumer:
            logger.warning("kvplug loads nothing into this engine: %s", refusal)
        self.can_load = kv_transfer.is_kv_consumer and refusal is None
        self.can_save = kv_transfer.is_kv_producer
        self.engine_key = engine_key
        #: A model of several KV cache groups loads in the background (plan.loads_in_background).
        self.num_groups = num_kv_cache_groups
        #: Some group keeps recurrent state (state_groups.py): a hit ends at a chunk whose state is
        #: stored, before the prompt's last token (which vLLM computes from the state before it).
        self.state_groups = state_groups
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.block_size = int(vllm_config.cache_config.block_size)
        workers = self.tp_size * self.pp_size
        self.lookups = SchedulerLookups(settings, config, engine_key, workers, self._count_lookup_time)
        #: Every request kvplug was asked about, until it finishes.
        self._states: dict[str, RequestState] = {}
        self._stats = KVPlugConnectorStats()
        self.events = SchedulerEvents(vllm_config)
        #: Worker and scheduler counters since start, for per-request reports.
        self.totals = KVPlugConnectorStats()

    @property
    def _pool(self) -> LookupPool | None:
        return self.lookups.pool

    def _state(self, request: Any) -> RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = RequestState.of(request, self.config)
        state.follow(request)
        return state

    # --- lookups ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        state.lookup = None
        if not self.can_load:
            return 0, False
        tokens = prompt_ids(request)
        if state.phase in (Phase.LOADING, Phase.LOAD_FAILED):
            # Its background load failed or ran past load_timeout_s and vLLM rolled it back to
            # nothing: trying the same slow tier again could fail the same way, forever. vLLM
            # asks again each step until it has blocks for the prompt: the answer stays.
            if state.phase is Phase.LOADING:
                logger.info("request %s: its background load failed; vLLM computes the prompt", request.request_id)
            state.phase = Phase.LOAD_FAILED
            return 0, False
        if self.settings.skip_last_n_tokens:
            tokens = tokens[: max(0, len(tokens) - self.settings.skip_last_n_tokens)]
        if self.state_groups:
            # vLLM computes the last token whatever the hit, and resumes a recurrent state only
            # where one is stored: the hit must be a chunk end with a state before that token.
            tokens = tokens[:-1]
        tiers = self.lookups.find(state, tokens)
        if tiers is None:
            state.phase = Phase.LOOKING_UP
            return None, False  # its lookup runs in the background: vLLM asks again next step
        hit = hit_tokens(tiers)
        need = tokens_to_load(hit, num_computed_tokens, request.num_tokens)
        background = need > 0 and loads_in_background(
            tiers,
            num_computed_tokens,
            load=self.settings.load,
            num_groups=self.num_groups,
            pipeline_stages=self.pp_size,
        )
        if background:
            tiers = background_hit(tiers, num_computed_tokens, request.num_tokens, self.block_size)
            hit = hit_tokens(tiers)
            need = tokens_to_load(hit, num_computed_tokens, request.num_tokens)
            background = need > 0
        lookup = LookupResult(num_computed_tokens, hit, tiers, request.num_prompt_tokens, background=background)
        state.lookup, state.phase = lookup, Phase.LOOKED_UP
        logger.info(
            "request %s: %d prompt tokens, %d cached by kvplug (%s), %d in vLLM's own prefix cache, loading %d%s",
            request.request_id, request.num_prompt_tokens, hit, lookup.describe(), num_computed_tokens,
            need, " in the background" if background else "",
        )  # fmt: skip
        return need, background

    def _count_lookup_time(self, seconds: float) -> None:
        lookup_us = int(seconds * 1e6)
        self._stats.add(lookup_us=lookup_us)
        self._stats.sample("lookup_seconds", lookup_us / 1e6)
        self.totals.add(lookup_us=lookup_us)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._state(request)
        state.request = request
        state.answer = None  # if vLLM preempts it, its next ask looks up anew
        lookup = state.lookup
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
            lookup.group_block_ids = [list(ids) for ids in blocks.get_block_ids()]
            state.load, state.lookup, state.phase = lookup, None, Phase.LOAD_QUEUED

    # --- per step -----------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVPlugConnectorMetadata:
        meta = KVPlugConnectorMetadata(idle=scheduler_output.total_num_scheduled_tokens == 0)
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        #: Recurrent states vLLM hands over this step (align mode): request -> (group, block, boundary).
        handed = dict(getattr(block_state, "boundary_state_offloads", None) or {}) if self.state_groups else {}
        if meta.idle:
            self.lookups.wait_any(IDLE_WAIT_S)  # nothing runs: a busy loop would take the lookups' CPU
        # A finished request was forgotten when vLLM called request_finished, at once: by now its
        # id may name a new request (vLLM without request id randomization), whose state this is.
        # The workers forget theirs before this step's loads, for the same reason.
        meta.finished_req_ids = sorted(scheduler_output.finished_req_ids)
        for queued in self._states.values():
            if queued.phase is Phase.LOAD_QUEUED:
                meta.requests.append(self._background_load(queued))
                queued.phase = Phase.LOADING
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._states.get(new.req_id)
            if state is None or state.request is None:
                continue
            self._start_progress(state, new)
            start = new.num_computed_tokens
            self._add(meta, state, start, start + scheduled[new.req_id], handed.get(new.req_id, ()))
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            state = self._states.get(req_id)
            if state is None or state.progress is None:
                continue
            progress = state.progress
            new_blocks = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:
                progress.blocks = [list(ids) for ids in new_blocks] if new_blocks else []
            elif new_blocks:
                if not progress.blocks:
                    progress.blocks = [[] for _ in new_blocks]
                for ids, added in zip(progress.blocks, new_blocks):
                    ids.extend(added)
            computed = cached.num_computed_tokens[index]
            if computed < progress.num_computed:  # preempted, or rolled back after a failed load
                progress.num_saved = rolled_back(progress.num_saved, computed, self.chunk_size)
                progress.rollbacks += 1
            self._take_background_load(state, computed)  # one vLLM preempted resumes as a cached request
            self._add(meta, state, computed, computed + scheduled[req_id], handed.get(req_id, ()))
        return meta

    def _start_progress(self, state: RequestState, new: Any) -> None:
        """A newly scheduled request's progress, from its blocks and its background load."""
        previous, progress = state.progress, Progress(new.prompt_len, [list(ids) for ids in new.block_ids])
        if previous is not None:  # preempted, and resumed as a new request (vLLM's v2 model runner)
            progress.rollbacks = previous.rollbacks + 1
        state.progress = progress
        self._take_background_load(state, new.num_computed_tokens)

    def _take_background_load(self, state: RequestState, num_computed: int) -> None:
        """What the request's background load brought (or failed to bring), in its progress, as
        vLLM schedules it with ``num_computed`` tokens: counted as a synchronous load's would be."""
        loaded, state.load, progress = state.load, None, state.progress
        if loaded is None or progress is None:
            return
        progress.hit_tokens, progress.vllm_cached_tokens = loaded.new_hit, loaded.vllm_cached
        if state.phase is Phase.LOADING:  # its KV arrived (else: LOAD_FAILED, nothing was loaded)
            progress.external_tokens += loaded.num_external
            promised_end = loaded.num_computed + loaded.num_external
            saved = saved_after_background_load(loaded.num_hit, promised_end, num_computed, self.chunk_size)
            progress.num_saved = max(progress.num_saved, saved)

    def _background_load(self, state: RequestState) -> RequestMeta:
        """The metadata of a background load allocated last step."""
        load = state.load
        assert load is not None
        request = state.request
        return RequestMeta(
            req_id=state.req_id,
            token_ids=list(request.all_token_ids[: load.num_hit]),
            block_ids=load.group_block_ids[0] if load.group_block_ids else [],
            group_block_ids=load.group_block_ids if self.num_groups > 1 else [],
            **isolation(state.info),
            load=LoadSpec(
                load.num_computed,
                load.num_hit,
                load.num_external,
                background=True,
                chunk_hashes=load.chunk_hashes(),
            ),
            block_hashes=self.events.block_hashes(request, load.num_hit),
        )

    def _take_load(self, state: RequestState) -> LoadSpec | None:
        """The load the request's latest lookup promised vLLM, if any, taken into this step."""
        lookup, state.lookup = state.lookup, None
        progress = state.progress
        assert progress is not None
        state.phase = Phase.RUNNING
        if lookup is None:
            return None
        progress.hit_tokens, progress.vllm_cached_tokens = lookup.new_hit, lookup.vllm_cached
        progress.num_saved = max(progress.num_saved, lookup.num_hit)
        if lookup.num_external <= 0:
            return None
        progress.external_tokens += lookup.num_external
        return LoadSpec(lookup.num_computed, lookup.num_hit, lookup.num_external, chunk_hashes=lookup.chunk_hashes())

    def _add(
        self,
        meta: KVPlugConnectorMetadata,
        state: RequestState,
        start: int,
        end: int,
        handed: Sequence[tuple[int, int, int]] = (),
    ) -> None:
        """Add the request to the step's metadata if it loads (:meth:`_take_load`) or stores
        anything (the step computes its tokens ``[start, end)``)."""
        load = self._take_load(state)
        progress = state.progress
        assert progress is not None
        progress.num_computed = end
        state.follow(state.request)  # a session's next turn is scheduled without a new lookup
        rules = SaveRules(
            self.chunk_size,
            can_save=self.can_save and not state.config.skip_save,
            save_unfull_chunk=state.config.save_unfull_chunk,
            save_tail=state.config.block_granular_hits,
            save_decode_cache=self.settings.save_decode_cache,
        )
        # Async scheduling: the token sampled last step is still in flight (not in all_token_ids),
        # and a chunk is keyed by its ids: what it ends is stored once the id is known.
        known = min(end, len(state.request.all_token_ids))
        plan = plan_step(progress.num_saved, known, progress.prompt_len, rules, handed)
        progress.num_saved = plan.num_saved
        if not plan.saving and load is None and not plan.states:
            # Still what the step computes: it may be a block whose load failed, computed again.
            blocks = progress.blocks[0] if progress.blocks else []
            meta.computed_blocks += blocks[start // self.block_size : -(-end // self.block_size)]
            return
        tokens = state.request.all_token_ids[: max(plan.stored_to, load.num_hit if load else 0)]
        meta.requests.append(
            RequestMeta(
                req_id=state.req_id,
                token_ids=list(tokens),
                block_ids=list(progress.blocks[0]) if progress.blocks else [],
                group_block_ids=[list(ids) for ids in progress.blocks] if self.num_groups > 1 else [],
                **isolation(state.info),
                overrides=dict(state.info.overrides),
                load=load,
                save_start=plan.save_start,
                save_end=plan.save_end,
                block_hashes=self.events.block_hashes(state.request, len(tokens)),
                state_blocks=[(int(g), int(b), int(n)) for g, b, n in plan.states],
                epoch=progress.rollbacks,
                computes=(start, end),
            )
        )

    # --- outputs ------------------------------------------------------------------------

    def update_connector_output(self, connector_output: Any) -> None:
        stats = connector_output.kv_connector_stats
        if stats is not None:
            self.totals.aggregate(stats, counts_only=True)
        self.events.add(connector_output.kv_cache_events)

    def take_events(self) -> Iterable[Any]:
        """kvplug's BlockStored/BlockRemoved events from the workers, for vLLM's publisher."""
        return self.events.take()

    def reset_cache(self) -> bool:
        """Remove this engine's chunks from the ``reset_tiers`` tiers (vLLM's reset_prefix_cache)."""
        try:
            removed = self.lookups.channel().reset()
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
        state = self._states.get(request.request_id)
        report = None
        if wants_report(request.kv_transfer_params):
            progress = state.progress if state is not None else None
            counts = progress.report() if progress is not None else Progress(0, []).report()
            report = {"kvplug": {**counts, "totals": self.totals.reduce()}}
        self._forget(request.request_id)
        return False, report

    def shutdown(self) -> None:
        self.lookups.close()

    def _forget(self, req_id: str) -> None:
        self._states.pop(req_id, None)
        self.lookups.discard(req_id)
