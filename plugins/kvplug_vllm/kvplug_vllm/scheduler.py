"""Scheduler side of the connector: lookups, and what each step loads and stores.

Semantics follow LMCache's vLLM v1 adapter:

- ``get_num_new_matched_tokens`` asks the worker's cache engine for the cached
  prefix (whole chunks, or the full prompt). vLLM must compute at least one token
  to sample from, so a full-prompt hit still leaves the last token to recompute.
  With ``background_lookups`` a lookup the tiers answering inline (memory, local
  files: ``StorageTier.inline_lookups``) cannot answer alone runs off the scheduler
  thread (:mod:`kvplug_vllm.scheduler_lookups`): the answer is ``None`` ("ask again next
  step") until it is done, and vLLM schedules other requests.
- Each step, what the scheduled requests load and store goes to the workers as the
  step's metadata (:mod:`kvplug_vllm.scheduler_steps`).

Each request has one :class:`~kvplug_vllm.request_state.RequestState`, with its phase.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kvplug import KVPlugConfig, hit_tokens
from kvplug.errors import KVPlugError
from kvplug_vllm.kv_events import SchedulerEvents
from kvplug_vllm.lookup_pool import LookupPool
from kvplug_vllm.lookup_result import LookupResult
from kvplug_vllm.metadata import KVPlugConnectorMetadata
from kvplug_vllm.plan import background_hit, loads_in_background, tokens_to_load
from kvplug_vllm.prefill_resume import load_refusal
from kvplug_vllm.request_state import Phase, Progress, RequestState, prompt_ids
from kvplug_vllm.scheduler_lookups import SchedulerLookups
from kvplug_vllm.scheduler_steps import SchedulerSteps
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
        refusal = load_refusal(vllm_config)
        if refusal is not None and kv_transfer.is_kv_consumer:
            logger.warning("kvplug loads nothing into this engine: %s", refusal)
        self.can_load = kv_transfer.is_kv_consumer and refusal is None
        #: A model of several KV cache groups loads in the background (plan.loads_in_background).
        self.num_groups = num_kv_cache_groups
        #: Some group keeps recurrent state (state_groups.py): a hit ends at a chunk whose state is
        #: stored, before the prompt's last token (which vLLM computes from the state before it).
        self.state_groups = state_groups
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.block_size = int(vllm_config.cache_config.block_size)
        workers = vllm_config.parallel_config.tensor_parallel_size * self.pp_size
        self.lookups = SchedulerLookups(settings, config, engine_key, workers, self._count_lookup_time)
        #: Every request kvplug was asked about, until it finishes.
        self._states: dict[str, RequestState] = {}
        self._stats = KVPlugConnectorStats()
        self.events = SchedulerEvents(vllm_config)
        self.steps = SchedulerSteps(
            settings,
            self.events,
            chunk_size=config.chunk_size,
            block_size=self.block_size,
            num_groups=num_kv_cache_groups,
            can_save=kv_transfer.is_kv_producer,
            state_groups=state_groups,
        )
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
        if scheduler_output.total_num_scheduled_tokens == 0:
            self.lookups.wait_any(IDLE_WAIT_S)  # nothing runs: a busy loop would take the lookups' CPU
        return self.steps.build(scheduler_output, self._states)

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
