"""A sliding-window group's store: no chunk holding a token of a leading null block.

vLLM gives the tokens of a sliding-window group that are out of its window the null block
(id 0), which other requests' writes leave holding anything. The engine gathers a chunk
that straddles a store's mask whole, so a chunk that holds such a token would be stored
with the null block's bytes as that token's KV, for a later request whose window reaches
it to load as real KV.
"""

from __future__ import annotations

import pytest
import torch

from kvplug import CacheEngine, Fingerprint, KVLayout, load_config, slots_from_block_ids
from kvplug_vllm.kv_groups import first_stored_token
from kvplug_vllm.layout import VLLM_FLASH

NULL = 0


@pytest.mark.parametrize(
    ("block_size", "chunk_size", "null_blocks", "save_start"),
    [(4, 8, 3, 0), (4, 8, 2, 0), (4, 16, 1, 0), (8, 8, 1, 0), (4, 8, 3, 16), (16, 32, 3, 8), (4, 8, 0, 0)],
)
def test_no_stored_chunk_holds_a_null_blocks_bytes(
    block_size: int, chunk_size: int, null_blocks: int, save_start: int
) -> None:
    layout = KVLayout(VLLM_FLASH, num_layers=2, block_size=block_size, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    tiers = [{"type": "cpu", "max_bytes": "64MiB"}]
    settings = {"kvplug.chunk_size": chunk_size, "kvplug.store.queue.mode": "sync", "kvplug.tiers": tiers}
    config = load_config(engine_extra=settings, env={}).config
    num_tokens = 4 * chunk_size
    blocks = num_tokens // block_size
    block_ids = [NULL] * null_blocks + list(range(1, blocks - null_blocks + 1))
    caches = [torch.full(layout.cache_shape(blocks + 1), 1.0, dtype=layout.dtype) for _ in range(2)]
    for cache in caches:
        cache[:, NULL] = 99.0  # what another request left in the null block
    tokens = list(range(1000, 1000 + num_tokens))
    with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="swa")) as engine:
        mask = torch.ones(num_tokens, dtype=torch.bool)
        mask[: first_stored_token(save_start, block_ids, block_size, chunk_size)] = False
        engine.store(tokens, caches, slots_from_block_ids(block_ids, block_size, num_tokens), mask)
        engine.flush()
        keys = engine.chunk_keys(tokens)
        held = engine.chain.contains_any([k.key for k in keys])
        stored = [k for k, h in zip(keys, held) if h]
        loaded = engine.chunk_store.load_prefix(
            [k.key for k in stored], [layout.chunk_shape(k.num_tokens) for k in stored], layout.dtype
        ).tensors
    assert all(bool((chunk != 99.0).all()) for chunk in loaded)
    # Every chunk past the null blocks and save_start is stored.
    first_whole = max(save_start, -(-null_blocks * block_size // chunk_size) * chunk_size)
    assert [k.start for k in stored] == list(range(first_whole, num_tokens, chunk_size))
