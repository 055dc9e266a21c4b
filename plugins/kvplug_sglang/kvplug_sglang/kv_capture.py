"""What an SGLang token pool holds at some slots, in the KV oracle's form (:class:`kvplug.testing.KVSlots`).

Compare a load's slots with the slots the KV was stored from (or an engine's own prefill)
by :func:`kvplug.testing.assert_kv_matches`.
"""

from __future__ import annotations

from typing import Any

import torch

from kvplug.testing import KVSlots


def capture_pool_slots(pool: Any, slots: torch.Tensor, *, rank: int = 0, first_head: int = 0) -> KVSlots:
    """The K and V of every layer of an ``MHATokenToKVPool`` at ``slots`` (one per token, in
    token order): layers ``[2, tokens, heads, head_dim]``."""
    index = slots.to(torch.long)
    layers = [
        torch.stack([pool.get_key_buffer(layer)[index], pool.get_value_buffer(layer)[index]]).clone()
        for layer in range(pool.layer_num)
    ]
    return KVSlots(
        group=0,
        rank=rank,
        first_head=first_head,
        unit_tokens=1,
        kv_names=("K", "V"),
        layers=layers,
        valid=torch.ones(len(index), dtype=torch.bool),
        layout=f"sglang_mha:L{pool.layer_num}:P{pool.page_size}:H{pool.head_num}:D{pool.head_dim}:{pool.dtype}",
    )
