"""``kvplug demo``: the main job on an embedded default, no services needed.

With an engine plugin installed (``kvplug-vllm``) and ``--engine auto``, the demo
runs that real engine. Otherwise it builds the paged KV cache a small Llama-style
model would have (8 layers, 8 KV heads of 128, bf16, in its own ``demo_paged``
format: K and V blocks of 16 tokens), fills a
prompt's blocks, stores them through the configured tiers, and loads them back
into other blocks, checking every byte.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kvplug.cli.console import print_table
from kvplug.core.config.loader import load_config
from kvplug.core.engine.cache_engine import CacheEngine
from kvplug.core.keys import Fingerprint
from kvplug.core.layouts import KVLayout, PagedFormat, slots_from_block_ids
from kvplug.core.plugins import get_registry

#: The synthetic demo's own paged format: [2, num_blocks, block_size, num_kv_heads, head_dim].
DEMO_FORMAT = PagedFormat(
    "demo_paged",
    ("kv", "block", "token", "head", "dim"),
    shape_doc="[2, num_blocks, block_size, num_kv_heads, head_dim]",
)
DEMO_LAYOUT = KVLayout(DEMO_FORMAT, num_layers=8, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def run_demo(console: Console, *, tokens: int = 4096, engine: str = "auto") -> dict[str, Any]:
    if engine == "auto":
        for adapter in get_registry().engine_adapters().values():
            result = adapter.run_demo(console, tokens=tokens)
            if result is not None:
                return result
    return run_synthetic_demo(console, num_tokens=tokens)


def run_synthetic_demo(console: Console, *, num_tokens: int = 4096, seed: int = 0) -> dict[str, Any]:
    loaded = load_config(engine_extra={"kvplug.store.queue.mode": "sync"})
    layout = DEMO_LAYOUT
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = -(-num_tokens // layout.block_size)
    num_blocks = 2 * blocks_needed + 8
    caches = [
        torch.randn(2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim, generator=generator).to(
            layout.dtype
        )
        for _ in range(layout.num_layers)
    ]
    prompt = torch.randint(0, 32_000, (num_tokens,), generator=generator).tolist()
    order = torch.randperm(num_blocks, generator=generator)
    source_slots = slots_from_block_ids(order[:blocks_needed], layout.block_size, num_tokens)
    target_slots = slots_from_block_ids(order[blocks_needed : 2 * blocks_needed], layout.block_size, num_tokens)
    fingerprint = Fingerprint.for_layout(layout, model_id="kvplug-demo/llama-8l")
    kv_bytes = num_tokens * layout.bytes_per_token()

    with CacheEngine(loaded.config, layout, fingerprint) as engine:
        cold_hit = engine.lookup(prompt)
        started = time.perf_counter()
        stored = engine.store(prompt, caches, source_slots)
        engine.flush()
        store_s = time.perf_counter() - started
        warm_hit = engine.lookup(prompt)
        shared_prefix_hit = engine.lookup(prompt[: num_tokens // 2] + [7] * (num_tokens - num_tokens // 2))
        started = time.perf_counter()
        loaded_mask = engine.retrieve(prompt, caches, target_slots)
        retrieve_s = time.perf_counter() - started
        # Only the tokens a load wrote are compared: the others were never loaded (a miss, as a tier
        # that refused the store or had no room for it leaves them), and are said apart below.
        loaded_slots = loaded_mask.to(torch.bool)
        identical = all(
            torch.equal(
                cache.flatten(1, 2)[:, source_slots[loaded_slots]], cache.flatten(1, 2)[:, target_slots[loaded_slots]]
            )
            for cache in caches
        )
        tiers = engine.chain.stats()
    chunk_size = loaded.config.chunk_size
    # The prompt's last, partial chunk is stored only with save_unfull_chunk: the rest is what a
    # store keeps and a load gives back.
    kept = num_tokens if loaded.config.save_unfull_chunk else num_tokens // chunk_size * chunk_size
    result = {
        "prompt_tokens": num_tokens,
        "chunks": -(-kept // chunk_size),
        "stored_tokens": stored,
        "cold_hit_tokens": cold_hit,
        "warm_hit_tokens": warm_hit,
        "shared_prefix_hit_tokens": shared_prefix_hit,
        "loaded_tokens": int(loaded_mask.sum()),
        "kv_bytes": kv_bytes,
        "store_gbps": kv_bytes / store_s / 1e9,
        "retrieve_gbps": kv_bytes / retrieve_s / 1e9,
        "identical": identical,
    }
    _print(console, result, tiers, loaded.config.chunk_size)
    if not identical:
        raise SystemExit("KV loaded back differs from what was stored")
    if result["loaded_tokens"] < kept:
        raise SystemExit(
            f"{result['loaded_tokens']} of {kept} tokens were loaded back: the tiers did not keep the prompt "
            "(a tier too small for a chunk, or one that refused the writes: see its warnings above)"
        )
    return result


def _print(console: Console, result: dict[str, Any], tiers: list[Any], chunk_size: int) -> None:
    table = Table(title="kvplug demo: synthetic paged KV cache (8 layers, 8x128 heads, bf16)")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("prompt", f"{result['prompt_tokens']} tokens, {result['chunks']} chunks of {chunk_size}")
    table.add_row("lookup before store", f"{result['cold_hit_tokens']} hit tokens")
    table.add_row("stored", f"{result['stored_tokens']} tokens, {result['kv_bytes'] / 2**20:.1f} MiB")
    table.add_row("lookup after store", f"{result['warm_hit_tokens']} hit tokens")
    table.add_row("prompt sharing half the prefix", f"{result['shared_prefix_hit_tokens']} hit tokens")
    table.add_row("retrieved into other blocks", f"{result['loaded_tokens']} tokens")
    table.add_row("store throughput", f"{result['store_gbps']:.2f} GB/s")
    table.add_row("retrieve throughput", f"{result['retrieve_gbps']:.2f} GB/s")
    shown = "yes" if result["identical"] else "[red]NO[/red]"
    table.add_row("KV identical after reload", shown if result["loaded_tokens"] else "nothing was loaded")
    for label, stats in tiers:
        # A tier's items are chunk records and the fingerprint's manifest (kvplug explain reads it).
        table.add_row(f"tier {label}", f"{stats.items} records ({result['chunks']} chunks + manifest)")
        table.add_row(f"tier {label} bytes, hits", f"{stats.bytes_used / 2**20:.1f} MiB, {stats.hits} hits")
    print_table(table)
