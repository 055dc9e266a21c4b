"""A KV oracle for CacheEngine tests: the KV of each token is a function of its prefix.

Token ``t`` of a prompt holds, in every layer and K/V index, the values a generator
seeded by ``tokens[:t + 1]`` draws for all of the model's KV heads; a TP rank's cache
holds its heads of them. So whatever an engine of any TP size loads into any slots can
be checked exactly (or within a lossy serializer's bound), whatever happened before.
Imported by name, as core_helpers is.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from kvplug import KVLayout, slots_from_block_ids

#: What an untouched slot holds: a value no token's KV has (its generator draws randn).
SENTINEL = -1000.0


@dataclass(frozen=True)
class Model:
    """The model's KV shape: layers, KV (2, or 1 latent), all of its heads, head dim, dtype."""

    full: KVLayout

    @property
    def heads(self) -> int:
        return self.full.num_kv_heads


@lru_cache(maxsize=4096)
def _prefix_kv(prefix: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(",".join(map(str, prefix)).encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


def prefix_kv(layout: KVLayout, total_heads: int, prefix: list[int]) -> torch.Tensor:
    """The KV of the last token of ``prefix``: ``[layers, num_kv, total heads, head_dim]``."""
    shape = (layout.num_layers, layout.num_kv, total_heads, layout.head_dim)
    return _prefix_kv(tuple(prefix), shape, layout.dtype)


def empty_caches(layout: KVLayout, num_blocks: int, *, scrambled: bool = False) -> list[Any]:
    """Per-layer caches of ``layout`` holding only :data:`SENTINEL`; ``scrambled``: each tensor
    a view of memory laid out in the reverse order of its axes but the last (any strides fit)."""

    def one() -> torch.Tensor:
        shape = layout.cache_shape(num_blocks)
        order = [*reversed(range(len(shape) - 1)), len(shape) - 1] if scrambled else list(range(len(shape)))
        memory = torch.full([shape[axis] for axis in order], SENTINEL, dtype=layout.dtype)
        return memory.permute([order.index(axis) for axis in range(len(shape))])

    return [
        tuple(one() for _ in range(layout.format.tensors)) if layout.format.tensors > 1 else one()
        for _ in range(layout.num_layers)
    ]


def block_slots(layout: KVLayout, blocks: list[int], num_tokens: int) -> torch.Tensor:
    """The slots of ``num_tokens`` tokens in ``blocks`` (a block table row)."""
    return slots_from_block_ids(blocks, layout.block_size, num_tokens)


def write_tokens(
    layout: KVLayout,
    caches: list[Any],
    tokens: list[int],
    slots: torch.Tensor,
    first_head: int,
    total_heads: int,
    span: range,
    *,
    tenant: int = 0,
) -> None:
    """Write the KV of the tokens in ``span`` (heads ``first_head ..`` of ``total_heads``) at
    their slots, as ``tenant`` computes it (tenants' KV differs: a load of another's is wrong)."""
    if not span:
        return
    slot = slots[list(span)]
    pages, offsets = slot // layout.page_tokens, slot % layout.page_tokens
    tenant_prefix = [-tenant] * bool(tenant)
    kv = torch.stack([prefix_kv(layout, total_heads, tenant_prefix + tokens[: t + 1]) for t in span])
    kv = kv[:, :, :, first_head : first_head + layout.num_kv_heads]  # [tokens, layers, num_kv, heads, dim]
    for layer, cache in enumerate(caches):
        for index, view in enumerate(layout.kv_views(cache)):
            view[pages, offsets] = kv[:, layer, index]


def token_mask(layout: KVLayout, caches: list[Any], slots: torch.Tensor, span: range) -> list[Any]:
    """Bool tensors shaped like ``caches``: True at every element of the slots of the tokens in ``span``."""
    masks = [
        tuple(torch.zeros(t.shape, dtype=torch.bool) for t in c)
        if isinstance(c, tuple)
        else torch.zeros(c.shape, dtype=torch.bool)
        for c in caches
    ]
    slot = slots[list(span)]
    for mask in masks:
        for view in layout.kv_views(mask):
            view[slot // layout.page_tokens, slot % layout.page_tokens] = True
    return masks


def flat(caches: list[Any]) -> list[torch.Tensor]:
    return [t for c in caches for t in (c if isinstance(c, tuple) else (c,))]
