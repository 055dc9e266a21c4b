"""Store many times a cpu tier's budget through cpu + disk tiers; print the growth of the
process's peak memory as JSON (run as its own process: peak RSS is per process).

    python memory_worker.py FOLDER CPU_MIB QUEUE_MIB STORED_MIB [defaults]

``defaults`` leaves the queues' byte bounds out of the config (code without them runs it too).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvplug import CacheEngine, Fingerprint, KVLayout, PagedFormat, load_config

#: The engine format this test's caches use, as the vLLM/SGLang adapters declare it (same name: same fingerprints).
VLLM_FLASH = PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))

# 2 MiB per 256-token chunk; a prompt of 2 chunks is one 4 MiB store batch.
LAYOUT = KVLayout(VLLM_FLASH, num_layers=2, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
CHUNK, CHUNKS_PER_PROMPT = 256, 2


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def main(folder: str, cpu_mib: int, queue_mib: int, stored_mib: int, bounded: bool) -> None:
    queue = f"{queue_mib}MiB"
    disk_queue: dict[str, object] = {"mode": "async", "on_full": "block"}
    store_queue: dict[str, object] = {"mode": "async", "on_full": "block"}
    if bounded:
        disk_queue["max_bytes"] = queue
        store_queue["max_bytes"] = queue
    disk = {"type": "disk", "path": folder, "max_bytes": "1GiB", "fsync": False, "queue": disk_queue}
    store = {"queue": store_queue}
    config = load_config(
        engine_extra={
            "kvplug": {
                "chunk_size": CHUNK,
                "store": store,
                "tiers": [{"type": "cpu", "max_bytes": f"{cpu_mib}MiB"}, disk],
            }
        },
        env={},
    ).config
    tokens_per_prompt = CHUNK * CHUNKS_PER_PROMPT
    blocks = tokens_per_prompt // LAYOUT.block_size
    caches = [torch.randn(2, blocks, LAYOUT.block_size, 8, 128).to(torch.bfloat16) for _ in range(LAYOUT.num_layers)]
    slots = torch.arange(tokens_per_prompt)
    chunk_bytes = LAYOUT.num_layers * 2 * CHUNK * 8 * 128 * 2
    prompts = stored_mib * 1024**2 // (chunk_bytes * CHUNKS_PER_PROMPT)
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="memory")) as engine:
        for warm in range(2):  # code paths, thread stacks, allocator pools: not chunk data
            engine.store(
                list(range(10**9 + warm * tokens_per_prompt, 10**9 + (warm + 1) * tokens_per_prompt)), caches, slots
            )
        engine.flush()
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM (peak RSS) to the current RSS
        baseline = rss_kib("VmRSS")
        started = time.perf_counter()
        for prompt in range(prompts):
            engine.store(list(range(prompt * tokens_per_prompt, (prompt + 1) * tokens_per_prompt)), caches, slots)
        engine.flush()
        seconds = time.perf_counter() - started
        peak = rss_kib("VmHWM")
        stats = dict(engine.chain.stats())
    print(
        json.dumps(
            {
                "growth_mib": (peak - baseline) / 1024,
                "stored_mib": prompts * CHUNKS_PER_PROMPT * chunk_bytes / 1024**2,
                "seconds": round(seconds, 2),
                "disk_dropped": stats["1:disk"].extra.get("writer_dropped"),
                "disk_items": stats["1:disk"].items,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), "defaults" not in sys.argv[5:])
