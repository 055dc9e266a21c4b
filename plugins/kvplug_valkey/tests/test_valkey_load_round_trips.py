"""What a lookup and the load after it cost on a real valkey-server: the server's own
command counters (``INFO commandstats``) say which commands reached it.

A load asks each tier one batched ``get`` and no ``contains`` (the lookup asked that); a
key the lookup saw but that is gone by the load ends the prefix there: a clean miss,
the chunks before it exact, nothing after it written.
"""

from __future__ import annotations

from typing import Any

import torch
import valkey
from test_valkey_engine import NUM_BLOCKS, caches, engine_for
from valkey_helpers import fresh_prefix

from kvplug import CacheEngine
from kvplug.testing import TierRoundTripContract

gathered = TierRoundTripContract.gathered

TOKENS = list(range(2000, 2040))  # 5 chunks of 8


def command_calls(port: int) -> dict[str, int]:
    """Calls of each command the server answered since the last reset of its statistics."""
    stats: dict[str, Any] = valkey.Valkey(host="127.0.0.1", port=port).info("commandstats")
    return {name.removeprefix("cmdstat_"): int(entry["calls"]) for name, entry in stats.items()}


def reset_calls(port: int) -> None:
    valkey.Valkey(host="127.0.0.1", port=port).config_resetstat()


def stored_by_another_engine(settings: dict[str, Any]) -> tuple[list, torch.Tensor]:
    source, slots = caches(11), torch.randperm(NUM_BLOCKS * 4)[:40]
    writer = engine_for(settings, lookup_budget_s=30.0)
    try:
        assert writer.store(TOKENS, source, slots) == 40
        writer.flush()
    finally:
        writer.close()
    return source, slots


def reader(settings: dict[str, Any]) -> CacheEngine:
    """A fresh engine (its cpu tier empty) on the same server and prefix: every hit is remote."""
    return engine_for(settings, lookup_budget_s=30.0)


def test_a_remote_hit_asks_contains_once_and_get_once(valkey_server) -> None:
    settings = {"url": valkey_server.url, "key_prefix": fresh_prefix(), "request_timeout_s": 5.0}
    source, src_slots = stored_by_another_engine(settings)
    engine = reader(settings)
    try:
        reset_calls(valkey_server.port)
        assert [loc.medium for loc in engine.locate(TOKENS)] == ["remote"] * 5
        looked = command_calls(valkey_server.port)
        target, dst_slots = caches(12), torch.randperm(NUM_BLOCKS * 4)[:40]
        assert bool(engine.retrieve(TOKENS, target, dst_slots).all())
        assert torch.equal(gathered(engine, source, src_slots), gathered(engine, target, dst_slots))
        loaded = command_calls(valkey_server.port)
    finally:
        engine.close()
    # The tier's contains is a STRLEN per record (it checks the size too): one per chunk, at the lookup.
    assert looked.get("strlen", 0) == 5 and looked.get("getrange", 0) == looked.get("get", 0) == 0
    assert loaded.get("strlen", 0) == 5  # the load asked no contains of its own
    # A read is a GETRANGE bounded by the engine's largest record, one per chunk.
    assert loaded.get("getrange", 0) == 5 and loaded.get("get", 0) == 0


def test_a_chunk_gone_between_lookup_and_load_ends_the_prefix_cleanly(valkey_server) -> None:
    settings = {"url": valkey_server.url, "key_prefix": fresh_prefix(), "request_timeout_s": 5.0}
    source, src_slots = stored_by_another_engine(settings)
    engine = reader(settings)
    try:
        assert sum(loc.tokens for loc in engine.locate(TOKENS)) == 40
        gone = [k.key for k in engine.chunk_keys(TOKENS)][2]
        valkey_tier = engine.chain.tiers[1]
        valkey_tier.remove([gone])  # evicted by someone else after the lookup
        target, dst_slots = caches(13), torch.randperm(NUM_BLOCKS * 4)[:40]
        before = target[0].clone()
        loaded = engine.retrieve(TOKENS, target, dst_slots)
        assert loaded[:16].all() and not loaded[16:].any()  # chunks 0 and 1, nothing after the gap
        expected = gathered(engine, source, src_slots[:16])
        assert torch.equal(expected, gathered(engine, target, dst_slots[:16]))
        untouched = dst_slots[16:]
        flat_after, flat_before = target[0].flatten(1, 2), before.flatten(1, 2)  # [kv, slot, head, dim]
        assert torch.equal(flat_after[:, untouched], flat_before[:, untouched])
        assert engine.lookup(TOKENS) == 16  # and the next lookup says so
    finally:
        engine.close()
