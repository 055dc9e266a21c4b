"""CacheEngine + cpu tier throughput next to a plain memcpy of the same bytes, per connector.

256-token chunks of an 8-layer model (8 KV heads of 128, bf16, vLLM flash layout,
block size 16, blocks in random order): 32 KiB of KV per token, 8 MiB per chunk.
Each connector installed (``torch``, core; ``native``, kvplug-native) gets an engine
of its own on the same caches.

Every figure is a ratio to ``copy_`` between two preallocated tensors of the same
bytes, **measured in the same round**: each round times the memcpy and then every
path once, and a path's ratio is the median over rounds of (memcpy time / path
time), with its interquartile range. On a shared VM the memcpy speed alone moves by
up to 2x between buffers and minutes; paired rounds cancel that drift, where two
medians taken minutes apart did not. Rows:

* ``store``: ``CacheEngine.store`` in sync mode with the cpu tier full (frames are
  recycled, as in a long-running server): keys, copy out of the cache, tier put;
* ``store call (async)``: what the caller of the default async mode waits for (the
  tier write runs on the store thread, flushed untimed after each);
* ``retrieve``: tier get, header check, and the write into the cache;
* ``gather`` / ``scatter``: the connector's copies of one such call alone;
* ``memcpy, streaming stores`` (with kvplug-native): the same ``copy_`` with
  non-temporal stores, this machine's limit for one pass over the bytes.

    python benchmarks/bench_engine.py [--tokens 4096] [--rounds 15] [--json]
    python benchmarks/bench_engine.py --tier shm [--shm-dir /dev/shm]   # tier shm instead of cpu

``--tier shm``: the engines' one tier is ``shm`` in a scratch folder under ``--shm-dir``
(written in sync mode; a retrieve maps each record, verifies it over the mapping and
scatters from it), instead of ``cpu``.

``--json``: the table goes to stderr and one JSON object is the last line of stdout:
``store_vs_memcpy``, ``store_async_vs_memcpy``, ``retrieve_vs_memcpy`` (medians, as
fractions) for the connector ``auto`` picks, and every connector's figures under
``connectors``. Goal (issue 16): store and retrieve >= 0.8 of memcpy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from kvplug import CacheEngine, Fingerprint, KVLayout, PagedFormat, get_registry, load_config, slots_from_block_ids
from kvplug.core.engine.parallel_copies import ParallelCopies, auto_copy_threads

#: The engine format this test's caches use, as the vLLM/SGLang adapters declare it (same name: same fingerprints).
VLLM_FLASH = PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))
CHUNK = 256


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def streaming_memcpy() -> Callable[[torch.Tensor, torch.Tensor], None] | None:
    """``dst.copy_(src)`` with non-temporal stores on torch's threads (kvplug-native), or None without it."""
    try:
        from kvplug_native import _copy
    except ImportError:
        return None

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        pieces = torch.get_num_threads()
        step = -(-src.numel() // pieces)
        table = torch.tensor(
            [
                [dst.data_ptr() + start, src.data_ptr() + start, min(step, src.numel() - start)]
                for start in range(0, src.numel(), step)
            ]
        )
        _copy.copy_runs(table.data_ptr(), table.shape[0], True, pieces)

    return copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per prompt (a multiple of 256)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="table on stderr; one JSON object as stdout's last line")
    parser.add_argument("--tier", choices=("cpu", "shm"), default="cpu", help="the engines' one tier")
    parser.add_argument("--shm-dir", default="/dev/shm", help="--tier shm: parent of its scratch folder")
    args = parser.parse_args()
    scratch = (
        tempfile.TemporaryDirectory(prefix="kvplug-bench-engine-", dir=args.shm_dir) if args.tier == "shm" else None
    )
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
    spans = [(start, min(start + CHUNK, tokens)) for start in range(0, tokens, CHUNK)]

    a = torch.empty(nbytes, dtype=torch.uint8).random_(generator=gen)
    b = torch.empty_like(a).fill_(1)
    budget = f"{max(4 * nbytes, 256 * 2**20)}"  # several prompts fit; older ones get evicted
    connectors = [name for name in ("torch", "native") if name in get_registry().kv_connectors()]
    auto = max(
        (cls for cls in get_registry().kv_connectors().values() if cls.is_available()),
        key=lambda cls: getattr(cls, "priority", 0),
    ).name

    def tier_entry(name: str) -> dict[str, object]:
        if scratch is None:
            return {"type": "cpu", "max_bytes": budget}
        return {"type": "shm", "path": f"{scratch.name}/{name}", "max_bytes": budget, "queue": {"mode": "sync"}}

    def make_engine(connector: str, mode: str) -> CacheEngine:
        config = load_config(
            engine_extra={
                "kvplug": {
                    "chunk_size": CHUNK,
                    "store": {"queue": {"mode": mode}},
                    "connector": {"type": connector},
                    "tiers": [tier_entry(f"{connector}-{mode}")],
                }
            },
            env={},
        ).config
        model = f"bench/llama-8l-{connector}-{mode}"
        return CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id=model))

    prompt_id = iter(range(1, 10**6))
    copy_threads = ParallelCopies(auto_copy_threads())  # what an engine runs its copies on
    paths: dict[str, Callable[[], object]] = {"memcpy": lambda: b.copy_(a)}
    streaming = streaming_memcpy()
    if streaming is not None:
        paths["memcpy_streaming"] = lambda: streaming(b, a)
    engines: list[CacheEngine] = []
    for name in connectors:
        engine = make_engine(name, "sync")
        async_engine = make_engine(name, "async")
        engines += [engine, async_engine]

        def store(engine: CacheEngine = engine) -> None:
            start = next(prompt_id) * tokens
            assert engine.store(list(range(start, start + tokens)), caches, src_slots) == tokens

        def store_async(engine: CacheEngine = async_engine) -> None:
            start = next(prompt_id) * tokens
            assert engine.store(list(range(start, start + tokens)), caches, src_slots) == tokens

        # Steady state: fill the cpu tier first, so stores recycle evicted frames (as a
        # long-running server does) instead of touching fresh memory.
        for _ in range(int(budget) // nbytes + 1):
            store()
            store_async()
            async_engine.flush()
        stored = list(range(tokens))
        engine.store(stored, caches, src_slots)

        def retrieve(engine: CacheEngine = engine, stored: list[int] = stored) -> None:
            assert bool(engine.retrieve(stored, caches, dst_slots).all())

        # Chunk tensors of their own, touched once: frames taken from the engine's pool here
        # would leave its stores short of recycled frames.
        frames = [torch.zeros(layout.chunk_shape(end - start), dtype=layout.dtype) for start, end in spans]

        def gather(engine: CacheEngine = engine, frames: list[torch.Tensor] = frames) -> None:
            plans = engine.connector.plan_many(src_slots, spans)
            copy_threads.run(
                engine.connector.gather_copies(caches, range(layout.num_layers), plans, frames, copy_threads.threads)
            )

        def scatter(engine: CacheEngine = engine, frames: list[torch.Tensor] = frames) -> None:
            plans = engine.connector.plan_many(dst_slots, spans)
            copy_threads.run(
                engine.connector.scatter_copies(caches, range(layout.num_layers), plans, frames, copy_threads.threads)
            )

        paths[f"{name}.store"] = store
        paths[f"{name}.store_async"] = store_async
        paths[f"{name}.retrieve"] = retrieve
        paths[f"{name}.gather"] = gather
        paths[f"{name}.scatter"] = scatter
        # The async engine's store thread writes after each timed call: flush it untimed.
        paths[f"{name}.flush"] = async_engine.flush

    # Every path is timed right after a memcpy of its own: each ratio is of a pair taken
    # back to back, so drift of the machine's speed cancels.
    baseline = paths.pop("memcpy")
    samples: dict[str, list[float]] = {key: [] for key in paths}
    pair_baselines: dict[str, list[float]] = {key: [] for key in paths}
    for fn in (baseline, *paths.values()):  # warm-up
        fn()
    for _ in range(args.rounds):
        for key, fn in paths.items():
            for timed, record in ((baseline, pair_baselines[key]), (fn, samples[key])):
                started = time.perf_counter()
                timed()
                record.append(time.perf_counter() - started)
    for engine in engines:
        engine.close()
    copy_threads.close()
    if scratch is not None:
        scratch.cleanup()

    ratios = {
        key: quartiles([base / seconds for base, seconds in zip(pair_baselines[key], values)])
        for key, values in samples.items()
        if not key.endswith(".flush")
    }
    memcpy_s = statistics.median([s for values in pair_baselines.values() for s in values])
    print(
        f"kvplug bench_engine: {tokens} tokens x {layout.bytes_per_token()} B = {nbytes / 2**20:.0f} MiB per prompt, "
        f"{len(spans)} chunks of {CHUNK} tokens, {args.rounds} rounds, torch threads {torch.get_num_threads()}; "
        f"memcpy {nbytes / memcpy_s / 1e9:.2f} GB/s (median); auto picks {auto!r}; tier {args.tier}",
        file=out,
    )
    print(f"{'path':<36}{'ms':>8}{'vs memcpy (median, IQR)':>28}", file=out)
    labels = {
        "memcpy_streaming": "memcpy, streaming stores",
        "store": "store, steady state",
        "store_async": "store call (async mode)",
        "retrieve": "retrieve (get + check + write)",
        "gather": "  gather alone",
        "scatter": "  scatter alone",
    }
    for key, (q1, median, q3) in ratios.items():
        connector, _, path = key.rpartition(".")
        label = f"{connector}: {labels[path]}" if connector else labels[path]
        ms = statistics.median(samples[key]) * 1e3
        print(f"{label:<36}{ms:>8.2f}{median:>13.0%}  [{q1:.0%}, {q3:.0%}]", file=out)
    if args.json:
        figures: dict[str, object] = {
            "benchmark": "bench_engine",
            "tokens": tokens,
            "bytes_per_prompt": nbytes,
            "rounds": args.rounds,
            "torch_threads": torch.get_num_threads(),
            "memcpy_gbps": round(nbytes / memcpy_s / 1e9, 3),
            "connector": auto,
            "tier": args.tier,
            "goal": {"store_vs_memcpy": 0.8, "retrieve_vs_memcpy": 0.8},
            "connectors": {
                name: {
                    f"{path}_vs_memcpy": round(ratios[f"{name}.{path}"][1], 4)
                    for path in ("store", "store_async", "retrieve", "gather", "scatter")
                }
                | {
                    f"{path}_vs_memcpy_iqr": [round(ratios[f"{name}.{path}"][i], 4) for i in (0, 2)]
                    for path in ("store", "store_async", "retrieve")
                }
                for name in connectors
            },
        }
        if "memcpy_streaming" in ratios:
            figures["memcpy_streaming_vs_memcpy"] = round(ratios["memcpy_streaming"][1], 4)
        for path in ("store", "store_async", "retrieve"):
            figures[f"{path}_vs_memcpy"] = round(ratios[f"{auto}.{path}"][1], 4)
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
