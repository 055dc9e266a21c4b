"""KVPlugConnector on a real MHATokenToKVPool: store, clear, load into other slots."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored
from sglang_pools import NUM_LAYERS, clear_pool, fill_random, kvplug_extra, snapshot

from kvplug.errors import LayoutError
from kvplug_sglang.connector import KVPlugConnector, LoadMetadata, StoreMetadata


def _connector(model_config, pool, extra) -> KVPlugConnector:
    return KVPlugConnector(model_config, 1, 0, pool.k_buffer, pool.v_buffer, engine_extra=extra)


def _assert_same(pool, slots: torch.Tensor, expected) -> None:
    for layer, (k, v) in enumerate(expected):
        assert torch.equal(pool.get_key_buffer(layer)[slots], k), f"K of layer {layer} differs"
        assert torch.equal(pool.get_value_buffer(layer)[slots], v), f"V of layer {layer} differs"


def test_store_clear_load_bit_exact_into_other_slots(model_config, pool_factory) -> None:
    pool = pool_factory()
    connector = _connector(model_config, pool, kvplug_extra())
    tokens = list(range(300, 364))  # 4 chunks of 16
    src = torch.randperm(200)[:64] + 1
    fill_random(pool, src)
    expected = snapshot(pool, src)
    connector.store_kv(StoreMetadata(last_node=None, token_ids=tokens, kv_indices=src, offset=0))
    clear_pool(pool)
    dst = torch.arange(300, 364)
    assert connector.load_kv(LoadMetadata(token_ids=tokens, slot_mapping=dst, offset=0)) == 64
    _assert_same(pool, dst, expected)
    # offset: the first 16 tokens are on device, only the rest is loaded and counted
    clear_pool(pool)
    loaded = connector.load_kv(LoadMetadata(token_ids=tokens, slot_mapping=dst[16:], offset=16))
    assert loaded == 48
    _assert_same(pool, dst[16:], [(k[16:], v[16:]) for k, v in expected])
    assert not pool.get_key_buffer(0)[dst[:16]].any(), "tokens before offset must not be written"
    connector.close()


def test_shared_prefix_loads_chunk_aligned_prefix(model_config, pool_factory) -> None:
    pool = pool_factory()
    connector = _connector(model_config, pool, kvplug_extra())
    tokens = list(range(1000, 1040))  # 2 full chunks + 8 (the partial chunk is not stored)
    src = torch.arange(1, 41)
    fill_random(pool, src, seed=1)
    expected = snapshot(pool, src)
    connector.store_kv(StoreMetadata(None, tokens, src, 0))
    other = tokens[:20] + [7] * 30  # shares 20 tokens: one whole chunk
    assert connector.lookup(other) == 16
    clear_pool(pool)
    dst = torch.arange(100, 150)
    assert connector.load_kv(LoadMetadata(other, dst, 0)) == 16
    _assert_same(pool, dst[:16], [(k[:16], v[:16]) for k, v in expected])
    assert not pool.get_key_buffer(0)[dst[16:]].any()
    # a different salt shares nothing
    assert connector.load_kv(LoadMetadata(tokens, torch.arange(100, 140), 0, cache_salt="tenant-b")) == 0
    connector.close()


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_corrupt_chunk_gives_shorter_load_never_wrong_data(
    model_config, pool_factory, tmp_path: Path, tier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = pool_factory()
    if tier == "cpu":
        from kvplug_cpu import CPUTier

        # The cpu tier's own frames are not re-verified (trusted_reads: this process's
        # bytes); as an in-memory tier another process could write, its frames are.
        monkeypatch.setattr(CPUTier, "trusted_reads", False)
        tiers = [{"type": "cpu"}]
    else:
        pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
        tiers = [{"type": "disk", "path": str(tmp_path / "kv"), "queue": {"mode": "sync"}}]
    connector = _connector(model_config, pool, kvplug_extra(tiers))
    tokens = list(range(500, 548))  # 3 chunks
    src = torch.arange(1, 49)
    fill_random(pool, src, seed=2)
    expected = snapshot(pool, src)
    connector.store_kv(StoreMetadata(None, tokens, src, 0))
    connector.flush()
    third = connector.engine.chunk_keys(tokens)[1].key
    if tier == "cpu":
        cpu = connector.engine.chain.tiers[0]
        frame = bytearray(cpu.get([third])[0])
        frame[-5] ^= 0xFF  # one flipped bit in the payload of the 2nd chunk
        cpu.put([(third, bytes(frame))])
    else:
        files = sorted(p for p in (tmp_path / "kv").rglob("*") if p.is_file() and p.stat().st_size > 1000)
        assert len(files) == 3, files
        victim = next(f for f in files if _holds_key(connector, f, third))
        data = bytearray(victim.read_bytes())
        data[-7] ^= 0x01
        victim.write_bytes(bytes(data))
    clear_pool(pool)
    dst = torch.arange(200, 248)
    assert connector.load_kv(LoadMetadata(tokens, dst, 0)) == 16
    _assert_same(pool, dst[:16], [(k[:16], v[:16]) for k, v in expected])
    assert not pool.get_key_buffer(0)[dst[16:]].any(), "nothing of a corrupt chunk may be written"
    connector.close()


def _holds_key(connector: KVPlugConnector, path: Path, key: str) -> bool:
    import hashlib

    return hashlib.sha256(key.encode()).digest() == path.read_bytes()[16:48]


def test_kv_events_in_sglang_shape(model_config, pool_factory) -> None:
    pool = pool_factory()
    connector = _connector(model_config, pool, kvplug_extra([{"type": "cpu", "max_bytes": 70_000}]))
    tokens = list(range(40, 72))
    fill_random(pool, torch.arange(1, 33))
    connector.store_kv(StoreMetadata(None, tokens, torch.arange(1, 33), 0))
    stored = connector.get_kv_events()
    assert [type(e) for e in stored] == [BlockStored, BlockStored]
    assert stored[0].token_ids == tokens[:16] and stored[1].token_ids == tokens[16:]
    assert stored[1].parent_block_hash == stored[0].block_hashes[0] and stored[0].parent_block_hash is None
    assert connector.get_kv_events() == []
    # a chunk is 4 layers * 2 * 16 tokens * 32 * 2 bytes = 8 KiB + header; 70 kB holds 8: overflow evicts
    for start in range(2000, 2000 + 16 * 8, 16):
        connector.store_kv(StoreMetadata(None, list(range(start, start + 16)), torch.arange(1, 17), 0))
    removed = [e for e in connector.get_kv_events() if isinstance(e, BlockRemoved)]
    assert removed and stored[0].block_hashes[0] in [h for e in removed for h in e.block_hashes]
    connector.close()


def _published(events: list, kind: type, medium: str) -> list[int]:
    return [h for e in events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]


def test_kv_events_name_each_medium_once_it_holds_the_chunk(model_config, pool_factory, tmp_path: Path) -> None:
    """An async disk tier that declines a chunk stored once is not announced; a load (its second
    sighting) writes it there and announces it then."""
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    pool = pool_factory()
    disk = {
        "type": "disk",
        "path": str(tmp_path / "disk"),
        "queue": {"mode": "async"},
        "admission": {"type": "frequency", "min_hits": 2},
    }
    connector = _connector(model_config, pool, kvplug_extra([{"type": "cpu", "max_bytes": 70_000}, disk]))
    tokens = list(range(40, 72))
    fill_random(pool, torch.arange(1, 33))
    connector.store_kv(StoreMetadata(None, tokens, torch.arange(1, 33), 0))
    connector.flush()
    events = connector.get_kv_events()
    ours = _published(events, BlockStored, "CPU_PINNED")
    assert len(ours) == 2 and _published(events, BlockStored, "DISK") == []
    assert connector.load_kv(LoadMetadata(tokens, torch.arange(100, 132), 0)) == 32
    connector.flush()
    assert _published(connector.get_kv_events(), BlockStored, "DISK") == ours  # the write landed
    connector.close()


def test_a_chunk_evicted_and_stored_again_is_announced_again(model_config, pool_factory) -> None:
    pool = pool_factory()
    connector = _connector(model_config, pool, kvplug_extra([{"type": "cpu", "max_bytes": 70_000}]))
    tokens = list(range(40, 72))
    fill_random(pool, torch.arange(1, 33))
    connector.store_kv(StoreMetadata(None, tokens, torch.arange(1, 33), 0))
    ours = _published(connector.get_kv_events(), BlockStored, "CPU_PINNED")
    assert len(ours) == 2
    # 8 other chunks overflow the cpu tier (room for 8): the first prompt's leave it
    for start in range(2000, 2000 + 16 * 8, 16):
        connector.store_kv(StoreMetadata(None, list(range(start, start + 16)), torch.arange(1, 17), 0))
    assert set(ours) <= set(_published(connector.get_kv_events(), BlockRemoved, "CPU_PINNED"))
    connector.store_kv(StoreMetadata(None, tokens, torch.arange(1, 33), 0))
    assert _published(connector.get_kv_events(), BlockStored, "CPU_PINNED") == ours  # held again: said again
    connector.close()


def test_fingerprint_separates_tp_rank_and_page_size(model_config, pool_factory) -> None:
    pool = pool_factory(heads=1)  # the model's 2 KV heads split over 2 ranks
    a = KVPlugConnector(model_config, 2, 0, pool.k_buffer, pool.v_buffer, engine_extra=kvplug_extra())
    b = KVPlugConnector(model_config, 2, 1, pool.k_buffer, pool.v_buffer, engine_extra=kvplug_extra())
    c = KVPlugConnector(model_config, 2, 0, pool.k_buffer, pool.v_buffer, page_size=4, engine_extra=kvplug_extra())
    prints = {x.engine.chunk_keys(list(range(16)))[0].key.split("/")[1] for x in (a, b, c)}
    assert len(prints) == 3
    for x in (a, b, c):
        x.close()


def test_bad_arguments_are_named(model_config, pool_factory) -> None:
    pool = pool_factory()
    connector = _connector(model_config, pool, kvplug_extra())
    with pytest.raises(LayoutError, match="slot_mapping has 3 slots"):
        connector.load_kv(LoadMetadata(list(range(10)), torch.arange(3), 2))
    with pytest.raises(LayoutError, match="kv_indices has 4 slots for 5 token ids"):
        connector.store_kv(StoreMetadata(None, list(range(5)), torch.arange(4), 0))
    with pytest.raises(LayoutError, match="offset must be in"):
        connector.load_kv(LoadMetadata(list(range(4)), torch.arange(0), 9))
    with pytest.raises(LayoutError, match=f"the model {NUM_LAYERS}"):
        KVPlugConnector(model_config, 1, 0, pool.k_buffer[:2] + pool.k_buffer, pool.v_buffer[:2] + pool.v_buffer)
    with pytest.raises(ValueError, match="multiple of SGLang's page size"):
        KVPlugConnector(model_config, 1, 0, pool.k_buffer, pool.v_buffer, page_size=5, engine_extra=kvplug_extra())
    connector.close()


def test_reset_removes_as_clear_does_never_another_engines_records(model_config, pool_factory, tmp_path: Path) -> None:
    """reset removes what this connector stored from every tier it wrote, and what it only
    loaded from its private cpu tier alone: another engine's records in the shared disk stay."""
    tiers = [{"type": "cpu"}, {"type": "disk", "path": str(tmp_path / "shared")}]
    pool = pool_factory()
    ours, theirs = list(range(500, 532)), list(range(900, 932))  # 2 chunks of 16 each
    fill_random(pool, torch.arange(1, 33), seed=3)
    other = _connector(model_config, pool, kvplug_extra(tiers))
    other.store_kv(StoreMetadata(None, theirs, torch.arange(1, 33), 0))
    other.flush()
    connector = _connector(model_config, pool, kvplug_extra(tiers))
    connector.store_kv(StoreMetadata(None, ours, torch.arange(1, 33), 0))
    assert connector.load_kv(LoadMetadata(theirs, torch.arange(100, 132), 0)) == 32  # promoted into our cpu
    connector.flush()
    cpu, disk = connector.engine.chain.tiers
    keys_of = {
        name: [k.key for k in connector.engine.chunk_keys(t)] for name, t in (("ours", ours), ("theirs", theirs))
    }
    assert all(cpu.contains(keys_of["theirs"]))

    connector.reset()
    assert not any(cpu.contains(keys_of["ours"] + keys_of["theirs"]))  # our private tier: all of it
    assert not any(disk.contains(keys_of["ours"]))
    assert all(disk.contains(keys_of["theirs"]))  # shared: only what our writes put there
    assert other.lookup(theirs) == 32
    removed = [e for e in connector.get_kv_events() if isinstance(e, BlockRemoved)]
    assert removed  # vLLM-style events: the removal of our stored chunks is published
    connector.close()
    other.close()


def test_pipeline_stages_of_as_many_layers_never_share_kv(model_config, pool_factory, tmp_path: Path) -> None:
    """Two pipeline stages' pools have one shape (half the layers each); stage 1 must not load
    the KV stage 0 stored for the same prompt (another slice of the model's layers)."""
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    from kvplug import load_config
    from kvplug_sglang.setup_engine import build_cache_engine

    tiers = [{"type": "disk", "path": str(tmp_path / "disk")}]
    config = load_config(
        engine_extra={"kvplug": {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}}
    ).config
    stages = []
    for first_layer in (0, NUM_LAYERS // 2):
        pool = pool_factory(size=64, layers=NUM_LAYERS // 2)
        stages.append((pool, build_cache_engine(model_config=model_config, k_pool=pool.k_buffer, v_pool=pool.v_buffer, config=config, first_layer=first_layer)))  # fmt: skip
    (pool0, stage0), (_, stage1) = stages
    tokens, slots = list(range(16)), torch.arange(16)
    fill_random(pool0, slots)
    stage0.store(tokens, list(zip(pool0.k_buffer, pool0.v_buffer)), slots)
    stage0.flush()
    assert stage0.lookup(tokens) == 16 and stage1.lookup(tokens) == 0
    whole = build_cache_engine(model_config=model_config, k_pool=pool0.k_buffer * 2, v_pool=pool0.v_buffer * 2, config=config)  # fmt: skip
    assert whole.fingerprint.engine_variant == ""  # a pool of every layer keys as before
    for _, engine in stages:
        engine.close()
    whole.close()


@pytest.mark.parametrize("where", ["engine", "env", "file"])
def test_on_full_block_set_by_the_operator_is_named_in_a_warning(
    model_config,
    pool_factory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    where: str,
) -> None:
    """SGLang's store queue never blocks (its scheduler thread stores): an ``on_full: block``
    the operator set is overridden, and said so, naming the setting and where it was set;
    the default (also ``block``) and ``drop`` are not."""
    pool = pool_factory()
    monkeypatch.delenv("KVPLUG_CONFIG", raising=False)
    extra = kvplug_extra()
    if where == "engine":
        extra["kvplug"]["store"]["queue"]["on_full"] = "block"
        named = "the engine's extra config"
    elif where == "env":
        monkeypatch.setenv("KVPLUG_STORE__QUEUE__ON_FULL", "block")
        named = "env KVPLUG_STORE__QUEUE__ON_FULL"
    else:
        (tmp_path / "kvplug.yaml").write_text("store: {queue: {on_full: block, block_timeout_s: 5}}\n")
        extra["kvplug"]["config"] = str(tmp_path / "kvplug.yaml")
        named = f"file {tmp_path / 'kvplug.yaml'}"
    with caplog.at_level(logging.WARNING, logger="kvplug.sglang"):
        connector = _connector(model_config, pool, extra)
    warned = [r.getMessage() for r in caplog.records if "store.queue.on_full" in r.getMessage()]
    assert len(warned) == 1 and "store.queue.on_full: block" in warned[0] and named in warned[0], warned
    assert connector.engine.config.store.queue.on_full == "drop"
    connector.close()
    caplog.clear()
    monkeypatch.delenv("KVPLUG_STORE__QUEUE__ON_FULL", raising=False)
    for quiet in (kvplug_extra(), kvplug_extra(store={"queue": {"mode": "sync", "on_full": "drop"}})):
        with caplog.at_level(logging.WARNING, logger="kvplug.sglang"):
            connector = _connector(model_config, pool, quiet)
        assert not [r for r in caplog.records if "on_full" in r.getMessage()]
        assert connector.engine.config.store.queue.on_full == "drop"
        connector.close()


@pytest.mark.parametrize(
    ("pool_dtype", "theirs", "ours"),
    [
        # SGLang keeps an fp8 KV cache in uint8 pools, e4m3 and e5m2 alike: the pool's dtype
        # does not tell them apart, the server's --kv-cache-dtype and its scales file do.
        (torch.float8_e4m3fn, {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "fp8_e5m2"}),
        # the KV a float16 model computes is cast to other fp8 bytes than a bfloat16 one's
        (torch.float8_e4m3fn, {"kv_cache_dtype": "fp8_e4m3", "dtype": "float16"}, {"kv_cache_dtype": "fp8_e4m3"}),
        (torch.bfloat16, {}, {"quantization": "fp8"}),  # other weights, other KV
        (torch.bfloat16, {}, {"json_model_override_args": '{"rope_theta": 1000.0}'}),  # other rotated keys
    ],
    ids=["fp8-format", "fp8-model-dtype", "quantized", "overridden"],
)
def test_servers_that_compute_other_kv_never_share_chunks(
    model_config, pool_factory, tmp_path: Path, pool_dtype: torch.dtype, theirs: dict, ours: dict
) -> None:
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    from sglang.srt.runtime_context import get_context

    from kvplug import CacheEngine, load_config
    from kvplug_sglang.setup_engine import build_cache_engine

    tiers = [{"type": "disk", "path": str(tmp_path / "disk")}]
    config = load_config(
        engine_extra={"kvplug": {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}}
    ).config
    pool = pool_factory(size=64, dtype=pool_dtype)
    tokens, slots = list(range(16)), torch.arange(16)

    def engine_of(server_args: dict) -> CacheEngine:
        with get_context().override_server_args(model_path=str(model_config.model_path), **server_args):
            return build_cache_engine(model_config=model_config, k_pool=pool.k_buffer, v_pool=pool.v_buffer, config=config)  # fmt: skip

    writer, same, other = engine_of(theirs), engine_of(theirs), engine_of(ours)
    try:
        writer.store(tokens, list(zip(pool.k_buffer, pool.v_buffer)), slots)
        writer.flush()
        assert same.lookup(tokens) == 16  # a server run alike shares them
        assert other.lookup(tokens) == 0, f"a server run with {ours} would load the KV of one run with {theirs}"
    finally:
        for engine in (writer, same, other):
            engine.close()
