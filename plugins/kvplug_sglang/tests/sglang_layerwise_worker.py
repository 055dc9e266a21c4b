"""One tensor-parallel rank of the layer-wise test (run by torch.multiprocessing.spawn)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


class TinyModelConfig:
    """The ModelConfig fields the connector reads (a spawned child skips building a real one)."""

    model_path = "tiny-llama"
    revision = None
    num_hidden_layers = 4

    def get_num_kv_heads(self, tp_size: int) -> int:
        return 2 // tp_size


def run_rank(rank: int, port: int, out_dir: str, chunks_stored: list[int]) -> None:
    import torch
    import torch.distributed as dist
    from sglang_pools import clear_pool, fill_random, kvplug_extra, make_pool, snapshot

    from kvplug_sglang.connector import KVPlugLayerwiseConnector, LoadMetadata, StoreMetadata

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        pool = make_pool(size=256, heads=1)
        connector = KVPlugLayerwiseConnector(
            TinyModelConfig(),
            2,
            rank,
            pool.k_buffer,
            pool.v_buffer,
            tp_group=dist.group.WORLD,
            engine_extra=kvplug_extra(),
        )
        tokens = list(range(700, 748))  # 3 chunks of 16
        src = torch.arange(1, 49)
        fill_random(pool, src, seed=10 + rank)
        expected = snapshot(pool, src)
        stored = chunks_stored[rank] * 16
        connector.store_kv(StoreMetadata(None, tokens[:stored], src[:stored], 0))
        clear_pool(pool)
        dst = torch.arange(100, 148)
        loaded = connector.start_load_kv(LoadMetadata(tokens, dst, 0))
        for layer in range(pool.layer_num):
            connector.load_kv_layerwise(layer)
        exact = all(
            torch.equal(pool.get_key_buffer(i)[dst[:loaded]], expected[i][0][:loaded])
            and torch.equal(pool.get_value_buffer(i)[dst[:loaded]], expected[i][1][:loaded])
            for i in range(pool.layer_num)
        )
        connector.close()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"loaded": loaded, "exact": exact}))
    finally:
        dist.destroy_process_group()
