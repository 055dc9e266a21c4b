"""Recurrent-state KV cache groups (Mamba, Gated DeltaNet) in vLLM's ``align`` mode.

A state layer has no per-token KV: it keeps one state per request (a short conv window
and an SSM / delta-rule matrix). With prefix caching in ``mamba_cache_mode: align``, vLLM
keeps the state at block boundaries, each in a block of its own, and hands every such
block to the connector with its exact id and boundary (``boundary_state_offloads``): an
``align`` table is not append-only (interior states are nulled, speculative blocks move),
so a state is never read from the request's table by position.

kvplug keeps each state group in a cache engine of its own whose "block" is one chunk:

- its layout (:data:`~kvplug_vllm.layout.VLLM_STATE_PAGES`) sees each layer's cache as
  pages of raw bytes, one per vLLM block, viewed as ``[num_blocks, chunk_size, page /
  chunk_size]`` bytes, so a chunk of the engine is exactly one page: the state at the
  chunk's end;
- a store writes the state vLLM handed over for a chunk end (:func:`state_store_calls`);
- a hit ends at a chunk whose state is stored (:class:`StateBoundaries` trims lookups);
- a load writes that one state into the block vLLM resumes from: the request's block at
  the hit boundary (:func:`state_load_block_ids`); vLLM gives the earlier ones its null block.

The chunk keys are the attention groups' token-prefix keys under the state group's own
fingerprint, so a state is found for exactly the prefix it was computed from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvplug import CacheEngine, ChunkLocation, KVLayout, RequestInfo, hit_tokens
from kvplug.errors import LayoutError
from kvplug_vllm.kv_groups import NULL_BLOCK_ID


def state_pages(layer_caches: Sequence[Any], layer_names: Sequence[str], chunk_size: int) -> list[torch.Tensor]:
    """Each state layer's cache as ``[num_blocks, chunk_size, page // chunk_size]`` bytes.

    vLLM registers a state layer as its state tensors (conv, SSM, ...), views into one
    raw buffer in which block ``b`` owns bytes ``[b * page, (b + 1) * page)`` (its page,
    padded to the attention page size). The view covers whole pages, padding included.
    """
    pages = []
    for name, cache in zip(layer_names, layer_caches):
        tensors = list(cache) if isinstance(cache, (list, tuple)) else [cache]
        if not tensors or any(not isinstance(t, torch.Tensor) or t.dim() < 1 for t in tensors):
            raise LayoutError(f"state layer {name!r}: expected vLLM's state tensors, got {type(cache).__name__}")
        page = tensors[0].stride(0) * tensors[0].element_size()
        blocks = tensors[0].shape[0]
        storage = tensors[0].untyped_storage()
        starts = [t.storage_offset() * t.element_size() for t in tensors]
        base = min(starts)
        fits = all(
            t.untyped_storage().data_ptr() == storage.data_ptr()
            and t.shape[0] == blocks
            and t.stride(0) * t.element_size() == page
            and start - base + t[0].numel() * t.element_size() <= page
            and t[0].is_contiguous()
            for t, start in zip(tensors, starts)
        )
        if not fits or base + blocks * page > storage.nbytes():
            shapes = ", ".join(f"{tuple(t.shape)}/{tuple(t.stride())}" for t in tensors)
            raise LayoutError(
                f"state layer {name!r}: tensors {shapes} are not one page per block in one buffer; "
                "kvplug copies a block's state as its page of bytes"
            )
        if page % chunk_size:
            raise LayoutError(
                f"state layer {name!r}: its page of {page} bytes is not a whole number of bytes per token of "
                f"a {chunk_size}-token chunk; use a chunk_size that divides {page}"
            )
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        pages.append(raw.as_strided((blocks, chunk_size, page // chunk_size), (page, page // chunk_size, 1), base))
    return pages


def state_layout(pages: Sequence[torch.Tensor], chunk_size: int) -> KVLayout:
    """The layout of :func:`state_pages`' views (every state layer's page must be the same size)."""
    from kvplug_vllm.layout import VLLM_STATE_PAGES

    widths = {int(p.shape[2]) for p in pages}
    if len(widths) != 1:
        raise LayoutError(f"state layers have pages of different sizes ({sorted(widths)} bytes per token)")
    layout = KVLayout(
        format=VLLM_STATE_PAGES,
        num_layers=len(pages),
        block_size=chunk_size,
        num_kv_heads=1,
        head_dim=widths.pop(),
        dtype=torch.uint8,
    )
    layout.check_caches(list(pages))
    return layout


def state_load_block_ids(table: Sequence[int], num_hit: int, chunk_size: int, block_size: int) -> list[int]:
    """The state engine's block per chunk of a hit of ``num_hit`` tokens: the request's
    block at the hit boundary for the last chunk (vLLM resumes from the state there),
    the null block for the others. ``LayoutError`` when the table has no block there
    (the load then fails and vLLM recomputes the request: never a silent partial load)."""
    index = num_hit // block_size - 1
    if num_hit <= 0 or num_hit % chunk_size or num_hit % block_size or not 0 <= index < len(table):
        raise LayoutError(f"no state block for a hit of {num_hit} tokens in a table of {len(table)} blocks")
    if table[index] == NULL_BLOCK_ID:
        raise LayoutError(f"vLLM gave the null block for the state at token {num_hit}")
    return [NULL_BLOCK_ID] * (num_hit // chunk_size - 1) + [table[index]]


def state_store_calls(
    handed: Sequence[tuple[int, int]], num_tokens: int, chunk_size: int
) -> list[tuple[int, list[int]]]:
    """One store per state vLLM handed over ``(boundary, block id)`` at a chunk end within
    ``num_tokens``: ``(boundary, block ids per chunk)``, the state's block for the last chunk."""
    calls = []
    for boundary, block_id in sorted(set(handed)):
        if boundary % chunk_size or not 0 < boundary <= num_tokens or block_id == NULL_BLOCK_ID:
            continue
        ids = [NULL_BLOCK_ID] * (boundary // chunk_size)
        ids[-1] = block_id
        calls.append((boundary, ids))
    return calls


class StateBoundaries:
    """Trims a lookup's hit to the last chunk end at which every state group has a state.

    vLLM hands kvplug the states of the boundaries it keeps (in ``align`` mode, where a
    prefill step ends: it schedules prefills to end at a block boundary), so not every
    chunk end of an attention hit has one; a hit that resumes without its state would be wrong.
    """

    def __init__(self, engines: Sequence[CacheEngine]) -> None:
        self.engines = list(engines)

    def __call__(
        self, tokens: Sequence[int], request: RequestInfo | None, tiers: list[ChunkLocation]
    ) -> list[ChunkLocation]:
        if not tiers or not self.engines:
            return tiers
        hit = hit_tokens(tiers)
        usable = [True] * len(tiers)
        for engine in self.engines:
            keys = engine.chunk_keys(list(tokens[:hit]), request)[: len(tiers)]
            records = engine.record_keys(keys, request)
            present = engine.chain.contains_any(records)
            count = engine.records.count
            for i, key in enumerate(keys):
                whole = key.num_tokens == engine.chunk_size
                usable[i] = usable[i] and whole and all(present[i * count : (i + 1) * count])
        end = next((i + 1 for i in reversed(range(len(tiers))) if usable[i]), 0)
        return tiers[:end]
