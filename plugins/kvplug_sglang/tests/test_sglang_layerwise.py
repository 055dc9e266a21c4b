"""KVPlugLayerwiseConnector: layer-by-layer loads, and TP ranks agreeing on the hit."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp
from sglang_pools import clear_pool, fill_random, kvplug_extra, snapshot

from kvplug_sglang.connector import KVPlugLayerwiseConnector, LoadMetadata, StoreMetadata


def test_start_then_each_layer_restores_every_layer(model_config, pool_factory) -> None:
    pool = pool_factory()
    connector = KVPlugLayerwiseConnector(model_config, 1, 0, pool.k_buffer, pool.v_buffer, engine_extra=kvplug_extra())
    tokens = list(range(10, 58))
    src = torch.arange(1, 49)
    fill_random(pool, src, seed=3)
    expected = snapshot(pool, src)
    connector.store_kv(StoreMetadata(None, tokens, src, 0))
    clear_pool(pool)
    dst = torch.arange(60, 108)
    assert connector.start_load_kv(LoadMetadata(tokens, dst, 0)) == 48
    written = [bool(pool.get_key_buffer(i)[dst].any()) for i in range(pool.layer_num)]
    assert written == [True] + [False] * (pool.layer_num - 1), "start_load_kv writes layer 0 only"
    for layer in range(pool.layer_num):
        connector.load_kv_layerwise(layer)
        upto = min(layer + 1, pool.layer_num - 1)
        assert all(pool.get_value_buffer(i)[dst].any() for i in range(upto + 1))
        if upto + 1 < pool.layer_num:
            assert not pool.get_value_buffer(upto + 1)[dst].any(), "a layer was written ahead of time"
    for layer, (k, v) in enumerate(expected):
        assert torch.equal(pool.get_key_buffer(layer)[dst], k) and torch.equal(pool.get_value_buffer(layer)[dst], v)
    # nothing cached beyond the offset: nothing to start
    assert connector.start_load_kv(LoadMetadata(tokens, dst[48:], 48)) == 0
    connector.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_tp_ranks_load_the_minimum(tmp_path: Path) -> None:
    from sglang_layerwise_worker import run_rank

    mp.spawn(run_rank, args=(_free_port(), str(tmp_path), [3, 1]), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["loaded"] for r in results] == [16, 16], results
    assert all(r["exact"] for r in results), results
