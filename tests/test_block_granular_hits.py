"""Hits granular to the engine's block (``block_granular_hits``): a prompt's tail past its last
whole chunk is stored cut at a block end, and a longer prompt that starts with it hits it."""

from __future__ import annotations

import pytest
import torch
from core_helpers import LAYOUTS, SGLANG_MHA, VLLM_MLA, random_caches
from hypothesis import given
from hypothesis import strategies as st

from kvplug import CacheEngine, ChunkLocation, Fingerprint, KVLayout, load_config, merge_locations
from kvplug.core.engine.head_shards import HeadShard
from kvplug.core.engine.tails import tail_cut, tail_lengths
from kvplug.core.keys import ExtraKey, KeyBuilder
from kvplug.core.plugins import PluginRegistry
from kvplug.errors import ConfigError

PREFIX = "v1/" + "a" * 32 + "/"


@pytest.fixture
def registry() -> PluginRegistry:
    return PluginRegistry(plugin_filter="cpu,disk")


@given(
    chunk_size=st.integers(1, 24),
    tokens=st.lists(st.integers(0, 2**40), min_size=1, max_size=80),
    cut=st.integers(1, 80),
    extra=st.lists(st.tuples(st.integers(0, 80), st.integers(1, 8), st.text(max_size=4)), max_size=3),
)
def test_a_tail_key_is_the_key_of_the_cut_prompts_last_chunk(chunk_size, tokens, cut, extra) -> None:
    cut = min(cut, len(tokens))
    builder = KeyBuilder(chunk_size=chunk_size)
    extra_keys = [ExtraKey(start, start + n, value) for start, n, value in extra]
    cut_keys = builder.keys(tokens[:cut], PREFIX, extra_keys=extra_keys, include_partial=True)
    whole = builder.keys(tokens, PREFIX, extra_keys=extra_keys)
    index = (cut - 1) // chunk_size
    after = whole[index - 1] if index else None
    (tail,) = builder.tail_keys(tokens, PREFIX, after, [cut - index * chunk_size], extra_keys=extra_keys)
    assert tail == cut_keys[-1]


@given(start=st.integers(0, 500), available=st.integers(1, 300), block_size=st.integers(1, 64))
def test_tail_lengths_end_at_block_ends_inside_what_is_available(start, available, block_size) -> None:
    lengths = tail_lengths(start, available, block_size)
    assert lengths == sorted(lengths, reverse=True)
    assert all(0 < n < available and (start + n) % block_size == 0 for n in lengths)
    missing = [n for n in range(1, available) if (start + n) % block_size == 0 and n not in lengths]
    assert missing == []


@given(num_tokens=st.integers(0, 2000), chunk_size=st.integers(1, 300), block_size=st.integers(1, 64))
def test_a_store_cuts_its_tail_at_the_last_block_end_past_the_last_whole_chunk(
    num_tokens, chunk_size, block_size
) -> None:
    cut = tail_cut(num_tokens, chunk_size, block_size)
    whole = num_tokens // chunk_size * chunk_size
    last_block_end = num_tokens // block_size * block_size
    assert cut == (last_block_end if last_block_end > whole else 0)


def token_kv(layout: KVLayout, caches: list, token: int) -> list[torch.Tensor]:
    """Every layer's KV of the token at slot ``token`` (slots are ``arange`` in these tests)."""
    block, offset = divmod(token, layout.block_size)
    if layout.format is SGLANG_MHA:
        return [t[token] for layer in caches for t in layer]
    if layout.format is VLLM_MLA:
        return [layer[block, offset] for layer in caches]
    return [layer[:, block, offset] for layer in caches]


def same_kv(layout: KVLayout, a: list, b: list, token: int) -> bool:
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(token_kv(layout, a, token), token_kv(layout, b, token))
    )


@pytest.mark.parametrize(
    ("name", "heads_per_record"),
    [("vllm_flash", "auto"), ("vllm_flash", 1), ("vllm_mla", "auto"), ("sglang_mha", "auto")],
)
def test_a_longer_prompt_hits_the_stored_tail_and_loads_exactly_its_kv(
    make_engine, request, name, heads_per_record
) -> None:
    layout = LAYOUTS[name]
    engine = make_engine(layout, chunk_size=16, block_granular_hits=True)
    if heads_per_record == 1:  # one record per KV head: a chunk is held when both are
        config, fingerprint = engine.config, engine.fingerprint
        engine.close()
        heads = HeadShard.for_rank(total_heads=2, tp_rank=0, tp_size=1, heads_per_record=1)
        engine = CacheEngine(config, layout, fingerprint, registry=engine.registry, heads=heads)
        request.addfinalizer(engine.close)
        assert engine.records.count == 2
    source = random_caches(layout, 64, seed=1)
    first = list(range(1000, 1027))  # a whole chunk of 16, then 11 tokens: the tail is cut at 24 (block 4)
    cut = 24 if layout.block_size == 4 else 27
    assert engine.store(first, source, torch.arange(27)) == 16 + cut - 16
    longer = first + list(range(5000, 5013))  # the next round: the first prompt and more
    assert [loc.tokens for loc in engine.locate(longer)] == [16, cut - 16]
    target = random_caches(layout, 64, seed=2)
    loaded = engine.retrieve(longer, target, torch.arange(len(longer)))
    assert loaded.tolist() == [True] * cut + [False] * (len(longer) - cut)
    assert all(same_kv(layout, source, target, t) for t in range(cut))
    assert not any(same_kv(layout, source, target, t) for t in range(cut, len(longer)))
    tail_records = engine.record_keys(engine.chunk_keys(first[:cut])[-1:])
    engine.chain.tiers[0].remove(tail_records[-1:])  # one head's record gone: the tail is not held
    assert engine.lookup(longer) == 16


def test_a_prompt_that_leaves_the_tail_inside_it_hits_the_whole_chunks_only(make_engine) -> None:
    layout = LAYOUTS["vllm_flash"]
    engine = make_engine(layout, chunk_size=16, block_granular_hits=True)
    first = list(range(1000, 1027))
    engine.store(first, random_caches(layout, 64), torch.arange(27))
    # Equal up to token 22, inside the tail [16, 24): the tail's key does not match, and no
    # shorter tail was stored.
    other = first[:22] + list(range(7000, 7010))
    assert engine.lookup(other) == 16
    # Equal up to token 24 and then different: the whole tail hits.
    assert engine.lookup(first[:24] + [7] * 9) == 24
    # A lookup that hits whole chunks throughout asks for no tail.
    assert engine.lookup(first[:16]) == 16


def test_without_the_setting_hits_stay_whole_chunks_and_nothing_more_is_stored(make_engine) -> None:
    layout = LAYOUTS["vllm_flash"]
    engine = make_engine(layout, chunk_size=16)
    first = list(range(1000, 1027))
    assert engine.store(first, random_caches(layout, 64), torch.arange(27)) == 16
    assert engine.lookup([*first, 1, 2, 3]) == 16


def test_a_tail_in_a_slower_tier_is_located_there(make_engine, tmp_path) -> None:
    layout = LAYOUTS["vllm_flash"]
    tiers = [{"type": "cpu", "max_bytes": "64MiB"}, {"type": "disk", "path": str(tmp_path)}]
    engine = make_engine(layout, tiers=tiers, chunk_size=16, block_granular_hits=True)
    first = list(range(1000, 1027))
    engine.store(first, random_caches(layout, 64), torch.arange(27))
    engine.flush()
    cpu, _ = engine.chain.tiers
    tail_key = engine.chunk_keys(first[:24])[-1].key
    cpu.remove([tail_key])
    located = engine.locate([*first, 1, 2, 3, 4, 5])
    assert [(loc.medium, loc.tokens) for loc in located] == [("memory", 16), ("disk", 8)]
    assert located[-1].chunk_hash == tail_key.rpartition("/")[2]


def test_with_save_unfull_chunk_both_the_exact_chunk_and_the_tail_are_stored(make_engine) -> None:
    layout = LAYOUTS["vllm_flash"]
    engine = make_engine(layout, chunk_size=16, block_granular_hits=True, save_unfull_chunk=True)
    first = list(range(1000, 1027))
    assert engine.store(first, random_caches(layout, 64), torch.arange(27)) == 16 + 11 + 8
    assert engine.lookup(first) == 27  # the same prompt: every token
    assert engine.lookup([*first, 3, 4]) == 24  # a longer one: up to the tail's end


def test_ranks_holding_tails_of_different_lengths_share_the_whole_chunks_only() -> None:
    whole, tail_8, tail_4 = (
        ChunkLocation("memory", "cpu", 16),
        ChunkLocation("memory", "cpu", 8),
        ChunkLocation("disk", "disk", 4),
    )
    assert merge_locations([[whole, tail_8], [whole, tail_4]]) == [whole]
    assert merge_locations([[whole, tail_8], [whole, tail_8]]) == [whole, tail_8]
    assert merge_locations([[whole, tail_8], [whole]]) == [whole]


def test_an_inline_lookup_leaves_a_prompt_with_a_partial_chunk_to_the_full_lookup(make_engine) -> None:
    """Its tail may be in a slower tier than those that answer inline: "ask the full lookup"."""
    layout = LAYOUTS["vllm_flash"]
    engine = make_engine(layout, chunk_size=16, block_granular_hits=True)
    first = list(range(1000, 1027))
    engine.store(first, random_caches(layout, 64), torch.arange(27))
    engine.chain.tiers[0].remove([engine.chunk_keys(first[:24])[-1].key])
    assert engine.locate_inline([*first, 1, 2]) is None
    assert engine.lookup([*first, 1, 2]) == 16
    assert engine.locate_inline(first[:16]) == engine.locate(first[:16])  # whole chunks only: answered inline


def test_a_packed_layouts_tail_loads_when_the_prompt_ends_inside_a_block(make_engine) -> None:
    """The partial last chunk of a packed (whole-block) layout cannot be copied when the
    prompt ends inside a block; the retrieve still loads the tail the lookup counted."""
    layout = LAYOUTS["vllm_cpu"]
    engine = make_engine(layout, chunk_size=16, block_granular_hits=True)
    source = random_caches(layout, 16, seed=1)
    first = list(range(1000, 1027))  # a whole chunk, then a tail cut at 24 (block 4)
    engine.store(first, source, torch.arange(27))
    prompt = first[:26]  # ends inside block 6: its partial chunk [16, 26) is not copyable
    assert engine.lookup(prompt) == 24
    target = random_caches(layout, 16, seed=2)
    loaded = engine.retrieve(prompt, target, torch.arange(26))
    assert loaded.tolist() == [True] * 24 + [False] * 2
    assert all(torch.equal(s[:6].view(torch.uint8), t[:6].view(torch.uint8)) for s, t in zip(source, target))
    assert not any(torch.equal(s[6], t[6]) for s, t in zip(source, target))


@pytest.mark.parametrize(
    "added",
    [
        pytest.param([7], id="partial-chunk"),  # 28 tokens: a whole chunk, a partial one of 12, its stored tail 8
        pytest.param([7, 8, 9, 10, 11], id="whole-last-chunk"),  # 32: two whole chunks, the second held as its tail
    ],
)
def test_keys_from_a_lookups_hashes_take_no_stored_tail_for_a_longer_last_chunk(make_engine, added: list[int]) -> None:
    """A lookup of a prompt past a stored tail names the tail's hash (8 tokens) for the prompt's
    last chunk, partial (12) or whole (16): keys rebuilt from those hashes must not name the
    chunk by it, or its load would fail the shape check and remove the tail from every tier."""
    layout = LAYOUTS["vllm_flash"]
    engine = make_engine(layout, chunk_size=16, block_granular_hits=True)
    source = random_caches(layout, 64, seed=1)
    first = list(range(1000, 1027))
    engine.store(first, source, torch.arange(27))
    longer = [*first, *added]
    found = engine.locate(longer)
    assert [loc.tokens for loc in found] == [16, 8]
    keys = engine.chunk_keys(longer, hashes=[loc.chunk_hash for loc in found])
    assert keys == engine.chunk_keys(longer)
    target = random_caches(layout, 64, seed=2)
    loading = engine.retrieve_layerwise(longer, target, torch.arange(len(longer)), keys=keys)
    loading.write_remaining()
    assert loading.num_loaded_tokens == 24
    assert all(same_kv(layout, source, target, t) for t in range(24))
    assert engine.lookup(longer) == 24  # the tail is still stored


def test_a_tail_after_whole_chunks_of_another_tp_size_loads_as_it_was_located(registry, tmp_path) -> None:
    """Whole chunks another TP size's writer stored, then this engine's own tail: the retrieve
    loads what the lookup counted (it left the tail out after another split's chunks)."""

    def engine(tp: int, rank: int) -> tuple[CacheEngine, KVLayout]:
        layout = KVLayout(SGLANG_MHA, num_layers=2, block_size=1, num_kv_heads=4 // tp, head_dim=8, dtype=torch.float32)
        extra = {"kvplug": {"chunk_size": 8, "block_granular_hits": True, "store": {"queue": {"mode": "sync"}}}}
        extra["kvplug"]["tiers"] = [{"type": "disk", "path": str(tmp_path)}]
        config = load_config(engine_extra=extra, env={}, registry=registry).config
        heads = HeadShard.for_rank(total_heads=4, tp_rank=rank, tp_size=tp)
        opened = CacheEngine(
            config, layout, Fingerprint.for_layout(layout, model_id="m"), registry=registry, heads=heads
        )
        return opened, layout

    prompt = list(range(100, 121))  # two whole chunks of 8, then 5 tokens
    whole = random_caches(KVLayout(SGLANG_MHA, 2, 1, 4, 8, torch.float32), 32, seed=1)
    ranks = [engine(2, rank) for rank in (0, 1)]
    for rank, (writer, _) in enumerate(ranks):  # TP=2 stores the whole chunks, each rank its heads
        writer.store(
            prompt[:16], [tuple(t[:, 2 * rank : 2 * rank + 2] for t in layer) for layer in whole], torch.arange(16)
        )
    reader, layout = engine(1, 0)
    masked = torch.arange(21) >= 16  # TP=1 stores only past them: the tail [16, 21)
    reader.store(prompt, whole, torch.arange(21), masked)
    longer = [*prompt, 7]
    assert reader.lookup(longer) == 21
    target = random_caches(layout, 32, seed=2)
    loaded = reader.retrieve(longer, target, torch.arange(22))
    assert loaded.tolist() == [True] * 21 + [False]
    assert all(same_kv(layout, whole, target, t) for t in range(21))
    for opened, _ in [*ranks, (reader, layout)]:
        opened.close()


def test_a_packed_layout_refuses_chunks_that_are_not_whole_blocks(make_engine) -> None:
    """No chunk of 6 tokens of 4-token blocks can be copied whole: the engine refuses the
    config, naming chunk_size, instead of storing nothing at every store."""
    with pytest.raises(ConfigError, match=r"chunk_size.*multiple of the block size 4"):
        make_engine(LAYOUTS["vllm_cpu"], chunk_size=6)
    assert make_engine(LAYOUTS["vllm_flash"], chunk_size=6).chunk_size == 6  # token-addressed: any size
