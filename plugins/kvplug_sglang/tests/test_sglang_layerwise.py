"""KVPlugLayerwiseConnector: layer-by-layer loads, and TP ranks agreeing on the hit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from sglang_pools import clear_pool, fill_random, kvplug_extra, snapshot

from kvplug.testing import PortTaken, free_port, held_port, says_address_in_use, start_on_free_ports
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


@pytest.mark.parametrize("next_forward", ["layers_only", "starts_a_load", "cancel_first"])
def test_an_aborted_forward_never_writes_its_load_into_slots_reused_since(
    model_config, pool_factory, next_forward: str
) -> None:
    """A forward aborted after layer 0 leaves its load half written; its slots are freed and
    given to another request, which computes its own KV there. The next forward's layer
    calls must not write the rest of the old load over it."""
    pool = pool_factory()
    connector = KVPlugLayerwiseConnector(model_config, 1, 0, pool.k_buffer, pool.v_buffer, engine_extra=kvplug_extra())
    tokens, src = list(range(10, 58)), torch.arange(1, 49)
    fill_random(pool, src, seed=3)
    connector.store_kv(StoreMetadata(None, tokens, src, 0))
    other_tokens = list(range(500, 548))
    fill_random(pool, src, seed=4)
    connector.store_kv(StoreMetadata(None, other_tokens, src, 0))
    other_kv = snapshot(pool, src)
    clear_pool(pool)
    reused = torch.arange(60, 108)
    assert connector.start_load_kv(LoadMetadata(tokens, reused, 0)) == 48
    connector.load_kv_layerwise(0)  # layers 0 and 1 written; then the forward raises
    fill_random(pool, reused, seed=99)  # the slots' new owner computed its KV into them
    owner_kv = snapshot(pool, reused)
    if next_forward == "cancel_first":
        connector.cancel_loads()
    elsewhere = torch.arange(120, 168)
    if next_forward == "starts_a_load":
        assert connector.start_load_kv(LoadMetadata(other_tokens, elsewhere, 0)) == 48
    for layer in range(pool.layer_num):
        connector.load_kv_layerwise(layer)
    for layer, (k, v) in enumerate(snapshot(pool, reused)):
        assert torch.equal(k, owner_kv[layer][0]) and torch.equal(v, owner_kv[layer][1]), f"layer {layer} overwritten"
    if next_forward == "starts_a_load":
        for layer, (k, v) in enumerate(snapshot(pool, elsewhere)):
            assert torch.equal(k, other_kv[layer][0]) and torch.equal(v, other_kv[layer][1])
    connector.close()


def test_two_tp_ranks_load_the_minimum(tmp_path: Path) -> None:
    from sglang_layerwise_worker import run_rank

    def spawn(port: int) -> None:
        try:
            mp.spawn(run_rank, args=(port, str(tmp_path), [3, 1]), nprocs=2, join=True)
        except mp.ProcessRaisedException as exc:  # rank 0's store could not bind: another process took the port
            if says_address_in_use(str(exc)):
                raise PortTaken(str(exc)) from exc
            raise

    # Also the test of a port taken between its choosing and rank 0's bind (no run of its own: the
    # ranks fail at their first step): the first port chosen is held (the race cannot be caused on demand).
    with held_port() as held:
        ports = [held]
        start_on_free_ports(lambda: spawn(ports[-1]), lambda: ports.append(free_port()))
    assert len(ports) == 2
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["loaded"] for r in results] == [16, 16], results
    assert all(r["exact"] for r in results), results
