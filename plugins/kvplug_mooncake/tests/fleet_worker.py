"""One engine of the fleet test: a CacheEngine with a cpu tier in front of a shared
mooncake tier, driven by JSON lines on stdin (run by test_mooncake_fleet.py).

Commands: ``{"op": "store", "prompt": i}``, ``{"op": "lookup", "prompt": i}`` (answers the
cached prefix and the seconds it took), ``{"op": "retrieve", "prompt": i}`` (answers
whether the loaded KV equals the prompt's KV byte for byte), ``{"op": "drop_cpu"}``
(empties the cpu tier so the next answers come from the shared tier), ``{"op": "quit"}``.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvplug import CacheEngine, Fingerprint, KVLayout, load_config, slots_from_block_ids

LAYOUT = KVLayout("vllm_flash", num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float16)
TOKENS = 256  # 4 chunks of 64 tokens per prompt
BLOCKS = TOKENS // LAYOUT.block_size


def prompt_tokens(i: int) -> list[int]:
    return [(i * 7919 + t) % 30000 for t in range(TOKENS)]


def prompt_kv(i: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + i)
    shape = (2, BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [torch.randn(*shape, generator=generator).to(LAYOUT.dtype) for _ in range(LAYOUT.num_layers)]


def main() -> None:
    mooncake = json.loads(sys.argv[1])
    extra = {
        "kvplug.chunk_size": 64,
        "kvplug.store.mode": "sync",
        "kvplug.lookup_timeout_ms": 200,
        "kvplug.tiers": [{"type": "cpu", "max_bytes": "64MiB"}, {"type": "mooncake", "write_mode": "sync", **mooncake}],
    }
    config = load_config(engine_extra=extra, env={}).config
    engine = CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="fleet-model"))
    slots = slots_from_block_ids(list(range(BLOCKS)), LAYOUT.block_size, TOKENS)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        answer: dict[str, object] = {"op": op}
        if op == "store":
            i = command["prompt"]
            answer["queued"] = engine.store(prompt_tokens(i), prompt_kv(i), slots)
            engine.flush()
        elif op == "lookup":
            start = time.perf_counter()
            answer["tokens"] = engine.lookup(prompt_tokens(command["prompt"]))
            answer["seconds"] = time.perf_counter() - start
        elif op == "retrieve":
            i = command["prompt"]
            target = [torch.zeros_like(t) for t in prompt_kv(i)]
            start = time.perf_counter()
            loaded = engine.retrieve(prompt_tokens(i), target, slots)
            answer["seconds"] = time.perf_counter() - start
            answer["loaded"] = int(loaded.sum())
            answer["equal"] = all(
                torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(prompt_kv(i), target)
            )
        elif op == "drop_cpu":
            cpu = engine.chain.tiers[0]
            for i in command["prompts"]:
                cpu.remove([chunk.key for chunk in engine.chunk_keys(prompt_tokens(i))])
        elif op == "quit":
            engine.close()
            print(json.dumps(answer), flush=True)
            return
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
