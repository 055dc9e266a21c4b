"""Store/load throughput of kvplug's SGLang connector on a real CPU MHATokenToKVPool.

An 8-layer model's pool (bf16, 8 KV heads x 128) holds a prompt at scattered
slots; the connector stores it (gather + serialize + cpu tier, sync) and loads
it back into other slots. The baseline, measured in the same run, is a plain
``copy_`` of the same number of bytes between two contiguous tensors. Prints a
table with GB/s and the ratio to the baseline; asserts nothing.

    python benchmarks/bench_sglang.py [--tokens 8192] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402

from kvplug_sglang.connector import KVPlugConnector, LoadMetadata, StoreMetadata  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 8, 8, 128


class ModelFacts:
    """The ModelConfig fields the connector reads, for an 8-layer model."""

    model_path = "bench/8-layer"
    revision = None
    num_hidden_layers = LAYERS

    def get_num_kv_heads(self, tp_size: int) -> int:
        return HEADS // tp_size


def best_of(repeat: int, fn) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--chunk-size", type=int, default=256)
    args = parser.parse_args()
    tokens = args.tokens
    pool = MHATokenToKVPool(
        size=2 * tokens + 16, page_size=1, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
        layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False,
    )
    for layer in range(LAYERS):
        pool.k_buffer[layer].normal_()
        pool.v_buffer[layer].normal_()
    perm = torch.randperm(2 * tokens) + 1
    src_slots, dst_slots = perm[:tokens], perm[tokens:]
    token_ids = list(range(tokens))
    nbytes = 2 * LAYERS * tokens * HEADS * HEAD_DIM * 2
    connector = KVPlugConnector(
        ModelFacts(), 1, 0, pool.k_buffer, pool.v_buffer,
        engine_extra={"kvplug": {"chunk_size": args.chunk_size, "store": {"mode": "sync"},
                                 "tiers": [{"type": "cpu", "max_bytes": 4 * nbytes}]}},
    )
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16).normal_()
    b = torch.empty_like(a)

    def store() -> None:
        connector.reset()  # so every round stores for real (kvplug skips chunks it has)
        connector.store_kv(StoreMetadata(None, token_ids, src_slots, 0))

    def load() -> None:
        assert connector.load_kv(LoadMetadata(token_ids, dst_slots, 0)) == tokens

    rows = []
    copy_best, copy_med = best_of(args.repeat, lambda: b.copy_(a))
    rows.append(("copy_ (baseline)", copy_best, copy_med))
    rows.append(("store_kv", *best_of(args.repeat, store)))
    rows.append(("load_kv", *best_of(args.repeat, load)))
    for layer in range(LAYERS):  # the loaded KV is the stored KV
        assert torch.equal(pool.k_buffer[layer][dst_slots], pool.k_buffer[layer][src_slots])
    connector.close()

    print(f"sglang connector, {LAYERS} layers x {HEADS} heads x {HEAD_DIM} bf16, {tokens} tokens, "
          f"chunk {args.chunk_size}: {nbytes / 2**20:.0f} MiB per pass, best/median of {args.repeat}")
    print(f"{'operation':<18} {'best ms':>9} {'median ms':>10} {'GB/s':>7} {'x copy_':>8}")
    for name, best, med in rows:
        print(f"{name:<18} {best * 1e3:9.1f} {med * 1e3:10.1f} {nbytes / best / 1e9:7.2f} {best / copy_best:8.2f}")


if __name__ == "__main__":
    main()
