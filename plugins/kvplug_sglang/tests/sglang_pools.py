"""Helpers: real SGLang pools on CPU, a config-only model directory, kvplug configs."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

# SGLang warns about CUDA-only quantization kernels on import; irrelevant here.
warnings.filterwarnings("ignore", message=".*support AWQ.*")

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 4, 2, 16


def write_model_dir(path: Path, *, num_layers: int = NUM_LAYERS, num_kv_heads: int = NUM_HEADS) -> Path:
    """A config-only HF model directory (no weights): enough for SGLang's ModelConfig."""
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=NUM_HEADS * 2 * HEAD_DIM,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=NUM_HEADS * 2,
        num_key_value_heads=num_kv_heads,
        vocab_size=1000,
        architectures=["LlamaForCausalLM"],
        torch_dtype="bfloat16",
    ).save_pretrained(path)
    return path


def make_pool(
    size: int = 512,
    page_size: int = 1,
    layers: int = NUM_LAYERS,
    heads: int = NUM_HEADS,
    dtype: torch.dtype = torch.bfloat16,
) -> MHATokenToKVPool:
    return MHATokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=dtype,
        head_num=heads,
        head_dim=HEAD_DIM,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )


def fill_random(pool: MHATokenToKVPool, slots: torch.Tensor, seed: int = 0) -> None:
    """Random KV at ``slots`` of every layer, through SGLang's own writer."""
    gen = torch.Generator().manual_seed(seed)
    heads = pool.head_num
    for layer in range(pool.layer_num):
        k = torch.randn(len(slots), heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
        v = torch.randn(len(slots), heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
        pool.set_kv_buffer(None, slots, k, v, layer_id_override=layer)


def snapshot(pool: MHATokenToKVPool, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (pool.get_key_buffer(i)[slots].clone(), pool.get_value_buffer(i)[slots].clone()) for i in range(pool.layer_num)
    ]


def clear_pool(pool: MHATokenToKVPool) -> None:
    for layer in range(pool.layer_num):
        pool.k_buffer[layer].zero_()
        pool.v_buffer[layer].zero_()


def kvplug_extra(tiers: list[dict[str, Any]] | None = None, chunk_size: int = 16, **more: Any) -> dict[str, Any]:
    """A nested ``kvplug`` engine-extra config: sync stores so reads see them at once."""
    return {
        "kvplug": {
            "chunk_size": chunk_size,
            "store": {"queue": {"mode": "sync"}},
            "tiers": tiers or [{"type": "cpu"}],
            **more,
        }
    }
