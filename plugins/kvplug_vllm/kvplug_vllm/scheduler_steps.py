"""The scheduler side's steps: what each scheduled request loads and stores, as the step's metadata.

Each step vLLM schedules a request, the tokens whose KV will exist after the step are known;
their whole chunks not stored yet are stored (:mod:`kvplug_vllm.plan`). A load the request's
lookup promised goes into the step that schedules it (the worker writes the cached blocks
before the forward pass, or layer by layer inside it); a background load goes into the step
after vLLM allocated its blocks, and what it brought is counted when vLLM schedules the
request. If a load fails, vLLM rolls the request back to the first bad block and recomputes;
a request whose computed count went backwards re-stores from there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvplug_vllm.kv_events import SchedulerEvents
from kvplug_vllm.metadata import KVPlugConnectorMetadata, LoadSpec, RequestMeta
from kvplug_vllm.plan import SaveRules, plan_step, rolled_back, saved_after_background_load
from kvplug_vllm.request_state import Phase, Progress, RequestState, isolation
from kvplug_vllm.settings import ConnectorSettings


class SchedulerSteps:
    """Builds one scheduler's per-step metadata from vLLM's ``SchedulerOutput``."""

    def __init__(
        self,
        settings: ConnectorSettings,
        events: SchedulerEvents,
        *,
        chunk_size: int,
        block_size: int,
        num_groups: int,
        can_save: bool,
        state_groups: bool,
    ) -> None:
        self.settings = settings
        self.events = events
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.num_groups = num_groups
        self.can_save = can_save
        self.state_groups = state_groups

    def build(self, scheduler_output: Any, states: Mapping[str, RequestState]) -> KVPlugConnectorMetadata:
        """The step's metadata; ``states`` are the scheduler's requests, by id."""
        meta = KVPlugConnectorMetadata(idle=scheduler_output.total_num_scheduled_tokens == 0)
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        #: Recurrent states vLLM hands over this step (align mode): request -> (group, block, boundary).
        handed = dict(getattr(block_state, "boundary_state_offloads", None) or {}) if self.state_groups else {}
        # A finished request was forgotten when vLLM called request_finished, at once: by now its
        # id may name a new request (vLLM without request id randomization), whose state this is.
        # The workers forget theirs before this step's loads, for the same reason.
        meta.finished_req_ids = sorted(scheduler_output.finished_req_ids)
        for queued in states.values():
            if queued.phase is Phase.LOAD_QUEUED:
                meta.requests.append(self._background_load(queued))
                queued.phase = Phase.LOADING
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = states.get(new.req_id)
            if state is None or state.request is None:
                continue
            self._start_progress(state, new)
            start = new.num_computed_tokens
            self._add(meta, state, start, start + scheduled[new.req_id], handed.get(new.req_id, ()))
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            state = states.get(req_id)
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
