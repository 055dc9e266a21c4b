"""The scheduler side's chunk arithmetic (``kvplug_vllm.plan``), on its own: what a lookup
lets vLLM skip, what each step stores, and where a request that went back stores again."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvplug import ChunkLocation
from kvplug_vllm.plan import (
    SaveRules,
    background_hit,
    loads_in_background,
    plan_step,
    promised_blocks,
    rolled_back,
    save_end,
    saved_after_background_load,
    tokens_to_load,
    whole_chunks,
)

CHUNK = 64

chunk_sizes = st.sampled_from([1, 16, 64, 256])


@st.composite
def prefills(draw: st.DrawFn) -> tuple[int, int, list[int], int]:
    """(chunk size, prompt length, tokens scheduled per step, tokens stored before the first step)."""
    chunk = draw(chunk_sizes)
    prompt = draw(st.integers(1, 2000))
    steps = draw(st.lists(st.integers(1, 700), min_size=1, max_size=12))
    hit = draw(st.integers(0, prompt))
    return chunk, prompt, steps, hit


@given(prefills(), st.booleans())
def test_planned_stores_cover_exactly_the_whole_chunks_computed(
    case: tuple[int, int, list[int], int], decode: bool
) -> None:
    """Step by step, the stores never reach past the tokens computed, start at a chunk start,
    and in the end cover every whole chunk computed past the hit, each chunk once."""
    chunk, prompt, steps, hit = case
    rules = SaveRules(chunk, save_decode_cache=decode)
    saved, computed, stored = hit, 0, set[int]()
    for scheduled in steps:
        computed += scheduled
        plan = plan_step(saved, computed, prompt, rules)
        assert plan.save_end <= computed and plan.stored_to <= computed
        assert plan.num_saved >= saved
        if plan.saving:
            assert plan.save_start % chunk == 0 and plan.save_end % chunk == 0
            chunks = set(range(plan.save_start // chunk, plan.save_end // chunk))
            assert not chunks & stored, "a whole chunk stored twice"
            stored |= chunks
        else:
            assert (plan.save_start, plan.save_end) == (0, 0)
        saved = plan.num_saved
    limit = computed if decode else min(computed, prompt)
    expected = set(range(whole_chunks(hit, chunk) // chunk, whole_chunks(limit, chunk) // chunk))
    assert stored == expected


@given(prefills(), st.sampled_from(["save_unfull_chunk", "save_tail"]))
def test_the_partial_last_chunk_is_stored_once_and_again_whole_never(
    case: tuple[int, int, list[int], int], setting: str
) -> None:
    """With save_unfull_chunk (or block_granular_hits, whose tail the cache engine cuts at a
    block end) the prompt's tail is stored when the prompt is done, never past it."""
    chunk, prompt, steps, _ = case
    rules = SaveRules(chunk, **{setting: True})
    saved, computed, ends = 0, 0, []
    for scheduled in steps:
        computed += scheduled
        plan = plan_step(saved, computed, prompt, rules)
        assert plan.save_end <= min(computed, prompt)
        if plan.saving:
            ends.append(plan.save_end)
        saved = plan.num_saved
    if computed >= prompt:
        assert ends[-1] == prompt
    assert ends == sorted(set(ends))


@given(chunk_sizes, st.integers(0, 5000), st.integers(0, 5000), st.booleans(), st.booleans())
def test_nothing_is_stored_where_saving_is_off(chunk: int, saved: int, end: int, unfull: bool, decode: bool) -> None:
    rules = SaveRules(chunk, can_save=False, save_unfull_chunk=unfull, save_decode_cache=decode)
    assert save_end(end, max(end, 1), rules) == 0
    plan = plan_step(saved, end, max(end, 1), rules, [(1, 7, chunk)])
    assert not plan.saving and plan.states == () and plan.num_saved == saved


@given(st.integers(0, 4000), st.integers(0, 4000), st.integers(1, 4000))
def test_a_load_never_exceeds_the_hit_nor_takes_the_last_token(hit: int, computed: int, num_tokens: int) -> None:
    hit, computed = min(hit, num_tokens), min(computed, num_tokens)
    need = tokens_to_load(hit, computed, num_tokens)
    assert need >= 0
    if need:
        assert computed + need <= hit and computed + need < num_tokens
        assert computed + need == (hit - 1 if hit == num_tokens else hit)


@given(chunk_sizes, st.integers(0, 4000), st.integers(0, 4000))
def test_a_request_that_went_back_stores_again_from_a_chunk_start_not_past_it(
    chunk: int, saved: int, computed: int
) -> None:
    after = rolled_back(saved, computed, chunk)
    assert after <= saved and after <= computed
    assert after == saved or after % chunk == 0
    # a load that failed (vLLM computed less than it was promised): whole chunks before the failure
    loaded = saved_after_background_load(saved, computed + 1, computed, chunk)
    assert loaded % chunk == 0 and loaded <= min(saved, computed)


def test_handed_states_are_kept_only_at_stored_chunk_ends() -> None:
    rules = SaveRules(CHUNK)
    handed = [(1, 5, 64), (1, 6, 96), (1, 7, 128), (1, 8, 192), (1, 9, 0)]
    plan = plan_step(0, 150, 1000, rules, handed)
    assert (plan.save_start, plan.save_end, plan.num_saved) == (0, 128, 128)
    assert plan.states == ((1, 5, 64), (1, 7, 128))
    # nothing new to store: the states up to what is stored still go
    again = plan_step(128, 150, 1000, rules, [(1, 7, 128)])
    assert not again.saving and again.states == ((1, 7, 128),) and again.stored_to == 128


def test_a_partial_chunk_stored_earlier_is_stored_again_from_its_chunk_start() -> None:
    # 100 tokens stored (a full-prompt hit or save_unfull_chunk): the chunk [64, 128) is stored whole now
    plan = plan_step(100, 200, 300, SaveRules(CHUNK))
    assert (plan.save_start, plan.save_end, plan.num_saved) == (64, 192, 192)


def test_a_full_prompt_hit_leaves_the_last_token_to_vllm() -> None:
    assert tokens_to_load(256, 0, 256) == 255
    assert tokens_to_load(256, 0, 300) == 256
    assert tokens_to_load(128, 200, 300) == 0  # vLLM's own prefix cache had more


def test_loads_go_to_the_background_by_the_medium_of_the_chunks_past_vllms_own() -> None:
    cpu, s3 = ChunkLocation("memory", "cpu", 64), ChunkLocation("remote", "s3", 64)
    tiers = [cpu, cpu, s3]
    assert loads_in_background(tiers, 0, load="auto", num_groups=1)
    assert not loads_in_background(tiers[:2], 0, load="auto", num_groups=1)
    assert not loads_in_background([s3, cpu], 64, load="auto", num_groups=1)
    assert not loads_in_background(tiers, 0, load="sync", num_groups=1)
    assert loads_in_background(tiers[:2], 0, load="async", num_groups=1)
    assert loads_in_background(tiers[:2], 0, load="sync", num_groups=2)  # several groups: by request
    # pipeline stages: a failed synchronous load on one stage would spoil what the next ones store
    assert loads_in_background(tiers[:2], 0, load="sync", num_groups=1, pipeline_stages=2)
    assert not loads_in_background(tiers[:2], 0, load="sync", num_groups=1, pipeline_stages=1)


@given(st.sampled_from([1, 16, 32]), st.integers(0, 2000), st.integers(0, 2000), st.integers(0, 2000))
def test_the_promised_blocks_cover_the_loaded_tokens_from_the_first_real_block(
    block_size: int, computed: int, external: int, first_real: int
) -> None:
    first_real = first_real // block_size * block_size  # a null block prefix is whole blocks
    start, end = max(computed, first_real), computed + external
    blocks = promised_blocks(computed, external, first_real, block_size)
    covered = [token for _, lo, hi in blocks for token in range(lo, hi)]
    assert covered == list(range(start, end))
    assert all(block * block_size <= lo < hi <= (block + 1) * block_size for block, lo, hi in blocks)


@given(
    st.sampled_from([1, 16, 32, 64]),
    st.sampled_from([16, 17, 48, 64, 100, 256]),
    st.integers(1, 600),
    st.integers(0, 600),
)
def test_a_background_hit_fits_the_blocks_vllm_allocates_for_its_promise(
    block: int, chunk: int, prompt: int, computed: int
) -> None:
    # The hit's chunks, the last one partial (save_unfull_chunk); vLLM's own prefix cache is whole blocks.
    sizes = [chunk] * (prompt // chunk) + ([prompt % chunk] if prompt % chunk else [])
    tiers = [ChunkLocation("disk", "disk", size) for size in sizes]
    computed = min(computed, prompt - 1) // block * block
    kept = background_hit(tiers, computed, prompt, block)
    hit = sum(location.tokens for location in kept)
    promised_end = computed + tokens_to_load(hit, computed, prompt)
    assert kept == tiers[: len(kept)]
    if hit > computed:  # the load writes its hit's tokens into the blocks of its promise
        assert -(-hit // block) <= -(-promised_end // block)
    # A chunk is left out only where the whole prompt's hit needs a block vLLM does not allocate.
    assert len(kept) == len(tiers) - ((prompt - 1) % block == 0)
