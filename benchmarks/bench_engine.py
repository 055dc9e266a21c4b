"""CacheEngine + cpu tier throughput next to a plain memcpy of the same bytes.

256-token chunks of an 8-layer model (8 KV heads of 128, bf16, vLLM flash layout,
block size 16): 32 KiB of KV per token, 8 MiB per chunk. Every figure comes from
this run; ratios are against ``copy_`` between two preallocated tensors of the
same size (the best a copy can do) and into a freshly allocated tensor (what a
store that keeps its copy must also pay: page faults of new memory).

    python benchmarks/bench_engine.py [--tokens 4096] [--rounds 8] [--json]

``--json``: the table goes to stderr and one JSON object is the last line of stdout:
GB/s of every path and its fraction of the same run's preallocated memcpy
(``store_vs_memcpy``, ``store_async_vs_memcpy``, ``retrieve_vs_memcpy``, ...).
Goal (issue 16): store and retrieve >= 0.8 of memcpy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvplug import CacheEngine, Fingerprint, KVLayout, PagedFormat, load_config, slots_from_block_ids

#: The engine format this test's caches use, as the vLLM/SGLang adapters declare it (same name: same fingerprints).
VLLM_FLASH = PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))


def timed(fn, repeat: int) -> float:
    """Median seconds of ``repeat`` calls (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per prompt (a multiple of 256)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="table on stderr; one JSON object as stdout's last line")
    args = parser.parse_args()
    out = sys.stderr if args.json else sys.stdout

    layout = KVLayout(VLLM_FLASH, num_layers=8, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    tokens = args.tokens
    blocks = tokens // layout.block_size
    nbytes = tokens * layout.bytes_per_token()
    gen = torch.Generator().manual_seed(0)
    num_blocks = 2 * blocks + 4
    caches = [
        torch.randn(2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim, generator=gen).to(
            layout.dtype
        )
        for _ in range(layout.num_layers)
    ]
    order = torch.randperm(num_blocks, generator=gen)
    src_slots = slots_from_block_ids(order[:blocks], layout.block_size, tokens)
    dst_slots = slots_from_block_ids(order[blocks : 2 * blocks], layout.block_size, tokens)

    # Baselines over exactly nbytes.
    a = torch.empty(nbytes, dtype=torch.uint8).random_(generator=gen)
    b = torch.empty_like(a).fill_(1)
    memcpy_s = timed(lambda: b.copy_(a), args.rounds)
    fresh_s = timed(lambda: torch.empty_like(a).copy_(a), args.rounds)

    budget = f"{max(4 * nbytes, 256 * 2**20)}"  # several prompts fit; older ones get evicted

    def make_engine(mode: str) -> CacheEngine:
        config = load_config(
            engine_extra={
                "kvplug": {
                    "chunk_size": 256,
                    "store": {"mode": mode},
                    "connector": {"type": "torch"},
                    "tiers": [{"type": "cpu", "max_bytes": budget}],
                }
            },
            env={},
        ).config
        return CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id=f"bench/llama-8l-{mode}"))

    engine = make_engine("sync")
    prompt_id = iter(range(10**6))

    def store_new_prompt() -> None:
        start = next(prompt_id) * tokens
        assert engine.store(list(range(start, start + tokens)), caches, src_slots) == tokens

    # Steady state: fill the cpu tier first, so stores recycle evicted frames (as a
    # long-running server does) instead of touching fresh memory.
    for _ in range(int(budget) // nbytes + 1):
        store_new_prompt()
    store_s = timed(store_new_prompt, args.rounds)
    stored_prompt = list(range(0, tokens))
    engine.store(stored_prompt, caches, src_slots)

    # The default async mode: what the engine's caller waits for is the copy out of its
    # cache; sealing and the tier write run on the store thread (flushed, untimed, after each).
    async_engine = make_engine("async")

    def store_async() -> None:
        start = next(prompt_id) * tokens
        assert async_engine.store(list(range(start, start + tokens)), caches, src_slots) == tokens

    for _ in range(int(budget) // nbytes + 1):
        store_async()
        async_engine.flush()
    async_samples = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        store_async()
        async_samples.append(time.perf_counter() - started)
        async_engine.flush()
    store_async_s = statistics.median(async_samples)
    async_engine.close()

    def retrieve() -> None:
        assert bool(engine.retrieve(stored_prompt, caches, dst_slots).all())

    retrieve_s = timed(retrieve, args.rounds)

    # Where the store time goes: gather into frames, seal (checksum), tier put.
    frames = []

    def allocate() -> None:
        frames.clear()
        frames.extend(
            engine.serializer.allocate(layout.chunk_shape(256), layout.dtype, engine.frame_pool.new_buffer)
            for _ in range(tokens // 256)
        )

    alloc_s = timed(allocate, args.rounds)

    def gather() -> None:
        for i, (_, payload) in enumerate(frames):
            engine.connector.gather(caches, src_slots[i * 256 : (i + 1) * 256], payload)

    gather_s = timed(gather, args.rounds)
    seal_s = timed(lambda: [engine.serializer.seal(frame) for frame, _ in frames], args.rounds)
    sealed = [engine.serializer.seal(frame) for frame, _ in frames]
    loads_s = timed(lambda: [engine.serializer.loads(s) for s in sealed], args.rounds)
    chunks = [engine.serializer.loads(s) for s in sealed]

    def scatter() -> None:
        for i, chunk in enumerate(chunks):
            engine.connector.scatter(caches, dst_slots[i * 256 : (i + 1) * 256], chunk)

    scatter_s = timed(scatter, args.rounds)
    tier_stats = engine.chain.stats()
    pool_stats = engine.frame_pool.stats()
    engine.close()

    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    print(
        f"kvplug bench_engine: {tokens} tokens x {layout.bytes_per_token()} B = {nbytes / 2**20:.0f} MiB per prompt, "
        f"{tokens // 256} chunks of 256 tokens, torch threads {torch.get_num_threads()}",
        file=out,
    )
    print(f"{'path':<40}{'GB/s':>8}{'vs memcpy':>11}{'vs fresh memcpy':>17}", file=out)
    rows = [
        ("memcpy", "memcpy (preallocated dst)", memcpy_s),
        ("fresh_memcpy", "memcpy into fresh memory", fresh_s),
        ("store", "store, steady state (frames recycled)", store_s),
        ("store_async", "store call, async mode (caller waits)", store_async_s),
        ("retrieve", "retrieve (get+verify+scatter)", retrieve_s),
        ("allocate", "  store: allocate frames", alloc_s),
        ("gather", "  store: gather paged -> frames (1 thread)", gather_s),
        ("seal", "  store: seal (xxh3 checksum)", seal_s),
        ("loads", "  retrieve: loads (verify)", loads_s),
        ("scatter", "  retrieve: scatter -> paged", scatter_s),
    ]
    for _, name, seconds in rows:
        print(f"{name:<40}{gbps(seconds):>8.2f}{memcpy_s / seconds:>10.0%}{fresh_s / seconds:>16.0%}", file=out)
    print(f"cpu tier after the run: {tier_stats[0][1]}", file=out)
    print(f"frame pool after the run: {pool_stats}", file=out)
    if args.json:
        figures: dict[str, object] = {
            "benchmark": "bench_engine",
            "tokens": tokens,
            "bytes_per_prompt": nbytes,
            "torch_threads": torch.get_num_threads(),
            "goal": {"store_vs_memcpy": 0.8, "retrieve_vs_memcpy": 0.8},
        }
        for key, _, seconds in rows:
            figures[f"{key}_gbps"] = round(gbps(seconds), 3)
            if key != "memcpy":
                figures[f"{key}_vs_memcpy"] = round(memcpy_s / seconds, 4)
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
