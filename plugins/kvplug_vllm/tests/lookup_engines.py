"""A cache engine holding one prompt, for the tests of the scheduler's socket lookup channel."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvplug import CacheEngine, Fingerprint, KVLayout, load_config, slots_from_block_ids
from kvplug_vllm.layout import VLLM_CPU

LAYOUT = KVLayout(VLLM_CPU, num_layers=2, block_size=32, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
PROMPT = list(range(3, 203))
#: A message's length prefix on the channel.
LEN = struct.Struct("<I")


@contextmanager
def engine_holding_prompt() -> Iterator[CacheEngine]:
    """A cache engine holding PROMPT's three whole chunks (192 tokens)."""
    config = load_config(
        engine_extra={"kvplug": {"chunk_size": 64, "store": {"queue": {"mode": "sync"}}}}, env={}
    ).config
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="m")) as engine:
        caches = [torch.randn(16, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
        engine.store(PROMPT, caches, slots_from_block_ids(list(range(1, 16)), 32, len(PROMPT)))
        yield engine
